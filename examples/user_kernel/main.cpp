// Your own CUDA kernel beside mpx's: mpx's headers give it the types (mpx::half), the
// conversions (mpx::cast, rounding to nearest even and overflowing to inf exactly as
// the hardware does), a policy's dtypes (mpx::mixed_float16::storage_type, ...) and
// the bit-exact classification (mpx::is_finite); the kernel takes the raw pointers of
// mpx tensors and runs on the stream of an mpx::cuda_executor, in order with mpx's own
// kernels on that stream (here mpx::copy and mpx::scale).
//
// The kernel is a fused swish activation, y = x * sigmoid(x) * scale, reading and
// writing the policy's storage type and computing in its accumulate type (float). It
// counts the values it wrote that are not finite (a scale too large for half) with
// mpx's block-level check (mpx::block_add_nonfinite: one block sum in shared memory and
// at most one atomic per block), so a caller needs no second pass. The program checks
// that count with a second pass of its own, over the values copied back to the host.
//
// Why not mpx::count_nonfinite or mpx::stats on the GPU here: those standalone checks
// are Thrust reductions, and each one a unit calls on the GPU costs it seconds of nvcc
// (bench/NOTES.md). A kernel's own unit stays small (types, casts, policies, the
// block-level check: about 4 s under nvcc); call the standalone checks from another one.
//
// Built by nvcc (main.cu) and run with a GPU, all of it runs on the GPU. Built as plain
// C++, or run without a GPU, the same element function runs in a host loop on
// mpx::host_executor, with the same results.
//
//   user_kernel [--executor auto|host|cuda] [--size N] [--scale X]
#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/numerics/block_finite.hpp>

#include "../common/command_line.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

using policy = mpx::mixed_float16;
using storage = policy::storage_type;  // mpx::half

//! The element function, shared by the kernel and the host loop: computed in the
//! policy's accumulate type (float), rounded once to its storage type.
template <class Policy>
MPX_HD typename Policy::storage_type swish_scaled(typename Policy::storage_type x, float scale) {
  static_assert(mpx::float_accumulating_policy<Policy>, "swish_scaled computes in float");
  using A = typename Policy::accumulate_type;
  A const v = mpx::cast<A>(x);
  A const y = v / (A(1) + ::expf(-v));
  return mpx::cast<typename Policy::storage_type>(y * scale);
}

#if MPX_HAS_CUDA
constexpr int threads = 256;

//! y = swish(x) * scale over n elements; adds to *nonfinite how many outputs are NaN or inf.
template <class Policy>
__global__ void __launch_bounds__(threads)
    swish_scaled_kernel(typename Policy::storage_type const* __restrict__ x,
                        typename Policy::storage_type* __restrict__ y, std::size_t n, float scale,
                        unsigned long long* nonfinite) {
  unsigned bad = 0;
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    auto const v = swish_scaled<Policy>(x[i], scale);
    y[i] = v;
    bad += mpx::is_finite(v) ? 0u : 1u;
  }
  mpx::block_add_nonfinite<threads>(bad, nonfinite);  // every thread of the block calls it
}
#endif

//! Runs swish_scaled over x into y on exec and returns how many outputs were not finite,
//! as the kernel (or the host loop) counted them.
template <class Exec, class Space = mpx::memory_space_t<Exec>>
std::size_t swish_scaled([[maybe_unused]] Exec const& exec, mpx::tensor_view<storage const, Space> x,
                         mpx::tensor_view<storage, Space> y, float scale) {
  if constexpr (mpx::is_host_executor_v<Exec>) {
    std::size_t bad = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      y[i] = swish_scaled<policy>(x[i], scale);
      bad += !mpx::is_finite(y[i]);
    }
    return bad;
  } else {
#if MPX_HAS_CUDA
    auto counter = mpx::make_tensor<unsigned long long>(exec, {1});  // stream-ordered, like mpx's own scratch
    MPX_CUDA_CHECK(cudaMemsetAsync(counter.data(), 0, sizeof(unsigned long long), exec.stream()));
    swish_scaled_kernel<policy><<<264, threads, 0, exec.stream()>>>(x.data(), y.data(), x.size(), scale,
                                                                      counter.data());
    MPX_CUDA_CHECK_LAUNCH("swish_scaled_kernel");
    return static_cast<std::size_t>(mpx::to_host(exec, counter)[0]);  // synchronises the stream
#else
    return 0;  // unreachable: a cuda_executor exists only under nvcc here
#endif
  }
}

