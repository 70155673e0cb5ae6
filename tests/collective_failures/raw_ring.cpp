#include "raw_ring.hpp"

#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>

#include "raw.hpp"

namespace dbuf::integration {
namespace {

// From the segment layout at the top of ipc/src/ring.cpp: the client's
// submission head is the only word on the segment's second cache line.
constexpr std::size_t kSubmitHeadOffset = 1 * 64;
constexpr std::size_t kSubmitTailOffset = 2 * 64;

}  // namespace

std::unique_ptr<RawRingClient> RawRingClient::attach(const EmbeddedDaemon& daemon, const std::string& job,
                                                     std::uint32_t rank, std::uint32_t world) {
  auto client = std::unique_ptr<RawRingClient>(new RawRingClient());
  client->socket_ = daemon.rawConnect();
  if (!client->socket_) return nullptr;
  writeAll(client->socket_.get(), frameOf(helloFor(job, rank, world), 1));
  auto reply = ipc::receiveMessage(client->socket_.get(), ipc::Clock::now() + std::chrono::seconds(5));
  if (!reply) {
    ADD_FAILURE() << "no Welcome: " << reply.error().message;
    return nullptr;
  }
  const auto* welcome = std::get_if<ipc::Welcome>(&reply->message);
  if (welcome == nullptr || reply->fds.size() != 2) {
    const auto* error = std::get_if<ipc::ErrorReply>(&reply->message);
    ADD_FAILURE() << "expected a Welcome with 2 fds, got message type " << static_cast<int>(reply->header.type)
                  << " with " << reply->fds.size() << " fds" << (error != nullptr ? ": " + error->message : "");
    return nullptr;
  }
  client->welcome_ = *welcome;
  client->segment_fd_ = std::move(reply->fds[0]);
  client->doorbell_ = std::move(reply->fds[1]);
  auto mapping = Mapping::map(client->segment_fd_.get(), welcome->segment_bytes);
  if (!mapping) {
    ADD_FAILURE() << "cannot map the session segment: " << mapping.error().message;
    return nullptr;
  }
  client->segment_ = std::move(*mapping);
  auto rings = ipc::ClientRings::attach({client->segment_.data(), client->segment_.size()});
  if (!rings) {
    ADD_FAILURE() << "ClientRings::attach: " << rings.error().message;
    return nullptr;
  }
  client->rings_ = *rings;
  return client;
}

void RawRingClient::send(const ipc::Message& message) {
  writeAll(socket_.get(), frameOf(message, next_request_++));
}

Result<ipc::ReceivedFrame> RawRingClient::receive(std::chrono::milliseconds timeout) {
  return ipc::receiveMessage(socket_.get(), ipc::Clock::now() + timeout);
}

bool RawRingClient::submit(ipc::Submission entry) {
  entry.handle = next_handle_++;
  if (!rings_.trySubmit(entry)) return false;
  ringDoorbell();
  return true;
}

std::optional<RawCompletion> RawRingClient::nextCompletion(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  if (!rings_.waitForCompletion(deadline, std::chrono::microseconds(50))) return std::nullopt;
  RawCompletion completion;
  std::array<char, ipc::kCompletionMessageBytes> message{};
  std::size_t bytes = 0;
  if (!rings_.tryReap(completion.entry, message, bytes)) return std::nullopt;
  completion.message.assign(message.data(), bytes);
  return completion;
}

void RawRingClient::scribbleSubmitHead(std::uint64_t head) {
  std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(segment_.data() + kSubmitHeadOffset))
      .store(head, std::memory_order_seq_cst);
  ringDoorbell();
}

std::uint64_t RawRingClient::submitTail() const {
  return std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(segment_.data() + kSubmitTailOffset))
      .load(std::memory_order_seq_cst);
}

void RawRingClient::ringDoorbell() const {
  // Always, not only when the daemon says it sleeps: a spare wake-up is harmless.
  const std::uint64_t one = 1;
  [[maybe_unused]] const auto written = ::write(doorbell_.get(), &one, sizeof(one));
}

ipc::Submission rawOp(ipc::OpCode op, std::uint32_t group_id, std::uint32_t root) {
  ipc::Submission entry;
  entry.op = static_cast<std::uint8_t>(op);
  entry.group_id = group_id;
  entry.root = root;
  return entry;
}

ipc::RegisterGroup rawGroup(const std::string& name, std::int64_t elements) {
  ipc::RegisterGroup spec;
  spec.name = name;
  spec.sharded_dtype = "fp32";
  spec.unsharded_dtype = "fp32";
  spec.granularity = "element";
  spec.tensors.push_back({"w", {elements}, "", -1});
  return spec;
}

}  // namespace dbuf::integration
