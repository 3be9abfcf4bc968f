// Microbenchmark of the layer kernels that no other benchmark covers, for half, bfloat16
// and float: layer normalisation and training-mode batch normalisation (forward and
// backward), dropout with a mask, max pooling (forward and backward) in GB/s beside a
// copy of the same byte count measured in the same run; the convolutions (forward, both
// gradients) in TFLOP/s beside mpx::gemm alone on the same matrix shapes; the LSTM's
// sequence pass and backpropagation through time in time per step and TFLOP/s.
//
//   layer_bench [--executor host|cuda|all] [--repeat R] [--small] [--rows R] [--cols C]
//               [--lstm-steps T[,T...]] [--lstm-units U[,U...]] [--only norm,dropout,pool,conv,lstm]
//
// Sizes depend on the executor (large on the GPU, a few seconds' worth on the host) and
// --small shrinks them for CI. Every output is checked to be finite and not all zero
// before its row prints: a benchmark of a broken result measures nothing. Build with nvcc
// (layer_bench.cu) for the CUDA rows; bench/NOTES.md has the byte and flop counts, the
// predictions and the results.
#include <mpx/mpx.hpp>

#include "executors.hpp"
#include "tensors.hpp"
#include "timing.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace {

using mpx_bench::check_output;
using mpx_bench::median_seconds;
using mpx_bench::policy_for;
using mpx_bench::random_tensor;
using mpx_bench::shape_text;

struct options {
  std::string executor = "all";
  int repeat = 5;
  bool small = false;
  std::int64_t rows = 0, cols = 0;  // 0: the executor's default
  std::vector<std::int64_t> lstm_steps, lstm_units;
  std::string only = "norm,dropout,pool,conv,lstm";
  [[nodiscard]] bool wants(std::string_view part) const { return only.find(part) != std::string::npos; }
};

//! The extents of one run: large on the GPU (every tensor well past the H100's 50 MB
//! L2), seconds' worth on the host, a fraction of a second with --small.
struct sizes {
  std::int64_t rows, cols;                   // layer norm (also at rows * cols / 1024 x 1024) and dropout
  std::int64_t bn_n, bn_h, bn_w, bn_c;       // batch norm over NHWC, normalised as [N*H*W, C]
  std::int64_t pool_n, pool_h, pool_w, pool_c;
  std::int64_t fmnist_batch, resnet_batch;   // resnet_batch 0: no ResNet-like row
  std::int64_t lstm_batch, lstm_features;
  std::vector<std::int64_t> lstm_steps, lstm_units;
};

sizes sizes_for(options const& opt, bool gpu) {
  sizes s{};
  if (opt.small) {
    s = {256, 1024, 4, 16, 16, 64, 4, 28, 28, 32, 8, 1, 8, 32, {10}, {32}};
  } else if (gpu) {
    s = {8192, 4096, 128, 56, 56, 64, 64, 112, 112, 64, 128, 32, 64, 32, {10, 30, 100}, {32, 64, 128, 256}};
  } else {
    s = {512, 4096, 4, 56, 56, 64, 4, 112, 112, 64, 128, 1, 64, 32, {10, 100}, {32, 128}};
  }
  if (opt.rows) s.rows = opt.rows;
  if (opt.cols) s.cols = opt.cols;
  if (!opt.lstm_steps.empty()) s.lstm_steps = opt.lstm_steps;
  if (!opt.lstm_units.empty()) s.lstm_units = opt.lstm_units;
  return s;
}

template <class Exec>
auto filled(Exec const& exec, mpx::shape const& shape, float value) {
  auto out = mpx::make_tensor<float>(exec, shape);
  mpx::fill(exec, out, value);
  return out;
}

//! GB/s of a copy that reads half of `bytes` and writes the other half (the convention
//! of every GB/s here: each byte read and each byte written counts once), measured once
//! per byte count in this run: memcpy on the host, a device-to-device cudaMemcpyAsync
//! on the GPU.
template <class Exec>
class copy_reference {
 public:
  copy_reference(Exec const& exec, int repeat) : exec_(exec), repeat_(repeat) {}

