// dbufctl: asks a running dbufd what it holds, or drains it
// (docs/operations.md). One connection to the daemon's socket; each verb is
// one AdminRequest answered by a JSON document, printed as it is (--json) or
// as text.
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dbuf/ipc/protocol.hpp"
#include "dbuf/plan_io/report.hpp"
#include "dbuf/ipc/socket.hpp"
#include "render.hpp"

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr const char* kDefaultSocket = "/run/dbufd/dbufd.sock";
constexpr int kExitFailed = 1;  // the daemon refused or could not be asked
constexpr int kExitUsage = 2;

constexpr const char* kUsage =
    "usage: dbufctl [--socket PATH] [--json] [--timeout SECONDS] VERB [ARGS]\n"
    "  status          the daemon, its memory, tenants, jobs and sessions\n"
    "  jobs            one line per job: state, ranks, memory, its current collective\n"
    "  job JOB         a job's ranks, groups, registrations and current collective\n"
    "  sessions        every connection: ranks, operators, handshakes\n"
    "  trace JOB [--chrome FILE]\n"
    "                  the job's last collectives (flight recorder): when each rank submitted\n"
    "                  each, how long it ran, how it ended (--chrome: a trace Perfetto opens)\n"
    "  plan JOB GROUP [--svg FILE]\n"
    "                  the planner's report of a live group: each tensor's place, padding,\n"
    "                  the lower bound and the FSDP2 / Megatron baselines (--svg: its layout)\n"
    "  drain [--no-wait]\n"
    "                  refuse new jobs, wait for the running ones to end, then stop\n"
    "                  (dbufctl waits until the daemon has stopped, unless --no-wait)\n"
    "  --socket PATH   the daemon's socket (default $DBUF_SOCKET, else /run/dbufd/dbufd.sock)\n"
    "  --json          print the daemon's answer as JSON (docs/operations.md)\n"
    "  --timeout S     seconds to wait for each answer (default 10)\n"
    "exit status: 0 done, 1 the daemon refused or could not be reached, 2 bad usage\n";

struct Options {
  std::string socket;
  bool json = false;
  bool wait = true;  // drain
  std::string svg;     // plan: write the layout's picture here
  std::string chrome;  // trace: write a Chrome trace-event file here
  std::chrono::milliseconds timeout{10000};
  std::string verb;
  std::vector<std::string> args;
};

std::optional<Options> parseArgs(const std::vector<std::string>& argv, std::string& error) {
  Options options;
  const char* from_env = std::getenv("DBUF_SOCKET");  // NOLINT(concurrency-mt-unsafe): read once
  options.socket = from_env != nullptr && *from_env != '\0' ? from_env : kDefaultSocket;
  for (std::size_t i = 0; i < argv.size(); ++i) {
    const std::string& arg = argv[i];
    const bool has_value = i + 1 < argv.size();
    if (arg == "--json") {
      options.json = true;
    } else if (arg == "--no-wait") {
      options.wait = false;
    } else if (arg == "--svg" || arg == "--chrome") {
      if (!has_value) {
        error = arg + " needs a file";
        return std::nullopt;
      }
      (arg == "--svg" ? options.svg : options.chrome) = argv[++i];
    } else if (arg == "--socket" || arg == "--timeout") {
      if (!has_value) {
        error = arg + " needs a value";
        return std::nullopt;
      }
      const std::string& value = argv[++i];
      if (arg == "--socket") {
        options.socket = value;
        continue;
      }
      char* end = nullptr;
      const double seconds = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end != '\0' || !(seconds > 0) || seconds > 86400) {
        error = "--timeout takes seconds, more than 0 and at most 86400, not '" + value + "'";
        return std::nullopt;
      }
      options.timeout = std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
    } else if (arg.starts_with("--")) {
      error = "unknown option '" + arg + "'";
      return std::nullopt;
    } else if (options.verb.empty()) {
      options.verb = arg;
    } else {
      options.args.push_back(arg);
    }
  }
  if (options.verb.empty()) {
    error = "no verb given";
    return std::nullopt;
  }
  return options;
}

/// One operator connection to the daemon.
class Connection {
 public:
  static dbuf::Result<Connection> open(const Options& options) {
    auto fd = dbuf::ipc::connectUnix(options.socket, Clock::now() + options.timeout);
    if (!fd) {
      return std::move(fd).error().withContext("cannot reach dbufd at " + options.socket +
                                               " (is it running? --socket or $DBUF_SOCKET name another)");
    }
    return Connection(std::move(*fd), options.timeout);
  }

  /// Sends a request; its answer comes back from next().
  dbuf::Result<void> ask(const std::string& verb, const std::vector<std::string>& args) {
    return dbuf::ipc::sendMessage(fd_.get(), dbuf::ipc::AdminRequest{verb, args}, ++request_id_, {},
                                  Clock::now() + timeout_);
  }

  /// The next frame from the daemon within the timeout.
  dbuf::Result<dbuf::ipc::ReceivedFrame> next() { return dbuf::ipc::receiveMessage(fd_.get(), Clock::now() + timeout_); }

  /// The answer to the last request: its JSON, or the daemon's error.
  dbuf::Result<json> answer() {
    auto frame = next();
    if (!frame) return std::move(frame).error();
    return answerOf(*frame);
  }

