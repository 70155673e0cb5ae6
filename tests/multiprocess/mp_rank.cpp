// dbuf-mp-rank: a test-only trainer process for tests/multiprocess. It does
// exactly what its commands say, one line at a time from stdin, and answers
// each on stdout with one line, flushed at once:
//
//   ok <command> [details]          the step is done
//   err <command> <code>: <message> the step failed (code: dbuf::toString, '_' for ' ')
//   begin <command>                 printed before a call that blocks on other ranks
//
// so the test knows exactly which stage it kills the process in: between two
// commands it is blocked reading stdin. EOF on stdin ends the process.
//
//   --uid U --gid G   drop to this uid / gid (and no supplementary groups) first;
//                     answers "ok ids uid=U gid=G" or "err ids ..." on stdout.
//
// Commands:
//   connect SOCKET                       dbuf::Client::connect (replaces any earlier client)
//   attach JOB RANK WORLD [persistent]   Client::attach; "ok attach reattached=0|1"
//   register NAME                        Client::registerGroup of a fixed 3-tensor spec
//   write NAME SEED                      fill this rank's shard of every tensor with a pattern
//   check NAME SEED                      verify that pattern, element by element
//   acquire NAME                         Group::acquireSlot: map a slot, gather nothing (not a
//                                        collective); writes 0x5a over the params so that the
//                                        slot's pages are really there
//   unshard NAME                         Group::unshard: a collective (every rank of the job):
//                                        slot if needed, then the all-gather; "begin unshard" first
//   gather NAME                          Group::allGather alone: a collective on the rings, needs
//                                        the slot (acquire); "begin gather" first
//   gathered NAME SEED0 SEED1 ...        verify the unsharded params, element by element: the
//                                        pattern of rank r's write with SEEDr (one seed per rank of
//                                        the job), cast to bf16 as the all-gather does
//   reshard NAME                         Group::reshard
//   drop NAME                            destroy the Group (unmaps its memory)
//   detach                               Client::detach
//   raw-connect SOCKET                   a bare connection (no Hello)
//   raw-half-hello JOB RANK WORLD        send the first half of a Hello frame on it
//   open PATH                            open(PATH, O_RDONLY); "err open errno=NAME ..." on failure
//   pid                                  "ok pid <pid>"
//   exit
#include <fcntl.h>
#include <grp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "dbuf/client.hpp"
#include "dbuf/common/unique_fd.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "dbuf/ipc/socket.hpp"
#include "dbuf/kernels/convert.hpp"

namespace {

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
      return;  // the test is gone; nothing to tell
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

void fail(const std::string& command, const dbuf::Error& error) {
  say("err " + command + " " + codeName(error.code) + ": " + error.message);
}

/// The group every rank registers: three tensors of different shapes.
dbuf::GroupSpec groupSpec(const std::string& name) {
  dbuf::GroupSpec spec;
  spec.name = name;
  spec.granularity = "element";
  spec.tensors = {{"w", {48, 40}, "", -1}, {"b", {40}, "", -1}, {"e", {4, 25, 8}, "", -1}};
  return spec;
}

/// The value of element `index` of this rank's part of tensor `tensor`.
std::uint32_t pattern(std::uint32_t seed, std::uint32_t rank, std::size_t tensor, std::int64_t index) {
  std::uint64_t x = (std::uint64_t{seed} << 40) ^ (std::uint64_t{rank} << 32) ^ (std::uint64_t{tensor} << 24) ^
                    static_cast<std::uint64_t>(index);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return static_cast<std::uint32_t>(x);
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
    if (command == "attach" && (args.size() == 3 || args.size() == 4)) return attach(args);
    if (command == "register" && args.size() == 1) return registerGroup(args[0]);
    if ((command == "write" || command == "check") && args.size() == 2) return pattern(command, args[0], args[1]);
    if ((command == "acquire" || command == "unshard" || command == "gather" || command == "reshard") &&
        args.size() == 1) {
      return slot(command, args[0]);
    }
    if (command == "gathered" && args.size() >= 2) return gathered(args);
    if (command == "drop" && args.size() == 1) {
      groups_.erase(args[0]);
      return say("ok drop");
    }
    if (command == "detach" && args.empty()) return detach();
    if (command == "raw-connect" && args.size() == 1) return rawConnect(args[0]);
    if (command == "raw-half-hello" && args.size() == 3) return rawHalfHello(args);
    if (command == "open" && args.size() == 1) return openPath(args[0]);
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
    options.persistent = args.size() == 4 && args[3] == "persistent";
    rank_ = options.rank;
    world_ = options.world_size;
    if (auto attached = client_->attach(options); !attached) return fail("attach", attached.error());
    say(std::string("ok attach reattached=") + (client_->reattached() ? "1" : "0"));
  }

