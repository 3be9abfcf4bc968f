// mpx::basic_nccl_communicator: everything mpx::nccl_communicator does around NCCL's and
// CUDA's calls, over a backend that makes them (nccl_communicator.hpp gives it NCCL and
// CUDA): the order of a collective's events on the side stream, the host-value
// collectives through pinned memory, the NaN-keeping max and min, the release (abort or
// destroy), and the supervision of every collective in flight
// (detail::collective_supervisor). Plain C++ with no NCCL in it, so the host suite runs
// it against a backend of its own (tests/dist/test_nccl_communicator.cpp).
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/dist/collective_supervisor.hpp>
#include <mpx/dist/communicator.hpp>
#include <mpx/dist/watchdog.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/elementwise.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx {

namespace detail {

//! One element of a max or min over NCCL: its nan_keeping_max_key, widened to the 32
//! bits NCCL reduces (it has no 16-bit integers), and back.
template <class T>
struct to_max_key {
  bool negated;
  MPX_HD std::uint32_t operator()(T x) const noexcept { return nan_keeping_max_key(x, negated); }
};
template <class T>
struct from_max_key {
  bool negated;
  MPX_HD T operator()(std::uint32_t key) const noexcept {
    return from_nan_keeping_max_key<T>(static_cast<bits_t<T>>(key), negated);
  }
};

//! A communicator backend as a collective_supervisor's transport: a collective's
//! completion is the backend's event (a CUDA event on the communicator's stream).
template <class Backend>
struct nccl_transport {
  using event = typename Backend::event;
  Backend* backend = nullptr;
  typename Backend::comm_type comm{};

  [[nodiscard]] bool done(event const& e) const { return backend->done(e); }
  [[nodiscard]] std::string async_error() const { return comm ? backend->async_error(comm) : std::string(); }
  void abort() noexcept {
    if (comm) report_failure_of(*backend, "aborting the NCCL communicator", [&] { backend->abort(comm); });
    comm = {};
  }
};

}  // namespace detail

//! What basic_nccl_communicator asks of its Backend, which makes NCCL's and CUDA's calls
//! (each throws what failed, unless noexcept): its types, the communicator's life
//! (make_unique_id; init(size, id, rank), which waits for every rank; destroy, abort;
//! async_error: why it broke, or ""), its stream (create_stream, destroy_stream,
//! stream_done), ordering events (make_event, record(e, s), wait(s, e): s waits on the
//! GPU; done(e)), memory (make_device_buffer(s, words): 64-bit words freed on s;
//! allocate_pinned, free_pinned; copy_to_device and copy_to_host, on s) and report(what,
//! why), for failures nothing may throw. The collectives, enqueued on s and named by
//! `what` in errors, are called where they are used: all_reduce_sum(data, n, dtype, ...),
//! all_reduce_max(keys, n, ...) on 32- and 64-bit keys, all_reduce_float64_sum,
//! all_gather_float64(mine, all, n, ...) (in place: mine is all + n * rank) and
//! broadcast_bytes(data, bytes, root, ...).
template <class B>
concept nccl_backend =
    std::is_class_v<typename B::executor_type> && std::is_class_v<typename B::device_buffer> &&
    requires(B& b, typename B::stream_type s, typename B::comm_type c, typename B::event const& e,
             typename B::unique_id const& id, std::uint64_t* words, int device) {
      typename B::space;
      { b.executor_on(s) };  // the mpx executor whose kernels run on s
      { b.make_unique_id() } -> std::same_as<typename B::unique_id>;
      { b.init(1, id, 0) } -> std::same_as<typename B::comm_type>;
      b.destroy(c);
      b.abort(c);
      { b.async_error(c) } -> std::same_as<std::string>;
      { b.current_device() } -> std::same_as<int>;
      { b.enter_watchdog_thread(device) } noexcept;  // run first on the watchdog's thread
      { b.create_stream() } -> std::same_as<typename B::stream_type>;
      b.destroy_stream(s);
      { b.stream_done(s) } -> std::same_as<bool>;
      { b.make_event() } -> std::same_as<typename B::event>;
      b.record(e, s);
      b.wait(s, e);
      { b.done(e) } -> std::same_as<bool>;
      { b.make_device_buffer(s, std::size_t{1}) } -> std::same_as<typename B::device_buffer>;
      { b.allocate_pinned(std::size_t{1}) } -> std::same_as<std::uint64_t*>;
      b.free_pinned(words);
      b.copy_to_device(words, words, std::size_t{1}, s);
      b.copy_to_host(words, words, std::size_t{1}, s);
      { b.report("what", "why") } noexcept;
    };

