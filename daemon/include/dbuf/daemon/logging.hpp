#pragma once
/// \file
/// dbufd logging: spdlog to stderr. Under systemd stderr is the journal, which
/// timestamps every line itself, so lines there carry no timestamp but start
/// with a `<N>` syslog priority prefix that journald turns into the entry's
/// priority. Anywhere else (a terminal, a test, a pipe) lines carry a local
/// timestamp and the level.
///
/// State: setupLogging() registers the logger in spdlog's registry under the
/// name "dbufd" and makes it spdlog's default logger, so both
/// `spdlog::get("dbufd")` and `spdlog::info(...)` reach it. That registry is
/// the only process-wide state; code that wants no globals (tests, an embedded
/// daemon) can build its own logger with makeLogger() and pass it around.
/// Calling setupLogging() again replaces the logger (e.g. once the config file
/// has been read). Loggers are thread-safe (multi-threaded sinks).

#include <spdlog/common.h>

#include <cstdint>
#include <memory>
#include <string_view>

#include "dbuf/daemon/config.hpp"

namespace spdlog {
class logger;
}  // namespace spdlog

namespace dbuf::daemon {

inline constexpr std::string_view kLoggerName = "dbufd";

enum class LogFormat : std::uint8_t {
  kTerminal,  ///< "[2024-05-01 12:00:00.123] [dbufd] [info] message"
  kJournal,   ///< "<6>info: message" (journald adds the time and the unit)
};

/// kJournal when stderr is connected to the journal: $JOURNAL_STREAM (set by
/// systemd) names the device and inode of stderr. Reads the environment; call
/// it once at start-up.
[[nodiscard]] LogFormat detectLogFormat();

/// True when `journal_stream` ("DEV:INODE", the value of $JOURNAL_STREAM)
/// matches the device and inode of `fd`. A set but stale variable (inherited
/// by a child whose stderr was redirected) does not match.
[[nodiscard]] bool isJournalStream(std::string_view journal_stream, int fd);

[[nodiscard]] spdlog::level::level_enum toSpdlogLevel(LogLevel level) noexcept;

/// A logger named "dbufd" writing to `sink` in `format` at `level`; not
/// registered anywhere. The caller owns it.
[[nodiscard]] std::shared_ptr<spdlog::logger> makeLogger(LogLevel level, LogFormat format, spdlog::sink_ptr sink);

/// Creates the stderr logger (format from detectLogFormat()), registers it as
/// "dbufd" and as spdlog's default logger, replacing any earlier one, and
/// returns it.
std::shared_ptr<spdlog::logger> setupLogging(LogLevel level);

}  // namespace dbuf::daemon
