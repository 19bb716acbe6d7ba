// How gradients are grouped for the wire (gradsync/dist/reducer/reducer.h): the compression names,
// the bucket assignment (Horovod's tensor fusion and DDP's compute_bucket_assignment_by_size),
// and the split of a bucket among the ranks (ZeRO).
#include <algorithm>
#include <map>

#include "gradsync/dist/reducer/reducer.h"

namespace gradsync::dist {

const char* compression_name(Compression compression) {
  switch (compression) {
    case Compression::none: return "none";
    case Compression::fp16: return "fp16";
    case Compression::bf16: return "bf16";
  }
  return "?";
}

Compression parse_compression(const std::string& text) {
  if (text == "none") return Compression::none;
  if (text == "fp16") return Compression::fp16;
  if (text == "bf16") return Compression::bf16;
  detail::throw_error("unknown compression '", text, "': expected one of none, fp16, bf16");
}

DType wire_dtype(DType dtype, Compression compression) {
  if (compression == Compression::none || !is_floating(dtype)) return dtype;
  return compression == Compression::fp16 ? DType::f16 : DType::bf16;
}

std::vector<std::vector<std::size_t>> assign_buckets(const std::vector<std::size_t>& sizes, const std::vector<int>& keys,
                                                     const std::vector<std::size_t>& limits, BucketRule rule,
                                                     const std::vector<int>& together) {
  GRADSYNC_CHECK(keys.size() == sizes.size(), "assign_buckets: ", sizes.size(), " sizes but ", keys.size(), " keys");
  GRADSYNC_CHECK(together.empty() || together.size() == sizes.size(), "assign_buckets: ", sizes.size(), " sizes but ",
                 together.size(), " unit ids");
  GRADSYNC_CHECK(!limits.empty(), "assign_buckets: no bucket size limit");

  // Units: an index alone, or every index sharing its unit id, placed at the first one.
  std::map<int, std::vector<std::size_t>> unit_members;
  if (!together.empty()) {
    for (std::size_t i = 0; i < sizes.size(); ++i) unit_members[together[i]].push_back(i);
  }
  struct Open {
    std::vector<std::size_t> indices;
    std::size_t bytes = 0;
    std::size_t limit_index = 0;
  };
  std::map<int, Open> open;  // one open bucket per key
  std::vector<std::vector<std::size_t>> closed;
  const auto limit_of = [&](const Open& bucket) { return limits[std::min(bucket.limit_index, limits.size() - 1)]; };
  const auto close = [&](Open& bucket) {
    closed.push_back(std::move(bucket.indices));
    bucket.indices.clear();
    bucket.bytes = 0;
    ++bucket.limit_index;
  };

  std::vector<bool> placed(sizes.size(), false);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (placed[i]) continue;
    std::vector<std::size_t> unit{i};
    if (!together.empty()) unit = unit_members[together[i]];
    std::size_t unit_bytes = 0;
    for (const std::size_t j : unit) {
      GRADSYNC_CHECK(keys[j] == keys[i], "assign_buckets: index ", j, " is grouped with index ", i,
                     " but has another dtype or device; a group must share one bucket");
      unit_bytes += sizes[j];
      placed[j] = true;
    }
    Open& bucket = open[keys[i]];
    if (rule == BucketRule::fusion && !bucket.indices.empty() && bucket.bytes + unit_bytes > limit_of(bucket)) close(bucket);
    bucket.indices.insert(bucket.indices.end(), unit.begin(), unit.end());
    bucket.bytes += unit_bytes;
    if (rule == BucketRule::pytorch && bucket.bytes >= limit_of(bucket)) close(bucket);
  }
  for (auto& [key, bucket] : open) {
    if (!bucket.indices.empty()) close(bucket);
  }
  std::sort(closed.begin(), closed.end(), [](const auto& a, const auto& b) {
    return *std::min_element(a.begin(), a.end()) < *std::min_element(b.begin(), b.end());
  });
  return closed;
}

void release_other_pieces(const Tensor& flat, const BucketShard& shard) {
  if (shard.begin > 0) flat.view(0, {shard.begin}).zero_releasing_pages();
  const std::int64_t end = shard.begin + shard.count;
  if (end < flat.numel()) flat.view(static_cast<std::size_t>(end), {flat.numel() - end}).zero_releasing_pages();
}

BucketShard shard_bucket(std::int64_t numel, int world, int rank) {
  GRADSYNC_CHECK(world > 0 && rank >= 0 && rank < world && numel >= 0, "shard_bucket: rank ", rank, " of ", world,
                 ", ", numel, " elements");
  BucketShard shard;
  shard.piece = numel / world;
  for (int r = 0; r < world; ++r) {
    const std::int64_t begin = shard.piece * r;
    const std::int64_t end = r + 1 == world ? numel : shard.piece * (r + 1);
    shard.counts.push_back(end - begin);
    if (r == rank) {
      shard.begin = begin;
      shard.count = end - begin;
    }
  }
  return shard;
}

}  // namespace gradsync::dist
