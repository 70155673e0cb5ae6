#pragma once
/// \file
/// The reference for tests/collectives: deterministic inputs (a pure function
/// of seed, stream, rank, tensor and element, so every process can compute
/// every rank's data), element access on raw dtype bytes, and a simulator of
/// a group's memory on every rank that applies each collective exactly as
/// the host backend is specified to (fp32 arithmetic, fp64 for fp64 groups,
/// rank-order sums, two roundings per multiply-add, round-to-nearest-even
/// conversions from dbuf/kernels/convert.hpp). Compiled with
/// -ffp-contract=off (no FMA).
///
/// Independent of the daemon: it uses the plan only for where tensors lie in
/// the global buffer of world * shard_elems elements.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dbuf/client.hpp"
#include "dbuf/common/dtype.hpp"

namespace dbuf::coll {

// ---- deterministic data ------------------------------------------------------

/// What a value is for; part of the hash key so that streams are independent.
enum class Stream : std::uint32_t {
  kShard = 1,      ///< master shard values (per tensor element, not per rank)
  kGrad = 2,       ///< a rank's unsharded gradient
  kShardGrad = 3,  ///< initial sharded gradient (accumulate)
  kParams = 4,     ///< a rank's own unsharded params (broadcast source)
  kScales = 5,     ///< a rank's own fp8 scales (broadcast source)
  kTrain = 6,      ///< training: initial master weights
};

/// A 64-bit hash of the key (splitmix64 rounds over the fields):
/// hashKey(...) == hashElement(hashPrefix(... without element), element).
[[nodiscard]] std::uint64_t hashPrefix(std::uint64_t seed, Stream stream, std::uint64_t round, std::uint64_t rank,
                                       std::uint64_t group, std::uint64_t tensor) noexcept;
[[nodiscard]] std::uint64_t hashElement(std::uint64_t prefix, std::uint64_t element) noexcept;
[[nodiscard]] std::uint64_t hashKey(std::uint64_t seed, Stream stream, std::uint64_t round, std::uint64_t rank,
                                    std::uint64_t group, std::uint64_t tensor, std::uint64_t element) noexcept;

/// Parameter values: mostly varied exponents and random mantissas, with
/// rounding ties for bf16 and fp16, zeros of both signs, fp32 subnormals,
/// values that overflow fp16 or bf16, infinities and NaNs with payloads.
[[nodiscard]] float paramValue(std::uint64_t hash) noexcept;
/// Gradient values: finite; for fp16 gradients sometimes large enough that
/// a sum of a few overflows fp16.
[[nodiscard]] float gradValue(std::uint64_t hash, DType grad) noexcept;
/// Moderate finite values (initial sharded gradients).
[[nodiscard]] float moderateValue(std::uint64_t hash) noexcept;
/// fp8 test data: |x| < 2^k with k depending on the granularity block, so
/// that blocks get very different scales.
[[nodiscard]] float blockScaledValue(std::uint64_t hash, std::int64_t block) noexcept;
/// What generator value v becomes as an element of `dtype`: v itself, but
/// for fp64 v with the 29 mantissa bits below fp32's taken from the hash
/// (v finite and non-zero), so that fp64 data needs all 64 bits and a path
/// through fp32 anywhere shows.
[[nodiscard]] double elementValue(DType dtype, float v, std::uint64_t hash) noexcept;

// ---- element access ----------------------------------------------------------

/// float value of element i (fp32, bf16, fp16; fp8 e4m3 without its scale).
[[nodiscard]] float loadElement(DType dtype, const std::byte* base, std::int64_t i) noexcept;
/// Rounds v to dtype (fp32, bf16, fp16) and stores it as element i; fp64
/// stores v widened (exact).
void storeElement(DType dtype, std::byte* base, std::int64_t i, float v) noexcept;
/// Element i as a double: fp64 as it is, the others as loadElement (exact).
[[nodiscard]] double loadDouble(DType dtype, const std::byte* base, std::int64_t i) noexcept;
/// Stores v as element i: fp64 as it is, the others as storeElement of
/// float(v), so that a v that is a float is rounded once, as there.
void storeDouble(DType dtype, std::byte* base, std::int64_t i, double v) noexcept;
/// Raw bits of element i, all of them (1, 2, 4 or 8 bytes).
[[nodiscard]] std::uint64_t elementBits64(DType dtype, const std::byte* base, std::int64_t i) noexcept;
/// The same for dtypes of at most 4 bytes (not fp64 or int64: elementBits64).
[[nodiscard]] std::uint32_t elementBits(DType dtype, const std::byte* base, std::int64_t i) noexcept;
void setElementBits(DType dtype, std::byte* base, std::int64_t i, std::uint64_t bits) noexcept;
/// "0x3f80 (1)": the bits and the value they stand for.
[[nodiscard]] std::string showBits(DType dtype, std::uint64_t bits);

/// Gradient dtype of a group: the unsharded dtype, bf16 for fp8 groups.
[[nodiscard]] DType gradDType(DType unsharded) noexcept;

// ---- the group simulator -------------------------------------------------------

/// Every rank's memory of one group, in the global layout: shards (rank d's
/// at [d*S, (d+1)*S) of one array, since they are disjoint), and per rank the
/// unsharded params, grads and fp8 scales. `*_known` says whether the content
/// is defined (a fresh slot is not).
class GroupSim {
 public:
  GroupSim(const GroupPlan& plan, DType sharded, DType unsharded);

