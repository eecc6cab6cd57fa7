// BucketedCollectives on gloo with ranks as threads. Every rank builds every other rank's inputs from a deterministic
// formula, so each result is checked against a locally computed reference, never against another collective.
#define USE_C10D_GLOO  // ProcessGroupGloo.hpp is empty without it
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "comm/bucketed_collectives.h"

#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

using zeroshard::BucketedCollectives;
using zeroshard::CollectiveHandle;
using Tensors = std::vector<at::Tensor>;
using PG = c10::intrusive_ptr<c10d::ProcessGroup>;

namespace {

PG make_gloo_pg(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world) {
  auto opts = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(30));
  opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, opts);
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, world);
  pg->setBackend(c10::kCPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  return pg;
}

// Runs fn(pg, rank) on `world` threads, each with its own gloo process group over a fresh shared HashStore.
void run_ranks(int world, const std::function<void(const PG&, int)>& fn) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::mutex mu;
  std::vector<std::string> errors;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(make_gloo_pg(store, r, world), r);
      } catch (const c10::Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back("rank " + std::to_string(r) + ": " + e.what_without_backtrace());
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(mu);
        errors.push_back("rank " + std::to_string(r) + ": " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) ADD_FAILURE() << e;
}

// Small integers, so sums are exact in bf16 and fp32 alike; distinct per (rank, tensor, element).
at::Tensor input(int rank, int index, int64_t numel, at::ScalarType dtype) {
  at::Tensor k = at::arange(numel, at::kDouble);
  return ((k.remainder(13) + 3 * index + 17 * rank + 1) * ((rank + index) % 2 == 0 ? 1 : -1)).to(dtype);
}

int64_t nonempty_buckets(const std::vector<int64_t>& full_numels, int64_t bucket_elems) {
  int64_t n = 0;
  for (const auto& [b, e] : BucketedCollectives::plan_buckets(full_numels, bucket_elems)) {
    int64_t total = 0;
    for (size_t i = b; i < e; ++i) total += full_numels[i];
    n += total > 0;
  }
  return n;
}

template <typename F>
void expect_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos) << e.what_without_backtrace();
  }
}

const std::vector<int64_t> kShardNumels = {5, 1, 17, 0, 8, 3, 40};
// In units of world_size elements: every tensor alone, a few splits, one bucket for all.
const std::vector<int64_t> kBucketUnits = {1, 6, 20, 26, 1 << 20};

}  // namespace

TEST(PlanBuckets, GroupsConsecutiveTensorsUpToTheLimit) {
  using B = std::vector<std::pair<size_t, size_t>>;
  EXPECT_EQ(BucketedCollectives::plan_buckets({}, 10), B{});
  EXPECT_EQ(BucketedCollectives::plan_buckets({4, 4, 4}, 8), (B{{0, 2}, {2, 3}}));
  EXPECT_EQ(BucketedCollectives::plan_buckets({4, 20, 4}, 8), (B{{0, 1}, {1, 2}, {2, 3}}));  // big one alone
  EXPECT_EQ(BucketedCollectives::plan_buckets({3, 3, 3}, 100), (B{{0, 3}}));
  EXPECT_EQ(BucketedCollectives::plan_buckets({3, 3, 3}, 1), (B{{0, 1}, {1, 2}, {2, 3}}));
  // Empty tensors ride along with the current bucket.
  EXPECT_EQ(BucketedCollectives::plan_buckets({0, 5, 0, 5}, 5), (B{{0, 3}, {3, 4}}));
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, AllGatherMatchesConcatenation) {
  const int world = GetParam();
  run_ranks(world, [&](const PG& pg, int rank) {
    BucketedCollectives bc(pg);
    EXPECT_EQ(bc.rank(), rank);
    EXPECT_EQ(bc.world_size(), world);
    for (int64_t unit : kBucketUnits) {
      Tensors shards, fulls;
      std::vector<int64_t> full_numels;
      for (size_t i = 0; i < kShardNumels.size(); ++i) {
        shards.push_back(input(rank, i, kShardNumels[i], at::kFloat));
        fulls.push_back(at::full({world * kShardNumels[i]}, -999.0f));
        full_numels.push_back(world * kShardNumels[i]);
      }
      fulls[2] = at::full({world, 17}, -999.0f);  // any shape with the right numel
      CollectiveHandle h = bc.all_gather(shards, fulls, unit * world);
      EXPECT_EQ(h.num_works(), nonempty_buckets(full_numels, unit * world));
      h.wait();
      EXPECT_TRUE(h.is_completed());
      for (size_t i = 0; i < kShardNumels.size(); ++i) {
        Tensors parts;
        for (int r = 0; r < world; ++r) parts.push_back(input(r, i, kShardNumels[i], at::kFloat));
        EXPECT_TRUE(at::equal(fulls[i].view({-1}), at::cat(parts))) << "bucket " << unit << " tensor " << i;
      }
    }
  });
}