  void registerGroup(const std::string& name) {
    if (!client_) return say("err register usage: connect first");
    say("begin register");
    auto group = client_->registerGroup(groupSpec(name));
    if (!group) return fail("register", group.error());
    const std::string details =
        "S=" + std::to_string(group->plan().shard_elems) + " bytes=" + std::to_string(group->shardBytes());
    groups_.insert_or_assign(name, std::move(*group));
    say("ok register " + details);
  }

  void pattern(const std::string& command, const std::string& name, const std::string& seed_text) {
    const auto found = groups_.find(name);
    if (found == groups_.end()) return say("err " + command + " usage: no group " + name);
    const auto seed = static_cast<std::uint32_t>(std::stoul(seed_text));
    const dbuf::Group& group = found->second;
    std::int64_t elements = 0;
    for (std::size_t t = 0; t < group.plan().tensors.size(); ++t) {
      const dbuf::TensorView view = group.shardView(t);
      auto* data = view.data<std::uint32_t>();  // fp32 storage, written as bit patterns
      for (std::int64_t i = 0; i < view.numel(); ++i) {
        const std::uint32_t expected = ::pattern(seed, rank_, t, view.begin + i);
        if (command == "write") {
          std::memcpy(data + i, &expected, sizeof expected);
        } else {
          std::uint32_t actual = 0;
          std::memcpy(&actual, data + i, sizeof actual);
          if (actual != expected) {
            return say("err check mismatch: tensor " + std::to_string(t) + " element " +
                       std::to_string(view.begin + i) + " holds " + std::to_string(actual) + ", expected " +
                       std::to_string(expected));
          }
        }
      }
      elements += view.numel();
    }
    if (elements == 0) return say("err " + command + " usage: this rank holds no elements");
    say("ok " + command + " elements=" + std::to_string(elements));
  }

  void slot(const std::string& command, const std::string& name) {
    const auto found = groups_.find(name);
    if (found == groups_.end()) return say("err " + command + " usage: no group " + name);
    dbuf::Group& group = found->second;
    if (command == "unshard" || command == "gather") say("begin " + command);  // blocks on the other ranks
    dbuf::Result<void> done = command == "acquire"   ? group.acquireSlot()
                              : command == "unshard" ? group.unshard()
                              : command == "gather"  ? group.allGather()
                                                     : group.reshard();
    if (!done) return fail(command, done.error());
    if (command == "acquire") {
      // Touch the slot so its pages are really there (nothing was gathered).
      auto view = group.unshardedView(0);
      if (!view) return fail(command, view.error());
      std::memset(view->base, 0x5a, static_cast<std::size_t>(view->numel()) * 2);
    }
    say("ok " + command);
  }

  void gathered(const std::vector<std::string>& args) {
    const auto found = groups_.find(args[0]);
    if (found == groups_.end()) return say("err gathered usage: no group " + args[0]);
    if (args.size() - 1 != world_) {
      return say("err gathered usage: " + std::to_string(world_) + " seeds needed, one per rank");
    }
    const dbuf::Group& group = found->second;
    const dbuf::GroupPlan& plan = group.plan();
    std::int64_t elements = 0;
    for (std::size_t t = 0; t < plan.tensors.size(); ++t) {
      auto view = group.unshardedView(t);
      if (!view) return fail("gathered", view.error());
      const auto* data = view->data<std::uint16_t>();  // bf16 bit patterns
      for (std::int64_t e = 0; e < view->numel(); ++e) {
        const auto owner = static_cast<std::uint32_t>((plan.tensors[t].offset + e) / plan.shard_elems);
        const auto seed = static_cast<std::uint32_t>(std::stoul(args[1 + owner]));
        const std::uint16_t expected =
            dbuf::kernels::floatToBf16(dbuf::kernels::bitsFloat(::pattern(seed, owner, t, e)));
        if (data[e] != expected) {
          return say("err gathered mismatch: tensor " + std::to_string(t) + " element " + std::to_string(e) +
                     " (rank " + std::to_string(owner) + "'s) holds " + std::to_string(data[e]) + ", expected " +
                     std::to_string(expected));
        }
      }
      elements += view->numel();
    }
    say("ok gathered elements=" + std::to_string(elements));
  }

