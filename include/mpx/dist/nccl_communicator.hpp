// mpx::nccl_communicator: the communicator between GPUs, on NCCL (one process per GPU).
// Collectives run on a stream of their own, ordered after the executor's work and before
// its later work by events, so the host never waits. The NCCL unique id comes from rank
// 0 through any bootstrap communicator (mpx::mpi_communicator: `nccl_communicator(exec,
// mpi)`), or through a file on a shared filesystem for launchers without MPI.
// A collective that has not completed `timeout` after it was enqueued is found by a
// watchdog thread (every tenth of the timeout, at most every second) and by poll()
// (every collective enqueued outside a graph capture calls it first; so may you), and
// the host-value collectives (barrier, all_reduce_values, all_gather_values) wait for
// their result at most `timeout`: the communicator is aborted (which ends a hung
// kernel, so a host waiting on the GPU goes on) and the next call throws
// mpx::collective_error naming the collective. A max or min keeps NaN, unlike NCCL's own on floats (through
// kernels: all_reduce is called from files nvcc compiles). Needs the CUDA runtime and
// NCCL (-lnccl); not included by <mpx/mpx.hpp>.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/dist/communicator.hpp>
#include <mpx/dist/file_bootstrap.hpp>
#include <mpx/dist/in_flight.hpp>
#include <mpx/dist/watchdog.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/streams.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/elementwise.hpp>