  [[nodiscard]] std::uint32_t world() const noexcept { return world_; }
  [[nodiscard]] std::int64_t shardElems() const noexcept { return shard_elems_; }
  [[nodiscard]] DType sharded() const noexcept { return sharded_; }
  [[nodiscard]] DType unsharded() const noexcept { return unsharded_; }
  [[nodiscard]] DType grad() const noexcept { return grad_; }
  [[nodiscard]] bool quantized() const noexcept { return unsharded_ == DType::kF8E4M3; }
  [[nodiscard]] const std::vector<PlacedTensor>& tensors() const noexcept { return tensors_; }
  /// Index of block 0 of tensor t among the fp8 scales (blocks numbered by offset).
  [[nodiscard]] std::int64_t firstBlock(std::size_t t) const { return first_block_.at(t); }
  [[nodiscard]] std::int64_t totalBlocks() const noexcept { return total_blocks_; }
  /// The rank that holds global element g.
  [[nodiscard]] std::uint32_t owner(std::int64_t global) const noexcept {
    return static_cast<std::uint32_t>(global / shard_elems_);
  }

  // Writes (what the ranks do to their memory between collectives): v as
  // storeDouble takes it, a float for every dtype but fp64.
  void setShard(std::int64_t global, double v) { storeDouble(sharded_, shard_.data(), global, v); }
  void setShardGrad(std::int64_t global, double v) { storeDouble(sharded_, shard_grad_.data(), global, v); }
  void setGrad(std::uint32_t rank, std::int64_t global, double v) {
    storeDouble(grad_, grads_[rank].data(), global, v);
  }
  void setParamBits(std::uint32_t rank, std::int64_t global, std::uint64_t bits) {
    setElementBits(unsharded_, params_[rank].data(), global, bits);
  }
  void setScale(std::uint32_t rank, std::int64_t block, float v) { scales_[rank][static_cast<std::size_t>(block)] = v; }
  void markShardGradKnown() { shard_grad_known_ = true; }
  void markGradsKnown(std::uint32_t rank) { grads_known_[rank] = true; }
  void markParamsKnown(std::uint32_t rank) { params_known_[rank] = true; }
  /// The slot was released and acquired again: its content is undefined.
  void forgetSlot(std::uint32_t rank);

  /// A job across nodes (first_ranks: nodes + 1 entries, node n holding
  /// ranks [first_ranks[n], first_ranks[n+1])): reductions sum each node's
  /// ranks in rank order, then the nodes' sums in node order.
  void setNodes(std::vector<std::uint32_t> first_ranks) { first_ranks_ = std::move(first_ranks); }
  // Collectives.
  void allGather();
  void reduceScatter(const ReduceOptions& reduce);
  void allReduce(const ReduceOptions& reduce);
  void broadcast(std::uint32_t root);

