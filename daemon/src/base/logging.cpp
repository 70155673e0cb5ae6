#include "dbuf/daemon/logging.hpp"

#include <spdlog/logger.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <charconv>
#include <cstdlib>
#include <ctime>
#include <string>
#include <system_error>
#include <utility>

namespace dbuf::daemon {
namespace {

/// `%*`: the sd-daemon(3) priority prefix, "<3>" for errors ... "<7>" for debug.
class SyslogPriorityFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm& /*tm_time*/, spdlog::memory_buf_t& dest) override {
    const std::string_view prefix = priority(msg.level);
    dest.append(prefix.data(), prefix.data() + prefix.size());
  }
  [[nodiscard]] std::unique_ptr<custom_flag_formatter> clone() const override {
    return std::make_unique<SyslogPriorityFlag>();
  }

 private:
  static std::string_view priority(spdlog::level::level_enum level) {
    switch (level) {
      case spdlog::level::trace:
      case spdlog::level::debug:
        return "<7>";
      case spdlog::level::info:
        return "<6>";
      case spdlog::level::warn:
        return "<4>";
      case spdlog::level::err:
        return "<3>";
      case spdlog::level::critical:
        return "<2>";
      case spdlog::level::off:
      case spdlog::level::n_levels:
        break;
    }
    return "<6>";
  }
};

template <typename T>
bool parseNumber(std::string_view text, T& out) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc{} && end == text.data() + text.size() && !text.empty();
}

}  // namespace

LogFormat detectLogFormat() {
  // The one environment lookup of the logging setup (systemd.exec(5)).
  const char* journal_stream = std::getenv("JOURNAL_STREAM");  // NOLINT(concurrency-mt-unsafe): start-up only
  if (journal_stream != nullptr && isJournalStream(journal_stream, STDERR_FILENO)) return LogFormat::kJournal;
  return LogFormat::kTerminal;
}

bool isJournalStream(std::string_view journal_stream, int fd) {
  const std::size_t colon = journal_stream.find(':');
  if (colon == std::string_view::npos) return false;
  unsigned long long device = 0;
  unsigned long long inode = 0;
  if (!parseNumber(journal_stream.substr(0, colon), device) || !parseNumber(journal_stream.substr(colon + 1), inode)) {
    return false;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) return false;
  return static_cast<unsigned long long>(st.st_dev) == device && static_cast<unsigned long long>(st.st_ino) == inode;
}

spdlog::level::level_enum toSpdlogLevel(LogLevel level) noexcept {
  switch (level) {
    case LogLevel::kTrace:
      return spdlog::level::trace;
    case LogLevel::kDebug:
      return spdlog::level::debug;
    case LogLevel::kInfo:
      return spdlog::level::info;
    case LogLevel::kWarn:
      return spdlog::level::warn;
    case LogLevel::kError:
      return spdlog::level::err;
    case LogLevel::kOff:
      return spdlog::level::off;
  }
  return spdlog::level::info;
}

std::shared_ptr<spdlog::logger> makeLogger(LogLevel level, LogFormat format, spdlog::sink_ptr sink) {
  auto logger = std::make_shared<spdlog::logger>(std::string(kLoggerName), std::move(sink));
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  if (format == LogFormat::kJournal) {
    formatter->add_flag<SyslogPriorityFlag>('*').set_pattern("%*%l: %v");
  } else {
    formatter->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %v");
  }
  logger->set_formatter(std::move(formatter));
  logger->set_level(toSpdlogLevel(level));
  // stderr is unbuffered, but a file or pipe sink given by a caller may not be:
  // make sure warnings are out before a crash.
  logger->flush_on(spdlog::level::warn);
  return logger;
}

std::shared_ptr<spdlog::logger> setupLogging(LogLevel level) {
  const LogFormat format = detectLogFormat();
  // Colours only on a terminal (color_mode::automatic checks isatty).
  auto logger = makeLogger(level, format, std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
  spdlog::drop(std::string(kLoggerName));
  // set_default_logger() also registers the logger under its name.
  spdlog::set_default_logger(logger);
  return logger;
}

}  // namespace dbuf::daemon
