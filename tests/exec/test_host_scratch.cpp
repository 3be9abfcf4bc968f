// The host kernels' per-thread scratch (detail::host_scratch_floats): each (tag, slot)
// owns its buffer, a buffer grows on demand, and each thread has its own.
#include "../support/testing.hpp"

#include <mpx/exec/host_scratch.hpp>

#include <thread>

namespace {
struct first_kernel {};
struct second_kernel {};
}  // namespace

TEST_CASE("host scratch: one buffer per tag, slot and thread", "[host_scratch]") {
  using mpx::detail::host_scratch_floats;
  float* a0 = host_scratch_floats<first_kernel>(0, 100);
  float* a1 = host_scratch_floats<first_kernel>(1, 100);
  float* b0 = host_scratch_floats<second_kernel>(0, 100);
  CHECK(a0 != a1);
  CHECK(a0 != b0);
  CHECK(a1 != b0);
  for (int i = 0; i < 100; ++i) a0[i] = static_cast<float>(i);
  b0[0] = -1.0f;
  a1[0] = -2.0f;
  CHECK(a0[0] == 0.0f);  // the other buffers' writes do not land in a0

  // Asking again for no more than it holds returns the same buffer, contents kept.
  CHECK(host_scratch_floats<first_kernel>(0, 50) == a0);
  CHECK(a0[99] == 99.0f);

  // Asking for more grows it: the whole of the new size is writable (ASan checks).
  float* grown = host_scratch_floats<first_kernel>(0, 1 << 20);
  grown[(1 << 20) - 1] = 1.0f;
  CHECK(host_scratch_floats<first_kernel>(0, 1) == grown);

  // Another thread gets its own buffer for the same tag and slot.
  float* other = nullptr;
  std::thread([&] { other = host_scratch_floats<first_kernel>(0, 100); }).join();
  CHECK(other != grown);
}
