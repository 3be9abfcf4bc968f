// mpx::transform, the executor's dispatch for elements of same-shaped tensors:
// out[i] = op(ins[i]...), one MPX_HD op for both executors. The host loops over the
// elements (or the op's whole-array host_span); the GPU runs CCCL's
// cub::DeviceTransform on the executor's stream, for any size and alignment. The
// element-wise algorithms built on it (fill, cast, scale, axpy) are in
// kernels/elementwise.hpp.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/host_threads.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/tensor.hpp>

#if MPX_HAS_CUDA
#include <cub/device/device_transform.cuh>
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
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
// CCCL's cub::DeviceTransform, which thrust::transform also uses: it may write in place,
// needs no scratch, can be captured in a CUDA graph, and picks its loading scheme at run
// time (vector loads, or Hopper's bulk copies), once per process for the first device.
template <class Op, class Out, class... Ins>
void cuda_transform(cudaStream_t stream, std::size_t n, Op const& op, Out* out, Ins const*... ins) {
  cudaError_t const status =
      cub::DeviceTransform::Transform(::cuda::std::make_tuple(ins...), out, static_cast<std::int64_t>(n), op, stream);
  MPX_CUDA_CHECK_LAUNCH("cub::DeviceTransform (mpx::transform)");  // as every kernel's launch: names a missing image
  check_cuda(status, "cub::DeviceTransform::Transform", __FILE__, __LINE__);  // its cached set-up's failure too
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
