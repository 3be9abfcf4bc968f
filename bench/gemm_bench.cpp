// Microbenchmark of mpx::gemm: square products and the shapes a small CNN on
// Fashion-MNIST makes (dense layers, their weight gradients, convolutions as products),
// for half, bfloat16 and float, mpx::fp8_gemm on e4m3 operands beside the bfloat16 row
// where the GPU's fp8 rules allow the shape, and the block-scaled recipes (quantize and
// product: 1x128 with 128x128 blocks, rowwise, MXFP8's 1x32 blocks; each skipped on a GPU
// whose cuBLASLt lacks its scale mode). On the GPU each row stands beside cuBLAS
// (cublasGemmEx / cublasGemmStridedBatchedEx, default algorithm, the same compute type)
// measured in the same run; on the host it reports GFLOP/s of the host path (OpenBLAS
// sgemm where the build found it, mpx's blocked product otherwise).
//
//   gemm_bench [--executor host|cuda|all] [--repeat R] [--max-square N] [--shapes squares|layers|all]
//
// Every result is spot-checked against a float64 product before its row is printed: a
// benchmark of a wrong answer measures nothing. Build with nvcc (gemm_bench.cu) for the
// CUDA rows; bench/NOTES.md has the predictions and the results.
#include <mpx/mpx.hpp>

#include "executors.hpp"
#include "tensors.hpp"
#include "timing.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#if MPX_HAS_CUDA
#include <cublas_v2.h>
#endif

namespace {

using mpx_bench::policy_for;

struct options {
  std::string executor = "all";
  int repeat = 5;
  std::int64_t max_square = 0;  // 0: 8192 on the GPU, 1024 on the host
  std::string shapes = "all";
};

struct shape_case {
  std::string name;
  std::int64_t batch, m, n, k;
  bool ta, tb;
};

// Squares 1024..8192, then the layers of a small CNN at batch 256 (28x28x1 -> conv 3x3
// 32 -> pool -> conv 3x3 64 -> pool -> dense 3136->128 -> dense 128->10), and one
// attention-like batch.
std::vector<shape_case> cases(options const& opt, bool gpu) {
  std::vector<shape_case> out;
  std::int64_t const max_square = opt.max_square ? opt.max_square : (gpu ? 8192 : 1024);
  if (opt.shapes != "layers")
    for (std::int64_t s = 256; s <= max_square; s *= 2)
      if (s >= 1024 || !gpu) out.push_back({"square " + std::to_string(s), 1, s, s, s, false, false});
  if (opt.shapes != "squares") {
    out.push_back({"dense 784->128 fwd", 1, 256, 128, 784, false, false});
    out.push_back({"dense 784->128 dW=x^T dy", 1, 784, 128, 256, true, false});
    out.push_back({"dense 3136->128 fwd", 1, 256, 128, 3136, false, false});
    out.push_back({"dense 3136->128 dX=dy W^T", 1, 256, 3136, 128, false, true});
    out.push_back({"dense 3136->128 dW=x^T dy", 1, 3136, 128, 256, true, false});
    out.push_back({"conv1 as gemm (K=9)", 1, 256 * 28 * 28, 32, 9, false, false});
    out.push_back({"conv2 as gemm (K=288)", 1, 256 * 14 * 14, 64, 288, false, false});
    out.push_back({"conv2 dW (K=50176)", 1, 288, 64, 256 * 14 * 14, true, false});
    if (gpu) out.push_back({"batched 32x512x512x64", 32, 512, 512, 64, false, true});
  }
  return out;
}

//! Fast seeded values in [-1, 1): a large operand's worth in well under a second.
template <class T>
std::vector<T> random_operand(std::size_t n, std::uint64_t seed) {
  std::vector<T> out(n);
  std::uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (auto& v : out) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    v = mpx::cast<T>(static_cast<float>(static_cast<std::int64_t>(s >> 40) - (1 << 23)) * 0x1p-23f);
  }
  return out;
}

