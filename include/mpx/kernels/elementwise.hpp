// Elementwise algorithms on any executor: a generic transform and fill, cast, scale
// and axpy built on it. Each op is one MPX_HD functor in mpx::ops that both executors
// apply; the CUDA path reads and writes 16 bytes per access where the pointers allow
// and handles any size and alignment with a scalar head and tail.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/convert_span.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/math.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/tensor.hpp>

#include <cstddef>
#include <type_traits>

namespace mpx {

namespace ops {

//! Every element becomes `value`.
template <class T>
struct fill_with {
  T value;
  MPX_HD T operator()() const noexcept { return value; }
};

//! Converts with mpx::cast (round to nearest even, overflow to inf).
template <class To>
struct cast_to {
  template <class From>
  MPX_HD To operator()(From x) const noexcept {
    return mpx::cast<To>(x);
  }
};

//! x * factor, computed in float and rounded once to T.
template <class T>
struct scale_by {
  float factor;
  MPX_HD T operator()(T x) const noexcept { return mpx::cast<T>(mpx::cast<float>(x) * factor); }
};

//! alpha * x + y, computed in float with one rounding (an FMA), then rounded to Y.
template <class Y>
struct axpy_with {
  float alpha;
  template <class X>
  MPX_HD Y operator()(X x, Y y) const noexcept {
    return mpx::cast<Y>(mpx::fma(alpha, mpx::cast<float>(x), mpx::cast<float>(y)));
  }
};

}  // namespace ops

namespace detail {

//! Whether a host transform is a cast from In to Out that the whole-array conversions
//! do (float to or from a 16-bit type; F16C for half).
template <class Op, class Out, class... Ins>
inline constexpr bool is_span_cast = false;
template <class Out, class In>
inline constexpr bool is_span_cast<ops::cast_to<Out>, Out, In> =
    (std::is_same_v<In, float> && dtype16<Out>) || (dtype16<In> && std::is_same_v<Out, float>);

template <class Op, class Out, class... Ins>
void host_transform(std::size_t n, Op const& op, Out* out, Ins const*... ins) {
  if constexpr (is_span_cast<Op, Out, Ins...>) {
    if constexpr (std::is_same_v<Out, float>) widen_span(ins..., out, n);
    else round_span(ins..., out, n);
  } else {
    for (std::size_t i = 0; i < n; ++i) out[i] = op(ins[i]...);
  }
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

//! Sets every element of x to value.
template <executor Exec, tensor_like X>
void fill(Exec const& exec, X&& x, value_t<X> value) {
  transform(exec, x, ops::fill_with<value_t<X>>{value});
}

//! dst[i] = mpx::cast<D>(src[i]): round to nearest even, overflow to ±inf, NaN kept.
template <executor Exec, tensor_like Src, tensor_like Dst>
void cast(Exec const& exec, Src&& src, Dst&& dst) {
  transform(exec, dst, ops::cast_to<value_t<Dst>>{}, src);
}

//! x[i] *= factor, in place, computed in float and rounded once.
template <executor Exec, tensor_like X>
void scale(Exec const& exec, X&& x, float factor) {
  transform(exec, x, ops::scale_by<value_t<X>>{factor}, x);
}

//! y[i] = alpha * x[i] + y[i], computed in float with one rounding, then rounded to y's type.
template <executor Exec, tensor_like X, tensor_like Y>
void axpy(Exec const& exec, float alpha, X&& x, Y&& y) {
  transform(exec, y, ops::axpy_with<value_t<Y>>{alpha}, x, y);
}

}  // namespace mpx
