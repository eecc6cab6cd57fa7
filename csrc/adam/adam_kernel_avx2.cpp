// AVX2 + FMA + F16C build of the Adam kernel (8 floats per vector). Compiled with -mavx2 -mfma -mf16c; only called
// after cpu_isa.cpp has checked the CPU and the OS (YMM state) support all three. bf16 and fp16 are converted in
// registers, never through a scalar loop; the tail reuses this vector code on zero-padded copies (adam_kernel_impl.h).
#include <immintrin.h>

#include <cstdint>

#include "adam/adam_kernel.h"
#include "adam/adam_kernel_impl.h"

namespace zeroshard::adam_kernel::avx2 {
namespace {

struct Ops {
  using V = __m256;
  struct Acc {
    __m256d lo, hi;
  };
  static constexpr int64_t kWidth = 8;
  static constexpr bool kMasked = false;

  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  // Hides values from the optimiser (the bandwidth reference stores what it loaded).
  static void opaque(V& a, V& b, V& c, V& d) { __asm__ volatile("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d)); }

  static V load(const float* p) { return _mm256_loadu_ps(p); }
  // bf16 -> fp32: widen to 32 bits and shift into the top half.
  static V load(const BF16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static V load(const FP16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  // fp32 -> bf16 round to nearest even: add 0x7FFF + lsb of the kept half, keep the top 16 bits; NaN -> 0x7FC0.
  static void store(BF16* p, V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), is_nan);
    // Pack 8 x 32-bit (all <= 0xFFFF) to 8 x 16-bit; packus works per 128-bit lane, so gather qwords 0 and 2.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store(FP16* p, V x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }

  static Acc acc_zero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  // Squares in double: exact for any float, and a finite float can never overflow it, so inf/NaN in the sum means
  // inf/NaN in the gradient.
  static Acc acc_add_sq(Acc a, V g) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(g));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
    return {_mm256_fmadd_pd(lo, lo, a.lo), _mm256_fmadd_pd(hi, hi, a.hi)};
  }
  static double acc_sum(Acc a) {
    alignas(32) double t[4];
    _mm256_store_pd(t, _mm256_add_pd(a.lo, a.hi));
    return (t[0] + t[1]) + (t[2] + t[3]);
  }
};

}  // namespace

double run(const Args& args, int64_t begin, int64_t end, bool want_grad_sq) {
  return impl::run<Ops>(args, begin, end, want_grad_sq);
}

void traffic(const Args& args, int64_t begin, int64_t end) { impl::traffic<Ops>(args, begin, end); }

}  // namespace zeroshard::adam_kernel::avx2
