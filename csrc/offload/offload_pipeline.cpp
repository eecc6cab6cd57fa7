#include "offload/offload_pipeline.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <string>

#include "adam/adam_state_format.h"
#include "offload/host_memory.h"

namespace zeroshard {
namespace {

constexpr int64_t kMaxElemBytes = 4;  // float32, the widest weight dtype

bool is_weight_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

void check_tensor(const at::Tensor& t, const std::string& name, int64_t n, bool cpu) {
  TORCH_CHECK_VALUE(t.defined(), "HostAdamPipeline.step: ", name, " is an undefined tensor");
  TORCH_CHECK_VALUE(!cpu || t.device().is_cpu(), "HostAdamPipeline.step: ", name, " is on ", t.device(),
                    "; it must be a CPU tensor (offloaded optimizer state and gradients live in host memory)");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "HostAdamPipeline.step: ", name, " has layout ", t.layout(),
                    "; only dense (strided) tensors are supported");
  TORCH_CHECK_VALUE(t.is_contiguous(), "HostAdamPipeline.step: ", name, " is not contiguous (sizes ", t.sizes(),
                    ", strides ", t.strides(), "); pass a contiguous tensor, the step updates it in place by chunks");
  TORCH_CHECK_VALUE(t.numel() == n, "HostAdamPipeline.step: ", name, " has ", t.numel(), " elements but master has ", n,
                    "; every tensor of a segment must have the same number of elements");
}

void check_no_overlap(const at::Tensor& a, const std::string& an, const at::Tensor& b, const std::string& bn) {
  const auto s = at::get_overlap_status(a, b);
  TORCH_CHECK_VALUE(s == at::MemOverlapStatus::No || s == at::MemOverlapStatus::TooHard, "HostAdamPipeline.step: ", an,
                    " and ", bn, " share memory; each must be its own buffer");
}

}  // namespace

HostAdamPipeline::HostAdamPipeline(std::shared_ptr<CopyQueue> d2h, std::shared_ptr<CopyQueue> h2d, int64_t chunk_elems,
                                   bool pin)
    : d2h_(std::move(d2h)), h2d_(std::move(h2d)), chunk_elems_(chunk_elems), pin_(pin) {
  TORCH_CHECK_VALUE(d2h_ && h2d_, "HostAdamPipeline: d2h and h2d must be copy queues (see make_copy_queue)");
  TORCH_CHECK_VALUE(chunk_elems_ >= 1, "HostAdamPipeline: chunk_elems=", chunk_elems_,
                    " is invalid; pass a chunk size >= 1 (ideally a multiple of ", kAdamChunk, ")");
}

void HostAdamPipeline::validate(const std::vector<OffloadSegment>& segments) const {
  const c10::Device upload_device = h2d_->device();
  for (size_t i = 0; i < segments.size(); ++i) {
    const OffloadSegment& s = segments[i];
    const std::string at = "segments[" + std::to_string(i) + "].";
    TORCH_CHECK_VALUE(s.master.defined(), "HostAdamPipeline.step: ", at, "master is an undefined tensor");
    const int64_t n = s.master.numel();
    check_tensor(s.master, at + "master", n, true);
    check_tensor(s.exp_avg, at + "exp_avg", n, true);
    check_tensor(s.exp_avg_sq, at + "exp_avg_sq", n, true);
    check_tensor(s.grad, at + "grad", n, true);
    if (s.exp_avg.scalar_type() == at::kByte || s.exp_avg_absmax.defined() || s.exp_avg_sq_absmax.defined()) {
      const int64_t blocks = adam_quant_blocks(n);
      check_tensor(s.exp_avg_absmax, at + "exp_avg_absmax", blocks, true);
      check_tensor(s.exp_avg_sq_absmax, at + "exp_avg_sq_absmax", blocks, true);
      for (const auto* t : {&s.master, &s.exp_avg, &s.exp_avg_sq, &s.grad}) {
        check_no_overlap(s.exp_avg_absmax, at + "exp_avg_absmax", *t, "a state or grad tensor");
        check_no_overlap(s.exp_avg_sq_absmax, at + "exp_avg_sq_absmax", *t, "a state or grad tensor");
      }
      check_no_overlap(s.exp_avg_absmax, at + "exp_avg_absmax", s.exp_avg_sq_absmax, at + "exp_avg_sq_absmax");
    }
    TORCH_CHECK_VALUE(s.grad_ticket <= d2h_->last_ticket(), "HostAdamPipeline.step: ", at,
                      "grad_ticket=", s.grad_ticket, " was never issued by the d2h queue (last ticket ",
                      d2h_->last_ticket(), "); pass the ticket d2h.copy() returned, or 0");
    TORCH_CHECK_VALUE(!(s.param_out.defined() && s.device_param.defined()), "HostAdamPipeline.step: segments[", i,
                      "] has both param_out and device_param; pass one (param_out: written in place on the host, ",
                      "device_param: uploaded through h2d)");
    check_no_overlap(s.master, at + "master", s.exp_avg, at + "exp_avg");
    check_no_overlap(s.master, at + "master", s.exp_avg_sq, at + "exp_avg_sq");
    check_no_overlap(s.exp_avg, at + "exp_avg", s.exp_avg_sq, at + "exp_avg_sq");
    for (const auto* t : {&s.master, &s.exp_avg, &s.exp_avg_sq}) check_no_overlap(s.grad, at + "grad", *t, "state");
    if (s.param_out.defined()) {
      check_tensor(s.param_out, at + "param_out", n, true);
      TORCH_CHECK_TYPE(is_weight_dtype(s.param_out.scalar_type()), "HostAdamPipeline.step: ", at,
                       "param_out has dtype ", s.param_out.scalar_type(), "; use bfloat16, float16 or float32");
      for (const auto* t : {&s.master, &s.exp_avg, &s.exp_avg_sq, &s.grad})
        check_no_overlap(s.param_out, at + "param_out", *t, "a state or grad tensor");
    }
    if (s.device_param.defined()) {
      check_tensor(s.device_param, at + "device_param", n, false);
      TORCH_CHECK_TYPE(is_weight_dtype(s.device_param.scalar_type()), "HostAdamPipeline.step: ", at,
                       "device_param has dtype ", s.device_param.scalar_type(), "; use bfloat16, float16 or float32");
      const c10::Device d = s.device_param.device();
      TORCH_CHECK_VALUE(d.is_cpu() || (upload_device.is_cuda() && d == upload_device), "HostAdamPipeline.step: ", at,
                        "device_param is on ", d, " but the h2d queue copies to ", upload_device,
                        "; make h2d for that device (make_copy_queue)");
    }
    // Dtypes and hyper-parameters through adam_step itself, on empty views: checks only, nothing written.
    const auto empty = [](const at::Tensor& t) { return t.view(-1).narrow(0, 0, 0); };
    std::optional<at::Tensor> out;
    if (s.param_out.defined()) out = empty(s.param_out);
    std::optional<AdamStateScales> scales;
    if (s.exp_avg_absmax.defined()) scales = AdamStateScales{empty(s.exp_avg_absmax), empty(s.exp_avg_sq_absmax)};
    adam_step(empty(s.master), empty(s.grad), empty(s.exp_avg), empty(s.exp_avg_sq), s.hyper, out, false, std::nullopt,
              scales);
  }
}

