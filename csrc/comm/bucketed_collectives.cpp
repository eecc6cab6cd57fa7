#include "comm/bucketed_collectives.h"

#include "comm/process_group_compat.h"

#include <string>
#include <utility>

namespace zeroshard {
namespace {

using Tensors = std::vector<at::Tensor>;

// Checks one list: defined, contiguous, one dtype (the first's unless `dtype` is given), on `device`.
void check_list(const Tensors& ts, const char* op, const char* name, const at::Device& device,
                std::optional<at::ScalarType> dtype = std::nullopt) {
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    TORCH_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
    const at::ScalarType want = dtype.value_or(ts[0].scalar_type());
    TORCH_CHECK(t.scalar_type() == want, op, ": ", name, "[", i, "] has dtype ", t.scalar_type(), ", expected ", want,
                " (", dtype ? "the dtype of the other list" : std::string(name) + "[0]'s", ")");
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, "[", i, "] must be contiguous (shape ", t.sizes(), ", strides ",
                t.strides(), ")");
    TORCH_CHECK(t.device() == device, op, ": ", name, "[", i, "] is on ", t.device(), ", expected ", device,
                " (all tensors must be on one device)");
  }
}

void check_bucket_and_scale(const char* op, int64_t bucket_elems, double scale, at::ScalarType scaled_dtype) {
  TORCH_CHECK(bucket_elems >= 1, op, ": bucket_elems must be >= 1, got ", bucket_elems);
  TORCH_CHECK(scale == 1.0 || at::isFloatingType(scaled_dtype) || at::isComplexType(scaled_dtype), op, ": scale ",
              scale, " != 1 needs a floating dtype, got ", scaled_dtype);
}

// world-sized pair check: fulls[i].numel() == world * shards[i].numel().
void check_pairs(const char* op, const Tensors& shards, const Tensors& fulls, int64_t world) {
  TORCH_CHECK(shards.size() == fulls.size(), op, ": got ", shards.size(), " shards but ", fulls.size(), " fulls");
  for (size_t i = 0; i < shards.size(); ++i) {
    TORCH_CHECK(fulls[i].numel() == world * shards[i].numel(), op, ": fulls[", i, "] has ", fulls[i].numel(),
                " elements, expected world_size (", world, ") * shards[", i, "].numel() (", shards[i].numel(),
                ") = ", world * shards[i].numel());
  }
}

at::Device first_device(const Tensors& a, const Tensors& b = {}) {
  if (!a.empty() && a[0].defined()) return a[0].device();
  if (!b.empty() && b[0].defined()) return b[0].device();
  return at::Device(at::kCPU);
}

// dst (=, or += when accumulate) scale * src. dst may have a wider dtype than src; the arithmetic runs in dst's dtype
// so e.g. a bf16 sum scaled into an fp32 shard is not rounded to bf16 on the way.
void store_scaled(at::Tensor dst, const at::Tensor& src, double scale, bool accumulate) {
  if (accumulate) {
    if (src.scalar_type() == dst.scalar_type() || scale == 1.0) {
      dst.add_(src, scale);
    } else {
      dst.add_(src.to(dst.scalar_type()), scale);
    }
    return;
  }
  if (!dst.is_same(src)) dst.copy_(src);
  if (scale != 1.0) dst.mul_(scale);
}

// out = chunks[0] + chunks[1] + ... (rows of [world, n]), in rank order and in out's dtype, so that 2 ranks give the
// bits of gloo's all-reduce sum. out may be chunks[0] itself.
void sum_rows(at::Tensor out, const at::Tensor& chunks) {
  const int64_t world = chunks.size(0);
  if (world == 1) {
    if (!out.is_same(chunks[0])) out.copy_(chunks[0]);
    return;
  }
  at::add_out(out, chunks[0], chunks[1]);
  for (int64_t r = 2; r < world; ++r) out.add_(chunks[r]);
}

// Whether tensors [b, e) are contiguous and follow each other in one storage, so one view covers them all.
bool back_to_back(const Tensors& ts, size_t b, size_t e) {
  for (size_t i = b; i < e; ++i) {
    if (!ts[i].is_contiguous()) return false;
    if (i == b) continue;
    const auto* end = static_cast<const char*>(ts[i - 1].data_ptr()) + ts[i - 1].nbytes();
    if (ts[i].data_ptr() != end || !ts[i].storage().is_alias_of(ts[b].storage())) return false;
  }
  return true;
}

}  // namespace

