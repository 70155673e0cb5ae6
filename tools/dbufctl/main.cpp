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

#include "dbuf/cli/command_line.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "dbuf/plan_io/report.hpp"
#include "dbuf/ipc/socket.hpp"
#include "render.hpp"

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr const char* kDefaultSocket = "/run/dbufd/dbufd.sock";
constexpr int kExitFailed = 1;  // the daemon refused or could not be asked

struct Options {
  std::string socket = kDefaultSocket;
  bool json = false;
  bool wait = true;  // drain
  std::string svg;     // plan: write the layout's picture here
  std::string chrome;  // trace: write a Chrome trace-event file here
  std::chrono::milliseconds timeout{10000};
  std::string verb;
  std::vector<std::string> args;  // the verb's operands, in order
};

struct Operand {
  std::string name;
  std::string help;
};
const Operand kJob{"JOB", "The job's id (dbufctl jobs lists them)"};
const Operand kGroup{"GROUP", "The group's name (dbufctl job JOB lists them)"};

/// A verb: one AdminRequest (docs/operations.md) with its operands in order.
CLI::App* addVerb(CLI::App& app, Options& options, const std::string& verb, const std::string& help,
                  const std::vector<Operand>& operands = {}) {
  CLI::App* sub = app.add_subcommand(verb, help);
  for (const Operand& operand : operands) {
    // Positionals are filled in the order they are declared: the operands' order on the wire.
    sub->add_option_function<std::string>(
           operand.name, [&options](const std::string& value) { options.args.push_back(value); }, operand.help)
        ->required();
  }
  return sub;
}

/// --timeout's value: seconds, more than 0 and at most a day.
std::string checkSeconds(const std::string& text) {
  char* end = nullptr;
  const double seconds = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !(seconds > 0) || seconds > 86400) {
    return "takes seconds, more than 0 and at most 86400, not '" + text + "'";
  }
  return {};
}

void describeCommandLine(CLI::App& app, Options& options, std::string& unknown_verb) {
  app.fallthrough();  // --socket, --json and --timeout after the verb too (the verbs inherit it)
  app.add_option("--socket", options.socket, "The daemon's socket (else $DBUF_SOCKET, else the default)")
      ->envname("DBUF_SOCKET")
      ->type_name("PATH")
      ->capture_default_str();
  app.add_flag("--json", options.json, "Print the daemon's answer as JSON (docs/operations.md)");
  app.add_option_function<double>(
         "--timeout",
         [&options](double seconds) { options.timeout = std::chrono::milliseconds(static_cast<long long>(seconds * 1000)); },
         "Seconds to wait for each answer (default 10)")
      ->type_name("SECONDS")
      ->check(CLI::Validator(checkSeconds, ""));
  addVerb(app, options, "status", "The daemon, its build, memory, tenants, jobs and sessions");
  addVerb(app, options, "jobs", "One line per job: state, ranks, memory, its current collective");
  addVerb(app, options, "job", "A job's ranks, groups, registrations and current collective", {kJob});
  addVerb(app, options, "sessions", "Every connection: ranks, operators, handshakes");
  addVerb(app, options, "trace",
          "The job's last collectives (flight recorder): when each rank submitted each, how long it ran, how it "
          "ended",
          {kJob})
      ->add_option("--chrome", options.chrome, "Also write a Chrome trace-event file (Perfetto opens it)")
      ->type_name("FILE");
  addVerb(app, options, "plan",
          "The planner's report of a live group: each tensor's place, padding, the lower bound and the FSDP2 / "
          "Megatron baselines",
          {kJob, kGroup})
      ->add_option("--svg", options.svg, "Also write the layout's picture (SVG)")
      ->type_name("FILE");
  addVerb(app, options, "drain",
          "Refuse new jobs, wait for the running ones to end, then stop (dbufctl waits until the daemon has "
          "stopped)")
      ->add_flag_callback("--no-wait", [&options] { options.wait = false; }, "Return once the daemon has started draining");
  // A word that names no verb lands here (verbs take precedence), so the error can name it.
  app.add_option("VERB", unknown_verb)->group("");
  app.footer("exit status: 0 done, 1 the daemon refused or could not be reached, 2 bad usage");
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
  if (renderer == kRenderers.end()) return fail("no rendering for verb '" + options.verb + "'");  // a verb added half
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
  Options options;
  std::string unknown_verb;
  CLI::App app{"dbufctl: asks a running dbufd what it holds, or drains it (docs/operations.md)", "dbufctl"};
  dbuf::cli::useConventions(app);
  describeCommandLine(app, options, unknown_verb);
  if (const auto done = dbuf::cli::parse(app, argc, argv)) return *done;
  if (!unknown_verb.empty()) return dbuf::cli::usageError(app, "unknown verb '" + unknown_verb + "'");
  const auto verbs = app.get_subcommands();
  if (verbs.empty()) return dbuf::cli::usageError(app, "no verb given");
  if (verbs.size() > 1) {
    return dbuf::cli::usageError(app, "one verb at a time, got '" + verbs[0]->get_name() + "' and '" +
                                          verbs[1]->get_name() + "'");
  }
  options.verb = verbs.front()->get_name();
  try {
    return run(options);
  } catch (const json::exception& e) {  // an answer of another layout than documented
    return fail(std::string("cannot read dbufd's answer: ") + e.what());
  } catch (const std::runtime_error& e) {
    return fail(e.what());
  }
}
