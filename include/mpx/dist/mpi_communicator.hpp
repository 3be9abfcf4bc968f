// mpx::mpi_communicator: the communicator between host processes, on MPI (Open MPI
// from Debian; any MPI-3 library). Every collective is non-blocking underneath and
// waited for with a deadline, so a rank that hangs or dies makes the others stop with
// mpx::collective_error naming it and the collective, instead of waiting forever.
// Needs <mpi.h>: compile with mpicxx, or with the flags of `pkg-config ompi-cxx`
// (Meson: dependency('mpi', language: 'cpp')). Not included by <mpx/mpx.hpp>.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/dist/communicator.hpp>

// MPI's C API only: Open MPI's deprecated C++ bindings do not compile warning-free.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace mpx {

//! MPI_Init on construction, MPI_Finalize on destruction (when this object initialised
//! MPI): the first line of a data-parallel main(). Left by an exception, it does not
//! finalize (MPI_Finalize waits for ranks that may be waiting for this one): report the
//! error, then mpi_environment::abort ends the job.
class mpi_environment {
 public:
  mpi_environment(int& argc, char**& argv) : unwinding_at_start_(std::uncaught_exceptions()) {
    int ready = 0;
    MPI_Initialized(&ready);
    if (ready) return;
    int provided = 0;
    if (MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
      detail::fail<error>("mpi_environment", "MPI_Init_thread failed");
    owner_ = true;
  }
  ~mpi_environment() {
    int done = 0;
    MPI_Finalized(&done);
    if (owner_ && !done && std::uncaught_exceptions() == unwinding_at_start_) MPI_Finalize();
  }

  //! Whether MPI is initialised and not yet finalised (an error handler then aborts).
  static bool active() noexcept {
    int ready = 0, done = 0;
    MPI_Initialized(&ready);
    MPI_Finalized(&done);
    return ready && !done;
  }
  mpi_environment(mpi_environment const&) = delete;
  mpi_environment& operator=(mpi_environment const&) = delete;

  //! Whether this process was started by mpirun/mpiexec (or srun) as one of several.
  static bool launched_as_replica() noexcept {
    for (char const* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "SLURM_NTASKS"})
      if (std::getenv(v)) return true;
    return false;
  }

  //! Ends the whole job: after a collective_error the others may be inside a collective
  //! that never completes, and MPI_Finalize would wait for them.
  [[noreturn]] static void abort(int code, std::string const& why) {
    std::fprintf(stderr, "%s\n", why.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, code);
    std::abort();  // MPI_Abort does not return; should an MPI library let it, stop anyway
  }

 private:
  int unwinding_at_start_ = 0;
  bool owner_ = false;
};

namespace detail {

//! Element-wise reductions MPI does not have: sums of half and bfloat16 (each addition
//! in float, rounded to the dtype as NCCL does), and max/min that keep a NaN (MPI_MAX's
//! `a > b ? a : b` would drop it, and a NaN must never pass a check).
template <class T>
T nan_keeping_extreme(T a, T b, bool larger) {
  double x = 0, y = 0;
  if constexpr (std::is_same_v<T, double>) {
    x = a;
    y = b;
  } else {
    x = cast<float>(a);
    y = cast<float>(b);
  }
  if (x != x) return a;
  if (y != y) return b;
  return (larger ? x > y : x < y) ? a : b;
}

template <class T, reduce_op Op>
void mpi_reduce_elements(void* in, void* inout, int* length, MPI_Datatype*) {
  auto const* a = static_cast<T const*>(in);
  auto* b = static_cast<T*>(inout);
  for (int i = 0; i < *length; ++i) {
    if constexpr (Op == reduce_op::sum)
      b[i] = cast<T>(cast<float>(a[i]) + cast<float>(b[i]));
    else
      b[i] = nan_keeping_extreme(a[i], b[i], Op == reduce_op::max);
  }
}

inline std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

}  // namespace detail

class mpi_communicator {
 public:
  using space = host_space;
  using executor_type = host_executor;

