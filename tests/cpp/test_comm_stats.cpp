// CommStats: ring volumes per collective kind, gloo's emulated reduce-scatter, step bookkeeping.
#include <gtest/gtest.h>

#include "comm/comm_stats.h"

using zeroshard::CollectiveKind;
using zeroshard::CommStats;

namespace {
constexpr int AG = static_cast<int>(CollectiveKind::kAllGather);
constexpr int RS = static_cast<int>(CollectiveKind::kReduceScatter);
constexpr int AR = static_cast<int>(CollectiveKind::kAllReduce);
}  // namespace

TEST(CommStats, RingBytesPerKind) {
  // F (N-1)/N for all-gather and reduce-scatter, 2 F (N-1)/N for all-reduce; nothing leaves a rank alone.
  EXPECT_EQ(CommStats::ring_bytes(CollectiveKind::kAllGather, 1200, 4), 900);
  EXPECT_EQ(CommStats::ring_bytes(CollectiveKind::kReduceScatter, 1200, 3), 800);
  EXPECT_EQ(CommStats::ring_bytes(CollectiveKind::kAllReduce, 1200, 4), 1800);
  EXPECT_EQ(CommStats::ring_bytes(CollectiveKind::kAllReduce, 1200, 1), 0);
}

TEST(CommStats, GlooSendsRingVolumes) {
  EXPECT_EQ(CommStats::wire_bytes("gloo", CollectiveKind::kReduceScatter, 1200, 4), 900);
  EXPECT_EQ(CommStats::wire_bytes("gloo", CollectiveKind::kAllGather, 1200, 4), 900);
  EXPECT_EQ(CommStats::wire_bytes("gloo", CollectiveKind::kAllReduce, 1200, 4), 1800);
  EXPECT_EQ(CommStats::wire_bytes("nccl", CollectiveKind::kReduceScatter, 1200, 4), -1);
}

TEST(CommStats, StepsCloseAndAccumulate) {
  CommStats s("gloo", 2);
  s.record(CollectiveKind::kReduceScatter, 400);
  s.record(CollectiveKind::kReduceScatter, 200);
  s.record(CollectiveKind::kAllGather, 600);
  EXPECT_EQ(s.current()[RS].calls, 2);
  EXPECT_EQ(s.current()[RS].bytes, 300);
  EXPECT_EQ(s.current()[RS].wire_bytes, 300);  // an all-to-all of the chunks
  EXPECT_EQ(s.current()[RS].tensor_bytes, 600);
  EXPECT_EQ(s.last_step()[RS].calls, 0);
  s.end_step();
  EXPECT_EQ(s.current()[RS].calls, 0);
  EXPECT_EQ(s.last_step()[AG].bytes, 300);
  s.record(CollectiveKind::kAllReduce, 100);
  s.record(CollectiveKind::kReduceScatter, 400, CollectiveKind::kAllReduce);  // gloo's own, on CUDA tensors
  s.end_step();
  EXPECT_EQ(s.last_step()[RS].bytes, 200);
  EXPECT_EQ(s.last_step()[RS].wire_bytes, 400);
  EXPECT_EQ(s.steps(), 2);
  EXPECT_EQ(s.last_step()[AG].calls, 0);
  EXPECT_EQ(s.last_step()[AR].bytes, 100);
  EXPECT_EQ(s.total()[RS].bytes, 500);
  EXPECT_EQ(s.total()[AR].wire_bytes, 100);
  s.reset();
  EXPECT_EQ(s.steps(), 0);
  EXPECT_EQ(s.total()[RS].calls, 0);
}

TEST(CommStats, UnknownBackendHasNoWireBytes) {
  CommStats s("nccl", 8);
  EXPECT_FALSE(s.wire_known());
  s.record(CollectiveKind::kReduceScatter, 800);
  EXPECT_EQ(s.current()[RS].bytes, 700);
  EXPECT_EQ(s.current()[RS].wire_bytes, 0);
}
