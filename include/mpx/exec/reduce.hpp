// mpx::transform_reduce: map every element to an accumulator and combine them, on any
// executor, as one Thrust algorithm: thrust::transform_reduce under the executor's
// policy. On the host that is Thrust's sequential system over chunks of 1,024 elements,
// the chunks then combined in order (a float sum of n values carries the rounding of
// about n / 1024 + 1024 additions rather than n). On the GPU it is
// thrust::cuda::par_nosync on the executor's stream (cub::DeviceReduce underneath, whose
// grid depends only on the size and the device, so the result is the same run after
// run), its scratch taken from the stream's memory pool in the stream's order, and the
// result read back once, which waits for the stream.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/memory_space.hpp>
#include <mpx/exec/tensor.hpp>

#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/transform_reduce.h>
#if MPX_HAS_CUDA
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/system_error.h>
#endif

#include <algorithm>
#include <cstddef>
#include <type_traits>

namespace mpx {

namespace detail {

inline constexpr std::size_t host_reduce_chunk = 1024;

template <class T, class Acc, class Map, class Combine>
Acc host_transform_reduce(T const* x, std::size_t n, Acc identity, Map const& map, Combine const& combine) {
  auto const reduce_chunk = [&](std::size_t c) {
    std::size_t const begin = c * host_reduce_chunk;
    return thrust::transform_reduce(thrust::cpp::par, x + begin, x + std::min(n, begin + host_reduce_chunk), map,
                                    identity, combine);
  };
  std::size_t const chunks = (n + host_reduce_chunk - 1) / host_reduce_chunk;
  return thrust::transform_reduce(thrust::cpp::par, thrust::counting_iterator<std::size_t>(0),
                                  thrust::counting_iterator<std::size_t>(chunks), reduce_chunk, identity, combine);
}

#if MPX_HAS_CUDA
//! Thrust's temporary storage, from the stream's pool in the stream's order (what
//! mpx's own scratch uses), not a cudaMalloc and cudaFree per call.
struct stream_ordered_scratch {
  using value_type = char;
  cudaStream_t stream;
  char* allocate(std::ptrdiff_t bytes) {
    return buffer<char, device_space>(static_cast<std::size_t>(bytes), stream).release();
  }
  void deallocate(char* p, std::size_t) const noexcept { device_release{stream}(p); }
};

template <class T, class Acc, class Map, class Combine>
Acc cuda_transform_reduce(cudaStream_t stream, T const* x, std::size_t n, Acc identity, Map const& map,
                          Combine const& combine) {
  MPX_CUDA_CHECK_LAUNCH("mpx::transform_reduce");  // an earlier call's error, which Thrust would drop
  try {
    return thrust::transform_reduce(thrust::cuda::par_nosync(stream_ordered_scratch{stream}).on(stream), x, x + n,
                                    map, identity, combine);
  } catch (thrust::system_error const& e) {  // CUDA's failure, said as every other in mpx
    check_cuda(static_cast<cudaError_t>(e.code().value()), "thrust::transform_reduce (mpx::transform_reduce)",
               __FILE__, __LINE__);
    throw;
  }
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
  // Thrust would convert another type to Acc on the host and let CUB accumulate in a
  // wider one on the GPU: the two executors would round differently.
  static_assert(std::is_same_v<std::invoke_result_t<Map const&, typename decltype(v)::element_type const&>, Acc>,
                "mpx::transform_reduce: map must return the accumulator type (the type of identity)");
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
