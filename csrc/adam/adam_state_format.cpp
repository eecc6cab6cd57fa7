#include "adam/adam_state_format.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "adam/adam_detail.h"

namespace zeroshard {
namespace {

// bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8), re-derived: for exponent i = 0..6,
// the midpoints of torch.linspace(0.1, 1, k + 1) (k = 2^i signed, 2^(i+1) unsigned) in fp32, times 10^(i - 6) as an
// fp32 tensor-scalar product (and its negation when signed); then 0 and 1; sorted. 127 + 1 + 127 + 1 = 256 values
// signed, 254 + 2 unsigned. Built with the same torch ops so the fp32 roundings match the reference construction.
std::vector<float> build_map(bool is_signed) {
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const int64_t items = is_signed ? (int64_t{1} << i) + 1 : (int64_t{1} << (i + 1)) + 1;
    const at::Tensor b = at::linspace(0.1, 1.0, items, at::kFloat);
    const at::Tensor means = (b.slice(0, 0, items - 1) + b.slice(0, 1, items)) / 2.0;
    // Python's 10 ** (i - 6) is a float for i < 6 and the int 1 for i = 6; either multiplies as a scalar.
    const double scale = i < 6 ? std::pow(10.0, i - 6) : 1.0;
    std::vector<at::Tensor> parts = {means * scale};
    if (is_signed) parts.push_back(means * (-scale));
    for (const at::Tensor& t : parts) {
      const float* p = t.data_ptr<float>();
      data.insert(data.end(), p, p + t.numel());
    }
  }
  data.push_back(0.f);
  data.push_back(1.f);
  TORCH_INTERNAL_ASSERT(data.size() == 256, "dynamic map has ", data.size(), " values");
  std::sort(data.begin(), data.end());
  return data;
}

float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

struct Maps {
  std::array<float, 256> values[2], thresholds[2];  // [0] unsigned, [1] signed
  std::vector<int32_t> lut[2];
  Maps() {
    constexpr float kInf = std::numeric_limits<float>::infinity();
    for (int s = 0; s < 2; ++s) {
      const std::vector<float> v = build_map(s == 1);
      std::copy(v.begin(), v.end(), values[s].begin());
      std::array<float, 256>& t = thresholds[s];
      t[0] = -kInf;
      for (int k = 1; k < 256; ++k) {
        const double mid = (static_cast<double>(v[k - 1]) + static_cast<double>(v[k])) * 0.5;  // exact
        float f = static_cast<float>(mid);
        if (static_cast<double>(f) < mid) f = std::nextafter(f, kInf);
        t[k] = f;
      }
      // exp_avg_sq (unsigned) never takes code 0: a second moment below half the smallest positive map value of its
      // block would otherwise read back as 0 while its exp_avg keeps a code, and that element's next step is
      // lr * m / eps (seen on a tied embedding's rows that got no gradient: 3% worse loss on a tiny Llama). With code
      // 1 at least, a nonzero block dequantises every v to >= map[1] * absmax (3.25e-7 of it); an all-zero block
      // still reads 0 (absmax 0).
      if (s == 0) t[1] = -kInf;
      // The nearest code by definition: how many thresholds x reaches.
      const auto code = [&](float x) {
        return static_cast<int32_t>(std::upper_bound(t.begin() + 1, t.end(), x) - t.begin() - 1);
      };
      // Bucket tables (adam_kernel.h, QuantMap): bucket j of sign sg holds the x whose |x| bits >> 16 are
      // kLutBase + j (j = 0: everything below; the last: 1 and above). Its lowest x takes code c; if its highest
      // takes c + 1, the one threshold crossed inside is t[c + 1].
      lut[s].resize(2 * adam_kernel::kLutBuckets);
      for (int sg = 0; sg < 2; ++sg) {
        for (int32_t j = 0; j < adam_kernel::kLutBuckets; ++j) {
          const uint32_t lo = j == 0 ? 0u : static_cast<uint32_t>(adam_kernel::kLutBase + j) << 16;
          const uint32_t hi = j == adam_kernel::kLutBuckets - 1
                                  ? 0x7F7FFFFFu
                                  : (static_cast<uint32_t>(adam_kernel::kLutBase + j + 1) << 16) - 1;
          const float xmin = sg == 0 ? float_of(lo) : -float_of(hi);
          const float xmax = sg == 0 ? float_of(hi) : -float_of(lo);
          const int32_t c0 = code(xmin), c1 = code(xmax);
          TORCH_INTERNAL_ASSERT(c1 == c0 || c1 == c0 + 1, "dynamic map bucket ", j, " holds ", c1 - c0,
                                " thresholds; the lookup needs at most one");
          int32_t entry = c0 << 16;
          if (c1 != c0) {
            uint32_t tb;
            std::memcpy(&tb, &t[c0 + 1], sizeof(tb));
            // The threshold lies in this bucket: its sign, exponent and top mantissa bits are every x's here.
            TORCH_INTERNAL_ASSERT(j > 0 && j < adam_kernel::kLutBuckets - 1 &&
                                  (tb & 0x7FFFFFFFu) >> 16 == static_cast<uint32_t>(adam_kernel::kLutBase + j) &&
                                  (tb >> 31) == static_cast<uint32_t>(sg));
            entry |= adam_kernel::kLutHasThreshold | static_cast<int32_t>(tb & 0xFFFFu);
          }
          lut[s][sg * adam_kernel::kLutBuckets + j] = entry;
        }
      }
    }
  }
};

const Maps& maps() {
  static const Maps m;
  return m;
}

at::Tensor to_tensor(const std::array<float, 256>& a) {
  return at::from_blob(const_cast<float*>(a.data()), {256}, at::kFloat).clone();
}

}  // namespace