  static dbuf::Result<json> answerOf(const dbuf::ipc::ReceivedFrame& frame) {
    if (const auto* reply = std::get_if<dbuf::ipc::AdminReply>(&frame.message)) {
      json document = json::parse(reply->json, nullptr, /*allow_exceptions=*/false);
      if (document.is_discarded()) return dbuf::makeError(dbuf::ErrorCode::kInternal, "dbufd answered with bad JSON");
      return document;
    }
    if (const auto* error = std::get_if<dbuf::ipc::ErrorReply>(&frame.message)) {
      return dbuf::makeError(dbuf::ipc::fromWire(error->code), error->message);
    }
    if (const auto* shutdown = std::get_if<dbuf::ipc::Shutdown>(&frame.message)) {
      return dbuf::makeError(dbuf::ErrorCode::kUnavailable, "dbufd stopped: " + shutdown->reason);
    }
    return dbuf::makeError(dbuf::ErrorCode::kInternal, "dbufd answered with an unexpected message");
  }

 private:
  Connection(dbuf::UniqueFd fd, std::chrono::milliseconds timeout) : fd_(std::move(fd)), timeout_(timeout) {}

  dbuf::UniqueFd fd_;
  std::chrono::milliseconds timeout_;
  std::uint64_t request_id_ = 0;
};

int fail(const std::string& message) {
  std::cerr << "dbufctl: " << message << "\n";
  return kExitFailed;
}

/// After a drain's first answer: asks again every second, saying which jobs
/// are left whenever that changes, until the daemon has stopped.
int waitForStop(Connection& connection, const Options& options, json last) {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    auto asked = connection.ask("drain", {});
    auto answer = asked ? connection.answer() : dbuf::Result<json>(std::move(asked).error());
    if (!answer) {
      // The daemon said goodbye (Shutdown) or closed the connection: it stopped.
      if (answer.error().code == dbuf::ErrorCode::kUnavailable || answer.error().code == dbuf::ErrorCode::kIo) {
        std::cout << (options.json ? "{\"stopped\":true}\n" : "dbufd has stopped\n");
        return 0;
      }
      return fail(answer.error().message);
    }
    if ((*answer)["waiting_for_jobs"] != last["waiting_for_jobs"]) {
      std::cout << (options.json ? answer->dump() + "\n" : dbuf::ctl::renderDrain(*answer)) << std::flush;
      last = std::move(*answer);
    }
  }
}

/// `plan`: the report as dbuf-plan prints it.
std::string renderPlan(const json& answer) {
  auto report = dbuf::plan_io::readPlanJson(answer.at("plan").dump());
  if (!report) throw std::runtime_error("the plan report: " + report.error().message);
  return "job " + answer.value("job", std::string("?")) + ", group " + answer.value("group", std::string("?")) +
         ":\n" + dbuf::plan_io::writePlanTable(*report);
}

void writeFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path);
}

/// --svg (plan) and --chrome (trace): the files besides the answer; what
/// dbufctl says of them.
std::string writeFiles(const json& answer, const Options& options) {
  std::string said;
  if (options.verb == "plan" && !options.svg.empty()) {
    auto report = dbuf::plan_io::readPlanJson(answer.at("plan").dump());
    if (!report) throw std::runtime_error("the plan report: " + report.error().message);
    auto svg = dbuf::plan_io::writePlanSvg(*report);
    if (!svg) throw std::runtime_error(svg.error().message);
    writeFile(options.svg, *svg);
    said += "wrote " + options.svg + "\n";
  }
  if (options.verb == "trace" && !options.chrome.empty()) {
    writeFile(options.chrome, dbuf::ctl::chromeTrace(answer).dump() + "\n");
    said += "wrote " + options.chrome + " (open it in https://ui.perfetto.dev or chrome://tracing)\n";
  }
  return said;
}

int run(const Options& options) {
  using Render = std::string (*)(const json&);
  static const std::map<std::string, Render> kRenderers{{"status", dbuf::ctl::renderStatus},
                                                        {"jobs", dbuf::ctl::renderJobs},
                                                        {"job", dbuf::ctl::renderJob},
                                                        {"sessions", dbuf::ctl::renderSessions},
                                                        {"plan", renderPlan},
                                                        {"trace", dbuf::ctl::renderTrace},
                                                        {"drain", dbuf::ctl::renderDrain}};
  const auto renderer = kRenderers.find(options.verb);
  if (renderer == kRenderers.end()) {
    std::cerr << "dbufctl: unknown verb '" << options.verb << "'\n" << kUsage;
    return kExitUsage;
  }
  auto connection = Connection::open(options);
  if (!connection) return fail(connection.error().message);
  if (auto asked = connection->ask(options.verb, options.args); !asked) return fail(asked.error().message);
  auto answer = connection->answer();
  if (!answer) return fail(answer.error().message);
  const std::string text = options.json ? answer->dump(2) + "\n" : renderer->second(*answer);
  const std::string files = writeFiles(*answer, options);
  std::cout << text << (options.json ? "" : files) << std::flush;
  if (options.verb == "drain" && options.wait) return waitForStop(*connection, options, std::move(*answer));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    std::cout << kUsage;
    return 0;
  }
  std::string error;
  const auto options = parseArgs(args, error);
  if (!options) {
    std::cerr << "dbufctl: " << error << "\n" << kUsage;
    return kExitUsage;
  }
  try {
    return run(*options);
  } catch (const json::exception& e) {  // an answer of another layout than documented
    return fail(std::string("cannot read dbufd's answer: ") + e.what());
  } catch (const std::runtime_error& e) {
    return fail(e.what());
  }
}
