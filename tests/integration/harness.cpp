#include "harness.hpp"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "dbuf/daemon/logging.hpp"
#include "dbuf/ipc/socket.hpp"

namespace dbuf::integration {
namespace {

/// The daemon logs at warn (errors it reports to clients show up in a failing
/// test's output); DBUF_TEST_LOG_LEVEL=info|debug|... for more.
void setUpLoggingOnce() {
  static std::once_flag once;
  std::call_once(once, [] {
    daemon::LogLevel level = daemon::LogLevel::kWarn;
    if (const char* wanted = std::getenv("DBUF_TEST_LOG_LEVEL"); wanted != nullptr) {  // NOLINT(concurrency-mt-unsafe)
      if (auto parsed = daemon::parseLogLevel(wanted)) level = *parsed;
    }
    daemon::setupLogging(level);
  });
}

}  // namespace

EmbeddedDaemon::EmbeddedDaemon(daemon::Config config) {
  setUpLoggingOnce();
  socket_path_ = dir_.path("dbufd.sock");
  config.socket_path = socket_path_;
  auto server = daemon::Server::create(std::move(config));
  if (!server) {
    ADD_FAILURE() << "Server::create: " << server.error().message;
    return;
  }
  server_ = std::move(*server);
  thread_ = std::thread([server = server_.get()] { server->run(); });
}

EmbeddedDaemon::~EmbeddedDaemon() {
  stop();
}

void EmbeddedDaemon::stop() {
  if (server_ == nullptr) return;
  if (thread_.joinable()) {
    server_->requestStop();
    thread_.join();
  }
}

daemon::ServerStats EmbeddedDaemon::stats() {
  if (server_ == nullptr) return {};
  return server_->stats();
}

Result<Client> EmbeddedDaemon::connect(std::chrono::milliseconds timeout) const {
  ClientOptions options;
  options.socket_path = socket_path_;
  options.timeout = timeout;
  return Client::connect(options);
}

Result<Client> EmbeddedDaemon::attach(const AttachOptions& options, std::chrono::milliseconds timeout) const {
  auto client = connect(timeout);
  if (!client) return client;
  if (auto attached = client->attach(options); !attached) return std::move(attached).error();
  return client;
}

UniqueFd EmbeddedDaemon::rawConnect() const {
  auto socket = ipc::connectUnix(socket_path_, ipc::Clock::now() + 10s);
  if (!socket) {
    ADD_FAILURE() << "connectUnix: " << socket.error().message;
    return {};
  }
  return std::move(*socket);
}

AttachOptions rankOf(const std::string& job, std::uint32_t rank, std::uint32_t world_size, bool persistent,
                     std::uint32_t prefetch_depth) {
  AttachOptions options;
  options.job = job;
  options.rank = rank;
  options.world_size = world_size;
  options.local_rank = rank;
  options.persistent = persistent;
  options.prefetch_depth = prefetch_depth;
  return options;
}

void onRanks(std::uint32_t n, const std::function<void(std::uint32_t)>& fn) {
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (std::uint32_t rank = 0; rank < n; ++rank) threads.emplace_back(fn, rank);
  for (std::thread& thread : threads) thread.join();
}

bool waitUntil(const std::function<bool()>& predicate, Clock::duration timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (predicate()) return true;
    if (Clock::now() >= deadline) return predicate();
    std::this_thread::yield();
  }
}

::testing::AssertionResult daemonIsEmpty(const daemon::ServerStats& stats) {
  if (stats.sessions == 0 && stats.jobs == 0 && stats.memfds == 0 && stats.bytes_in_use == 0) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "daemon still holds " << stats.sessions << " sessions, " << stats.jobs
                                       << " jobs, " << stats.memfds << " memfds, " << stats.bytes_in_use << " bytes";
}

std::size_t dbufMappings(const std::string& job) {
  std::ifstream maps("/proc/self/maps");
  const std::string needle = "/memfd:dbuf:" + job;
  std::size_t count = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find(needle) != std::string::npos) ++count;
  }
  return count;
}

std::uint64_t dbufMemfdAllocatedBytes(const std::string& prefix) {
  const std::string needle = "/memfd:dbuf:" + prefix;
  std::uint64_t bytes = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", error)) {
    std::error_code ignored;
    const std::string target = std::filesystem::read_symlink(entry.path(), ignored).string();
    if (target.rfind(needle, 0) != 0) continue;
    struct stat info {};
    if (::stat(entry.path().c_str(), &info) == 0) bytes += static_cast<std::uint64_t>(info.st_blocks) * 512;
  }
  return bytes;
}

std::size_t openFdCount() {
  std::size_t count = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  while (const dirent* entry = ::readdir(dir)) {  // NOLINT(concurrency-mt-unsafe): one reader
    if (entry->d_name[0] != '.') ++count;
  }
  ::closedir(dir);
  return count - 1;  // the directory's own fd
}

std::string describe(const GroupPlan& plan) {
  std::ostringstream text;
  text << "group " << plan.group_id << " over " << plan.devices << " devices, S=" << plan.shard_elems << ":";
  for (const PlacedTensor& tensor : plan.tensors) {
    text << " " << tensor.name << "[";
    for (std::size_t i = 0; i < tensor.shape.size(); ++i) text << (i ? "x" : "") << tensor.shape[i];
    text << "]@" << tensor.offset << "+" << tensor.numel << "/g" << tensor.granularity;
  }
  return text.str();
}

daemon::Config oneTenantWithQuota(const std::string& name, std::uint64_t quota_bytes) {
  daemon::Tenant tenant;
  tenant.name = name;
  tenant.uids = {static_cast<std::uint32_t>(::getuid())};
  tenant.memory_quota_bytes = quota_bytes;
  daemon::Config config;
  config.tenants = {tenant};
  return config;
}

GroupSpec smallGroup(const std::string& name, std::size_t tensors, std::int64_t rows) {
  GroupSpec spec;
  spec.name = name;
  for (std::size_t i = 0; i < tensors; ++i) spec.tensors.push_back({"t" + std::to_string(i), {rows, 8}, "", -1});
  return spec;
}

}  // namespace dbuf::integration
