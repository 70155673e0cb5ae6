// The collectives' reference; see reference.hpp. Built with -ffp-contract=off:
// every multiply and add below is its own IEEE operation, as in the kernels.
#include "reference.hpp"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "dbuf/kernels/convert.hpp"
#include "dbuf/kernels/ops.hpp"
#include "dbuf/planner/unit_plan.hpp"

namespace dbuf::coll {
namespace {

using kernels::bf16ToFloat;
using kernels::bitsDouble;
using kernels::bitsFloat;
using kernels::doubleBits;
using kernels::e4m3ToFloat;
using kernels::floatBits;
using kernels::floatToBf16;
using kernels::floatToE4m3;
using kernels::floatToHalf;
using kernels::halfToFloat;

std::uint64_t splitmix(std::uint64_t x) noexcept {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::size_t index(std::int64_t i) noexcept {
  return static_cast<std::size_t>(i);
}

/// Element access in the type a reduction sums in (float, or double for fp64).
/// The reduction's factor as a sum of type Acc takes it: computed in float,
/// or in double for fp64 sums (dbufd computes it in the sum's dtype).
template <typename Acc>
Acc factorIn(const ReduceOptions& reduce, std::uint32_t world) noexcept {
  if constexpr (std::is_same_v<Acc, double>) {
    return finalFactorFp64(reduce, world);
  } else {
    return finalFactor(reduce, world);
  }
}

template <typename Acc>
Acc loadAs(DType dtype, const std::byte* base, std::int64_t i) noexcept {
  if constexpr (std::is_same_v<Acc, double>) {
    return loadDouble(dtype, base, i);
  } else {
    return loadElement(dtype, base, i);
  }
}
template <typename Acc>
void storeAs(DType dtype, std::byte* base, std::int64_t i, Acc v) noexcept {
  if constexpr (std::is_same_v<Acc, double>) {
    storeDouble(dtype, base, i, v);
  } else {
    storeElement(dtype, base, i, v);
  }
}

}  // namespace

// ---- deterministic data ------------------------------------------------------------

std::uint64_t hashPrefix(std::uint64_t seed, Stream stream, std::uint64_t round, std::uint64_t rank,
                         std::uint64_t group, std::uint64_t tensor) noexcept {
  std::uint64_t h = splitmix(seed);
  h = splitmix(h ^ static_cast<std::uint64_t>(stream));
  h = splitmix(h ^ round);
  h = splitmix(h ^ rank);
  h = splitmix(h ^ group);
  return splitmix(h ^ tensor);
}

std::uint64_t hashElement(std::uint64_t prefix, std::uint64_t element) noexcept {
  return splitmix(prefix ^ element);
}

std::uint64_t hashKey(std::uint64_t seed, Stream stream, std::uint64_t round, std::uint64_t rank, std::uint64_t group,
                      std::uint64_t tensor, std::uint64_t element) noexcept {
  return hashElement(hashPrefix(seed, stream, round, rank, group, tensor), element);
}

float paramValue(std::uint64_t hash) noexcept {
  const auto sel = static_cast<std::uint32_t>(hash & 1023U);
  const auto sign = static_cast<std::uint32_t>((hash >> 10) & 1U) << 31;
  const auto mant = static_cast<std::uint32_t>((hash >> 11) & 0x7fffffU);
  const auto exp = static_cast<std::uint32_t>(127 - 12 + (hash >> 34) % 17);  // 2^-12 .. 2^4
  switch (sel) {
    case 0:
      return bitsFloat(0x7f800000U | sign);  // +-inf
    case 1:
      return bitsFloat(0x7fc12345U | sign);  // quiet NaN with a payload
    case 2:
      return bitsFloat(0x7f7fffffU | sign);  // +-FLT_MAX: inf in bf16 and fp16
    case 3:
      return bitsFloat(0x7f7f8000U | sign);  // a bf16 tie that rounds to inf
    case 4:
      return bitsFloat(0x477ff000U | sign);  // 65520: the fp16 tie that rounds to inf
    case 5:
      return bitsFloat(0x477fe000U | sign);  // 65504: fp16 max
    case 6:
      return bitsFloat((mant & 0x7fffffU) | sign);  // fp32 subnormal
    case 7:
    case 8:
      return bitsFloat(sign);  // +-0
    default:
      break;
  }
  if (sel < 48) return bitsFloat(sign | (exp << 23) | (mant & 0x7f0000U) | 0x8000U);  // bf16 tie
  if (sel < 88) return bitsFloat(sign | (exp << 23) | (mant & 0x7fe000U) | 0x1000U);  // fp16 tie
  if (sel < 104) {
    const auto small = static_cast<std::uint32_t>(127 - 26 + (hash >> 34) % 12);  // fp16 subnormals and below
    return bitsFloat(sign | (small << 23) | mant);
  }
  return bitsFloat(sign | (exp << 23) | mant);
}

float gradValue(std::uint64_t hash, DType grad) noexcept {
  const auto sel = static_cast<std::uint32_t>(hash & 255U);
  const auto sign = static_cast<std::uint32_t>((hash >> 8) & 1U) << 31;
  const auto mant = static_cast<std::uint32_t>((hash >> 9) & 0x7fffffU);
  if (grad == DType::kF16 && sel < 4) {
    // 32768 .. 65536 in magnitude: a sum of two of the same sign overflows fp16.
    return bitsFloat(sign | (142U << 23) | mant);
  }
  if (sel < 8) return bitsFloat(sign);
  const auto exp = static_cast<std::uint32_t>(127 - 10 + (hash >> 32) % 12);  // 2^-10 .. 2^1
  return bitsFloat(sign | (exp << 23) | mant);
}

float moderateValue(std::uint64_t hash) noexcept {
  const auto sign = static_cast<std::uint32_t>(hash & 1U) << 31;
  const auto mant = static_cast<std::uint32_t>((hash >> 1) & 0x7fffffU);
  const auto exp = static_cast<std::uint32_t>(127 - 4 + (hash >> 32) % 7);
  return bitsFloat(sign | (exp << 23) | mant);
}

float blockScaledValue(std::uint64_t hash, std::int64_t block) noexcept {
  const std::uint64_t block_hash = splitmix(static_cast<std::uint64_t>(block) ^ (hash & 0xff00000000000000ULL));
  if (block_hash % 11 == 0) return 0.0F;                           // an all-zero block: scale from the amax floor
  const auto k = static_cast<std::int32_t>(block_hash % 41) - 20;  // block magnitude 2^-20 .. 2^20
  const auto sel = static_cast<std::uint32_t>(hash & 63U);
  const auto sign = static_cast<std::uint32_t>((hash >> 6) & 1U) << 31;
  const auto mant = static_cast<std::uint32_t>((hash >> 7) & 0x7fffffU);
  if (sel == 0) return bitsFloat(sign);
  const auto exp = static_cast<std::uint32_t>(127 + k - static_cast<std::int32_t>((hash >> 32) % 12));
  return bitsFloat(sign | (exp << 23) | mant);
}

double elementValue(DType dtype, float v, std::uint64_t hash) noexcept {
  const auto wide = static_cast<double>(v);
  // Infinities keep their zero mantissa (else NaN); zeros stay zeros.
  if (dtype != DType::kF64 || !std::isfinite(v) || v == 0.0F) return wide;
  // The hash's top 29 bits: the generators take sign and mantissa from the low ones.
  const std::uint64_t low = hash >> 35;
  return bitsDouble(doubleBits(wide) | low);
}

// ---- element access ------------------------------------------------------------------

float loadElement(DType dtype, const std::byte* base, std::int64_t i) noexcept {
  switch (dtype) {
    case DType::kF32: {
      float v = 0;
      std::memcpy(&v, base + index(i) * 4, 4);
      return v;
    }
    case DType::kBF16:
    case DType::kF16: {
      std::uint16_t h = 0;
      std::memcpy(&h, base + index(i) * 2, 2);
      return dtype == DType::kBF16 ? bf16ToFloat(h) : halfToFloat(h);
    }
    case DType::kF8E4M3:
      return e4m3ToFloat(static_cast<std::uint8_t>(base[index(i)]));
    default:
      return std::nanf("");
  }
}

void storeElement(DType dtype, std::byte* base, std::int64_t i, float v) noexcept {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(base + index(i) * 4, &v, 4);
      return;
    case DType::kF64:
      storeDouble(dtype, base, i, static_cast<double>(v));
      return;
    case DType::kBF16:
    case DType::kF16: {
      const std::uint16_t h = dtype == DType::kBF16 ? floatToBf16(v) : floatToHalf(v);
      std::memcpy(base + index(i) * 2, &h, 2);
      return;
    }
    default:
      return;
  }
}

double loadDouble(DType dtype, const std::byte* base, std::int64_t i) noexcept {
  if (dtype != DType::kF64) return static_cast<double>(loadElement(dtype, base, i));
  double v = 0;
  std::memcpy(&v, base + index(i) * 8, 8);
  return v;
}

void storeDouble(DType dtype, std::byte* base, std::int64_t i, double v) noexcept {
  if (dtype != DType::kF64) {
    storeElement(dtype, base, i, static_cast<float>(v));
    return;
  }
  std::memcpy(base + index(i) * 8, &v, 8);
}

std::uint64_t elementBits64(DType dtype, const std::byte* base, std::int64_t i) noexcept {
  if (sizeBytes(dtype) != 8) return elementBits(dtype, base, i);
  std::uint64_t u = 0;
  std::memcpy(&u, base + index(i) * 8, 8);
  return u;
}

std::uint32_t elementBits(DType dtype, const std::byte* base, std::int64_t i) noexcept {
  switch (sizeBytes(dtype)) {
    case 4: {
      std::uint32_t u = 0;
      std::memcpy(&u, base + index(i) * 4, 4);
      return u;
    }
    case 2: {
      std::uint16_t h = 0;
      std::memcpy(&h, base + index(i) * 2, 2);
      return h;
    }
    default:
      return static_cast<std::uint8_t>(base[index(i)]);
  }
}

void setElementBits(DType dtype, std::byte* base, std::int64_t i, std::uint64_t bits) noexcept {
  switch (sizeBytes(dtype)) {
    case 8:
      std::memcpy(base + index(i) * 8, &bits, 8);
      return;
    case 4: {
      const auto u = static_cast<std::uint32_t>(bits);
      std::memcpy(base + index(i) * 4, &u, 4);
      return;
    }
    case 2: {
      const auto h = static_cast<std::uint16_t>(bits);
      std::memcpy(base + index(i) * 2, &h, 2);
      return;
    }
    default:
      base[index(i)] = static_cast<std::byte>(bits);
      return;
  }
}

std::string showBits(DType dtype, std::uint64_t bits) {
  double value = 0;
  int digits = 8;
  int precision = 9;
  switch (dtype) {
    case DType::kF64:
      value = bitsDouble(bits);
      digits = 16;
      precision = 17;
      break;
    case DType::kF32:
      value = bitsFloat(static_cast<std::uint32_t>(bits));
      break;
    case DType::kBF16:
      value = bf16ToFloat(static_cast<std::uint16_t>(bits));
      digits = 4;
      break;
    case DType::kF16:
      value = halfToFloat(static_cast<std::uint16_t>(bits));
      digits = 4;
      break;
    case DType::kF8E4M3:
      value = e4m3ToFloat(static_cast<std::uint8_t>(bits));
      digits = 2;
      break;
    default:
      break;
  }
  char text[96];
  std::snprintf(text, sizeof text, "0x%0*" PRIx64 " (%.*g)", digits, bits, precision, value);
  return text;
}

DType gradDType(DType unsharded) noexcept {
  return unsharded == DType::kF8E4M3 ? DType::kBF16 : unsharded;
}

// ---- the group simulator ---------------------------------------------------------------

float finalFactor(const ReduceOptions& reduce, std::uint32_t world) noexcept {
  return reduce.mode == ReduceMode::kAvg ? reduce.post_scale / static_cast<float>(world) : reduce.post_scale;
}

double finalFactorFp64(const ReduceOptions& reduce, std::uint32_t world) noexcept {
  const auto post = static_cast<double>(reduce.post_scale);
  return reduce.mode == ReduceMode::kAvg ? post / static_cast<double>(world) : post;
}

GroupSim::GroupSim(const GroupPlan& plan, DType sharded, DType unsharded)
    : world_(plan.devices),
      shard_elems_(plan.shard_elems),
      sharded_(sharded),
      unsharded_(unsharded),
      grad_(gradDType(unsharded)),
      tensors_(plan.tensors) {
  const auto elements = index(world_ * shard_elems_);
  shard_.assign(elements * index(sizeBytes(sharded_)), std::byte{0});
  shard_grad_.assign(elements * index(sizeBytes(sharded_)), std::byte{0});
  params_.assign(world_, std::vector<std::byte>(elements * index(sizeBytes(unsharded_)), std::byte{0}));
  grads_.assign(world_, std::vector<std::byte>(elements * index(sizeBytes(grad_)), std::byte{0}));
  params_known_.assign(world_, false);
  grads_known_.assign(world_, false);
  // Blocks numbered in buffer order (by offset), as Group::scaleIndex says.
  std::vector<std::size_t> order(tensors_.size());
  for (std::size_t t = 0; t < order.size(); ++t) order[t] = t;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return tensors_[a].offset < tensors_[b].offset; });
  first_block_.assign(tensors_.size(), 0);
  for (const std::size_t t : order) {
    first_block_[t] = total_blocks_;
    total_blocks_ += (tensors_[t].numel + tensors_[t].granularity - 1) / tensors_[t].granularity;
  }
  scales_.assign(world_, std::vector<float>(index(quantized() ? total_blocks_ : 0), 0.0F));
}

