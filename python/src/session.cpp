// dbuf.Client, dbuf.Group, dbuf.Op: libdbuf's Client and Group with the C++
// API's semantics (dbuf/client.hpp), Python conventions (seconds, keyword
// options, exceptions, async_op handles) and one session mutex.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "bindings.hpp"

namespace dbuf::python {
namespace {

using namespace nb::literals;

DType dtypeOf(const std::string& name) {
  const auto dtype = parseDType(name);
  if (!dtype) {
    throw nb::value_error(
        ("unknown dtype '" + name + "' (fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, fp64, int8, uint8, int32, int64)").c_str());
  }
  return *dtype;
}

std::vector<std::int64_t> shapeOf(const nb::handle& shape) {
  std::vector<std::int64_t> dims;
  for (const nb::handle dim : shape) dims.push_back(nb::cast<std::int64_t>(dim));
  return dims;
}

bool interpreterFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

/// Ctrl-C: the waiting thread takes the GIL back briefly and lets Python run
/// its signal handlers; a raised KeyboardInterrupt stays pending and cancels
/// the wait (raise() then re-raises it). While the interpreter shuts down
/// the wait is cancelled without touching Python (a thread taking the GIL
/// then would be ended under our feet).
std::function<bool()> interruptCheck(const std::weak_ptr<Session>& weak) {
  return [weak] {
    if (uninterruptible) return false;
    if (interpreterFinalizing()) return true;
    if (!weak.lock()) return false;
    const nb::gil_scoped_acquire gil;
    return PyErr_CheckSignals() != 0;
  };
}

/// A destructor or close() must finish: on this thread, no cancelling and
/// no Python error left pending by it.
class Uninterruptible {
 public:
  Uninterruptible() : was_(uninterruptible) { uninterruptible = true; }
  ~Uninterruptible() { uninterruptible = was_; }
  Uninterruptible(const Uninterruptible&) = delete;
  Uninterruptible& operator=(const Uninterruptible&) = delete;

 private:
  bool was_;
};

// ----------------------------------------------------------------- Op

/// An op in flight (async_op=True). Waits at most once in libdbuf; the result
/// (or the error) is kept for later waits. Copies share one state; the last
/// one gone abandons an op nobody waited for (its result is dropped when it
/// completes, so a forgotten handle cannot block later submits).
class PyOp {
 public:
  PyOp(std::shared_ptr<Session> session, OpHandle handle)
      : state_(std::make_shared<State>(std::move(session), handle)) {}

  OpResult wait(std::optional<double> timeout) {
    State& state = *state_;
    if (state.result) return *state.result;
    if (state.error) raise(*state.error);
    const auto ms = toTimeout(timeout);
    // The state is read and written under the session's mutex: two threads
    // may wait on one op, the second then finds the first one's result.
    Result<OpResult> outcome = state.session->locked([&](std::optional<Client>& client) -> Result<OpResult> {
      if (state.result) return *state.result;
      if (state.error) return *state.error;
      if (!client) return makeError(ErrorCode::kUnavailable, "the client is closed");
      auto waited = client->wait(state.handle, ms);
      if (waited) {
        state.result = *waited;
      } else if (waited.error().code != ErrorCode::kTimeout && waited.error().code != ErrorCode::kCancelled) {
        state.error = waited.error();  // it ended with this error
      }
      return waited;
    });
    raiseIfPending();
    if (outcome) return *outcome;
    raise(outcome.error());  // a timeout or a cancelled wait leaves the op in flight: wait again
  }

  /// Whether the op completed (successfully or not), without blocking.
  bool done() {
    if (state_->result || state_->error) return true;
    try {
      static_cast<void>(wait(0.0));
    } catch (const nb::python_error& error) {
      if (state_->error) return true;  // it ended with that error: wait() raises it
      if (error.matches(nb::module_::import_("dbuf._errors").attr("TimeoutError"))) return false;
      throw;
    }
    return true;
  }

  [[nodiscard]] std::uint64_t id() const noexcept { return state_->handle.id; }

