#pragma once
// What a daemon needs to join its jobs' other nodes: the rendezvous stores
// users already run (Gloo's FileStore on a shared directory, Redis through
// Gloo's RedisStore), and the Gloo communicators between daemons, which are
// the daemon's, not a job's: keyed by the ordered set of daemons they
// connect, made once and reused by every later job over the same daemons.
//
// Thread safety: StoreSpec functions are pure; CommunicatorCache and Waker
// are safe from any thread (the jobs' link threads use them).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/daemon/config.hpp"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}  // namespace rendezvous
namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo

namespace dbuf::daemon {

/// A job's rendezvous store as its ranks name it: "file:DIR" or
/// "redis:HOST:PORT", then optionally "#PREFIX".
struct StoreSpec {
  enum class Kind : std::uint8_t { kFile, kRedis };
  Kind kind = Kind::kFile;
  std::string path;  ///< kFile: the directory
  std::string host;  ///< kRedis
  int port = 0;      ///< kRedis
  std::string prefix;
};

/// Parses a store as a Hello carries it; kInvalidArgument says what is wrong.
[[nodiscard]] Result<StoreSpec> parseStoreSpec(const std::string& text);

/// Whether this daemon may use `store` for a job of the user `uid`: a file
/// store's directory must exist, belong to `uid` and be writable by nobody
/// else (the daemon writes there on the job's behalf); a Redis store's
/// HOST:PORT must be listed in [cluster] store_hosts. kPermissionDenied or
/// kNotFound otherwise.
[[nodiscard]] Result<void> checkStoreAllowed(const StoreSpec& store, const Config& config, std::uint32_t uid);

/// Opens the store (a Redis store connects now); kUnavailable if it cannot.
[[nodiscard]] Result<std::unique_ptr<gloo::rendezvous::Store>> openStore(const StoreSpec& store);

/// A Gloo context between daemons (one rank per daemon, in the order of the
/// key it is cached under), shared by every job over those daemons. Jobs use
/// it from their own link threads, each with its own tags.
struct Communicator {
  std::uint64_t id = 0;  ///< agreed by every daemon when it was made
  std::shared_ptr<gloo::transport::Device> device;
  std::shared_ptr<gloo::Context> context;
  /// Set by the first job that saw a transport error on it: the next job
  /// over the same daemons makes a new one.
  std::atomic<bool> failed{false};
  /// The tag of the next job to use it (handed out by rank 0's daemon only).
  std::atomic<std::uint32_t> next_channel{1};

  /// Keeps what an exchange that timed out left posted in Gloo (its buffers
  /// and the memory they point into) while the connections live: a late
  /// payload from a peer must land somewhere, as a Gloo pair whose receive
  /// buffer is gone stops reading, for every job sharing it.
  void keep(std::shared_ptr<void> leftover);

 private:
  std::mutex leftovers_mutex_;
  std::vector<std::shared_ptr<void>> leftovers_;
};

/// The daemon's communicators, keyed by the daemons they connect.
class CommunicatorCache {
 public:
  /// The live (not failed) communicator for `key`, or null.
  [[nodiscard]] std::shared_ptr<Communicator> find(const std::string& key);
  /// Caches `communicator` for `key`, replacing a failed or older one.
  void insert(const std::string& key, std::shared_ptr<Communicator> communicator);
  /// Communicators made so far (and how many were reused), for tests and logs.
  [[nodiscard]] std::uint64_t made() const noexcept { return made_.load(); }
  [[nodiscard]] std::uint64_t reused() const noexcept { return reused_.load(); }
  void countReuse() noexcept { reused_.fetch_add(1); }

 private:
  std::mutex mutex_;
  std::map<std::string, std::shared_ptr<Communicator>> communicators_;
  std::atomic<std::uint64_t> made_{0};
  std::atomic<std::uint64_t> reused_{0};
};

/// Communicators of another kind than Gloo's (the cuda backend's NCCL ones)
/// while no job uses them. Each serves one job at a time (two jobs' NCCL
/// calls could reach it in another order on another node), so a job takes
/// its one out when its nodes meet and puts it back when it ends; a later
/// job over the same set then makes none. Type-erased: the code that makes
/// them owns their type, and ends them through their deleter.
class IdleCommunicators {
 public:
  struct Entry {
    std::uint64_t id = 0;  ///< agreed by every daemon when it was made
    std::shared_ptr<void> communicator;
  };
  /// The idle communicator for `key` (now the caller's), if any.
  [[nodiscard]] std::optional<Entry> take(const std::string& key);
  /// Keeps `entry` for `key`; one kept before for it ends.
  void put(const std::string& key, Entry entry);

 private:
  std::mutex mutex_;
  std::map<std::string, Entry> idle_;
};

/// Wakes the daemon's loop from another thread, until the loop goes
/// (a link thread may outlive the job that started it).
class Waker {
 public:
  explicit Waker(std::function<void()> wake) : wake_(std::move(wake)) {}
  void wake();
  /// After this, wake() does nothing (the loop is going).
  void close();

 private:
  std::mutex mutex_;
  std::function<void()> wake_;
};

/// What every job across nodes on this daemon shares.
struct ClusterContext {
  const Config* config = nullptr;
  std::uint64_t instance_id = 0;  ///< this daemon's, part of its identity in communicator keys
  std::shared_ptr<CommunicatorCache> communicators = std::make_shared<CommunicatorCache>();
  std::shared_ptr<IdleCommunicators> idle_gpu_communicators = std::make_shared<IdleCommunicators>();
  std::shared_ptr<Waker> waker;
};

}  // namespace dbuf::daemon