//! What mpx::nccl_communicator does between NCCL's and CUDA's calls, over a Backend that
//! makes them (nccl_backend), so that the host suite runs it against a backend of its own.
template <nccl_backend Backend>
class basic_nccl_communicator {
 public:
  using executor_type = typename Backend::executor_type;
  using space = typename Backend::space;

  //! One rank of `size`, all holding the same `id` (ncclGetUniqueId on rank 0). The
  //! device current now is the communicator's (its stream, its watchdog).
  basic_nccl_communicator(executor_type const& /*exec: the kind of executor its callers use*/,
                          typename Backend::unique_id const& id, int rank, int size, communicator_options options = {},
                          Backend backend = {})
      : backend_(std::move(backend)),
        rank_(rank),
        size_(size),
        transport_{&backend_},
        supervisor_(transport_, "mpx::nccl_communicator: rank " + std::to_string(rank), options.timeout) {
    // Every rank must join, and a blocking init cannot be aborted: past the timeout the
    // process ends with the reason, so that the launcher ends the job. (The deadline is
    // the communicator's rule, not a call of NCCL's: kept here, where every backend's
    // init has it.)
    detail::end_process_unless_returns_within(
        options.timeout,
        "mpx::nccl_communicator: rank " + std::to_string(rank) + " of " + std::to_string(size) +
            ": ncclCommInitRank has not returned " + std::to_string(options.timeout.count()) +
            " ms after it began (a rank did not join: it died, hung, or was given another id)",
        [&] { transport_.comm = backend_.init(size, id, rank); });
    // A constructor that throws runs no destructor: without this the communicator would
    // leak, never aborted, while the other ranks go on with theirs.
    try {
      int const device = backend_.current_device();
      stream_ = backend_.create_stream();
      // Made, used and freed on the stream of the collectives: ordered without events.
      values_ = backend_.make_device_buffer(stream_, host_value_capacity);
      host_values_ = backend_.allocate_pinned(host_value_capacity);
      // Its event queries must not count as another thread's call during a CUDA-graph
      // capture of the training step: the backend relaxes the thread's capture mode.
      supervisor_.watch([this, device] { backend_.enter_watchdog_thread(device); });
    } catch (...) {
      release(true);  // aborted, not destroyed: aborting waits for no other rank
      throw;
    }
  }
  //! The id handed out by rank 0 through `bootstrap` (an mpx::mpi_communicator, or any
  //! communicator with a host broadcast_bytes): the usual way under mpirun.
  template <class Bootstrap>
    requires requires(Bootstrap& b, std::span<std::byte> bytes) { b.broadcast_bytes(bytes, 0); }
  basic_nccl_communicator(executor_type const& exec, Bootstrap& bootstrap, communicator_options options = {},
                          Backend backend = {})
      : basic_nccl_communicator(exec, id_from(backend, bootstrap), bootstrap.rank(), bootstrap.size(), options,
                                backend) {}

  //! Destroys the communicator once its collectives are done (waiting at most the
  //! timeout), or aborts it: when they are not done by then, when it broke, or when it
  //! is destroyed by an exception's unwinding (ncclCommDestroy would wait for the other
  //! ranks, which may never come).
  ~basic_nccl_communicator() {
    supervisor_.stop_watching();  // first: nothing aborts behind release()'s back
    release(supervisor_.aborted() || std::uncaught_exceptions() > uncaught_at_construction_ ||
            !supervisor_.drained_within_timeout());
  }
  basic_nccl_communicator(basic_nccl_communicator const&) = delete;
  basic_nccl_communicator& operator=(basic_nccl_communicator const&) = delete;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  //! NCCL's communicator; null once it was aborted. The watchdog may abort it at any
  //! time after this returns: a handle kept for later calls may dangle.
  [[nodiscard]] typename Backend::comm_type native() const {
    return supervisor_.locked([&] { return transport_.comm; });
  }
  //! The stream the collectives run on (for profilers and tests); the executors' streams
  //! are ordered with it by events.
  [[nodiscard]] typename Backend::stream_type stream() const noexcept { return stream_; }

