#include "local_collective.hpp"

#include <algorithm>

namespace dbuf::daemon {
namespace {

using kernels::ConstBuffer;
using kernels::MutBuffer;
using kernels::Segment;

Segment run(std::int64_t src, std::int64_t dst, std::int64_t count) {
  return Segment{src, dst, count, 0, 0};
}

}  // namespace

LocalCollective::LocalCollective(const CollectiveArgs& args, const GroupGeometry* geometry,
                                 std::span<const RankBuffers> ranks, std::span<kernels::ConstBuffer> sources,
                                 std::span<float> scratch, kernels::Runner& runner, std::uint32_t first_rank)
    : args_(args),
      geometry_(geometry),
      ranks_(ranks),
      sources_(sources),
      scratch_(scratch),
      runner_(&runner),
      first_rank_(first_rank) {
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    sources_[r] = ConstBuffer{ranks[r].grads, geometry->grad, geometry->world * geometry->shard_elems};
  }
}

Result<bool> LocalCollective::step() {
  switch (args_.op) {
    case ipc::OpCode::kAllGather:
      return allGatherStep();
    case ipc::OpCode::kReduceScatter:
      return reduceScatterStep();
    case ipc::OpCode::kAllReduce:
      return allReduceStep();
    case ipc::OpCode::kBroadcast:
      return broadcastStep();
    case ipc::OpCode::kNoop:
    case ipc::OpCode::kBarrier:
      return true;  // no data
  }
  return makeError(ErrorCode::kInternal, "unknown collective");
}

Result<void> LocalCollective::copyParams(std::uint32_t from, std::uint32_t to, std::int64_t first, std::int64_t count) {
  const GroupGeometry& g = *geometry_;
  const std::int64_t elements = g.world * g.shard_elems;
  const Segment segment = run(first, first, count);
  if (auto copied = runner_->copy(ConstBuffer{ranks_[from].params, g.unsharded, elements},
                                  MutBuffer{ranks_[to].params, g.unsharded, elements}, {&segment, 1});
      !copied) {
    return copied;
  }
  written_ += static_cast<std::uint64_t>(count * sizeBytes(g.unsharded));
  return {};
}

Result<bool> LocalCollective::allGatherStep() {
  if (phase_ == 0) {
    auto rank_done = geometry_->quantized() ? quantizeOwnPartStep() : castOwnPartStep();
    if (!rank_done) return std::move(rank_done).error();
    if (*rank_done) {
      offset_ = 0;
      segment_ = 0;
      if (++index_ == ranks_.size()) {
        phase_ = 1;
        index_ = 0;
      }
    }
    return false;
  }
  return copyPartStep();
}

Result<bool> LocalCollective::castOwnPartStep() {
  // Rank `index_`'s own part of its unsharded params, cast from its shard.
  const GroupGeometry& g = *geometry_;
  const auto rank = static_cast<std::uint32_t>(index_);
  const std::int64_t part = first_rank_ + rank;
  const std::int64_t count = std::min(kStepElements, g.shard_elems - offset_);
  const Segment segment = run(offset_, part * g.shard_elems + offset_, count);
  if (auto done = runner_->cast(ConstBuffer{ranks_[rank].shard, g.sharded, g.shard_elems},
                                MutBuffer{ranks_[rank].params, g.unsharded, g.world * g.shard_elems}, {&segment, 1});
      !done) {
    return std::move(done).error();
  }
  written_ += static_cast<std::uint64_t>(count * sizeBytes(g.unsharded));
  offset_ += count;
  return offset_ >= g.shard_elems;
}

Result<bool> LocalCollective::quantizeOwnPartStep() {
  // Rank `index_`'s own part, block-quantized with its scales beside it: the
  // rank's tensor slices (segments), a run of whole ones per step, or a
  // piece of whole blocks of one larger than a step.
  const GroupGeometry& g = *geometry_;
  const auto rank = static_cast<std::uint32_t>(index_);
  const std::vector<Segment>& segments = g.ranks[first_rank_ + rank].segments;
  if (segment_ == segments.size()) return true;
  Segment piece;
  std::span<const Segment> batch;
  std::int64_t count = 0;
  const Segment& next = segments[segment_];
  if (offset_ > 0 || next.count > kStepElements) {
    const std::int64_t step = std::max(next.block, kStepElements / next.block * next.block);
    count = std::min(step, next.count - offset_);
    piece = Segment{next.src_offset + offset_, next.dst_offset + offset_, count, next.block,
                    next.scale_offset + offset_ / next.block};
    batch = {&piece, 1};
    offset_ += count;
    if (offset_ == next.count) {
      offset_ = 0;
      ++segment_;
    }
  } else {
    std::size_t end = segment_;
    while (end < segments.size() && count + segments[end].count <= kStepElements) count += segments[end++].count;
    batch = std::span(segments).subspan(segment_, end - segment_);
    segment_ = end;
  }
  const RankBuffers& mine = ranks_[rank];
  if (auto done = runner_->quantizeE4m3(ConstBuffer{mine.shard, g.sharded, g.shard_elems},
                                        MutBuffer{mine.params, g.unsharded, g.world * g.shard_elems},
                                        MutBuffer{mine.scales, DType::kF32, g.total_blocks}, batch);
      !done) {
    return std::move(done).error();
  }
  written_ += static_cast<std::uint64_t>(count);  // one byte per fp8 element
  return segment_ == segments.size();
}

