#include "soak_stats.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <type_traits>

namespace dbuf::soak {

static_assert(std::is_trivially_destructible_v<RankStats>);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free, "counters are shared between processes");

const char* opKindName(OpKind kind) noexcept {
  switch (kind) {
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kCount:
      break;
  }
  return "?";
}

const char* rankEndName(RankEnd end) noexcept {
  switch (end) {
    case RankEnd::kRunning:
      return "running";
    case RankEnd::kStopped:
      return "stopped";
    case RankEnd::kJobLostRank:
      return "job lost a rank";
    case RankEnd::kDaemonGone:
      return "daemon gone";
    case RankEnd::kWrongResult:
      return "WRONG RESULT";
    case RankEnd::kFailed:
      return "failed";
    case RankEnd::kStuck:
      return "stuck";
  }
  return "?";
}

RankStats* mapStats(const std::string& path, bool create) {
  const int fd = ::open(path.c_str(), create ? (O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC) : (O_RDWR | O_CLOEXEC), 0600);
  if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  // A new file is zero-filled, which is every counter at 0 and end = kRunning.
  if (create && ::ftruncate(fd, sizeof(RankStats)) != 0) {
    const int error = errno;
    ::close(fd);
    throw std::runtime_error("cannot size " + path + ": " + std::strerror(error));
  }
  void* memory = ::mmap(nullptr, sizeof(RankStats), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int error = errno;
  ::close(fd);
  if (memory == MAP_FAILED) throw std::runtime_error("cannot map " + path + ": " + std::strerror(error));
  return static_cast<RankStats*>(memory);
}

void unmapStats(RankStats* stats) noexcept {
  if (stats != nullptr) ::munmap(stats, sizeof(RankStats));
}

std::int64_t monotonicNs() noexcept {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<std::int64_t>(now.tv_sec) * 1'000'000'000 + now.tv_nsec;
}

}  // namespace dbuf::soak
