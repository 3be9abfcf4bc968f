// The executor's dispatch for a reduction over items, each of which may also write its
// own outputs: the losses (an item is an element, whose gradient it writes, or a row of
// logits, handled by lanes). The total is combined in a fixed order of two levels, the
// same on every GPU and on the host:
//   1. blocks = min(ceil(items / items per block), max_item_blocks); thread (or warp)
//      k of block b folds items k, k + stride, ... in order; the block combines its
//      threads as block_all_reduce does and writes partials[b];
//   2. one block of 256 threads folds the partials the same way and hands the total to
//      `finish` (an MPX_HD callable run once: it stores the result where it belongs).
// The host computes every item in order, then combines their values in exactly that
// order (exec/lanes.hpp's emulation), so a loss has the same bits on the host as on any
// GPU, up to the last bit of exp and log. No allocation on the GPU: the caller gives the
// partials (max_item_blocks of them), so a CUDA graph can capture the reduction.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/host_scratch.hpp>
#include <mpx/exec/lanes.hpp>
#include <mpx/exec/launch.hpp>

#include <algorithm>
#include <cstddef>
#include <type_traits>

namespace mpx::detail {

//! At most this many first-level blocks (and partials). Fixed, not sized to the device,
//! so the order of the sums, and with it the result, does not depend on the GPU.
inline constexpr std::size_t max_item_blocks = 1024;
inline constexpr int item_block_threads = 256;
inline constexpr std::size_t rows_per_item_block = item_block_threads / warp_size;

//! What an item is: an element (a thread each) or a row (a warp each, with lanes).
enum class item_kind { element, row };

template <item_kind Kind>
constexpr std::size_t items_per_block() noexcept {
  return Kind == item_kind::element ? std::size_t{item_block_threads} : rows_per_item_block;
}

//! The first level's block count for n items.
template <item_kind Kind>
constexpr std::size_t item_blocks(std::size_t n) noexcept {
  std::size_t const wanted = (n + items_per_block<Kind>() - 1) / items_per_block<Kind>();
  return std::max<std::size_t>(1, std::min(wanted, max_item_blocks));
}

#if MPX_HAS_CUDA
template <item_kind Kind, class Op, class Body>
__global__ void __launch_bounds__(item_block_threads)
    reduce_items_kernel(Body body, Op op, std::size_t n, typename Op::value_type* __restrict__ partials) {
  using T = typename Op::value_type;
  T acc = Op::identity();
  if constexpr (Kind == item_kind::element) {
    std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
    for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
      acc = op(acc, body(i));
  } else {
    device_lanes<warp_size> const lanes{static_cast<int>(threadIdx.x & 31u)};
    std::size_t const stride = static_cast<std::size_t>(gridDim.x) * rows_per_item_block;
    for (std::size_t r = static_cast<std::size_t>(blockIdx.x) * rows_per_item_block + (threadIdx.x >> 5); r < n;
         r += stride)
      acc = op(acc, body(lanes, r));
    if (lanes.lane != 0) acc = Op::identity();  // a row's value counts once, from lane 0
  }
  acc = block_all_reduce(acc, op);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

template <class Op, class Finish>
__global__ void __launch_bounds__(item_block_threads)
    finish_items_kernel(Op op, typename Op::value_type const* __restrict__ partials, unsigned count, Finish finish) {
  using T = typename Op::value_type;
  T acc = Op::identity();
  for (unsigned i = threadIdx.x; i < count; i += item_block_threads) acc = op(acc, partials[i]);
  acc = block_all_reduce(acc, op);
  if (threadIdx.x == 0) finish(acc);
}
#endif

//! The host's per-thread (per-warp) accumulators (host_scratch).
struct item_accumulators {};

//! The host's emulation of both levels: item i goes to the accumulator of the GPU
//! thread (or warp) that folds it, i % stride, in increasing order as there; then each
//! block's threads are combined as block_all_reduce does, then the partials as the
//! finishing block does.
template <item_kind Kind, class Op, class Items>
typename Op::value_type host_reduce_items(Op op, std::size_t n, Items const& item, typename Op::value_type* partials) {
  using T = typename Op::value_type;
  std::size_t const blocks = item_blocks<Kind>(n);
  constexpr std::size_t per_block = items_per_block<Kind>();
  std::size_t const stride = blocks * per_block;
  T* acc = host_scratch<T, item_accumulators, 0>(stride);  // at most 262,144 values
  for (std::size_t k = 0; k < stride; ++k) acc[k] = Op::identity();
  for (std::size_t i = 0; i < n; ++i) acc[i % stride] = op(acc[i % stride], item(i));
  T slot[item_block_threads];
  for (std::size_t b = 0; b < blocks; ++b) {
    for (int t = 0; t < item_block_threads; ++t) slot[t] = Op::identity();
    for (std::size_t k = 0; k < per_block; ++k)  // a row's value sits at its warp's lane 0
      slot[Kind == item_kind::element ? k : k * warp_size] = acc[b * per_block + k];
    partials[b] = host_block_all_reduce<item_block_threads>(slot, op);
  }
  for (int t = 0; t < item_block_threads; ++t) {
    T total = Op::identity();
    for (std::size_t i = static_cast<std::size_t>(t); i < blocks; i += item_block_threads) total = op(total, partials[i]);
    slot[t] = total;
  }
  return host_block_all_reduce<item_block_threads>(slot, op);
}

//! Calls body on each of n items (body(i) for elements, body(lanes, r) for rows; each
//! returns its value as Op::value_type and may write its own outputs), combines the
//! values with op in the fixed order above, and calls finish(total) once. `partials`:
//! max_item_blocks values in the executor's memory. Asynchronous on a cuda_executor.
//! A row body's lanes count its columns in 32 bits: the caller keeps them at most
//! max_row_cols (as for_each_row does).
template <item_kind Kind, executor Exec, class Op, class Body, class Finish>
void reduce_items([[maybe_unused]] Exec const& exec, std::size_t n, Op op, Body const& body, Finish const& finish,
                  typename Op::value_type* partials) {
  static_assert(std::is_trivially_copyable_v<Body> && std::is_trivially_copyable_v<Finish>,
                "mpx: a body is copied to the GPU: pointers and sizes only");
  if constexpr (is_host_executor_v<Exec>) {
    if constexpr (Kind == item_kind::element) {
      finish(host_reduce_items<Kind>(op, n, body, partials));
    } else {
      host_lanes<warp_size> const lanes{};
      finish(host_reduce_items<Kind>(op, n, [&](std::size_t r) { return body(lanes, r); }, partials));
    }
  } else {
#if MPX_HAS_CUDA
    auto const blocks = static_cast<unsigned>(item_blocks<Kind>(n));
    reduce_items_kernel<Kind><<<blocks, item_block_threads, 0, exec.stream()>>>(body, op, n, partials);
    check_dispatch_launch<Body>("mpx::reduce_items_kernel", __FILE__, __LINE__);
    finish_items_kernel<<<1, item_block_threads, 0, exec.stream()>>>(op, partials, blocks, finish);
    check_dispatch_launch<Finish>("mpx::finish_items_kernel", __FILE__, __LINE__);
#else
    kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace mpx::detail
