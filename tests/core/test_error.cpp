// mpx's errors as users read them: the launch check says whose error it found (this
// launch's, an earlier call's, an earlier kernel's fault), and a GPU the program has no
// code for is named with the architectures it was built for and what to do.
#include "../support/testing.hpp"

#include <string>

TEST_CASE("a GPU without code in the program is named, with the architectures built and the fix", "[errors]") {
  using Catch::Matchers::Contains;
  CHECK(mpx::detail::architecture_names("800,860,890,900,1000,1200") == "sm_80, sm_86, sm_89, sm_90, sm_100, sm_120");
  CHECK(mpx::detail::architecture_names("900") == "sm_90");
  CHECK(mpx::detail::architecture_names("").empty());

  // A newer GPU than the build: rebuild for it.
  std::string const newer = mpx::detail::missing_kernel_image_note(1, "NVIDIA RTX PRO 6000", 12, 0, "800,900");
  CHECK_THAT(newer, Contains("GPU 1 (NVIDIA RTX PRO 6000) has compute capability 12.0") &&
                        Contains("compiled for sm_80, sm_90") && Contains("-Dgpu_architectures=native") &&
                        Contains("arch=compute_120,code=sm_120") && !Contains("cannot run it"));
  // An older GPU than mpx supports: no rebuild helps.
  std::string const older = mpx::detail::missing_kernel_image_note(0, "Tesla T4", 7, 5, "800");
  CHECK_THAT(older, Contains("compute capability 7.5") && Contains("needs compute capability 8.0 or newer") &&
                        Contains("cannot run it") && !Contains("Rebuild"));
  // Outside nvcc the list is unknown and not claimed.
  CHECK_THAT(mpx::detail::missing_kernel_image_note(0, "A100", 8, 0, ""), !Contains("compiled for"));

#if MPX_HAS_CUDA_RUNTIME
  CHECK(mpx::detail::is_missing_kernel_image(cudaErrorNoKernelImageForDevice));
  CHECK(mpx::detail::is_missing_kernel_image(cudaErrorInvalidDeviceFunction));
  CHECK_FALSE(mpx::detail::is_missing_kernel_image(cudaErrorInvalidConfiguration));
#endif
}

// MPX_CUDA_CHECK_LAUNCH reads cudaGetLastError(), which may hold another operation's
// error: the message must say whose. The wording is a function of its own, checked here
// without a GPU (and the classification of CUDA's codes, where its headers are).
TEST_CASE("a failed launch check says whether this launch, an earlier call or an earlier fault failed",
          "[errors]") {
  using mpx::detail::launch_failure;
  using Catch::Matchers::Contains;
#if MPX_HAS_CUDA_RUNTIME
  using mpx::detail::classify_launch_error;
  for (cudaError_t e : {cudaErrorInvalidConfiguration, cudaErrorLaunchOutOfResources, cudaErrorNoKernelImageForDevice,
                        cudaErrorInvalidDeviceFunction, cudaErrorInvalidValue})
    CHECK(classify_launch_error(e) == launch_failure::this_launch);
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorMisalignedAddress, cudaErrorAssert,
                        cudaErrorIllegalInstruction, cudaErrorHardwareStackError})
    CHECK(classify_launch_error(e) == launch_failure::sticky_fault);
  for (cudaError_t e : {cudaErrorMemoryAllocation, cudaErrorInvalidDevicePointer, cudaErrorInvalidMemcpyDirection})
    CHECK(classify_launch_error(e) == launch_failure::earlier_call);
  CHECK(mpx::detail::is_sticky_error(cudaErrorIllegalAddress));
  CHECK_FALSE(mpx::detail::is_sticky_error(cudaErrorMemoryAllocation));
  CHECK_FALSE(mpx::detail::is_sticky_error(cudaSuccess));
