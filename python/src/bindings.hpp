#pragma once
// The native core of the Python package (dbuf._dbuf): libdbuf's C++ client
// and the planner, bound with nanobind. One file a part: errors (dbuf::Error
// -> the exceptions of dbuf/_errors.py), the session (Client, Group, Op), the
// views of daemon memory (NumPy / PyTorch / DLPack), the planner.
//
// Rules every binding follows, so that no Python program can crash the
// process through the module:
//   - A call that may block releases the GIL first, then takes the session's
//     mutex (one call per session at a time, as libdbuf requires); never the
//     other way round, since a waiting call takes the GIL back to check for
//     Ctrl-C.
//   - Every index and enum from Python is checked here or by libdbuf, and
//     every libdbuf error becomes a dbuf.Error exception.
//   - Views hold a pin of their address range (dbuf::TensorView::pin), so
//     their memory stays mapped (zero pages once the daemon's is gone).

#include <nanobind/nanobind.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "dbuf/client.hpp"
#include "dbuf/common/result.hpp"

namespace dbuf::python {

namespace nb = nanobind;

/// Raises the dbuf exception for `error` (dbuf._errors): or, when a Python
/// exception is already pending (KeyboardInterrupt from a cancelled wait),
/// that one.
[[noreturn]] void raise(const Error& error);

template <typename T>
T unwrap(Result<T>&& result) {
  if (!result) raise(result.error());
  return std::move(result).value();
}
inline void unwrap(Result<void>&& result) {
  if (!result) raise(result.error());
}

/// Raises a pending Python exception (one the interrupt check set while a
/// call succeeded anyway, say), if any.
void raiseIfPending();

/// True on a thread while a call must not be cancelled (a destructor, an
/// explicit close): its interrupt check then neither runs Python's signal
/// handlers nor cancels. Per thread: another thread's Ctrl-C still works.
inline thread_local bool uninterruptible = false;  // NOLINT(readability-identifier-naming)

/// One connection to dbufd as Python sees it: shared by its Client, Groups,
/// Ops and nothing else. `client` is empty once closed.
struct Session {
  std::mutex mutex;
  std::optional<Client> client;
  /// The thread inside a call (holding `mutex`), if any: a Python signal
  /// handler run by that call's interrupt check must not call in again.
  std::atomic<std::thread::id> busy{};
  /// Groups, and the client, that Python let go of while their thread was
  /// inside a call of this session (a signal handler, a garbage collection
  /// run by the interrupt check): closed when that call ends, never under
  /// the call's feet. Groups are shared: a call holds its group for its
  /// length, so the object it runs on cannot go away.
  std::vector<std::shared_ptr<Group>> graveyard;
  bool close_pending = false;

  [[nodiscard]] bool calledFromInsideACall() const { return busy.load() == std::this_thread::get_id(); }

  /// Ops whose every Python handle is gone without a wait: abandoned at the
  /// next call (a handle's destructor must not block on `mutex`).
  void abandon(OpHandle handle) {
    const std::lock_guard lock(dropped_mutex);
    dropped.push_back(handle);
  }
  std::mutex dropped_mutex;
  std::vector<OpHandle> dropped;

  /// Runs `call` (which gets the session's client, empty once closed)
  /// without the GIL and with the session's mutex; returns what it returned.
  template <typename F>
  auto locked(F&& call) {
    if (calledFromInsideACall()) {
      throw std::runtime_error(
          "dbuf: a call on a client from inside another call of it (a signal handler run while it waited)");
    }
    const nb::gil_scoped_release no_gil;
    const std::lock_guard lock(mutex);
    busy = std::this_thread::get_id();
    if (client) {
      const std::lock_guard dropped_lock(dropped_mutex);
      for (const OpHandle handle : dropped) client->abandon(handle);
      dropped.clear();
    }
    struct Leave {
      Session& session;
      ~Leave() { session.leave(); }
    } leave{*this};
    return call(client);
  }

  /// The end of a call (mutex held): what was let go of during it is closed.
  void leave() noexcept {
    const bool was = uninterruptible;
    uninterruptible = true;  // closing may wait; nothing may cancel it or run handlers
    while (!graveyard.empty()) {
      auto dead = std::move(graveyard);  // destructors may add more: none is lost, none cleared twice
      graveyard.clear();
      dead.clear();
    }
    if (close_pending) client.reset();
    close_pending = false;
    uninterruptible = was;
    busy = std::thread::id{};
  }

  /// locked() for a libdbuf call returning a Result: its value, or its error
  /// raised (with the GIL back).
  template <typename F>
  auto run(F&& call) {
    using R = decltype(call(std::declval<Client&>()));
    R result = locked([&](std::optional<Client>& open) {
      if (!open) return R(makeError(ErrorCode::kUnavailable, "the client is closed"));
      return call(*open);
    });
    if constexpr (std::is_same_v<R, Result<OpHandle>>) {
      // An op submitted while Ctrl-C arrived: nobody will get its handle.
      if (result && PyErr_Occurred() != nullptr) abandon(*result);
    }
    raiseIfPending();
    return unwrap(std::move(result));
  }
};

/// Seconds (None: the client's default) as libdbuf's timeout; 0 is "now".
std::optional<std::chrono::milliseconds> toTimeout(std::optional<double> seconds);
/// toTimeout for a request to dbufd, which a timeout ends with the
/// connection: 0 is refused (ValueError).
std::optional<std::chrono::milliseconds> toRequestTimeout(std::optional<double> seconds);

void exposeErrors(nb::module_& module);
void exposeSession(nb::module_& module);
void exposeViews(nb::module_& module);
void exposePlanner(nb::module_& module);

/// A view of daemon memory as handed to Python (views.cpp).
struct PyTensorView {
  TensorView view;
  bool whole = false;                  ///< an unsharded view: shaped like the tensor, else 1-D
  std::optional<std::int32_t> device;  ///< GPU memory: the session's GPU
};

}  // namespace dbuf::python
