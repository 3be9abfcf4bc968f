// Catch2's runner for the CUDA suite: without a usable GPU it exits 77, which Meson
// reports as SKIP, so a machine without a GPU never reports the CUDA suite as passed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime_api.h>

#include <cstdio>

int main(int argc, char* argv[]) {
  int devices = 0;
  cudaError_t const status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("mpx cuda suite: no usable GPU (%s); skipped\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "no devices");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) std::printf("mpx cuda suite on %s\n", prop.name);
  // Catch2 returns the number of failed assertions (up to 255), which a caller would
  // read as 77 (skipped), 124 (timed out) or a signal: 1 for any failure instead.
  return Catch::Session().run(argc, argv) == 0 ? 0 : 1;
}