#endif

  auto message = [](launch_failure kind, char const* name, char const* text) {
    return mpx::detail::launch_failure_message("mpx::softmax_warp_kernel", kind, name, text, "softmax.hpp", 233);
  };
  auto const refused = message(launch_failure::this_launch, "cudaErrorInvalidConfiguration", "invalid configuration argument");
  CHECK_THAT(refused, Contains("the launch of mpx::softmax_warp_kernel was refused") &&
                          Contains("cudaErrorInvalidConfiguration (invalid configuration argument)") &&
                          Contains("configuration") && Contains("softmax.hpp:233"));
  // An earlier kernel's fault: the kernel just launched is named as the one that
  // noticed, and explicitly cleared.
  auto const sticky = message(launch_failure::sticky_fault, "cudaErrorIllegalAddress",
                              "an illegal memory access was encountered");
  CHECK_THAT(sticky, Contains("cudaErrorIllegalAddress (an illegal memory access was encountered)") &&
                         Contains("sticky error of an earlier asynchronous operation") &&
                         Contains("not the launch of mpx::softmax_warp_kernel") && Contains("compute-sanitizer") &&
                         Contains("CUDA_LAUNCH_BLOCKING=1") && Contains("softmax.hpp:233"));
  CHECK_THAT(sticky, !Contains("was refused") && !Contains("may have succeeded"));
  auto const earlier = message(launch_failure::earlier_call, "cudaErrorMemoryAllocation", "out of memory");
  CHECK_THAT(earlier, Contains("cudaErrorMemoryAllocation (out of memory)") &&
                          Contains("an earlier CUDA runtime call on this thread failed") &&
                          Contains("mpx::softmax_warp_kernel itself may have succeeded") && !Contains("was refused"));
}

#if MPX_HAS_CUDA
namespace test_error {
template <int Unused>
__global__ void noop_kernel(int* out) {
  if (out) *out = Unused;
}
}  // namespace test_error

// The same on a GPU, with real errors that leave the device usable: a block too large
// for any GPU (this launch's fault), and an unchecked failed allocation before a good
// launch (an earlier call's error, which the check must not pin on the kernel).
TEST_CASE("MPX_CUDA_CHECK_LAUNCH tells a refused launch from an earlier call's error", "[errors][cuda]") {
  static_cast<void>(cudaGetLastError());
  test_error::noop_kernel<0><<<1, 4096>>>(nullptr);
  try {
    MPX_CUDA_CHECK_LAUNCH("test_error::noop_kernel");
    FAIL("a block of 4096 threads was not refused");
  } catch (mpx::cuda_error const& e) {
    CHECK(e.code() == static_cast<int>(cudaErrorInvalidConfiguration));
    CHECK_THAT(e.what(), Catch::Contains("the launch of test_error::noop_kernel was refused"));
  }
  void* p = nullptr;
  CHECK(cudaMalloc(&p, std::size_t{1} << 62) == cudaErrorMemoryAllocation);  // not checked: left as the last error
  test_error::noop_kernel<0><<<1, 32>>>(nullptr);
  try {
    MPX_CUDA_CHECK_LAUNCH("test_error::noop_kernel");
    FAIL("the failed allocation was not reported");
  } catch (mpx::cuda_error const& e) {
    CHECK(e.code() == static_cast<int>(cudaErrorMemoryAllocation));
    CHECK_THAT(e.what(), Catch::Contains("earlier CUDA runtime call") && Catch::Contains("may have succeeded"));
  }
  MPX_CUDA_CHECK_LAUNCH("nothing");  // both errors were consumed
  MPX_CUDA_CHECK(cudaDeviceSynchronize());
}
#endif

TEST_CASE("an error names its operation once, however the caller spelled it", "[errors]") {
  auto message_of = [](auto&& throwing) {
    try {
      throwing();
    } catch (mpx::error const& e) {
      return std::string(e.what());
    }
    return std::string("(nothing thrown)");
  };
  std::string const plain = message_of([] { mpx::detail::fail("gemm", "shapes differ"); });
  std::string const spelled = message_of([] { mpx::detail::fail("mpx::dense", "units must be positive"); });
  CHECK(plain.rfind("mpx::gemm: shapes differ (at ", 0) == 0);
  CHECK(spelled.rfind("mpx::dense: units must be positive (at ", 0) == 0);
  CHECK(spelled.find("mpx::mpx::") == std::string::npos);
  // A layer built with a bad configuration says so in the library's words.
  std::string const layer = message_of([] { mpx::dense<mpx::float32> d({.units = 0}); });
  CHECK(layer.rfind("mpx::dense: units must be positive", 0) == 0);
}
