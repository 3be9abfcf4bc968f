// mpx::transform_reduce: map every element to an accumulator and combine them, on any
// executor, deterministically. The CUDA path is one pass over the data (16-byte loads,
// per-thread accumulation, a block reduction to one partial per block) and one block
// that combines the partials in a fixed order; the grid depends only on the size and the
// device, so the result is the same run after run. (The second stage is a block, not
// cub::DeviceReduce: there are at most a few thousand partials, and DeviceReduce's
// dispatch machinery cost every user translation unit that includes this header about
// two seconds of compile time. The block reductions are block_all_reduce, the one the
// row bodies' lanes use, not cub::BlockReduce, whose header alone costs a translation
// unit about 3.5 s under nvcc: each runs once per block, where its speed does not show.)
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/lanes.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/memory_space.hpp>
#include <mpx/exec/tensor.hpp>

#include <cstddef>
#include <type_traits>

namespace mpx {

namespace detail {

// Host: combine fixed-size chunks, then the chunks, so a float sum of n values carries
// the rounding of about n / 1024 + 1024 additions rather than n.
template <class T, class Acc, class Map, class Combine>
Acc host_transform_reduce(T const* x, std::size_t n, Acc identity, Map const& map, Combine const& combine) {
  constexpr std::size_t chunk = 1024;
  Acc total = identity;
  for (std::size_t begin = 0; begin < n; begin += chunk) {
    std::size_t const end = begin + chunk < n ? begin + chunk : n;
    Acc part = identity;
    for (std::size_t i = begin; i < end; ++i) part = combine(part, map(x[i]));
    total = combine(total, part);
  }
  return total;
}

#if MPX_HAS_CUDA
template <int Width, class T, class Acc, class Map, class Combine>
__global__ void __launch_bounds__(block_size)
    reduce_to_partials_kernel(T const* __restrict__ x, vector_split split, Acc identity, Map map, Combine combine,
                              Acc* __restrict__ partials) {
  std::size_t const tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  Acc acc = identity;
  if (tid < split.head) acc = combine(acc, map(x[tid]));
  for (std::size_t v = tid; v < split.vectors; v += stride) {
    auto const vec = *reinterpret_cast<aligned_vector<T, Width> const*>(x + split.head + v * Width);
#pragma unroll
    for (int k = 0; k < Width; ++k) acc = combine(acc, map(vec.v[k]));
  }
  if (tid < split.tail) acc = combine(acc, map(x[split.head + split.vectors * Width + tid]));
  Acc const block_total = block_all_reduce(acc, combine, identity);
  if (threadIdx.x == 0) partials[blockIdx.x] = block_total;
}

//! One block: *result = the combination of partials[0, count), thread i taking i,
//! i + block_size, ..., and block_all_reduce combining the threads in a fixed order.
template <class Acc, class Combine>
__global__ void __launch_bounds__(block_size)
    combine_partials_kernel(Acc const* __restrict__ partials, unsigned count, Acc identity, Combine combine,
                            Acc* __restrict__ result) {
  Acc acc = identity;
  for (unsigned i = threadIdx.x; i < count; i += block_size) acc = combine(acc, partials[i]);
  Acc const total = block_all_reduce(acc, combine, identity);
  if (threadIdx.x == 0) *result = total;
}

template <class T, class Acc, class Map, class Combine>
Acc cuda_transform_reduce(cudaStream_t stream, T const* x, std::size_t n, Acc identity, Map const& map,
                          Combine const& combine) {
  static_assert(std::is_trivially_copyable_v<Acc> && sizeof(Acc) % 4 == 0,
                "mpx::transform_reduce on a cuda_executor: the accumulator must be trivially copyable and a whole "
                "number of 32-bit words (warp shuffles carry it): pad a smaller one");
  constexpr int width = vector_width<T>;
  vector_split split;
  split_for_vectors<width>(n, split, x);  // one pointer: always splits
  unsigned const grid = grid_for(std::max({split.vectors, split.head, split.tail}), 4);

  // One stream-ordered scratch allocation: the partials and the result.
  buffer<Acc, device_space> scratch(static_cast<std::size_t>(grid) + 1, stream);
  Acc* partials = scratch.data();
  Acc* result = partials + grid;

  reduce_to_partials_kernel<width><<<grid, block_size, 0, stream>>>(x, split, identity, map, combine, partials);
  MPX_CUDA_CHECK_LAUNCH("mpx::reduce_to_partials_kernel");
  combine_partials_kernel<<<1, block_size, 0, stream>>>(partials, grid, identity, combine, result);
  MPX_CUDA_CHECK_LAUNCH("mpx::combine_partials_kernel");
  Acc host_result;
  MPX_CUDA_CHECK(cudaMemcpyAsync(&host_result, result, sizeof(Acc), cudaMemcpyDeviceToHost, stream));
  MPX_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host_result;
}
#endif

}  // namespace detail

//! combine(... combine(identity, map(x[0])) ..., map(x[n-1])) in an unspecified but fixed
//! order: `combine` must be associative and commutative up to rounding, and `identity`
//! its neutral element. Both are MPX_HD functors. On a cuda_executor this returns a host
//! value, so it synchronises the stream.
template <executor Exec, tensor_like X, class Acc, class Map, class Combine>
Acc transform_reduce([[maybe_unused]] Exec const& exec, X&& x, Acc identity, Map map, Combine combine) {
  auto v = mpx::view(x);
  detail::require_access<Exec, space_t<X>>();
  if (v.empty()) return identity;
  if constexpr (is_host_executor_v<Exec>) {
    return detail::host_transform_reduce(v.data(), v.size(), identity, map, combine);
  } else {
#if MPX_HAS_CUDA
    return detail::cuda_transform_reduce(exec.stream(), v.data(), v.size(), identity, map, combine);
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace mpx
