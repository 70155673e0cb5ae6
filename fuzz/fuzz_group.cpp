// Fuzzes what dbufd does with a client's RegisterGroup before any memory is
// made (daemon/src/memory/group_layout.hpp, as JobTable::buildGroup calls it): the
// payload is decoded (ipc decodePayload), planned over the job's ranks
// (planGroup), described (describeGroup: the reply and the byte sizes of the
// shard file and the slots), and turned into the data plane's geometry
// (groupGeometry, fp8 block scales per rank).
//
// Input: 2 bytes, the job's world size (1 + u16 % 4096, dbufd's limit), then
// a RegisterGroup payload.
//
// Properties: bad input is an error value, never a crash; a group that plans
// gets a reply that encodes (the daemon sends it), whose regions are where
// its sizes say and whose byte sizes are exact (no wrap-around in 64 bits:
// they size the memfds the ranks map); the fp8 geometry keeps every
// segment inside the rank's shard and every scale inside the slot's.
//
// `fuzz_group --write-seeds DIR` writes registrations a trainer sends.

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "dbuf/common/dtype.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "fuzz_util.hpp"
#include "group_layout.hpp"

namespace {

using namespace dbuf::daemon;  // NOLINT(google-build-using-namespace)
using dbuf::DType;
using dbuf::fuzz::check;
namespace ipc = dbuf::ipc;
using U128 = unsigned __int128;

constexpr std::uint32_t kMaxWorld = 4096;  // jobs.cpp kMaxWorldSize (kernels::kMaxReduceSources)

void checkReply(const ipc::RegisterGroup& spec, const dbuf::planner::UnitPlan& plan, std::uint32_t devices) {
  const ipc::GroupReady ready = describeGroup(spec, plan, 7);
  check(ready.devices == devices && ready.tensors.size() == spec.tensors.size(), "the reply is for the group");
  check(ipc::encodePayload(ipc::Message{ready}).ok(), "the reply encodes");
  const DType sharded = *dbuf::parseDType(spec.sharded_dtype);
  const DType unsharded = *dbuf::parseDType(spec.unsharded_dtype);
  const U128 shard_bytes = U128(static_cast<std::uint64_t>(ready.shard_elems)) * U128(dbuf::sizeBytes(sharded));
  check(ready.sharded.bytes == shard_bytes && ready.sharded_grad.bytes == shard_bytes, "shard regions are exact");
  check(ready.sharded_grad.offset >= ready.sharded.bytes &&
            U128(ready.shard_file_bytes) >= U128(ready.sharded_grad.offset) + shard_bytes,
        "the shard file holds both shard regions");

  const SlotLayout slot = slotLayout(ready);
  const U128 elements = U128(devices) * U128(static_cast<std::uint64_t>(ready.shard_elems));
  check(U128(slot.params.bytes) == elements * U128(dbuf::sizeBytes(unsharded)), "slot params bytes are exact");
  check(U128(slot.grads.bytes) == elements * U128(dbuf::sizeBytes(dbuf::gradientDType(sharded, unsharded))),
        "slot grads bytes are exact");
  check(slot.grads.offset >= slot.params.bytes && U128(slot.file_bytes) >= U128(slot.grads.offset) + slot.grads.bytes &&
            U128(slot.file_bytes) >= U128(slot.scales.offset) + slot.scales.bytes,
        "the slot file holds its regions");
  check(ready.slot_bytes == slot.file_bytes, "the reply's slot size is the layout's");

  const GroupGeometry geometry = groupGeometry(ready);
  check(geometry.world == devices && geometry.shard_elems == ready.shard_elems, "the geometry is the reply's");
  if (dbuf::isGatherOnly(sharded, unsharded)) {
    check(!geometry.quantized() && !geometry.reduces() && geometry.ranks.empty() && slot.scales.bytes == 0 &&
              geometry.grad == unsharded,
          "a gather-only group is copied as it is: no quantization, no scales, no reductions");
  } else {
    check(geometry.reduces() && dbuf::isReducedDType(geometry.grad), "every other group reduces its gradients");
    check(geometry.accumulation() == (geometry.grad == DType::kF64 ? DType::kF64 : DType::kF32),
          "a group sums in fp32, fp64 ones in fp64");
  }
  for (const GroupGeometry::RankBlocks& rank : geometry.ranks) {
    check(rank.first_scale >= 0 && rank.scales >= 0 && rank.first_scale + rank.scales <= geometry.total_blocks,
          "a rank's scales are inside the slot's");
    for (const auto& segment : rank.segments) {
      check(segment.src_offset >= 0 && segment.count > 0 && segment.src_offset + segment.count <= ready.shard_elems,
            "a segment is inside the rank's shard");
      check(segment.block > 0 && segment.scale_offset >= 0 &&
                segment.scale_offset + (segment.count + segment.block - 1) / segment.block <= geometry.total_blocks,
            "a segment's scales are inside the slot's");
    }
  }
}

/// Whether the planner is bounded to milliseconds on `spec`: a single tensor
/// (placed at the lower bound), or a small group. A large group with many
/// tensors can take the planner seconds (its scan walks up from the lower
/// bound; docs/reliability.md, "Fuzzing": not fixed), which libFuzzer would
/// report as a timeout on every such input.
bool plannedQuickly(const ipc::RegisterGroup& spec) {
  constexpr std::size_t kMaxTensors = 64;
  constexpr long double kMaxElements = 68719476736.0L;  // 2^36
  if (spec.tensors.size() <= 1) return true;
  if (spec.tensors.size() > kMaxTensors) return false;
  long double elements = 0;
  for (const ipc::TensorDecl& tensor : spec.tensors) {
    long double numel = 1;
    for (const std::int64_t dim : tensor.shape) numel *= static_cast<long double>(dim < 0 ? 0 : dim);
    elements += numel;
  }
  return elements <= kMaxElements;
}

void writeSeeds(const std::string& dir) {
  const auto write = [&](const std::string& name, std::uint16_t world, const ipc::RegisterGroup& group) {
    auto payload = ipc::encodePayload(ipc::Message{group});
    check(payload.ok(), "a seed encodes");
    std::vector<std::byte> bytes{std::byte(world & 0xFFU), std::byte(world >> 8U)};
    bytes.insert(bytes.end(), payload->begin(), payload->end());
    dbuf::fuzz::writeSeed(dir, name, bytes);
  };
  ipc::RegisterGroup layer;
  layer.name = "layers.0";
  layer.granularity = "rows:32";
  layer.tensors = {{"wq", {512, 512}, "", -1},
                   {"wk", {128, 512}, "", -1},
                   {"norm", {512}, "element", -1},
                   {"w1", {4, 256, 512}, "block:64x64", -1},
                   {"w2", {512, 256}, "", 1}};
  write("layer-4", 3, layer);  // world 4
  ipc::RegisterGroup fp8 = layer;
  fp8.unsharded_dtype = "fp8_e4m3";
  fp8.granularity = "block:128x128";
  write("layer-fp8-8", 7, fp8);
  ipc::RegisterGroup frozen = layer;  // held as it is: gathered by copies, never quantized or reduced
  frozen.sharded_dtype = "fp8_e4m3";
  frozen.unsharded_dtype = "fp8_e4m3";
  write("layer-frozen-fp8-4", 3, frozen);
  ipc::RegisterGroup small;
  small.name = "embed";
  small.sharded_dtype = "bf16";
  small.unsharded_dtype = "fp16";
  small.align_bytes = 256;
  small.tensors = {{"tok", {1000, 64}, "matrix", -1}, {"bias", {7}, "7", -1}};
  write("embed-2", 1, small);
  ipc::RegisterGroup big;
  big.name = "huge";
  big.unsharded_dtype = "fp32";
  big.tensors = {{"w", {1 << 20, 1 << 20}, "matrix", -1}};
  write("huge-64", 63, big);
  ipc::RegisterGroup widest;
  widest.name = "widest";
  widest.unsharded_dtype = "fp32";
  widest.tensors = {{"w", {std::int64_t{1} << 25, std::int64_t{1} << 25}, "matrix", -1}};
  write("widest-4096", 4095, widest);
  ipc::RegisterGroup one;
  one.name = "bias";
  one.tensors = {{"b", {1}, "", -1}};
  write("one-1", 0, one);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  dbuf::fuzz::seedMode(argc, argv, writeSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  const std::uint32_t devices = 1 + static_cast<std::uint32_t>(data[0] | (data[1] << 8U)) % kMaxWorld;
  const std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(data) + 2, size - 2);  // NOLINT
  auto decoded = ipc::decodePayload(ipc::MessageType::kRegisterGroup, payload);
  if (!decoded) return 0;
  const auto& spec = std::get<ipc::RegisterGroup>(*decoded);
  check(!specDifference(spec, spec).has_value(), "a spec does not differ from itself");
  if (!plannedQuickly(spec)) return 0;
  auto plan = planGroup(spec, devices);
  if (!plan) {
    check(!plan.error().message.empty(), "a planning error has a message");
    return 0;
  }
  checkReply(spec, *plan, devices);
  return 0;
}
