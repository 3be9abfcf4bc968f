// Copies between tensors in any pair of memory spaces, and the two conveniences
// to_host and to_device. Host-to-host copies run on the host_executor; anything that
// touches device memory runs on a cuda_executor's stream.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

namespace mpx {

namespace detail {
//! The copy rule of both executors: src and dst are the same memory (nothing to do) or
//! disjoint. cudaMemcpyAsync leaves overlapping ranges undefined, so a partial overlap
//! is refused everywhere rather than moved like memmove on the host only. Addresses are
//! compared as numbers: under unified addressing a host and a device range never meet.
inline bool copy_needed(void const* src, void* dst, std::size_t bytes) {
  auto const s = reinterpret_cast<std::uintptr_t>(src), d = reinterpret_cast<std::uintptr_t>(dst);
  if (s == d) return false;
  if (s < d + bytes && d < s + bytes)
    fail<invalid_argument>("copy", "the source and the destination overlap in memory (" + std::to_string(bytes) +
                                       " bytes, " + std::to_string(s < d ? d - s : s - d) +
                                       " bytes apart); copy through a separate buffer");
  return true;
}
}  // namespace detail

//! Copies src into dst (same shape, same element type). On a cuda_executor the copy is
//! enqueued on its stream; a copy from pageable host memory returns once the data is
//! staged, so src may be reused at once. src and dst are the same elements (a no-op) or
//! do not overlap: mpx::invalid_argument otherwise, on every executor.
template <executor Exec, tensor_like Src, tensor_like Dst>
void copy([[maybe_unused]] Exec const& exec, Src&& src, Dst&& dst) {
  auto s = mpx::view(src);
  auto d = mpx::view(dst);
  static_assert(std::is_same_v<value_t<Src>, value_t<Dst>>,
                "mpx::copy copies elements of one type; convert with mpx::cast(exec, src, dst)");
  static_assert(!std::is_const_v<typename decltype(d)::element_type>, "mpx::copy: the destination is const");
  detail::require_same_shape("copy", "src", s.shape(), "dst", d.shape());
  if (s.empty()) return;
  if (!detail::copy_needed(s.data(), d.data(), s.size_bytes())) return;
  if constexpr (is_host_executor_v<Exec>) {
    detail::require_access<Exec, space_t<Src>, space_t<Dst>>();
    std::memcpy(d.data(), s.data(), s.size_bytes());
  } else {
#if MPX_HAS_CUDA_RUNTIME
    MPX_CUDA_CHECK(cudaMemcpyAsync(d.data(), s.data(), s.size_bytes(), cudaMemcpyDefault, exec.stream()));
#endif
  }
}

//! A host copy of x. On a cuda_executor this synchronises the stream.
template <executor Exec, tensor_like X>
tensor<value_t<X>, host_space> to_host(Exec const& exec, X&& x) {
  auto v = mpx::view(x);
  tensor<value_t<X>, host_space> out(v.shape());
  copy(exec, v, out);
  exec.synchronize();
  return out;
}

#if MPX_HAS_CUDA_RUNTIME
//! A device copy of x, enqueued on the executor's stream.
template <tensor_like X>
tensor<value_t<X>, device_space> to_device(cuda_executor const& exec, X&& x) {
  auto v = mpx::view(x);
  tensor<value_t<X>, device_space> out(exec, v.shape());
  copy(exec, v, out);
  return out;
}
#endif

namespace detail {

//! rows x count elements from src (rows `src_pitch` elements apart) to dst (`dst_pitch`
//! apart), both in the executor's memory: one cudaMemcpy2DAsync on its stream.
template <class Exec, class T>
void copy_strided_rows([[maybe_unused]] Exec const& exec, T const* src, std::int64_t src_pitch, T* dst,
                       std::int64_t dst_pitch, std::int64_t rows, std::int64_t count) {
  if (rows == 0 || count == 0) return;
  if constexpr (is_host_executor_v<Exec>) {
    for (std::int64_t r = 0; r < rows; ++r)
      std::memcpy(dst + r * dst_pitch, src + r * src_pitch, static_cast<std::size_t>(count) * sizeof(T));
  } else {
#if MPX_HAS_CUDA_RUNTIME
    MPX_CUDA_CHECK(cudaMemcpy2DAsync(dst, static_cast<std::size_t>(dst_pitch) * sizeof(T), src,
                                     static_cast<std::size_t>(src_pitch) * sizeof(T),
                                     static_cast<std::size_t>(count) * sizeof(T), static_cast<std::size_t>(rows),
                                     cudaMemcpyDeviceToDevice, exec.stream()));
#endif
  }
}

}  // namespace detail

}  // namespace mpx
