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

  // int8 state (adam_kernel_quant.h): 8 codes as int32 lanes, table lookups, exact comparisons.
  using VI = __m256i;
  // Table lookups as 8 scalar loads into one vector: on Zen 3 vgatherdps / vpgatherdd took twice as long per
  // vector (measured: a 2048-code dequantisation at 0.52 ns per element by gather, 0.26 by loads).
  static V lookup(const float* table, const uint8_t* codes) {
    uint64_t w;
    __builtin_memcpy(&w, codes, sizeof(w));
    return _mm256_setr_ps(table[w & 255], table[(w >> 8) & 255], table[(w >> 16) & 255], table[(w >> 24) & 255],
                          table[(w >> 32) & 255], table[(w >> 40) & 255], table[(w >> 48) & 255], table[w >> 56]);
  }
  static VI lookup(const int32_t* table, const int32_t* idx) {
    return _mm256_setr_epi32(table[idx[0]], table[idx[1]], table[idx[2]], table[idx[3]], table[idx[4]], table[idx[5]],
                             table[idx[6]], table[idx[7]]);
  }
  static void store_i32(int32_t* p, VI x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  // Bucket of n in QuantMap's lookup tables (see the scalar build): integer ops on the bits, no rounding.
  static VI lut_index(V n) {
    const __m256i u = _mm256_castps_si256(n);
    __m256i b = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), 16),
                                 _mm256_set1_epi32(kLutBase));
    b = _mm256_min_epi32(_mm256_max_epi32(b, _mm256_setzero_si256()), _mm256_set1_epi32(kLutBuckets - 1));
    return _mm256_add_epi32(b, _mm256_and_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32(kLutBuckets)));
  }
  // Code of n from its bucket's entry e (see the scalar build).
  static VI lut_code(V n, VI e) {
    const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
    const __m256 t = _mm256_castsi256_ps(
        _mm256_or_si256(_mm256_andnot_si256(lo16, _mm256_castps_si256(n)), _mm256_and_si256(e, lo16)));
    const __m256i ge = _mm256_castps_si256(_mm256_cmp_ps(n, t, _CMP_GE_OQ));
    const __m256i has = _mm256_srai_epi32(_mm256_slli_epi32(e, 7), 31);  // bit 24 -> all ones
    const __m256i c = _mm256_and_si256(_mm256_srli_epi32(e, 16), _mm256_set1_epi32(0xFF));
    return _mm256_sub_epi32(c, _mm256_and_si256(ge, has));  // ge & has is -1 where the threshold is reached
  }
  static void store_u8(uint8_t* p, VI x) {  // lanes hold 0..255: saturating packs keep them
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
  }
  // max |x[i]| over [0, n) (n a multiple of 8); NaN if any element is NaN (tracked apart: maxps drops NaN operands
  // depending on their position).
  static float block_absmax(const float* x, int64_t n) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
      m = _mm256_max_ps(m, a);
    }
    if (_mm256_movemask_ps(nan) != 0) return __builtin_nanf("");
    alignas(32) float t[8];
    _mm256_store_ps(t, m);
    float r = t[0];
    for (int k = 1; k < 8; ++k) r = t[k] > r ? t[k] : r;
    return r;
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