TEST_P(Collectives, AllGatherInPlace) {
  const int world = GetParam();
  run_ranks(world, [&](const PG& pg, int rank) {
    BucketedCollectives bc(pg);
    for (int64_t unit : {int64_t{1}, int64_t{1} << 20}) {  // single-tensor buckets, then one multi-tensor bucket
      Tensors shards, fulls;
      for (size_t i = 0; i < kShardNumels.size(); ++i) {
        const int64_t s = kShardNumels[i];
        fulls.push_back(at::full({world * s}, -999.0, at::kDouble));
        shards.push_back(fulls.back().narrow(0, rank * s, s));
        shards.back().copy_(input(rank, i, s, at::kDouble));
      }
      bc.all_gather(shards, fulls, unit * world).wait();
      for (size_t i = 0; i < kShardNumels.size(); ++i) {
        Tensors parts;
        for (int r = 0; r < world; ++r) parts.push_back(input(r, i, kShardNumels[i], at::kDouble));
        EXPECT_TRUE(at::equal(fulls[i], at::cat(parts))) << "bucket " << unit << " tensor " << i;
      }
    }
  });
}

// Shards back to back in one buffer (stage 3's packed unit row) are sent from where they lie; one out of place (a
// gap before it) takes the copy-in path. Both gather the same values, and the row itself is left as it was.
TEST_P(Collectives, AllGatherFromBackToBackShards) {
  const int world = GetParam();
  run_ranks(world, [&](const PG& pg, int rank) {
    BucketedCollectives bc(pg);
    int64_t total = 0;
    for (int64_t s : kShardNumels) total += s;
    for (int64_t gap : {int64_t{0}, int64_t{3}}) {
      at::Tensor row = at::full({total + gap}, -5.0f);
      Tensors shards, fulls;
      int64_t off = 0;
      for (size_t i = 0; i < kShardNumels.size(); ++i) {
        const int64_t s = kShardNumels[i];
        if (i == 1) off += gap;  // gap > 0: shards[1] no longer follows shards[0]
        shards.push_back(row.narrow(0, off, s));
        shards.back().copy_(input(rank, i, s, at::kFloat));
        off += s;
        fulls.push_back(at::full({world * s}, -999.0f));
      }
      at::Tensor before = row.clone();
      bc.all_gather(shards, fulls, int64_t{1} << 20).wait();  // one multi-tensor bucket
      EXPECT_TRUE(at::equal(row, before)) << "gap " << gap;
      for (size_t i = 0; i < kShardNumels.size(); ++i) {
        Tensors parts;
        for (int r = 0; r < world; ++r) parts.push_back(input(r, i, kShardNumels[i], at::kFloat));
        EXPECT_TRUE(at::equal(fulls[i], at::cat(parts))) << "gap " << gap << " tensor " << i;
      }
    }
  });
}

// Reference: scale * sum over ranks of chunk `rank` of each full, computed in double, (+ the old shard).
TEST_P(Collectives, ReduceScatterSumScaleAccumulate) {
  const int world = GetParam();
  run_ranks(world, [&](const PG& pg, int rank) {
    BucketedCollectives bc(pg);
    for (int64_t unit : kBucketUnits) {
      for (bool accumulate : {false, true}) {
        for (double scale : {1.0, 1.0 / world}) {
          Tensors fulls, shards, refs;
          for (size_t i = 0; i < kShardNumels.size(); ++i) {
            const int64_t s = kShardNumels[i];
            fulls.push_back(input(rank, i, world * s, at::kFloat));
            shards.push_back(at::full({s}, 0.25f * (i + 1)));
            at::Tensor sum = at::zeros({s}, at::kDouble);
            for (int r = 0; r < world; ++r) sum += input(r, i, world * s, at::kDouble).narrow(0, rank * s, s);
            refs.push_back(sum * scale + (accumulate ? 0.25 * (i + 1) : 0.0));
          }
          std::vector<int64_t> full_numels;
          for (const auto& f : fulls) full_numels.push_back(f.numel());
          CollectiveHandle h = bc.reduce_scatter(fulls, shards, unit * world, scale, accumulate);
          EXPECT_EQ(h.num_works(), nonempty_buckets(full_numels, unit * world));
          h.wait();
          for (size_t i = 0; i < kShardNumels.size(); ++i) {
            EXPECT_TRUE(at::allclose(shards[i].to(at::kDouble), refs[i], 1e-6, 1e-6))
                << "bucket " << unit << " acc " << accumulate << " scale " << scale << " tensor " << i << "\n"
                << shards[i] << "\n"
                << refs[i];
          }
        }
      }
    }
  });
}