 private:
  struct State {
    State(std::shared_ptr<Session> s, OpHandle h) : session(std::move(s)), handle(h) {}
    State(const State&) = delete;
    State& operator=(const State&) = delete;
    ~State() {
      if (!result && !error) session->abandon(handle);
    }
    std::shared_ptr<Session> session;
    OpHandle handle;
    std::optional<OpResult> result;
    std::optional<Error> error;
  };
  std::shared_ptr<State> state_;
};

/// What a collective call returns: the op (async_op) or its result.
using OpOrResult = std::variant<PyOp, OpResult>;

/// Submit options from the Python keywords. `stream`: None, an int
/// (cudaStream_t) or an object with `.cuda_stream` (torch.cuda.Stream).
SubmitOptions submitOptions(std::optional<double> timeout, const nb::object& stream, bool wait_if_full) {
  SubmitOptions options;
  options.wait_if_full = wait_if_full;
  options.timeout = toTimeout(timeout);
  if (!stream.is_none()) {
    const nb::object handle = nb::hasattr(stream, "cuda_stream") ? stream.attr("cuda_stream") : stream;
    if (!nb::isinstance<nb::int_>(handle)) {
      throw nb::type_error("stream must be None, an int (a cudaStream_t) or a torch.cuda.Stream");
    }
    options.stream = reinterpret_cast<void*>(nb::cast<std::uintptr_t>(handle));  // NOLINT(performance-no-int-to-ptr)
  }
  return options;
}

/// The op just submitted, or (unless async_op) its result once done.
OpOrResult finish(const std::shared_ptr<Session>& session, OpHandle handle, bool async_op,
                  std::optional<double> timeout) {
  PyOp op(session, handle);
  if (async_op) return op;
  return op.wait(timeout);
}

ReduceOptions reduceOptions(ReduceMode op, double pre_scale, double post_scale, bool accumulate) {
  const auto fits = [](double x) { return std::isfinite(x) && std::abs(x) <= std::numeric_limits<float>::max(); };
  if (!fits(pre_scale) || !fits(post_scale)) throw nb::value_error("scales must be finite fp32 numbers");
  return {op, static_cast<float>(pre_scale), static_cast<float>(post_scale), accumulate};
}

// ----------------------------------------------------------------- Group

class PyGroup {
 public:
  PyGroup(std::shared_ptr<Session> session, Group group)
      : session_(std::move(session)),
        group_(std::make_shared<Group>(std::move(group))),
        plan_(group_->plan()),
        name_(group_->name()) {}
  PyGroup(const PyGroup&) = delete;
  PyGroup& operator=(const PyGroup&) = delete;
  ~PyGroup() { close(); }

  /// Unmaps the group's memory (views read zeros afterwards) and gives its
  /// slot back; later calls raise. Idempotent.
  void close() {
    if (!group_) return;
    if (session_->calledFromInsideACall()) {  // let go of from inside a call: closed when it ends
      session_->graveyard.push_back(std::move(group_));
      return;
    }
    const Uninterruptible steady;
    session_->locked([&](std::optional<Client>&) { group_.reset(); });
  }

  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] const GroupPlan& plan() const noexcept { return plan_; }

  /// Index of a tensor given by position or by name.
  [[nodiscard]] std::size_t index(const std::variant<std::int64_t, std::string>& which) const {
    if (const auto* position = std::get_if<std::int64_t>(&which)) {
      const auto count = static_cast<std::int64_t>(plan_.tensors.size());
      const std::int64_t i = *position < 0 ? *position + count : *position;
      if (i < 0 || i >= count) {
        throw nb::index_error(("group '" + name_ + "' has " + std::to_string(count) + " tensors").c_str());
      }
      return static_cast<std::size_t>(i);
    }
    const auto& wanted = std::get<std::string>(which);
    for (std::size_t i = 0; i < plan_.tensors.size(); ++i) {
      if (plan_.tensors[i].name == wanted) return i;
    }
    throw nb::key_error(("group '" + name_ + "' has no tensor '" + wanted + "'").c_str());
  }

  /// Runs `call` on the live group (session mutex held, GIL released). The
  /// call holds the group: closing it meanwhile (a signal handler) defers.
  template <typename F>
  auto run(F&& call) {
    std::shared_ptr<Group> group = group_;
    return session_->run([&](Client&) {
      using R = decltype(call(std::declval<Group&>()));
      if (!group) return R(makeError(ErrorCode::kInvalidArgument, "group '" + name_ + "' is closed"));
      return call(*group);
    });
  }

