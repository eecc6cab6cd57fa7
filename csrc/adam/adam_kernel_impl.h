// The one implementation of the fused Adam step, shared by the scalar, AVX2 and AVX-512 builds. Each build includes
// this file after defining an `Ops` type (vector width, arithmetic, loads/stores with dtype conversion) in its own
// namespace. Everything here is a template over Ops, so every instantiation is distinct per ISA: no function compiled
// with one ISA's flags can be merged by the linker into another ISA's build. For the same reason the ISA files call
// compiler builtins, not inline std:: functions.
//
// Speed (the step is memory bound: 28 bytes per fp32 parameter against ~10 vector operations):
//  - every per-step constant is broadcast once per call into registers (Consts), and the pointers are copied into
//    __restrict locals, so the loop body does not reload them after each store (a float* store could alias them);
//  - the decay mode and the statistics are template parameters: no test in the loop for them. The gradient scale
//    is always applied (x * 1.0f == x) and the lerp formula is a loop-invariant run-time choice: as templates they
//    quadrupled the instantiations (compile time) for no measured speed at the memory wall;
//  - software prefetch runs Args::prefetch_elems ahead on every stream. The hardware streamers stop at each 4 KiB
//    page and ramp up again; on 2 Sapphire Rapids cores at the memory limit that restart cost about 10% of the step
//    (bench_cpu_adam.py). The distance is set per CPU on the host (adam_detail::prefetch_elems).
#pragma once

#include <cstdint>
#include <type_traits>

#include "adam/adam_kernel.h"
#include "adam/adam_kernel_quant.h"

