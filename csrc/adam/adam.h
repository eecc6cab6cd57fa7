// Fused Adam / AdamW step on CPU tensors: one pass over fp32 master weights, both moments and the gradient, with the
// gradient upcast (bf16/fp16) and the compute-dtype copy of the weights (param_out) folded into the same pass.
// Source: Kingma & Ba 2015 (Adam, Alg. 1); Loshchilov & Hutter 2019 (decoupled weight decay). Numerics follow
// torch.optim.Adam / AdamW (single-tensor CPU path) operation by operation.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string_view>

#include "adam/adam_state_format.h"
#include "adam/cpu_isa.h"

namespace zeroshard {

struct AdamHyper {
  int64_t step = 1;             // 1-based step count *after* this step's increment (torch's state["step"])
  double lr = 1e-3;             // >= 0
  double beta1 = 0.9;           // in [0, 1)
  double beta2 = 0.999;         // in [0, 1)
  double eps = 1e-8;            // >= 0
  double weight_decay = 0.0;    // >= 0
  bool adamw_mode = true;       // true: decoupled decay p *= 1 - lr*wd (AdamW); false: L2, g += wd*p (Adam)
  bool bias_correction = true;  // false: step_size = lr and no sqrt(1 - beta2^t) scaling
  // Gradient scale folded into the step: g = (g * grad_unscale) * grad_clip, each product rounded to fp32, as the
  // two in-place multiplies an fp16 loss-scale removal and a clip-by-norm do on an fp32 gradient. Each finite, >= 0,
  // used as its fp32 rounding; both 1 (the default) skip the multiplies.
  double grad_unscale = 1.0;
  double grad_clip = 1.0;
};

struct GradStats {
  double grad_sq_sum = 0.0;  // sum over elements of upcast(grad)^2, in double (fixed summation order)
  bool found_inf = false;    // some gradient element is inf or NaN
};

// Elements per work chunk. Chunks are the unit of threading and of the statistics' partial sums, so results never
// depend on the thread count. A multiple of 64 so chunk starts stay vector- and cache-line aligned.
constexpr int64_t kAdamChunk = 64 * 1024;
static_assert(kAdamChunk % kAdamQuantBlock == 0, "chunks must start on int8 state block boundaries");

// One Adam/AdamW step, in place on param, exp_avg and exp_avg_sq; writes param_out if given.
//   param, exp_avg, exp_avg_sq: CPU, dense, contiguous, same numel, not overlapping one another. param is fp32 and
//     the moments are in one state format, told by their dtype (adam_state_format.h): float32; bfloat16 (fp32
//     math, rounded to nearest even on store); or uint8 codes of block-wise int8 state, whose per-block fp32 absmax
//     come in scales (adam_quant_blocks(numel) each; given only for int8 state). param may
//     also be bf16 with no param_out (bf16 weights, no master: upcast on load, rounded to nearest even once per
//     step, fp32 moments; DeepSpeedCPUAdam's bf16 mode with fp32_optimizer_states).
//   grad: fp32, bf16 or fp16, CPU, dense, contiguous, same numel (any shape).
//   param_out: optional bf16, fp16 or fp32, same constraints; receives the updated param (bf16: round to nearest
//     even, NaN kept NaN; fp16: round to nearest even, overflow to inf).
//   isa: "scalar" | "avx2" | "avx512" to force a kernel build (else ZEROSHARD_CPU_ISA, else the best supported).
// Returns the gradient statistics if compute_grad_stats, else nullopt. Validates every argument before touching
// memory; throws c10::Error / ValueError / TypeError naming the bad argument and the fix. Threads: at::parallel_for
// over kAdamChunk-element chunks (at::get_num_threads() threads).
std::optional<GradStats> adam_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                                   const at::Tensor& exp_avg_sq, const AdamHyper& hyper,
                                   const std::optional<at::Tensor>& param_out = std::nullopt,
                                   bool compute_grad_stats = false, std::optional<std::string_view> isa = std::nullopt,
                                   const std::optional<AdamStateScales>& scales = std::nullopt);

// Bytes ahead of the current element the kernel prefetches on every stream (0: hardware prefetch only):
// $ZEROSHARD_ADAM_PREFETCH_BYTES if set, else the default for this CPU's vendor. Read once.
int64_t adam_prefetch_bytes();

// The bandwidth reference of adam_step: the same memory traffic for fp32 tensors (read param, grad, exp_avg,
// exp_avg_sq; write param, exp_avg, exp_avg_sq back unchanged), the same chunks, threads and loop, no arithmetic.
// What adam_step would take if its arithmetic were free; benchmarks compare the two in one run. Same argument rules
// as adam_step, all four tensors fp32; nothing changes in value.
void adam_traffic_reference(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                            const at::Tensor& exp_avg_sq, std::optional<std::string_view> isa = std::nullopt);

}  // namespace zeroshard
