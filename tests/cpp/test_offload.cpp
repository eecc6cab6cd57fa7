// CPU offload core: exact-size host buffers and their accounting, the host budget check, the host copy queue against
// the sources it copied, and the chunked Adam pipeline against one plain adam_step per whole segment (bit for bit),
// including gradients that arrive through the d2h queue.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "adam/adam.h"
#include "adam/adam_state_format.h"
#include "offload/copy_queue.h"
#include "offload/host_memory.h"
#include "offload/offload_pipeline.h"

namespace zeroshard {
namespace {

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.numel() == b.numel() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

TEST(EmptyHost, ExactSizeAlignedAndCounted) {
  for (int64_t numel : {0, 1, 3, 1000, 65536 + 7}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kByte}) {
      const HostMemoryStats before = host_memory_stats();
      const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
      {
        at::Tensor t = empty_host(numel, dtype, /*pin=*/false);
        EXPECT_EQ(t.dim(), 1);
        EXPECT_EQ(t.numel(), numel);
        EXPECT_EQ(t.scalar_type(), dtype);
        EXPECT_TRUE(t.device().is_cpu());
        EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 64, 0u);
        if (numel > 0) std::memset(t.data_ptr(), 0xab, t.nbytes());  // the whole range is writable
        const HostMemoryStats during = host_memory_stats();
        EXPECT_EQ(during.unpinned_bytes - before.unpinned_bytes, nbytes);
        EXPECT_EQ(during.pinned_bytes, before.pinned_bytes);
        EXPECT_GE(during.peak_unpinned_bytes, during.unpinned_bytes);
      }
      EXPECT_EQ(host_memory_stats().unpinned_bytes, before.unpinned_bytes);
    }
  }
}

TEST(EmptyHost, PinWithoutDeviceIsUnpinned) {
  if (at::hasCUDA()) GTEST_SKIP() << "a CUDA device is present; this checks the fallback without one";
  const HostMemoryStats before = host_memory_stats();
  at::Tensor t = empty_host(1024, at::kFloat, /*pin=*/true);
  EXPECT_FALSE(t.is_pinned());
  EXPECT_EQ(host_memory_stats().unpinned_bytes - before.unpinned_bytes, 4096);
  EXPECT_EQ(host_memory_stats().pinned_bytes, before.pinned_bytes);
}

TEST(EmptyHost, NegativeNumelThrows) { EXPECT_THROW(empty_host(-1, at::kFloat, false), c10::ValueError); }