  double gbps(double bytes) {
    auto const elements = std::max<std::int64_t>(1, static_cast<std::int64_t>(bytes / 8.0));
    auto const found = measured_.find(elements);
    if (found != measured_.end()) return found->second;
    if (elements > capacity_) {
      src_ = mpx::make_tensor<float>(exec_, {elements});
      dst_ = mpx::make_tensor<float>(exec_, {elements});
      mpx::fill(exec_, src_, 0.5f);
      mpx::fill(exec_, dst_, 0.0f);
      capacity_ = elements;
    }
    auto const src = mpx::view(src_).flat(0, static_cast<std::size_t>(elements));
    auto const dst = mpx::view(dst_).flat(0, static_cast<std::size_t>(elements));
    double const s = median_seconds(exec_, repeat_, [&] { mpx::copy(exec_, src, dst); });
    double const rate = 8.0 * static_cast<double>(elements) / s / 1e9;
    measured_.emplace(elements, rate);
    return rate;
  }

 private:
  Exec exec_;
  int repeat_;
  std::int64_t capacity_ = 0;
  mpx::tensor<float, mpx::memory_space_t<Exec>> src_, dst_;
  std::map<std::int64_t, double> measured_;
};

void print_bandwidth_header(std::string_view exec) {
  std::printf("\n%-6s %-32s %-9s %-16s %10s %6s %8s %9s %8s %8s\n", std::string(exec).c_str(), "op", "dtype",
              "shape", "time (us)", "B/elem", "GB/s", "copy GB/s", "of copy", "1-pass");
}

//! One row of a memory-bound op: `bytes` is what the kernels move (every pass counted),
//! `one_pass_bytes` what a single fused pass would; "1-pass" is the time a copy of those
//! takes over the time measured (equal to "of copy" where the two counts agree).
template <class Exec>
void print_bandwidth_row(copy_reference<Exec>& copy, std::string_view op, std::string_view dtype,
                         std::string const& shape, double elements, double bytes, double one_pass_bytes,
                         double seconds) {
  double const gbps = bytes / seconds / 1e9;
  double const copy_gbps = copy.gbps(bytes);
  double const one_pass_share = one_pass_bytes / copy.gbps(one_pass_bytes) / 1e9 / seconds;
  std::printf("%-6s %-32s %-9s %-16s %10.1f %6.2f %8.1f %9.1f %7.1f%% %7.1f%%\n", std::string(Exec::name).c_str(),
              std::string(op).c_str(), std::string(dtype).c_str(), shape.c_str(), seconds * 1e6, bytes / elements,
              gbps, copy_gbps, 100.0 * gbps / copy_gbps, 100.0 * one_pass_share);
  std::fflush(stdout);
}

// ---- layer norm, batch norm, dropout ----

template <class T, class Exec>
void bench_layer_norm(Exec const& exec, options const& opt, copy_reference<Exec>& copy, std::int64_t rows,
                      std::int64_t cols) {
  using P = typename policy_for<T>::type;
  auto const name = mpx::dtype_name<T>;
  double const t = sizeof(T), n = static_cast<double>(rows * cols);
  auto x = random_tensor<T>(exec, {rows, cols}, 1);
  auto dy = random_tensor<T>(exec, {rows, cols}, 2);
  auto y = mpx::make_tensor<T>(exec, {rows, cols});
  auto dx = mpx::make_tensor<T>(exec, {rows, cols});
  auto gamma = filled(exec, {cols}, 1.0f), beta = filled(exec, {cols}, 0.0f);
  auto mean = filled(exec, {rows}, 0.0f), rstd = filled(exec, {rows}, 0.0f);
  auto dgamma = filled(exec, {cols}, 0.0f), dbeta = filled(exec, {cols}, 0.0f);
  std::string const shape = shape_text({rows, cols});
  // Forward: one kernel, a warp per row; x is read three times, the 2nd and 3rd from L1/L2.
  double const fwd = median_seconds(exec, opt.repeat, [&] { mpx::layer_norm_forward<P>(exec, x, gamma, beta, y, mean, rstd); });
  check_output(exec, y, "layer_norm_forward y");
  print_bandwidth_row(copy, "layer_norm forward", name, shape, n, 2 * t * n, 2 * t * n, fwd);
  // Backward: the column sums (dgamma, dbeta) read x and dy; the row kernel reads them
  // again and writes dx. A fused pass would read x, dy and write dx once.
  double const bwd = median_seconds(
      exec, opt.repeat, [&] { mpx::layer_norm_backward<P>(exec, x, dy, gamma, mean, rstd, dx, dgamma, dbeta); });
  check_output(exec, dx, "layer_norm_backward dx");
  check_output(exec, dgamma, "layer_norm_backward dgamma");
  print_bandwidth_row(copy, "layer_norm backward", name, shape, n, 5 * t * n, 3 * t * n, bwd);
}