namespace zeroshard::adam_kernel::impl {

// Marker for "no param_out".
struct NoOut {};

enum class Decay { kNone, kL2, kDecoupled };

template <class T>
inline void prefetch(const T* p, int64_t i) {
  __builtin_prefetch(p + i, 0, 3);
}
template <class T>
inline void prefetch_w(const T* p, int64_t i) {
  __builtin_prefetch(p + i, 1, 3);
}

// Per-call constants, broadcast once.
template <class Ops>
struct Consts {
  using V = typename Ops::V;
  V weight_decay, decay_mul, lerp_coeff, beta2, one_minus_beta2, inv_bc2_sqrt, eps, neg_step_size, unscale, clip;
  bool lerp_small;
  explicit Consts(const Factors& f)
      : weight_decay(Ops::set1(f.weight_decay)),
        decay_mul(Ops::set1(f.decay_mul)),
        lerp_coeff(Ops::set1(f.lerp_coeff)),
        beta2(Ops::set1(f.beta2)),
        one_minus_beta2(Ops::set1(f.one_minus_beta2)),
        inv_bc2_sqrt(Ops::set1(f.inv_bc2_sqrt)),
        eps(Ops::set1(f.eps)),
        neg_step_size(Ops::set1(f.neg_step_size)),
        unscale(Ops::set1(f.grad_unscale)),
        clip(Ops::set1(f.grad_clip)),
        lerp_small(f.lerp_small) {}
};

// The per-element update on one vector, always inlined: out of line, its vectors go through memory (GCC left it out
// of line once the kernel had fewer instantiations; 3x slower in cache). Operation order and rounding follow torch's
// single-tensor Adam/AdamW on CPU (see Factors in adam_kernel.h) except in the denominator, which multiplies by 1 /
// bc2_sqrt instead of dividing: one division and one square root per element are left, the step's costliest operations.
template <class Ops, Decay kDecay>
[[gnu::always_inline]] inline void update(const Consts<Ops>& c, typename Ops::V& p, typename Ops::V& m,
                                          typename Ops::V& v, typename Ops::V g) {
  using V = typename Ops::V;
  // Always applied: with no loss scale and no clipping both factors are 1.0f and x * 1.0f == x exactly, and two
  // multiplies per vector are free at the memory wall; a template flag for them doubled the kernels' compile time.
  g = Ops::mul(Ops::mul(g, c.unscale), c.clip);  // two roundings, as two in-place mul_ calls
  if constexpr (kDecay == Decay::kL2) g = Ops::fmadd(p, c.weight_decay, g);
  if constexpr (kDecay == Decay::kDecoupled) p = Ops::mul(p, c.decay_mul);
  const V diff = Ops::sub(g, m);
  m = Ops::fmadd(c.lerp_coeff, diff, c.lerp_small ? m : g);  // a run-time choice: both are exact
  v = Ops::fmadd(Ops::mul(c.one_minus_beta2, g), g, Ops::mul(v, c.beta2));
  const V denom = Ops::fmadd(Ops::sqrt(v), c.inv_bc2_sqrt, c.eps);
  p = Ops::add(p, Ops::div(Ops::mul(c.neg_step_size, m), denom));
}

// Raw pointers of one call, as __restrict locals. M: how the moments are loaded and stored (float or BF16; int8
// state is stepped on fp32 copies of one block, see run_int8).
template <class P, class G, class O, class M = float>
struct Ptrs {
  P* __restrict p;
  M* __restrict m;
  M* __restrict v;
  const G* __restrict g;
  O* __restrict out;
};

template <class Ops, class P, class G, class O, class M, bool kStats, Decay kDecay>
[[gnu::always_inline]] inline void step_vec(const Consts<Ops>& c, const Ptrs<P, G, O, M>& a, int64_t i,
                                            typename Ops::Acc& acc) {
  using V = typename Ops::V;
  V g = Ops::load(a.g + i);
  if constexpr (kStats) acc = Ops::acc_add_sq(acc, g);
  V p = Ops::load(a.p + i);
  V m = Ops::load(a.m + i);
  V v = Ops::load(a.v + i);
  update<Ops, kDecay>(c, p, m, v, g);
  Ops::store(a.p + i, p);
  Ops::store(a.m + i, m);
  Ops::store(a.v + i, v);
  if constexpr (!std::is_same_v<O, NoOut>) Ops::store(a.out + i, p);
}

// The last r (< width) elements starting at i.
template <class Ops, class P, class G, class O, class M, bool kStats, Decay kDecay>
inline void step_tail(const Consts<Ops>& c, const Ptrs<P, G, O, M>& a, int64_t i, int64_t r, typename Ops::Acc& acc) {
  using V = typename Ops::V;
  if constexpr (Ops::kMasked) {
    // Masked loads read zeros beyond r (g = 0 adds nothing to the statistics); masked stores write only r lanes.
    const auto k = Ops::mask(r);
    V g = Ops::load_masked(a.g + i, k);
    if constexpr (kStats) acc = Ops::acc_add_sq(acc, g);
    V p = Ops::load_masked(a.p + i, k);
    V m = Ops::load_masked(a.m + i, k);
    V v = Ops::load_masked(a.v + i, k);
    update<Ops, kDecay>(c, p, m, v, g);
    Ops::store_masked(a.p + i, p, k);
    Ops::store_masked(a.m + i, m, k);
    Ops::store_masked(a.v + i, v, k);
    if constexpr (!std::is_same_v<O, NoOut>) Ops::store_masked(a.out + i, p, k);
  } else {
    // Copy the tail into zero-padded stack buffers and run the same vector code on them, so the tail shares the
    // body's math (and its dtype conversions) exactly. Padding lanes may compute NaN (eps = 0); they are discarded.
    constexpr int64_t W = Ops::kWidth;
    using OB = std::conditional_t<std::is_same_v<O, NoOut>, float, O>;
    alignas(64) P pb[W] = {};
    alignas(64) M mb[W] = {}, vb[W] = {};
    alignas(64) G gb[W] = {};
    alignas(64) OB ob[W] = {};
    __builtin_memcpy(pb, a.p + i, r * sizeof(P));
    __builtin_memcpy(mb, a.m + i, r * sizeof(M));
    __builtin_memcpy(vb, a.v + i, r * sizeof(M));
    __builtin_memcpy(gb, a.g + i, r * sizeof(G));
    const Ptrs<P, G, O, M> b{pb, mb, vb, gb, reinterpret_cast<O*>(ob)};
    step_vec<Ops, P, G, O, M, kStats, kDecay>(c, b, 0, acc);
    if constexpr (!std::is_same_v<O, NoOut>) __builtin_memcpy(a.out + i, ob, r * sizeof(O));
    __builtin_memcpy(a.p + i, pb, r * sizeof(P));
    __builtin_memcpy(a.m + i, mb, r * sizeof(M));
    __builtin_memcpy(a.v + i, vb, r * sizeof(M));
  }
}

// The loop over [begin, end) of one set of pointers: whole vectors, then one tail.
template <class Ops, class P, class G, class O, class M, bool kStats, Decay kDecay>
inline void loop(const Consts<Ops>& c, const Ptrs<P, G, O, M>& a, int64_t begin, int64_t end, int64_t ahead,
                 typename Ops::Acc& acc) {
  constexpr int64_t W = Ops::kWidth;
  // Prefetch one cache line of each stream per 64 bytes of fp32 progress; lines past `end` are harmless hints.
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(float));
  static_assert(kLine % W == 0 || W % kLine == 0, "vector width and cache line must nest");
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    // one vector covers at least one line of fp32, or this vector starts one
    if (ahead > 0 && (W >= kLine || (i & (kLine - 1)) == 0)) {
      prefetch_w(a.p, i + ahead);
      prefetch_w(a.m, i + ahead);
      prefetch_w(a.v, i + ahead);
      prefetch(a.g, i + ahead);
    }
    step_vec<Ops, P, G, O, M, kStats, kDecay>(c, a, i, acc);
  }
  if (i < end) step_tail<Ops, P, G, O, M, kStats, kDecay>(c, a, i, end - i, acc);
}

