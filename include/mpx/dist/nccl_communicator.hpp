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
// suite: the supervision (detail::collective_supervisor) and all the communicator does
// around NCCL's and CUDA's calls (basic_nccl_communicator, over a backend that makes
// them); detail::nccl_cuda_backend gives it NCCL and CUDA. A max or min keeps NaN,
// unlike NCCL's own on floats (through kernels: all_reduce is called from files nvcc
// compiles). The init (ncclCommInitRank, which waits for every rank) ends the process
// with the reason when it has not returned within the timeout. Needs the CUDA runtime
// and NCCL (-lnccl); not included by <mpx/mpx.hpp>.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/dist/basic_nccl_communicator.hpp>
#include <mpx/dist/communicator.hpp>
#include <mpx/dist/file_bootstrap.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/streams.hpp>
#include <mpx/exec/tensor.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#if MPX_HAS_CUDA_RUNTIME
#include <nccl.h>

#include <cstdio>
#include <filesystem>
#include <memory>

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

//! NCCL's and CUDA's calls for basic_nccl_communicator, one each.
struct nccl_cuda_backend {
  using executor_type = cuda_executor;
  using space = device_space;
  using stream_type = cudaStream_t;
  using comm_type = ncclComm_t;
  using unique_id = ncclUniqueId;
  using event = std::shared_ptr<ordering_event>;  // shared: events cannot move; the queue's entries do
  using device_buffer = tensor<std::uint64_t, device_space>;

  static cuda_executor executor_on(cudaStream_t stream) noexcept { return cuda_executor(stream); }

  static ncclUniqueId make_unique_id() {
    ncclUniqueId id{};
    check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId", "bootstrap");
    return id;
  }
  static ncclComm_t init(int size, ncclUniqueId const& id, int rank) {
    ncclComm_t comm = nullptr;
    check_nccl(ncclCommInitRank(&comm, size, id, rank), "ncclCommInitRank", "bootstrap");
    return comm;
  }
  static void destroy(ncclComm_t comm) { check_nccl(ncclCommDestroy(comm), "ncclCommDestroy", "its release"); }
  static void abort(ncclComm_t comm) { check_nccl(ncclCommAbort(comm), "ncclCommAbort", "its abort"); }
  static std::string async_error(ncclComm_t comm) {
    ncclResult_t async = ncclSuccess;
    if (ncclResult_t const query = ncclCommGetAsyncError(comm, &async); query != ncclSuccess)
      return std::string("ncclCommGetAsyncError failed: ") + ncclGetErrorString(query);
    if (async != ncclSuccess && async != ncclInProgress) return ncclGetErrorString(async);
    return "";
  }

  static int current_device() {
    int device = 0;
    MPX_CUDA_CHECK(cudaGetDevice(&device));
    return device;
  }
  static void enter_watchdog_thread(int device) noexcept {
    static_cast<void>(cudaSetDevice(device));
    // The default, global capture mode would make the watchdog's event queries
    // invalidate a capture running on another thread.
    cudaStreamCaptureMode relaxed = cudaStreamCaptureModeRelaxed;
    static_cast<void>(cudaThreadExchangeStreamCaptureMode(&relaxed));
  }

  static cudaStream_t create_stream() {
    cudaStream_t stream = nullptr;
    MPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    return stream;
  }
  static void destroy_stream(cudaStream_t stream) { MPX_CUDA_CHECK(cudaStreamDestroy(stream)); }
  static bool stream_done(cudaStream_t stream) {
    cudaError_t const status = cudaStreamQuery(stream);
    if (status != cudaSuccess && status != cudaErrorNotReady) MPX_CUDA_CHECK(status);
    return status == cudaSuccess;
  }

  static event make_event() { return std::make_shared<ordering_event>(); }
  static void record(event const& e, cudaStream_t stream) { MPX_CUDA_CHECK(cudaEventRecord(e->get(), stream)); }
  static void wait(cudaStream_t stream, event const& e) { MPX_CUDA_CHECK(cudaStreamWaitEvent(stream, e->get(), 0)); }
  static bool done(event const& e) {
    cudaError_t const status = cudaEventQuery(e->get());
    if (status != cudaSuccess && status != cudaErrorNotReady) MPX_CUDA_CHECK(status);
    return status == cudaSuccess;
  }

