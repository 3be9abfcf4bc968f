// The executor's dispatch for the two simplest shapes of work, so an operation is one
// MPX_HD body and the loop or launch lives here, once (public: user code writes its own
// operations the same way; docs/writing_operations.md):
//   for_each_index(exec, n, body)        body(i) for every i in [0, n): elements, gathers,
//                                        permutations (a grid-stride loop on the GPU);
//   for_each_row(exec, rows, cols, body) body(lanes, r) for every row r, with the lanes
//                                        of exec/lanes.hpp (a warp per row up to 1024
//                                        columns, a block of 512 beyond; the host
//                                        emulates the same lanes in the same order).
// Both are asynchronous on a cuda_executor. Bodies are trivially copyable values (they
// travel to the GPU as kernel arguments): pointers and sizes, no tensors.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/host_threads.hpp>
#include <mpx/exec/lanes.hpp>
#include <mpx/exec/launch.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

namespace mpx::detail {

//! A tensor seen as rows along its last axis.
struct row_shape {
  std::size_t rows = 0, cols = 0;
};

//! x as rows along its last axis; a rank-0 x is a shape_error, a row longer than the
//! lanes count (max_row_cols) an invalid_argument, both before anything is read.
inline row_shape last_axis_rows(std::string_view op, shape const& x) {
  if (x.rank() < 1) fail<shape_error>(op, "expects a tensor of rank 1 or more, got shape " + x.to_string());
  row_shape s;
  s.cols = static_cast<std::size_t>(x[x.rank() - 1]);
  s.rows = s.cols ? x.size() / s.cols : 0;
  if (s.cols > max_row_cols) fail<invalid_argument>(op, "rows of more than 2^31 - 1025 elements are not supported");
  return s;
}

//! The name of type T as the compiler spells it ("mpx::detail::softmax_row<false, __half,
//! float>"), for messages.
template <class T>
std::string type_name() {
  std::string_view const f = __PRETTY_FUNCTION__;  // "... [with T = NAME; ...]" or "[with T=NAME]"
  std::size_t begin = f.find("T = ");
  begin = begin == std::string_view::npos ? f.find("T=") : begin;
  if (begin == std::string_view::npos) return std::string(f);
  begin = f.find('=', begin) + 1;
  while (begin < f.size() && f[begin] == ' ') ++begin;
  std::size_t const end = f.find_first_of(";]", begin);
  return std::string(f.substr(begin, end == std::string_view::npos ? f.npos : end - begin));
}

#if MPX_HAS_CUDA_RUNTIME
//! MPX_CUDA_CHECK_LAUNCH for a dispatch kernel: a failure names the kernel and the body it
//! ran ("mpx::rows_by_warp_kernel running mpx::detail::softmax_row<...>"), so the message
//! says which operation it was. The name is only made when something failed.
template <class Body>
void check_dispatch_launch(char const* kernel, char const* file, int line) {
  if (cudaPeekAtLastError() == cudaSuccess) return;
  std::string const what = std::string(kernel) + " running " + type_name<Body>();
  check_launch(what.c_str(), file, line, MPX_BUILT_ARCHITECTURES);
}
#endif
#if MPX_HAS_CUDA
template <class Index, class Body>
__global__ void __launch_bounds__(block_size) for_each_index_kernel(Body body, Index n) {
  Index const stride = static_cast<Index>(gridDim.x) * blockDim.x;
  for (Index i = static_cast<Index>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) body(i);
}

template <class Body>
__global__ void run_once_kernel(Body body) {
  body();
}

// Each thread folds its indices' values; the block's total goes to `into` from one thread.
template <class Op, class Body, class Into>
__global__ void __launch_bounds__(block_size) for_each_index_into_kernel(Body body, Op op, std::size_t n, Into into) {
  using T = typename Op::value_type;
  T acc = Op::identity();
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    acc = op(acc, body(i));
  acc = block_all_reduce(acc, op);
  if (threadIdx.x == 0) into(acc);
}

inline constexpr int rows_per_warp_block = block_size / warp_size;  // 8 rows of a warp each

// Rows by warps in a grid-stride loop over rows: the loop is uniform in a warp, so
// every lane of a row takes part in its reductions.
template <class Body>
__global__ void __launch_bounds__(block_size) rows_by_warp_kernel(Body body, std::size_t rows) {
  device_lanes<warp_size> const lanes{static_cast<int>(threadIdx.x & 31u)};
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * rows_per_warp_block;
  for (std::size_t r = static_cast<std::size_t>(blockIdx.x) * rows_per_warp_block + (threadIdx.x >> 5); r < rows;
       r += stride)
    body(lanes, r);
}

// Rows by whole blocks, for rows longer than a warp serves well.
template <class Body>
__global__ void __launch_bounds__(block_row_lanes) rows_by_block_kernel(Body body, std::size_t rows) {
  device_lanes<block_row_lanes> const lanes{static_cast<int>(threadIdx.x)};
  for (std::size_t r = blockIdx.x; r < rows; r += gridDim.x) body(lanes, r);
}
#endif

//! Runs check() on the host executor only. Arguments the host can read without a copy
//! (token ids, labels) are validated there before anything is written; on a GPU the
//! kernel flags them instead (a NaN, a zero row, a recorded index), since checking them
//! first would cost a copy and a synchronisation every step.
template <executor Exec, class Check>
void check_on_host(Exec const&, Check&& check) {
  if constexpr (is_host_executor_v<Exec>) check();
}

//! *counter += v from a body that runs on many indices at once: an atomic add on the
//! GPU and on the host's threads (exec/host_threads.hpp). Atomic on every host build, so
//! translation units compiled with and without -fopenmp agree on what it does.
MPX_HD inline void add_to_count(unsigned* counter, unsigned v) noexcept {
#if MPX_DEVICE_PASS
  atomicAdd(counter, v);
#else
  __atomic_fetch_add(counter, v, __ATOMIC_RELAXED);  // also where this file has no OpenMP: another may
#endif
}

//! body() once where the executor computes, in stream order on the GPU (one thread): the
//! small updates of state that lives on the executor (a step count, a loss scale, an
//! fp8 scale), so a step never waits for the host.
template <executor Exec, class Body>
void run_once([[maybe_unused]] Exec const& exec, Body const& body) {
  static_assert(std::is_trivially_copyable_v<Body>, "mpx: a body is copied to the GPU: pointers and sizes only");
  if constexpr (is_host_executor_v<Exec>) {
    body();
  } else {
#if MPX_HAS_CUDA
    run_once_kernel<<<1, 1, 0, exec.stream()>>>(body);
    check_dispatch_launch<Body>("mpx::run_once_kernel", __FILE__, __LINE__);
#else
    kernels_need_nvcc<Exec>();
#endif
  }
}

//! *target = max(*target, v) from a body that runs on many indices at once: an atomic
//! max on the GPU and on the host's threads (on every host build, as add_to_count).
MPX_HD inline void max_into(unsigned* target, unsigned v) noexcept {
#if MPX_DEVICE_PASS
  atomicMax(target, v);
#else
  unsigned current = __atomic_load_n(target, __ATOMIC_RELAXED);
  while (current < v && !__atomic_compare_exchange_n(target, &current, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
#endif
}

//! A body that takes its index as a template (body(std::uint32_t) or body(std::size_t))
//! and says the largest index it reaches in any array (largest_index()): where that and
//! the grid-stride loop fit 32 bits, the GPU counts in 32 bits (a gather's divisions are
//! its cost; 64-bit ones take several times longer).
template <class Body>
concept narrow_index_body = requires(Body const& body) {
  { body.largest_index() } -> std::convertible_to<std::size_t>;
};

//! A body whose host loop is faster written as a whole (a 16-bit row widened and rounded
//! at once): body.host_loop() must do, element for element, what body(i) does.
template <class Body>
concept has_host_loop = requires(Body const& body) { body.host_loop(); };

//! Whether the host executor may run a body's host_loop (yes, unless turned off on this
//! thread). The tests turn it off to run on the host the element bodies the GPU runs,
//! and check that both give the same bits.
inline bool& host_loops_enabled() noexcept {
  thread_local bool enabled = true;
  return enabled;
}

}  // namespace mpx::detail

namespace mpx {

//! body(i) for every i in [0, n): on the host a contiguous range per thread
//! (exec/host_threads.hpp; or body.host_loop()), on the GPU a grid-stride loop; so the
//! body must not depend on the order, and must write only its own element.
template <executor Exec, class Body>
void for_each_index([[maybe_unused]] Exec const& exec, std::size_t n, Body const& body) {
  static_assert(std::is_trivially_copyable_v<Body>, "mpx: a body is copied to the GPU: pointers and sizes only");
  if (n == 0) return;
  if constexpr (is_host_executor_v<Exec>) {
    if constexpr (detail::has_host_loop<Body>) {
      if (detail::host_loops_enabled()) return body.host_loop();
    }
    detail::host_parallel_ranges(n, n, [&](std::size_t begin, std::size_t end) {
      for (std::size_t i = begin; i < end; ++i) body(i);
    }, 64);
  } else {
#if MPX_HAS_CUDA
    unsigned const grid = detail::grid_for(n);
    bool narrow = false;
    if constexpr (detail::narrow_index_body<Body>)
      narrow = detail::fits_32_bit_grid_stride(n, std::max<std::size_t>(n, body.largest_index()), grid);
    if (narrow)
      detail::for_each_index_kernel<<<grid, detail::block_size, 0, exec.stream()>>>(body, static_cast<std::uint32_t>(n));
    else
      detail::for_each_index_kernel<<<grid, detail::block_size, 0, exec.stream()>>>(body, n);
    detail::check_dispatch_launch<Body>("mpx::for_each_index_kernel", __FILE__, __LINE__);
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

//! body(lanes, r) for every row r in [0, rows) of `cols` columns (see exec/lanes.hpp).
//! cols is at most detail::max_row_cols (2^31 - 1025; more is an mpx::invalid_argument),
//! and so must be every n the body gives lanes.reduce or lanes.for_each (the GPU's lanes
//! count in 32 bits; the body keeps its own n within cols or checks it). Every lane of a
//! row must reach each lanes.reduce: not under a condition that depends on the lane,
//! nor inside lanes.for_each or lanes.once (on the GPU that deadlocks a block's row).
template <executor Exec, class Body>
void for_each_row([[maybe_unused]] Exec const& exec, std::size_t rows, std::size_t cols, Body const& body) {
  static_assert(std::is_trivially_copyable_v<Body>, "mpx: a body is copied to the GPU: pointers and sizes only");
  if (cols > detail::max_row_cols)
    detail::fail<invalid_argument>("for_each_row", "rows of more than 2^31 - 1025 elements are not supported");
  if (rows == 0) return;
  bool const by_warp = detail::lanes_for_row(cols) == detail::warp_size;
  if constexpr (is_host_executor_v<Exec>) {
    detail::host_parallel_ranges(rows, rows * cols, [&](std::size_t begin, std::size_t end) {
      if (by_warp) {
        detail::host_lanes<detail::warp_size> const lanes{};
        for (std::size_t r = begin; r < end; ++r) body(lanes, r);
      } else {
        detail::host_lanes<detail::block_row_lanes> const lanes{};
        for (std::size_t r = begin; r < end; ++r) body(lanes, r);
      }
    });
  } else {
#if MPX_HAS_CUDA
    if (by_warp) {
      unsigned const grid = detail::grid_for(rows * detail::warp_size);
      detail::rows_by_warp_kernel<<<grid, detail::block_size, 0, exec.stream()>>>(body, rows);
      detail::check_dispatch_launch<Body>("mpx::rows_by_warp_kernel", __FILE__, __LINE__);
    } else {
      std::size_t const blocks = std::min<std::size_t>(rows, static_cast<std::size_t>(detail::sm_count()) * 4);
      unsigned const grid = static_cast<unsigned>(blocks);
      detail::rows_by_block_kernel<<<grid, detail::block_row_lanes, 0, exec.stream()>>>(body, rows);
      detail::check_dispatch_launch<Body>("mpx::rows_by_block_kernel", __FILE__, __LINE__);
    }
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

//! As for_each_index, where body(i) also returns a value: the values are combined with
//! op, per block on the GPU (each block's result handed to into(result), which must
//! combine it atomically: detail::max_into, detail::add_to_count), over all of [0, n)
//! on the host (into called once). For an op whose result does not depend on the order
//! (a maximum, an integer sum): an fp8 cast's amax. Asynchronous on a cuda_executor.
template <executor Exec, class Op, class Body, class Into>
void for_each_index_into([[maybe_unused]] Exec const& exec, std::size_t n, Op op, Body const& body,
                         Into const& into) {
  static_assert(std::is_trivially_copyable_v<Body> && std::is_trivially_copyable_v<Into>,
                "mpx: a body is copied to the GPU: pointers and sizes only");
  if (n == 0) return;
  if constexpr (is_host_executor_v<Exec>) {
    typename Op::value_type acc = Op::identity();
    for (std::size_t i = 0; i < n; ++i) acc = op(acc, body(i));
    into(acc);
  } else {
#if MPX_HAS_CUDA
    detail::for_each_index_into_kernel<<<detail::grid_for(n), detail::block_size, 0, exec.stream()>>>(body, op, n,
                                                                                                       into);
    detail::check_dispatch_launch<Body>("mpx::for_each_index_into_kernel", __FILE__, __LINE__);
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

//! The combining operations a row body's lanes.reduce takes (exec/lanes.hpp).
using lane_sum = detail::sum_float;            //!< float sum
using lane_max = detail::max_float;            //!< float maximum that keeps NaN
using lane_sum_pair = detail::sum_float_pair;  //!< two float sums at once (a float_pair)
using detail::float_pair;

}  // namespace mpx
