// Memory that cannot be had is an mpx::allocation_error naming what was being allocated
// and how many bytes, never a std::bad_alloc or a crash, on the host (a size no machine
// has, and a process held under RLIMIT_AS) and on the GPU (more than the device holds);
// a model whose build ran out of memory builds again smaller. Extents whose product does
// not fit in 63 bits are refused before any size is computed from them.
#include "../support/doc_quotes.hpp"
#include "../support/testing.hpp"

#include <mpx/layers/dense.hpp>
#include <mpx/model/sequential.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

// The cases that ask for more than the machine has run in the plain host suite and the
// CUDA suite, not under AddressSanitizer (MPX_TEST_UNDER_ASAN).

namespace allocation {

using Catch::Matchers::Contains;

TEST_CASE("extents whose product passes 2^63 - 1 are refused, not wrapped to a small size", "[exec][allocation]") {
  std::int64_t const big = std::int64_t{1} << 40;
  CHECK_THROWS_TYPE_WITH((mpx::shape{big, big}), mpx::invalid_argument,
                         Contains("the extents [1099511627776, 1099511627776] hold more than 2^63 - 1 elements"));
  CHECK_THROWS_AS((mpx::shape{2, big, big, 0 + 1}), mpx::invalid_argument);
  CHECK((mpx::shape{big, big, 0}).size() == 0);  // an empty tensor is empty, however long its other axes
  CHECK((mpx::shape{std::int64_t{1} << 31, std::int64_t{1} << 31}).size() == std::size_t{1} << 62);
}

#if !MPX_TEST_UNDER_ASAN
TEMPLATE_LIST_TEST_CASE("a tensor larger than the memory is an allocation_error naming its dtype, shape and bytes",
                        "[exec][allocation]", mpx_test::executors) {
  TestType exec;
  // 2^48 floats: 1 PiB, more than any host or GPU holds.
  std::int64_t const side = std::int64_t{1} << 24;
  CHECK_THROWS_TYPE_WITH(mpx::make_tensor<float>(exec, {side, side}), mpx::allocation_error,
                         Contains("mpx::tensor: a float32 tensor of shape [16777216, 16777216]") &&
                             Contains("cannot allocate 1125899906842624 bytes (1.05e+06 GiB)") &&
                             Contains("nothing was allocated"));
  if constexpr (mpx::is_host_executor_v<TestType>)
    mpx_test::check_doc_quote("robustness.md",
                              "mpx::tensor: a float32 tensor of shape [16777216, 16777216]: mpx::allocate: cannot "
                              "allocate 1125899906842624 bytes (1.05e+06 GiB) of host memory for 281474976710656 "
                              "elements: the system has no more to give (std::bad_alloc); nothing was allocated (at ...)",
                              mpx_test::message_of([&] { (void)mpx::make_tensor<float>(exec, {side, side}); }));
  // More bytes than size_t counts: refused before any allocator is asked.
  CHECK_THROWS_TYPE_WITH(mpx::make_tensor<float>(exec, {std::int64_t{1} << 62}), mpx::allocation_error,
                         Contains("more bytes than an address can count"));
  // The executor still works.
  auto small = mpx_test::upload(exec, std::vector<float>{1, 2, 3}, mpx::shape{3});
  CHECK(mpx_test::download(exec, small) == std::vector<float>{1, 2, 3});
}

TEMPLATE_LIST_TEST_CASE("a model whose build runs out of memory says which tensor, and builds again smaller",
                        "[exec][allocation]", mpx_test::executors) {
  TestType exec;
  auto model = mpx::sequential<mpx::float32>(mpx::dense<>(1024, mpx::activation::relu), mpx::dense<>(3));
  // A first layer of [2^40, 1024] floats: 4 PiB.
  CHECK_THROWS_TYPE_WITH(model.build(exec, {std::int64_t{1} << 40}, 1), mpx::allocation_error,
                         Contains("[1099511627776, 1024]"));
  model.build(exec, {8}, 1);
  auto const x = mpx_test::upload(exec, mpx_test::random_values<float>(2 * 8, -1.0, 1.0, 3), mpx::shape{2, 8});
  auto const y = mpx_test::download(exec, model.forward(exec, x.view(), false));
  REQUIRE(y.size() == 6);
  for (float v : y) CHECK(std::isfinite(v));
}

#if !MPX_HAS_CUDA
// The resident size of this process, from /proc/self/statm (pages).
std::size_t address_space_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages = 0;
  statm >> pages;
  return pages * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

TEST_CASE("under RLIMIT_AS, a host tensor the limit does not allow is an allocation_error", "[exec][allocation]") {
  // In a child process: the limit is the process's own and cannot be lifted again.
  pid_t const child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    rlimit const limit{address_space_bytes() + (std::size_t{256} << 20), RLIM_INFINITY};
    int status = 3;
    if (::setrlimit(RLIMIT_AS, &limit) == 0) {
      try {
        auto t = mpx::make_tensor<float>(mpx::host_executor{}, {std::int64_t{1} << 28});  // 1 GiB
        status = 1;  // allocated: the limit did not hold
      } catch (mpx::allocation_error const& e) {
        std::string const what = e.what();
        status = what.find("a float32 tensor of shape [268435456]") != std::string::npos &&
                         what.find("1073741824 bytes") != std::string::npos
                     ? 0
                     : 2;
      } catch (...) {
        status = 4;
      }
      struct scratch_tag {};
      try {  // the host kernels' scratch too, and the buffer it held is kept
        float* held = mpx::detail::host_scratch_floats<scratch_tag, 0>(16);
        try {
          (void)mpx::detail::host_scratch_floats<scratch_tag, 0>(std::size_t{1} << 28);
          if (status == 0) status = 6;
        } catch (mpx::allocation_error const& e) {
          if (std::string_view(e.what()).find("of host scratch memory for 268435456 elements") == std::string_view::npos ||
              mpx::detail::host_scratch_floats<scratch_tag, 0>(16) != held)
            status = 6;
        }
      } catch (...) {
        status = 6;
      }
      try {  // and what fits still allocates
        auto small = mpx::make_tensor<float>(mpx::host_executor{}, {1024});
        mpx::fill(mpx::host_executor{}, small, 1.0f);
      } catch (...) {
        status = 5;
      }
    }
    std::fflush(nullptr);
    ::_exit(status);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  INFO("child exit status " << WEXITSTATUS(status)
                            << " (1: allocated past the limit, 2: another message, 3: setrlimit failed, 4: another "
                               "exception, 5: a small tensor failed, 6: host scratch past the limit was not an allocation_error)");
  CHECK(WEXITSTATUS(status) == 0);
}
#endif
#endif

#if !MPX_HAS_CUDA
TEST_CASE("host scratch more than a std::vector can hold is an allocation_error, and the buffer held is kept",
          "[exec][allocation]") {
  struct tag {};
  float* held = mpx::detail::host_scratch_floats<tag, 0>(8);
  CHECK_THROWS_TYPE_WITH((mpx::detail::host_scratch_floats<tag, 0>(SIZE_MAX / 2)), mpx::allocation_error,
                         Contains("host scratch memory") && Contains("more than a std::vector can hold"));
  CHECK(mpx::detail::host_scratch_floats<tag, 0>(8) == held);
}
#endif

}  // namespace allocation
