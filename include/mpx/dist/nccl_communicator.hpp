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
// mpx::collective_error naming the collective. That logic is plain C++, run by the host
// suite (detail::collective_supervisor); this file gives it NCCL and CUDA. A max or min
// keeps NaN, unlike NCCL's own on floats (through kernels: all_reduce is called from
// files nvcc compiles). The init (ncclCommInitRank, which waits for every rank) ends the
// process with the reason when it has not returned within the timeout. Needs the CUDA
// runtime and NCCL (-lnccl); not included by <mpx/mpx.hpp>.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/dist/collective_supervisor.hpp>
#include <mpx/dist/communicator.hpp>
#include <mpx/dist/file_bootstrap.hpp>
#include <mpx/dist/watchdog.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/streams.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/elementwise.hpp>

#if MPX_HAS_CUDA_RUNTIME
#include <nccl.h>

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
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

namespace detail {

//! NCCL and CUDA as a collective_supervisor's transport: a collective's completion is a
//! CUDA event on the communicator's stream.
struct nccl_transport {
  using event = std::shared_ptr<ordering_event>;  // shared: events cannot move; the queue's entries do
  ncclComm_t comm = nullptr;

  [[nodiscard]] bool done(event const& e) const {
    cudaError_t const status = cudaEventQuery(e->get());
    if (status != cudaSuccess && status != cudaErrorNotReady) MPX_CUDA_CHECK(status);
    return status == cudaSuccess;
  }
  [[nodiscard]] std::string async_error() const {
    if (!comm) return "";
    ncclResult_t async = ncclSuccess;
    if (ncclResult_t const query = ncclCommGetAsyncError(comm, &async); query != ncclSuccess)
      return std::string("ncclCommGetAsyncError failed: ") + ncclGetErrorString(query);
    if (async != ncclSuccess && async != ncclInProgress) return ncclGetErrorString(async);
    return "";
  }
  void abort() noexcept {
    if (comm) ncclCommAbort(comm);
    comm = nullptr;
  }
};

}  // namespace detail

class nccl_communicator {
 public:
  using space = device_space;
  using executor_type = cuda_executor;

  //! One rank of `size`, all holding the same `id` (ncclGetUniqueId on rank 0). The
  //! device current now is the communicator's (its stream, its watchdog).
  nccl_communicator(cuda_executor const& exec, ncclUniqueId const& id, int rank, int size,
                    communicator_options options = {})
      : rank_(rank),
        size_(size),
        supervisor_(transport_, "mpx::nccl_communicator: rank " + std::to_string(rank), options.timeout) {
    // Every rank must join, and a blocking init cannot be aborted: past the timeout the
    // process ends with the reason, so that the launcher ends the job.
    detail::end_process_unless_returns_within(
        options.timeout,
        "mpx::nccl_communicator: rank " + std::to_string(rank) + " of " + std::to_string(size) +
            ": ncclCommInitRank has not returned " + std::to_string(options.timeout.count()) +
            " ms after it began (a rank did not join: it died, hung, or was given another id)",
        [&] {
          detail::check_nccl(ncclCommInitRank(&transport_.comm, size, id, rank), "ncclCommInitRank", "bootstrap");
        });
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
      supervisor_.watch([device] {
        static_cast<void>(cudaSetDevice(device));
        // Its event queries must not count as another thread's call during a CUDA-graph
        // capture of the training step (the default, global mode would invalidate it).
        cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
        static_cast<void>(cudaThreadExchangeStreamCaptureMode(&relaxed));
      });
    } catch (...) {
      release(true);  // aborted, not destroyed: aborting waits for no other rank
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
    supervisor_.stop_watching();  // first: nothing aborts behind release()'s back
    release(supervisor_.aborted() || std::uncaught_exceptions() > uncaught_at_construction_ ||
            !supervisor_.drained_within_timeout());
  }
  nccl_communicator(nccl_communicator const&) = delete;
  nccl_communicator& operator=(nccl_communicator const&) = delete;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  //! NCCL's communicator; null once it was aborted. The watchdog may abort it at any
  //! time after this returns: a handle kept for later calls may dangle.
  [[nodiscard]] ncclComm_t native() const {
    return supervisor_.locked([&] { return transport_.comm; });
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
    supervisor_.require_usable();
  }

  void broadcast(cuda_executor const& exec, tensor_ref<device_space> data, int root) {
    if (root < 0 || root >= size_)
      detail::fail<invalid_argument>("nccl_communicator::broadcast", "root " + std::to_string(root) +
                                                                         " is not a rank of " + std::to_string(size_));
    run(exec, "broadcast (" + std::to_string(data.size_bytes()) + " bytes from rank " + std::to_string(root) + ")",
        false, [&](std::string const& what) {
          detail::check_nccl(
              ncclBroadcast(data.data(), data.data(), data.size_bytes(), ncclUint8, root, transport_.comm, stream_),
              "ncclBroadcast", what);
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
      MPX_CUDA_CHECK(cudaMemcpyAsync(values_.data() + at, host_values_ + at, n * sizeof(double),
                                     cudaMemcpyHostToDevice, stream_));
      detail::check_nccl(ncclAllGather(values_.data() + at, values_.data(), n, ncclFloat64, transport_.comm, stream_),
                         "ncclAllGather", what);
      MPX_CUDA_CHECK(
          cudaMemcpyAsync(host_values_, values_.data(), total * sizeof(double), cudaMemcpyDeviceToHost, stream_));
    });
    std::vector<double> all(total);
    for (std::size_t i = 0; i < total; ++i) all[i] = detail::bit_cast<double>(host_values_[i]);
    return all;
  }