template <class T, class Exec>
void bench_batch_norm(Exec const& exec, options const& opt, copy_reference<Exec>& copy, sizes const& s) {
  using P = typename policy_for<T>::type;
  auto const name = mpx::dtype_name<T>;
  mpx::shape const xs{s.bn_n, s.bn_h, s.bn_w, s.bn_c};
  double const t = sizeof(T), n = static_cast<double>(xs.size());
  auto x = random_tensor<T>(exec, xs, 3);
  auto dy = random_tensor<T>(exec, xs, 4);
  auto y = mpx::make_tensor<T>(exec, xs);
  auto dx = mpx::make_tensor<T>(exec, xs);
  mpx::shape const c{s.bn_c};
  auto gamma = filled(exec, c, 1.0f), beta = filled(exec, c, 0.0f);
  auto running_mean = filled(exec, c, 0.0f), running_var = filled(exec, c, 1.0f);
  auto save_mean = filled(exec, c, 0.0f), save_invstd = filled(exec, c, 0.0f);
  auto dgamma = filled(exec, c, 0.0f), dbeta = filled(exec, c, 0.0f);
  std::string const shape = shape_text({s.bn_n, s.bn_h, s.bn_w, s.bn_c});
  // Training forward: two column passes (mean, then squared deviations) read x, then the
  // apply pass reads x and writes y. One pass over x for the statistics (Welford) plus
  // the apply pass would move 3T; 2T is the floor.
  double const fwd = median_seconds(exec, opt.repeat, [&] {
    mpx::batch_norm_forward_training<P>(exec, x, gamma, beta, y, running_mean, running_var, save_mean, save_invstd);
  });
  check_output(exec, y, "batch_norm_forward_training y");
  print_bandwidth_row(copy, "batch_norm train forward", name, shape, n, 4 * t * n, 2 * t * n, fwd);
  double const bwd = median_seconds(exec, opt.repeat, [&] {
    mpx::batch_norm_backward<P>(exec, x, dy, gamma, save_mean, save_invstd, dx, dgamma, dbeta);
  });
  check_output(exec, dx, "batch_norm_backward dx");
  print_bandwidth_row(copy, "batch_norm backward", name, shape, n, 5 * t * n, 3 * t * n, bwd);
}

template <class T, class Exec>
void bench_dropout(Exec const& exec, options const& opt, copy_reference<Exec>& copy, std::int64_t rows,
                   std::int64_t cols) {
  auto const name = mpx::dtype_name<T>;
  double const t = sizeof(T), n = static_cast<double>(rows * cols);
  auto x = random_tensor<T>(exec, {rows, cols}, 5);
  auto y = mpx::make_tensor<T>(exec, {rows, cols});
  auto dx = mpx::make_tensor<T>(exec, {rows, cols});
  auto mask = mpx::make_tensor<std::uint8_t>(exec, {rows, cols});
  mpx::dropout_options const o{.rate = 0.1f, .seed = 42, .offset = 7};
  std::string const shape = shape_text({rows, cols});
  double const fwd = median_seconds(exec, opt.repeat, [&] { mpx::dropout_forward(exec, o, x, y, mask); });
  check_output(exec, y, "dropout_forward y");
  print_bandwidth_row(copy, "dropout forward + mask", name, shape, n, 2 * t * n + n, 2 * t * n + n, fwd);
  double const bwd = median_seconds(exec, opt.repeat, [&] { mpx::dropout_backward(exec, o, y, dx, mask); });
  check_output(exec, dx, "dropout_backward dx");
  print_bandwidth_row(copy, "dropout backward (stored mask)", name, shape, n, 2 * t * n + n, 2 * t * n + n, bwd);
  double const regen = median_seconds(exec, opt.repeat, [&] { mpx::dropout_backward(exec, o, y, dx); });
  check_output(exec, dx, "dropout_backward dx");
  print_bandwidth_row(copy, "dropout backward (regenerated)", name, shape, n, 2 * t * n, 2 * t * n, regen);
}