BucketedCollectives::BucketedCollectives(c10::intrusive_ptr<c10d::ProcessGroup> pg) : pg_(std::move(pg)) {
  TORCH_CHECK(pg_, "BucketedCollectives: process group is null");
  rank_ = pg_->getRank();
  world_size_ = pg_->getSize();
  // gloo's reduce-scatter is an all-reduce of the whole input plus a local copy: twice the bytes of an all-to-all of
  // the chunks, and 1.5-2x its time on 2 ranks at 0.2-12 MB here (benchmarks/bench_gloo_collectives.py)
  gloo_ = pg_->getBackendName() == "gloo";
  stats_ = std::make_shared<CommStats>(pg_->getBackendName(), world_size_);
}

std::vector<std::pair<size_t, size_t>> BucketedCollectives::plan_buckets(const std::vector<int64_t>& full_numels,
                                                                         int64_t bucket_elems) {
  std::vector<std::pair<size_t, size_t>> buckets;
  size_t begin = 0;
  int64_t size = 0;
  for (size_t i = 0; i < full_numels.size(); ++i) {
    if (i > begin && size + full_numels[i] > bucket_elems) {
      buckets.emplace_back(begin, i);
      begin = i;
      size = 0;
    }
    size += full_numels[i];
  }
  if (begin < full_numels.size()) buckets.emplace_back(begin, full_numels.size());
  return buckets;
}

CollectiveHandle BucketedCollectives::all_gather(Tensors shards, Tensors fulls, int64_t bucket_elems) {
  constexpr const char* op = "BucketedCollectives.all_gather";
  const at::Device device = first_device(shards, fulls);
  check_list(shards, op, "shards", device);
  check_list(fulls, op, "fulls", device, shards.empty() ? std::nullopt : std::optional(shards[0].scalar_type()));
  check_pairs(op, shards, fulls, world_size_);
  check_bucket_and_scale(op, bucket_elems, 1.0, at::kFloat);

  std::vector<int64_t> full_numels;
  for (const auto& f : fulls) full_numels.push_back(f.numel());
  CollectiveHandle handle;
  for (const auto& [b, e] : plan_buckets(full_numels, bucket_elems)) {
    int64_t total = 0;
    for (size_t i = b; i < e; ++i) total += shards[i].numel();
    if (total == 0) continue;  // identical on every rank, so skipping keeps the collectives matched
    stats_->record(CollectiveKind::kAllGather, world_size_ * total * shards[b].element_size());
    if (e - b == 1) {
      at::Tensor out = fulls[b].view({-1});
      at::Tensor in = shards[b].view({-1});
      handle.add_work(compat::all_gather_single(*pg_, out, in));
      continue;
    }
    // Copy-in to this rank's row of the [world, total] staging buffer, gather in place, copy-out each column block.
    // Shards that already lie back to back (stage 3 packs a unit's shards and tag so) are sent from where they lie.
    at::Tensor staging = at::empty({world_size_, total}, shards[b].options());
    std::vector<int64_t> sizes;
    Tensors outs;
    sizes.reserve(e - b);
    outs.reserve(e - b);
    for (size_t i = b; i < e; ++i) {
      sizes.push_back(shards[i].numel());
      outs.push_back(fulls[i].view({world_size_, shards[i].numel()}));
    }
    at::Tensor flat = staging.view({-1});
    if (back_to_back(shards, b, e)) {
      at::Tensor row = shards[b].as_strided({total}, {1});
      handle.add_work(compat::all_gather_single(*pg_, flat, row));
    } else {
      Tensors ins;
      ins.reserve(e - b);
      for (size_t i = b; i < e; ++i) ins.push_back(shards[i].view({-1}));
      at::Tensor own_row = staging.select(0, rank_);
      at::cat_out(own_row, ins, 0);
      handle.add_work(compat::all_gather_single(*pg_, flat, own_row));
    }
    handle.add_finisher([staging, sizes, outs]() { at::split_with_sizes_copy_out(outs, staging, sizes, 1); });
  }
  return handle;
}

