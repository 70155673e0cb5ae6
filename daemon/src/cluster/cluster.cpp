#include "cluster.hpp"

#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/redis_store.h>
#include <sys/stat.h>

#include <algorithm>
#include <charconv>
#include <exception>
#include <utility>

namespace dbuf::daemon {
namespace {

constexpr std::size_t kMaxPrefixLength = 128;

Error invalidStore(const std::string& text, const std::string& why) {
  return makeError(ErrorCode::kInvalidArgument, "store '" + text + "': " + why);
}

bool prefixCharacter(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == '-';
}

}  // namespace

Result<StoreSpec> parseStoreSpec(const std::string& text) {
  StoreSpec spec;
  std::string body = text;
  if (const std::size_t hash = text.find('#'); hash != std::string::npos) {
    spec.prefix = text.substr(hash + 1);
    body = text.substr(0, hash);
    if (spec.prefix.empty() || spec.prefix.size() > kMaxPrefixLength ||
        !std::all_of(spec.prefix.begin(), spec.prefix.end(), prefixCharacter)) {
      return invalidStore(text, "the prefix after '#' must be 1.." + std::to_string(kMaxPrefixLength) +
                                    " letters, digits, '.', '_' or '-'");
    }
  }
  if (body.starts_with("file:")) {
    spec.kind = StoreSpec::Kind::kFile;
    spec.path = body.substr(5);
    if (spec.path.empty() || spec.path.front() != '/' || spec.path.find("/../") != std::string::npos ||
        spec.path.ends_with("/..")) {
      return invalidStore(text, "a file store needs an absolute directory path without '..'");
    }
    return spec;
  }
  if (body.starts_with("redis:")) {
    spec.kind = StoreSpec::Kind::kRedis;
    const std::string address = body.substr(6);
    const std::size_t colon = address.rfind(':');
    if (colon == std::string::npos || colon == 0) return invalidStore(text, "a Redis store is redis:HOST:PORT");
    spec.host = address.substr(0, colon);
    const std::string port = address.substr(colon + 1);
    const auto parsed = std::from_chars(port.data(), port.data() + port.size(), spec.port);
    if (parsed.ec != std::errc{} || parsed.ptr != port.data() + port.size() || spec.port < 1 || spec.port > 65535) {
      return invalidStore(text, "'" + port + "' is not a TCP port");
    }
    return spec;
  }
  return invalidStore(text, "expected file:DIR or redis:HOST:PORT (optionally followed by #PREFIX)");
}

Result<void> checkStoreAllowed(const StoreSpec& store, const Config& config, std::uint32_t uid) {
  if (store.kind == StoreSpec::Kind::kRedis) {
    const std::string address = store.host + ":" + std::to_string(store.port);
    const auto& hosts = config.cluster_store_hosts;
    if (std::find(hosts.begin(), hosts.end(), address) == hosts.end()) {
      return makeError(ErrorCode::kPermissionDenied,
                       "Redis store " + address + " is not in this dbufd's [cluster] store_hosts");
    }
    return {};
  }
  struct stat info {};
  if (::lstat(store.path.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    return makeError(ErrorCode::kNotFound, "file store " + store.path + " is not a directory");
  }
  if (info.st_uid != uid || (info.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return makeError(ErrorCode::kPermissionDenied, "file store " + store.path +
                                                       " must belong to the job's user (uid " + std::to_string(uid) +
                                                       ") and be writable by nobody else");
  }
  return {};
}

Result<std::unique_ptr<gloo::rendezvous::Store>> openStore(const StoreSpec& store) {
  try {
    if (store.kind == StoreSpec::Kind::kFile) {
      return std::unique_ptr<gloo::rendezvous::Store>(std::make_unique<gloo::rendezvous::FileStore>(store.path));
    }
    return std::unique_ptr<gloo::rendezvous::Store>(
        std::make_unique<gloo::rendezvous::RedisStore>(store.host, store.port));
  } catch (const std::exception& error) {
    return makeError(ErrorCode::kUnavailable, std::string("cannot open the store: ") + error.what());
  }
}

std::shared_ptr<Communicator> CommunicatorCache::find(const std::string& key) {
  const std::lock_guard lock(mutex_);
  const auto found = communicators_.find(key);
  if (found == communicators_.end() || found->second->failed.load()) return nullptr;
  return found->second;
}

void CommunicatorCache::insert(const std::string& key, std::shared_ptr<Communicator> communicator) {
  const std::lock_guard lock(mutex_);
  communicators_[key] = std::move(communicator);
  made_.fetch_add(1);
}

std::optional<IdleCommunicators::Entry> IdleCommunicators::take(const std::string& key) {
  const std::lock_guard lock(mutex_);
  const auto found = idle_.find(key);
  if (found == idle_.end()) return std::nullopt;
  Entry entry = std::move(found->second);
  idle_.erase(found);
  return entry;
}

void IdleCommunicators::put(const std::string& key, Entry entry) {
  Entry replaced;  // ended outside the lock (its deleter may take a while)
  const std::lock_guard lock(mutex_);
  replaced = std::exchange(idle_[key], std::move(entry));
}

void Communicator::keep(std::shared_ptr<void> leftover) {
  const std::lock_guard lock(leftovers_mutex_);
  leftovers_.push_back(std::move(leftover));
}

void Waker::wake() {
  const std::lock_guard lock(mutex_);
  if (wake_) wake_();
}

void Waker::close() {
  const std::lock_guard lock(mutex_);
  wake_ = nullptr;
}

}  // namespace dbuf::daemon
