// AVX-512 (F, BW, VL, DQ) build of the Adam kernel (16 floats per vector). Compiled with -mavx512f/bw/vl/dq plus
// -mavx2 -mfma -mf16c; only called after cpu_isa.cpp has checked the CPU and the OS (ZMM state) support them.
// Tails use masked loads and stores, so no element past the end is touched.
#include <immintrin.h>

#include <cstdint>

#include "adam/adam_kernel.h"
#include "adam/adam_kernel_impl.h"

namespace zeroshard::adam_kernel::avx512 {
namespace {

struct Ops {
  using V = __m512;
  using Mask = __mmask16;
  struct Acc {
    __m512d lo, hi;
  };
  static constexpr int64_t kWidth = 16;
  static constexpr bool kMasked = true;

  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // Hides values from the optimiser (the bandwidth reference stores what it loaded).
  static void opaque(V& a, V& b, V& c, V& d) { __asm__ volatile("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d)); }

  static __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
  static __m256i narrow_bf16(V x) {
    // Round to nearest even: add 0x7FFF + lsb of the kept half; NaN -> 0x7FC0. Values fit 16 bits: truncating pack.
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, is_nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
  static __m256i narrow_fp16(V x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const BF16* p) { return widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load(const FP16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static void store(BF16* p, V x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_bf16(x)); }
  static void store(FP16* p, V x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow_fp16(x)); }

  static Mask mask(int64_t r) { return static_cast<Mask>((1u << r) - 1u); }
  static V load_masked(const float* p, Mask k) { return _mm512_maskz_loadu_ps(k, p); }
  static V load_masked(const BF16* p, Mask k) { return widen_bf16(_mm256_maskz_loadu_epi16(k, p)); }
  static V load_masked(const FP16* p, Mask k) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p)); }
  static void store_masked(float* p, V x, Mask k) { _mm512_mask_storeu_ps(p, k, x); }
  static void store_masked(BF16* p, V x, Mask k) { _mm256_mask_storeu_epi16(p, k, narrow_bf16(x)); }
  static void store_masked(FP16* p, V x, Mask k) { _mm256_mask_storeu_epi16(p, k, narrow_fp16(x)); }

  // int8 state (adam_kernel_quant.h): 16 codes as int32 lanes, table lookups, exact comparisons.
  using VI = __m512i;
  static V lookup(const float* table, const uint8_t* codes) {
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))), table,
                               4);
  }
  static VI lookup(const int32_t* table, const int32_t* idx) {
    return _mm512_i32gather_epi32(_mm512_loadu_si512(idx), table, 4);
  }
  static void store_i32(int32_t* p, VI x) { _mm512_storeu_si512(p, x); }
  // Bucket of n in QuantMap's lookup tables (see the scalar build): integer ops on the bits, no rounding.
  static VI lut_index(V n) {
    const __m512i u = _mm512_castps_si512(n);
    __m512i b = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), 16),
                                 _mm512_set1_epi32(kLutBase));
    b = _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()), _mm512_set1_epi32(kLutBuckets - 1));
    return _mm512_add_epi32(b, _mm512_and_si512(_mm512_srai_epi32(u, 31), _mm512_set1_epi32(kLutBuckets)));
  }
  // Code of n from its bucket's entry e (see the scalar build).
  static VI lut_code(V n, VI e) {
    const __m512i lo16 = _mm512_set1_epi32(0xFFFF);
    const __m512 t = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_andnot_si512(lo16, _mm512_castps_si512(n)), _mm512_and_si512(e, lo16)));
    const __mmask16 up =
        _mm512_cmp_ps_mask(n, t, _CMP_GE_OQ) & _mm512_test_epi32_mask(e, _mm512_set1_epi32(kLutHasThreshold));
    const __m512i c = _mm512_and_si512(_mm512_srli_epi32(e, 16), _mm512_set1_epi32(0xFF));
    return _mm512_mask_add_epi32(c, up, c, _mm512_set1_epi32(1));
  }
  static void store_u8(uint8_t* p, VI x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  // max |x[i]| over [0, n) (n a multiple of 16); NaN if any element is NaN (tracked apart, see the AVX2 build).
  static float block_absmax(const float* x, int64_t n) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
      const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
      nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, a);
    }
    if (nan != 0) return __builtin_nanf("");
    alignas(64) float t[16];
    _mm512_store_ps(t, m);
    float r = t[0];
    for (int k = 1; k < 16; ++k) r = t[k] > r ? t[k] : r;
    return r;
  }

  static Acc acc_zero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  // Squares in double: exact, and finite floats cannot overflow them (see the AVX2 build).
  static Acc acc_add_sq(Acc a, V g) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
    return {_mm512_fmadd_pd(lo, lo, a.lo), _mm512_fmadd_pd(hi, hi, a.hi)};
  }
  static double acc_sum(Acc a) {
    alignas(64) double t[8];
    _mm512_store_pd(t, _mm512_add_pd(a.lo, a.hi));
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
  }
};

}  // namespace

double run(const Args& args, int64_t begin, int64_t end, bool want_grad_sq) {
  return impl::run<Ops>(args, begin, end, want_grad_sq);
}

void traffic(const Args& args, int64_t begin, int64_t end) { impl::traffic<Ops>(args, begin, end); }

}  // namespace zeroshard::adam_kernel::avx512
