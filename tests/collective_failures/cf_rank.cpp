// dbuf-cf-rank: a test-only trainer process for collective_failures_process_test.
// Like tests/multiprocess/mp_rank.cpp it does exactly what its commands say,
// one line at a time from stdin, and answers each with one line on stdout,
// flushed at once, so the test knows which stage it kills the process in:
//
//   ok <command> [details]
//   err <command> <code>[ elapsed_ms=N]: <message>   (code: dbuf::toString, '_' for ' ')
//   begin <command>                                  printed once a blocking op is submitted
//
// Commands (groups hold one fp32 tensor "w", fp32 unsharded):
//   connect SOCKET / attach JOB RANK WORLD [LOCAL_RANK LOCAL_WORLD STORE] [persistent] / detach / pid
//                                 (the optional three: a job across nodes); "ok attach", or
//                                 "ok attach reattached" when the job kept the rank's shards
//   register NAME ELEMENTS        Client::registerGroup
//   acquire NAME                  Group::acquireSlot
//   fill NAME BASE                shard := (rank + 1) * BASE; with a slot also the unsharded
//                                 gradient := (rank + 1) * BASE, and the first and last element
//                                 of the params := -1 (a sentinel; the rest stays untouched)
//   fillshard NAME BASE           the same without the gradient (for large groups)
//   submit ag|rs|barrier NAME     submit only; "ok submit id=N"
//   wait ID                       Client::wait; "ok wait seq=S elapsed_ms=E"
//   run ag|rs|barrier NAME        "begin run" once submitted, then waits: "ok run seq=S elapsed_ms=E"
//   rejoin TRIES                  what a trainer does after a failure: barriers until one succeeds
//                                 (0.1 s apart), at most TRIES; "ok rejoin tries=N" ("begin rejoin" first)
//   watch NAME                    spins until params[0] is no longer the sentinel (the daemon
//                                 started the all-gather); "ok watch last_untouched=0|1"
//                                 tells whether the last element still holds the sentinel
//   checkag NAME BASE             params element i == (i / shard_elems + 1) * BASE
//   checkrs NAME BASE             sharded gradient == BASE * (1 + 2 + ... + world)
//   exit
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "dbuf/client.hpp"

namespace {

using Clock = std::chrono::steady_clock;
constexpr float kSentinel = -1.0F;

void say(const std::string& line) {
  std::string text = line;
  for (char& c : text) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  text += '\n';
  const char* data = text.data();
  std::size_t left = text.size();
  while (left > 0) {
    const ssize_t n = ::write(STDOUT_FILENO, data, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data += n;
    left -= static_cast<std::size_t>(n);
  }
}

std::string codeName(dbuf::ErrorCode code) {
  std::string name(dbuf::toString(code));
  for (char& c : name) {
    if (c == ' ') c = '_';
  }
  return name;
}

std::string elapsedSince(Clock::time_point start) {
  return "elapsed_ms=" + std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count());
}

class Rank {
 public:
  void run(const std::string& line) {
    std::istringstream in(line);
    std::string command;
    in >> command;
    std::vector<std::string> args;
    for (std::string arg; in >> arg;) args.push_back(arg);
    if (command.empty()) return;
    if (command == "connect" && args.size() == 1) return connect(args[0]);
    if (command == "attach" && args.size() >= 3 && args.size() <= 7 && args.size() != 5) return attach(args);
    if (command == "register" && args.size() == 2) return registerGroup(args[0], std::stoll(args[1]));
    if (command == "acquire" && args.size() == 1) return acquire(args[0]);
    if ((command == "fill" || command == "fillshard") && args.size() == 2) {
      return fill(command, args[0], std::stof(args[1]));
    }
    if (command == "submit" && args.size() == 2) return submit(args[0], args[1]);
    if (command == "wait" && args.size() == 1) return wait(std::stoull(args[0]));
    if (command == "run" && args.size() == 2) return runOp(args[0], args[1]);
    if (command == "rejoin" && args.size() == 1) return rejoin(std::stoi(args[0]));
    if (command == "watch" && args.size() == 1) return watch(args[0]);
    if (command == "checkag" && args.size() == 2) return checkGathered(args[0], std::stof(args[1]));
    if (command == "checkrs" && args.size() == 2) return checkReduced(args[0], std::stof(args[1]));
    if (command == "detach" && args.empty()) return detach();
    if (command == "pid" && args.empty()) return say("ok pid " + std::to_string(::getpid()));
    say("err " + command + " usage: bad command or arguments: " + line);
  }

