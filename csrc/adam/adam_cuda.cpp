#include "adam/adam_cuda.h"

#include <c10/util/Exception.h>

#ifdef ZEROSHARD_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <mutex>
#include <unordered_map>

#include "adam/adam_kernel_cuda.h"
#include "adam/adam_state_format.h"
#endif

namespace zeroshard::adam_detail {

#ifdef ZEROSHARD_WITH_CUDA

namespace {

// Rows: signed values, signed thresholds, unsigned values, unsigned thresholds (256 fp32 each), on `device`. Kept
// for the life of the process: 4 KiB per device.
const at::Tensor& device_maps(const c10::Device& device) {
  static std::mutex mu;
  static std::unordered_map<c10::DeviceIndex, at::Tensor> maps;
  std::lock_guard<std::mutex> lock(mu);
  auto it = maps.find(device.index());
  if (it == maps.end()) {
    const at::Tensor host = at::stack({adam_dynamic_map(true), adam_dynamic_map_thresholds(true),
                                       adam_dynamic_map(false), adam_dynamic_map_thresholds(false)});
    it = maps.emplace(device.index(), host.to(device).contiguous()).first;
  }
  return it->second;
}

}  // namespace

bool cuda_step_available() { return true; }

void run_cuda_step(const adam_kernel::Args& args, int64_t n, const c10::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  adam_kernel::cuda::DeviceMaps maps;
  if (args.state_type == adam_kernel::StateType::kInt8) {
    const float* m = device_maps(device).data_ptr<float>();
    maps = {m, m + 256, m + 512, m + 768};
  }
  const char* err = adam_kernel::cuda::run(args, n, maps, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  TORCH_CHECK(err == nullptr, "adam_step: the CUDA kernel failed to launch on ", device, ": ", err);
}

#else

bool cuda_step_available() { return false; }

void run_cuda_step(const adam_kernel::Args&, int64_t, const c10::Device& device) {
  TORCH_CHECK(false, "adam_step: tensors on ", device, " need zeroshard's CUDA parts, and this build has none");
}

#endif

}  // namespace zeroshard::adam_detail