  void detach() {
    if (!client_) return say("err detach usage: connect first");
    if (auto detached = client_->detach(); !detached) return fail("detach", detached.error());
    say("ok detach");
  }

  void rawConnect(const std::string& socket) {
    auto fd = dbuf::ipc::connectUnix(socket, dbuf::ipc::Clock::now() + std::chrono::seconds(10));
    if (!fd) return fail("raw-connect", fd.error());
    raw_ = std::move(*fd);
    say("ok raw-connect");
  }

  void rawHalfHello(const std::vector<std::string>& args) {
    if (!raw_) return say("err raw-half-hello usage: raw-connect first");
    dbuf::ipc::Hello hello;
    hello.job_id = args[0];
    hello.rank = static_cast<std::uint32_t>(std::stoul(args[1]));
    hello.world_size = static_cast<std::uint32_t>(std::stoul(args[2]));
    hello.nonce = 42;
    auto frame = dbuf::ipc::encodeFrame(hello, 1);
    if (!frame) return fail("raw-half-hello", frame.error());
    const std::size_t half = frame->size() / 2;
    std::size_t sent = 0;
    while (sent < half) {
      const ssize_t n = ::send(raw_.get(), frame->data() + sent, half - sent, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) continue;  // a few dozen bytes on a fresh socket: never for long
      if (n < 0) return say(std::string("err raw-half-hello io: send: ") + std::strerror(errno));
      sent += static_cast<std::size_t>(n);
    }
    say("ok raw-half-hello sent=" + std::to_string(sent) + " of " + std::to_string(frame->size()));
  }

  static void openPath(const std::string& path) {
    const dbuf::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));  // NOLINT(cppcoreguidelines-pro-type-vararg)
    if (!fd) {
      const int error = errno;
      return say(std::string("err open errno=") +
                 (error == EACCES  ? "EACCES"
                  : error == EPERM ? "EPERM"
                                   : "other") +
                 " " + std::strerror(error));
    }
    say("ok open");
  }

  std::optional<dbuf::Client> client_;
  std::map<std::string, dbuf::Group> groups_;
  std::uint32_t rank_ = 0;
  std::uint32_t world_ = 1;
  dbuf::UniqueFd raw_;
};

/// setgroups / setgid / setuid, in that order (after setuid the others are
/// not permitted any more).
bool dropPrivileges(uid_t uid, gid_t gid) {
  if (::setgroups(0, nullptr) != 0 || ::setgid(gid) != 0 || ::setuid(uid) != 0) {
    say(std::string("err ids cannot switch to uid ") + std::to_string(uid) + ": " + std::strerror(errno));
    return false;
  }
  if (::getuid() != uid || ::geteuid() != uid || ::getgid() != gid) {
    say("err ids credentials did not change");
    return false;
  }
  say("ok ids uid=" + std::to_string(::getuid()) + " gid=" + std::to_string(::getgid()));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  std::optional<uid_t> uid;
  std::optional<gid_t> gid;
  for (std::size_t i = 0; i + 1 < args.size(); i += 2) {
    if (args[i] == "--uid") uid = static_cast<uid_t>(std::stoul(args[i + 1]));
    if (args[i] == "--gid") gid = static_cast<gid_t>(std::stoul(args[i + 1]));
  }
  if (uid && !dropPrivileges(*uid, gid.value_or(static_cast<gid_t>(*uid)))) return 3;
  Rank rank;
  for (std::string line; std::getline(std::cin, line);) {
    if (line == "exit") break;
    rank.run(line);
  }
  return 0;
}
