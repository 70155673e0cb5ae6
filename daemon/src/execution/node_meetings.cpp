#include "node_meetings.hpp"

#include <spdlog/spdlog.h>

#include <utility>

namespace dbuf::daemon {

NodeMeetings::NodeMeetings(const NodeJob& job, const ClusterContext& cluster)
    : job_(job),
      cluster_(cluster),
      link_(std::make_unique<NodeLink>(job, cluster)),
      staging_(std::make_shared<Staging>()) {
  meet();
}

Result<bool> NodeMeetings::readyForAnOp() {
  if (link_->connected() && link_->idle()) return true;
  if (!link_->connected() && link_->idle()) {
    if (const std::optional<Error> why = link_->broken()) {
      lose(*why);
      return *lost_;
    }
    meet();
  }
  return false;
}

const Error* NodeMeetings::unavailable() {
  if (state_ == State::kMeeting) {
    if (link_->connected()) {
      state_ = State::kUp;
      lost_.reset();
    } else if (const std::optional<Error> why = link_->broken(); why && link_->idle()) {
      markLost(*why);  // the meeting failed once every node had come: the next one
    }
  }
  meetAgainIfReady();
  return state_ == State::kUp ? nullptr : &*lost_;
}

void NodeMeetings::lose(const Error& why) {
  link_->breakLink(why);
  markLost(why);
}

void NodeMeetings::ranksAttached() {
  whole_ = true;
  meetAgainIfReady();
}

std::uint64_t NodeMeetings::sinceMeeting(std::uint64_t sequence) {
  if (!first_sequence_) first_sequence_ = sequence;
  return sequence - *first_sequence_;
}

void NodeMeetings::meet() {
  static_cast<void>(link_->post([](const LinkChannel&) { return Result<void>{}; }));
}

void NodeMeetings::markLost(const Error& why) {
  state_ = State::kLost;
  lost_ = Error{why.code,
                why.message + " (job " + job_.job_id +
                    "'s nodes meet again once each has all its ranks attached; until then its collectives fail)",
                why.ranks};
  if (when_lost_) when_lost_();
}

void NodeMeetings::meetAgainIfReady() {
  if (state_ != State::kLost || !whole_ || !link_->idle()) return;
  ++job_.meeting;
  spdlog::info("job {}: meeting its other nodes again (meeting {}), after: {}", job_.job_id, job_.meeting,
               lost_->message);
  link_ = std::make_unique<NodeLink>(job_, cluster_);  // the lost one is idle: its thread ends now
  staging_ = std::make_shared<Staging>();
  committed_.reset();
  first_sequence_.reset();
  state_ = State::kMeeting;
  meet();
}

}  // namespace dbuf::daemon
