// State formats of the fused CPU Adam (adam_state_format.h): bf16 moments and block-wise dynamic 8-bit moments.
// Quantisation against an independent scalar reference (nearest map value by distance in double), the fused step
// against "dequantise, fp32 step, requantise" done with separate calls, every ISA build bit-equal to the scalar one
// on tails and tiny blocks, thread-count independence, NaN/inf in a block, and argument validation. ISA builds this
// CPU cannot run are skipped with the reason.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "adam/adam.h"
#include "adam/adam_state_format.h"
#include "adam/cpu_isa.h"
#include "isa_support.h"

namespace zeroshard {
namespace {

using test_isa::kIsas;
using test_isa::supported;
const std::vector<int64_t> kSizes = {1, 7, 2047, 2048, 2049, 3 * 2048 + 5, kAdamChunk + 3 * 2048 + 17};

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.numel() == b.numel() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

// Independent reference of the nearest code: the index k minimising |x - map[k]| in double; on a tie the larger k.
uint8_t ref_code(float x, const std::vector<float>& map) {
  int best = 0;
  double best_d = std::fabs(static_cast<double>(x) - map[0]);
  for (int k = 1; k < 256; ++k) {
    const double d = std::fabs(static_cast<double>(x) - map[k]);
    if (d <= best_d) {  // <=: ties to the larger code
      best = k;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best);
}

std::vector<float> map_of(bool is_signed) {
  const at::Tensor m = adam_dynamic_map(is_signed);
  return std::vector<float>(m.data_ptr<float>(), m.data_ptr<float>() + 256);
}

// Reference block-wise quantisation of x: per block, absmax = max |x|, code = ref_code(x / absmax) (0 -> 1 divisor),
// at least 1 for the unsigned map (exp_avg_sq: a positive second moment never reads back as 0).
void ref_quantize(const at::Tensor& x, bool is_signed, at::Tensor& codes, at::Tensor& absmax) {
  const std::vector<float> map = map_of(is_signed);
  const int64_t n = x.numel();
  codes = at::empty({n}, at::kByte);
  absmax = at::empty({adam_quant_blocks(n)}, at::kFloat);
  const float* px = x.data_ptr<float>();
  for (int64_t b = 0; b < adam_quant_blocks(n); ++b) {
    const int64_t e = std::min(n, (b + 1) * kAdamQuantBlock);
    float a = 0.f;
    for (int64_t i = b * kAdamQuantBlock; i < e; ++i) a = std::max(a, std::fabs(px[i]));
    absmax.data_ptr<float>()[b] = a;
    const float d = a == 0.f ? 1.f : a;
    for (int64_t i = b * kAdamQuantBlock; i < e; ++i) {
      const uint8_t c = ref_code(px[i] / d, map);
      codes.data_ptr<uint8_t>()[i] = is_signed || c > 0 ? c : 1;  // exp_avg_sq never takes code 0
    }
  }
}

at::Tensor ref_dequantize(const at::Tensor& codes, const at::Tensor& absmax, bool is_signed) {
  const std::vector<float> map = map_of(is_signed);
  at::Tensor out = at::empty({codes.numel()}, at::kFloat);
  for (int64_t i = 0; i < codes.numel(); ++i) {
    out.data_ptr<float>()[i] = map[codes.data_ptr<uint8_t>()[i]] * absmax.data_ptr<float>()[i / kAdamQuantBlock];
  }
  return out;
}

struct Int8State {
  at::Tensor p, m, v, ma, va;
  Int8State clone() const { return {p.clone(), m.clone(), v.clone(), ma.clone(), va.clone()}; }
  AdamStateScales scales() const { return {ma, va}; }
};

// A state after one step from zero moments with lr = 0: realistic codes and scales, param unchanged.
Int8State make_int8(int64_t n, uint64_t seed) {
  at::manual_seed(seed);
  Int8State s{at::randn({n}), at::zeros({n}, at::kByte), at::zeros({n}, at::kByte), at::zeros({adam_quant_blocks(n)}),
              at::zeros({adam_quant_blocks(n)})};
  AdamHyper h;
  h.lr = 0.0;
  adam_step(s.p, at::randn({n}) * 0.1, s.m, s.v, h, std::nullopt, false, "scalar", s.scales());
  return s;
}

AdamHyper hyper(int64_t step) {
  AdamHyper h;
  h.step = step;
  h.lr = 1e-2;
  h.weight_decay = 0.01;
  return h;
}

TEST(AdamStateFormats, DynamicMapsAreBitsandbytesShaped) {
  const std::vector<float> s = map_of(true), u = map_of(false);
  EXPECT_EQ(s[255], 1.f);
  EXPECT_EQ(s[127], 0.f);  // 127 negative values, zero, 127 positive, one
  EXPECT_EQ(u[0], 0.f);
  EXPECT_EQ(u[255], 1.f);
  EXPECT_NEAR(s[0], -0.99297f, 1e-5);
  for (int k = 1; k < 256; ++k) {
    EXPECT_LT(s[k - 1], s[k]);
    EXPECT_LT(u[k - 1], u[k]);
  }
  // Thresholds are exact midpoints rounded up: x >= t[k] iff x >= (map[k-1] + map[k]) / 2.
  const at::Tensor t = adam_dynamic_map_thresholds(true);
  for (int k = 1; k < 256; ++k) {
    const double mid = (static_cast<double>(s[k - 1]) + s[k]) / 2;
    const float tk = t.data_ptr<float>()[k];
    EXPECT_GE(static_cast<double>(tk), mid);
    EXPECT_LT(static_cast<double>(std::nextafter(tk, -1.f)), mid);
  }
}

// beta1 = beta2 = 0 makes the step store m = g and v = g * g exactly, so the state is the quantisation of known values.
TEST(AdamStateFormats, QuantizeRoundTripMatchesScalarReference) {
  for (const std::string& isa : kIsas) {
    if (!supported(isa)) continue;
    for (int64_t n : kSizes) {
      at::manual_seed(n);
      at::Tensor g = at::randn({n}) * at::exp(at::randn({n}) * 3);   // values over many decades
      if (n > 100) g.index_put_({at::indexing::Slice(0, 50)}, 0.f);  // zeros in the first block
      Int8State s{at::randn({n}), at::zeros({n}, at::kByte), at::zeros({n}, at::kByte),
                  at::zeros({adam_quant_blocks(n)}), at::zeros({adam_quant_blocks(n)})};
      AdamHyper h;
      h.beta1 = 0.0;
      h.beta2 = 0.0;
      adam_step(s.p, g, s.m, s.v, h, std::nullopt, false, isa, s.scales());
      at::Tensor rm, rma, rv, rva;
      ref_quantize(g, true, rm, rma);
      ref_quantize(g * g, false, rv, rva);
      ASSERT_TRUE(same_bits(s.ma, rma)) << isa << " n=" << n;
      ASSERT_TRUE(same_bits(s.va, rva)) << isa << " n=" << n;
      ASSERT_TRUE(same_bits(s.m, rm)) << isa << " n=" << n;
      ASSERT_TRUE(same_bits(s.v, rv)) << isa << " n=" << n;
      // Dequantised error within half the widest gap of the map (0.9 / 64 / 2 signed) times absmax.
      const at::Tensor dm = ref_dequantize(s.m, s.ma, true);
      const at::Tensor scale = s.ma.repeat_interleave(kAdamQuantBlock).slice(0, 0, n);
      EXPECT_LE((dm - g).abs().div(scale.clamp_min(1e-30)).max().item<float>(), 0.0071f) << isa << " n=" << n;
    }
  }
}

// The fused int8 step equals dequantise -> fp32 step (the fp32 kernel) -> requantise, bit for bit.
TEST(AdamStateFormats, FusedInt8StepEqualsDequantizeStepRequantize) {
  for (int64_t n : kSizes) {
    Int8State s = make_int8(n, 7);
    for (int64_t step = 1; step <= 3; ++step) {
      const at::Tensor g = at::randn({n}).to(at::kBFloat16);
      at::Tensor p32 = s.p.clone(), m32 = ref_dequantize(s.m, s.ma, true), v32 = ref_dequantize(s.v, s.va, false);
      at::Tensor out32 = at::empty({n}, at::kBFloat16), out8 = at::empty({n}, at::kBFloat16);
      const auto st32 = adam_step(p32, g, m32, v32, hyper(step), out32, true, "scalar");
      const auto st8 = adam_step(s.p, g, s.m, s.v, hyper(step), out8, true, "scalar", s.scales());
      ASSERT_TRUE(same_bits(s.p, p32)) << "n=" << n;
      ASSERT_TRUE(same_bits(out8, out32)) << "n=" << n;
      ASSERT_EQ(st8->grad_sq_sum, st32->grad_sq_sum);
      at::Tensor rm, rma, rv, rva;
      ref_quantize(m32, true, rm, rma);
      ref_quantize(v32, false, rv, rva);
      ASSERT_TRUE(same_bits(s.m, rm) && same_bits(s.ma, rma)) << "n=" << n << " step " << step;
      ASSERT_TRUE(same_bits(s.v, rv) && same_bits(s.va, rva)) << "n=" << n << " step " << step;
    }
  }
}

// bf16 moments: the fp32 step on the upcast moments, each moment rounded to nearest even on store.
TEST(AdamStateFormats, Bf16StateEqualsFp32StepRoundedOnStore) {
  for (const std::string& isa : kIsas) {
    if (!supported(isa)) continue;
    for (int64_t n : kSizes) {
      at::manual_seed(n);
      at::Tensor p = at::randn({n}), m = (at::randn({n}) * 0.1).to(at::kBFloat16),
                 v = (at::rand({n}) * 0.01).to(at::kBFloat16);
      at::Tensor p32 = p.clone(), m32 = m.to(at::kFloat), v32 = v.to(at::kFloat);
      const at::Tensor g = at::randn({n});
      adam_step(p, g, m, v, hyper(3), std::nullopt, false, isa);
      adam_step(p32, g, m32, v32, hyper(3), std::nullopt, false, isa);
      ASSERT_TRUE(same_bits(p, p32)) << isa << " n=" << n;
      ASSERT_TRUE(same_bits(m, m32.to(at::kBFloat16))) << isa << " n=" << n;
      ASSERT_TRUE(same_bits(v, v32.to(at::kBFloat16))) << isa << " n=" << n;
    }
  }
}

class StateFormatIsa : public ::testing::TestWithParam<std::string> {};

TEST_P(StateFormatIsa, BitwiseEqualToScalarBuild) {
  const std::string isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  for (int64_t n : kSizes) {
    for (auto gdt : {at::kFloat, at::kBFloat16}) {
      Int8State a = make_int8(n, 3), b = a.clone();
      at::Tensor c = a.p.clone(), cm = (at::randn({n}) * 0.1).to(at::kBFloat16), cv = (at::rand({n})).to(at::kBFloat16);
      at::Tensor d = c.clone(), dm = cm.clone(), dv = cv.clone();
      for (int64_t step = 1; step <= 4; ++step) {
        const at::Tensor g = at::randn({n}).to(gdt);
        at::Tensor oa = at::empty({n}, at::kBFloat16), ob = at::empty({n}, at::kBFloat16);
        const auto sa = adam_step(a.p, g, a.m, a.v, hyper(step), oa, true, "scalar", a.scales());
        const auto sb = adam_step(b.p, g, b.m, b.v, hyper(step), ob, true, isa, b.scales());
        ASSERT_TRUE(same_bits(a.p, b.p) && same_bits(oa, ob)) << isa << " n=" << n << " step " << step;
        ASSERT_TRUE(same_bits(a.m, b.m) && same_bits(a.v, b.v)) << isa << " n=" << n << " step " << step;
        ASSERT_TRUE(same_bits(a.ma, b.ma) && same_bits(a.va, b.va)) << isa << " n=" << n << " step " << step;
        // Sums run in a different order per vector width: equal to rounding (as for fp32 state).
        EXPECT_NEAR(sa->grad_sq_sum, sb->grad_sq_sum, 1e-12 * sa->grad_sq_sum);
        adam_step(c, g, cm, cv, hyper(step), std::nullopt, false, "scalar");
        adam_step(d, g, dm, dv, hyper(step), std::nullopt, false, isa);
        ASSERT_TRUE(same_bits(c, d) && same_bits(cm, dm) && same_bits(cv, dv)) << "bf16 state " << isa << " n=" << n;
      }
    }
  }
}

// NaN or inf in a block: that step's param update is the fp32 one (non-finite only where the gradient was); the
// block's absmax becomes NaN, so from the next step on every element of that block is NaN. Other blocks are
// untouched. The same bits in every build.
TEST_P(StateFormatIsa, NonFiniteValueTurnsItsBlockNaN) {
  const std::string isa = GetParam();
  SKIP_IF_UNSUPPORTED(isa);
  const int64_t n = 3 * 2048 + 5;
  for (float bad : {NAN, INFINITY}) {
    Int8State s = make_int8(n, 5), ref = s.clone();
    at::Tensor g = at::randn({n});
    g.data_ptr<float>()[2048 + 100] = bad;  // block 1
    adam_step(s.p, g, s.m, s.v, hyper(1), std::nullopt, false, isa, s.scales());
    adam_step(ref.p, g, ref.m, ref.v, hyper(1), std::nullopt, false, "scalar", ref.scales());
    ASSERT_TRUE(same_bits(s.p, ref.p) && same_bits(s.m, ref.m) && same_bits(s.ma, ref.ma)) << isa;
    EXPECT_TRUE(std::isnan(s.ma.data_ptr<float>()[1]) && std::isnan(s.va.data_ptr<float>()[1]));
    EXPECT_TRUE(s.ma.index({at::tensor({0, 2, 3})}).isfinite().all().item<bool>());
    EXPECT_FALSE(std::isfinite(s.p.data_ptr<float>()[2048 + 100]));
    EXPECT_EQ(s.p.isfinite().logical_not().sum().item<int64_t>(), 1);  // only the element torch would poison
    adam_step(s.p, at::randn({n}), s.m, s.v, hyper(2), std::nullopt, false, isa, s.scales());
    EXPECT_TRUE(s.p.slice(0, 2048, 4096).isnan().all().item<bool>());
    EXPECT_TRUE(s.p.slice(0, 0, 2048).isfinite().all().item<bool>());
    EXPECT_TRUE(s.p.slice(0, 4096, n).isfinite().all().item<bool>());
  }
}

INSTANTIATE_TEST_SUITE_P(Isas, StateFormatIsa, ::testing::ValuesIn(kIsas), [](const auto& info) { return info.param; });

TEST(AdamStateFormats, Int8ResultsDoNotDependOnThreadCount) {
  const int64_t n = 3 * kAdamChunk + 2048 * 5 + 11;
  const int threads = at::get_num_threads();
  Int8State a = make_int8(n, 9), b = a.clone();
  const at::Tensor g = at::randn({n});
  at::set_num_threads(1);
  const auto sa = adam_step(a.p, g, a.m, a.v, hyper(1), std::nullopt, true, std::nullopt, a.scales());
  at::set_num_threads(std::max(2, threads));
  const auto sb = adam_step(b.p, g, b.m, b.v, hyper(1), std::nullopt, true, std::nullopt, b.scales());
  at::set_num_threads(threads);
  EXPECT_TRUE(same_bits(a.p, b.p) && same_bits(a.m, b.m) && same_bits(a.v, b.v));
  EXPECT_TRUE(same_bits(a.ma, b.ma) && same_bits(a.va, b.va));
  EXPECT_EQ(sa->grad_sq_sum, sb->grad_sq_sum);
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << needle;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos) << e.what_without_backtrace();
  }
}

TEST(AdamStateFormats, RejectsBadStateBeforeWriting) {
  const int64_t n = 5000;
  Int8State s = make_int8(n, 1);
  const Int8State before = s.clone();
  const at::Tensor g = at::randn({n});
  expect_error([&] { adam_step(s.p, g, s.m, s.v, hyper(1)); }, "exp_avg_absmax is missing");
  expect_error(
      [&] { adam_step(s.p, g, s.m, s.v, hyper(1), std::nullopt, false, std::nullopt, {{s.ma, at::zeros({2})}}); },
      "ceil(5000 / 2048) = 3");
  expect_error(
      [&] { adam_step(s.p, g, s.m, s.v, hyper(1), std::nullopt, false, std::nullopt, {{s.ma, s.va.to(at::kDouble)}}); },
      "absmax scales are float32");
  expect_error([&] { adam_step(s.p, g, s.m, s.v.to(at::kFloat), hyper(1)); },
               "both moments must have one state format");
  at::Tensor m32 = at::zeros({n}), v32 = at::zeros({n});
  expect_error([&] { adam_step(s.p, g, m32, v32, hyper(1), std::nullopt, false, std::nullopt, s.scales()); },
               "belong to int8 state");
  expect_error([&] { adam_step(s.p, g, s.m.to(at::kChar), s.v.to(at::kChar), hyper(1)); }, "uint8 codes");
  EXPECT_TRUE(same_bits(s.p, before.p) && same_bits(s.m, before.m) && same_bits(s.ma, before.ma));
}

}  // namespace
}  // namespace zeroshard