Result<bool> LocalCollective::copyPartStep() {
  // Every rank's part to every other rank: plain copies in the unsharded
  // dtype (and, for fp8, the part's scales).
  const GroupGeometry& g = *geometry_;
  const std::uint64_t ranks = ranks_.size();
  const std::uint64_t pairs = ranks * ranks;
  while (index_ < pairs && index_ / ranks == index_ % ranks) ++index_;  // a rank has its own part
  if (index_ == pairs) return true;
  const auto to = static_cast<std::uint32_t>(index_ / ranks);
  const auto from = static_cast<std::uint32_t>(index_ % ranks);
  const std::uint32_t part = first_rank_ + from;
  const std::int64_t count = std::min(kStepElements, g.shard_elems - offset_);
  if (auto copied = copyParams(from, to, part * g.shard_elems + offset_, count); !copied) {
    return std::move(copied).error();
  }
  if (g.quantized() && offset_ == 0 && g.ranks[part].scales > 0) {
    const Segment scales = run(g.ranks[part].first_scale, g.ranks[part].first_scale, g.ranks[part].scales);
    if (auto copied = runner_->copy(ConstBuffer{ranks_[from].scales, DType::kF32, g.total_blocks},
                                    MutBuffer{ranks_[to].scales, DType::kF32, g.total_blocks}, {&scales, 1});
        !copied) {
      return std::move(copied).error();
    }
  }
  offset_ += count;
  if (offset_ >= g.shard_elems) {
    offset_ = 0;
    ++index_;
  }
  return false;
}

kernels::ReduceOptions LocalCollective::reduction(bool accumulate) const noexcept {
  return kernels::ReduceOptions{args_.pre_scale, args_.factor(geometry_->world, geometry_->accumulation()), accumulate};
}

Result<bool> LocalCollective::reduceScatterStep() {
  // One fused pass: every rank's gradient part straight into this rank's
  // sharded gradient (summed in rank order, in fp32; fp64 in fp64).
  const GroupGeometry& g = *geometry_;
  const auto rank = static_cast<std::uint32_t>(index_);
  const std::int64_t count = std::min(kStepElements, g.shard_elems - offset_);
  const Segment segment = run((first_rank_ + rank) * g.shard_elems + offset_, offset_, count);
  if (auto done = runner_->reduce(sources_, MutBuffer{ranks_[rank].shard_grad, g.sharded, g.shard_elems},
                                  reduction(args_.accumulate), {&segment, 1});
      !done) {
    return std::move(done).error();
  }
  written_ += static_cast<std::uint64_t>(count * sizeBytes(g.sharded));
  offset_ += count;
  if (offset_ >= g.shard_elems) {
    offset_ = 0;
    ++index_;
  }
  return index_ == ranks_.size();
}

Result<bool> LocalCollective::allReduceStep() {
  const GroupGeometry& g = *geometry_;
  const std::int64_t elements = g.world * g.shard_elems;
  // In place: the chunk is reduced into the scratch (fp32, or fp64 for fp64
  // gradients: half as many elements) before any rank's copy is
  // overwritten, then written to every rank.
  const DType summed = g.accumulation();
  const auto scratch_elements = static_cast<std::int64_t>(scratch_.size_bytes()) / sizeBytes(summed);
  const std::int64_t count = std::min(scratch_elements, elements - offset_);
  const Segment reduced = run(offset_, 0, count);
  if (auto done = runner_->reduce(sources_, MutBuffer{scratch_.data(), summed, scratch_elements}, reduction(false),
                                  {&reduced, 1});
      !done) {
    return std::move(done).error();
  }
  const Segment segment = run(0, offset_, count);
  for (const RankBuffers& rank : ranks_) {
    if (auto done = runner_->cast(ConstBuffer{scratch_.data(), summed, scratch_elements},
                                  MutBuffer{rank.grads, g.grad, elements}, {&segment, 1});
        !done) {
      return std::move(done).error();
    }
    written_ += static_cast<std::uint64_t>(count * sizeBytes(g.grad));
  }
  offset_ += count;
  return offset_ >= elements;
}

Result<bool> LocalCollective::broadcastStep() {
  const GroupGeometry& g = *geometry_;
  const std::int64_t elements = g.world * g.shard_elems;
  const std::uint64_t root = args_.root - first_rank_;
  if (index_ == root) ++index_;
  if (index_ >= ranks_.size()) return true;
  const auto to = static_cast<std::uint32_t>(index_);
  const std::int64_t count = std::min(kStepElements, elements - offset_);
  if (auto copied = copyParams(static_cast<std::uint32_t>(root), to, offset_, count); !copied) {
    return std::move(copied).error();
  }
  if (g.quantized() && offset_ == 0) {
    const Segment scales = run(0, 0, g.total_blocks);
    if (auto copied = runner_->copy(ConstBuffer{ranks_[root].scales, DType::kF32, g.total_blocks},
                                    MutBuffer{ranks_[to].scales, DType::kF32, g.total_blocks}, {&scales, 1});
        !copied) {
      return std::move(copied).error();
    }
  }
  offset_ += count;
  if (offset_ >= elements) {
    offset_ = 0;
    ++index_;
  }
  return false;
}

}  // namespace dbuf::daemon
