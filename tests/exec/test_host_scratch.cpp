// The host kernels' per-thread scratch (detail::host_scratch_floats): each (tag, slot)
// owns its buffer, a buffer grows on demand, and each thread has its own; and
// detail::host_floats_of, which widens through it (or hands float data back as is).
#include "../support/testing.hpp"

#include <mpx/core/cast.hpp>
#include <mpx/exec/host_scratch.hpp>

#include <cmath>
#include <limits>
#include <thread>
#include <vector>

namespace {
struct first_kernel {};
struct second_kernel {};
}  // namespace

TEST_CASE("host scratch: one buffer per tag, slot and thread", "[host_scratch]") {
  using mpx::detail::host_scratch_floats;
  float* a0 = host_scratch_floats<first_kernel, 0>(100);
  float* a1 = host_scratch_floats<first_kernel, 1>(100);
  float* a7 = host_scratch_floats<first_kernel, 7>(100);  // any number of slots
  float* b0 = host_scratch_floats<second_kernel, 0>(100);
  CHECK(a0 != a1);
  CHECK(a0 != a7);
  CHECK(a1 != a7);
  CHECK(a0 != b0);
  CHECK(a1 != b0);
  for (int i = 0; i < 100; ++i) a0[i] = static_cast<float>(i);
  b0[0] = -1.0f;
  a1[0] = -2.0f;
  CHECK(a0[0] == 0.0f);  // the other buffers' writes do not land in a0

  // Asking again for no more than it holds returns the same buffer, contents kept.
  CHECK(host_scratch_floats<first_kernel, 0>(50) == a0);
  CHECK(a0[99] == 99.0f);

  // Asking for more grows it: the whole of the new size is writable (ASan checks).
  float* grown = host_scratch_floats<first_kernel, 0>(1 << 20);
  grown[(1 << 20) - 1] = 1.0f;
  CHECK(host_scratch_floats<first_kernel, 0>(1) == grown);

  // Another thread gets its own buffer for the same tag and slot.
  float* other = nullptr;
  std::thread([&] { other = host_scratch_floats<first_kernel, 0>(100); }).join();
  CHECK(other != grown);
}

TEST_CASE("host scratch: float data as floats, 16-bit data widened exactly", "[host_scratch]") {
  using mpx::detail::host_floats_of;
  std::vector<float> const f{1.0f, -2.5f, 3.0e-8f};
  CHECK(host_floats_of<first_kernel, 3>(f.data(), f.size()) == f.data());  // no copy

  // Awkward length (not a multiple of the eight-wide F16C step), with a NaN, an infinity,
  // a subnormal and the largest finite value in the second group of eight.
  std::vector<mpx::half> h;
  std::vector<float> expected;
  for (int i = 0; i < 19; ++i) expected.push_back(static_cast<float>(i) * 0.375f - 3.0f);
  expected[9] = std::numeric_limits<float>::infinity();
  expected[10] = 65504.0f;
  expected[11] = 0x1p-24f;
  for (float v : expected) h.push_back(mpx::cast<mpx::half>(v));
  h[12] = mpx::cast<mpx::half>(std::numeric_limits<float>::quiet_NaN());
  float const* widened = host_floats_of<first_kernel, 3>(h.data(), h.size());
  CHECK(widened != nullptr);
  for (std::size_t i = 0; i < h.size(); ++i) {
    if (i == 12) {
      CHECK(std::isnan(widened[i]));
    } else {
      CHECK(widened[i] == expected[i]);
    }
  }
  // The scratch it widened into is the (tag, slot) buffer.
  CHECK(widened == mpx::detail::host_scratch_floats<first_kernel, 3>(1));

  std::vector<mpx::bfloat16> bf{mpx::cast<mpx::bfloat16>(-1.5f), mpx::cast<mpx::bfloat16>(0x1p-130f)};
  float const* bw = host_floats_of<second_kernel, 1>(bf.data(), bf.size());
  CHECK(bw[0] == -1.5f);
  CHECK(bw[1] == 0x1p-130f);
}