#if MPX_HAS_CUDA_RUNTIME
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace mpx {

namespace detail {

inline void check_nccl(ncclResult_t status, char const* call, std::string const& collective) {
  if (status == ncclSuccess || status == ncclInProgress) return;
  throw collective_error("mpx::nccl_communicator: " + std::string(call) + " failed in " + collective + ": " +
                             ncclGetErrorString(status),
                         {});
}

inline ncclDataType_t nccl_type(dtype_id d) {
  switch (d) {
    case dtype_id::float16: return ncclFloat16;
    case dtype_id::bfloat16: return ncclBfloat16;
    case dtype_id::float32: return ncclFloat32;
    default: break;
  }
  fail<invalid_argument>("nccl_communicator", "no NCCL type for " + std::string(to_string(d)));
}

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

}  // namespace detail

//! Rank 0's NCCL unique id, handed to the other ranks through a file at `path` on a
//! filesystem every rank sees (share_bytes_through_file: a path of the job's own), for
//! launchers without MPI. The other ranks wait for it up to `timeout`.
inline ncclUniqueId nccl_unique_id_through_file(std::filesystem::path const& path, int rank,
                                                std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
  ncclUniqueId id{};
  if (rank == 0) detail::check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId", "bootstrap");
  share_bytes_through_file(path, rank, std::as_writable_bytes(std::span<char>(id.internal, sizeof id.internal)),
                           timeout);
  return id;
}

class nccl_communicator {
 public:
  using space = device_space;
  using executor_type = cuda_executor;

  //! One rank of `size`, all holding the same `id` (ncclGetUniqueId on rank 0). The
  //! device current now is the communicator's (its stream, its watchdog).
  nccl_communicator(cuda_executor const& exec, ncclUniqueId const& id, int rank, int size,
                    communicator_options options = {})
      : options_(options), rank_(rank), size_(size) {
    detail::check_nccl(ncclCommInitRank(&comm_, size, id, rank), "ncclCommInitRank", "bootstrap");
    // A constructor that throws runs no destructor: without this the communicator would
    // leak, never aborted, while the other ranks go on with theirs.
    try {
      int device = 0;
      MPX_CUDA_CHECK(cudaGetDevice(&device));
      MPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      // Made, used and freed on the stream of the collectives: ordered without events.
      values_ = tensor<double, device_space>(exec.on(stream_), shape{host_value_capacity});
      void* pinned = nullptr;
      MPX_CUDA_CHECK(cudaMallocHost(&pinned, host_value_capacity * sizeof(std::uint64_t)));
      host_values_ = static_cast<std::uint64_t*>(pinned);
      watchdog_ = std::make_unique<detail::collective_watchdog>(
          detail::collective_watchdog::period_for(options_.timeout), [this] { return watchdog_check(); },
          [this](std::string const& why) { return watchdog_abort(why); },
          [device] {
            static_cast<void>(cudaSetDevice(device));
            // Its event queries must not count as another thread's call during a CUDA-graph
            // capture of the training step (the default, global mode would invalidate it).
            cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
            static_cast<void>(cudaThreadExchangeStreamCaptureMode(&relaxed));
          });
    } catch (...) {
      broken_ = true;  // aborted, not destroyed: aborting waits for no other rank
      release();
      throw;
    }
  }
  //! The id handed out by rank 0 through `bootstrap` (an mpx::mpi_communicator, or any
  //! communicator with a host broadcast_bytes): the usual way under mpirun.
  template <class Bootstrap>
    requires requires(Bootstrap& b, std::span<std::byte> bytes) { b.broadcast_bytes(bytes, 0); }
  nccl_communicator(cuda_executor const& exec, Bootstrap& bootstrap, communicator_options options = {})
      : nccl_communicator(exec, id_from(bootstrap), bootstrap.rank(), bootstrap.size(), options) {}

  //! Destroys the communicator once its collectives are done (waiting at most the
  //! timeout), or aborts it: when they are not done by then, when it broke, or when it
  //! is destroyed by an exception's unwinding (ncclCommDestroy would wait for the other
  //! ranks, which may never come).
  ~nccl_communicator() {
    watchdog_.reset();  // joined first: nothing aborts behind release()'s back
    if (!broken_ && (std::uncaught_exceptions() > uncaught_at_construction_ || !collectives_done_within_timeout()))
      broken_ = true;
    release();
  }
  nccl_communicator(nccl_communicator const&) = delete;
  nccl_communicator& operator=(nccl_communicator const&) = delete;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  //! NCCL's communicator; null once it was aborted. The watchdog may abort it at any
  //! time after this returns: a handle kept for later calls may dangle.
  [[nodiscard]] ncclComm_t native() const {
    std::lock_guard lock(mutex_);
    return comm_;
  }
  //! The stream the collectives run on (for profilers and tests); the executors' streams
  //! are ordered with it by events.
  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

  //! A max or min keeps a NaN (NCCL's own float max and min would drop it): the values
  //! are reduced as detail::nan_keeping_max_key integers, converted by kernels on the
  //! communicator's stream. Launches kernels, so compiled by nvcc (a template: a file
  //! the plain C++ compiler builds is told so at compile time, as for any algorithm).
  template <std::same_as<cuda_executor> Exec>
  void all_reduce(Exec const& exec, tensor_ref<device_space> data, reduce_op op) {
    all_reduce_on(exec, data, op, false);
  }

  //! all_reduce, started on the communicator's stream without making the executor's
  //! stream wait: the executor's later work (the backward pass of earlier layers) runs
  //! concurrently. `data` must stay untouched until finish_all_reduces(exec).
  template <std::same_as<cuda_executor> Exec>
  void start_all_reduce(Exec const& exec, tensor_ref<device_space> data, reduce_op op) {
    all_reduce_on(exec, data, op, true);
  }
  //! The executor's stream waits (on the GPU) for every started all-reduce. Then throws
  //! the reason if the communicator was aborted meanwhile: an aborted all-reduce's event
  //! completes too, over partly reduced values.
  void finish_all_reduces(cuda_executor const& exec) {
    std::vector<std::shared_ptr<detail::ordering_event>> pending;
    pending.swap(unfinished_);  // forgotten on every way out: a failed wait leaves none for the next step
    // The waits first, also after an abort: an aborted kernel may still be writing.
    for (auto const& e : pending) MPX_CUDA_CHECK(cudaStreamWaitEvent(exec.stream(), e->get(), 0));
    std::lock_guard lock(mutex_);
    require_usable_locked();
  }

  void broadcast(cuda_executor const& exec, tensor_ref<device_space> data, int root) {
    if (root < 0 || root >= size_)
      detail::fail<invalid_argument>("nccl_communicator::broadcast", "root " + std::to_string(root) +
                                                                         " is not a rank of " + std::to_string(size_));
    run(exec, "broadcast (" + std::to_string(data.size_bytes()) + " bytes from rank " + std::to_string(root) + ")",
        false, [&](std::string const& what) {
          detail::check_nccl(ncclBroadcast(data.data(), data.data(), data.size_bytes(), ncclUint8, root, comm_, stream_),
                             "ncclBroadcast", what);
        });
  }

  //! Host values through a small device buffer; waits for the result (at most the
  //! timeout: the copies go through pinned memory, so none blocks behind a hung collective).
  [[nodiscard]] std::vector<double> all_gather_values(std::span<double const> mine) {
    std::size_t const n = mine.size(), total = n * static_cast<std::size_t>(size_),
                      at = n * static_cast<std::size_t>(rank_);
    require_room(total);
    std::string const what = enqueue_host_collective(
        "all_gather (" + std::to_string(n) + " values)",
        [&] {
          for (std::size_t i = 0; i < n; ++i) host_values_[at + i] = detail::bit_cast<std::uint64_t>(mine[i]);
          MPX_CUDA_CHECK(cudaMemcpyAsync(values_.data() + at, host_values_ + at, n * sizeof(double),
                                         cudaMemcpyHostToDevice, stream_));
        },
        [&](std::string const& w) {
          detail::check_nccl(ncclAllGather(values_.data() + at, values_.data(), n, ncclFloat64, comm_, stream_),
                             "ncclAllGather", w);
          MPX_CUDA_CHECK(
              cudaMemcpyAsync(host_values_, values_.data(), total * sizeof(double), cudaMemcpyDeviceToHost, stream_));
        });
    wait_for_stream(what);
    std::vector<double> all(total);
    for (std::size_t i = 0; i < total; ++i) all[i] = detail::bit_cast<double>(host_values_[i]);
    return all;
  }

  //! A max or min keeps a NaN, as all_reduce's (the keys are made on the host).
  void all_reduce_values(std::span<double> values, reduce_op op) {
    require_room(values.size());
    bool const keys = op != reduce_op::sum, negated = op == reduce_op::min;
    std::string const what = enqueue_host_collective(
        "all_reduce (" + std::string(to_string(op)) + " of " + std::to_string(values.size()) + " values)",
        [&] {
          for (std::size_t i = 0; i < values.size(); ++i)
            host_values_[i] =
                keys ? detail::nan_keeping_max_key(values[i], negated) : detail::bit_cast<std::uint64_t>(values[i]);
          MPX_CUDA_CHECK(
              cudaMemcpyAsync(values_.data(), host_values_, values.size_bytes(), cudaMemcpyHostToDevice, stream_));
        },
        [&](std::string const& w) {
          detail::check_nccl(ncclAllReduce(values_.data(), values_.data(), values.size(),
                                           keys ? ncclUint64 : ncclFloat64, keys ? ncclMax : ncclSum, comm_, stream_),
                             "ncclAllReduce", w);
          MPX_CUDA_CHECK(
              cudaMemcpyAsync(host_values_, values_.data(), values.size_bytes(), cudaMemcpyDeviceToHost, stream_));
        });
    wait_for_stream(what);
    for (std::size_t i = 0; i < values.size(); ++i)
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
  void poll() {
    std::lock_guard lock(mutex_);
    require_usable_locked();
    if (std::string why = why_stop_locked(); !why.empty()) fail_locked(why);
  }

 private:
  template <class Bootstrap>
  static ncclUniqueId id_from(Bootstrap& bootstrap) {
    ncclUniqueId id{};
    if (bootstrap.rank() == 0) detail::check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId", "bootstrap");
    bootstrap.broadcast_bytes(std::as_writable_bytes(std::span<char>(id.internal, sizeof id.internal)), 0);
    return id;
  }

  // all_reduce, waited for by the executor's stream now or (deferred) at finish_all_reduces.
  template <class Exec>
  void all_reduce_on(Exec const& exec, tensor_ref<device_space> data, reduce_op op, bool deferred) {
    detail::require_reducible("nccl_communicator::all_reduce", data.dtype());
    run(exec, "all_reduce (" + std::string(to_string(op)) + " of " + std::to_string(data.size()) + " " +
                  std::string(to_string(data.dtype())) + ")",
        deferred, [&](std::string const& what) {
          if (op == reduce_op::sum) {
            detail::check_nccl(ncclAllReduce(data.data(), data.data(), data.size(), detail::nccl_type(data.dtype()),
                                             ncclSum, comm_, stream_),
                               "ncclAllReduce", what);
          } else {
            extreme_keeping_nan(exec.on(stream_), data, op == reduce_op::min, what);
          }
        });
  }

  // The max (or, negated, the min) of `data` over the ranks, NaN kept: each value becomes
  // its nan_keeping_max_key in 32 bits, the keys' integer max is taken, and turned back.
  // The keys live on stream_ (`here`) for the collective alone (allocated and freed there:
  // in a capture, the graph's own memory).
  template <class Exec>
  void extreme_keeping_nan(Exec const& here, tensor_ref<device_space> data, bool negated, std::string const& what) {
    auto const n = static_cast<std::int64_t>(data.size());
    visit_dtype(data.dtype(), [&](auto t) {
      using T = decltype(t);
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16>) {
        auto const values = data.template as<T>().reshape(shape{n});
        tensor<std::uint32_t, device_space> keys(here, shape{n});
        transform(here, keys, detail::to_max_key<T>{negated}, tensor_view<T const, device_space>(values));
        detail::check_nccl(ncclAllReduce(keys.data(), keys.data(), data.size(), ncclUint32, ncclMax, comm_, stream_),
                           "ncclAllReduce", what);
        transform(here, values, detail::from_max_key<T>{negated}, tensor_view<std::uint32_t const, device_space>(keys));
      }
    });
  }

  // The collective on the side stream: after the executor's work so far, before its later
  // work (or, deferred, before finish_all_reduces). Under the lock, so the watchdog never
  // aborts the communicator in the middle of an enqueue; an NCCL call that fails there
  // aborts it (the ranks no longer agree on what was enqueued).
  template <class Enqueue>
  void run(cuda_executor const& exec, std::string what, bool deferred, Enqueue&& enqueue) {
    std::lock_guard lock(mutex_);
    require_usable_locked();
    bool const capturing = exec.capturing();
    if (!capturing)  // a CUDA graph being captured: no queries
      if (std::string why = why_stop_locked(); !why.empty()) fail_locked(why);
    what += " #" + std::to_string(++sequence_);
    detail::ordering_event ready;
    MPX_CUDA_CHECK(cudaEventRecord(ready.get(), exec.stream()));
    MPX_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready.get(), 0));
    auto done = std::make_shared<detail::ordering_event>();
    enqueue_or_abort(what, [&] {
      enqueue(what);
      MPX_CUDA_CHECK(cudaEventRecord(done->get(), stream_));
    });
    // A collective captured into a CUDA graph is not in flight: it runs with each replay,
    // and its event, recorded in the capture, cannot be queried (cudaErrorCapturedEvent).
    if (!capturing) in_flight_.push(what, done);
    if (deferred) unfinished_.push_back(std::move(done));
    else MPX_CUDA_CHECK(cudaStreamWaitEvent(exec.stream(), done->get(), 0));
  }

  // A host-value collective's enqueue, under the lock: `stage()` fills the pinned buffer
  // and copies it up, `call(what)` enqueues the NCCL call and the copy back. Returns the
  // collective's name, for wait_for_stream.
  template <class Stage, class Call>
  std::string enqueue_host_collective(std::string what, Stage&& stage, Call&& call) {
    std::lock_guard lock(mutex_);
    require_usable_locked();
    what += " #" + std::to_string(++sequence_);
    stage();
    enqueue_or_abort(what, [&] { call(what); });
    return what;
  }

  // Runs a collective's NCCL calls under the enqueue mark (stuck_in_enqueue). Once they
  // began, a failure aborts the communicator, since the ranks may disagree on what was
  // enqueued; the mark is gone before the abort. Under the lock.
  template <class Calls>
  void enqueue_or_abort(std::string const& what, Calls&& calls) {
    try {
      enqueue_mark const marked(*this);
      calls();
    } catch (std::exception const& e) {
      abort_locked(dynamic_cast<collective_error const*>(&e)
                       ? std::string(e.what())
                       : "mpx::nccl_communicator: rank " + std::to_string(rank_) + ": " + what +
                             ": failed while it was enqueued: " + e.what());
      throw;
    }
  }

  // Waits for the stream (a host-value collective's copy back) at most the timeout,
  // looking at NCCL's asynchronous errors as it goes; then checks that the watchdog did
  // not abort the communicator meanwhile (an aborted collective's stream completes too).
  void wait_for_stream(std::string const& what) {
    auto const start = std::chrono::steady_clock::now();
    for (;;) {
      cudaError_t const s = cudaStreamQuery(stream_);
      if (s != cudaSuccess && s != cudaErrorNotReady) MPX_CUDA_CHECK(s);
      {
        std::lock_guard lock(mutex_);  // not held while sleeping: the watchdog takes it too
        require_usable_locked();
        if (s == cudaSuccess) return;
        ncclResult_t async = ncclSuccess;
        if (ncclResult_t const query = ncclCommGetAsyncError(comm_, &async); query != ncclSuccess)
          fail_locked(what + ": ncclCommGetAsyncError failed: " + ncclGetErrorString(query));
        if (async != ncclSuccess && async != ncclInProgress) fail_locked(what + ": " + ncclGetErrorString(async));
        if (detail::waited_past(start, options_.timeout))
          fail_locked(what + ": not complete after " + std::to_string(options_.timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  // Why the communicator must stop now, or "": NCCL reports an asynchronous error (also
  // for collectives no list holds: those a CUDA graph replays), or the oldest collective
  // in flight ran past the timeout. Under the lock; throws mpx::cuda_error when an event
  // cannot be queried.
  std::string why_stop_locked() {
    auto const* const oldest = in_flight_.oldest_running([](std::shared_ptr<detail::ordering_event> const& done) {
      cudaError_t const status = cudaEventQuery(done->get());
      if (status != cudaSuccess && status != cudaErrorNotReady) MPX_CUDA_CHECK(status);
      return status == cudaSuccess;
    });
    std::string const which = oldest ? oldest->what : std::string("a collective (replayed from a CUDA graph?)");
    ncclResult_t async = ncclSuccess;
    if (ncclResult_t const query = ncclCommGetAsyncError(comm_, &async); query != ncclSuccess)
      return which + ": ncclCommGetAsyncError failed: " + ncclGetErrorString(query);
    if (async != ncclSuccess && async != ncclInProgress) return which + ": " + ncclGetErrorString(async);
    if (!oldest) return "";
    if (in_flight_.overdue(*oldest, options_.timeout))
      return oldest->what + ": not complete " + std::to_string(options_.timeout.count()) +
             " ms after it was enqueued (a rank hung, died, or called another collective)";
    return "";
  }

  // The watchdog's look (its own thread): why to stop, or "". The caller holds the lock
  // only while it enqueues; stuck there past the timeout is a reason too (NCCL's enqueue
  // waits for room on a GPU that a hung collective holds).
  std::string watchdog_check() {
    std::unique_lock lock(mutex_, std::try_to_lock);
    if (!lock) return stuck_in_enqueue();
    return broken_ ? std::string() : why_stop_locked();
  }
  // The watchdog's abort, after a second look under the same lock (a collective may have
  // completed since): the hung kernel ends, so a host waiting on the GPU behind it goes
  // on, and the next call into the communicator throws the reason, which is also said at
  // once on stderr. A caller stuck inside an enqueue holds the lock, and NCCL's calls may
  // not race an abort: the process is ended instead (std::abort), after saying why, so
  // that the job's launcher ends the job rather than leave it hung.
  bool watchdog_abort(std::string const& /*the first look's reason, looked at again*/) noexcept {
    std::unique_lock lock(mutex_, std::try_to_lock);
    if (!lock) {
      std::string const stuck = stuck_in_enqueue();
      if (stuck.empty()) return false;
      std::fprintf(stderr, "mpx::nccl_communicator: rank %d: %s; ending the process (std::abort)\n", rank_,
                   stuck.c_str());
      std::fflush(stderr);
      std::abort();
    }
    if (broken_) return true;
    std::string now;
    try {
      now = why_stop_locked();
    } catch (std::exception const& e) {
      now = e.what();
    }
    if (now.empty()) return false;
    abort_locked("mpx::nccl_communicator: rank " + std::to_string(rank_) + ": " + now);
    std::fprintf(stderr, "%s (aborted by the watchdog)\n", failure_.c_str());
    return true;
  }
  // "" unless the caller has been inside NCCL's enqueue for longer than the timeout
  // while a collective enqueued before it was still running: the evidence of a hang. (A first collective's lazy connection setup, inside the enqueue, has no
  // collective before it, and never counts.)
  std::string stuck_in_enqueue() const {
    auto const at = [](std::int64_t ticks) {
      return std::chrono::steady_clock::time_point(std::chrono::steady_clock::duration(ticks));
    };
    std::int64_t const since = enqueue_started_.load(), behind = enqueue_behind_.load();
    // (behind <= since: the collective before it has been running longer still)
    if (since == 0 || behind == 0 || !detail::waited_past(at(since), options_.timeout)) return "";
    return "a collective's enqueue has not returned " + std::to_string(options_.timeout.count()) +
           " ms after it began, behind a collective enqueued longer ago than that (the GPU cannot take more work "
           "behind a hung collective)";
  }
  // Marks, while an enqueue's NCCL calls run (under the lock), when they began and when
  // the oldest collective in flight before them was enqueued, for stuck_in_enqueue.
  struct enqueue_mark {
    nccl_communicator& c;
    explicit enqueue_mark(nccl_communicator& owner) : c(owner) {
      auto const behind = c.in_flight_.oldest_enqueued();
      c.enqueue_behind_.store(behind ? behind->time_since_epoch().count() : 0);
      c.enqueue_started_.store(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    ~enqueue_mark() { c.enqueue_started_.store(0); }
    enqueue_mark(enqueue_mark const&) = delete;
    enqueue_mark& operator=(enqueue_mark const&) = delete;
  };

  void require_usable_locked() const {
    if (broken_)
      throw collective_error(failure_.empty() ? "mpx::nccl_communicator: an earlier collective failed; end the job"
                                              : failure_ + " (the communicator is aborted; end the job)",
                             {});
  }

  void require_room(std::size_t n) const {
    if (n > values_.size())
      detail::fail<invalid_argument>("nccl_communicator", std::to_string(n) + " host values in one collective (at most " +
                                                              std::to_string(values_.size()) + ")");
  }

  // Whether every collective in flight completed within the timeout (for the destructor).
  bool collectives_done_within_timeout() noexcept {
    auto const start = std::chrono::steady_clock::now();
    for (;;) {
      bool query_failed = false;
      bool const done = in_flight_.oldest_running([&](std::shared_ptr<detail::ordering_event> const& e) {
        cudaError_t const status = cudaEventQuery(e->get());
        if (status != cudaSuccess && status != cudaErrorNotReady) query_failed = true;
        return status == cudaSuccess || query_failed;
      }) == nullptr;
      if (query_failed) {
        static_cast<void>(cudaGetLastError());
        return false;
      }
      if (done) return true;
      if (detail::waited_past(start, options_.timeout)) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // What the constructor made, freed in order (also when it made only part of it): the
  // device buffer on the stream, after the work there; the communicator, aborted when
  // broken (an abort waits for no other rank and stops a hung kernel); then the pinned
  // buffer (freeing it waits for the device, which the abort has released) and the stream.
  void release() noexcept {
    values_ = {};
    if (comm_) {
      if (broken_) ncclCommAbort(comm_);
      else ncclCommDestroy(comm_);
      comm_ = nullptr;
    }
    if (host_values_) {
      if (cudaError_t status = cudaFreeHost(host_values_); status != cudaSuccess)
        std::fprintf(stderr, "mpx: cudaFreeHost failed: %s\n", cudaGetErrorString(status));
      host_values_ = nullptr;
    }
    if (stream_) static_cast<void>(cudaStreamDestroy(stream_));
    stream_ = nullptr;
  }

  // Marks the communicator broken for `message` and aborts it (an abort waits for no
  // other rank and ends a hung collective's kernel). Under the lock.
  void abort_locked(std::string message) noexcept {
    broken_ = true;
    failure_ = std::move(message);
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }
  [[noreturn]] void fail_locked(std::string const& why) {
    abort_locked("mpx::nccl_communicator: rank " + std::to_string(rank_) + ": " + why);
    throw collective_error(failure_, {});
  }

  static constexpr std::size_t host_value_capacity = 64;  // doubles (or their 64-bit keys) in one host collective

  communicator_options options_;
  int rank_ = 0;
  int size_ = 1;
  int uncaught_at_construction_ = std::uncaught_exceptions();
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  tensor<double, device_space> values_;
  std::uint64_t* host_values_ = nullptr;  // pinned: a copy into pageable memory would wait for the stream
  // (shared: events cannot move; the queue's entries do)
  detail::in_flight_collectives<std::shared_ptr<detail::ordering_event>> in_flight_;
  std::vector<std::shared_ptr<detail::ordering_event>> unfinished_;  // started, not yet waited for
  long long sequence_ = 0;
  // The watchdog's thread and the caller's share comm_, broken_, failure_ and in_flight_.
  mutable std::mutex mutex_;
  std::atomic<std::int64_t> enqueue_started_{0};  // steady_clock ticks; 0: no enqueue running
  std::atomic<std::int64_t> enqueue_behind_{0};   // the oldest collective in flight then; 0: none
  bool broken_ = false;
  std::string failure_;  // why it broke, for every later call
  std::unique_ptr<detail::collective_watchdog> watchdog_;  // last: destroyed (joined) first
};

static_assert(communicator<nccl_communicator>);

}  // namespace mpx

#endif  // MPX_HAS_CUDA_RUNTIME
