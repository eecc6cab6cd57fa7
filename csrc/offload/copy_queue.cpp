#include "offload/copy_queue.h"

#include <c10/util/Exception.h>

#include "offload/host_copy_queue.h"

#ifdef ZEROSHARD_WITH_CUDA
#include "offload/cuda_copy_queue.h"
#endif

namespace zeroshard {
namespace {

void check_one(const at::Tensor& t, const char* name, const char* queue) {
  TORCH_CHECK_VALUE(t.defined(), queue, ".copy: ", name, " is an undefined tensor; pass a tensor");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, queue, ".copy: ", name, " has layout ", t.layout(),
                    "; only dense (strided) tensors can be copied (convert with .to_dense())");
  TORCH_CHECK_VALUE(t.is_contiguous(), queue, ".copy: ", name, " is not contiguous (sizes ", t.sizes(), ", strides ",
                    t.strides(), "); pass a contiguous tensor (the copy is of raw bytes, no layout change)");
}

}  // namespace

void check_copy_args(const at::Tensor& dst, const at::Tensor& src, const char* queue) {
  check_one(dst, "dst", queue);
  check_one(src, "src", queue);
  TORCH_CHECK_TYPE(dst.scalar_type() == src.scalar_type(), queue, ".copy: dst has dtype ", dst.scalar_type(),
                   " but src has ", src.scalar_type(), "; the queue copies bytes, cast src first");
  TORCH_CHECK_VALUE(dst.numel() == src.numel(), queue, ".copy: dst has ", dst.numel(), " elements but src has ",
                    src.numel(), "; pass tensors of the same number of elements");
}

std::shared_ptr<CopyQueue> make_copy_queue(c10::Device device) {
  if (device.is_cpu()) return std::make_shared<HostCopyQueue>();
  if (device.is_cuda()) {
#ifdef ZEROSHARD_WITH_CUDA
    return std::make_shared<CudaCopyQueue>(device);
#else
    TORCH_CHECK_VALUE(false, "make_copy_queue: device ", device,
                      " needs the CUDA parts, but this zeroshard build has none (torch without CUDA or no nvcc at ",
                      "build time); rebuild against a CUDA build of torch, or use device 'cpu'");
#endif
  }
  TORCH_CHECK_VALUE(false, "make_copy_queue: device ", device, " is not supported; use 'cpu' or 'cuda[:index]'");
}

}  // namespace zeroshard
