// Pieces of adam_step shared with AdamGroup (adam_group.cpp): argument checks, the host-side factors, the kernel for
// an ISA and the chunked threading. Internal to csrc/adam.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>

#include "adam/adam.h"
#include "adam/adam_kernel.h"
#include "adam/cpu_isa.h"

namespace zeroshard::adam_detail {

// dtype of a gradient / param_out tensor as the kernel sees it; throws c10::TypeError naming the dtype otherwise.
adam_kernel::GradType grad_type_of(const at::Tensor& grad);
// Throws c10::ValueError naming the first out-of-range hyperparameter.
void check_hyper(const AdamHyper& h);
// Per-step factors, computed in double and rounded to float as torch rounds its Python-float scalars.
adam_kernel::Factors make_factors(const AdamHyper& h);
adam_kernel::KernelFn kernel_for(CpuIsa isa);
// The dynamic 8-bit map of exp_avg (signed) or exp_avg_sq (unsigned), built once (adam_state_format.cpp).
adam_kernel::QuantMap quant_map(bool is_signed);
// Points a's state fields at the given format (m_absmax / v_absmax: the int8 scales, else unused).
void set_state(adam_kernel::Args& a, adam_kernel::StateType type, const at::Tensor* m_absmax,
               const at::Tensor* v_absmax);
// The state format of an n-element parameter's moments, told by their dtypes (adam_state_format.h), and the int8
// scales checked against it: dtype and numel only (callers check device, layout and aliasing). m_absmax / v_absmax
// may be null or undefined. what(key) names a state tensor ("exp_avg", "exp_avg_absmax", ...) in errors. Throws
// c10::TypeError for a dtype, c10::ValueError for a missing or extra scale or a wrong numel, each with the fix.
adam_kernel::StateType state_type_of(const at::Tensor& m, const at::Tensor& v, const at::Tensor* m_absmax,
                                     const at::Tensor* v_absmax, int64_t n,
                                     const std::function<std::string(const char*)>& what);
// Software prefetch distance of the kernel, in elements: $ZEROSHARD_ADAM_PREFETCH_BYTES / 4 if set (0 turns it off),
// else this CPU's default. Read once; throws c10::ValueError naming a bad value.
int64_t prefetch_elems();
// In-place writes through raw pointers bypass autograd's version counter: bump it like an in-place op would.
void bump_version(const at::Tensor& t);

// The threading of every step: fixed kAdamChunk-element chunks over at::parallel_for, so per-chunk partial sums (and
// their order) do not depend on the thread count. fn(chunk, begin, end) for each chunk of [0, n).
template <class F>
void for_each_chunk(int64_t n, const F& fn) {
  const int64_t chunks = (n + kAdamChunk - 1) / kAdamChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) fn(c, c * kAdamChunk, std::min(n, (c + 1) * kAdamChunk));
  });
}

}  // namespace zeroshard::adam_detail