//! How many of a host tensor's values are NaN or inf, one element after another.
std::size_t count_nonfinite_on_host(mpx::tensor<storage, mpx::host_space> const& y) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < y.size(); ++i) bad += mpx::is_finite(y.data()[i]) ? 0 : 1;
  return bad;
}

template <class Exec>
void run(Exec const& exec, std::size_t n, float scale) {
  std::printf("%zu values x ~ N(0, 3^2) in %s (the storage type of %s), %s executor\n", n,
              std::string(mpx::dtype_name<storage>).c_str(), std::string(policy::name).c_str(),
              std::string(Exec::name).c_str());
  std::vector<storage> host_x(n);
  std::mt19937_64 gen(17);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (auto& v : host_x) v = mpx::cast<storage>(normal(gen));
  mpx::shape const s{static_cast<std::int64_t>(n)};
  auto x = mpx::make_tensor<storage>(exec, s);
  mpx::copy(exec, mpx::tensor_view<storage const>(host_x.data(), s), x);
  auto y = mpx::make_tensor<storage>(exec, s);

  // 1. The user's kernel, with its own count of non-finite outputs.
  std::size_t const counted = swish_scaled(exec, mpx::view(std::as_const(x)), y.view(), scale);
  // 2. A second pass, on the host, over the values the kernel wrote.
  std::size_t const checked = count_nonfinite_on_host(mpx::to_host(exec, y));
  std::printf("  y = swish(x) * %g, stored in half:\n"
              "    %-40s %zu non-finite values\n"
              "    %-40s %zu\n",
              static_cast<double>(scale),
              mpx::is_host_executor_v<Exec> ? "the host loop counted" : "the kernel's block-level check counted",
              counted, "a second pass over the values counted", checked);
  if (counted != checked) throw mpx::error("the kernel's finite check and the second pass disagree");

  // 3. mpx::scale divides the scale back out, in place, on the same stream.
  mpx::scale(exec, y, 1.0f / scale);
  std::size_t const still = count_nonfinite_on_host(mpx::to_host(exec, y));
  std::printf("  after mpx::scale(y, 1/%g): %zu non-finite values\n", static_cast<double>(scale), still);
  if (still)
    std::printf("  The values that overflowed stay inf once unscaled: this scale is too large for half at\n"
                "  these activations (try --scale 1).\n");
  else
    std::printf("  No value overflowed: every scaled output fits in half.\n");
}

bool gpu_available() {
#if MPX_HAS_CUDA
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#else
  return false;
#endif
}

}  // namespace

int main(int argc, char** argv) try {
  std::string executor = "auto";
  std::size_t n = std::size_t{1} << 20;
  float scale = 8192;
  mpx_programs::command_line args(argc, argv, "[--executor auto|host|cuda] [--size N] [--scale X]");
  while (args.next()) {
    if (args.is("--executor")) executor = args.choice({"auto", "host", "cuda"});
    else if (args.is("--size")) n = args.whole<std::size_t>(1, std::size_t{1} << 30);
    else if (args.is("--scale")) scale = static_cast<float>(args.real(0, 16777216, true));
    else args.unknown();
  }
  bool const gpu = gpu_available();
  if (executor == "cuda" || (executor == "auto" && gpu)) {
#if MPX_HAS_CUDA
    if (!gpu) throw mpx::error("--executor cuda: no GPU is visible to this process");
    // The user's own stream: mpx's calls and the user's kernel are ordered on it.
    cudaStream_t stream{};
    MPX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    try {
      run(mpx::cuda_executor{stream}, n, scale);
    } catch (...) {
      cudaStreamDestroy(stream);
      throw;
    }
    MPX_CUDA_CHECK(cudaStreamDestroy(stream));
#else
    throw mpx::error("--executor cuda: this binary was built without nvcc; rebuild with -Dcuda=enabled");
#endif
  } else {
    if (executor == "auto")
      std::printf("No GPU%s: running the same computation on the host executor.\n",
                  MPX_HAS_CUDA ? "" : " code (built without nvcc)");
    run(mpx::host_executor{}, n, scale);
  }
  return 0;
} catch (...) {
  return mpx_programs::report_failure("user_kernel");
}
