// The one implementation of the fused Adam step, shared by the scalar, AVX2 and AVX-512 builds. Each build includes
// this file after defining an `Ops` type (vector width, arithmetic, loads/stores with dtype conversion) in its own
// namespace. Everything here is a template over Ops, so every instantiation is distinct per ISA: no function compiled
// with one ISA's flags can be merged by the linker into another ISA's build. For the same reason the ISA files call
// compiler builtins, not inline std:: functions.
#pragma once

#include <cstdint>
#include <type_traits>

#include "adam/adam_kernel.h"

namespace zeroshard::adam_kernel::impl {

// Marker for "no param_out".
struct NoOut {};

// The per-element update on one vector. Operation order and rounding follow torch's single-tensor Adam/AdamW on CPU
// (see Factors in adam_kernel.h), so results match torch.optim bit for bit where torch uses its vector kernels.
template <class Ops>
inline void update(const Factors& f, typename Ops::V& p, typename Ops::V& m, typename Ops::V& v, typename Ops::V g) {
  using V = typename Ops::V;
  if (f.l2_decay) g = Ops::fmadd(p, Ops::set1(f.weight_decay), g);
  if (f.decoupled_decay) p = Ops::mul(p, Ops::set1(f.decay_mul));
  const V diff = Ops::sub(g, m);
  m = Ops::fmadd(Ops::set1(f.lerp_coeff), diff, f.lerp_small ? m : g);
  v = Ops::fmadd(Ops::mul(Ops::set1(f.one_minus_beta2), g), g, Ops::mul(v, Ops::set1(f.beta2)));
  const V denom = Ops::add(Ops::div(Ops::sqrt(v), Ops::set1(f.bc2_sqrt)), Ops::set1(f.eps));
  p = Ops::add(p, Ops::div(Ops::mul(Ops::set1(f.neg_step_size), m), denom));
}

// One full vector at element i.
template <class Ops, class G, class O, bool kStats>
inline void step_vec(const Args& a, const G* grad, O* out, int64_t i, typename Ops::Acc& acc) {
  using V = typename Ops::V;
  V g = Ops::load(grad + i);
  if constexpr (kStats) acc = Ops::acc_add_sq(acc, g);
  V p = Ops::load(a.param + i);
  V m = Ops::load(a.exp_avg + i);
  V v = Ops::load(a.exp_avg_sq + i);
  update<Ops>(a.f, p, m, v, g);
  Ops::store(a.param + i, p);
  Ops::store(a.exp_avg + i, m);
  Ops::store(a.exp_avg_sq + i, v);
  if constexpr (!std::is_same_v<O, NoOut>) Ops::store(out + i, p);
}

// The last r (< width) elements starting at i.
template <class Ops, class G, class O, bool kStats>
inline void step_tail(const Args& a, const G* grad, O* out, int64_t i, int64_t r, typename Ops::Acc& acc) {
  using V = typename Ops::V;
  if constexpr (Ops::kMasked) {
    // Masked loads read zeros beyond r (g = 0 adds nothing to the statistics); masked stores write only r lanes.
    const auto k = Ops::mask(r);
    V g = Ops::load_masked(grad + i, k);
    if constexpr (kStats) acc = Ops::acc_add_sq(acc, g);
    V p = Ops::load_masked(a.param + i, k);
    V m = Ops::load_masked(a.exp_avg + i, k);
    V v = Ops::load_masked(a.exp_avg_sq + i, k);
    update<Ops>(a.f, p, m, v, g);
    Ops::store_masked(a.param + i, p, k);
    Ops::store_masked(a.exp_avg + i, m, k);
    Ops::store_masked(a.exp_avg_sq + i, v, k);
    if constexpr (!std::is_same_v<O, NoOut>) Ops::store_masked(out + i, p, k);
  } else {
    // Copy the tail into zero-padded stack buffers and run the same vector code on them, so the tail shares the
    // body's math (and its dtype conversions) exactly. Padding lanes may compute NaN (eps = 0); they are discarded.
    constexpr int64_t W = Ops::kWidth;
    alignas(64) float pb[W] = {}, mb[W] = {}, vb[W] = {};
    alignas(64) G gb[W] = {};
    alignas(64) std::conditional_t<std::is_same_v<O, NoOut>, float, O> ob[W] = {};
    __builtin_memcpy(pb, a.param + i, r * sizeof(float));
    __builtin_memcpy(mb, a.exp_avg + i, r * sizeof(float));
    __builtin_memcpy(vb, a.exp_avg_sq + i, r * sizeof(float));
    __builtin_memcpy(gb, grad + i, r * sizeof(G));
    Args b = a;
    b.param = pb;
    b.exp_avg = mb;
    b.exp_avg_sq = vb;
    if constexpr (std::is_same_v<O, NoOut>) {
      step_vec<Ops, G, O, kStats>(b, gb, static_cast<O*>(nullptr), 0, acc);
    } else {
      step_vec<Ops, G, O, kStats>(b, gb, ob, 0, acc);
      __builtin_memcpy(out + i, ob, r * sizeof(O));
    }
    __builtin_memcpy(a.param + i, pb, r * sizeof(float));
    __builtin_memcpy(a.exp_avg + i, mb, r * sizeof(float));
    __builtin_memcpy(a.exp_avg_sq + i, vb, r * sizeof(float));
  }
}

template <class Ops, class G, class O, bool kStats>
double run_typed(const Args& a, int64_t begin, int64_t end) {
  constexpr int64_t W = Ops::kWidth;
  const G* grad = static_cast<const G*>(a.grad);
  O* out = static_cast<O*>(a.param_out);
  auto acc = Ops::acc_zero();
  int64_t i = begin;
  for (; i + W <= end; i += W) step_vec<Ops, G, O, kStats>(a, grad, out, i, acc);
  if (i < end) step_tail<Ops, G, O, kStats>(a, grad, out, i, end - i, acc);
  return kStats ? Ops::acc_sum(acc) : 0.0;
}

template <class Ops, class G, class O>
double run_out(const Args& a, int64_t begin, int64_t end, bool want_grad_sq) {
  return want_grad_sq ? run_typed<Ops, G, O, true>(a, begin, end) : run_typed<Ops, G, O, false>(a, begin, end);
}

template <class Ops, class G>
double run_grad(const Args& a, int64_t begin, int64_t end, bool want_grad_sq) {
  switch (a.out_type) {
    case OutType::kFloat32:
      return run_out<Ops, G, float>(a, begin, end, want_grad_sq);
    case OutType::kBFloat16:
      return run_out<Ops, G, BF16>(a, begin, end, want_grad_sq);
    case OutType::kFloat16:
      return run_out<Ops, G, FP16>(a, begin, end, want_grad_sq);
    case OutType::kNone:
      break;
  }
  return run_out<Ops, G, NoOut>(a, begin, end, want_grad_sq);
}

template <class Ops>
double run(const Args& a, int64_t begin, int64_t end, bool want_grad_sq) {
  switch (a.grad_type) {
    case GradType::kBFloat16:
      return run_grad<Ops, BF16>(a, begin, end, want_grad_sq);
    case GradType::kFloat16:
      return run_grad<Ops, FP16>(a, begin, end, want_grad_sq);
    case GradType::kFloat32:
      break;
  }
  return run_grad<Ops, float>(a, begin, end, want_grad_sq);
}

}  // namespace zeroshard::adam_kernel::impl