void GroupSim::forgetSlot(std::uint32_t rank) {
  params_known_[rank] = false;
  grads_known_[rank] = false;
}

void GroupSim::allGather() {
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    const PlacedTensor& tensor = tensors_[t];
    if (sharded_ == DType::kF64) {
      // fp64 is never cast: copied as it is, all 64 bits.
      for (std::int64_t e = 0; e < tensor.numel; ++e) {
        const std::int64_t g = tensor.offset + e;
        const double v = loadDouble(sharded_, shard_.data(), g);
        for (std::uint32_t r = 0; r < world_; ++r) storeDouble(unsharded_, params_[r].data(), g, v);
      }
      continue;
    }
    if (!quantized()) {
      for (std::int64_t e = 0; e < tensor.numel; ++e) {
        const std::int64_t g = tensor.offset + e;
        const float v = loadElement(sharded_, shard_.data(), g);
        for (std::uint32_t r = 0; r < world_; ++r) storeElement(unsharded_, params_[r].data(), g, v);
      }
      continue;
    }
    // fp8 e4m3: per granularity block, amax over the finite elements (at
    // least kAmaxFloor), scale = amax / 448, q = e4m3(x / scale).
    for (std::int64_t b = 0; b * tensor.granularity < tensor.numel; ++b) {
      const std::int64_t begin = tensor.offset + b * tensor.granularity;
      const std::int64_t end = tensor.offset + std::min(tensor.numel, (b + 1) * tensor.granularity);
      float amax = 0.0F;
      for (std::int64_t g = begin; g < end; ++g) {
        const float x = loadElement(sharded_, shard_.data(), g);
        if (std::isfinite(x)) amax = std::max(amax, std::fabs(x));
      }
      amax = std::max(amax, kernels::kAmaxFloor);
      const float scale = amax / kernels::kE4m3Max;
      for (std::int64_t g = begin; g < end; ++g) {
        const float x = loadElement(sharded_, shard_.data(), g);
        const float y = x / scale;
        const std::uint8_t q = floatToE4m3(y);
        for (std::uint32_t r = 0; r < world_; ++r) params_[r][index(g)] = static_cast<std::byte>(q);
      }
      for (std::uint32_t r = 0; r < world_; ++r) scales_[r][index(first_block_[t] + b)] = scale;
    }
  }
  params_known_.assign(world_, true);
}