  //! A max or min keeps a NaN (NCCL's own float max and min would drop it): the values
  //! are reduced as detail::nan_keeping_max_key integers, converted by kernels on the
  //! communicator's stream. On the CUDA backend it launches kernels, so it is compiled by
  //! nvcc (a template: a file the plain C++ compiler builds is told so at compile time,
  //! as for any algorithm).
  template <std::same_as<executor_type> Exec>
  void all_reduce(Exec const& exec, tensor_ref<space> data, reduce_op op) {
    all_reduce_on(exec, data, op, false);
  }

  //! all_reduce, started on the communicator's stream without making the executor's
  //! stream wait: the executor's later work (the backward pass of earlier layers) runs
  //! concurrently. `data` must stay untouched until finish_all_reduces(exec).
  template <std::same_as<executor_type> Exec>
  void start_all_reduce(Exec const& exec, tensor_ref<space> data, reduce_op op) {
    all_reduce_on(exec, data, op, true);
  }
  //! The executor's stream waits (on the GPU) for every started all-reduce. Then throws
  //! the reason if the communicator was aborted meanwhile: an aborted all-reduce's event
  //! completes too, over partly reduced values.
  void finish_all_reduces(executor_type const& exec) {
    std::vector<event> pending;
    pending.swap(unfinished_);  // forgotten on every way out: a failed wait leaves none for the next step
    // The waits first, also after an abort: an aborted kernel may still be writing. One
    // that fails does not skip the others (the first failure is thrown once all were asked).
    std::exception_ptr failed;
    for (auto const& e : pending) {
      try {
        backend_.wait(exec.stream(), e);
      } catch (...) {
        if (!failed) failed = std::current_exception();
      }
    }
    if (failed) std::rethrow_exception(failed);
    supervisor_.require_usable();
  }

  void broadcast(executor_type const& exec, tensor_ref<space> data, int root) {
    if (root < 0 || root >= size_)
      detail::fail<invalid_argument>("nccl_communicator::broadcast", "root " + std::to_string(root) +
                                                                         " is not a rank of " + std::to_string(size_));
    run(exec, "broadcast (" + std::to_string(data.size_bytes()) + " bytes from rank " + std::to_string(root) + ")",
        false, [&](std::string const& what) {
          backend_.broadcast_bytes(data.data(), data.size_bytes(), root, transport_.comm, stream_, what);
        });
  }

  //! Host values through a small device buffer; waits for the result (at most the
  //! timeout: the copies go through pinned memory, so none blocks behind a hung collective).
  [[nodiscard]] std::vector<double> all_gather_values(std::span<double const> mine) {
    std::size_t const n = mine.size(), total = n * static_cast<std::size_t>(size_),
                      at = n * static_cast<std::size_t>(rank_);
    require_room(total);
    host_collective("all_gather (" + std::to_string(n) + " values)", [&](std::string const& what) {
      for (std::size_t i = 0; i < n; ++i) host_values_[at + i] = detail::bit_cast<std::uint64_t>(mine[i]);
      backend_.copy_to_device(values_.data() + at, host_values_ + at, n, stream_);
      backend_.all_gather_float64(values_.data() + at, values_.data(), n, transport_.comm, stream_, what);
      backend_.copy_to_host(host_values_, values_.data(), total, stream_);
    });
    std::vector<double> all(total);
    for (std::size_t i = 0; i < total; ++i) all[i] = detail::bit_cast<double>(host_values_[i]);
    return all;
  }

