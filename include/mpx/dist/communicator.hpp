// mpx::communicator: what data-parallel training asks of a transport between replicas
// (all-reduce, broadcast, all-gather, barrier), and the error every backend throws when
// a collective fails or a replica does not arrive in time. Two backends implement it on
// existing engines: mpx::mpi_communicator (host memory, Open MPI; dist/mpi_communicator.hpp)
// and mpx::nccl_communicator (GPU memory, NCCL; dist/nccl_communicator.hpp).
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/tensor_ref.hpp>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace mpx {

//! A collective that failed, or that a replica did not reach within the communicator's
//! timeout. what() names the collective (with its sequence number) and the ranks that
//! were missing; after it the communicator is unusable: end the job (MPI_Abort, or
//! mpx::mpi_environment::abort) rather than call another collective.
class collective_error : public error {
 public:
  collective_error(std::string const& what, std::vector<int> missing_ranks)
      : error(what), missing_(std::move(missing_ranks)) {}
  //! The ranks that never arrived at the collective (empty when it was not a timeout).
  [[nodiscard]] std::vector<int> const& missing_ranks() const noexcept { return missing_; }

 private:
  std::vector<int> missing_;
};

enum class reduce_op { sum, max, min };

constexpr char const* to_string(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::max: return "max";
    case reduce_op::min: return "min";
  }
  return "?";
}

//! How long a rank waits for the others in one collective before it gives up with
//! mpx::collective_error. Generous by default: the first collective of a run waits for
//! every rank to load its data, build its model and compile its kernels.
//! std::chrono::milliseconds::max() waits for ever.
struct communicator_options {
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
};

namespace detail {
//! Whether `timeout` has passed since `start`, in whole milliseconds: a deadline (start +
//! timeout), or a comparison in the clock's nanoseconds, would overflow for
//! milliseconds::max().
inline bool waited_past(std::chrono::steady_clock::time_point start, std::chrono::milliseconds timeout,
                        std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now()) noexcept {
  return std::chrono::duration_cast<std::chrono::milliseconds>(now - start) >= timeout;
}
}  // namespace detail

//! A transport between the replicas of a data-parallel job. Comm::space is the memory
//! its collectives read and write; every call is made by every rank, in the same order
//! (a collective's sequence number names it in errors).
//!   all_reduce(exec, data, op)     in place, element-wise over ranks (float, half, bfloat16)
//!   broadcast(exec, data, root)    root's bytes into every rank's tensor
//!   all_gather_values(values)      each rank's few host doubles, rank after rank (host memory)
//!   all_reduce_values(values, op)  a few host doubles (metrics), in place
//!   barrier()
template <class C>
concept communicator = requires(C& c, tensor_ref<typename C::space> data, std::span<double> values,
                                std::span<double const> mine) {
  typename C::space;
  typename C::executor_type;
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.all_reduce(std::declval<typename C::executor_type const&>(), data, reduce_op::sum);
  c.broadcast(std::declval<typename C::executor_type const&>(), data, 0);
  { c.all_gather_values(mine) } -> std::same_as<std::vector<double>>;
  c.all_reduce_values(values, reduce_op::sum);
  c.barrier();
};

namespace detail {

//! "ranks 1 and 3", "rank 2": for messages.
inline std::string rank_list(std::vector<int> const& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i) out += i + 1 == ranks.size() ? " and " : ", ";
    out += std::to_string(ranks[i]);
  }
  return out;
}

//! A floating value's bits as an unsigned key whose integer order is the value's order,
//! -inf < ... < -0 < +0 < ... < +inf, with every NaN above +inf: a NaN's sign bit is
//! cleared first (a "-NaN" would otherwise rank lowest), its payload orders NaNs among
//! themselves. The integer max of keys is then a float max that keeps NaN, which a
//! transport's own float max need not be (NCCL's ncclMax keeps the other operand).
//! Positive values get the sign bit set, negative ones all bits flipped (larger
//! magnitudes, smaller keys). `negated` makes the key of -x: min(x) = -max(-x), NaN
//! still kept. For half, bfloat16, float and double (16-, 32- and 64-bit keys).
template <class T>
MPX_HD constexpr bits_t<T> nan_keeping_max_key(T x, bool negated = false) noexcept {
  using B = bits_t<T>;
  constexpr B sign = B(B(1) << (8 * sizeof(T) - 1));
  B b = bit_cast<B>(x);
  if (negated) b = B(b ^ sign);
  bool nan = false;
  if constexpr (std::is_same_v<T, double>) nan = x != x;
  else nan = is_nan(x);
  if (nan) b = B(b & B(~sign));
  return (b & sign) ? B(~b) : B(b | sign);
}

//! The value of a nan_keeping_max_key (a NaN comes back with its sign bit cleared, or
//! set when `negated`).
template <class T>
MPX_HD constexpr T from_nan_keeping_max_key(bits_t<T> key, bool negated = false) noexcept {
  using B = bits_t<T>;
  constexpr B sign = B(B(1) << (8 * sizeof(T) - 1));
  B b = (key & sign) ? B(key ^ sign) : B(~key);
  if (negated) b = B(b ^ sign);
  return bit_cast<T>(b);
}

//! The dtypes a gradient all-reduce carries.
inline void require_reducible(std::string_view op, dtype_id d) {
  if (d != dtype_id::float32 && d != dtype_id::float16 && d != dtype_id::bfloat16)
    fail<invalid_argument>(op, "all-reduces float, half and bfloat16 tensors, not " + std::string(to_string(d)));
}

}  // namespace detail

}  // namespace mpx