//! Checks 64 seeded elements of C against float64; throws mpx::error on a miss. fp8
//! operands allow for the GPU's fp8 tensor cores, which add the products of one
//! instruction with about 14 bits before promoting the sum to float.
template <class T, class TC = T>
void spot_check(shape_case const& c, std::vector<T> const& a, std::vector<T> const& b, std::vector<TC> const& got,
                std::string_view who) {
  std::uint64_t s = 12345;
  double const fp8_sums = mpx::dtype8<T> ? static_cast<double>(std::min<std::int64_t>(c.k, 128)) * 0x1p-14 : 0.0;
  double const bound = std::ldexp(1.0, -(mpx::dtype_traits<TC>::mantissa_bits + 1)) +
                       static_cast<double>(c.k + 4) * std::ldexp(1.0, std::is_same_v<T, float> ? -24 : -23) + fp8_sums;
  for (int t = 0; t < 64; ++t) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    auto const bi = static_cast<std::int64_t>((s >> 20) % static_cast<std::uint64_t>(c.batch));
    auto const i = static_cast<std::int64_t>((s >> 30) % static_cast<std::uint64_t>(c.m));
    auto const j = static_cast<std::int64_t>((s >> 4) % static_cast<std::uint64_t>(c.n));
    double exact = 0, scale = 0;
    for (std::int64_t k = 0; k < c.k; ++k) {
      std::size_t const ai = static_cast<std::size_t>(bi * c.m * c.k + (c.ta ? k * c.m + i : i * c.k + k));
      std::size_t const bj = static_cast<std::size_t>(bi * c.k * c.n + (c.tb ? j * c.k + k : k * c.n + j));
      double const p = mpx::detail::to_double(a[ai]) * mpx::detail::to_double(b[bj]);
      exact += p;
      scale += std::abs(p);
    }
    double const g = mpx::detail::to_double(got[static_cast<std::size_t>((bi * c.m + i) * c.n + j)]);
    if (!(std::abs(g - exact) <= bound * scale + 1e-30))
      throw mpx::error(std::string(who) + " " + c.name + " " + std::string(mpx::dtype_name<T>) +
                       ": C[" + std::to_string(bi) + "][" + std::to_string(i) + "][" + std::to_string(j) + "] = " +
                       std::to_string(g) + ", float64 says " + std::to_string(exact));
  }
}

mpx::shape operand_shape(std::int64_t batch, std::int64_t rows, std::int64_t cols) {
  return batch > 1 ? mpx::shape{batch, rows, cols} : mpx::shape{rows, cols};
}

#if MPX_HAS_CUDA
void check(cublasStatus_t status, char const* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw mpx::cublas_error(std::string(call) + " returned " + cublasGetStatusName(status),
                            static_cast<int>(status));
}

