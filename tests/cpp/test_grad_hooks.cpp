// GradBuffer and GradHooks (csrc/grad/): the buffer a reduction reads equals the sum of the gradients autograd
// produced, with zeros in the padding and where no gradient came, although it is never zero-filled as a whole. Every
// fresh allocation is NaN here (ATen's deterministic fill), so an element read before it is written shows. References
// are plain autograd's gradients of the same loss, in float64.
#include <gtest/gtest.h>

#include "grad/grad_buffer.h"
#include "grad/grad_hooks.h"

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

using zeroshard::FlatParamLayout;
using zeroshard::GradBuffer;
using zeroshard::GradHooks;
using Shapes = std::vector<std::vector<int64_t>>;

namespace {

// Poisons every uninitialised allocation with NaN for the test's lifetime.
struct NanEmpty {
  NanEmpty() {
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
    at::globalContext().setDeterministicFillUninitializedMemory(true);
  }
  ~NanEmpty() { at::globalContext().setDeterministicAlgorithms(false, false); }
};

const Shapes kShapes = {{3, 5}, {7}, {2, 2}};  // 15 + 7 + 4 elements: padding between and after them (align 4, world 2)

FlatParamLayout layout() { return FlatParamLayout(kShapes, 2, 4); }

// The flat buffer a reduction must read: each gradient at its offset, zeros elsewhere.
at::Tensor expected(const FlatParamLayout& l, const std::vector<at::Tensor>& grads) {
  at::Tensor out = at::zeros({l.padded_numel()}, at::kDouble);
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined()) out.narrow(0, l.offsets()[i], l.numels()[i]).copy_(grads[i].reshape(-1));
  }
  return out;
}

std::vector<at::Tensor> leaves(uint64_t seed) {
  at::manual_seed(seed);
  std::vector<at::Tensor> out;
  for (const auto& s : kShapes) out.push_back(at::randn(s).requires_grad_(true));
  return out;
}

// A loss using every parameter, so each gets a gradient that depends on the values.
at::Tensor loss_of(const std::vector<at::Tensor>& p, double scale) {
  return (p[0].pow(2).sum() + (p[1] * 3.0).sin().sum() + p[2].exp().sum()) * scale;
}

}  // namespace

TEST(GradBuffer, PaddingIsWhatNoParameterCovers) {
  GradBuffer b(layout(), at::kFloat, at::kCPU);
  // parameters at 0..15, 16..23, 24..28; padded to 32 (multiple of world 2 x align 4)
  const std::vector<std::pair<int64_t, int64_t>> gaps = {{15, 16}, {23, 24}, {28, 32}};
  EXPECT_EQ(b.padding(), gaps);
  EXPECT_FALSE(b.allocated());
}

TEST(GradBuffer, FirstGradientIsCopiedLaterOnesAddedTheRestReadsZero) {
  NanEmpty poison;
  FlatParamLayout l = layout();
  GradBuffer b(l, at::kFloat, at::kCPU);
  at::Tensor a = at::randn({3, 5}), c = at::randn({3, 5}), d = at::randn({7});
  b.accumulate(0, a);
  b.accumulate(1, d.to(at::kDouble));  // any floating dtype, converted
  b.accumulate(0, c);
  EXPECT_EQ(b.unwritten(), (std::vector<int64_t>{2}));
  EXPECT_TRUE(at::isnan(b.full()[l.offsets()[2]]).item<bool>());  // the poison shows where nothing was written yet
  b.views();
  EXPECT_TRUE(b.unwritten().empty());
  EXPECT_TRUE(at::equal(b.full().to(at::kDouble), expected(l, {(a + c).to(at::kDouble), d.to(at::kDouble), {}})));

  b.reset();  // stage 1: reads as zeros again; the next gradient is copied over the old sum
  b.accumulate(2, at::ones({2, 2}));
  b.views();
  EXPECT_TRUE(at::equal(b.full().to(at::kDouble), expected(l, {{}, {}, at::ones({2, 2}, at::kDouble)})));

  b.release();
  EXPECT_FALSE(b.allocated());
  b.views();  // a reader before any gradient: zeros everywhere
  EXPECT_TRUE(at::equal(b.full(), at::zeros({l.padded_numel()})));
}

