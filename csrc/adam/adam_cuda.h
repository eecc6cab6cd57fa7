// adam_step on CUDA tensors: the launch of adam_kernel_cuda.cu on the current stream, for adam.cpp, which checks
// the tensors (one device, dense, contiguous, no aliasing) and builds Args exactly as for the CPU kernel.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

#include "adam/adam_kernel.h"

namespace zeroshard::adam_detail {

// Whether this build has the CUDA step (built against a CUDA torch with nvcc present: ZEROSHARD_WITH_CUDA).
bool cuda_step_available();

// Launches the step over elements [0, n) of args' pointers (memory of `device`) on that device's current stream;
// the maps' device copies are made once per device. Throws c10::Error with the CUDA error string if the launch
// fails, and always without CUDA parts (callers check cuda_step_available() first).
void run_cuda_step(const adam_kernel::Args& args, int64_t n, const c10::Device& device);

}  // namespace zeroshard::adam_detail
