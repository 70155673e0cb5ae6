#pragma once
// dbufctl's human output: each verb's answer (the daemon's JSON, documented
// in docs/operations.md) as text that fits a terminal. Pure functions; a
// field missing from the answer is shown as "?" rather than failing.

#include <nlohmann/json.hpp>
#include <string>

namespace dbuf::ctl {

[[nodiscard]] std::string renderStatus(const nlohmann::json& answer);
[[nodiscard]] std::string renderJobs(const nlohmann::json& answer);
[[nodiscard]] std::string renderJob(const nlohmann::json& answer);
[[nodiscard]] std::string renderSessions(const nlohmann::json& answer);
/// A job's flight recorder: one line per collective, oldest first.
[[nodiscard]] std::string renderTrace(const nlohmann::json& answer);
/// The same as a Chrome trace-event document (Perfetto, chrome://tracing):
/// a process for the job, a track per rank, each op's wait (its submission
/// to the moment every rank had submitted it) and run phases.
[[nodiscard]] nlohmann::json chromeTrace(const nlohmann::json& answer);

/// The first answer to a drain: what the daemon waits for.
[[nodiscard]] std::string renderDrain(const nlohmann::json& answer);

/// "1.5 GiB", "64 MiB", "512 B".
[[nodiscard]] std::string bytesText(double bytes);
/// "0, 2-5, 7".
[[nodiscard]] std::string rankList(const nlohmann::json& ranks);

}  // namespace dbuf::ctl