// bf16 in, fp32 out: the sum is exact in bf16 (small integers), and the scale must be applied in fp32, so the result
// matches the fp32 reference to fp32 rounding, not bf16 rounding.
TEST_P(Collectives, ReduceScatterBf16InFp32Out) {
  const int world = GetParam();
  run_ranks(world, [&](const PG& pg, int rank) {
    BucketedCollectives bc(pg);
    const double scale = 1.0 / 3.0;
    for (int64_t unit : {int64_t{1}, int64_t{20}, int64_t{1} << 20}) {
      for (bool accumulate : {false, true}) {
        Tensors fulls, shards, refs;
        for (size_t i = 0; i < kShardNumels.size(); ++i) {
          const int64_t s = kShardNumels[i];
          fulls.push_back(input(rank, i, world * s, at::kBFloat16));
          shards.push_back(at::full({s}, 0.1f));
          at::Tensor sum = at::zeros({s}, at::kDouble);
          for (int r = 0; r < world; ++r) sum += input(r, i, world * s, at::kDouble).narrow(0, rank * s, s);
          refs.push_back(sum * scale + (accumulate ? 0.1 : 0.0));
        }
        bc.reduce_scatter(fulls, shards, unit * world, scale, accumulate).wait();
        for (size_t i = 0; i < kShardNumels.size(); ++i) {
          EXPECT_EQ(shards[i].scalar_type(), at::kFloat);
          EXPECT_TRUE(at::allclose(shards[i].to(at::kDouble), refs[i], 1e-6, 1e-6))
              << "bucket " << unit << " acc " << accumulate << " tensor " << i << "\n"
              << shards[i] << "\n"
              << refs[i];
        }
      }
    }
  });
}

TEST_P(Collectives, AllReduceSumAndScale) {
  const int world = GetParam();
  run_ranks(world, [&](const PG& pg, int rank) {
    BucketedCollectives bc(pg);
    for (int64_t unit : kBucketUnits) {
      for (double scale : {1.0, 0.5}) {
        Tensors ts, refs;
        std::vector<int64_t> numels;
        for (size_t i = 0; i < kShardNumels.size(); ++i) {
          const int64_t n = kShardNumels[i] * 2 + 1;
          ts.push_back(input(rank, i, n, at::kFloat).view({1, n}));
          at::Tensor sum = at::zeros({1, n}, at::kDouble);
          for (int r = 0; r < world; ++r) sum += input(r, i, n, at::kDouble).view({1, n});
          refs.push_back(sum * scale);
          numels.push_back(n);
        }
        CollectiveHandle h = bc.all_reduce(ts, unit, scale);
        EXPECT_EQ(h.num_works(), nonempty_buckets(numels, unit));
        h.wait();
        for (size_t i = 0; i < ts.size(); ++i) {
          EXPECT_TRUE(at::allclose(ts[i].to(at::kDouble), refs[i], 1e-6, 1e-6)) << "bucket " << unit << " tensor " << i;
        }
      }
    }
  });
}

TEST_P(Collectives, SeveralOpsInFlightAndWaitTwice) {
  const int world = GetParam();
  run_ranks(world, [&](const PG& pg, int rank) {
    BucketedCollectives bc(pg);
    Tensors shards{input(rank, 0, 4, at::kFloat), input(rank, 1, 6, at::kFloat)};
    Tensors fulls{at::empty({world * 4}), at::empty({world * 6})};
    Tensors ar{input(rank, 2, 9, at::kFloat)};
    CollectiveHandle h1 = bc.all_gather(shards, fulls, 1 << 20);
    CollectiveHandle h2 = bc.all_reduce(ar, 1 << 20, 2.0);
    h2.wait();
    h1.wait();
    h1.wait();  // no-op
    h2.wait();  // no-op: not scaled twice
    at::Tensor ref = at::zeros({9}, at::kDouble);
    for (int r = 0; r < world; ++r) ref += input(r, 2, 9, at::kDouble);
    EXPECT_TRUE(at::allclose(ar[0].to(at::kDouble), ref * 2.0));
    EXPECT_TRUE(h1.is_completed());
    EXPECT_EQ(fulls[1][6 * (world - 1)].item<float>(), input(world - 1, 1, 6, at::kFloat)[0].item<float>());
  });
}