// int8 state, one kQuantBlock block at a time: dequantise both moments into fp32 stack buffers (L1-resident), run
// the same loop as the fp32 path on them (so the update and the gradient statistics have the fp32 path's bits and
// order), then requantise (new absmax first, then the nearest code) and write codes and absmax back once.
template <class Ops, class P, class G, class O, bool kStats, Decay kDecay>
void run_int8(const Consts<Ops>& c, const Args& args, int64_t begin, int64_t end, typename Ops::Acc& acc) {
  alignas(64) float mb[kQuantBlock], vb[kQuantBlock];
  auto* const mq = static_cast<uint8_t*>(args.exp_avg);
  auto* const vq = static_cast<uint8_t*>(args.exp_avg_sq);
  P* const p = static_cast<P*>(args.param);
  const G* const g = static_cast<const G*>(args.grad);
  O* const out = static_cast<O*>(args.param_out);
  for (int64_t b = begin; b < end; b += kQuantBlock) {
    const int64_t len = end - b < kQuantBlock ? end - b : kQuantBlock;
    const int64_t blk = b / kQuantBlock;
    // The next block's codes are 2 KiB ahead on each stream: prefetch them while this block computes.
    for (int64_t k = 0; k < kQuantBlock && b + kQuantBlock + k < end; k += 64) {
      prefetch_w(mq, b + kQuantBlock + k);
      prefetch_w(vq, b + kQuantBlock + k);
    }
    dequant_block<Ops>(mq + b, len, args.exp_avg_map.values, args.exp_avg_absmax[blk], mb);
    dequant_block<Ops>(vq + b, len, args.exp_avg_sq_map.values, args.exp_avg_sq_absmax[blk], vb);
    O* const ob = [&] {
      if constexpr (std::is_same_v<O, NoOut>) {
        return out;
      } else {
        return out + b;
      }
    }();
    const Ptrs<P, G, O, float> a{p + b, mb, vb, g + b, ob};
    loop<Ops, P, G, O, float, kStats, kDecay>(c, a, 0, len, args.prefetch_elems, acc);
    args.exp_avg_absmax[blk] = quant_block<Ops>(mb, len, args.exp_avg_map, mq + b);
    args.exp_avg_sq_absmax[blk] = quant_block<Ops>(vb, len, args.exp_avg_sq_map, vq + b);
  }
}

// fp32 state: every combination of the flags is its own loop (the hot path, at the memory wall).
template <class Ops, class P, class G, class O, bool kStats, Decay kDecay>
double run_fp32(const Args& args, int64_t begin, int64_t end) {
  const Consts<Ops> c(args.f);
  auto acc = Ops::acc_zero();
  const Ptrs<P, G, O, float> a{static_cast<P*>(args.param), static_cast<float*>(args.exp_avg),
                               static_cast<float*>(args.exp_avg_sq), static_cast<const G*>(args.grad),
                               static_cast<O*>(args.param_out)};
  loop<Ops, P, G, O, float, kStats, kDecay>(c, a, begin, end, args.prefetch_elems, acc);
  return kStats ? Ops::acc_sum(acc) : 0.0;
}

// bf16 and int8 state: the statistics are always on (they cost one convert and two FMAs per vector against the
// format's conversions), so each format is instantiated half as often as fp32. The kernel files' compile time is
// what that saves (issue 21's 5 minutes).
template <class Ops, class P, class G, class O, Decay kDecay>
double run_lowp(const Args& args, int64_t begin, int64_t end) {
  const Consts<Ops> c(args.f);
  auto acc = Ops::acc_zero();
  if (args.state_type == StateType::kInt8) {
    run_int8<Ops, P, G, O, true, kDecay>(c, args, begin, end, acc);
  } else {
    const Ptrs<P, G, O, BF16> a{static_cast<P*>(args.param), static_cast<BF16*>(args.exp_avg),
                                static_cast<BF16*>(args.exp_avg_sq), static_cast<const G*>(args.grad),
                                static_cast<O*>(args.param_out)};
    loop<Ops, P, G, O, BF16, true, kDecay>(c, a, begin, end, args.prefetch_elems, acc);
  }
  return Ops::acc_sum(acc);
}

