#pragma once
/// \file
/// Sample messages with non-trivial field values (one or more per message
/// type) shared by the protocol and socket tests.

#include <cstdint>
#include <string>
#include <vector>

#include "dbuf/ipc/protocol.hpp"

namespace dbuf::ipc::testing {

inline TensorDecl tensorDecl(std::string name, std::vector<std::int64_t> shape, std::string granularity,
                             std::int32_t tp_dim) {
  TensorDecl tensor;
  tensor.name = std::move(name);
  tensor.shape = std::move(shape);
  tensor.granularity = std::move(granularity);
  tensor.tp_dim = tp_dim;
  return tensor;
}

inline Hello sampleHello() {
  Hello hello;
  hello.protocol_version = kProtocolVersion;
  hello.job_id = "train-llama3_8b.run-42";
  hello.rank = 5;
  hello.world_size = 8;
  hello.local_rank = 3;
  hello.local_world_size = 4;
  hello.store = "redis:10.0.0.1:6379#run-42";
  hello.device = 7;
  hello.nonce = 0xDEADBEEFCAFEF00DULL;
  hello.persistent = true;
  hello.prefetch_depth = 2;
  return hello;
}

inline RegisterGroup sampleRegisterGroup() {
  RegisterGroup group;
  group.name = "decoder.layers.17";
  group.sharded_dtype = "fp32";
  group.unsharded_dtype = "bf16";
  group.granularity = "rows:32";
  group.align_bytes = 256;
  group.tensors = {
      tensorDecl("attn.q_proj.weight", {4096, 4096}, "", 0),
      tensorDecl("attn.norm.weight", {4096}, "element", -1),
      tensorDecl("mlp.experts.w1", {128, 2880, 5760}, "block:32x32", 2),
      tensorDecl("scalar", {}, "", -1),
      tensorDecl("huge", {INT64_MAX, -1, 0, 1, 2, 3, 4, 5}, "rows:1", 7),
  };
  return group;
}

inline GroupReady sampleGroupReady() {
  GroupReady ready;
  ready.group_id = 42;
  ready.devices = 8;
  ready.shard_elems = 123'456'789;
  ready.sharded_dtype = "fp32";
  ready.unsharded_dtype = "bf16";
  ready.tensors = {
      PlacedTensorWire{"attn.q_proj.weight", {4096, 4096}, 0, 4096LL * 4096, 131072},
      PlacedTensorWire{"attn.norm.weight", {4096}, 16'777'216, 4096, 1},
      PlacedTensorWire{"neg", {}, INT64_MIN, -5, INT64_MAX},
  };
  ready.shard_file_bytes = 1ULL << 40U;
  ready.sharded = Region{0, 493'827'156};
  ready.sharded_grad = Region{493'827'328, 493'827'156};
  ready.slot_bytes = 0xFFFF'FFFF'FFFF'FFFFULL;
  return ready;
}

/// Every field non-default, the data-plane fields (protocol version 2) with
/// distinct bytes in every position so that a swapped or misplaced field
/// cannot round-trip by accident.
inline Welcome sampleWelcome() {
  Welcome welcome;
  welcome.nonce = 0x0123456789ABCDEFULL;
  welcome.daemon_instance_id = 77;
  welcome.session_id = 0xFFFFFFFFFFFFFFFFULL;
  welcome.memory_quota_bytes = 64ULL << 30U;
  welcome.memory_used_bytes = 12345;
  welcome.reattached = true;
  welcome.ring_capacity = 0x00010000U;            // kMaxRingCapacity
  welcome.segment_bytes = 0x0102030405060708ULL;  // all 8 bytes matter
  welcome.busy_poll_us = 0xA1B2C3D4U;
  welcome.memory_kind = MemoryKind::kCuda;
  welcome.device = 0x01020304;
  return welcome;
}

/// At least one message of every type, each with non-default values.
inline std::vector<Message> sampleMessages() {
  std::vector<Message> messages;
  messages.emplace_back(sampleHello());
  Hello minimal_hello;
  minimal_hello.job_id = "j";
  messages.emplace_back(minimal_hello);
  messages.emplace_back(sampleWelcome());
  messages.emplace_back(ErrorReply{WireError::kQuotaExceeded, "asked 8 GiB, 3 GiB left in tenant 'research'", {}});
  messages.emplace_back(ErrorReply{WireError::kInternal, "", {}});
  messages.emplace_back(ErrorReply{WireError::kBadRequest, std::string(kMaxStringBytes, 'x'), {}});
  messages.emplace_back(ErrorReply{WireError::kTimeout, "ranks 1, 3 did not register", {1, 3}});
  messages.emplace_back(ErrorReply{WireError::kDevice, "ncclAllGather: unhandled cuda error", {0xFFFFFFFFU}});
  messages.emplace_back(sampleRegisterGroup());
  messages.emplace_back(RegisterGroup{});
  messages.emplace_back(sampleGroupReady());
  messages.emplace_back(AcquireSlot{0xA5A5A5A5U});
  messages.emplace_back(SlotGranted{3, 1, 1ULL << 33U, Region{256, 1000}, Region{1280, 1000}, Region{2304, 64}});
  messages.emplace_back(ReleaseSlot{0xFFFFFFFFU});
  messages.emplace_back(SlotReleased{9});
  messages.emplace_back(Detach{});
  messages.emplace_back(Detached{});
  messages.emplace_back(Shutdown{"SIGTERM received; daemon stopping"});
  messages.emplace_back(AdminRequest{"status", {}});
  messages.emplace_back(AdminRequest{"job", {"llama-70b.run3"}});
  messages.emplace_back(AdminReply{R"({"scope":"everything","jobs":[]})"});
  messages.emplace_back(AdminReply{std::string(4 * kMaxStringBytes, ' ')});  // longer than any other string
  messages.emplace_back(UnregisterGroup{0xFFFFFFFFU});
  messages.emplace_back(GroupUnregistered{2});
  return messages;
}

}  // namespace dbuf::ipc::testing
