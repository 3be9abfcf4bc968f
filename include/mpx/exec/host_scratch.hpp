// Float scratch for the host executor's kernels, kept from call to call on each thread,
// so a training step does not allocate (and page-fault) fresh buffers for every layer.
#pragma once

#include <cstddef>
#include <vector>

namespace mpx::detail {

//! Buffers per tag: a kernel that needs several at once asks for slots 0, 1, ...
inline constexpr std::size_t host_scratch_slots = 4;

//! At least n floats of scratch, for the calling thread, owned by (Tag, slot). Each kernel
//! names its own Tag, so one that calls another (conv2d calls gemm) never gets a buffer
//! the other is using. The pointer stays valid until the same thread asks the same
//! (Tag, slot) for more than it holds. Contents are unspecified.
template <class Tag>
float* host_scratch_floats(std::size_t slot, std::size_t n) {
  static_assert(sizeof(Tag) > 0, "a scratch tag is a complete type");
  thread_local std::vector<float> buffers[host_scratch_slots];
  std::vector<float>& buffer = buffers[slot < host_scratch_slots ? slot : host_scratch_slots - 1];
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

}  // namespace mpx::detail
