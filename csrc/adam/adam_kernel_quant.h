// Block-wise dynamic 8-bit quantisation of the Adam moments, shared by the scalar, AVX2 and AVX-512 builds (a
// template over each build's Ops, like adam_kernel_impl.h). Scheme: Dettmers, Lewis, Shleifer, Zettlemoyer 2022,
// "8-bit Optimizers via Block-wise Quantization" (bitsandbytes): per block of kQuantBlock elements an fp32 absmax,
// and each element stored as the index of the nearest value of x / absmax in a 256-entry dynamic map (the maps are
// built on the host, adam_state_format.cpp).
//
// Same bits in every build: dequantisation is one fp32 multiply (map[code] * absmax); quantisation is one fp32
// division (x / absmax) and the comparison `n >= thresholds[k]` against the one threshold of n's bucket, with
// thresholds exact in fp32 (QuantMap): the nearest code, ties (n exactly on a midpoint) to the larger code. absmax is
// a maximum, exact in any order. Scalar statements here are single operations (no a * b + c a compiler could fuse).
//
// Non-finite values: a block whose updated moment holds a NaN or an inf gets absmax = NaN and all codes 0, so on
// the next step every element of that block dequantises to NaN.
// torch's AdamW would poison only the elements that went non-finite; an 8-bit code has no inf or NaN to say so.
// The param update of the step that produced the value is computed from the fp32 moments, as torch does.
// A block of all zeros keeps absmax = 0 and the code of 0.0.
#pragma once

#include <cstdint>

#include "adam/adam_kernel.h"

namespace zeroshard::adam_kernel::impl {

// out[0, len) = values[codes[i]] * absmax; out[len, len rounded up to the vector width) = 0, so the quantiser can
// run whole vectors and the zeros leave absmax unchanged.
template <class Ops>
inline void dequant_block(const uint8_t* codes, int64_t len, const float* values, float absmax, float* out) {
  constexpr int64_t W = Ops::kWidth;
  const auto s = Ops::set1(absmax);
  int64_t i = 0;
  for (; i + W <= len; i += W) Ops::store(out + i, Ops::mul(Ops::lookup(values, codes + i), s));
  for (; i < len; ++i) out[i] = values[codes[i]] * absmax;  // one rounding: the vector lanes' bits
  for (; i % W != 0; ++i) out[i] = 0.f;
}

// Quantises x[0, len) (fp32, zero past len up to the vector width) into codes[0, len); returns the block's absmax
// (NaN if any element is NaN or inf). The nearest code of n = x / absmax is the number of thresholds[1..255] that n
// reaches, read from n's bucket of the map's lookup table (QuantMap): one table lookup and one comparison per element.
// In slices of kQuantSlice elements, three passes over L1: n and its bucket index into stack buffers, then the table
// lookups from memory-resident indices (Ops::lookup: scalar loads where the ISA's gather is slower), then the codes.
template <class Ops>
inline float quant_block(const float* x, int64_t len, const QuantMap& map, uint8_t* codes) {
  constexpr int64_t W = Ops::kWidth;
  constexpr int64_t kQuantSlice = 256;
  static_assert(kQuantSlice % W == 0, "a slice holds whole vectors");
  const int64_t padded = (len + W - 1) / W * W;
  const float absmax = Ops::block_absmax(x, padded);  // NaN if any NaN; inf if any inf
  if (!__builtin_isfinite(absmax)) {
    __builtin_memset(codes, 0, static_cast<unsigned long>(len));
    return __builtin_nanf("");
  }
  const auto d = Ops::set1(absmax == 0.f ? 1.f : absmax);  // all zeros: n = 0, the code of 0.0
  alignas(64) float nb[kQuantSlice];
  alignas(64) int32_t ib[kQuantSlice];
  for (int64_t s = 0; s < padded; s += kQuantSlice) {
    const int64_t m = padded - s < kQuantSlice ? padded - s : kQuantSlice;
    for (int64_t i = 0; i < m; i += W) {
      const auto n = Ops::div(Ops::load(x + s + i), d);
      Ops::store(nb + i, n);
      Ops::store_i32(ib + i, Ops::lut_index(n));
    }
    for (int64_t i = 0; i < m; i += W) {
      const auto c = Ops::lut_code(Ops::load(nb + i), Ops::lookup(map.lut, ib + i));
      if (s + i + W <= len) {
        Ops::store_u8(codes + s + i, c);
      } else {  // the last vector of the block: only its first len - (s + i) codes are the block's
        alignas(64) uint8_t tail[W];
        Ops::store_u8(tail, c);
        __builtin_memcpy(codes + s + i, tail, static_cast<unsigned long>(len - (s + i)));
      }
    }
  }
  return absmax;
}

}  // namespace zeroshard::adam_kernel::impl