template <typename Acc>
Acc GroupSim::reduced(std::int64_t global, const ReduceOptions& reduce) const noexcept {
  const auto pre = static_cast<Acc>(reduce.pre_scale);
  const auto sumOf = [&](std::uint32_t first, std::uint32_t end) {
    Acc acc = 0;
    for (std::uint32_t r = first; r < end; ++r) {
      const Acc x = loadAs<Acc>(grad_, grads_[r].data(), global);
      const Acc scaled = x * pre;
      acc = acc + scaled;
    }
    return acc;
  };
  if (first_ranks_.empty()) return sumOf(0, world_);
  Acc acc = 0;
  for (std::size_t n = 0; n + 1 < first_ranks_.size(); ++n) {
    const Acc node = sumOf(first_ranks_[n], first_ranks_[n + 1]);
    acc = acc + node;
  }
  return acc;
}

template <typename Acc>
void GroupSim::reduceScatterIn(const ReduceOptions& reduce) {
  // The factor in the sum's type: float, or computed in double for fp64 (as dbufd does).
  const Acc factor = factorIn<Acc>(reduce, world_);
  const DType accumulation = accumulationDType(grad_);
  for (const PlacedTensor& tensor : tensors_) {
    for (std::int64_t e = 0; e < tensor.numel; ++e) {
      const std::int64_t g = tensor.offset + e;
      const Acc acc = reduced<Acc>(g, reduce);
      if (reduce.accumulate) {
        const Acc out = loadAs<Acc>(accumulation, shard_grad_.data(), g);
        const Acc add = acc * factor;
        const Acc sum = out + add;
        storeAs<Acc>(accumulation, shard_grad_.data(), g, sum);
      } else {
        const Acc v = factor == Acc{1} ? acc : acc * factor;
        storeAs<Acc>(sharded_, shard_grad_.data(), g, v);
      }
    }
  }
}

