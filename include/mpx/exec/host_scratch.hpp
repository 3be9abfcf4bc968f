// Float scratch for the host executor's kernels, kept from call to call on each thread,
// so a training step does not allocate (and page-fault) fresh buffers for every layer.
#pragma once

#include <mpx/core/convert_span.hpp>

#include <cstddef>
#include <type_traits>
#include <vector>

namespace mpx::detail {

//! At least n floats of scratch, for the calling thread, owned by (Tag, Slot). Each kernel
//! names its own Tag, so one that calls another (conv2d calls gemm) never gets a buffer
//! the other is using; a kernel that needs several buffers at once gives each its own
//! Slot (an enumerator, so the names say which is which). The pointer stays valid until
//! the same thread asks the same (Tag, Slot) for more than it holds. Contents are
//! unspecified.
template <class Tag, std::size_t Slot>
float* host_scratch_floats(std::size_t n) {
  static_assert(sizeof(Tag) > 0, "a scratch tag is a complete type");
  thread_local std::vector<float> buffer;  // one per (Tag, Slot) instantiation
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

//! x[0, n) as floats: x itself when T is float (no copy, no scratch), else x widened
//! into the (Tag, Slot) scratch, which the result points into.
template <class Tag, std::size_t Slot, class T>
float const* host_floats_of(T const* x, std::size_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    float* out = host_scratch_floats<Tag, Slot>(n);
    widen_span(x, out, n);
    return out;
  }
}

}  // namespace mpx::detail
