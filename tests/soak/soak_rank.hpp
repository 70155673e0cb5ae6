#pragma once
/// \file
/// One rank process of dbuf-soak (soak_rank.cpp says what it does).

#include <cstdint>
#include <string>

namespace dbuf::soak {

struct RankArgs {
  std::string socket;
  std::string job;
  std::uint32_t rank = 0;
  std::uint32_t world = 2;
  std::uint64_t seed = 1;        ///< the job's: every rank draws the same groups and ops from it
  bool persistent = false;       ///< the supervisor restarts killed ranks (else the job ends when one dies)
  std::string stats_path;        ///< the RankStats file the supervisor created
  std::uint32_t groups = 3;
  std::int64_t max_elements = 1 << 18;  ///< elements of the largest group
  bool full_size = false;               ///< every group that large (else sizes down to 1/64 of it)
  std::int64_t op_timeout_ms = 20000;   ///< the client's timeout for each call
  std::int64_t recover_ms = 30000;      ///< longest a job may take to get back in step
};

/// Runs the rank until SIGTERM, a wrong result or an end it cannot recover
/// from; the process's exit status (0: nothing wrong).
[[nodiscard]] int runRank(const RankArgs& args);

}  // namespace dbuf::soak
