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
  for (; i + W <= len; i += W) Ops::store(out + i, Ops::mul(Ops::gather(values, Ops::load_u8(codes + i)), s));
  for (; i < len; ++i) out[i] = values[codes[i]] * absmax;  // one rounding: the vector lanes' bits
  for (; i % W != 0; ++i) out[i] = 0.f;
}

// Index of the nearest map value of each lane of n (finite): the number of thresholds[1..255] that n reaches (>=),
// read from the map's bucket table (QuantMap): one table lookup and one comparison.
template <class Ops>
inline typename Ops::VI nearest_code(typename Ops::V n, const QuantMap& map) {
  return Ops::lut_code(n, Ops::gather(map.lut, Ops::lut_index(n)));
}

// Quantises x[0, len) (fp32, zero past len up to the vector width) into codes[0, len); returns the block's absmax
// (NaN if any element is NaN or inf).
template <class Ops>
inline float quant_block(const float* x, int64_t len, const QuantMap& map, uint8_t* codes) {
  constexpr int64_t W = Ops::kWidth;
  const int64_t padded = (len + W - 1) / W * W;
  const float absmax = Ops::block_absmax(x, padded);  // NaN if any NaN; inf if any inf
  if (!__builtin_isfinite(absmax)) {
    __builtin_memset(codes, 0, static_cast<unsigned long>(len));
    return __builtin_nanf("");
  }
  const auto d = Ops::set1(absmax == 0.f ? 1.f : absmax);  // all zeros: n = 0, the code of 0.0
  int64_t i = 0;
  for (; i + W <= len; i += W) Ops::store_u8(codes + i, nearest_code<Ops>(Ops::div(Ops::load(x + i), d), map));
  if (i < len) {
    alignas(64) uint8_t tail[W];
    Ops::store_u8(tail, nearest_code<Ops>(Ops::div(Ops::load(x + i), d), map));
    __builtin_memcpy(codes + i, tail, static_cast<unsigned long>(len - i));
  }
  return absmax;
}

}  // namespace zeroshard::adam_kernel::impl
