// Fuzzes what dbufd reads from other nodes' daemons and from the store of a
// job across nodes, where a pure function reads it (daemon/src):
//   mode 0  parseStoreSpec (cluster.hpp): Hello::store, as a client sends it;
//   mode 1  judgeHeaders (node_executor.hpp): the OpHeader each node's
//           daemon sends before (and after) an op, as raw bytes off the wire;
//   mode 2  idleOrNew (node_link.hpp): the store entries ("ID PROPOSAL")
//           each node's daemon writes at a meeting, read from a store fake.
// Byte 0 picks the mode; modes 1 and 2 then read the job's layout (nodes,
// ranks per node, this node), which is the daemon's own, not the peer's.
//
// Properties: bad input is an error value, never a crash; an accepted store
// is one the daemon may open; a verdict that accepts the headers saw every
// node ready for the same op; idleOrNew keeps or returns its idle
// communicator and uses node 0's proposal for a new one.
//
// `fuzz_node --write-seeds DIR` writes seeds of each mode.

#include <gloo/rendezvous/store.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cluster.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "fuzz_util.hpp"
#include "node_executor.hpp"
#include "node_link.hpp"

namespace {

using namespace dbuf::daemon;  // NOLINT(google-build-using-namespace)
using dbuf::ErrorCode;
using dbuf::fuzz::Bytes;
using dbuf::fuzz::check;

enum Mode : std::uint8_t { kStoreSpec, kHeaders, kMeeting, kModes };
constexpr std::uint32_t kMaxNodes = 4;
constexpr std::uint32_t kMaxRanksPerNode = 4;

NodeLayout layoutFrom(Bytes& in) {
  NodeLayout layout;
  const std::uint32_t nodes = 1 + in.take<std::uint8_t>() % kMaxNodes;
  std::uint32_t first = 0;
  for (std::uint32_t n = 0; n < nodes; ++n) {
    layout.first_ranks.push_back(first);
    first += 1 + in.take<std::uint8_t>() % kMaxRanksPerNode;
  }
  layout.first_ranks.push_back(first);
  layout.node = in.take<std::uint8_t>() % nodes;
  return layout;
}

void storeSpec(Bytes& in) {
  const auto rest = in.span(in.left());
  const std::string text(rest.begin(), rest.end());
  auto spec = parseStoreSpec(text);
  if (!spec) {
    check(spec.error().code == ErrorCode::kInvalidArgument, "a bad store is kInvalidArgument");
    return;
  }
  if (spec->kind == StoreSpec::Kind::kFile) {
    check(spec->path.starts_with("/") && spec->path.find("/../") == std::string::npos && !spec->path.ends_with("/.."),
          "a file store is an absolute path without '..'");
  } else {
    check(!spec->host.empty() && spec->port >= 1 && spec->port <= 65535, "a Redis store has a host and a TCP port");
  }
  check(spec->prefix.size() <= 128 && spec->prefix.find('#') == std::string::npos, "the prefix is 0..128 plain bytes");
}

void headers(Bytes& in) {
  const NodeLayout layout = layoutFrom(in);
  const bool force_magic = in.take<std::uint8_t>() % 2 == 0;  // most inputs get past the version check
  std::vector<OpHeader> received(layout.nodes());
  for (OpHeader& header : received) {
    const auto raw = in.span(sizeof(OpHeader));
    std::memcpy(&header, raw.data(), raw.size());
    if (force_magic) header.magic = OpHeader::kMagic;
  }
  bool fatal = false;
  auto verdict = judgeHeaders(received, layout, fatal);
  const std::uint32_t world = layout.first_ranks.back();
  if (verdict) {
    check(!fatal, "an accepted op is not fatal");
    for (const OpHeader& header : received) {
      check(header.magic == OpHeader::kMagic && header.status == 0, "an accepted op is ready on every node");
    }
    return;
  }
  const auto& error = verdict.error();
  check(!error.message.empty(), "a verdict's error has a message");
  const bool any_failed =
      std::any_of(received.begin(), received.end(), [](const OpHeader& h) { return h.status != 0; });
  const bool any_foreign =
      std::any_of(received.begin(), received.end(), [](const OpHeader& h) { return h.magic != OpHeader::kMagic; });
  if (!any_failed && !any_foreign) {
    check(error.code == ErrorCode::kConflict && !fatal, "differing ops are a conflict, not fatal");
    check(!error.ranks.empty() &&
              std::all_of(error.ranks.begin(), error.ranks.end(), [&](std::uint32_t r) { return r < world; }),
          "a mismatch names ranks of the job");
  }
  check(error.ranks.size() <= std::max<std::size_t>(world, OpHeader::kRanks), "an error names a bounded set of ranks");
}

/// A rendezvous store whose other nodes' entries are fuzz bytes.
class FakeStore : public gloo::rendezvous::Store {
 public:
  void set(const std::string& key, const std::vector<char>& data) override { entries_[key] = data; }
  std::vector<char> get(const std::string& key) override {
    const auto found = entries_.find(key);
    if (found == entries_.end()) throw std::runtime_error("no key " + key);
    return found->second;
  }
  void wait(const std::vector<std::string>& keys) override {
    for (const std::string& key : keys) {
      if (entries_.count(key) == 0) throw std::runtime_error("Timed out waiting for " + key);
    }
  }
  std::map<std::string, std::vector<char>> entries_;
};

void meeting(Bytes& in) {
  const NodeLayout layout = layoutFrom(in);
  const std::uint8_t flags = in.take<std::uint8_t>();
  const std::uint64_t held_id = in.take<std::uint8_t>();  // 0: no idle communicator
  const std::uint64_t proposal = in.take<std::uint64_t>();
  FakeStore store;
  for (std::uint32_t n = 0; n < layout.nodes(); ++n) {
    const auto raw = in.span(in.take<std::uint8_t>() % 48);
    if (n != layout.node || (flags & 1U) != 0) store.entries_["nccl-" + std::to_string(n)] = {raw.begin(), raw.end()};
  }
  IdleCommunicators idle;
  if (held_id != 0) idle.put("daemons", IdleCommunicators::Entry{held_id, std::make_shared<int>(1)});
  const std::string daemons = "daemons";
  const NodeJob::Meeting at{store, layout, daemons, 1};
  std::uint64_t made_with = 0;
  bool made = false;
  const bool make_fails = (flags & 2U) != 0;
  auto make = [&](std::uint64_t id) -> dbuf::Result<std::shared_ptr<void>> {
    made_with = id;
    made = true;
    if (make_fails) return dbuf::makeError(ErrorCode::kDevice, "ncclCommInitRank failed");
    return std::shared_ptr<void>(std::make_shared<int>(2));
  };
  try {
    auto chosen = idleOrNew(at, "nccl", idle, daemons, proposal, std::chrono::milliseconds(1), make);
    const bool back = idle.take(daemons).has_value();
    if (chosen) {
      check(chosen->communicator != nullptr, "a chosen communicator exists");
      const bool reused = *static_cast<const int*>(chosen->communicator.get()) == 1;
      check(reused ? !made && chosen->id == held_id && !back : made && chosen->id == made_with,
            "the idle communicator is reused (and not idle any more), or a new one has node 0's proposed id");
      check(reused || held_id == 0 || back, "an idle communicator not used goes back");
    } else {
      check(held_id == 0 || back, "an idle communicator not used goes back");
    }
  } catch (const std::runtime_error&) {
    // The fake's missing key: Gloo's stores throw too, and callers catch it.
  }
}

std::vector<std::uint8_t> headerSeed(const std::vector<OpHeader>& headers, std::uint8_t ranks_per_node) {
  std::vector<std::uint8_t> out{kHeaders, static_cast<std::uint8_t>(headers.size() - 1)};
  for (std::size_t n = 0; n < headers.size(); ++n) out.push_back(static_cast<std::uint8_t>(ranks_per_node - 1));
  out.push_back(0);  // this node
  out.push_back(1);  // magic as sent
  for (const OpHeader& header : headers) {
    const auto* raw = reinterpret_cast<const std::uint8_t*>(&header);  // NOLINT
    out.insert(out.end(), raw, raw + sizeof(OpHeader));
  }
  return out;
}

void writeSeeds(const std::string& dir) {
  const auto write = [&](const std::string& name, const std::vector<std::uint8_t>& bytes) {
    dbuf::fuzz::writeSeed(dir, name, std::as_bytes(std::span(bytes)));
  };
  const auto text = [&](const std::string& name, Mode mode, const std::string& body) {
    std::vector<std::uint8_t> bytes{mode};
    bytes.insert(bytes.end(), body.begin(), body.end());
    write(name, bytes);
  };
  text("store-file", kStoreSpec, "file:/shared/dbuf-store");
  text("store-file-prefix", kStoreSpec, "file:/tmp/s#run-7.a_b");
  text("store-redis", kStoreSpec, "redis:10.0.0.5:6379");
  text("store-redis-prefix", kStoreSpec, "redis:[::1]:6380#job");
  text("store-bad", kStoreSpec, "file:/a/../b");

  OpHeader ready;
  ready.sequence = 12;
  ready.group_digest = 0xabcdef;
  ready.op = 3;
  ready.reduce = 1;
  ready.root = 0;
  std::strcpy(ready.text, "all-gather of group 2 (layers.0)");  // NOLINT
  OpHeader other = ready;
  other.group_digest = 0x123;
  const OpHeader failed = failureHeader(12, dbuf::Error{ErrorCode::kTimeout, "rank 3 did not arrive", {3}}, false);
  const OpHeader fatal = failureHeader(12, dbuf::Error{ErrorCode::kDevice, "NCCL failed", {}}, true);
  write("headers-agree", headerSeed({ready, ready, ready}, 2));
  write("headers-differ", headerSeed({ready, other}, 1));
  write("headers-failed", headerSeed({ready, failed, ready, ready}, 4));
  write("headers-fatal", headerSeed({fatal, ready}, 2));
  OpHeader foreign = ready;
  foreign.magic = 0x02484244;
  write("headers-foreign", headerSeed({ready, foreign}, 1));

  const auto meetingSeed = [](std::uint8_t flags, std::uint8_t held, const std::vector<std::string>& entries) {
    std::vector<std::uint8_t> out{kMeeting, static_cast<std::uint8_t>(entries.size() - 1)};
    for (std::size_t n = 0; n < entries.size(); ++n) out.push_back(1);
    out.push_back(0);
    out.push_back(flags);
    out.push_back(held);
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(0x11 * (i + 1)));
    for (const std::string& entry : entries) {
      out.push_back(static_cast<std::uint8_t>(entry.size()));
      out.insert(out.end(), entry.begin(), entry.end());
    }
    return out;
  };
  write("meeting-reuse", meetingSeed(1, 7, {"7 99", "7 0", "7 0"}));
  write("meeting-new", meetingSeed(1, 7, {"0 12345", "7 0"}));
  write("meeting-make-fails", meetingSeed(3, 0, {"0 5", "0 0"}));
  write("meeting-garbage", meetingSeed(1, 2, {"2 x", "2"}));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  dbuf::fuzz::seedMode(argc, argv, writeSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Bytes in(data, size);
  switch (in.take<std::uint8_t>() % kModes) {
    case kStoreSpec:
      storeSpec(in);
      break;
    case kHeaders:
      headers(in);
      break;
    case kMeeting:
      meeting(in);
      break;
    default:
      break;
  }
  return 0;
}
