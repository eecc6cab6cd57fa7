// Formats of the Adam moments (exp_avg, exp_avg_sq) the fused CPU step reads and writes, told apart by dtype:
//   float32 moments                        fp32 state (8 bytes per parameter);
//   bfloat16 moments                       bf16 state, rounded to nearest even on every store (4 bytes);
//   uint8 moments + fp32 absmax tensors    block-wise dynamic 8-bit state (2 bytes + 8 per 2048): each moment is the
//                                          index of a value in a 256-entry dynamic map, scaled by its block's absmax.
// The 8-bit scheme is Dettmers, Lewis, Shleifer, Zettlemoyer 2022, "8-bit Optimizers via Block-wise Quantization":
// blocks of 2048 elements, one fp32 absmax per block, the signed dynamic map for exp_avg and the unsigned one for
// exp_avg_sq, as bitsandbytes' blockwise 8-bit Adam keeps them (bitsandbytes/functional.py, create_dynamic_map(signed=
// True) and create_dynamic_map(signed=False) with their defaults max_exponent_bits=7, total_bits=8).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace zeroshard {

// Elements per quantisation block; kAdamChunk is a multiple of it.
constexpr int64_t kAdamQuantBlock = 2048;

// Number of blocks (absmax entries per moment) of an n-element int8 state: ceil(n / 2048).
constexpr int64_t adam_quant_blocks(int64_t n) { return (n + kAdamQuantBlock - 1) / kAdamQuantBlock; }

// The per-block scales of int8 state: fp32, CPU, contiguous, adam_quant_blocks(numel) elements each.
struct AdamStateScales {
  at::Tensor exp_avg_absmax;
  at::Tensor exp_avg_sq_absmax;
};

// The dynamic map of exp_avg (signed: 256 ascending fp32 values in [-0.99297, 1]) or of exp_avg_sq (unsigned: in
// [0, 1]), built with torch ops in bitsandbytes' construction order, so its values are those of
// bitsandbytes.functional.create_dynamic_map(signed) on the same torch. A new tensor each call.
at::Tensor adam_dynamic_map(bool is_signed);

// The exact nearest-code thresholds of that map: element k (1..255) is the smallest float >= the midpoint of
// values k-1 and k (computed in double, where it is exact), element 0 is -inf. The code of a normalised value x is
// the number of thresholds[1..255] with x >= thresholds[k] (ties go to the larger code).
at::Tensor adam_dynamic_map_thresholds(bool is_signed);

}  // namespace zeroshard