// ---- max pooling ----

template <class T, class Exec>
void bench_max_pool(Exec const& exec, options const& opt, copy_reference<Exec>& copy, sizes const& s,
                    mpx::pool_options const& po, std::string_view label) {
  bool constexpr gpu = !mpx::is_host_executor_v<Exec>;
  auto const name = mpx::dtype_name<T>;
  mpx::shape const xs{s.pool_n, s.pool_h, s.pool_w, s.pool_c};
  mpx::shape const ys = mpx::max_pool2d_output_shape(xs, po);
  double const t = sizeof(T), nx = static_cast<double>(xs.size()), ny = static_cast<double>(ys.size());
  auto x = random_tensor<T>(exec, xs, 6);
  auto dy = random_tensor<T>(exec, ys, 7);
  auto y = mpx::make_tensor<T>(exec, ys);
  auto dx = mpx::make_tensor<T>(exec, xs);
  std::string const shape = shape_text({s.pool_n, s.pool_h, s.pool_w, s.pool_c});
  // Forward: read x once (overlapping windows re-read from L1/L2), write y.
  double const fwd = median_seconds(exec, opt.repeat, [&] { mpx::max_pool2d_forward(exec, x, y, po); });
  check_output(exec, y, "max_pool2d_forward y");
  double const fwd_bytes = t * (nx + ny);
  print_bandwidth_row(copy, std::string("max_pool ") + std::string(label) + " forward", name, shape, nx, fwd_bytes,
                      fwd_bytes, fwd);
  // Backward: the GPU's gather reads x (its windows' scans from L1/L2), y and dy, writes
  // dx; the host's scatter does not read y.
  double const bwd = median_seconds(exec, opt.repeat, [&] { mpx::max_pool2d_backward(exec, x, y, dy, dx, po); });
  check_output(exec, dx, "max_pool2d_backward dx");
  double const bwd_bytes = t * (2 * nx + (gpu ? 2 : 1) * ny);
  print_bandwidth_row(copy, std::string("max_pool ") + std::string(label) + " backward", name, shape, nx, bwd_bytes,
                      t * (2 * nx + ny), bwd);
}

// ---- convolutions ----

struct conv_case {
  std::string name;
  std::int64_t n, h, w, cin, k, cout;
  bool same;  // Keras padding='same' (else 'valid')
};