  //! A max or min keeps a NaN, as all_reduce's (the keys are made on the host).
  void all_reduce_values(std::span<double> values, reduce_op op) {
    require_room(values.size());
    bool const keys = op != reduce_op::sum, negated = op == reduce_op::min;
    host_collective(
        "all_reduce (" + std::string(to_string(op)) + " of " + std::to_string(values.size()) + " values)",
        [&](std::string const& what) {
          for (std::size_t i = 0; i < values.size(); ++i)
            host_values_[i] =
                keys ? detail::nan_keeping_max_key(values[i], negated) : detail::bit_cast<std::uint64_t>(values[i]);
          MPX_CUDA_CHECK(
              cudaMemcpyAsync(values_.data(), host_values_, values.size_bytes(), cudaMemcpyHostToDevice, stream_));
          detail::check_nccl(ncclAllReduce(values_.data(), values_.data(), values.size(),
                                           keys ? ncclUint64 : ncclFloat64, keys ? ncclMax : ncclSum, transport_.comm,
                                           stream_),
                             "ncclAllReduce", what);
          MPX_CUDA_CHECK(
              cudaMemcpyAsync(host_values_, values_.data(), values.size_bytes(), cudaMemcpyDeviceToHost, stream_));
        });
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
  void poll() { supervisor_.poll(); }

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
                                             ncclSum, transport_.comm, stream_),
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
        detail::check_nccl(
            ncclAllReduce(keys.data(), keys.data(), data.size(), ncclUint32, ncclMax, transport_.comm, stream_),
            "ncclAllReduce", what);
        transform(here, values, detail::from_max_key<T>{negated}, tensor_view<std::uint32_t const, device_space>(keys));
      }
    });
  }

  // The collective on the side stream: after the executor's work so far, before its later
  // work (or, deferred, before finish_all_reduces). A collective captured into a CUDA
  // graph is not watched: it runs with each replay, its event recorded in the capture
  // cannot be queried, and a capture makes no queries. (A failure of the events' calls
  // aborts too, as any in an enqueue: only a broken context fails them.)
  template <class Enqueue>
  void run(cuda_executor const& exec, std::string what, bool deferred, Enqueue&& enqueue) {
    bool const capturing = exec.capturing();
    auto done = std::make_shared<detail::ordering_event>();
    supervisor_.enqueue(std::move(what), !capturing,
                        [&](std::string const& named) -> std::optional<detail::nccl_transport::event> {
                          detail::ordering_event ready;
                          MPX_CUDA_CHECK(cudaEventRecord(ready.get(), exec.stream()));
                          MPX_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready.get(), 0));
                          enqueue(named);
                          MPX_CUDA_CHECK(cudaEventRecord(done->get(), stream_));
                          if (capturing) return std::nullopt;
                          return done;
                        });
    if (deferred) unfinished_.push_back(std::move(done));
    else MPX_CUDA_CHECK(cudaStreamWaitEvent(exec.stream(), done->get(), 0));
  }

  // A host-value collective: `calls(name)` fills the pinned buffer, copies it up, and
  // enqueues the NCCL call and the copy back; then the stream is waited for (at most the
  // timeout).
  template <class Calls>
  void host_collective(std::string what, Calls&& calls) {
    std::string const named = supervisor_.enqueue(
        std::move(what), true, [&](std::string const& w) -> std::optional<detail::nccl_transport::event> {
          calls(w);
          return std::nullopt;
        });
    supervisor_.wait(named, [&] {
      cudaError_t const status = cudaStreamQuery(stream_);
      if (status != cudaSuccess && status != cudaErrorNotReady) MPX_CUDA_CHECK(status);
      return status == cudaSuccess;
    });
  }

  void require_room(std::size_t n) const {
    if (n > values_.size())
      detail::fail<invalid_argument>("nccl_communicator", std::to_string(n) + " host values in one collective (at most " +
                                                              std::to_string(values_.size()) + ")");
  }

  // What the constructor made, freed in order (also when it made only part of it): the
  // device buffer on the stream, after the work there; the communicator, aborted (an
  // abort waits for no other rank and stops a hung kernel) or destroyed with the other
  // ranks; then the pinned buffer (freeing it waits for the device, which the abort has
  // released) and the stream.
  void release(bool abort) noexcept {
    values_ = {};
    if (abort) transport_.abort();
    if (transport_.comm) static_cast<void>(ncclCommDestroy(transport_.comm));
    transport_.comm = nullptr;
    if (host_values_) detail::report_if_failed(cudaFreeHost(host_values_), "cudaFreeHost");
    host_values_ = nullptr;
    if (stream_) detail::report_if_failed(cudaStreamDestroy(stream_), "cudaStreamDestroy");
    stream_ = nullptr;
  }

  static constexpr std::size_t host_value_capacity = 64;  // doubles (or their 64-bit keys) in one host collective

  int rank_ = 0;
  int size_ = 1;
  int uncaught_at_construction_ = std::uncaught_exceptions();
  detail::nccl_transport transport_;  // its handle is read and aborted under the supervisor's lock
  cudaStream_t stream_ = nullptr;
  tensor<double, device_space> values_;
  std::uint64_t* host_values_ = nullptr;  // pinned: a copy into pageable memory would wait for the stream
  std::vector<std::shared_ptr<detail::ordering_event>> unfinished_;  // started, not yet waited for
  detail::collective_supervisor<detail::nccl_transport> supervisor_;  // last: its watchdog stops first
};

static_assert(communicator<nccl_communicator>);

}  // namespace mpx

#endif  // MPX_HAS_CUDA_RUNTIME