  static device_buffer make_device_buffer(cudaStream_t stream, std::size_t words) {
    return device_buffer(cuda_executor(stream), shape{static_cast<std::int64_t>(words)});
  }
  static std::uint64_t* allocate_pinned(std::size_t words) { return pinned_buffer<std::uint64_t>(words).release(); }
  static void free_pinned(std::uint64_t* pinned) { MPX_CUDA_CHECK(cudaFreeHost(pinned)); }
  static void copy_to_device(std::uint64_t* to, std::uint64_t const* from, std::size_t words, cudaStream_t stream) {
    MPX_CUDA_CHECK(cudaMemcpyAsync(to, from, words * sizeof(std::uint64_t), cudaMemcpyHostToDevice, stream));
  }
  static void copy_to_host(std::uint64_t* to, std::uint64_t const* from, std::size_t words, cudaStream_t stream) {
    MPX_CUDA_CHECK(cudaMemcpyAsync(to, from, words * sizeof(std::uint64_t), cudaMemcpyDeviceToHost, stream));
  }

  static void all_reduce_sum(void* data, std::size_t n, dtype_id d, ncclComm_t comm, cudaStream_t stream,
                             std::string const& what) {
    check_nccl(ncclAllReduce(data, data, n, nccl_type(d), ncclSum, comm, stream), "ncclAllReduce", what);
  }
  static void all_reduce_max(std::uint32_t* keys, std::size_t n, ncclComm_t comm, cudaStream_t stream,
                             std::string const& what) {
    check_nccl(ncclAllReduce(keys, keys, n, ncclUint32, ncclMax, comm, stream), "ncclAllReduce", what);
  }
  static void all_reduce_max(std::uint64_t* keys, std::size_t n, ncclComm_t comm, cudaStream_t stream,
                             std::string const& what) {
    check_nccl(ncclAllReduce(keys, keys, n, ncclUint64, ncclMax, comm, stream), "ncclAllReduce", what);
  }
  static void all_reduce_float64_sum(std::uint64_t* words, std::size_t n, ncclComm_t comm, cudaStream_t stream,
                                     std::string const& what) {
    check_nccl(ncclAllReduce(words, words, n, ncclFloat64, ncclSum, comm, stream), "ncclAllReduce", what);
  }
  static void all_gather_float64(std::uint64_t const* mine, std::uint64_t* all, std::size_t n, ncclComm_t comm,
                                 cudaStream_t stream, std::string const& what) {
    check_nccl(ncclAllGather(mine, all, n, ncclFloat64, comm, stream), "ncclAllGather", what);
  }
  static void broadcast_bytes(void* data, std::size_t bytes, int root, ncclComm_t comm, cudaStream_t stream,
                              std::string const& what) {
    check_nccl(ncclBroadcast(data, data, bytes, ncclUint8, root, comm, stream), "ncclBroadcast", what);
  }

  static void report(char const* what, char const* why) noexcept {
    std::fprintf(stderr, "mpx: %s failed: %s\n", what, why);
  }
};

}  // namespace detail

//! Rank 0's NCCL unique id, handed to the other ranks through a file at `path` on a
//! filesystem every rank sees (share_bytes_through_file: a path of the job's own), for
//! launchers without MPI. The other ranks wait for it up to `timeout`.
inline ncclUniqueId nccl_unique_id_through_file(std::filesystem::path const& path, int rank,
                                                std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
  ncclUniqueId id{};
  if (rank == 0) id = detail::nccl_cuda_backend::make_unique_id();
  share_bytes_through_file(path, rank, std::as_writable_bytes(std::span<char>(id.internal, sizeof id.internal)),
                           timeout);
  return id;
}

//! The communicator between GPUs: basic_nccl_communicator on NCCL and CUDA.
using nccl_communicator = basic_nccl_communicator<detail::nccl_cuda_backend>;

static_assert(communicator<nccl_communicator>);

}  // namespace mpx

#endif  // MPX_HAS_CUDA_RUNTIME
