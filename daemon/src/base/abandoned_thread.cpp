#include "abandoned_thread.hpp"

#include <atomic>

namespace dbuf::daemon {
namespace {

std::atomic<int> abandoned_threads{0};

}  // namespace

AbandonedThread::AbandonedThread() noexcept {
  abandoned_threads.fetch_add(1);
}
AbandonedThread::~AbandonedThread() {
  abandoned_threads.fetch_sub(1);
}
int AbandonedThread::live() noexcept {
  return abandoned_threads.load();
}

}  // namespace dbuf::daemon