CollectiveHandle BucketedCollectives::reduce_scatter(Tensors fulls, Tensors shards, int64_t bucket_elems, double scale,
                                                     bool accumulate) {
  constexpr const char* op = "BucketedCollectives.reduce_scatter";
  const at::Device device = first_device(fulls, shards);
  check_list(fulls, op, "fulls", device);
  check_list(shards, op, "shards", device);
  check_pairs(op, shards, fulls, world_size_);
  check_bucket_and_scale(op, bucket_elems, scale, shards.empty() ? at::kFloat : shards[0].scalar_type());

  std::vector<int64_t> full_numels;
  for (const auto& f : fulls) full_numels.push_back(f.numel());
  CollectiveHandle handle;
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;  // never AVG: gloo's is wrong (pytorch#162338); scale locally instead
  for (const auto& [b, e] : plan_buckets(full_numels, bucket_elems)) {
    int64_t total = 0;
    for (size_t i = b; i < e; ++i) total += shards[i].numel();
    if (total == 0) continue;
    const bool all_to_all = gloo_ && device.is_cpu();
    stats_->record(CollectiveKind::kReduceScatter, world_size_ * total * fulls[b].element_size(),
                   gloo_ && !all_to_all ? std::optional(CollectiveKind::kAllReduce) : std::nullopt);
    at::Tensor in;
    if (e - b == 1) {
      in = fulls[b].view({-1});  // already [world, S] in memory
    } else {
      // Row r of the staging buffer holds chunk r of every full, so the reduce-scatter hands rank r its chunks.
      in = at::empty({world_size_, total}, fulls[b].options());
      Tensors parts;
      for (size_t i = b; i < e; ++i) parts.push_back(fulls[i].view({world_size_, shards[i].numel()}));
      at::cat_out(in, parts, 1);
      in = in.view({-1});
    }
    const bool direct = e - b == 1 && !accumulate && shards[b].scalar_type() == fulls[b].scalar_type();
    // gloo: chunk r of every rank's input goes to rank r (an all-to-all), which sums them after the wait, into the
    // shard (direct) or in place into the first received chunk
    at::Tensor chunks = all_to_all ? at::empty({world_size_, total}, in.options()) : at::Tensor();
    at::Tensor out = direct ? shards[b].view({-1}) : all_to_all ? chunks[0] : at::empty({total}, fulls[b].options());
    if (all_to_all) {
      at::Tensor received = chunks.view({-1});
      handle.add_work(compat::all_to_all_single(*pg_, received, in));
    } else {
      handle.add_work(compat::reduce_scatter_single(*pg_, out, in, opts));
      if (direct && scale == 1.0) continue;
    }
    Tensors dsts(shards.begin() + b, shards.begin() + e);
    handle.add_finisher([in, out, chunks, dsts, scale, accumulate, direct]() {
      if (chunks.defined()) {
        sum_rows(out, chunks);
        if (direct && scale == 1.0) return;
      }
      int64_t off = 0;
      for (const auto& d : dsts) {
        store_scaled(d.view({-1}), out.narrow(0, off, d.numel()), scale, accumulate);
        off += d.numel();
      }
    });
  }
  return handle;
}

CollectiveHandle BucketedCollectives::all_reduce(Tensors tensors, int64_t bucket_elems, double scale) {
  constexpr const char* op = "BucketedCollectives.all_reduce";
  check_list(tensors, op, "tensors", first_device(tensors));
  check_bucket_and_scale(op, bucket_elems, scale, tensors.empty() ? at::kFloat : tensors[0].scalar_type());

  std::vector<int64_t> numels;
  for (const auto& t : tensors) numels.push_back(t.numel());
  CollectiveHandle handle;
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  for (const auto& [b, e] : plan_buckets(numels, bucket_elems)) {
    int64_t total = 0;
    for (size_t i = b; i < e; ++i) total += numels[i];
    if (total == 0) continue;
    stats_->record(CollectiveKind::kAllReduce, total * tensors[b].element_size());
    if (e - b == 1) {
      Tensors one{tensors[b]};
      handle.add_work(pg_->allreduce(one, opts));
      if (scale != 1.0) handle.add_finisher([t = tensors[b], scale]() { t.mul_(scale); });
      continue;
    }
    Tensors flats;
    std::vector<int64_t> sizes;
    for (size_t i = b; i < e; ++i) {
      flats.push_back(tensors[i].view({-1}));
      sizes.push_back(numels[i]);
    }
    Tensors staging{at::cat(flats, 0)};
    handle.add_work(pg_->allreduce(staging, opts));
    handle.add_finisher([buf = staging[0], flats, sizes, scale]() {
      if (scale != 1.0) buf.mul_(scale);
      at::split_with_sizes_copy_out(flats, buf, sizes, 0);
    });
  }
  return handle;
}

}  // namespace zeroshard
