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
/// The first answer to a drain: what the daemon waits for.
[[nodiscard]] std::string renderDrain(const nlohmann::json& answer);

/// "1.5 GiB", "64 MiB", "512 B".
[[nodiscard]] std::string bytesText(double bytes);
/// "0, 2-5, 7".
[[nodiscard]] std::string rankList(const nlohmann::json& ranks);

}  // namespace dbuf::ctl