// The factors' decay mode as a template parameter: fn(std::integral_constant<...>), so each mode is its own loop.
template <class Fn>
double with_decay(const Factors& f, Fn&& fn) {
  if (f.l2_decay) return fn(std::integral_constant<Decay, Decay::kL2>{});
  if (f.decoupled_decay) return fn(std::integral_constant<Decay, Decay::kDecoupled>{});
  return fn(std::integral_constant<Decay, Decay::kNone>{});
}

template <class Ops, class P, class G, class O, bool kStats>
double run_mode(const Args& a, int64_t begin, int64_t end) {
  return with_decay(a.f,
                    [&](auto decay) { return run_fp32<Ops, P, G, O, kStats, decltype(decay)::value>(a, begin, end); });
}

template <class Ops, class P, class G, class O>
double run_lowp_mode(const Args& a, int64_t begin, int64_t end) {
  return with_decay(a.f, [&](auto decay) { return run_lowp<Ops, P, G, O, decltype(decay)::value>(a, begin, end); });
}

template <class Ops, class P, class G, class O>
double run_out(const Args& a, int64_t begin, int64_t end, bool want_grad_sq) {
  if (a.state_type != StateType::kFloat32) {
    const double sq = run_lowp_mode<Ops, P, G, O>(a, begin, end);
    return want_grad_sq ? sq : 0.0;
  }
  return want_grad_sq ? run_mode<Ops, P, G, O, true>(a, begin, end) : run_mode<Ops, P, G, O, false>(a, begin, end);
}

template <class Ops, class G>
double run_grad(const Args& a, int64_t begin, int64_t end, bool want_grad_sq) {
  // bf16 parameters are their own compute-dtype copy: no param_out (the host checks refuse one).
  if (a.param_type == ParamType::kBFloat16) return run_out<Ops, BF16, G, NoOut>(a, begin, end, want_grad_sq);
  switch (a.out_type) {
    case OutType::kFloat32:
      return run_out<Ops, float, G, float>(a, begin, end, want_grad_sq);
    case OutType::kBFloat16:
      return run_out<Ops, float, G, BF16>(a, begin, end, want_grad_sq);
    case OutType::kFloat16:
      return run_out<Ops, float, G, FP16>(a, begin, end, want_grad_sq);
    case OutType::kNone:
      break;
  }
  return run_out<Ops, float, G, NoOut>(a, begin, end, want_grad_sq);
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

// The bandwidth reference: exactly the step's fp32 memory traffic (read p, g, m, v; write p, m, v), the same loop,
// prefetch and chunking, and no arithmetic. Ops::opaque keeps the compiler from dropping a store of a loaded value.
template <class Ops>
void traffic(const Args& args, int64_t begin, int64_t end) {
  using V = typename Ops::V;
  constexpr int64_t W = Ops::kWidth;
  const int64_t ahead = args.prefetch_elems;
  constexpr int64_t kLine = 64 / static_cast<int64_t>(sizeof(float));
  float* __restrict p = static_cast<float*>(args.param);
  float* __restrict m = static_cast<float*>(args.exp_avg);
  float* __restrict v = static_cast<float*>(args.exp_avg_sq);
  const float* __restrict g = static_cast<const float*>(args.grad);
  int64_t i = begin;
  for (; i + W <= end; i += W) {
    if (ahead > 0 && (W >= kLine || (i & (kLine - 1)) == 0)) {
      prefetch_w(p, i + ahead);
      prefetch_w(m, i + ahead);
      prefetch_w(v, i + ahead);
      prefetch(g, i + ahead);
    }
    V vp = Ops::load(p + i), vg = Ops::load(g + i), vm = Ops::load(m + i), vv = Ops::load(v + i);
    Ops::opaque(vp, vg, vm, vv);
    Ops::store(p + i, vp);
    Ops::store(m + i, vm);
    Ops::store(v + i, vv);
  }
  for (; i < end; ++i) {  // no vector tail needed: nothing is computed
    float x = p[i] + 0.0f * g[i];
    p[i] = x;
    m[i] = m[i];
    v[i] = v[i];
  }
}

}  // namespace zeroshard::adam_kernel::impl