int64_t HostAdamPipeline::int8_chunk_elems() const {
  return std::max(kAdamQuantBlock, chunk_elems_ / kAdamQuantBlock * kAdamQuantBlock);
}

at::Tensor HostAdamPipeline::upload_chunk(int slot, at::ScalarType dtype, int64_t n) {
  at::Tensor& buf = upload_[slot];
  // chunk_elems, or one int8 chunk when that is larger (chunk_elems under one 2048-element block)
  const int64_t elems = std::max(chunk_elems_, n);
  if (!buf.defined() || buf.numel() < elems * kMaxElemBytes) buf = empty_host(elems * kMaxElemBytes, at::kByte, pin_);
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype));
  return buf.narrow(0, 0, n * itemsize).view(dtype);
}

std::optional<GradStats> HostAdamPipeline::step(const std::vector<OffloadSegment>& segments, bool compute_grad_stats) {
  validate(segments);
  h2d_->wait_current_stream();

  GradStats total;
  int64_t k = 0;  // chunk counter across segments: picks the staging buffer
  for (const OffloadSegment& s : segments) {
    const int64_t n = s.master.numel();
    const at::Tensor master = s.master.view(-1), m = s.exp_avg.view(-1), v = s.exp_avg_sq.view(-1);
    const at::Tensor grad = s.grad.view(-1);
    const at::Tensor param_out = s.param_out.defined() ? s.param_out.view(-1) : at::Tensor();
    const at::Tensor device_param = s.device_param.defined() ? s.device_param.view(-1) : at::Tensor();
    const bool int8_state = s.exp_avg_absmax.defined();
    const int64_t chunk = int8_state ? int8_chunk_elems() : chunk_elems_;
    d2h_->synchronize(s.grad_ticket);
    for (int64_t c0 = 0; c0 < n; c0 += chunk, ++k) {
      const int64_t len = std::min(chunk, n - c0);
      const int slot = static_cast<int>(k % 2);
      std::optional<at::Tensor> out;
      if (device_param.defined()) {
        h2d_->synchronize(slot_ticket_[slot]);  // the upload that last read this buffer
        out = upload_chunk(slot, device_param.scalar_type(), len);
      } else if (param_out.defined()) {
        out = param_out.narrow(0, c0, len);
      }
      std::optional<AdamStateScales> scales;
      if (int8_state) {  // c0 is a multiple of the block: this chunk's blocks are a slice of the segment's
        const int64_t b0 = c0 / kAdamQuantBlock, blocks = adam_quant_blocks(len);
        scales = AdamStateScales{s.exp_avg_absmax.narrow(0, b0, blocks), s.exp_avg_sq_absmax.narrow(0, b0, blocks)};
      }
      const auto stats = adam_step(master.narrow(0, c0, len), grad.narrow(0, c0, len), m.narrow(0, c0, len),
                                   v.narrow(0, c0, len), s.hyper, out, compute_grad_stats, std::nullopt, scales);
      if (stats) {
        total.grad_sq_sum += stats->grad_sq_sum;
        total.found_inf = total.found_inf || stats->found_inf;
      }
      if (device_param.defined()) slot_ticket_[slot] = h2d_->copy(device_param.narrow(0, c0, len), *out);
    }
  }
  // Compute issued after the step must see the new weights; the host moves on.
  h2d_->current_stream_wait(h2d_->last_ticket());
  if (!compute_grad_stats) return std::nullopt;
  return total;
}

int64_t HostAdamPipeline::upload_buffer_bytes() const {
  int64_t bytes = 0;
  for (const at::Tensor& b : upload_) {
    if (b.defined()) bytes += static_cast<int64_t>(b.nbytes());
  }
  return bytes;
}

}  // namespace zeroshard