  //! A max or min keeps a NaN, as all_reduce's (the keys are made on the host).
  void all_reduce_values(std::span<double> values, reduce_op op) {
    std::size_t const n = values.size();
    require_room(n);
    bool const keys = op != reduce_op::sum, negated = op == reduce_op::min;
    host_collective("all_reduce (" + std::string(to_string(op)) + " of " + std::to_string(n) + " values)",
                    [&](std::string const& what) {
                      for (std::size_t i = 0; i < n; ++i)
                        host_values_[i] = keys ? detail::nan_keeping_max_key(values[i], negated)
                                               : detail::bit_cast<std::uint64_t>(values[i]);
                      backend_.copy_to_device(values_.data(), host_values_, n, stream_);
                      if (keys) backend_.all_reduce_max(values_.data(), n, transport_.comm, stream_, what);
                      else backend_.all_reduce_float64_sum(values_.data(), n, transport_.comm, stream_, what);
                      backend_.copy_to_host(host_values_, values_.data(), n, stream_);
                    });
    for (std::size_t i = 0; i < n; ++i)
      values[i] = keys ? detail::from_nan_keeping_max_key<double>(host_values_[i], negated)
                       : detail::bit_cast<double>(host_values_[i]);
  }

  void barrier() {
    double one[1] = {1};
    all_reduce_values(one, reduce_op::sum);
  }

  //! Looks at the collectives still in flight: one that failed, or is older than the
  //! timeout, aborts the communicator and throws collective_error naming it. Never waits.
  //! (The watchdog thread does the same every tenth of the timeout, at most every second.)
  void poll() { supervisor_.poll(); }

  //! Times a CUDA graph's replay, just enqueued on exec's stream, as one collective: the
  //! collectives captured in it cannot be watched one by one (an event recorded in a
  //! capture cannot be asked whether it completed), so a replay that has not completed
  //! `timeout` after it was enqueued aborts the communicator, as a hung collective does.
  //! The time counts from the launch: the step's own work, and what was queued before
  //! it, must fit in the timeout too. data_parallel's hooks call it after each launch of
  //! a captured step (replica_hooks::step_replayed). Throws only when the communicator
  //! was aborted (the step before it polled).
  template <std::same_as<executor_type> Exec>
  void watch_replay(Exec const& exec) {
    supervisor_.enqueue("a training step replayed from a CUDA graph", false,
                        [&](std::string const&) -> std::optional<event> {
                          event done = backend_.make_event();
                          backend_.record(done, exec.stream());
                          return done;
                        });
  }

 private:
  using stream_type = typename Backend::stream_type;
  using unique_id = typename Backend::unique_id;
  using event = typename Backend::event;

  template <class Bootstrap>
  static unique_id id_from(Backend& backend, Bootstrap& bootstrap) {
    unique_id id{};
    if (bootstrap.rank() == 0) id = backend.make_unique_id();
    bootstrap.broadcast_bytes(std::as_writable_bytes(std::span<unique_id, 1>(&id, 1)), 0);
    return id;
  }

  // all_reduce, waited for by the executor's stream now or (deferred) at finish_all_reduces.
  void all_reduce_on(executor_type const& exec, tensor_ref<space> data, reduce_op op, bool deferred) {
    detail::require_reducible("nccl_communicator::all_reduce", data.dtype());
    run(exec, "all_reduce (" + std::string(to_string(op)) + " of " + std::to_string(data.size()) + " " +
                  std::string(to_string(data.dtype())) + ")",
        deferred, [&](std::string const& what) {
          if (op == reduce_op::sum)
            backend_.all_reduce_sum(data.data(), data.size(), data.dtype(), transport_.comm, stream_, what);
          else extreme_keeping_nan(data, op == reduce_op::min, what);
        });
  }

