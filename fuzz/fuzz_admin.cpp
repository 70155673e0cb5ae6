// Fuzzes what dbufd makes of an operator's request (admin.hpp): the
// AdminRequest payload as it comes off the socket, decoded, parsed, checked
// against the asking peer and answered over a daemon state with two tenants'
// jobs (a plan report and a flight recorder included). Byte 0 picks the peer (root, the daemon's uid, a tenant's user, a
// member of the [admin] group, a stranger); the rest is the payload.
//
// Properties: bad input is an error value, never a crash; an answer is JSON
// that fits one reply; a tenant's user never hears of the other tenant's job,
// may not drain, and a stranger gets nothing at all.
//
// `fuzz_admin --write-seeds DIR` writes one request of every verb.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "admin.hpp"
#include "dbuf/ipc/protocol.hpp"
#include "fuzz_util.hpp"

namespace {

using namespace dbuf::daemon;  // NOLINT(google-build-using-namespace)
using dbuf::ErrorCode;
using dbuf::fuzz::check;

constexpr std::uint32_t kDaemonUid = 990;
constexpr std::uint32_t kAlice = 1000;  // tenant "research"
constexpr std::uint32_t kBob = 2000;    // tenant "prod"
constexpr std::uint32_t kStranger = 3000;
constexpr std::uint32_t kAdminGroup = 4242;
const std::string kProdJob = "prod-secret-run";

struct Peer {
  dbuf::ipc::PeerCredentials credentials;
  std::vector<std::uint32_t> groups;
};
// The last is the stranger: in no tenant, not in the [admin] group.
const std::vector<Peer> kPeers{{{1, 0, 0}, {}},        {{1, kDaemonUid, kDaemonUid}, {}},
                               {{1, kAlice, kAlice}, {}}, {{1, kBob, kBob}, {5}},
                               {{1, kStranger, kStranger}, {kAdminGroup}}, {{1, kStranger, 7}, {8, 9}}};

Config config() {
  Config made;
  made.tenants = {Tenant{"research", {kAlice}, {}, 1 << 20, 4}, Tenant{"prod", {kBob}, {}, 1 << 20, 4}};
  made.admin_gids = {kAdminGroup};
  return made;
}

admin::DaemonView view() {
  admin::DaemonView made;
  made.uid = kDaemonUid;
  made.tenants = {{"research", 1 << 20, 64, 4}, {"prod", 1 << 20, 64, 4}};
  for (const auto& [id, tenant] : {std::pair<std::string, std::size_t>{"research-run", 0}, {kProdJob, 1}}) {
    admin::JobView job;
    job.id = id;
    job.tenant = tenant;
    job.world_size = 2;
    job.ranks = {admin::RankView{0, true}, admin::RankView{1, false, true}};
    job.groups = {admin::GroupView{"g\xff", 1, 2, 3, 100, 51, "fp32", "bf16", 408, 408}};
    job.registrations = {admin::RegistrationView{"h", {0}, {1}}};
    job.current = admin::OpView{3, "allGather", "g", "waiting for ranks", 0.5, {0}, {1}};
    made.jobs.push_back(job);
  }
  // What a plan or trace request adds (the harness answers every request over the same view).
  made.plan_report = R"({"devices": 2, "units": [{"name": "g\u00ff"}]})";
  made.trace = {admin::TraceEntry{3, "allGather", "g\xff", 408, {1.5, std::nullopt}, 2.0, 2.5, "timeout", "rank 1 \xfe"},
                admin::TraceEntry{4, "barrier", "", 0, {2.6, 2.7}, 2.7, 2.7, "ok", ""}};
  made.sessions = {admin::SessionView{1, {1, kAlice, kAlice}, 0, "rank", "research-run", 0, 1},
                   admin::SessionView{2, {1, kBob, kBob}, 1, "rank", kProdJob, 0, 1},
                   admin::SessionView{3, {1, kStranger, kStranger}, {}, "handshake", "", 0, 0}};
  return made;
}

void writeSeeds(const std::string& dir) {
  const std::vector<std::pair<std::string, dbuf::ipc::AdminRequest>> seeds{
      {"status", {"status", {}}},    {"jobs", {"jobs", {}}},   {"job", {"job", {"research-run"}}},
      {"job_other", {"job", {kProdJob}}}, {"sessions", {"sessions", {}}}, {"plan", {"plan", {kProdJob, "g"}}},
      {"drain", {"drain", {}}}};
  for (std::uint8_t peer = 0; peer < kPeers.size(); ++peer) {
    for (const auto& [name, request] : seeds) {
      auto payload = dbuf::ipc::encodePayload(request);
      check(payload.ok(), "a seed encodes");
      std::vector<std::byte> bytes{std::byte{peer}};
      bytes.insert(bytes.end(), payload->begin(), payload->end());
      dbuf::fuzz::writeSeed(dir, name + "_peer" + std::to_string(peer), bytes);
    }
  }
}

void checkAnswer(const admin::Query& query, const admin::Access& access, const dbuf::Result<std::string>& answer) {
  if (!answer) {
    const ErrorCode code = answer.error().code;
    check(code == ErrorCode::kNotFound || code == ErrorCode::kPermissionDenied, "an answer fails as documented");
    check(query.verb != admin::Verb::kDrain || !access.everything, "an administrator may drain");
    return;
  }
  check(answer->size() <= dbuf::ipc::kMaxAdminReplyBytes, "an answer fits one reply");
  check(!nlohmann::json::parse(*answer, nullptr, false).is_discarded(), "an answer is JSON");
  if (!access.everything) {
    check(query.verb != admin::Verb::kDrain, "only an administrator drains");
    check(access.tenant != 0 || answer->find(kProdJob) == std::string::npos, "no word of another tenant's job");
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  dbuf::fuzz::seedMode(argc, argv, writeSeeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  static const Config kConfig = config();
  static const admin::DaemonView kView = view();
  const Peer& peer = kPeers[data[0] % kPeers.size()];
  const auto payload = std::as_bytes(std::span(data + 1, size - 1));
  auto message = dbuf::ipc::decodePayload(dbuf::ipc::MessageType::kAdminRequest, payload);
  if (!message) return 0;
  auto query = admin::parseRequest(std::get<dbuf::ipc::AdminRequest>(*message));
  if (!query) {
    check(query.error().code == ErrorCode::kInvalidArgument, "a bad request is a bad argument");
    return 0;
  }
  auto access = admin::authorize(kConfig, kDaemonUid, peer.credentials, peer.groups);
  if (!access) {
    check(&peer == &kPeers.back(), "only the stranger is refused");
    check(access.error().code == ErrorCode::kPermissionDenied, "a stranger is denied");
    return 0;
  }
  checkAnswer(*query, *access, admin::answer(*query, *access, kView));
  return 0;
}