template <class Exec>
void bench_conv(Exec const& exec, options const& opt, sizes const& s) {
  bool constexpr gpu = !mpx::is_host_executor_v<Exec>;
  std::vector<conv_case> cases = {{"fmnist conv1", s.fmnist_batch, 28, 28, 1, 3, 32, false},
                                  {"fmnist conv2", s.fmnist_batch, 13, 13, 32, 3, 64, false}};
  if (s.resnet_batch > 0) cases.push_back({"resnet 56x56x64", s.resnet_batch, 56, 56, 64, 3, 64, true});
  char const* const unit = gpu ? "TFLOP/s" : "GFLOP/s";
  std::printf("\n%-6s %-38s %-9s %-16s %10s %9s %10s %9s %9s\n", std::string(Exec::name).c_str(), "conv", "dtype",
              "N x H x W x Cin", "time (us)", unit, "gemm (us)", "conv/gemm", "not gemm");
  for (conv_case const& c : cases) {
    auto for_type = [&](auto tag) {
      using T = decltype(tag);
      using P = typename policy_for<T>::type;
      auto const name = mpx::dtype_name<T>;
      mpx::shape const xs{c.n, c.h, c.w, c.cin}, ws{c.k, c.k, c.cin, c.cout};
      mpx::conv2d_options const o = c.same ? mpx::conv2d_padding_same(xs, ws) : mpx::conv2d_options{};
      mpx::shape const ys = mpx::conv2d_output_shape(xs, ws, o);
      mpx::shape const cs = mpx::conv2d_workspace_shape(xs, ws, o);  // the whole batch: [N*OH*OW, KH*KW*Cin]
      auto x = random_tensor<T>(exec, xs, 8);
      auto w = random_tensor<T>(exec, ws, 9, 1.0f / std::sqrt(static_cast<float>(cs[1])));
      auto dy = random_tensor<T>(exec, ys, 10);
      auto y = mpx::make_tensor<T>(exec, ys);
      auto dx = mpx::make_tensor<T>(exec, xs);
      auto dw = mpx::make_tensor<T>(exec, ws);
      auto columns = mpx::make_tensor<T>(exec, cs);
      // The same products mpx::gemm runs inside, on the same tensors.
      auto const cols = mpx::view(columns);
      auto const wm = mpx::view(w).reshape({cs[1], c.cout});
      auto const ym = mpx::view(y).reshape({cs[0], c.cout});
      auto const dym = mpx::view(dy).reshape({cs[0], c.cout});
      auto const dwm = mpx::view(dw).reshape({cs[1], c.cout});
      double const flops = 2.0 * static_cast<double>(cs[0]) * static_cast<double>(c.cout) * static_cast<double>(cs[1]);
      std::string const shape = shape_text({c.n, c.h, c.w, c.cin});
      int const inner = gpu ? static_cast<int>(std::clamp(2e10 / flops, 1.0, 200.0)) : 1;
      auto row = [&](std::string const& what, double conv_s, double gemm_s) {
        std::printf("%-6s %-38s %-9s %-16s %10.1f %9.2f %10.1f %9.2f %8.1f%%\n", std::string(Exec::name).c_str(),
                    (c.name + " " + what).c_str(), std::string(name).c_str(), shape.c_str(), conv_s * 1e6,
                    flops / conv_s / (gpu ? 1e12 : 1e9), gemm_s * 1e6, conv_s / gemm_s,
                    100.0 * (1.0 - gemm_s / conv_s));
        std::fflush(stdout);
      };
      double const fwd = median_seconds(exec, opt.repeat, [&] { mpx::conv2d_forward<P>(exec, x, w, y, columns, o); }, inner);
      check_output(exec, y, "conv2d_forward y");
      double const fwd_gemm = median_seconds(exec, opt.repeat, [&] { mpx::gemm<P>(exec, cols, wm, ym); }, inner);
      row("fwd", fwd, fwd_gemm);
      // The workspace still holds the forward columns: reuse them, then recompute them.
      double const bww_reuse = median_seconds(exec, opt.repeat, [&] {
        mpx::conv2d_backward_weights<P>(exec, x, dy, dw, columns, o, mpx::conv2d_columns::reuse_forward);
      }, inner);
      check_output(exec, dw, "conv2d_backward_weights dw");
      double const bww = median_seconds(exec, opt.repeat,
                                        [&] { mpx::conv2d_backward_weights<P>(exec, x, dy, dw, columns, o); }, inner);
      double const bww_gemm = median_seconds(
          exec, opt.repeat, [&] { mpx::gemm<P>(exec, cols, dym, dwm, {.transpose_a = true}); }, inner);
      row("dW (im2col again)", bww, bww_gemm);
      row("dW (forward's columns)", bww_reuse, bww_gemm);
      double const bwd = median_seconds(exec, opt.repeat,
                                        [&] { mpx::conv2d_backward_data<P>(exec, dy, w, dx, columns, o); }, inner);
      check_output(exec, dx, "conv2d_backward_data dx");
      double const bwd_gemm = median_seconds(
          exec, opt.repeat, [&] { mpx::gemm<P>(exec, dym, wm, cols, {.transpose_b = true}); }, inner);
      row("dX (gemm + col2im)", bwd, bwd_gemm);
    };
    for_type(mpx::half{});
    for_type(mpx::bfloat16{});
    for_type(float{});
  }
}

