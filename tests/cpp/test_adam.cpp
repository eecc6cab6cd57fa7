// Fused CPU Adam: every ISA build against a double-precision reference of the same formula, the ISA builds against
// each other bit for bit, dtype conversions against c10's, gradient statistics, thread-count independence, and
// argument validation. ISA builds this CPU cannot run are skipped with the reason.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "adam/adam.h"
#include "adam/cpu_isa.h"
#include "isa_support.h"

namespace zeroshard {
namespace {

using test_isa::kIsas;
using test_isa::supported;
const std::vector<int64_t> kSizes = {1, 7, 8, 9, 15, 16, 17, 31, 33, 1023, kAdamChunk + 17, 1'000'003};

struct State {
  at::Tensor p, m, v;
  State clone() const { return {p.clone(), m.clone(), v.clone()}; }
};

State make_state(int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  return {at::randn({n}), at::randn({n}) * 0.1, at::rand({n}) * 0.01};
}

// Double-precision reference of the documented formula (Kingma & Ba Alg. 1, Loshchilov & Hutter decoupled decay).
void reference_step(std::vector<double>& p, std::vector<double>& m, std::vector<double>& v, const at::Tensor& grad,
                    const AdamHyper& h) {
  const at::Tensor g32 = grad.to(at::kFloat);
  const float* g = g32.data_ptr<float>();
  const double t = static_cast<double>(h.step);
  const double step_size = h.bias_correction ? h.lr / (1 - std::pow(h.beta1, t)) : h.lr;
  const double bc2_sqrt = h.bias_correction ? std::sqrt(1 - std::pow(h.beta2, t)) : 1.0;
  for (size_t i = 0; i < p.size(); ++i) {
    double gi = g[i];
    if (h.weight_decay != 0 && !h.adamw_mode) gi += h.weight_decay * p[i];
    if (h.weight_decay != 0 && h.adamw_mode) p[i] *= 1 - h.lr * h.weight_decay;
    m[i] = h.beta1 * m[i] + (1 - h.beta1) * gi;
    v[i] = h.beta2 * v[i] + (1 - h.beta2) * gi * gi;
    p[i] -= step_size * m[i] / (std::sqrt(v[i]) / bc2_sqrt + h.eps);
  }
}

std::vector<double> to_double(const at::Tensor& t) {
  const at::Tensor d = t.to(at::kDouble).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

void expect_close(const at::Tensor& got, const std::vector<double>& want, double rtol, double atol, const char* what) {
  const float* g = got.data_ptr<float>();
  int64_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!(std::abs(g[i] - want[i]) <= atol + rtol * std::abs(want[i]))) {
      if (bad++ < 3) ADD_FAILURE() << what << "[" << i << "] = " << g[i] << ", reference " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size() << " elements out of tolerance";
}

void expect_bitwise(const at::Tensor& a, const at::Tensor& b, const char* what) {
  ASSERT_EQ(a.nbytes(), b.nbytes());
  EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0) << what << " differs bitwise";
}

class AdamIsa : public ::testing::TestWithParam<std::string> {};

TEST_P(AdamIsa, MatchesDoubleReferenceOnEveryTailSize) {
  const std::string isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  for (bool adamw : {true, false}) {
    for (bool bc : {true, false}) {
      for (int64_t n : kSizes) {
        if (n > 100'000 && !(adamw && bc)) continue;  // the big size once is enough for the tail logic
        State s = make_state(n, 7);
        std::vector<double> p = to_double(s.p), m = to_double(s.m), v = to_double(s.v);
        AdamHyper h{1, 1e-2, 0.9, 0.999, 1e-8, 0.05, adamw, bc};
        for (int64_t step = 1; step <= 5; ++step) {
          h.step = step;
          at::manual_seed(100 + step);
          const at::Tensor g = at::randn({n});
          adam_step(s.p, g, s.m, s.v, h, std::nullopt, false, isa);
          reference_step(p, m, v, g, h);
        }
        SCOPED_TRACE("n=" + std::to_string(n) + " adamw=" + std::to_string(adamw) + " bc=" + std::to_string(bc));
        expect_close(s.m, m, 1e-5, 1e-7, "exp_avg");
        expect_close(s.v, v, 1e-5, 1e-9, "exp_avg_sq");
        expect_close(s.p, p, 1e-5, 1e-6, "param");
      }
    }
  }
}

TEST_P(AdamIsa, BitwiseEqualToScalarBuildForEveryDtype) {
  const std::string isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  for (at::ScalarType gt : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (at::ScalarType ot : {at::kBFloat16, at::kHalf, at::kFloat}) {
      for (int64_t n : std::vector<int64_t>{1, 15, 17, 1023, 2 * kAdamChunk + 33}) {
        State a = make_state(n, 3), b = a.clone();
        at::manual_seed(11);
        const at::Tensor g = (at::randn({n}) * 3).to(gt);
        at::Tensor oa = at::empty({n}, ot), ob = at::empty({n}, ot);
        for (bool adamw : {true, false}) {
          AdamHyper h{3, 1e-3, 0.9, 0.999, 1e-8, 0.1, adamw, true};
          const auto sa = adam_step(a.p, g, a.m, a.v, h, oa, true, "scalar");
          const auto sb = adam_step(b.p, g, b.m, b.v, h, ob, true, isa);
          SCOPED_TRACE("n=" + std::to_string(n) + " grad " + std::string(c10::toString(gt)) + " out " +
                       c10::toString(ot));
          expect_bitwise(a.p, b.p, "param");
          expect_bitwise(a.m, b.m, "exp_avg");
          expect_bitwise(a.v, b.v, "exp_avg_sq");
          expect_bitwise(oa, ob, "param_out");
          // Sums run in a different order per vector width: equal to rounding.
          EXPECT_NEAR(sa->grad_sq_sum, sb->grad_sq_sum, 1e-12 * sa->grad_sq_sum);
          EXPECT_FALSE(sb->found_inf);
        }
      }
    }
  }
}

// bf16 parameters with no master: the same arithmetic as the fp32 path from the upcast value, rounded once (to
// nearest even, as c10::BFloat16 rounds), on every tail size; moments bitwise equal to the fp32 path's.
TEST_P(AdamIsa, Bf16ParamsEqualFp32PathRoundedOnce) {
  const std::string isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  for (int64_t n : std::vector<int64_t>{1, 7, 15, 16, 17, 33, 1023, kAdamChunk + 17}) {
    for (at::ScalarType gt : {at::kBFloat16, at::kFloat}) {
      State s = make_state(n, 5);
      at::Tensor p16 = s.p.to(at::kBFloat16);
      State r{p16.to(at::kFloat), s.m.clone(), s.v.clone()};
      for (bool adamw : {true, false}) {
        AdamHyper h{2, 1e-2, 0.9, 0.999, 1e-8, 0.1, adamw, true};
        at::manual_seed(21);
        const at::Tensor g = at::randn({n}).to(gt);
        adam_step(p16, g, s.m, s.v, h, std::nullopt, false, isa);
        adam_step(r.p, g, r.m, r.v, h, std::nullopt, false, "scalar");
        SCOPED_TRACE("n=" + std::to_string(n) + " grad " + std::string(c10::toString(gt)) +
                     " adamw=" + std::to_string(adamw));
        expect_bitwise(p16, r.p.to(at::kBFloat16), "bf16 param");
        expect_bitwise(s.m, r.m, "exp_avg");
        expect_bitwise(s.v, r.v, "exp_avg_sq");
        r.p = p16.to(at::kFloat);  // the next step starts from the rounded value on both paths
      }
    }
  }
}

TEST_P(AdamIsa, LowPrecisionGradsAreUpcastExactly) {
  // Every 16-bit pattern as a gradient: stepping with the 16-bit tensor equals stepping with c10's fp32 upcast of it.
  const std::string isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  const int64_t n = 65536;
  for (at::ScalarType gt : {at::kBFloat16, at::kHalf}) {
    // NaN patterns are zeroed: their payload bits carry no meaning and may differ between conversions.
    const at::Tensor all = at::arange(n, at::kInt).to(at::kShort).view(gt);
    const at::Tensor g = all.masked_fill(all.to(at::kFloat).isnan(), 0);
    const at::Tensor g32 = g.to(at::kFloat);
    State a = make_state(n, 5), b = a.clone();
    AdamHyper h{2, 1e-3, 0.9, 0.999, 1e-8, 0.0, true, true};
    const auto sa = adam_step(a.p, g, a.m, a.v, h, std::nullopt, true, isa);
    const auto sb = adam_step(b.p, g32, b.m, b.v, h, std::nullopt, true, isa);
    SCOPED_TRACE(c10::toString(gt));
    expect_bitwise(a.p, b.p, "param");
    expect_bitwise(a.m, b.m, "exp_avg");
    expect_bitwise(a.v, b.v, "exp_avg_sq");
    EXPECT_TRUE(sa->found_inf);  // the patterns include +-inf
    EXPECT_TRUE(sb->found_inf);
  }
}

// Patterns that exercise rounding: ties to even both ways, just above/below ties, NaNs (quiet, signalling, negative),
// infinities, the largest float (rounds to inf in bf16 and fp16), fp16 subnormals and the fp16 overflow boundary.
std::vector<uint32_t> rounding_patterns() {
  std::vector<uint32_t> u = {0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF818000, 0x7FC00000, 0x7FC00001,
                             0x7F800001, 0xFFC00000, 0xFF800001, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF,
                             0x00000000, 0x80000000, 0x00000001, 0x33800000, 0x33800001, 0x33C00000, 0x387FE000,
                             0x387FF000, 0x38800000, 0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x3F801000,
                             0x3F803000, 0x3F800FFF, 0x3F802000};
  uint32_t x = 12345;
  for (int i = 0; i < 200000; ++i) {  // plus random patterns over the whole range
    x = x * 1664525u + 1013904223u;
    u.push_back(x);
  }
  return u;
}

TEST_P(AdamIsa, ParamOutRoundsToNearestEvenLikeC10) {
  // lr = 0 and zero gradient/moments leave param unchanged (p + -0), so param_out is exactly convert(param).
  const std::string isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  const std::vector<uint32_t> pat = rounding_patterns();
  const int64_t n = static_cast<int64_t>(pat.size());
  at::Tensor p = at::empty({n}, at::kFloat);
  std::memcpy(p.data_ptr(), pat.data(), n * sizeof(uint32_t));
  const float* pf = p.data_ptr<float>();
  at::Tensor g = at::zeros({n}), m = at::zeros({n}), v = at::zeros({n});
  at::Tensor ob = at::empty({n}, at::kBFloat16), oh = at::empty({n}, at::kHalf);
  AdamHyper h{1, 0.0, 0.9, 0.999, 1e-8, 0.0, true, true};
  const at::Tensor p0 = p.clone();
  adam_step(p, g, m, v, h, ob, false, isa);
  // Unchanged, except that arithmetic quiets signalling NaNs (p + -0).
  EXPECT_TRUE(at::equal(p.isnan(), p0.isnan()));
  EXPECT_TRUE(at::equal(p.nan_to_num(0, 0, 0).view(at::kInt), p0.nan_to_num(0, 0, 0).view(at::kInt)));
  adam_step(p, g, m, v, h, oh, false, isa);
  const uint16_t* b = reinterpret_cast<const uint16_t*>(ob.data_ptr());
  const uint16_t* hh = reinterpret_cast<const uint16_t*>(oh.data_ptr());
  int64_t bad_b = 0, bad_h = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t want_b = c10::BFloat16(pf[i]).x;  // c10: RNE, NaN -> 0x7FC0
    if (b[i] != want_b && bad_b++ < 3)
      ADD_FAILURE() << std::hex << "bf16(" << pat[i] << ") = " << b[i] << " want " << want_b;
    const uint16_t want_h = c10::Half(pf[i]).x;
    const bool nan_h = (want_h & 0x7C00) == 0x7C00 && (want_h & 0x3FF);
    const bool got_nan_h = (hh[i] & 0x7C00) == 0x7C00 && (hh[i] & 0x3FF);
    const bool ok_h = nan_h ? got_nan_h : hh[i] == want_h;  // NaN payloads may differ between F16C and software
    if (!ok_h && bad_h++ < 3) ADD_FAILURE() << std::hex << "fp16(" << pat[i] << ") = " << hh[i] << " want " << want_h;
  }
  EXPECT_EQ(bad_b, 0);
  EXPECT_EQ(bad_h, 0);
  EXPECT_EQ(b[0], 0x3F80);  // tie, even lsb: down
  EXPECT_EQ(b[1], 0x3F82);  // tie, odd lsb: up
  EXPECT_EQ(b[2], 0x3F81);  // above tie: up
  EXPECT_EQ(b[5], 0x7FC0);  // NaN stays NaN
  EXPECT_EQ(b[9], 0x7FC0);  // negative signalling NaN too
}

TEST_P(AdamIsa, GradStatsSumOfSquaresAndInf) {
  const std::string isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  for (int64_t n : std::vector<int64_t>{1, 17, 1023, 3 * kAdamChunk + 5}) {
    State s = make_state(n, 9);
    at::manual_seed(12);
    at::Tensor g = at::randn({n}) * 1e3;
    const double want = g.to(at::kDouble).pow(2).sum().item<double>();
    AdamHyper h;
    auto st = adam_step(s.p, g, s.m, s.v, h, std::nullopt, true, isa);
    ASSERT_TRUE(st.has_value());
    EXPECT_NEAR(st->grad_sq_sum, want, 1e-12 * want) << "n=" << n;
    EXPECT_FALSE(st->found_inf);
    // Large finite values overflow float squares but not the double accumulator: not an inf.
    g.fill_(3e38f);
    st = adam_step(s.p, g, s.m, s.v, h, std::nullopt, true, isa);
    EXPECT_FALSE(st->found_inf);
    const double big = g.to(at::kDouble).pow(2).sum().item<double>();
    EXPECT_NEAR(st->grad_sq_sum, big, 1e-12 * big);
    for (float bad : {INFINITY, -INFINITY, NAN}) {
      g.fill_(1.0f);
      g[n - 1].fill_(bad);  // the very last element: in the tail for most sizes
      st = adam_step(s.p, g, s.m, s.v, h, std::nullopt, true, isa);
      EXPECT_TRUE(st->found_inf) << "n=" << n << " value " << bad;
    }
  }
  State s = make_state(5, 1);
  EXPECT_FALSE(adam_step(s.p, at::zeros({5}), s.m, s.v, AdamHyper{}, std::nullopt, false, isa).has_value());
}

TEST_P(AdamIsa, ResultsDoNotDependOnThreadCount) {
  const std::string isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  const int old = at::get_num_threads();
  const int64_t n = 5 * kAdamChunk + 77;
  State a = make_state(n, 21), b = a.clone();
  at::manual_seed(22);
  const at::Tensor g = at::randn({n}).to(at::kBFloat16);
  at::Tensor oa = at::empty({n}, at::kBFloat16), ob = at::empty({n}, at::kBFloat16);
  AdamHyper h{4, 1e-3, 0.9, 0.999, 1e-8, 0.01, true, true};
  at::set_num_threads(1);
  const auto sa = adam_step(a.p, g, a.m, a.v, h, oa, true, isa);
  at::set_num_threads(2);
  const auto sb = adam_step(b.p, g, b.m, b.v, h, ob, true, isa);
  at::set_num_threads(old);
  expect_bitwise(a.p, b.p, "param");
  expect_bitwise(a.m, b.m, "exp_avg");
  expect_bitwise(a.v, b.v, "exp_avg_sq");
  expect_bitwise(oa, ob, "param_out");
  EXPECT_EQ(sa->grad_sq_sum, sb->grad_sq_sum);  // bitwise: fixed chunks summed in a fixed order
}

TEST_P(AdamIsa, GradScaleEqualsTwoInPlaceMultipliesFirst) {
  // grad_unscale then grad_clip, folded into the pass, give the bits of g.mul_(unscale).mul_(clip) before the step.
  const std::string isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  const int64_t n = kAdamChunk + 21;
  for (bool adamw : {true, false}) {
    State a = make_state(n, 31), b = a.clone();
    at::manual_seed(32);
    const at::Tensor g = at::randn({n}) * 1e4;
    AdamHyper h{2, 1e-3, 0.9, 0.999, 1e-8, 0.1, adamw, true};
    h.grad_unscale = 1.0 / 65536;
    h.grad_clip = 0.3183099;  // not a power of two: the product rounds
    at::Tensor oa = at::empty({n}, at::kBFloat16), ob = at::empty({n}, at::kBFloat16);
    const auto sa = adam_step(a.p, g, a.m, a.v, h, oa, true, isa);
    const at::Tensor g2 = g.clone().mul_(h.grad_unscale).mul_(static_cast<float>(h.grad_clip));
    AdamHyper plain = h;
    plain.grad_unscale = plain.grad_clip = 1.0;
    adam_step(b.p, g2, b.m, b.v, plain, ob, false, isa);
    expect_bitwise(a.p, b.p, "param");
    expect_bitwise(a.m, b.m, "exp_avg");
    expect_bitwise(a.v, b.v, "exp_avg_sq");
    expect_bitwise(oa, ob, "param_out");
    // The statistics are those of the gradient as stored, before scaling.
    const double want = g.to(at::kDouble).pow(2).sum().item<double>();
    EXPECT_NEAR(sa->grad_sq_sum, want, 1e-12 * want);
  }
}

TEST_P(AdamIsa, TrafficReferenceKeepsEveryValue) {
  const std::string isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  for (int64_t n : std::vector<int64_t>{1, 17, 3 * kAdamChunk + 5}) {
    State s = make_state(n, 41);
    const State before = s.clone();
    const at::Tensor g = at::randn({n}), g0 = g.clone();
    adam_traffic_reference(s.p, g, s.m, s.v, isa);
    expect_bitwise(s.p, before.p, "param");
    expect_bitwise(s.m, before.m, "exp_avg");
    expect_bitwise(s.v, before.v, "exp_avg_sq");
    expect_bitwise(g, g0, "grad");
  }
  State s = make_state(8, 1);
  EXPECT_THROW(adam_traffic_reference(s.p, at::randn({8}).to(at::kBFloat16), s.m, s.v, isa), c10::Error);
}

INSTANTIATE_TEST_SUITE_P(AllIsas, AdamIsa, ::testing::ValuesIn(kIsas),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// --- Validation: each bad argument throws with a message naming it, and nothing is written.

template <class F>
void expect_throws_untouched(F&& call, const State& s, const std::string& needle) {
  const State before = s.clone();
  try {
    call();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  expect_bitwise(s.p, before.p, "param after a rejected call");
  expect_bitwise(s.m, before.m, "exp_avg after a rejected call");
  expect_bitwise(s.v, before.v, "exp_avg_sq after a rejected call");
}

TEST(AdamValidation, RejectsBadArgumentsBeforeWriting) {
  State s = make_state(64, 2);
  const at::Tensor g = at::randn({64});
  const AdamHyper ok;
  auto with = [&](auto mutate) {
    AdamHyper h = ok;
    mutate(h);
    return h;
  };
  expect_throws_untouched([&] { adam_step(s.p, g.to(at::kDouble), s.m, s.v, ok); }, s, "grad has dtype");
  expect_throws_untouched([&] { adam_step(s.p, at::randn({65}), s.m, s.v, ok); }, s, "grad has 65 elements");
  expect_throws_untouched([&] { adam_step(s.p, at::randn({128}).slice(0, 0, 128, 2), s.m, s.v, ok); }, s,
                          "grad is not contiguous");
  expect_throws_untouched([&] { adam_step(s.p, g, s.m, s.m, ok); }, s, "share memory");
  expect_throws_untouched([&] { adam_step(s.p, g, s.m, s.v, ok, at::empty({64}, at::kInt)); }, s,
                          "param_out has dtype");
  expect_throws_untouched([&] { adam_step(s.p, g, s.m, s.v, ok, at::empty({64}, at::kHalf), false, "sse9"); }, s,
                          "sse9");
  expect_throws_untouched([&] { adam_step(s.p, g, s.m, s.v, with([](AdamHyper& h) { h.lr = -1; })); }, s, "lr=-1");
  expect_throws_untouched([&] { adam_step(s.p, g, s.m, s.v, with([](AdamHyper& h) { h.beta1 = 1.0; })); }, s,
                          "beta1=1");
  expect_throws_untouched([&] { adam_step(s.p, g, s.m, s.v, with([](AdamHyper& h) { h.beta2 = -0.1; })); }, s,
                          "beta2=-0.1");
  expect_throws_untouched([&] { adam_step(s.p, g, s.m, s.v, with([](AdamHyper& h) { h.eps = -1; })); }, s, "eps");
  expect_throws_untouched([&] { adam_step(s.p, g, s.m, s.v, with([](AdamHyper& h) { h.weight_decay = -1; })); }, s,
                          "weight_decay");
  expect_throws_untouched([&] { adam_step(s.p, g, s.m, s.v, with([](AdamHyper& h) { h.step = 0; })); }, s, "step=0");
  expect_throws_untouched([&] { adam_step(s.p, g, s.m, s.v, with([](AdamHyper& h) { h.grad_clip = NAN; })); }, s,
                          "grad_clip=nan");
  expect_throws_untouched([&] { adam_step(s.p, g, s.m, s.v, with([](AdamHyper& h) { h.grad_unscale = -1; })); }, s,
                          "grad_unscale=-1");
  expect_throws_untouched([&] { adam_step(s.p, g.to_sparse(), s.m, s.v, ok); }, s, "dense");
  State d{s.p.to(at::kDouble), s.m, s.v};
  expect_throws_untouched([&] { adam_step(d.p, g, d.m, d.v, ok); }, s, "param has dtype");
  const at::Tensor half_p = s.p.to(at::kHalf);
  expect_throws_untouched([&] { adam_step(half_p, g, s.m, s.v, ok); }, s, "param has dtype Half");
  const at::Tensor bf16_p = s.p.to(at::kBFloat16);
  expect_throws_untouched([&] { adam_step(bf16_p, g, s.m, s.v, ok, at::empty({64}, at::kBFloat16)); }, s,
                          "param is bfloat16 and param_out is given");
}

TEST(CpuIsa, DetectionAndOverrides) {
  const auto& isas = supported_cpu_isas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), CpuIsa::kScalar);
  EXPECT_EQ(resolve_cpu_isa(), isas.back());
  EXPECT_EQ(resolve_cpu_isa("scalar"), CpuIsa::kScalar);
  ::setenv("ZEROSHARD_CPU_ISA", "scalar", 1);
  EXPECT_EQ(cpu_isa(), "scalar");
  ::setenv("ZEROSHARD_CPU_ISA", "avx3", 1);
  try {
    cpu_isa();
    ADD_FAILURE() << "an unknown ISA name must throw";
  } catch (const c10::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("ZEROSHARD_CPU_ISA='avx3'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("supports scalar"), std::string::npos) << msg;
  }
  ::unsetenv("ZEROSHARD_CPU_ISA");
  if (!supported("avx512")) {
    try {
      resolve_cpu_isa("avx512");
      ADD_FAILURE() << "forcing an ISA the CPU lacks must throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("cannot run"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace zeroshard