  // Reading the expected state.
  [[nodiscard]] const std::byte* shard() const noexcept { return shard_.data(); }
  [[nodiscard]] const std::byte* shardGrad() const noexcept { return shard_grad_.data(); }
  [[nodiscard]] const std::byte* params(std::uint32_t rank) const { return params_.at(rank).data(); }
  [[nodiscard]] const std::byte* grads(std::uint32_t rank) const { return grads_.at(rank).data(); }
  [[nodiscard]] const std::vector<float>& scales(std::uint32_t rank) const { return scales_.at(rank); }
  [[nodiscard]] bool shardGradKnown() const noexcept { return shard_grad_known_; }
  [[nodiscard]] bool paramsKnown(std::uint32_t rank) const { return params_known_.at(rank); }
  [[nodiscard]] bool gradsKnown(std::uint32_t rank) const { return grads_known_.at(rank); }

 private:
  /// acc = sum over r in rank order of (Acc(grad_r[g]) * pre) (over nodes:
  /// sum over nodes of each node's such sum), before the factor. Acc is what
  /// the group sums in (accumulationDType): float, or double for fp64.
  template <typename Acc>
  [[nodiscard]] Acc reduced(std::int64_t global, const ReduceOptions& reduce) const noexcept;
  template <typename Acc>
  void reduceScatterIn(const ReduceOptions& reduce);
  template <typename Acc>
  void allReduceIn(const ReduceOptions& reduce);

  std::uint32_t world_ = 1;
  std::vector<std::uint32_t> first_ranks_;  // empty: one node
  std::int64_t shard_elems_ = 0;
  DType sharded_ = DType::kF32;
  DType unsharded_ = DType::kBF16;
  DType grad_ = DType::kBF16;
  std::vector<PlacedTensor> tensors_;
  std::vector<std::int64_t> first_block_;
  std::int64_t total_blocks_ = 0;
  std::vector<std::byte> shard_;
  std::vector<std::byte> shard_grad_;
  std::vector<std::vector<std::byte>> params_;
  std::vector<std::vector<std::byte>> grads_;
  std::vector<std::vector<float>> scales_;
  bool shard_grad_known_ = false;
  std::vector<bool> params_known_;
  std::vector<bool> grads_known_;
};

/// The reduction's final factor: post / float(world) for avg, else post.
[[nodiscard]] float finalFactor(const ReduceOptions& reduce, std::uint32_t world) noexcept;
/// The same for a sum in fp64 (fp64 groups): post / world in double.
[[nodiscard]] double finalFactorFp64(const ReduceOptions& reduce, std::uint32_t world) noexcept;

// ---- the training run ------------------------------------------------------------

/// Tensors of the training test (shapes only; the reference needs no plan).
struct TrainTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  [[nodiscard]] std::int64_t numel() const noexcept;
};
[[nodiscard]] std::vector<TrainTensor> trainTensors();

inline constexpr std::uint32_t kTrainWorld = 4;
inline constexpr int kTrainSteps = 5;
inline constexpr float kTrainLr = 0.05F;

/// Initial master weight of element e of tensor t.
[[nodiscard]] float trainInit(std::uint64_t seed, std::size_t t, std::int64_t e) noexcept;
/// The gradient a rank writes (bf16 bits) for gathered parameter p (a bf16
/// value) at `step`: bf16(p * c_rank_t + step * 1e-3), two roundings.
[[nodiscard]] std::uint16_t trainGrad(float p, std::uint32_t rank, std::size_t t, int step) noexcept;
/// One SGD update: w - (lr * g), two roundings.
[[nodiscard]] float sgdUpdate(float w, float g) noexcept;

/// Single-process reference of kTrainSteps steps of kTrainWorld ranks: final
/// master weights per tensor. `gathered`, when not null, receives per step
/// the bf16 bits every rank should see after the all-gather of that step.
[[nodiscard]] std::vector<std::vector<float>> trainReference(
    std::uint64_t seed, std::vector<std::vector<std::vector<std::uint16_t>>>* gathered = nullptr);

}  // namespace dbuf::coll