  //! A communicator of its own over the processes of `base` (a duplicate: mpx's
  //! messages never meet the program's). MPI must be initialised (mpi_environment).
  explicit mpi_communicator(MPI_Comm base = MPI_COMM_WORLD, communicator_options options = {}) : options_(options) {
    check(MPI_Comm_dup(base, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);  // failures become collective_error
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    make_ops<half>(ops_[0]);
    make_ops<bfloat16>(ops_[1]);
    make_ops<float>(ops_[2]);
    make_ops<double>(double_ops_);
  }
  ~mpi_communicator() {
    for (auto* row : {ops_[0], ops_[1], ops_[2], double_ops_})
      for (int i = 0; i < 3; ++i)
        if (row[i] != MPI_OP_NULL && row[i] != MPI_SUM) MPI_Op_free(&row[i]);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!broken_ && !finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  mpi_communicator(mpi_communicator const&) = delete;
  mpi_communicator& operator=(mpi_communicator const&) = delete;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] MPI_Comm native() const noexcept { return comm_; }
  [[nodiscard]] communicator_options const& options() const noexcept { return options_; }
  void set_timeout(std::chrono::milliseconds t) noexcept { options_.timeout = t; }

  //! In place: every rank's `data` becomes the element-wise reduction over all ranks.
  //! The same bits on every rank (MPI's algorithms combine each element along one
  //! schedule; data_parallel checks it in debug builds). All-reduces started before it
  //! stay started (an fp8 layer's amax is reduced while later layers' gradient buckets
  //! are on the wire): MPI lets collectives overlap where every rank issues them in the
  //! same order.
  void all_reduce(host_executor const& exec, tensor_ref<host_space> data, reduce_op op) {
    start_all_reduce(exec, data, op);
    started const mine = started_.back();
    started_.pop_back();
    current_ = mine.what;
    MPI_Request request = mine.request;
    wait(request);
  }

  //! all_reduce, started: it may progress while this rank computes; `data` must stay
  //! untouched until finish_all_reduces() returns. Ranks start the same all-reduces in
  //! the same order.
  void start_all_reduce(host_executor const&, tensor_ref<host_space> data, reduce_op op) {
    detail::require_reducible("mpi_communicator::start_all_reduce", data.dtype());
    begin("all_reduce (" + std::string(to_string(op)) + " of " + std::to_string(data.size()) + " " +
          std::string(to_string(data.dtype())) + ")");
    MPI_Request request = MPI_REQUEST_NULL;
    if (data.size() != 0) {
      MPI_Datatype const type = data.dtype() == dtype_id::float32 ? MPI_FLOAT : MPI_UINT16_T;
      check(MPI_Iallreduce(MPI_IN_PLACE, data.data(), count_of(data.size()), type, op_for(data.dtype(), op), comm_,
                           &request),
            "MPI_Iallreduce");
    } else {
      check(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier");
    }
    started_.push_back({request, current_});
  }

  //! Waits (with the deadline) for every all-reduce start_all_reduce began. They are
  //! forgotten on every way out: after a failed wait the communicator is broken, and a
  //! second call (a step being abandoned) throws at once rather than wait again.
  void finish_all_reduces(host_executor const&) {
    std::vector<started> pending;
    pending.swap(started_);
    if (broken_ && !pending.empty())
      throw collective_error("mpx::mpi_communicator: an earlier collective failed (" + current_ +
                                 "); this communicator cannot be used again: end the job",
                             {});
    for (auto& s : pending) {
      current_ = s.what;
      wait(s.request);
    }
  }

  //! Root's bytes into every rank's `data` (same dtype and size everywhere).
  void broadcast(host_executor const&, tensor_ref<host_space> data, int root) {
    require_rank("mpi_communicator::broadcast", root);
    begin("broadcast (" + std::to_string(data.size_bytes()) + " bytes from rank " + std::to_string(root) + ")");
    if (data.size_bytes() == 0) {
      barrier_inside();
      return;
    }
    MPI_Request request{};
    check(MPI_Ibcast(data.data(), count_of(data.size_bytes()), MPI_BYTE, root, comm_, &request), "MPI_Ibcast");
    wait(request);
  }

  //! Root's host bytes into every rank's (a bootstrap: nccl_communicator's unique id).
  void broadcast_bytes(std::span<std::byte> bytes, int root) {
    require_rank("mpi_communicator::broadcast_bytes", root);
    begin("broadcast (" + std::to_string(bytes.size()) + " host bytes from rank " + std::to_string(root) + ")");
    MPI_Request request{};
    check(MPI_Ibcast(bytes.data(), count_of(bytes.size()), MPI_BYTE, root, comm_, &request), "MPI_Ibcast");
    wait(request);
  }

  //! Every rank's `mine` (the same count everywhere), rank 0's first.
  [[nodiscard]] std::vector<double> all_gather_values(std::span<double const> mine) {
    begin("all_gather (" + std::to_string(mine.size()) + " values)");
    std::vector<double> all(mine.size() * static_cast<std::size_t>(size_));
    MPI_Request request{};
    check(MPI_Iallgather(mine.data(), count_of(mine.size()), MPI_DOUBLE, all.data(), count_of(mine.size()),
                         MPI_DOUBLE, comm_, &request),
          "MPI_Iallgather");
    wait(request);
    return all;
  }

  //! A few host doubles reduced over the ranks, in place (metrics, checks).
  void all_reduce_values(std::span<double> values, reduce_op op) {
    begin("all_reduce (" + std::string(to_string(op)) + " of " + std::to_string(values.size()) + " values)");
    MPI_Op const mop = double_ops_[static_cast<int>(op)];
    MPI_Request request{};
    check(MPI_Iallreduce(MPI_IN_PLACE, values.data(), count_of(values.size()), MPI_DOUBLE, mop, comm_, &request),
          "MPI_Iallreduce");
    wait(request);
  }

  void barrier() {
    begin("barrier");
    barrier_inside();
  }

 private:
  // The collective being waited for: its number (the same on every rank that reached it)
  // and what it is, for messages.
  void begin(std::string what) {
    if (broken_)
      throw collective_error("mpx::mpi_communicator: an earlier collective failed (" + current_ +
                                 "); this communicator cannot be used again: end the job",
                             {});
    ++sequence_;
    current_ = std::move(what) + " #" + std::to_string(sequence_);
  }

  void barrier_inside() {
    MPI_Request request{};
    check(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier");
    wait(request);
  }

  // ops[sum, max, min] for T. Float and double sums are MPI_SUM: IEEE addition keeps NaN and inf.
  template <class T>
  static void make_ops(MPI_Op* ops) {
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>)
      ops[0] = MPI_SUM;
    else
      MPI_Op_create(&detail::mpi_reduce_elements<T, reduce_op::sum>, 1, &ops[0]);
    MPI_Op_create(&detail::mpi_reduce_elements<T, reduce_op::max>, 1, &ops[1]);
    MPI_Op_create(&detail::mpi_reduce_elements<T, reduce_op::min>, 1, &ops[2]);
  }

  MPI_Op op_for(dtype_id d, reduce_op op) const {
    int const row = d == dtype_id::float16 ? 0 : d == dtype_id::bfloat16 ? 1 : 2;
    return ops_[row][static_cast<int>(op)];
  }

  void require_rank(std::string_view op, int root) const {
    if (root < 0 || root >= size_)
      detail::fail<invalid_argument>(op, "root " + std::to_string(root) + " of " + std::to_string(size_) + " ranks");
  }

  static int count_of(std::size_t n) {
    if (n > static_cast<std::size_t>(INT32_MAX))
      detail::fail<invalid_argument>("mpi_communicator", std::to_string(n) +
                                                             " elements in one collective; MPI counts are int: "
                                                             "split it (data_parallel's buckets do)");
    return static_cast<int>(n);
  }

  void check(int code, char const* call) {
    if (code == MPI_SUCCESS) return;
    broken_ = true;
    throw collective_error("mpx::mpi_communicator: " + std::string(call) + " failed on rank " +
                               std::to_string(rank_) + " in " + current_ + ": " + detail::mpi_error_text(code),
                           {});
  }

  // Tags of the timeout diagnosis: a rank that gave up asks every other where it is; a
  // rank waiting in a collective answers with that collective's number.
  static constexpr int query_tag = 7301;
  static constexpr int answer_tag = 7302;

  void answer_queries() {
    for (;;) {
      int pending = 0;
      MPI_Status status{};
      if (MPI_Iprobe(MPI_ANY_SOURCE, query_tag, comm_, &pending, &status) != MPI_SUCCESS || !pending) return;
      long long asked = 0;
      MPI_Recv(&asked, 1, MPI_LONG_LONG, status.MPI_SOURCE, query_tag, comm_, MPI_STATUS_IGNORE);
      long long const here = sequence_;
      MPI_Request r{};
      if (MPI_Isend(&here, 1, MPI_LONG_LONG, status.MPI_SOURCE, answer_tag, comm_, &r) == MPI_SUCCESS)
        MPI_Wait(&r, MPI_STATUS_IGNORE);  // one number: delivered eagerly, never blocks
    }
  }

  // Polls the request until it completes or the timeout passes. Polling with short
  // sleeps, not spinning: ranks may share cores (mpirun --oversubscribe).
  void wait(MPI_Request& request) {
    using clock = std::chrono::steady_clock;
    auto const start = clock::now();
    for (int spins = 0;; ++spins) {
      int done = 0;
      check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      answer_queries();
      if (detail::waited_past(start, options_.timeout)) break;
      if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(spins > 4096 ? 1000 : 50));
    }
    timed_out();
  }

  // Asks every other rank where it is and names those that are not in this collective.
  [[noreturn]] void timed_out() {
    broken_ = true;
    long long const mine = sequence_;
    std::vector<MPI_Request> sends;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      sends.emplace_back();
      MPI_Isend(&mine, 1, MPI_LONG_LONG, r, query_tag, comm_, &sends.back());
    }
    std::vector<long long> where(static_cast<std::size_t>(size_), -1);
    where[static_cast<std::size_t>(rank_)] = mine;
    using clock = std::chrono::steady_clock;
    auto const grace = clock::now() + std::min<std::chrono::milliseconds>(options_.timeout, std::chrono::seconds(2));
    int answers = 0;
    while (answers < size_ - 1 && clock::now() < grace) {
      answer_queries();  // others may be diagnosing too
      int pending = 0;
      MPI_Status status{};
      if (MPI_Iprobe(MPI_ANY_SOURCE, answer_tag, comm_, &pending, &status) == MPI_SUCCESS && pending) {
        long long at = 0;
        MPI_Recv(&at, 1, MPI_LONG_LONG, status.MPI_SOURCE, answer_tag, comm_, MPI_STATUS_IGNORE);
        where[static_cast<std::size_t>(status.MPI_SOURCE)] = at;
        ++answers;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    std::vector<int> missing, elsewhere;
    for (int r = 0; r < size_; ++r) {
      long long const at = where[static_cast<std::size_t>(r)];
      if (at == -1) missing.push_back(r);
      else if (at != mine) elsewhere.push_back(r);
    }
    std::string message = "rank " + std::to_string(rank_) + " waited " +
                          std::to_string(options_.timeout.count()) + " ms in " + current_ + ": ";
    if (!missing.empty())
      message += detail::rank_list(missing) + " did not reach it (hung, still computing, or dead)";
    if (!elsewhere.empty())
      message += std::string(missing.empty() ? "" : "; ") + detail::rank_list(elsewhere) +
                 " waited in another collective (the ranks called collectives in different orders)";
    if (missing.empty() && elsewhere.empty()) message += "every rank reached it, yet it did not complete";
    std::vector<int> absent = missing;
    absent.insert(absent.end(), elsewhere.begin(), elsewhere.end());
    std::sort(absent.begin(), absent.end());
    throw collective_error("mpx::mpi_communicator: " + message, std::move(absent));
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  communicator_options options_;
  MPI_Op ops_[3][3] = {{MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL},
                       {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL},
                       {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL}};
  MPI_Op double_ops_[3] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  long long sequence_ = 0;
  std::string current_;
  bool broken_ = false;
  struct started {
    MPI_Request request;
    std::string what;
  };
  std::vector<started> started_;  // all-reduces begun by start_all_reduce
};

static_assert(communicator<mpi_communicator>);

}  // namespace mpx