// ---- LSTM ----

template <class Exec>
void bench_lstm(Exec const& exec, options const& opt, sizes const& s) {
  bool constexpr gpu = !mpx::is_host_executor_v<Exec>;
  char const* const unit = gpu ? "TFLOP/s" : "GFLOP/s";
  std::printf("\n%-6s %-14s %-9s %-16s %10s %10s %9s %10s %10s %9s\n", std::string(Exec::name).c_str(), "lstm",
              "dtype", "N x T x F x U", "fwd (us)", "us/step", unit, "bwd (us)", "us/step", unit);
  std::int64_t const n = s.lstm_batch, f = s.lstm_features;
  for (std::int64_t const u : s.lstm_units)
    for (std::int64_t const steps : s.lstm_steps) {
      auto for_type = [&](auto tag) {
        using T = decltype(tag);
        using P = typename policy_for<T>::type;
        auto x = random_tensor<T>(exec, {n, steps, f}, 11);
        auto w = random_tensor<T>(exec, {f, 4 * u}, 12, 1.0f / std::sqrt(static_cast<float>(f)));
        auto r = random_tensor<T>(exec, {u, 4 * u}, 13, 1.0f / std::sqrt(static_cast<float>(u)));
        auto b = filled(exec, {4 * u}, 0.0f);
        auto h = mpx::make_tensor<T>(exec, {n, steps, u});
        auto dh = random_tensor<T>(exec, {n, steps, u}, 14);
        auto dx = mpx::make_tensor<T>(exec, {n, steps, f});
        auto dw = filled(exec, {f, 4 * u}, 0.0f);
        auto dr = filled(exec, {u, 4 * u}, 0.0f);
        auto db = filled(exec, {4 * u}, 0.0f);
        auto workspace = mpx::make_tensor<float>(
            exec, {static_cast<std::int64_t>(mpx::lstm_workspace_elements<P>(n, steps, f, u))});
        // x W for all steps and h R per step; backward: dx, dh, dW and dR, twice that.
        double const fwd_flops = 2.0 * static_cast<double>(n * steps * 4 * u) * static_cast<double>(f + u);
        double const scale = gpu ? 1e12 : 1e9;
        double const fwd = median_seconds(exec, opt.repeat, [&] { mpx::lstm_forward<P>(exec, x, w, r, b, h, workspace); });
        check_output(exec, h, "lstm_forward h");
        // The workspace holds the forward pass's states; backward may run from it again.
        double const bwd = median_seconds(exec, opt.repeat,
                                          [&] { mpx::lstm_backward<P>(exec, dh, w, r, dx, dw, dr, db, workspace); });
        check_output(exec, dx, "lstm_backward dx");
        check_output(exec, dr, "lstm_backward drecurrent_kernel");
        auto const st = static_cast<double>(steps);
        std::printf("%-6s %-14s %-9s %-16s %10.1f %10.2f %9.3f %10.1f %10.2f %9.3f\n", std::string(Exec::name).c_str(),
                    "lstm", std::string(mpx::dtype_name<T>).c_str(), shape_text({n, steps, f, u}).c_str(), fwd * 1e6,
                    fwd * 1e6 / st, fwd_flops / fwd / scale, bwd * 1e6, bwd * 1e6 / st, 2 * fwd_flops / bwd / scale);
        std::fflush(stdout);
      };
      for_type(mpx::half{});
      for_type(mpx::bfloat16{});
      for_type(float{});
    }
}