 private:
  void connect(const std::string& socket) {
    groups_.clear();
    client_.reset();
    auto client = dbuf::Client::connect({socket, std::chrono::seconds(20)});
    if (!client) return fail("connect", client.error());
    client_.emplace(std::move(*client));
    say("ok connect");
  }

  void attach(const std::vector<std::string>& args) {
    if (!client_) return say("err attach usage: connect first");
    dbuf::AttachOptions options;
    options.job = args[0];
    options.rank = static_cast<std::uint32_t>(std::stoul(args[1]));
    options.world_size = static_cast<std::uint32_t>(std::stoul(args[2]));
    if (args.size() >= 6) {
      options.local_rank = static_cast<std::uint32_t>(std::stoul(args[3]));
      options.local_world_size = static_cast<std::uint32_t>(std::stoul(args[4]));
      options.store = args[5];
    }
    options.persistent = args.size() % 3 == 1;
    if (options.persistent && args.back() != "persistent") {
      return say("err attach usage: the last word is 'persistent'");
    }
    rank_ = options.rank;
    world_ = options.world_size;
    if (auto attached = client_->attach(options); !attached) return fail("attach", attached.error());
    say(client_->reattached() ? "ok attach reattached" : "ok attach");
  }

  void registerGroup(const std::string& name, std::int64_t elements) {
    if (!client_) return say("err register usage: connect first");
    dbuf::GroupSpec spec;
    spec.name = name;
    spec.granularity = "element";
    spec.sharded_dtype = dbuf::DType::kF32;
    spec.unsharded_dtype = dbuf::DType::kF32;
    spec.tensors = {{"w", {elements}, "", -1}};
    say("begin register");
    auto group = client_->registerGroup(spec);
    if (!group) return fail("register", group.error());
    const std::string details = "S=" + std::to_string(group->plan().shard_elems);
    groups_.insert_or_assign(name, std::move(*group));
    say("ok register " + details);
  }

  dbuf::Group* find(const std::string& command, const std::string& name) {
    const auto found = groups_.find(name);
    if (found == groups_.end()) {
      say("err " + command + " usage: no group " + name);
      return nullptr;
    }
    return &found->second;
  }

  void acquire(const std::string& name) {
    dbuf::Group* group = find("acquire", name);
    if (group == nullptr) return;
    if (auto done = group->acquireSlot(); !done) return fail("acquire", done.error());
    say("ok acquire");
  }

  void fill(const std::string& command, const std::string& name, float base) {
    dbuf::Group* group = find(command, name);
    if (group == nullptr) return;
    const float value = static_cast<float>(rank_ + 1) * base;
    const dbuf::TensorView shard = group->shardView(0);
    for (std::int64_t i = 0; i < shard.numel(); ++i) shard.data<float>()[i] = value;
    if (group->unsharded()) {
      auto grads = group->unshardedGradView(0);
      auto params = group->unshardedView(0);
      if (!grads || !params) return say("err " + command + " usage: no slot views");
      if (command == "fill") {
        for (std::int64_t i = 0; i < grads->numel(); ++i) grads->data<float>()[i] = value;
      }
      params->data<float>()[0] = kSentinel;
      params->data<float>()[params->numel() - 1] = kSentinel;
    }
    say("ok " + command);
  }

  dbuf::Result<dbuf::OpHandle> submitOp(const std::string& op, const std::string& name) {
    if (op == "barrier") return client_->submitBarrier();
    const auto found = groups_.find(name);
    if (found == groups_.end()) return dbuf::makeError(dbuf::ErrorCode::kInvalidArgument, "no group " + name);
    if (op == "ag") return found->second.submitAllGather();
    if (op == "rs") return found->second.submitReduceScatter({dbuf::ReduceMode::kSum});
    return dbuf::makeError(dbuf::ErrorCode::kInvalidArgument, "unknown op " + op);
  }

  void submit(const std::string& op, const std::string& name) {
    if (!client_) return say("err submit usage: connect first");
    auto handle = submitOp(op, name);
    if (!handle) return fail("submit", handle.error());
    say("ok submit id=" + std::to_string(handle->id));
  }

