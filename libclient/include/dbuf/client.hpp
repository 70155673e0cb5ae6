#pragma once
/// \file
/// libdbuf, C++ API: a trainer process's connection to its node's dbufd.
///
/// ```
/// auto client = dbuf::Client::connect({});            // socket from options, $DBUF_SOCKET or the default
/// client->attach({.job = "run-42", .rank = r, .world_size = 4});
/// auto group = client->registerGroup(spec);            // collective: every rank registers the same group
/// float* shard = group->shardView(0).data<float>();   // this rank's part of tensor 0
/// group->unshard(); ... group->reshard();              // map / release an unsharded slot
/// client->detach();
/// ```
///
/// Errors are values (`dbuf::Result`); the library never exits or aborts the
/// process. Every call that talks to the daemon takes a timeout (defaulting to
/// the client's). A daemon that dies surfaces as an error on the next call.
///
/// Thread safety: a Client and its Groups share one connection and must be
/// used by one thread at a time (or externally synchronised). Memory views
/// stay valid while their Group is alive, the client has not detached and, for
/// unsharded views, until `reshard()`; mappings are removed when the Group is
/// destroyed or the client detaches (views taken afterwards are empty).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dbuf/common/dtype.hpp"
#include "dbuf/common/result.hpp"
#include "dbuf/planner/unit_plan.hpp"

namespace dbuf {

inline constexpr const char* kDefaultSocketPath = "/run/dbufd/dbufd.sock";

struct ClientOptions {
  /// Empty: $DBUF_SOCKET if set, else kDefaultSocketPath.
  std::string socket_path;
  std::chrono::milliseconds timeout{10000};  ///< default for every call
};

struct AttachOptions {
  std::string job;
  std::uint32_t rank = 0;
  std::uint32_t world_size = 1;
  std::uint32_t local_rank = 0;
  std::int32_t device = -1;          ///< -1: host memory
  bool persistent = false;           ///< keep shards for the daemon's grace period if every rank dies
  std::uint32_t prefetch_depth = 1;  ///< unsharded slots = prefetch_depth + 1
};

struct TensorSpec {
  std::string name;
  std::vector<std::int64_t> shape;
  std::string granularity;  ///< empty: the group's rule
  std::int32_t tp_dim = -1;
};

struct GroupSpec {
  std::string name;
  std::vector<TensorSpec> tensors;
  std::string granularity = "element";   ///< default rule for 2D+ tensors
  DType sharded_dtype = DType::kF32;     ///< persistent shard (master weights) and sharded gradient
  DType unsharded_dtype = DType::kBF16;  ///< gathered parameters and their gradients
  std::uint32_t align_bytes = 16;
};

/// A typed view of memory the daemon shares with this process.
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;  ///< the whole tensor's shape
  std::byte* base = nullptr;        ///< first element this view covers
  std::int64_t begin = 0;           ///< first element (flattened) of the tensor in this view
  std::int64_t end = 0;             ///< one past the last
  std::int64_t local_units = 0;     ///< RaggedShard blocks in this view

  [[nodiscard]] std::int64_t numel() const noexcept { return end - begin; }
  template <typename T>
  [[nodiscard]] T* data() const noexcept {
    return reinterpret_cast<T*>(base);
  }
};

/// A tensor's place in the group's global buffer of devices * shard_elems
/// elements, as the planner computed it.
using PlacedTensor = planner::PlannedTensor;

struct GroupPlan {
  std::uint32_t group_id = 0;
  std::uint32_t devices = 1;
  std::int64_t shard_elems = 0;
  std::vector<PlacedTensor> tensors;
};

class Connection;  // internal, shared by a Client and its Groups

class Group {
 public:
  Group(Group&&) noexcept;
  Group& operator=(Group&&) noexcept;
  ~Group();

  [[nodiscard]] const std::string& name() const noexcept;
  [[nodiscard]] const GroupPlan& plan() const noexcept;
  [[nodiscard]] std::uint32_t rank() const noexcept;

  /// This rank's part of tensor `index` in the sharded (master) region; an
  /// empty view (numel 0) when the rank holds none of it.
  [[nodiscard]] TensorView shardView(std::size_t index) const;
  /// The same part in the sharded gradient region.
  [[nodiscard]] TensorView shardGradView(std::size_t index) const;
  /// The whole tensor in the unsharded slot; requires unshard().
  [[nodiscard]] Result<TensorView> unshardedView(std::size_t index) const;
  [[nodiscard]] Result<TensorView> unshardedGradView(std::size_t index) const;

  /// Maps an unsharded slot (params + grads, devices * shard_elems each).
  [[nodiscard]] Result<void> unshard(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  /// Unmaps the slot; the daemon gives its pages back.
  [[nodiscard]] Result<void> reshard(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  [[nodiscard]] bool unsharded() const noexcept;

  /// Bytes of this rank's shard file (sharded + sharded gradient).
  [[nodiscard]] std::size_t shardBytes() const noexcept;

 private:
  friend class Client;
  struct State;
  explicit Group(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

class Client {
 public:
  [[nodiscard]] static Result<Client> connect(const ClientOptions& options);

  Client(Client&&) noexcept;
  Client& operator=(Client&&) noexcept;
  ~Client();  ///< closes the connection (the daemon reclaims the session)

  /// HELLO / WELCOME. Fails if (job, rank) is taken, the rank is outside the
  /// world size, or this user is not in the job's tenant.
  [[nodiscard]] Result<void> attach(const AttachOptions& options,
                                    std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  /// True if the daemon kept this job's shards from an earlier life of this rank.
  [[nodiscard]] bool reattached() const noexcept;
  [[nodiscard]] std::uint64_t daemonInstanceId() const noexcept;

  /// Collective: returns once every rank of the job registered the same group.
  [[nodiscard]] Result<Group> registerGroup(const GroupSpec& spec,
                                            std::optional<std::chrono::milliseconds> timeout = std::nullopt);

  /// Orderly goodbye; the connection is closed afterwards.
  [[nodiscard]] Result<void> detach(std::optional<std::chrono::milliseconds> timeout = std::nullopt);

 private:
  explicit Client(std::shared_ptr<Connection> connection);
  std::shared_ptr<Connection> connection_;
};

}  // namespace dbuf