INSTANTIATE_TEST_SUITE_P(Gloo, Collectives, ::testing::Values(2, 3),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(CollectivesHandle, EmptyHandleIsComplete) {
  CollectiveHandle h;
  EXPECT_TRUE(h.is_completed());
  h.wait();
  h.wait();
}

// Validation runs before any launch, so a process group with no backend is enough: a check that slipped would fail
// with a different error (no backend), not pass.
TEST(CollectivesErrors, BadInputsNameIndexAndValue) {
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(), 0, 2);
  BucketedCollectives bc(pg);
  const auto f = [](int64_t n) { return at::zeros({n}); };
  expect_error([&] { bc.all_gather({f(2), f(3)}, {f(4)}, 8); }, "got 2 shards but 1 fulls");
  expect_error([&] { bc.all_gather({f(2), f(3)}, {f(4), f(5)}, 8); },
               "fulls[1] has 5 elements, expected world_size (2) * shards[1].numel() (3) = 6");
  expect_error([&] { bc.all_gather({f(2), f(3).to(at::kDouble)}, {f(4), f(6)}, 8); },
               "shards[1] has dtype Double, expected Float");
  expect_error([&] { bc.all_gather({f(2)}, {f(4).to(at::kHalf)}, 8); }, "fulls[0] has dtype Half, expected Float");
  expect_error([&] { bc.all_gather({f(2), f(6).slice(0, 0, 6, 2)}, {f(4), f(6)}, 8); }, "shards[1] must be contiguous");
  expect_error([&] { bc.all_gather({f(2)}, {at::zeros({4}, at::kMeta)}, 8); }, "fulls[0] is on meta, expected cpu");
  expect_error([&] { bc.all_gather({f(2)}, {f(4)}, 0); }, "bucket_elems must be >= 1, got 0");
  expect_error([&] { bc.reduce_scatter({f(4), f(7)}, {f(2), f(3)}, 8, 0.5, false); },
               "fulls[1] has 7 elements, expected world_size (2) * shards[1].numel() (3) = 6");
  expect_error([&] { bc.reduce_scatter({f(4), f(6)}, {f(2), f(3).to(at::kBFloat16)}, 8, 0.5, false); },
               "shards[1] has dtype BFloat16, expected Float");
  expect_error([&] { bc.reduce_scatter({f(4).to(at::kLong)}, {f(2).to(at::kLong)}, 8, 0.5, false); },
               "scale 0.5 != 1 needs a floating dtype, got Long");
  expect_error([&] { bc.all_reduce({f(4), at::zeros({2, 2}).t()}, 8, 1.0); }, "tensors[1] must be contiguous");
  expect_error([&] { bc.all_reduce({f(4), at::zeros({2}, at::kMeta)}, 8, 1.0); }, "tensors[1] is on meta");
  expect_error([&] { bc.all_reduce({f(4)}, -1, 1.0); }, "bucket_elems must be >= 1, got -1");
  expect_error([] { BucketedCollectives bad{PG()}; }, "process group is null");
}

// Every launched bucket is counted once, with its full-buffer bytes and the ring volume of its kind.
TEST(CollectivesStats, CountsEveryBucketByKind) {
  const int world = 3;
  run_ranks(world, [&](const PG& pg, int rank) {
    BucketedCollectives bc(pg);
    ASSERT_EQ(bc.stats()->backend(), "gloo");
    Tensors shards{input(rank, 0, 4, at::kFloat), input(rank, 1, 6, at::kFloat), at::empty({0})};
    Tensors fulls{at::empty({world * 4}), at::empty({world * 6}), at::empty({0})};
    bc.all_gather(shards, fulls, world * 4).wait();  // two non-empty buckets
    Tensors rs_shards{at::zeros({4}), at::zeros({6})};
    Tensors rs_fulls{input(rank, 2, world * 4, at::kBFloat16), input(rank, 3, world * 6, at::kBFloat16)};
    bc.reduce_scatter(rs_fulls, rs_shards, 1 << 20, 1.0, false).wait();  // one bucket, bf16 on the wire
    Tensors ar{input(rank, 4, 9, at::kFloat)};
    bc.all_reduce(ar, 1 << 20, 1.0).wait();
    const auto c = bc.stats()->current();
    const auto& ag = c[static_cast<int>(zeroshard::CollectiveKind::kAllGather)];
    const auto& rs = c[static_cast<int>(zeroshard::CollectiveKind::kReduceScatter)];
    const auto& al = c[static_cast<int>(zeroshard::CollectiveKind::kAllReduce)];
    EXPECT_EQ(ag.calls, 2);
    EXPECT_EQ(ag.tensor_bytes, world * 10 * 4);
    EXPECT_EQ(ag.bytes, (world - 1) * 10 * 4);
    EXPECT_EQ(rs.calls, 1);
    EXPECT_EQ(rs.bytes, (world - 1) * 10 * 2);
    EXPECT_EQ(rs.wire_bytes, (world - 1) * 10 * 2);  // an all-to-all of the chunks, not gloo's all-reduce
    EXPECT_EQ(al.calls, 1);
    EXPECT_EQ(al.bytes, 2 * 9 * 4 * (world - 1) / world);
    bc.stats()->end_step();
    EXPECT_EQ(bc.stats()->last_step()[static_cast<int>(zeroshard::CollectiveKind::kAllGather)].calls, 2);
  });
}
