// Portable build of the Adam kernel: one element at a time, no ISA extension. The fused multiply-adds that torch's
// vector kernels use are done with __builtin_fmaf (a correctly rounded libm call here), so this path gives the same
// bits as the AVX2 and AVX-512 builds.
#include <cstdint>

#include "adam/adam_kernel.h"
#include "adam/adam_kernel_impl.h"

namespace zeroshard::adam_kernel::scalar {
namespace {

inline uint32_t bits_of(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  return u;
}
inline float float_of(uint32_t u) {
  float x;
  __builtin_memcpy(&x, &u, sizeof(x));
  return x;
}

// bf16 -> fp32 is exact: the 16 bits are the top half of the fp32 pattern.
inline float bf16_to_float(BF16 h) { return float_of(static_cast<uint32_t>(h.bits) << 16); }

// fp32 -> bf16, round to nearest even; any NaN becomes the canonical quiet NaN 0x7FC0 (as c10::BFloat16 does).
inline BF16 float_to_bf16(float x) {
  const uint32_t u = bits_of(x);
  if (x != x) return BF16{0x7FC0};
  return BF16{static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}

// IEEE binary16 -> fp32, exact (what F16C's vcvtph2ps does).
inline float fp16_to_float(FP16 h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1Fu;
  const uint32_t man = h.bits & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in fp32
    return float_of(sign | bits_of(static_cast<float>(man) * 0x1p-24f));
  }
  if (exp == 31) return float_of(sign | 0x7F800000u | (man << 13));  // inf / NaN (payload kept)
  return float_of(sign | ((exp + 112u) << 23) | (man << 13));
}

// fp32 -> IEEE binary16, round to nearest even, overflow to inf, NaN quieted with its top payload bits kept (what
// F16C's vcvtps2ph with _MM_FROUND_TO_NEAREST_INT does).
inline FP16 float_to_fp16(float x) {
  uint32_t u = bits_of(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  u &= 0x7FFFFFFFu;
  if (u >= 0x7F800000u) {
    return FP16{static_cast<uint16_t>(sign | (u > 0x7F800000u ? 0x7E00u | ((u >> 13) & 0x3FFu) : 0x7C00u))};
  }
  if (u >= 0x477FF000u) return FP16{static_cast<uint16_t>(sign | 0x7C00u)};  // >= 65520 rounds to inf
  if (u < 0x38800000u) {
    // |x| < 2^-14: fp16 subnormal. Adding 0.5f lines |x| up with fp16's subnormal step (2^-24 = ulp of 0.5f) and
    // lets the FPU do the round to nearest even.
    const float y = float_of(u) + 0.5f;
    return FP16{static_cast<uint16_t>(sign | (bits_of(y) - 0x3F000000u))};
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even.
  u += (static_cast<uint32_t>(15 - 127) << 23) + 0xFFFu + ((u >> 13) & 1u);
  return FP16{static_cast<uint16_t>(sign | (u >> 13))};
}

struct Ops {
  using V = float;
  using Acc = double;
  static constexpr int64_t kWidth = 1;
  static constexpr bool kMasked = false;

  static V set1(float x) { return x; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return __builtin_sqrtf(a); }
  static V fmadd(V a, V b, V c) { return __builtin_fmaf(a, b, c); }
  // Hides values from the optimiser (the bandwidth reference stores what it loaded).
  static void opaque(V& a, V& b, V& c, V& d) { __asm__ volatile("" : "+x"(a), "+x"(b), "+x"(c), "+x"(d)); }

  static V load(const float* p) { return *p; }
  static V load(const BF16* p) { return bf16_to_float(*p); }
  static V load(const FP16* p) { return fp16_to_float(*p); }
  static void store(float* p, V x) { *p = x; }
  static void store(BF16* p, V x) { *p = float_to_bf16(x); }
  static void store(FP16* p, V x) { *p = float_to_fp16(x); }

  // int8 state (adam_kernel_quant.h): codes as int32 lanes, table lookups, exact comparisons.
  using VI = int32_t;
  static V lookup(const float* table, const uint8_t* codes) { return table[*codes]; }
  static VI lookup(const int32_t* table, const int32_t* idx) { return table[*idx]; }
  static void store_i32(int32_t* p, VI x) { *p = x; }
  // Bucket of n in QuantMap's lookup tables: sign, then (|n| bits >> 16) - kLutBase clamped to [0, kLutBuckets).
  static VI lut_index(V n) {
    const uint32_t u = bits_of(n);
    int32_t b = static_cast<int32_t>((u & 0x7FFFFFFFu) >> 16) - kLutBase;
    b = b < 0 ? 0 : (b > kLutBuckets - 1 ? kLutBuckets - 1 : b);
    return (u >> 31) != 0 ? b + kLutBuckets : b;
  }
  // Code of n from its bucket's entry e (QuantMap): c + (n >= t), t = n's high 16 bits and e's low 16 bits.
  static VI lut_code(V n, VI e) {
    const float t = float_of((bits_of(n) & 0xFFFF0000u) | (static_cast<uint32_t>(e) & 0xFFFFu));
    return ((e >> 16) & 0xFF) + ((e & kLutHasThreshold) != 0 && n >= t ? 1 : 0);
  }
  static void store_u8(uint8_t* p, VI x) { *p = static_cast<uint8_t>(x); }
  // max |x[i]| over [0, n); NaN if any element is NaN.
  static float block_absmax(const float* x, int64_t n) {
    float m = 0.f;
    bool nan = false;
    for (int64_t i = 0; i < n; ++i) {
      const float a = __builtin_fabsf(x[i]);
      nan |= a != a;
      m = a > m ? a : m;
    }
    return nan ? __builtin_nanf("") : m;
  }

  static Acc acc_zero() { return 0.0; }
  // float * float is exact in double, so this is the same sum of squares the vector builds form per lane.
  static Acc acc_add_sq(Acc acc, V g) { return acc + static_cast<double>(g) * static_cast<double>(g); }
  static double acc_sum(Acc acc) { return acc; }
};

}  // namespace

double run(const Args& args, int64_t begin, int64_t end, bool want_grad_sq) {
  return impl::run<Ops>(args, begin, end, want_grad_sq);
}

void traffic(const Args& args, int64_t begin, int64_t end) { impl::traffic<Ops>(args, begin, end); }

}  // namespace zeroshard::adam_kernel::scalar
