// An installed mpx in a user's own CUDA code, built by CMake with nvcc: a kernel on
// mpx's types and casts, and mpx::gemm on a cuda_executor, which links cuBLASLt through
// mpx::mpx. run.sh compiles and links it; it runs only where there is a GPU.
#include <mpx/mpx.hpp>

#include <cstdio>

namespace {

// The user's kernel: scaled half gradients back to float, flagging non-finite ones.
__global__ void unscale(mpx::half const* in, float* out, float inv_scale, int n, int* found_inf) {
  int const i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  float const v = mpx::cast<float>(in[i]) * inv_scale;
  if (!mpx::is_finite(v)) atomicExch(found_inf, 1);
  out[i] = v;
}

}  // namespace

int main() try {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no GPU: built and linked, not run\n");
    return 0;
  }
  mpx::cuda_executor exec;
  auto a = mpx::make_tensor<mpx::half>(exec, {64, 32});
  auto b = mpx::make_tensor<mpx::half>(exec, {32, 16});
  auto c = mpx::make_tensor<float>(exec, {64, 16});
  mpx::fill(exec, a, mpx::cast<mpx::half>(1.0f));
  mpx::fill(exec, b, mpx::cast<mpx::half>(0.5f));
  mpx::gemm<mpx::mixed_float16>(exec, a, b, c);  // cuBLASLt, float accumulation
  auto out = mpx::make_tensor<float>(exec, {64 * 32});
  auto flag = mpx::make_tensor<int>(exec, {1});
  mpx::fill(exec, flag, 0);
  unscale<<<(64 * 32 + 255) / 256, 256>>>(a.data(), out.data(), 0.5f, 64 * 32, flag.data());
  MPX_CUDA_CHECK(cudaGetLastError());
  auto const host_c = mpx::to_host(exec, c);
  auto const host_flag = mpx::to_host(exec, flag);
  bool const ok = host_c[0] == 16.0f && host_flag[0] == 0;
  std::printf("gemm %g (expect 16), non-finite flag %d\n", static_cast<double>(host_c[0]), host_flag[0]);
  return ok ? 0 : 1;
} catch (mpx::error const& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 1;
}