at::Tensor adam_dynamic_map(bool is_signed) { return to_tensor(maps().values[is_signed ? 1 : 0]); }

at::Tensor adam_dynamic_map_thresholds(bool is_signed) { return to_tensor(maps().thresholds[is_signed ? 1 : 0]); }

namespace adam_detail {

adam_kernel::QuantMap quant_map(bool is_signed) {
  const Maps& m = maps();
  const int s = is_signed ? 1 : 0;
  return {m.values[s].data(), m.thresholds[s].data(), m.lut[s].data()};
}

namespace {
bool given(const at::Tensor* t) { return t != nullptr && t->defined(); }
}  // namespace

adam_kernel::StateType state_type_of(const at::Tensor& m, const at::Tensor& v, const at::Tensor* m_absmax,
                                     const at::Tensor* v_absmax, int64_t n,
                                     const std::function<std::string(const char*)>& what) {
  using adam_kernel::StateType;
  const auto mt = m.scalar_type();
  const auto vt = v.scalar_type();
  const auto known = [](at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kByte; };
  TORCH_CHECK_TYPE(known(mt) && known(vt) && mt == vt, what("exp_avg"), " has dtype ", mt, " and exp_avg_sq has dtype ",
                   vt, "; both moments must have one state format: float32, bfloat16, or uint8 codes of int8 state ",
                   "(with float32 exp_avg_absmax and exp_avg_sq_absmax)");
  if (mt != at::kByte) {
    TORCH_CHECK_VALUE(!given(m_absmax) && !given(v_absmax), what("exp_avg_absmax"), " / ", what("exp_avg_sq_absmax"),
                      " given with ", mt, " moments; absmax scales belong to int8 state (uint8 moments): drop them");
    return mt == at::kFloat ? StateType::kFloat32 : StateType::kBFloat16;
  }
  const int64_t blocks = adam_quant_blocks(n);
  const char* keys[] = {"exp_avg_absmax", "exp_avg_sq_absmax"};
  const at::Tensor* scales[] = {m_absmax, v_absmax};
  for (int k = 0; k < 2; ++k) {
    TORCH_CHECK_VALUE(given(scales[k]), what(keys[k]), " is missing; int8 state (uint8 moments) needs a float32 ",
                      "absmax per block of ", kAdamQuantBlock, " elements: ", blocks, " for ", n, " elements");
    TORCH_CHECK_TYPE(scales[k]->scalar_type() == at::kFloat, what(keys[k]), " has dtype ", scales[k]->scalar_type(),
                     "; absmax scales are float32");
    TORCH_CHECK_VALUE(scales[k]->numel() == blocks, what(keys[k]), " has ", scales[k]->numel(), " elements; int8 ",
                      "state of ", n, " elements has ceil(", n, " / ", kAdamQuantBlock, ") = ", blocks, " blocks");
  }
  return StateType::kInt8;
}

}  // namespace adam_detail
}  // namespace zeroshard