template <typename Acc>
void GroupSim::allReduceIn(const ReduceOptions& reduce) {
  const Acc factor = factorIn<Acc>(reduce, world_);
  for (const PlacedTensor& tensor : tensors_) {
    for (std::int64_t e = 0; e < tensor.numel; ++e) {
      const std::int64_t g = tensor.offset + e;
      const Acc acc = reduced<Acc>(g, reduce);
      const Acc v = factor == Acc{1} ? acc : acc * factor;
      for (std::uint32_t r = 0; r < world_; ++r) storeAs<Acc>(grad_, grads_[r].data(), g, v);
    }
  }
}

void GroupSim::reduceScatter(const ReduceOptions& reduce) {
  if (accumulationDType(grad_) == DType::kF64) {
    reduceScatterIn<double>(reduce);
  } else {
    reduceScatterIn<float>(reduce);
  }
  shard_grad_known_ = true;
}

void GroupSim::allReduce(const ReduceOptions& reduce) {
  if (accumulationDType(grad_) == DType::kF64) {
    allReduceIn<double>(reduce);
  } else {
    allReduceIn<float>(reduce);
  }
  grads_known_.assign(world_, true);
}

void GroupSim::broadcast(std::uint32_t root) {
  for (std::uint32_t r = 0; r < world_; ++r) {
    if (r == root) continue;
    params_[r] = params_[root];
    scales_[r] = scales_[root];
    params_known_[r] = params_known_[root];
  }
}

