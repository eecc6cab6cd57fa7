// FlatParamLayout: offsets, padding, shard ranges and slices, views and copies, checked against hand-computed values
// and an element-by-element ownership map.
#include <gtest/gtest.h>

#include "flat/flat_layout.h"

#include <string>
#include <vector>

using zeroshard::FlatParamLayout;
using zeroshard::ShardSlice;
using Shapes = std::vector<std::vector<int64_t>>;

namespace {

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos) << e.what_without_backtrace();
  }
}

const std::vector<Shapes> kShapeSets = {
    {}, {{}}, {{7}}, {{3, 5}, {10}, {}, {0}, {2, 3, 4}}, {{1000}, {1}, {33, 3}, {64}}, {{0, 4}, {5}},
};

}  // namespace

TEST(FlatLayout, OffsetsAlignmentAndPaddingByHand) {
  FlatParamLayout l({{3, 5}, {10}, {}, {0}, {2, 3}}, 2, 4);
  EXPECT_EQ(l.num_params(), 5);
  EXPECT_EQ(l.numels(), (std::vector<int64_t>{15, 10, 1, 0, 6}));
  // 0..15 -> 16..26 -> 28..29 -> 32 (empty) -> 32..38
  EXPECT_EQ(l.offsets(), (std::vector<int64_t>{0, 16, 28, 32, 32}));
  EXPECT_EQ(l.total_numel(), 38);
  EXPECT_EQ(l.padded_numel(), 40);  // multiple of 2 * 4
  EXPECT_EQ(l.shard_numel(), 20);
  EXPECT_EQ(l.shard_range(0), (std::pair<int64_t, int64_t>{0, 20}));
  EXPECT_EQ(l.shard_range(1), (std::pair<int64_t, int64_t>{20, 40}));
  // The second param straddles the boundary at 20.
  EXPECT_EQ(l.shard_slices(0), (std::vector<ShardSlice>{{0, 0, 0, 15}, {1, 0, 16, 4}}));
  EXPECT_EQ(l.shard_slices(1), (std::vector<ShardSlice>{{1, 4, 0, 6}, {2, 0, 8, 1}, {4, 0, 12, 6}}));
}

TEST(FlatLayout, WorldSizeThreePadsToMultiple) {
  FlatParamLayout l({{10}, {10}}, 3, 8);
  EXPECT_EQ(l.offsets(), (std::vector<int64_t>{0, 16}));
  EXPECT_EQ(l.total_numel(), 26);
  EXPECT_EQ(l.padded_numel(), 48);
  EXPECT_EQ(l.shard_numel(), 16);
  EXPECT_EQ(l.shard_slices(2), (std::vector<ShardSlice>{}));  // rank 2 holds only padding
}

