// Float scratch for the host executor's kernels, kept from call to call on each thread,
// so a training step does not allocate (and page-fault) fresh buffers for every layer.
#pragma once

#include <mpx/core/convert_span.hpp>
#include <mpx/exec/host_threads.hpp>
#include <mpx/exec/memory_space.hpp>

#include <cstddef>
#include <new>
#include <type_traits>
#include <vector>

namespace mpx::detail {

//! At least n values of T of scratch, for the calling thread, owned by (Tag, Slot): the
//! one way the host executor's kernels get temporary memory (the GPU's is a
//! stream-ordered buffer). Each kernel names its own Tag, so one that calls another
//! (conv2d calls gemm) never gets a buffer the other is using; a kernel that needs
//! several buffers at once gives each its own Slot (an enumerator, so the names say
//! which is which). The pointer stays valid until the same thread asks the same
//! (T, Tag, Slot) for more than it holds. Contents are unspecified. Scratch the host
//! cannot give is an mpx::allocation_error, as a tensor's is, and the buffer held before
//! is kept.
template <class T, class Tag, std::size_t Slot>
T* host_scratch(std::size_t n) {
  static_assert(sizeof(Tag) > 0, "a scratch tag is a complete type");
  static_assert(std::is_trivially_copyable_v<T>, "host scratch holds plain values");
  thread_local std::vector<T> buffer;  // one per (T, Tag, Slot) instantiation
  if (buffer.size() < n) {
    try {
      buffer.resize(n);
    } catch (std::bad_alloc const&) {
      fail_allocation("host scratch", n, sizeof(T), "the system has no more to give (std::bad_alloc)");
    } catch (std::length_error const&) {
      fail_allocation("host scratch", n, sizeof(T), "more than a std::vector can hold");
    }
  }
  return buffer.data();
}

//! host_scratch of floats, the common case.
template <class Tag, std::size_t Slot>
float* host_scratch_floats(std::size_t n) {
  return host_scratch<float, Tag, Slot>(n);
}

//! x[0, n) as floats: x itself when T is float (no copy, no scratch), else x widened
//! into the (Tag, Slot) scratch, which the result points into.
template <class Tag, std::size_t Slot, class T>
float const* host_floats_of(T const* x, std::size_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    float* out = host_scratch_floats<Tag, Slot>(n);
    // Memory-bound: a large array (a product's operand) is widened by the host's threads.
    host_parallel_ranges(n, n, [&](std::size_t begin, std::size_t end) { widen_span(x + begin, out + begin, end - begin); },
                         16);
    return out;
  }
}

}  // namespace mpx::detail