TEST(HostBudget, PassesAndFails) {
  EXPECT_GT(host_available_bytes(), 0);
  EXPECT_NO_THROW(check_host_budget(1, "one byte"));
  try {
    check_host_budget(host_available_bytes() + (int64_t{1} << 30), "the offloaded optimizer state");
    FAIL() << "expected ValueError";
  } catch (const c10::ValueError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("GiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("the offloaded optimizer state"), std::string::npos) << msg;
  }
}

TEST(HostCopyQueue, ManyCopiesInOrder) {
  auto q = make_copy_queue(c10::Device(c10::kCPU));
  EXPECT_TRUE(q->device().is_cpu());
  std::mt19937 rng(7);
  std::uniform_int_distribution<int64_t> size(0, 5000);
  std::vector<at::Tensor> src, dst;
  int64_t expected_bytes = 0, prev = 0;
  for (int i = 0; i < 1000; ++i) {
    const int64_t n = size(rng);
    src.push_back(at::randn({n}));
    dst.push_back(at::zeros({n}));
    expected_bytes += n * 4;
    const int64_t ticket = q->copy(dst.back(), src.back());
    EXPECT_EQ(ticket, prev + 1);
    prev = ticket;
  }
  EXPECT_EQ(q->last_ticket(), 1000);
  q->synchronize(q->last_ticket());
  for (size_t i = 0; i < src.size(); ++i) ASSERT_TRUE(bitwise_equal(dst[i], src[i])) << "copy " << i;
  EXPECT_EQ(q->stats().first, expected_bytes);
  EXPECT_GE(q->stats().second, 0.0);
  q->reset_stats();
  EXPECT_EQ(q->stats().first, 0);
  q->synchronize(0);  // no-op
}

TEST(HostCopyQueue, LaterCopiesSeeEarlierOnes) {
  // A chain a -> b -> c -> d: each copy reads what the one before wrote, so any reordering shows.
  auto q = make_copy_queue(c10::Device(c10::kCPU));
  std::vector<at::Tensor> chain;
  chain.push_back(at::randn({100000}));
  for (int i = 0; i < 20; ++i) chain.push_back(at::zeros({100000}));
  for (int i = 0; i + 1 < static_cast<int>(chain.size()); ++i) q->copy(chain[i + 1], chain[i]);
  q->current_stream_wait(q->last_ticket());
  EXPECT_TRUE(bitwise_equal(chain.back(), chain.front()));
}

TEST(HostCopyQueue, MismatchThrowsAtEnqueue) {
  auto q = make_copy_queue(c10::Device(c10::kCPU));
  EXPECT_THROW(q->copy(at::zeros({4}), at::zeros({4}, at::kBFloat16)), c10::TypeError);
  EXPECT_THROW(q->copy(at::zeros({4}), at::zeros({5})), c10::ValueError);
  EXPECT_THROW(q->copy(at::zeros({4, 4}).t(), at::zeros({4, 4})), c10::ValueError);
  EXPECT_EQ(q->last_ticket(), 0);  // nothing was queued
  EXPECT_THROW(q->synchronize(1), c10::ValueError);
}

#ifndef ZEROSHARD_WITH_CUDA
TEST(CopyQueue, CudaWithoutCudaPartsThrows) {
  EXPECT_THROW(make_copy_queue(c10::Device(c10::kCUDA, 0)), c10::ValueError);
}
#endif

// --- HostAdamPipeline

struct SegmentData {
  at::Tensor master, m, v, grad;
};

SegmentData make_segment(int64_t n, at::ScalarType grad_dtype, uint64_t seed) {
  at::manual_seed(seed);
  return {at::randn({n}), at::randn({n}) * 0.1, at::rand({n}) * 0.01, (at::randn({n}) * 0.5).to(grad_dtype)};
}

AdamHyper hyper_for(int i) {
  AdamHyper h;
  h.step = 3 + i;
  h.lr = 1e-3 * (i + 1);
  h.weight_decay = 0.01 * i;
  h.adamw_mode = (i % 2) == 0;
  return h;
}

enum class Out { kNone, kParamOut, kDeviceParam };

struct PipelineCase {
  int64_t chunk_elems;
  at::ScalarType grad_dtype;
  Out out;
  bool grads_through_d2h;
};

void run_pipeline_case(const PipelineCase& pc) {
  const std::vector<int64_t> sizes = {1, 100, 65536 * 3 + 17, 65536, 4097};
  auto d2h = make_copy_queue(c10::Device(c10::kCPU));
  auto h2d = make_copy_queue(c10::Device(c10::kCPU));
  HostAdamPipeline pipeline(d2h, h2d, pc.chunk_elems, /*pin=*/true);

  std::vector<OffloadSegment> segs;
  std::vector<SegmentData> ref;
  std::vector<at::Tensor> grad_sources;
  double want_sq = 0.0;
  bool want_inf = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const SegmentData d = make_segment(sizes[i], pc.grad_dtype, 100 + i);
    OffloadSegment s;
    s.master = d.master.clone();
    s.exp_avg = d.m.clone();
    s.exp_avg_sq = d.v.clone();
    s.hyper = hyper_for(static_cast<int>(i));
    if (pc.grads_through_d2h) {
      // The grad buffer holds garbage until the queued copy lands; the pipeline must wait for the ticket.
      s.grad = at::full({sizes[i]}, std::nan(""), pc.grad_dtype);
      grad_sources.push_back(d.grad.clone());
      s.grad_ticket = d2h->copy(s.grad, grad_sources.back());
    } else {
      s.grad = d.grad.clone();
    }
    if (pc.out == Out::kParamOut) s.param_out = at::full({sizes[i]}, -7.0, at::kBFloat16);
    if (pc.out == Out::kDeviceParam) s.device_param = at::full({sizes[i]}, -7.0, at::kBFloat16);
    segs.push_back(s);

    // Reference: one adam_step over the whole segment.
    SegmentData r{d.master.clone(), d.m.clone(), d.v.clone(), d.grad};
    const auto st = adam_step(r.master, r.grad, r.m, r.v, s.hyper, std::nullopt, /*compute_grad_stats=*/true);
    want_sq += st->grad_sq_sum;
    want_inf = want_inf || st->found_inf;
    ref.push_back(r);
  }

  const auto got = pipeline.step(segs, /*compute_grad_stats=*/true);
  ASSERT_TRUE(got.has_value());
  EXPECT_NEAR(got->grad_sq_sum, want_sq, 1e-12 * want_sq);
  EXPECT_EQ(got->found_inf, want_inf);
  for (size_t i = 0; i < segs.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(segs[i].master, ref[i].master)) << "segment " << i << " master";
    EXPECT_TRUE(bitwise_equal(segs[i].exp_avg, ref[i].m)) << "segment " << i << " exp_avg";
    EXPECT_TRUE(bitwise_equal(segs[i].exp_avg_sq, ref[i].v)) << "segment " << i << " exp_avg_sq";
    const at::Tensor want_bf16 = ref[i].master.to(at::kBFloat16);
    if (pc.out == Out::kParamOut) EXPECT_TRUE(bitwise_equal(segs[i].param_out, want_bf16)) << "segment " << i;
    if (pc.out == Out::kDeviceParam) EXPECT_TRUE(bitwise_equal(segs[i].device_param, want_bf16)) << "segment " << i;
  }
  if (pc.out == Out::kDeviceParam) {
    EXPECT_EQ(pipeline.upload_buffer_bytes(), 2 * pc.chunk_elems * 4);
    EXPECT_GT(h2d->last_ticket(), 0);
  } else {
    EXPECT_EQ(pipeline.upload_buffer_bytes(), 0);
    EXPECT_EQ(h2d->last_ticket(), 0);
  }

  // A second step reuses the buffers (and waits for the uploads of the first one before overwriting them).
  std::vector<SegmentData> ref2;
  for (size_t i = 0; i < segs.size(); ++i) {
    segs[i].hyper.step += 1;
    segs[i].grad_ticket = 0;
    SegmentData r{ref[i].master.clone(), ref[i].m.clone(), ref[i].v.clone(), segs[i].grad};
    adam_step(r.master, r.grad, r.m, r.v, segs[i].hyper);
    ref2.push_back(r);
  }
  EXPECT_FALSE(pipeline.step(segs, /*compute_grad_stats=*/false).has_value());
  for (size_t i = 0; i < segs.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(segs[i].master, ref2[i].master)) << "step 2 segment " << i;
    if (pc.out == Out::kDeviceParam)
      EXPECT_TRUE(bitwise_equal(segs[i].device_param, ref2[i].master.to(at::kBFloat16))) << "step 2 segment " << i;
  }
}

