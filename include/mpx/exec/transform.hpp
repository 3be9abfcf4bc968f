// mpx::transform, the executor's dispatch for elements of same-shaped tensors:
// out[i] = op(ins[i]...), one MPX_HD op for both executors. The host loops over the
// elements (or the op's whole-array host_span); the GPU reads and writes 16 bytes per
// access where the pointers allow, with a scalar head and tail for any size and
// alignment. The element-wise algorithms built on it (fill, cast, scale, axpy) are in
// kernels/elementwise.hpp.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/host_threads.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/tensor.hpp>

#include <algorithm>
#include <cstddef>
#include <type_traits>

namespace mpx {

namespace detail {

//! An op with a faster host loop over whole arrays (a cast with F16C): op.host_span(n,
//! out, ins...) must give, element for element, op's bits.
template <class Op, class Out, class... Ins>
concept has_host_span = requires(Op const& op, std::size_t n, Out* out, Ins const*... ins) {
  op.host_span(n, out, ins...);
};

//! Whether a host transform runs as a whole-array conversion (mpx's: the casts between
//! float and a 16-bit type, ops::cast_to's host_span).
template <class Op, class Out, class... Ins>
inline constexpr bool is_span_cast = has_host_span<Op, Out, Ins...>;

// On the host's threads, 64 elements aligned per range (whole cache lines and vectors).
template <class Op, class Out, class... Ins>
void host_transform(std::size_t n, Op const& op, Out* out, Ins const*... ins) {
  bool const span = is_span_cast<Op, Out, Ins...> && host_loops_enabled();
  host_parallel_ranges(
      n, n,
      [&](std::size_t begin, std::size_t end) {
        if constexpr (is_span_cast<Op, Out, Ins...>) {
          if (span) return op.host_span(end - begin, out + begin, (ins + begin)...);
        }
        for (std::size_t i = begin; i < end; ++i) out[i] = op(ins[i]...);
      },
      64);
}

#if MPX_HAS_CUDA
template <int Width, class Op, class Out, class... Ins>
__device__ __forceinline__ void transform_vector(Op const& op, Out* out, Ins const*... ins) {
  aligned_vector<Out, Width> result;
  [&](auto const&... inputs) {
#pragma unroll
    for (int k = 0; k < Width; ++k) result.v[k] = op(inputs.v[k]...);
  }(*reinterpret_cast<aligned_vector<Ins, Width> const*>(ins)...);
  *reinterpret_cast<aligned_vector<Out, Width>*>(out) = result;
}

// One launch covers the scalar head (until every pointer is aligned), the vectorised
// body in a grid-stride loop, and the scalar tail. mpx's own kernel, not CCCL's
// cub::DeviceTransform (which would serve: in place allowed, no scratch, capturable):
// DeviceTransform compiles every loading scheme it may pick at run time, and that cost
// examples/user_kernel's unit 1.9 s of nvcc time (9.2 -> 11.1 s, over its 8 s budget);
// bench/NOTES.md, "Thrust for the standalone checks", has the figures.
template <int Width, class Op, class Out, class... Ins>
__global__ void __launch_bounds__(block_size)
    transform_kernel(vector_split split, Op op, Out* out, Ins const*... ins) {  // out may be an input
  std::size_t const tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  if (tid < split.head) out[tid] = op(ins[tid]...);
  for (std::size_t v = tid; v < split.vectors; v += stride) {
    std::size_t const base = split.head + v * Width;
    transform_vector<Width>(op, out + base, (ins + base)...);
  }
  if (tid < split.tail) {
    std::size_t const i = split.head + split.vectors * Width + tid;
    out[i] = op(ins[i]...);
  }
}

template <class Op, class Out, class... Ins>
void cuda_transform(cudaStream_t stream, std::size_t n, Op const& op, Out* out, Ins const*... ins) {
  constexpr int width = vector_width<Out, Ins...>;
  vector_split split;
  if (split_for_vectors<width>(n, split, out, ins...)) {
    unsigned const grid = grid_for(std::max({split.vectors, split.head, split.tail}));
    transform_kernel<width><<<grid, block_size, 0, stream>>>(split, op, out, ins...);
  } else {
    split = {0, n, 0};  // pointers misaligned relative to each other: scalar accesses
    transform_kernel<1><<<grid_for(n), block_size, 0, stream>>>(split, op, out, ins...);
  }
  MPX_CUDA_CHECK_LAUNCH("mpx::transform_kernel");
}
#endif

}  // namespace detail

//! out[i] = op(ins[i]...) for every element. All tensors must have out's shape (else
//! mpx::shape_error) and live where the executor computes (else a compile error); out
//! may be one of the inputs, element for element, but may not overlap one otherwise
//! (mpx::invalid_argument). `op` is an MPX_HD functor (or an __device__ __host__
//! lambda under nvcc's --extended-lambda). Asynchronous on a cuda_executor.
template <executor Exec, tensor_like Out, class Op, tensor_like... Ins>
void transform([[maybe_unused]] Exec const& exec, Out&& out, Op op, Ins&&... ins) {
  auto o = mpx::view(out);
  detail::require_access<Exec, space_t<Out>, space_t<Ins>...>();
  static_assert(!std::is_const_v<typename decltype(o)::element_type>, "mpx::transform: the output is const");
  (detail::require_same_shape("transform", mpx::view(ins).shape(), o.shape()), ...);
  (detail::require_in_place_or_disjoint("transform", o, mpx::view(ins)), ...);
  if (o.empty()) return;
  if constexpr (is_host_executor_v<Exec>) {
    detail::host_transform(o.size(), op, o.data(), mpx::view(ins).data()...);
  } else {
#if MPX_HAS_CUDA
    detail::cuda_transform(exec.stream(), o.size(), op, o.data(), mpx::view(ins).data()...);
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace mpx