template <class Exec>
void run_all(Exec const& exec, options const& opt) {
  bool constexpr gpu = !mpx::is_host_executor_v<Exec>;
#if MPX_HAS_CUDA
  if constexpr (gpu) {
    // Keep freed device memory in the stream-ordered pool across synchronisations, as a
    // framework's caching allocator does: the norms' per-call partial sums would
    // otherwise be mapped afresh after every timed batch.
    int device = 0;
    MPX_CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPool_t pool{};
    MPX_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    std::uint64_t keep = UINT64_MAX;
    MPX_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  }
#endif
  sizes const s = sizes_for(opt, gpu);
  copy_reference<Exec> copy(exec, opt.repeat);
  if (opt.wants("norm") || opt.wants("dropout")) {
    print_bandwidth_header(Exec::name);
    auto for_type = [&](auto tag) {
      using T = decltype(tag);
      if (opt.wants("norm")) {
        bench_layer_norm<T>(exec, opt, copy, s.rows, s.cols);
        if (s.cols != 1024 && s.rows * s.cols % 1024 == 0)
          bench_layer_norm<T>(exec, opt, copy, s.rows * s.cols / 1024, 1024);
        bench_batch_norm<T>(exec, opt, copy, s);
      }
      if (opt.wants("dropout")) bench_dropout<T>(exec, opt, copy, s.rows, s.cols);
    };
    for_type(mpx::half{});
    for_type(mpx::bfloat16{});
    for_type(float{});
  }
  if (opt.wants("pool")) {
    print_bandwidth_header(Exec::name);
    auto for_type = [&](auto tag) {
      using T = decltype(tag);
      bench_max_pool<T>(exec, opt, copy, s, mpx::pool_options{}, "2x2/2");
      bench_max_pool<T>(exec, opt, copy, s,
                        mpx::pool_options{.pool_h = 3, .pool_w = 3, .stride_h = 2, .stride_w = 2, .pad_h = 1, .pad_w = 1},
                        "3x3/2 pad 1");
    };
    for_type(mpx::half{});
    for_type(mpx::bfloat16{});
    for_type(float{});
  }
  if (opt.wants("conv")) bench_conv(exec, opt, s);
  if (opt.wants("lstm")) bench_lstm(exec, opt, s);
}

}  // namespace

int main(int argc, char** argv) try {
  options opt;
  mpx_programs::command_line args(
      argc, argv,
      "[--executor host|cuda|all] [--repeat R] [--small] [--rows R] [--cols C]\n"
      "          [--lstm-steps T[,T...]] [--lstm-units U[,U...]] [--only norm,dropout,pool,conv,lstm]");
  while (args.next()) {
    if (args.is("--executor")) opt.executor = args.choice({"host", "cuda", "all"});
    else if (args.is("--repeat")) opt.repeat = args.whole<int>(1, 10'000);
    else if (args.is("--small")) opt.small = true;
    else if (args.is("--rows")) opt.rows = args.whole<std::int64_t>(1, std::int64_t{1} << 24);
    else if (args.is("--cols")) opt.cols = args.whole<std::int64_t>(1, std::int64_t{1} << 24);
    else if (args.is("--lstm-steps")) opt.lstm_steps = args.wholes<std::int64_t>(1, 100'000);
    else if (args.is("--lstm-units")) opt.lstm_units = args.wholes<std::int64_t>(1, 65'536);
    else if (args.is("--only")) {
      opt.only = args.text();
      std::stringstream in(opt.only);
      bool known = !opt.only.empty() && opt.only.back() != ',';
      for (std::string part; std::getline(in, part, ',');)
        known = known && (part == "norm" || part == "dropout" || part == "pool" || part == "conv" || part == "lstm");
      if (!known)
        throw mpx_programs::usage_error("--only expects parts among norm, dropout, pool, conv, lstm, got '" +
                                        opt.only + "'");
    } else args.unknown();
  }
  std::printf("median of %d runs%s; GB/s counts every byte read and written once; host gemm: %s\n", opt.repeat,
              opt.small ? ", --small sizes" : "",
              mpx::gemm_host_library);
  return mpx_bench::run_on_executors(opt.executor, [&](auto const& exec) { run_all(exec, opt); });
} catch (...) {
  return mpx_programs::report_failure("layer_bench");
}