class PipelineTest : public ::testing::TestWithParam<PipelineCase> {};

TEST_P(PipelineTest, EqualsWholeSegmentAdam) { run_pipeline_case(GetParam()); }

std::vector<PipelineCase> pipeline_cases() {
  std::vector<PipelineCase> cases;
  // 1000 and 65536 + 17: chunk ends that are not on adam_step's own 64Ki boundaries (results still bitwise).
  for (int64_t chunk : {int64_t{65536}, int64_t{65536 * 2}, int64_t{1000}, int64_t{65536 + 17}})
    for (at::ScalarType g : {at::kFloat, at::kBFloat16})
      for (Out out : {Out::kNone, Out::kParamOut, Out::kDeviceParam})
        for (bool d2h : {false, true}) cases.push_back({chunk, g, out, d2h});
  return cases;
}

std::string case_name(const ::testing::TestParamInfo<PipelineCase>& info) {
  const PipelineCase& c = info.param;
  const char* out = c.out == Out::kNone ? "none" : c.out == Out::kParamOut ? "param_out" : "device_param";
  return "chunk" + std::to_string(c.chunk_elems) + "_" + (c.grad_dtype == at::kFloat ? "fp32" : "bf16") + "_" + out +
         (c.grads_through_d2h ? "_d2h" : "");
}

INSTANTIATE_TEST_SUITE_P(Cases, PipelineTest, ::testing::ValuesIn(pipeline_cases()), case_name);

