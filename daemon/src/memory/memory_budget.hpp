#pragma once
// Bytes of shared memory charged per tenant and for the whole daemon.
// A charge that would pass either limit fails with how much was asked and how
// much is left; nothing is charged then.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dbuf/common/result.hpp"
#include "dbuf/daemon/config.hpp"

namespace dbuf::daemon {

class MemoryBudget {
 public:
  MemoryBudget(const std::vector<Tenant>& tenants, std::uint64_t daemon_limit)
      : tenants_(tenants), used_(tenants.size(), 0), daemon_limit_(daemon_limit) {}

  [[nodiscard]] Result<void> charge(std::size_t tenant, std::uint64_t bytes, const std::string& what) {
    if (auto fits = check(tenant, bytes, what); !fits) return fits;
    used_[tenant] += bytes;
    total_ += bytes;
    return {};
  }

  /// The error charge() would give now, charging nothing.
  [[nodiscard]] Result<void> check(std::size_t tenant, std::uint64_t bytes, const std::string& what) const {
    const std::uint64_t quota = tenants_[tenant].memory_quota_bytes;
    // A reload may have set the quota below what the tenant already uses.
    const std::uint64_t left = used_[tenant] >= quota ? 0 : quota - used_[tenant];
    if (bytes > left) {
      return makeError(ErrorCode::kInfeasible, what + " needs " + std::to_string(bytes) + " bytes but tenant '" +
                                                   tenants_[tenant].name + "' has " + std::to_string(left) +
                                                   " of its " + std::to_string(quota) + "-byte quota left");
    }
    if (bytes > daemon_limit_ - total_) {
      return makeError(ErrorCode::kInfeasible, what + " needs " + std::to_string(bytes) + " bytes but the daemon has " +
                                                   std::to_string(daemon_limit_ - total_) + " of its " +
                                                   std::to_string(daemon_limit_) + "-byte memory limit left");
    }
    return {};
  }

  void release(std::size_t tenant, std::uint64_t bytes) {
    used_[tenant] -= bytes;
    total_ -= bytes;
  }

  /// The tenant list changes (a reload): the use of old tenant t becomes
  /// that of `new_index[t]` (kDropped: it had none) among `tenants` tenants.
  /// Call before the new list replaces the old one.
  static constexpr std::size_t kDropped = static_cast<std::size_t>(-1);
  void remap(const std::vector<std::size_t>& new_index, std::size_t tenants) {
    std::vector<std::uint64_t> used(tenants, 0);
    for (std::size_t t = 0; t < new_index.size(); ++t) {
      if (new_index[t] != kDropped) used[new_index[t]] += used_[t];
    }
    used_ = std::move(used);
  }

  [[nodiscard]] std::uint64_t used(std::size_t tenant) const { return used_[tenant]; }
  [[nodiscard]] std::uint64_t total() const { return total_; }

 private:
  const std::vector<Tenant>& tenants_;
  std::vector<std::uint64_t> used_;
  std::uint64_t daemon_limit_;
  std::uint64_t total_ = 0;
};

}  // namespace dbuf::daemon