  void finishWait(const std::string& command, dbuf::OpHandle handle, Clock::time_point start) {
    auto done = client_->wait(handle);
    if (!done) {
      return say("err " + command + " " + codeName(done.error().code) + " " + elapsedSince(start) + ": " +
                 done.error().message);
    }
    say("ok " + command + " seq=" + std::to_string(done->sequence) + " " + elapsedSince(start));
  }

  void wait(std::uint64_t id) {
    if (!client_) return say("err wait usage: connect first");
    finishWait("wait", dbuf::OpHandle{id}, Clock::now());
  }

  void runOp(const std::string& op, const std::string& name) {
    if (!client_) return say("err run usage: connect first");
    auto handle = submitOp(op, name);
    if (!handle) return fail("run", handle.error());
    const auto start = Clock::now();
    say("begin run");
    finishWait("run", *handle, start);
  }

  void rejoin(int tries) {
    if (!client_) return say("err rejoin usage: connect first");
    const auto start = Clock::now();
    say("begin rejoin");
    dbuf::Error last{dbuf::ErrorCode::kInternal, "no try", {}};
    for (int n = 1; n <= tries; ++n) {
      auto handle = client_->submitBarrier();
      auto done = handle ? client_->wait(*handle) : dbuf::Result<dbuf::OpResult>(handle.error());
      if (done) return say("ok rejoin tries=" + std::to_string(n) + " " + elapsedSince(start));
      last = done.error();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    say("err rejoin " + codeName(last.code) + " " + elapsedSince(start) + ": " + last.message);
  }

  void watch(const std::string& name) {
    dbuf::Group* group = find("watch", name);
    if (group == nullptr) return;
    auto params = group->unshardedView(0);
    if (!params) return fail("watch", params.error());
    const std::atomic_ref<float> first(params->data<float>()[0]);
    const std::atomic_ref<float> last(params->data<float>()[params->numel() - 1]);
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (first.load(std::memory_order_relaxed) == kSentinel) {
      if (Clock::now() > deadline) return say("err watch timeout: the all-gather did not start");
    }
    say(std::string("ok watch last_untouched=") + (last.load(std::memory_order_relaxed) == kSentinel ? "1" : "0"));
  }

  void checkGathered(const std::string& name, float base) {
    dbuf::Group* group = find("checkag", name);
    if (group == nullptr) return;
    auto params = group->unshardedView(0);
    if (!params) return fail("checkag", params.error());
    const std::int64_t shard = group->plan().shard_elems;
    for (std::int64_t i = 0; i < params->numel(); ++i) {
      const float expected = static_cast<float>(i / shard + 1) * base;
      if (params->data<float>()[i] != expected) {
        return say("err checkag mismatch: element " + std::to_string(i) + " holds " +
                   std::to_string(params->data<float>()[i]) + ", expected " + std::to_string(expected));
      }
    }
    say("ok checkag");
  }

  void checkReduced(const std::string& name, float base) {
    dbuf::Group* group = find("checkrs", name);
    if (group == nullptr) return;
    const dbuf::TensorView grad = group->shardGradView(0);
    const float expected = base * static_cast<float>(world_ * (world_ + 1) / 2);
    for (std::int64_t i = 0; i < grad.numel(); ++i) {
      if (grad.data<float>()[i] != expected) {
        return say("err checkrs mismatch: element " + std::to_string(grad.begin + i) + " holds " +
                   std::to_string(grad.data<float>()[i]) + ", expected " + std::to_string(expected));
      }
    }
    say("ok checkrs");
  }

  void detach() {
    if (!client_) return say("err detach usage: connect first");
    if (auto detached = client_->detach(); !detached) return fail("detach", detached.error());
    say("ok detach");
  }

  static void fail(const std::string& command, const dbuf::Error& error) {
    say("err " + command + " " + codeName(error.code) + ": " + error.message);
  }

  std::optional<dbuf::Client> client_;
  std::map<std::string, dbuf::Group> groups_;
  std::uint32_t rank_ = 0;
  std::uint32_t world_ = 1;
};

}  // namespace

int main() {
  Rank rank;
  for (std::string line; std::getline(std::cin, line);) {
    if (line == "exit") break;
    rank.run(line);
  }
  return 0;
}