TEST(GradBuffer, BadIndexOrShapeIsAnError) {
  GradBuffer b(layout(), at::kFloat, at::kCPU);
  EXPECT_THROW(b.accumulate(3, at::ones({2, 2})), c10::Error);
  EXPECT_THROW(b.accumulate(-1, at::ones({2, 2})), c10::Error);
  try {
    b.accumulate(1, at::ones({1}));  // would broadcast under copy_: refused instead
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("expected [7]"), std::string::npos);
  }
}

TEST(GradHooks, BackwardFillsTheBufferLikeAutogradAndReportsEachFlatParameterOnce) {
  NanEmpty poison;
  FlatParamLayout l = layout();
  std::vector<at::Tensor> p = leaves(0), ref = leaves(0);
  std::vector<at::Tensor> q = {at::randn({4}).requires_grad_(true)};  // a second flat parameter
  auto b0 = std::make_shared<GradBuffer>(l, at::kFloat, at::kCPU);
  auto b1 = std::make_shared<GradBuffer>(FlatParamLayout({{4}}, 2, 4), at::kFloat, at::kCPU);
  int firsts = 0;
  std::vector<int64_t> completed;
  GradHooks hooks({p, q}, {b0, b1}, [&] { ++firsts; }, [&](int64_t f) { completed.push_back(f); });

  for (double scale : {1.0, 0.5}) {  // two micro-batches: the second is added to the first
    (loss_of(p, scale) + q[0].sum() * scale).backward();
    loss_of(ref, scale).backward();
  }
  for (const auto& t : p) EXPECT_FALSE(t.grad().defined());  // moved into the buffer
  EXPECT_EQ(firsts, 1);                                      // until the caller ends the backward
  EXPECT_EQ(completed, (std::vector<int64_t>{0, 1}));        // once each until reset_reported()
  EXPECT_TRUE(hooks.complete(0) && hooks.complete(1));
  std::vector<at::Tensor> want;
  for (const auto& t : ref) want.push_back(t.grad().to(at::kDouble));
  b0->views();
  EXPECT_TRUE(at::allclose(b0->full().to(at::kDouble), expected(l, want), 1e-6, 1e-6));
  EXPECT_TRUE(at::equal(b1->views()[0], at::full({4}, 1.5)));
  EXPECT_EQ(hooks.take_used(0), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_TRUE(hooks.take_used(0).empty());

  hooks.set_active(false);
  hooks.reset_reported();
  p[1].sin().sum().backward();  // one parameter used: flat parameter 0 is not complete
  EXPECT_EQ(firsts, 2);
  EXPECT_FALSE(hooks.complete(0));
  EXPECT_EQ(hooks.take_used(0), (std::vector<int64_t>{1}));

  hooks.remove();  // gradients stay in .grad from now on
  p[2].sum().backward();
  EXPECT_TRUE(p[2].grad().defined());
  EXPECT_EQ(firsts, 2);
}

TEST(GradHooks, AnExceptionInACallbackEndsTheBackward) {
  std::vector<at::Tensor> p = leaves(1);
  auto b = std::make_shared<GradBuffer>(layout(), at::kFloat, at::kCPU);
  GradHooks hooks({p}, {b}, [] {}, [](int64_t) { throw std::runtime_error("launch failed"); });
  try {
    loss_of(p, 1.0).backward();
    ADD_FAILURE() << "expected the callback's error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("launch failed"), std::string::npos) << e.what();
  }
}

TEST(GradHooks, RefusesWhatItCannotHook) {
  auto b = std::make_shared<GradBuffer>(FlatParamLayout({{4}}, 1, 4), at::kFloat, at::kCPU);
  EXPECT_THROW(GradHooks({{at::ones({4})}}, {b}, [] {}, [](int64_t) {}), c10::Error);  // no requires_grad
  EXPECT_THROW(GradHooks({{}, {}}, {b}, [] {}, [](int64_t) {}), c10::Error);           // counts differ
}
