// HostAdamPipeline: the optimizer step of CPU offload. Optimizer state lives in host memory; the step walks it in
// chunks so that three things overlap: gradients still arriving (device -> host), the fused CPU Adam on one chunk,
// and the upload (host -> device) of the chunk before it through two alternating staging buffers.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "adam/adam.h"
#include "offload/copy_queue.h"

namespace zeroshard {

struct OffloadSegment {
  at::Tensor master;               // fp32, CPU, contiguous, n elements (updated in place)
  at::Tensor exp_avg, exp_avg_sq;  // CPU, contiguous, n elements each, in a state format (adam_state_format.h):
                                   // fp32, bf16, or uint8 codes with the two absmax below (updated in place)
  at::Tensor grad;                 // CPU, fp32/bf16/fp16, contiguous, n elements (read only)
  int64_t grad_ticket = 0;         // d2h ticket after which `grad` holds its data (0: already there)
  at::Tensor param_out;     // optional (undefined = none): CPU tensor (bf16/fp16/fp32, n) the step writes directly
  at::Tensor device_param;  // optional: contiguous tensor (CPU, or CUDA on h2d's device; bf16/fp16/fp32, n) that
                            // receives the updated weights through the double-buffered upload
  AdamHyper hyper;
  at::Tensor exp_avg_absmax, exp_avg_sq_absmax;  // int8 state only (else undefined): fp32, CPU, ceil(n / 2048) each
};

class HostAdamPipeline {
 public:
  // d2h: the queue that delivers gradients (its tickets are OffloadSegment::grad_ticket). h2d: the queue that uploads
  // weights to device_param. chunk_elems (>= 1): elements per pipeline chunk; adam_step threads over 64Ki-element
  // pieces of one chunk, so a chunk of at least kAdamChunk * threads elements keeps every thread busy. pin: staging
  // buffers in page-locked memory (see empty_host), which async host -> device copies need.
  HostAdamPipeline(std::shared_ptr<CopyQueue> d2h, std::shared_ptr<CopyQueue> h2d, int64_t chunk_elems, bool pin);

  // One Adam step over every segment, in order.
  //  - Every segment is validated first; nothing is written or enqueued if a check fails.
  //  - h2d first waits for the work already issued on the caller's current stream (compute may still read the old
  //    device weights).
  //  - Each segment waits (host side) for its gradient copy d2h ticket, then is cut into chunks of chunk_elems
  //    elements (int8 state: int8_chunk_elems(), whole quantisation blocks, so each chunk's absmax are a slice); chunk
  //    k (counted across segments) stages its weights in buffer k % 2, waiting first for the upload that last read that
  //    buffer, and enqueues the upload into device_param. param_out is written directly.
  //  - At the end the caller's current stream waits (device side) for the last upload; the host does not block, and
  //    the staging buffers may still be read: the next step waits for them before writing.
  // Results: master / exp_avg / exp_avg_sq / param_out / device_param equal one adam_step call per whole segment bit
  // for bit for any chunk_elems (the kernel's tail runs the same vector code on a padded copy, so elementwise results
  // do not depend on where chunks end). Grad stats: the sum over chunks of each chunk's grad_sq_sum in chunk order,
  // and the OR of found_inf; the sum equals the per-segment one up to double rounding of the partial sums (bitwise
  // when chunk_elems == kAdamChunk, since adam_step sums its 64Ki partials in the same order).
  // Returns the stats if compute_grad_stats, else nullopt. Rethrows copy errors (the step is then partly applied).
  std::optional<GradStats> step(const std::vector<OffloadSegment>& segments, bool compute_grad_stats);

  // Bytes of the two upload buffers allocated so far (each chunk_elems * 4 bytes, allocated on first use; at least
  // int8_chunk_elems() * 4 once an int8 segment was stepped).
  int64_t upload_buffer_bytes() const;
  int64_t chunk_elems() const { return chunk_elems_; }
  // Chunk of segments with int8 state: chunk_elems rounded down to whole 2048-element blocks, at least one block.
  int64_t int8_chunk_elems() const;

 private:
  void validate(const std::vector<OffloadSegment>& segments) const;
  // `n` elements of upload buffer `slot` viewed as `dtype` (n <= chunk_elems).
  at::Tensor upload_chunk(int slot, at::ScalarType dtype, int64_t n);

  std::shared_ptr<CopyQueue> d2h_, h2d_;
  int64_t chunk_elems_;
  bool pin_;
  std::array<at::Tensor, 2> upload_;          // uint8, max(chunk, int8 chunk used) * 4 bytes each
  std::array<int64_t, 2> slot_ticket_{0, 0};  // h2d ticket of the copy that last read each buffer
};

}  // namespace zeroshard
