// The fused Adam step on CUDA memory: the same Args and the same bits as the CPU builds (adam_kernel_impl.h,
// adam_kernel_quant.h), so a state written by one device steps on the other. Plain C++ here (no CUDA or torch
// header): adam_cuda.cpp calls it, adam_kernel_cuda.cu implements it.
#pragma once

#include <cstdint>

#include "adam/adam_kernel.h"

namespace zeroshard::adam_kernel::cuda {

// Device copies of the two dynamic maps (256 fp32 each): values, and the thresholds of adam_dynamic_map_thresholds
// (element 0 unused). The CPU builds' QuantMap lookup table is replaced by a binary search over thresholds[1..255]:
// the same comparison, `n >= thresholds[k]`, against the same threshold.
struct DeviceMaps {
  const float* signed_values = nullptr;
  const float* signed_thresholds = nullptr;
  const float* unsigned_values = nullptr;
  const float* unsigned_thresholds = nullptr;
};

// Steps elements [0, n) of args' device pointers on `stream` (a cudaStream_t), asynchronously. args.param_out must
// be null and the statistics are not computed (adam_cuda.cpp refuses both before calling). Returns null, or the CUDA
// error string of the launch.
const char* run(const Args& args, int64_t n, const DeviceMaps& maps, void* stream);

}  // namespace zeroshard::adam_kernel::cuda