//! cuBLAS's own answer to the same row-major problem (column-major C^T = op(B)^T op(A)^T).
template <class T>
void cublas_reference(cublasHandle_t handle, shape_case const& c, T const* a, T const* b, T* out) {
  float const alpha = 1.0f, beta = 0.0f;
  cudaDataType_t const type = mpx::detail::cuda_data_type<T>;
  auto const m = static_cast<int>(c.m), n = static_cast<int>(c.n), k = static_cast<int>(c.k);
  cublasOperation_t const op_b = c.tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = c.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  int const ldb = c.tb ? k : n, lda = c.ta ? m : k;
  if (c.batch == 1) {
    check(cublasGemmEx(handle, op_b, op_a, n, m, k, &alpha, b, type, ldb, a, type, lda, &beta, out, type, n,
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx");
  } else {
    check(cublasGemmStridedBatchedEx(handle, op_b, op_a, n, m, k, &alpha, b, type, ldb, c.k * c.n, a, type, lda,
                                     c.m * c.k, &beta, out, type, n, c.m * c.n, static_cast<int>(c.batch),
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmStridedBatchedEx");
  }
}
#endif

//! The GPU's compute capability major (9 Hopper, 10 and up Blackwell); 0 on the host.
template <class Exec>
int device_generation([[maybe_unused]] Exec const& exec) {
#if MPX_HAS_CUDA
  if constexpr (mpx::is_cuda_executor_v<Exec>) {
    int device = 0, major = 0;
    MPX_CUDA_CHECK(cudaGetDevice(&device));
    MPX_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major;
  }
#endif
  return 0;
}

template <class Exec>
void run_all(Exec const& exec, options const& opt) {
  constexpr bool gpu = mpx::is_cuda_executor_v<Exec>;
#if MPX_HAS_CUDA
  cublasHandle_t handle = nullptr;
  if constexpr (gpu) {
    check(cublasCreate(&handle), "cublasCreate");
    check(cublasSetStream(handle, exec.stream()), "cublasSetStream");
  }
#endif
  std::printf("%-6s %-28s %-9s %22s %10s %10s %10s %8s\n", std::string(Exec::name).c_str(), "shape", "dtype",
              "batch x M x N x K", "time (us)", gpu ? "TFLOP/s" : "GFLOP/s", gpu ? "cuBLAS" : "", gpu ? "of it" : "");
  double bfloat16_rate = 0;  // this shape's bfloat16 row, which the fp8 row is compared with
  // mpx::fp8_gemm on e4m3 operands (scale 1: the values lie in [-1, 1)) in the layout
  // the GPU's fp8 kernels take, A [M, K] and B [N, K], into bfloat16; shapes the GPU
  // refuses (K or N not a multiple of mpx::fp8_gemm_multiple) are skipped on both executors.
  auto fp8_row = [&](shape_case const& c) {
    if (c.batch != 1 || c.k % mpx::fp8_gemm_multiple != 0 || c.n % mpx::fp8_gemm_multiple != 0) return;
    using F = mpx::float8_e4m3;
    shape_case const tn{c.name, 1, c.m, c.n, c.k, false, true};
    auto to_fp8 = [](std::vector<mpx::bfloat16> const& v) {
      std::vector<F> out(v.size());
      for (std::size_t i = 0; i < v.size(); ++i) out[i] = mpx::saturate_cast<F>(mpx::cast<float>(v[i]));
      return out;
    };
    auto const ha = to_fp8(random_operand<mpx::bfloat16>(static_cast<std::size_t>(c.m * c.k), 1));
    auto const hb = to_fp8(random_operand<mpx::bfloat16>(static_cast<std::size_t>(c.n * c.k), 2));
    auto a = mpx::make_tensor<F>(exec, {c.m, c.k});
    auto b = mpx::make_tensor<F>(exec, {c.n, c.k});
    auto out = mpx::make_tensor<mpx::bfloat16>(exec, {c.m, c.n});
    auto one = mpx::make_tensor<float>(exec, {1});
    float const unit = 1.0f;
    mpx::copy(exec, mpx::tensor_view<F const>(ha.data(), a.shape()), a);
    mpx::copy(exec, mpx::tensor_view<F const>(hb.data(), b.shape()), b);
    mpx::copy(exec, mpx::tensor_view<float const>(&unit, one.shape()), one);
    double const flops = 2.0 * static_cast<double>(c.m) * static_cast<double>(c.n * c.k);
    int const inner = gpu ? static_cast<int>(std::clamp(2e10 / flops, 1.0, 1000.0)) : 1;
    double const s = mpx_bench::median_seconds(
        exec, opt.repeat, [&] { mpx::fp8_gemm(exec, a, one.data(), b, one.data(), out, {.transpose_b = true}); }, inner);
    auto host_out = mpx::to_host(exec, out);
    spot_check(tn, ha, hb, std::vector<mpx::bfloat16>(host_out.begin(), host_out.end()), "mpx::fp8_gemm");
    double const rate = flops / s / (gpu ? 1e12 : 1e9);
    std::string const dims = "1x" + std::to_string(c.m) + "x" + std::to_string(c.n) + "x" + std::to_string(c.k) + " Bt";
    std::printf("%-6s %-28s %-9s %22s %10.1f %10.2f %10s %7.2fx  (of the bfloat16 row)\n",
                std::string(Exec::name).c_str(), c.name.c_str(), "e4m3", dims.c_str(), s * 1e6, rate, "",
                bfloat16_rate > 0 ? rate / bfloat16_rate : 0.0);
    std::fflush(stdout);
  };
  // The block-scaled recipes on the same bfloat16 operands: both quantized
  // (quantize_fp8_blocks: A in 1x128 blocks, B as a weight in 128x128 tiles; or both
  // rowwise; or both in MXFP8's 1x32 blocks) and multiplied (fp8_block_gemm), the three calls timed together, as a layer
  // runs them. Checked against float64 of the bfloat16 data within e4m3's rounding of
  // both operands (2^-4 each, plus the sums): a scale applied wrongly is off by far more.
  // A block row that fails (never run on a GPU before: cuBLASLt may refuse a layout, or a
  // scale layout may be read otherwise than mpx writes it) prints its error and the run
  // goes on, so one GPU run still measures the rest; the program then exits non-zero.
  std::size_t block_failures = 0;
  // Spot-checks a block row's product against float64 of the bfloat16 data (within
  // `tolerance` of the sum of the terms' magnitudes) and prints its rate.
  auto report_block_row = [&](shape_case const& c, char const* label, std::vector<mpx::bfloat16> const& ha,
                              std::vector<mpx::bfloat16> const& hb, auto const& out, double s, double tolerance) {
    auto host_out = mpx::to_host(exec, out);
    std::vector<mpx::bfloat16> const got(host_out.begin(), host_out.end());
    std::uint64_t seed = 777;
    for (int t = 0; t < 64; ++t) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      auto const i = static_cast<std::int64_t>((seed >> 30) % static_cast<std::uint64_t>(c.m));
      auto const j = static_cast<std::int64_t>((seed >> 4) % static_cast<std::uint64_t>(c.n));
      double exact = 0, scale = 0;
      for (std::int64_t k = 0; k < c.k; ++k) {
        double const p = mpx::detail::to_double(ha[static_cast<std::size_t>(i * c.k + k)]) *
                         mpx::detail::to_double(hb[static_cast<std::size_t>(k * c.n + j)]);
        exact += p;
        scale += std::abs(p);
      }
      double const g = mpx::detail::to_double(got[static_cast<std::size_t>(i * c.n + j)]);
      if (!(std::abs(g - exact) <= tolerance * scale + 1e-30))
        throw mpx::error(std::string("mpx::fp8_block_gemm ") + label + " " + c.name + ": C[" + std::to_string(i) +
                         "][" + std::to_string(j) + "] = " + std::to_string(g) + ", float64 says " +
                         std::to_string(exact));
    }
    double const flops = 2.0 * static_cast<double>(c.m) * static_cast<double>(c.n * c.k);
    double const rate = flops / s / (gpu ? 1e12 : 1e9);
    std::string const dims = "1x" + std::to_string(c.m) + "x" + std::to_string(c.n) + "x" + std::to_string(c.k);
    std::printf("%-6s %-28s %-9s %22s %10.1f %10.2f %10s %7.2fx  (of the bfloat16 row; quantize included)\n",
                std::string(Exec::name).c_str(), c.name.c_str(), label, dims.c_str(), s * 1e6, rate, "",
                bfloat16_rate > 0 ? rate / bfloat16_rate : 0.0);
    std::fflush(stdout);
  };
  auto block_row_once = [&](shape_case const& c, mpx::fp8_block_kind a_kind, mpx::fp8_block_kind b_kind,
                            char const* label, auto mx) {
    if (c.batch != 1 || c.n % mpx::fp8_gemm_multiple != 0) return;
    using F = mpx::float8_e4m3;
    using space = mpx::memory_space_t<Exec>;
    shape_case const tn{c.name, 1, c.m, c.n, c.k, false, false};
    auto const ha = random_operand<mpx::bfloat16>(static_cast<std::size_t>(c.m * c.k), 1);
    auto const hb = random_operand<mpx::bfloat16>(static_cast<std::size_t>(c.k * c.n), 2);  // [K, N], a weight
    auto a = mpx::make_tensor<mpx::bfloat16>(exec, {c.m, c.k});
    auto b = mpx::make_tensor<mpx::bfloat16>(exec, {c.k, c.n});
    mpx::copy(exec, mpx::tensor_view<mpx::bfloat16 const>(ha.data(), a.shape()), a);
    mpx::copy(exec, mpx::tensor_view<mpx::bfloat16 const>(hb.data(), b.shape()), b);
    mpx::fp8_block_scale_layout const la{a_kind, c.m, c.k}, lb{b_kind, c.n, c.k};
    // MXFP8's scales are E8M0 bytes, the others floats.
    using S = std::conditional_t<decltype(mx)::value, mpx::float8_e8m0, float>;
    auto aq = mpx::make_tensor<F>(exec, {c.m, la.padded_k()});
    auto bq = mpx::make_tensor<F>(exec, {c.n, lb.padded_k()});
    auto as = mpx::make_tensor<S>(exec, {la.count()});
    auto bs = mpx::make_tensor<S>(exec, {lb.count()});
    auto out = mpx::make_tensor<mpx::bfloat16>(exec, {c.m, c.n});
    bool const pow2 = a_kind != mpx::fp8_block_kind::row;
    double const flops = 2.0 * static_cast<double>(c.m) * static_cast<double>(c.n * c.k);
    int const inner = gpu ? static_cast<int>(std::clamp(2e10 / flops, 1.0, 1000.0)) : 1;
    double const s = mpx_bench::median_seconds(
        exec, opt.repeat,
        [&] {
          mpx::quantize_fp8_blocks<F>(exec, a, true, a_kind, pow2, aq, as);
          mpx::quantize_fp8_blocks<F>(exec, b, false, b_kind, pow2, bq, bs);
          mpx::fp8_block_gemm(exec, mpx::fp8_block_operand<F, space, S>{mpx::view(aq), mpx::view(as), la},
                              mpx::fp8_block_operand<F, space, S>{mpx::view(bq), mpx::view(bs), lb}, out);
        },
        inner);
    report_block_row(c, label, ha, hb, out, s, 0.14);
  };
  // NVFP4 on the same operands: both through quantize_nvfp4 (B as a weight, in 16x16
  // blocks) and multiplied. e2m1 keeps 2 significant bits: the check allows half of
  // the terms' magnitudes (a decode factor or a scale applied wrongly is off by more
  // than that on these shapes' sums).
  auto nvfp4_row_once = [&](shape_case const& c) {
    if (c.batch != 1 || c.n % mpx::fp8_gemm_multiple != 0) return;
    using space = mpx::memory_space_t<Exec>;
    auto const ha = random_operand<mpx::bfloat16>(static_cast<std::size_t>(c.m * c.k), 1);
    auto const hb = random_operand<mpx::bfloat16>(static_cast<std::size_t>(c.k * c.n), 2);
    auto a = mpx::make_tensor<mpx::bfloat16>(exec, {c.m, c.k});
    auto b = mpx::make_tensor<mpx::bfloat16>(exec, {c.k, c.n});
    mpx::copy(exec, mpx::tensor_view<mpx::bfloat16 const>(ha.data(), a.shape()), a);
    mpx::copy(exec, mpx::tensor_view<mpx::bfloat16 const>(hb.data(), b.shape()), b);
    mpx::fp8_block_scale_layout const la{mpx::fp8_block_kind::vec16, c.m, c.k}, lb{mpx::fp8_block_kind::vec16, c.n, c.k};
    auto aq = mpx::make_tensor<mpx::float4_e2m1x2>(exec, {c.m, la.padded_k() / 2});
    auto bq = mpx::make_tensor<mpx::float4_e2m1x2>(exec, {c.n, lb.padded_k() / 2});
    auto as = mpx::make_tensor<mpx::float8_e4m3>(exec, {la.count()});
    auto bs = mpx::make_tensor<mpx::float8_e4m3>(exec, {lb.count()});
    auto at = mpx::make_tensor<float>(exec, {mpx::nvfp4_tensor_scale_slots});
    auto bt = mpx::make_tensor<float>(exec, {mpx::nvfp4_tensor_scale_slots});
    auto out = mpx::make_tensor<mpx::bfloat16>(exec, {c.m, c.n});
    double const flops = 2.0 * static_cast<double>(c.m) * static_cast<double>(c.n * c.k);
    int const inner = gpu ? static_cast<int>(std::clamp(2e10 / flops, 1.0, 1000.0)) : 1;
    double const s = mpx_bench::median_seconds(
        exec, opt.repeat,
        [&] {
          mpx::quantize_nvfp4(exec, a, true, {}, aq, as, at);
          mpx::quantize_nvfp4(exec, b, false, {.square_blocks = true}, bq, bs, bt);
          mpx::fp8_block_gemm(exec, mpx::nvfp4_operand<space>{mpx::view(aq), mpx::view(as), la, mpx::view(at)},
                              mpx::nvfp4_operand<space>{mpx::view(bq), mpx::view(bs), lb, mpx::view(bt)}, out);
        },
        inner);
    report_block_row(c, "e2m1 nv", ha, hb, out, s, 0.5);
  };
  auto block_row = [&](shape_case const& c, mpx::fp8_block_kind a_kind, mpx::fp8_block_kind b_kind,
                       char const* label) {
    bool const mx = a_kind == mpx::fp8_block_kind::vec32 || a_kind == mpx::fp8_block_kind::vec16;
    int const major = device_generation(exec);
    if (gpu && (mx ? major < 10 : major != 9)) {  // cuBLASLt has these scale modes on one generation
      std::printf("%-6s %-28s %-9s skipped: cuBLASLt runs it on %s, this device is sm_%dx\n",
                  std::string(Exec::name).c_str(), c.name.c_str(), label,
                  mx ? "Blackwell (sm_100) and newer" : "Hopper (sm_90)", major);
      return;
    }
    try {
      if (a_kind == mpx::fp8_block_kind::vec16) nvfp4_row_once(c);
      else if (mx) block_row_once(c, a_kind, b_kind, label, std::true_type{});
      else block_row_once(c, a_kind, b_kind, label, std::false_type{});
    } catch (mpx::error const& e) {
      ++block_failures;
      std::printf("%-6s %-28s %-9s FAILED: %s\n", std::string(Exec::name).c_str(), c.name.c_str(), label, e.what());
      std::fflush(stdout);
    }
  };
  for (shape_case const& c : cases(opt, gpu)) {
    auto for_type = [&](auto tag) {
      using T = decltype(tag);
      using P = typename policy_for<T>::type;
      auto const a_shape = operand_shape(c.batch, c.ta ? c.k : c.m, c.ta ? c.m : c.k);
      auto const b_shape = operand_shape(c.batch, c.tb ? c.n : c.k, c.tb ? c.k : c.n);
      auto const c_shape = operand_shape(c.batch, c.m, c.n);
      auto const ha = random_operand<T>(a_shape.size(), 1);
      auto const hb = random_operand<T>(b_shape.size(), 2);
      auto a = mpx::make_tensor<T>(exec, a_shape);
      auto b = mpx::make_tensor<T>(exec, b_shape);
      auto out = mpx::make_tensor<T>(exec, c_shape);
      mpx::copy(exec, mpx::tensor_view<T const>(ha.data(), a_shape), a);
      mpx::copy(exec, mpx::tensor_view<T const>(hb.data(), b_shape), b);
      double const flops = 2.0 * static_cast<double>(c.batch * c.m) * static_cast<double>(c.n * c.k);
      int const inner = gpu ? static_cast<int>(std::clamp(2e10 / flops, 1.0, 1000.0)) : 1;
      mpx::gemm_options const o{.transpose_a = c.ta, .transpose_b = c.tb};
      double const s = mpx_bench::median_seconds(exec, opt.repeat, [&] { mpx::gemm<P>(exec, a, b, out, o); }, inner);
      auto host_out = mpx::to_host(exec, out);
      spot_check(c, ha, hb, std::vector<T>(host_out.begin(), host_out.end()), "mpx::gemm");
      double const rate = flops / s / (gpu ? 1e12 : 1e9);
      if constexpr (std::is_same_v<T, mpx::bfloat16>) bfloat16_rate = rate;
      std::string const dims = std::to_string(c.batch) + "x" + std::to_string(c.m) + "x" + std::to_string(c.n) + "x" +
                               std::to_string(c.k) + (c.ta ? " At" : "") + (c.tb ? " Bt" : "");
      std::printf("%-6s %-28s %-9s %22s %10.1f %10.2f", std::string(Exec::name).c_str(), c.name.c_str(),
                  std::string(mpx::dtype_name<T>).c_str(), dims.c_str(), s * 1e6, rate);
#if MPX_HAS_CUDA
      if constexpr (gpu) {
        auto ref = mpx::make_tensor<T>(exec, c_shape);
        double const rs = mpx_bench::median_seconds(
            exec, opt.repeat, [&] { cublas_reference(handle, c, a.data(), b.data(), ref.data()); }, inner);
        auto host_ref = mpx::to_host(exec, ref);
        spot_check(c, ha, hb, std::vector<T>(host_ref.begin(), host_ref.end()), "cublasGemmEx");
        double const ref_rate = flops / rs / 1e12;
        std::printf(" %10.2f %7.1f%%", ref_rate, 100.0 * rate / ref_rate);
      }
#endif
      std::printf("\n");
      std::fflush(stdout);
    };
    for_type(mpx::half{});
    bfloat16_rate = 0;
    for_type(mpx::bfloat16{});
    for_type(float{});
    fp8_row(c);
    block_row(c, mpx::fp8_block_kind::vec128, mpx::fp8_block_kind::tile128, "e4m3 blk");
    block_row(c, mpx::fp8_block_kind::row, mpx::fp8_block_kind::row, "e4m3 row");
    block_row(c, mpx::fp8_block_kind::vec32, mpx::fp8_block_kind::vec32, "e4m3 mx");
    block_row(c, mpx::fp8_block_kind::vec16, mpx::fp8_block_kind::vec16, "e2m1 nv");
  }
#if MPX_HAS_CUDA
  if constexpr (gpu) check(cublasDestroy(handle), "cublasDestroy");
#endif
  if (block_failures > 0)
    throw mpx::error("gemm_bench: " + std::to_string(block_failures) + " block-scaled row(s) failed (above)");
}

}  // namespace

int main(int argc, char** argv) try {
  options opt;
  mpx_programs::command_line args(argc, argv,
                                  "[--executor host|cuda|all] [--repeat R] [--max-square N] [--shapes squares|layers|all]");
  while (args.next()) {
    if (args.is("--executor")) opt.executor = args.choice({"host", "cuda", "all"});
    else if (args.is("--repeat")) opt.repeat = args.whole<int>(1, 10'000);
    else if (args.is("--max-square")) opt.max_square = args.whole<std::int64_t>(1, 65536);
    else if (args.is("--shapes")) opt.shapes = args.choice({"squares", "layers", "all"});
    else args.unknown();
  }
  std::printf("median of %d runs; host path: %s\n", opt.repeat,
              mpx::gemm_host_library);
  return mpx_bench::run_on_executors(opt.executor, [&](auto const& exec) { run_all(exec, opt); });
} catch (...) {
  return mpx_programs::report_failure("gemm_bench");
}