  // The max (or, negated, the min) of `data` over the ranks, NaN kept: each value becomes
  // its nan_keeping_max_key in 32 bits, the keys' integer max is taken, and turned back.
  // The keys live on stream_ (`here`, whatever executor the backend runs kernels there
  // with) for the collective alone (allocated and freed there: in a capture, the graph's
  // own memory).
  void extreme_keeping_nan(tensor_ref<space> data, bool negated, std::string const& what) {
    auto const here = backend_.executor_on(stream_);
    auto const n = static_cast<std::int64_t>(data.size());
    visit_dtype(data.dtype(), [&](auto t) {
      using T = decltype(t);
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) {
        auto const values = data.template as<T>().reshape(shape{n});
        tensor<std::uint32_t, space> keys(here, shape{n});
        transform(here, keys, detail::to_max_key<T>{negated}, tensor_view<T const, space>(values));
        backend_.all_reduce_max(keys.data(), data.size(), transport_.comm, stream_, what);
        transform(here, values, detail::from_max_key<T>{negated}, tensor_view<std::uint32_t const, space>(keys));
      }
    });
  }

  // The collective on the side stream: after the executor's work so far, before its later
  // work (or, deferred, before finish_all_reduces). A collective captured into a CUDA
  // graph is not watched: it runs with each replay, its event recorded in the capture
  // cannot be queried, and a capture makes no queries. (A failure of the events' calls
  // aborts too, as any in an enqueue: only a broken context fails them.)
  template <class Enqueue>
  void run(executor_type const& exec, std::string what, bool deferred, Enqueue&& enqueue) {
    bool const capturing = exec.capturing();
    event done = backend_.make_event();
    supervisor_.enqueue(std::move(what), !capturing, [&](std::string const& named) -> std::optional<event> {
      event const ready = backend_.make_event();
      backend_.record(ready, exec.stream());
      backend_.wait(stream_, ready);
      enqueue(named);
      backend_.record(done, stream_);
      if (capturing) return std::nullopt;
      return done;
    });
    if (deferred) unfinished_.push_back(std::move(done));
    else backend_.wait(exec.stream(), done);
  }

  // A host-value collective: `calls(name)` fills the pinned buffer, copies it up, and
  // enqueues the NCCL call and the copy back; then the stream is waited for (at most the
  // timeout).
  template <class Calls>
  void host_collective(std::string what, Calls&& calls) {
    std::string const named =
        supervisor_.enqueue(std::move(what), true, [&](std::string const& w) -> std::optional<event> {
          calls(w);
          return std::nullopt;
        });
    supervisor_.wait(named, [&] { return backend_.stream_done(stream_); });
  }

  void require_room(std::size_t n) const {
    if (n > host_value_capacity)
      detail::fail<invalid_argument>("nccl_communicator", std::to_string(n) +
                                                              " host values in one collective (at most " +
                                                              std::to_string(host_value_capacity) + ")");
  }

  // What the constructor made, freed in order (also when it made only part of it): the
  // device buffer on the stream, after the work there; the communicator, aborted (an
  // abort waits for no other rank and stops a hung kernel) or destroyed with the other
  // ranks; then the pinned buffer (freeing it waits for the device, which the abort has
  // released) and the stream. Each failure is reported, and the rest still freed.
  void release(bool abort) noexcept {
    values_ = {};
    if (abort) transport_.abort();
    if (transport_.comm)
      detail::report_failure_of(backend_, "destroying the NCCL communicator",
                                [&] { backend_.destroy(transport_.comm); });
    transport_.comm = {};
    if (host_values_)
      detail::report_failure_of(backend_, "freeing the communicator's pinned buffer",
                                [&] { backend_.free_pinned(host_values_); });
    host_values_ = nullptr;
    if (stream_)
      detail::report_failure_of(backend_, "destroying the communicator's stream",
                                [&] { backend_.destroy_stream(stream_); });
    stream_ = {};
  }

  static constexpr std::size_t host_value_capacity = 64;  // doubles (or their 64-bit keys) in one host collective

  Backend backend_;  // first: everything below calls it, to the end
  int rank_ = 0;
  int size_ = 1;
  int uncaught_at_construction_ = std::uncaught_exceptions();
  detail::nccl_transport<Backend> transport_;  // its handle is read and aborted under the supervisor's lock
  stream_type stream_{};
  typename Backend::device_buffer values_;  // 64-bit words: doubles' bits, or their keys
  std::uint64_t* host_values_ = nullptr;    // pinned: a copy into pageable memory would wait for the stream
  std::vector<event> unfinished_;           // started, not yet waited for
  detail::collective_supervisor<detail::nccl_transport<Backend>> supervisor_;  // last: its watchdog stops first
};

}  // namespace mpx