TEST(FlatLayout, ParamSpanningSeveralShards) {
  FlatParamLayout l({{2}, {5, 6}}, 4, 2);
  EXPECT_EQ(l.offsets(), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(l.padded_numel(), 32);
  EXPECT_EQ(l.shard_slices(0), (std::vector<ShardSlice>{{0, 0, 0, 2}, {1, 0, 2, 6}}));
  EXPECT_EQ(l.shard_slices(1), (std::vector<ShardSlice>{{1, 6, 0, 8}}));
  EXPECT_EQ(l.shard_slices(2), (std::vector<ShardSlice>{{1, 14, 0, 8}}));
  EXPECT_EQ(l.shard_slices(3), (std::vector<ShardSlice>{{1, 22, 0, 8}}));
}

TEST(FlatLayout, EmptyLayout) {
  FlatParamLayout l({}, 4, 16);
  EXPECT_EQ(l.total_numel(), 0);
  EXPECT_EQ(l.padded_numel(), 0);
  EXPECT_EQ(l.shard_numel(), 0);
  EXPECT_TRUE(l.shard_slices(3).empty());
  EXPECT_EQ(l.flatten({}).numel(), 0);
}

// For every shape set, world size and alignment: offsets aligned and non-overlapping, padding right, and shard_slices
// cover each parameter element exactly once, inside its shard, at the right flat position.
TEST(FlatLayout, SlicesCoverEveryElementOnce) {
  for (const auto& shapes : kShapeSets) {
    for (int64_t world : {1, 2, 3, 4, 8}) {
      for (int64_t align : {1, 3, 16}) {
        FlatParamLayout l(shapes, world, align);
        SCOPED_TRACE("world " + std::to_string(world) + " align " + std::to_string(align) + " params " +
                     std::to_string(shapes.size()));
        ASSERT_EQ(l.padded_numel() % (world * align), 0);
        ASSERT_GE(l.padded_numel(), l.total_numel());
        ASSERT_LT(l.padded_numel() - l.total_numel(), world * align);
        ASSERT_EQ(l.shard_numel() * world, l.padded_numel());
        int64_t prev_end = 0;
        for (int64_t i = 0; i < l.num_params(); ++i) {
          EXPECT_EQ(l.offsets()[i] % align, 0);
          EXPECT_GE(l.offsets()[i], prev_end);
          EXPECT_LT(l.offsets()[i] - prev_end, align);
          prev_end = l.offsets()[i] + l.numels()[i];
        }
        EXPECT_EQ(prev_end, l.total_numel());

        std::vector<std::vector<int>> seen(l.num_params());
        for (int64_t i = 0; i < l.num_params(); ++i) seen[i].assign(l.numels()[i], 0);
        for (int64_t r = 0; r < world; ++r) {
          const auto [begin, end] = l.shard_range(r);
          for (const ShardSlice& s : l.shard_slices(r)) {
            ASSERT_GT(s.numel, 0);
            ASSERT_GE(s.shard_offset, 0);
            ASSERT_LE(s.shard_offset + s.numel, end - begin);
            ASSERT_EQ(begin + s.shard_offset, l.offsets()[s.param_index] + s.param_offset);
            for (int64_t k = 0; k < s.numel; ++k) seen[s.param_index].at(s.param_offset + k)++;
          }
        }
        for (int64_t i = 0; i < l.num_params(); ++i) {
          for (int c : seen[i]) ASSERT_EQ(c, 1) << "param " << i;
        }
      }
    }
  }
}

TEST(FlatLayout, FlattenViewsCopyRoundTrip) {
  FlatParamLayout l({{3, 5}, {10}, {}, {0}, {2, 3, 4}}, 3, 4);
  std::vector<at::Tensor> ts;
  for (const auto& s : l.shapes()) ts.push_back(at::randn(s, at::kDouble));
  at::Tensor flat = l.flatten(ts);
  EXPECT_EQ(flat.scalar_type(), at::kDouble);
  EXPECT_EQ(flat.numel(), l.padded_numel());
  // Padding is zero and each param sits at its offset.
  at::Tensor mask = at::ones({l.padded_numel()}, at::kBool);
  for (int64_t i = 0; i < l.num_params(); ++i) {
    mask.narrow(0, l.offsets()[i], l.numels()[i]).fill_(false);
    EXPECT_TRUE(at::equal(flat.narrow(0, l.offsets()[i], l.numels()[i]), ts[i].reshape({-1})));
  }
  EXPECT_EQ(flat.masked_select(mask).abs().sum().item<double>(), 0.0);

  auto views = l.views(flat);
  ASSERT_EQ(views.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    EXPECT_EQ(views[i].sizes(), ts[i].sizes());
    EXPECT_TRUE(at::equal(views[i], ts[i]));
  }
  views[1].fill_(7.0);  // views alias the buffer
  EXPECT_EQ(flat[l.offsets()[1]].item<double>(), 7.0);

  std::vector<at::Tensor> outs;
  for (const auto& t : ts) outs.push_back(at::empty_like(t, at::kFloat));
  l.copy_out(flat, outs);
  EXPECT_TRUE(at::allclose(outs[0], ts[0].to(at::kFloat)));
  EXPECT_TRUE(at::equal(outs[1], at::full({10}, 7.0f)));

  at::Tensor flat2 = at::full({l.padded_numel()}, -1.0, at::kDouble);
  l.copy_into(flat2, ts);
  EXPECT_EQ(flat2[l.padded_numel() - 1].item<double>(), -1.0);  // padding untouched
  for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(at::equal(l.views(flat2)[i], ts[i]));

  at::Tensor bf = l.flatten(ts, at::kBFloat16);
  EXPECT_EQ(bf.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(l.views(bf)[4], ts[4].to(at::kBFloat16)));
}

TEST(FlatLayout, NonContiguousInputsFlatten) {
  FlatParamLayout l({{4, 3}}, 2, 1);
  at::Tensor t = at::arange(12, at::kFloat).view({3, 4}).t();  // [4, 3], transposed strides
  at::Tensor flat = l.flatten({t});
  EXPECT_TRUE(at::equal(flat.narrow(0, 0, 12), t.contiguous().view({-1})));
}

TEST(FlatLayout, BadInputErrors) {
  expect_error([] { FlatParamLayout({{2}}, 0, 1); }, "world_size must be >= 1, got 0");
  expect_error([] { FlatParamLayout({{2}}, 2, 0); }, "align_elems must be >= 1, got 0");
  expect_error([] { FlatParamLayout({{2}, {3, -1}}, 2, 1); }, "shapes[1] has negative dim 1 = -1");
  FlatParamLayout l({{2, 2}, {3}}, 2, 4);
  expect_error([&] { l.shard_range(2); }, "rank 2 out of range [0, 2)");
  expect_error([&] { l.shard_slices(-1); }, "rank -1 out of range");
  expect_error([&] { l.views(at::zeros({4, 4})); }, "must be 1-D");
  expect_error([&] { l.views(at::zeros({15})); }, "has 15 elements, the layout needs padded_numel = 8");
  expect_error([&] { l.views(at::zeros({16}).slice(0, 0, 16, 2)); }, "must be contiguous");
  expect_error([&] { l.flatten({at::zeros({2, 2})}); }, "got 1 tensors for 2 parameters");
  expect_error([&] { l.flatten({at::zeros({2, 2}), at::zeros({4})}); },
               "tensors[1] has shape [4], the layout expects [3]");
  expect_error([&] { l.copy_out(at::zeros({8}), {at::zeros({4}), at::zeros({3})}); }, "tensors[0] has shape [4]");
}