  PyTensorView view(const std::variant<std::int64_t, std::string>& which, bool sharded, bool grad) {
    const std::size_t i = index(which);
    PyTensorView result;
    result.whole = !sharded;
    std::shared_ptr<Group> group = group_;
    result.view = session_->run([&](Client& client) -> Result<TensorView> {
      if (!group) return makeError(ErrorCode::kInvalidArgument, "group '" + name_ + "' is closed");
      result.device = client.memoryDevice();
      if (sharded) return grad ? group->shardGradView(i) : group->shardView(i);
      return grad ? group->unshardedGradView(i) : group->unshardedView(i);
    });
    return result;
  }

  std::shared_ptr<Session>& session() noexcept { return session_; }

 private:
  std::shared_ptr<Session> session_;
  std::shared_ptr<Group> group_;  // shared with the call running on it, if any
  GroupPlan plan_;
  std::string name_;
};

// ----------------------------------------------------------------- Client

class PyClient {
 public:
  PyClient(std::optional<std::string> socket, double timeout) : session_(std::make_shared<Session>()) {
    ClientOptions options;
    if (socket) options.socket_path = *socket;
    const auto ms = toTimeout(timeout);
    if (!ms || ms->count() == 0) throw nb::value_error("timeout must be > 0 seconds");
    options.timeout = *ms;
    options.interrupted = interruptCheck(session_);
    std::optional<Result<Client>> connected;
    {
      const nb::gil_scoped_release no_gil;
      connected.emplace(Client::connect(options));
    }
    raiseIfPending();
    session_->client.emplace(unwrap(std::move(*connected)));
  }
  PyClient(const PyClient&) = delete;
  PyClient& operator=(const PyClient&) = delete;
  ~PyClient() { close(); }

  /// Closes the connection (dbufd reclaims the session); views read zeros.
  void close() {
    if (session_->calledFromInsideACall()) {
      session_->close_pending = true;
      return;
    }
    const Uninterruptible steady;
    session_->locked([](std::optional<Client>& client) { client.reset(); });
  }

  void attach(const std::string& job, std::uint32_t rank, std::uint32_t world_size, std::uint32_t local_rank,
              std::int32_t device, bool persistent, std::uint32_t prefetch_depth, std::uint32_t local_world_size,
              const std::string& store, bool keep_slot_mappings, std::optional<double> timeout) {
    AttachOptions options{job,        rank,           world_size,       local_rank,        device,
                          persistent, prefetch_depth, local_world_size, store,             keep_slot_mappings};
    const auto ms = toRequestTimeout(timeout);
    session_->run([&](Client& client) { return client.attach(options, ms); });
  }

  PyGroup* registerGroup(const std::string& name, const std::vector<TensorSpec>& tensors,
                         const std::string& granularity, const std::string& sharded_dtype,
                         const std::string& unsharded_dtype, std::uint32_t align_bytes, std::optional<double> timeout) {
    GroupSpec spec;
    spec.name = name;
    spec.tensors = tensors;
    spec.granularity = granularity;
    spec.sharded_dtype = dtypeOf(sharded_dtype);
    spec.unsharded_dtype = dtypeOf(unsharded_dtype);
    spec.align_bytes = align_bytes;
    const auto ms = toRequestTimeout(timeout);
    Group group = session_->run([&](Client& client) { return client.registerGroup(spec, ms); });
    return new PyGroup(session_, std::move(group));  // NOLINT(cppcoreguidelines-owning-memory): Python owns it
  }

  template <typename T, typename F>
  T read(F&& get) {
    return session_->run([&](Client& client) -> Result<T> { return get(client); });
  }

  std::shared_ptr<Session>& session() noexcept { return session_; }

