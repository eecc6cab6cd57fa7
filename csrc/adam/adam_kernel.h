// Plain-C++ interface of the fused Adam/AdamW kernel. No torch header here: the three ISA builds of the kernel
// (adam_kernel_{scalar,avx2,avx512}.cpp) include this file, and any inline torch function they pulled in could be
// emitted with AVX-512 instructions and picked by the linker for code that runs on older CPUs.
#pragma once

#include <cstdint>

namespace zeroshard::adam_kernel {

// 16-bit storage types, distinct so overloads pick the right conversion.
struct BF16 {
  uint16_t bits;
};
struct FP16 {
  uint16_t bits;
};

enum class ParamType : uint8_t { kFloat32, kBFloat16 };
enum class GradType : uint8_t { kFloat32, kBFloat16, kFloat16 };
enum class OutType : uint8_t { kNone, kFloat32, kBFloat16, kFloat16 };
// How the moments are stored (adam_state_format.h): fp32; bf16 (round to nearest even on store); or block-wise
// dynamic 8-bit codes (uint8 indices into a 256-entry map) with one fp32 absmax per kQuantBlock elements.
enum class StateType : uint8_t { kFloat32, kBFloat16, kInt8 };

// Elements per quantisation block (Dettmers et al. 2022, block-wise quantization). kAdamChunk is a multiple of it,
// so every chunk starts on a block boundary and blocks never straddle threads.
constexpr int64_t kQuantBlock = 2048;

// Nearest-code lookup of a normalised value n in [-1, 1]: bucket = its sign and the top 15 bits of |n| (exponent
// and 7 mantissa bits), |n| < 2^-24 in bucket 0 and |n| >= 1 in the last one, so kLutBuckets buckets per sign.
constexpr int32_t kLutBase = 0x3380;                    // (bits of 2^-24) >> 16
constexpr int32_t kLutBuckets = 0x3F80 - kLutBase + 1;  // up to (bits of 1.0) >> 16

// One dynamic 8-bit map: values[256] ascending, and thresholds[k] (k = 1..255) the smallest float >= the exact
// midpoint of values[k-1] and values[k], so `x >= thresholds[k]` is an exact nearest-code decision in fp32.
// lut (2 * kLutBuckets entries, negative n from kLutBuckets on): each bucket holds at most one threshold (checked
// when built), so code(n) = c + (n >= t) with c the code of the bucket's lowest value and t its threshold: the same
// comparison against the same threshold as a search over all 255. One 32-bit entry per bucket, so one table lookup:
// bits 0-15 the low half of t (its high half is n's own: t lies in n's bucket), bits 16-23 c, bit 24 set if the
// bucket holds a threshold.
struct QuantMap {
  const float* values = nullptr;
  const float* thresholds = nullptr;
  const int32_t* lut = nullptr;
};
constexpr int32_t kLutHasThreshold = 1 << 24;

// Per-step factors, computed in double on the host and rounded to float exactly as torch rounds its Python-float
// scalars (see adam.cpp). The kernel does, per element, in this order (fma = one rounding, like torch's vector code):
//   g = upcast(grad)                                   stats: sum += double(g)^2 (of the gradient as stored)
//   always:         g = (g * grad_unscale) * grad_clip (fp16 loss-scale removal, then the clip coefficient: the same
//                                                       two roundings as two in-place mul_ calls; 1.0f when unused)
//   L2 (Adam):      g = fma(p, weight_decay, g)
//   decoupled:      p = p * decay_mul                  (decay_mul = 1 - lr*wd)
//   m = lerp_small ? fma(lerp_coeff, g - m, m) : fma(lerp_coeff, g - m, g)   (torch's lerp, weight = 1 - beta1)
//   v = fma(one_minus_beta2 * g, g, v * beta2)                              (torch's mul_ + addcmul_)
//   p = p + (neg_step_size * m) / fma(sqrt(v), inv_bc2_sqrt, eps)   (torch's addcdiv_; torch divides sqrt(v) by
//                                                                   bc2_sqrt: one division less here, 1 ulp apart)
//   param_out = convert(p)
// With bf16 parameters (no fp32 master) p is upcast on load and rounded to nearest even once, on the store.
struct Factors {
  bool l2_decay = false;         // Adam mode with weight_decay != 0
  bool decoupled_decay = false;  // AdamW mode with weight_decay != 0
  float weight_decay = 0.f;
  float decay_mul = 1.f;
  bool lerp_small = true;  // torch's lerp switches formula at |weight| < 0.5
  float lerp_coeff = 0.f;  // weight if lerp_small, else weight - 1
  float beta2 = 0.f;
  float one_minus_beta2 = 0.f;
  float inv_bc2_sqrt = 1.f;  // 1 / sqrt(1 - beta2^t), rounded once from double
  float eps = 0.f;
  float neg_step_size = 0.f;
  float grad_unscale = 1.f;
  float grad_clip = 1.f;
};

struct Args {
  void* param = nullptr;  // param_type elements, updated in place: fp32 master weights, or bf16 weights (no master)
  ParamType param_type = ParamType::kFloat32;
  void* exp_avg = nullptr;     // state_type elements (kInt8: uint8 codes), updated in place
  void* exp_avg_sq = nullptr;  // state_type elements (kInt8: uint8 codes), updated in place
  StateType state_type = StateType::kFloat32;
  // kInt8 only: one fp32 absmax per kQuantBlock elements, indexed by absolute element / kQuantBlock; the maps of
  // exp_avg (signed) and exp_avg_sq (unsigned). Callers pass ranges whose begin is a multiple of kQuantBlock.
  float* exp_avg_absmax = nullptr;
  float* exp_avg_sq_absmax = nullptr;
  QuantMap exp_avg_map, exp_avg_sq_map;
  const void* grad = nullptr;  // grad_type elements, read only
  GradType grad_type = GradType::kFloat32;
  void* param_out = nullptr;  // out_type elements, written; null when out_type is kNone
  OutType out_type = OutType::kNone;
  // Software prefetch distance, in elements ahead of the current one, on every stream (0: hardware prefetch only).
  int64_t prefetch_elems = 256;
  Factors f;
};

// Steps elements [begin, end) of the arrays in args. Returns the sum of squares of the upcast gradient over that
// range (in double, a fixed order for a given ISA and range) when want_grad_sq, else 0.
using KernelFn = double (*)(const Args& args, int64_t begin, int64_t end, bool want_grad_sq);

// The bandwidth reference: the step's fp32 memory traffic over [begin, end) (read param, grad (fp32), exp_avg,
// exp_avg_sq; write param, exp_avg, exp_avg_sq with the values read) with the same loop and no arithmetic.
using TrafficFn = void (*)(const Args& args, int64_t begin, int64_t end);

namespace scalar {
double run(const Args& args, int64_t begin, int64_t end, bool want_grad_sq);
void traffic(const Args& args, int64_t begin, int64_t end);
}  // namespace scalar
namespace avx2 {
double run(const Args& args, int64_t begin, int64_t end, bool want_grad_sq);
void traffic(const Args& args, int64_t begin, int64_t end);
}  // namespace avx2
namespace avx512 {
double run(const Args& args, int64_t begin, int64_t end, bool want_grad_sq);
void traffic(const Args& args, int64_t begin, int64_t end);
}  // namespace avx512

}  // namespace zeroshard::adam_kernel