// int8 state: chunks of whole 2048-element blocks (chunk_elems rounded down, at least one block), each chunk's absmax
// a slice of the segment's; the result equals one adam_step over the whole segment, an fp32 segment beside it too.
TEST(HostAdamPipeline, Int8StateEqualsWholeSegmentAdam) {
  for (const int64_t chunk : {int64_t{1}, int64_t{3000}, int64_t{8192}}) {
    auto q = make_copy_queue(c10::Device(c10::kCPU));
    HostAdamPipeline pipeline(q, q, chunk, /*pin=*/false);
    EXPECT_EQ(pipeline.int8_chunk_elems(), std::max<int64_t>(2048, chunk / 2048 * 2048));
    std::vector<OffloadSegment> segs;
    std::vector<std::vector<at::Tensor>> refs;
    const std::vector<int64_t> sizes = {5000, 2048, 7, 3001};
    for (size_t i = 0; i < sizes.size(); ++i) {
      const int64_t n = sizes[i];
      const bool int8 = i != 3;  // the last one keeps fp32 moments
      const SegmentData d = make_segment(n, at::kBFloat16, 200 + i);
      std::vector<at::Tensor> state = {d.master, d.m, d.v};
      if (int8) {
        const int64_t blocks = (n + 2047) / 2048;
        state = {d.master, at::randint(0, 256, {n}, at::kByte), at::randint(1, 256, {n}, at::kByte),
                 at::rand({blocks}) * 0.1, at::rand({blocks}) * 0.01};
      }
      OffloadSegment s;
      s.master = state[0].clone();
      s.exp_avg = state[1].clone();
      s.exp_avg_sq = state[2].clone();
      if (int8) {
        s.exp_avg_absmax = state[3].clone();
        s.exp_avg_sq_absmax = state[4].clone();
      }
      s.grad = d.grad;
      s.hyper = hyper_for(static_cast<int>(i));
      s.device_param = at::zeros({n}, at::kBFloat16);
      segs.push_back(s);
      std::vector<at::Tensor> r;
      for (const auto& t : state) r.push_back(t.clone());
      std::optional<AdamStateScales> scales;
      if (int8) scales = AdamStateScales{r[3], r[4]};
      adam_step(r[0], d.grad, r[1], r[2], s.hyper, std::nullopt, false, std::nullopt, scales);
      refs.push_back(r);
    }
    pipeline.step(segs, /*compute_grad_stats=*/false);
    q->synchronize(q->last_ticket());
    for (size_t i = 0; i < segs.size(); ++i) {
      const OffloadSegment& s = segs[i];
      const std::vector<at::Tensor> got = {s.master, s.exp_avg, s.exp_avg_sq, s.exp_avg_absmax, s.exp_avg_sq_absmax};
      for (size_t k = 0; k < refs[i].size(); ++k) {
        EXPECT_TRUE(bitwise_equal(got[k], refs[i][k])) << "chunk " << chunk << " segment " << i << " tensor " << k;
      }
      EXPECT_TRUE(bitwise_equal(s.device_param, refs[i][0].to(at::kBFloat16))) << "segment " << i << " upload";
    }
    EXPECT_EQ(pipeline.upload_buffer_bytes(), 2 * 4 * std::max<int64_t>(chunk, 2048));
  }
}

TEST(HostAdamPipeline, ValidatesBeforeWriting) {
  auto q = make_copy_queue(c10::Device(c10::kCPU));
  HostAdamPipeline pipeline(q, q, 1024, false);
  const SegmentData d = make_segment(100, at::kFloat, 1);
  OffloadSegment good{d.master.clone(), d.m.clone(), d.v.clone(), d.grad, 0, {}, {}, AdamHyper{}};
  const at::Tensor before = good.master.clone();

  auto expect_rejected = [&](OffloadSegment bad, const char* why) {
    EXPECT_ANY_THROW(pipeline.step({good, bad}, true)) << why;
    EXPECT_TRUE(bitwise_equal(good.master, before)) << why << ": the good segment was written";
  };
  OffloadSegment s = good;
  s.param_out = at::zeros({100}, at::kBFloat16);
  s.device_param = at::zeros({100}, at::kBFloat16);
  expect_rejected(s, "param_out and device_param");
  s = good;
  s.grad = at::zeros({99});
  expect_rejected(s, "grad numel");
  s = good;
  s.exp_avg = at::zeros({100}, at::kDouble);
  expect_rejected(s, "exp_avg dtype");
  s = good;
  s.hyper.beta1 = 1.5;
  expect_rejected(s, "beta1");
  s = good;
  s.grad_ticket = 5;
  expect_rejected(s, "grad_ticket never issued");
  s = good;
  s.param_out = at::zeros({100}, at::kInt);
  expect_rejected(s, "param_out dtype");
  s = good;
  s.master = at::zeros({10, 20}).t();
  expect_rejected(s, "non-contiguous master");
  EXPECT_EQ(q->last_ticket(), 0);
  EXPECT_THROW(HostAdamPipeline(q, q, 0, false), c10::ValueError);
}

}  // namespace
}  // namespace zeroshard