 private:
  std::shared_ptr<Session> session_;
};

constexpr const char* kTimeoutDoc = "timeout: seconds (None: the client's default).";

void exposeValues(nb::module_& m) {
  nb::enum_<ReduceMode>(m, "ReduceOp", "How a reduction combines the ranks' values (in fp32, fp64 for fp64 groups; ranks in order).")
      .value("SUM", ReduceMode::kSum, "post_scale * sum over ranks of (pre_scale * x)")
      .value("AVG", ReduceMode::kAvg, "as SUM with post_scale divided by the world size");

  nb::class_<TensorSpec>(m, "TensorSpec", "A tensor of a group: name, shape, its own granularity rule, tp_dim.")
      .def(
          "__init__",
          [](TensorSpec* self, std::string name, const nb::handle& shape, std::optional<std::string> granularity,
             std::int32_t tp_dim) {
            new (self) TensorSpec{std::move(name), shapeOf(shape), granularity.value_or(""), tp_dim};
          },
          "name"_a, "shape"_a, "granularity"_a = nb::none(), "tp_dim"_a = -1,
          "granularity: a rule ('element', 'rows:R', 'block:RxC', 'matrix' or a count); None: the group's.\n"
          "tp_dim: the dimension tensor parallelism already shards (-1: none).")
      .def_rw("name", &TensorSpec::name)
      .def_rw("shape", &TensorSpec::shape)
      .def_rw("granularity", &TensorSpec::granularity)
      .def_rw("tp_dim", &TensorSpec::tp_dim)
      .def("__repr__", [](const TensorSpec& t) {
        std::string shape;
        for (const std::int64_t d : t.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
        return "TensorSpec('" + t.name + "', (" + shape + (t.shape.size() == 1 ? ",)" : ")") +
               (t.granularity.empty() ? "" : ", granularity='" + t.granularity + "'") + ")";
      });

  nb::class_<PlacedTensor>(m, "PlacedTensor", "A tensor's place in the group's buffer of devices * shard_elems.")
      .def_ro("name", &PlacedTensor::name)
      .def_ro("shape", &PlacedTensor::shape)
      .def_ro("offset", &PlacedTensor::offset, "first element in the global buffer")
      .def_ro("numel", &PlacedTensor::numel)
      .def_ro("granularity", &PlacedTensor::granularity, "elements per RaggedShard block");

  nb::class_<GroupPlan>(m, "GroupPlan", "The planner's layout of a group, as dbufd made it.")
      .def_ro("group_id", &GroupPlan::group_id)
      .def_ro("devices", &GroupPlan::devices)
      .def_ro("shard_elems", &GroupPlan::shard_elems, "S: elements per rank")
      .def_ro("tensors", &GroupPlan::tensors);

  nb::class_<OpResult>(m, "OpResult", "What dbufd reported about a completed op.")
      .def_ro("sequence", &OpResult::sequence, "the op's index among the job's collectives")
      .def_prop_ro(
          "wait_ns", [](const OpResult& r) { return r.wait.count(); }, "from this rank's submission to the last rank's")
      .def_prop_ro(
          "run_ns", [](const OpResult& r) { return r.run.count(); }, "execution in the daemon")
      .def("__repr__", [](const OpResult& r) {
        return "OpResult(sequence=" + std::to_string(r.sequence) + ", wait_ns=" + std::to_string(r.wait.count()) +
               ", run_ns=" + std::to_string(r.run.count()) + ")";
      });
}

void exposeOp(nb::module_& m) {
  nb::class_<PyOp>(m, "Op",
                   "An op in flight (async_op=True). wait() returns its OpResult or raises its error; waiting "
                   "again returns the same. A timeout or Ctrl-C leaves the op in flight. Every op must be waited "
                   "for: a client keeps the results of twice its ring capacity of ops.")
      .def("wait", &PyOp::wait, "timeout"_a = nb::none(), kTimeoutDoc)
      .def("done", &PyOp::done, "Whether the op completed (wait() then returns at once).")
      .def_prop_ro("id", &PyOp::id);
}

/// A Group method that asks dbufd with a timeout (acquireSlot, unshard, reshard), as a binding.
template <Result<void> (Group::*Method)(std::optional<std::chrono::milliseconds>)>
void slotRequest(PyGroup& g, std::optional<double> timeout) {
  const auto ms = toRequestTimeout(timeout);
  g.run([&](Group& group) { return (group.*Method)(ms); });
}

void exposeGroup(nb::module_& m) {
  using Which = std::variant<std::int64_t, std::string>;
  nb::class_<PyGroup>(m, "Group",
                      "A registered group (an FSDP unit): its plan, views of its memory and its collectives. "
                      "Views taken before reshard(), close() or the client's detach read zeros afterwards "
                      "(host memory) instead of faulting; views of the unsharded slot keep their address "
                      "across reshard / unshard.")
      .def_prop_ro("name", &PyGroup::name)
      .def_prop_ro("plan", &PyGroup::plan, nb::rv_policy::copy)
      .def_prop_ro("rank",
                   [](PyGroup& g) { return g.run([](Group& group) -> Result<std::uint32_t> { return group.rank(); }); })
      .def_prop_ro(
          "shard_bytes",
          [](PyGroup& g) { return g.run([](Group& group) -> Result<std::size_t> { return group.shardBytes(); }); },
          "bytes of this rank's shard file (sharded + sharded gradient)")
      .def_prop_ro(
          "is_unsharded",
          [](PyGroup& g) { return g.run([](Group& group) -> Result<bool> { return group.unsharded(); }); },
          "whether the group holds its unsharded slot")
      .def("index", &PyGroup::index, "tensor"_a, "The position of a tensor given by position or name.")
      .def(
          "shard_view", [](PyGroup& g, const Which& t) { return g.view(t, true, false); }, "tensor"_a,
          "This rank's part of a tensor in the sharded (master) region: 1-D, possibly empty.")
      .def(
          "shard_grad_view", [](PyGroup& g, const Which& t) { return g.view(t, true, true); }, "tensor"_a,
          "The same part in the sharded gradient region.")
      .def(
          "unsharded_view", [](PyGroup& g, const Which& t) { return g.view(t, false, false); }, "tensor"_a,
          "The whole tensor in the unsharded slot (needs acquire_slot() or unshard()).")
      .def(
          "unsharded_grad_view", [](PyGroup& g, const Which& t) { return g.view(t, false, true); }, "tensor"_a,
          "The whole tensor's gradient in the unsharded slot.")
      .def(
          "acquire_slot",
          [](PyGroup& g, std::optional<double> timeout, bool grow) {
            const auto ms = toRequestTimeout(timeout);
            g.run([&](Group& group) { return group.acquireSlot(ms, grow ? WhenPoolFull::kGrow : WhenPoolFull::kFail); });
          },
          "timeout"_a = nb::none(), "grow"_a = false,
          "Maps an unsharded slot without gathering (not a collective). When every slot of the rank's pool is "
          "held: ConflictError, or with grow=True a slot beyond the pool (within the tenant's quota; its memory "
          "goes back at reshard).")
      .def("unshard", &slotRequest<&Group::unshard>, "timeout"_a = nb::none(),
           "Collective: acquire_slot() if needed, then all_gather() and wait for it.")
      .def("reshard", &slotRequest<&Group::reshard>, "timeout"_a = nb::none(),
           "Waits for this group's ops in flight, then gives the slot back without waiting for dbufd's answer "
           "(not a collective).")
      .def(
          "reshard_on_stream",
          [](PyGroup& g, const nb::object& stream) {
            void* handle = submitOptions(std::nullopt, stream, true).stream.value_or(nullptr);
            g.run([&](Group& group) { return group.reshardOnStream(handle); });
          },
          "stream"_a, "GPU memory: reshard() ordered on a CUDA stream; returns at once.")
      .def(
          "all_gather",
          [](PyGroup& g, bool async_op, std::optional<double> timeout, const nb::object& stream, bool wait_if_full) {
            const SubmitOptions options = submitOptions(timeout, stream, wait_if_full);
            return finish(g.session(), g.run([&](Group& group) { return group.submitAllGather(options); }), async_op,
                          timeout);
          },
          nb::kw_only(), "async_op"_a = false, "timeout"_a = nb::none(), "stream"_a = nb::none(),
          "wait_if_full"_a = true,
          "Every rank's shard -> every rank's unsharded params (cast or fp8-quantized). Needs the slot.")
      .def(
          "reduce_scatter",
          [](PyGroup& g, ReduceMode op, double pre_scale, double post_scale, bool accumulate, bool async_op,
             std::optional<double> timeout, const nb::object& stream, bool wait_if_full) {
            const ReduceOptions reduce = reduceOptions(op, pre_scale, post_scale, accumulate);
            const SubmitOptions options = submitOptions(timeout, stream, wait_if_full);
            return finish(g.session(), g.run([&](Group& group) { return group.submitReduceScatter(reduce, options); }),
                          async_op, timeout);
          },
          nb::kw_only(), "op"_a = ReduceMode::kSum, "pre_scale"_a = 1.0, "post_scale"_a = 1.0, "accumulate"_a = false,
          "async_op"_a = false, "timeout"_a = nb::none(), "stream"_a = nb::none(), "wait_if_full"_a = true,
          "Every rank's unsharded gradient -> this rank's part of their reduction, written (or, with "
          "accumulate, added) into its sharded gradient (fp32, or fp64 in an fp64 group).")
      .def(
          "all_reduce",
          [](PyGroup& g, ReduceMode op, double pre_scale, double post_scale, bool async_op,
             std::optional<double> timeout, const nb::object& stream, bool wait_if_full) {
            const ReduceOptions reduce = reduceOptions(op, pre_scale, post_scale, false);
            const SubmitOptions options = submitOptions(timeout, stream, wait_if_full);
            return finish(g.session(), g.run([&](Group& group) { return group.submitAllReduce(reduce, options); }),
                          async_op, timeout);
          },
          nb::kw_only(), "op"_a = ReduceMode::kSum, "pre_scale"_a = 1.0, "post_scale"_a = 1.0, "async_op"_a = false,
          "timeout"_a = nb::none(), "stream"_a = nb::none(), "wait_if_full"_a = true,
          "Every rank's unsharded gradient becomes the reduction of all of them.")
      .def(
          "broadcast",
          [](PyGroup& g, std::uint32_t root, bool async_op, std::optional<double> timeout, const nb::object& stream,
             bool wait_if_full) {
            const SubmitOptions options = submitOptions(timeout, stream, wait_if_full);
            return finish(g.session(), g.run([&](Group& group) { return group.submitBroadcast(root, options); }),
                          async_op, timeout);
          },
          "root"_a, nb::kw_only(), "async_op"_a = false, "timeout"_a = nb::none(), "stream"_a = nb::none(),
          "wait_if_full"_a = true, "root's unsharded params -> every rank's unsharded params.")
      .def("unregister", &slotRequest<&Group::unregister>, "timeout"_a = nb::none(),
           "This rank is done with the group: its slot given back, its ops waited for, dbufd told; the group's "
           "memory is freed once every rank of the job on the node has unregistered it (not a collective). "
           "Views read zeros afterwards; later calls raise.")
      .def("close", &PyGroup::close,
           "Unmaps the group's memory and gives its slot back (the daemon keeps the shards); later calls raise.")
      .def(
          "__enter__", [](PyGroup* g) { return g; }, nb::rv_policy::reference)
      .def("__exit__", [](PyGroup& g, const nb::args&) { g.close(); })
      .def("__repr__", [](const PyGroup& g) {
        return "Group('" + g.name() + "', tensors=" + std::to_string(g.plan().tensors.size()) +
               ", shard_elems=" + std::to_string(g.plan().shard_elems) + ")";
      });
}

void exposeClient(nb::module_& m) {
  nb::class_<PyClient>(m, "Client",
                       "A trainer process's connection to its node's dbufd. Calls may block (the GIL is released "
                       "while they do, and Ctrl-C interrupts them); one call at a time runs per client.")
      .def(nb::init<std::optional<std::string>, double>(), "socket"_a = nb::none(), "timeout"_a = 10.0,
           "Connects to dbufd. socket: its path (None: $DBUF_SOCKET, else /run/dbufd/dbufd.sock); timeout: the "
           "default of every call, in seconds.")
      .def("attach", &PyClient::attach, "job"_a, "rank"_a, "world_size"_a, nb::kw_only(), "local_rank"_a = 0,
           "device"_a = -1, "persistent"_a = false, "prefetch_depth"_a = 1, "local_world_size"_a = 0,
           "store"_a = "", "keep_slot_mappings"_a = false, "timeout"_a = nb::none(),
           "Joins job `job` as `rank` of `world_size`. device: the trainer's GPU (-1: none); persistent: keep "
           "the shards for the daemon's grace period if every rank dies; prefetch_depth: unsharded slots = "
           "prefetch_depth + 1. A job across nodes: local_world_size is the job's ranks on this node "
           "(contiguous, from rank - local_rank; 0: every rank is here) and store where the nodes' daemons "
           "meet: \"file:DIR\" or \"redis:HOST:PORT\", optionally \"#PREFIX\" (unique per run of the job). "
           "keep_slot_mappings (host memory): a slot stays mapped after reshard() so that getting it back maps "
           "nothing; views kept past reshard() then read what the slot holds by then, not zeros.")
      .def("register_group", &PyClient::registerGroup, "name"_a, "tensors"_a, nb::kw_only(),
           "granularity"_a = "element", "sharded_dtype"_a = "fp32", "unsharded_dtype"_a = "bf16", "align_bytes"_a = 16,
           "timeout"_a = nb::none(), nb::rv_policy::take_ownership,
           "Collective: returns once every rank registered the same group. tensors: TensorSpec list; "
           "granularity: default rule of 2D+ tensors; dtypes 'fp32', 'bf16', 'fp16' ('fp8_e4m3' unsharded).")
      .def(
          "barrier",
          [](PyClient& c, bool async_op, std::optional<double> timeout) {
            const SubmitOptions options = submitOptions(timeout, nb::none(), true);
            return finish(c.session(), c.session()->run([&](Client& client) { return client.submitBarrier(options); }),
                          async_op, timeout);
          },
          nb::kw_only(), "async_op"_a = false, "timeout"_a = nb::none(),
          "Collective across the job: returns once every rank reached it.")
      .def(
          "noop",
          [](PyClient& c, bool async_op, std::optional<double> timeout) {
            const SubmitOptions options = submitOptions(timeout, nb::none(), true);
            return finish(c.session(), c.session()->run([&](Client& client) { return client.submitNoop(options); }),
                          async_op, timeout);
          },
          nb::kw_only(), "async_op"_a = false, "timeout"_a = nb::none(),
          "Not a collective: dbufd answers at once (the ring's round trip).")
      .def(
          "detach",
          [](PyClient& c, std::optional<double> timeout) {
            const auto ms = toRequestTimeout(timeout);
            c.session()->run([&](Client& client) { return client.detach(ms); });
          },
          "timeout"_a = nb::none(), "Orderly goodbye; views read zeros afterwards.")
      .def("close", &PyClient::close, "Closes the connection without a goodbye (dbufd reclaims the session).")
      .def_prop_ro(
          "reattached", [](PyClient& c) { return c.read<bool>([](Client& client) { return client.reattached(); }); },
          "whether dbufd kept this job's shards from an earlier life of this rank")
      .def_prop_ro(
          "daemon_instance_id",
          [](PyClient& c) { return c.read<std::uint64_t>([](Client& client) { return client.daemonInstanceId(); }); })
      .def_prop_ro(
          "in_flight",
          [](PyClient& c) { return c.read<std::uint32_t>([](Client& client) { return client.inFlight(); }); },
          "ops submitted and not yet completed by the daemon")
      .def_prop_ro(
          "device",
          [](PyClient& c) {
            return c.read<std::optional<std::int32_t>>([](Client& client) { return client.memoryDevice(); });
          },
          "None for host memory, else the GPU this session's views are on")
      .def(
          "__enter__", [](PyClient* c) { return c; }, nb::rv_policy::reference)
      .def("__exit__", [](PyClient& c, const nb::args&) { c.close(); });

  m.def(
      "_noop_loop_cpp",
      [](PyClient& c, std::uint64_t count) {
        // The same round trips as `for _ in range(count): client.noop()`,
        // timed in C++: the Python overhead benchmark's baseline.
        return c.session()->run([&](Client& client) -> Result<double> {
          const auto start = std::chrono::steady_clock::now();
          for (std::uint64_t i = 0; i < count; ++i) {
            auto op = client.submitNoop();
            if (!op) return std::move(op).error();
            if (auto done = client.wait(*op); !done) return std::move(done).error();
          }
          return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        });
      },
      "client"_a, "count"_a, "Seconds for `count` no-op round trips made from C++ (benchmarks).");
}

}  // namespace

void exposeSession(nb::module_& m) {
  exposeValues(m);
  exposeOp(m);
  exposeGroup(m);
  exposeClient(m);
}

}  // namespace dbuf::python