// ---- the training run ------------------------------------------------------------------

std::int64_t TrainTensor::numel() const noexcept {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;
  return n;
}

std::vector<TrainTensor> trainTensors() {
  return {{"w1", {24, 19}}, {"b1", {19}}, {"w2", {19, 10}}, {"b2", {10}}, {"emb", {9, 7}}};
}

float trainInit(std::uint64_t seed, std::size_t t, std::int64_t e) noexcept {
  const std::uint64_t h = hashKey(seed, Stream::kTrain, 0, 0, 0, t, static_cast<std::uint64_t>(e));
  const float unit = static_cast<float>(h >> 40) / 16777216.0F;  // [0, 1), exact
  return unit * 2.0F - 1.0F;
}

std::uint16_t trainGrad(float p, std::uint32_t rank, std::size_t t, int step) noexcept {
  const float c = 0.5F + 0.25F * static_cast<float>(rank) + 0.125F * static_cast<float>(t);
  const float prod = p * c;
  const float shift = static_cast<float>(step) * 1e-3F;
  const float g = prod + shift;
  return floatToBf16(g);
}

float sgdUpdate(float w, float g) noexcept {
  const float step = kTrainLr * g;
  return w - step;
}

std::vector<std::vector<float>> trainReference(std::uint64_t seed,
                                               std::vector<std::vector<std::vector<std::uint16_t>>>* gathered) {
  const std::vector<TrainTensor> tensors = trainTensors();
  std::vector<std::vector<float>> w(tensors.size());
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    for (std::int64_t e = 0; e < tensors[t].numel(); ++e) w[t].push_back(trainInit(seed, t, e));
  }
  if (gathered != nullptr) gathered->assign(kTrainSteps, {});
  // reduceScatter(avg): acc in rank order of float(g_r) * 1, then acc * (1 / world), cast to fp32 (exact).
  const ReduceOptions avg{ReduceMode::kAvg, 1.0F, 1.0F, false};
  const float factor = finalFactor(avg, kTrainWorld);
  for (int step = 1; step <= kTrainSteps; ++step) {
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      std::vector<std::uint16_t> seen;
      for (float& weight : w[t]) {
        const std::uint16_t p_bits = floatToBf16(weight);  // all-gather: fp32 -> bf16
        seen.push_back(p_bits);
        const float p = bf16ToFloat(p_bits);
        float acc = 0.0F;
        for (std::uint32_t r = 0; r < kTrainWorld; ++r) {
          const float x = bf16ToFloat(trainGrad(p, r, t, step));
          const float scaled = x * avg.pre_scale;
          acc = acc + scaled;
        }
        const float grad = factor == 1.0F ? acc : acc * factor;
        weight = sgdUpdate(weight, grad);
      }
      if (gathered != nullptr) (*gathered)[static_cast<std::size_t>(step - 1)].push_back(std::move(seen));
    }
  }
  return w;
}

}  // namespace dbuf::coll
