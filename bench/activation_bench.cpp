// Microbenchmark of the activation, softmax and loss kernels: bias + gelu forward,
// bias + gelu backward with the bias gradient, softmax over rows of 1000 and of 4099,
// and sparse categorical cross-entropy, each for half, bfloat16 and float, in GB/s
// beside a copy of the same bytes measured in the same run (memcpy on the host, a
// device-to-device cudaMemcpyAsync on the GPU).
//
//   activation_bench [--rows R] [--cols C] [--repeat N] [--executor host|cuda|all]
//
// Build with nvcc (activation_bench.cu) for the CUDA rows; bench/NOTES.md has the
// predictions and the results.
#include <mpx/mpx.hpp>

#include "executors.hpp"
#include "timing.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace {

using mpx_bench::median_seconds;

struct options {
  std::int64_t rows = 8192;
  std::int64_t cols = 4096;
  int repeat = 10;
  std::string executor = "all";
};

void print_row(std::string_view exec, std::string_view op, std::string_view dtype, double bytes, double seconds,
               double copy_gbps) {
  double const gbps = bytes / seconds / 1e9;
  std::printf("%-6s %-30s %-9s %10.1f %9.1f %8.1f%%\n", std::string(exec).c_str(), std::string(op).c_str(),
              std::string(dtype).c_str(), seconds * 1e6, gbps, 100.0 * gbps / copy_gbps);
}

template <class Exec>
void run_all(Exec const& exec, options const& opt) {
  std::int64_t const rows = opt.rows, cols = opt.cols;
  auto const n = static_cast<double>(rows * cols);
  auto src = mpx::make_tensor<float>(exec, {rows, cols});
  auto dst = mpx::make_tensor<float>(exec, {rows, cols});
  mpx::fill(exec, src, 0.5f);
  mpx::fill(exec, dst, 0.0f);
  double const copy_bytes = 2.0 * static_cast<double>(src.size_bytes());
  double const copy_s = median_seconds(exec, opt.repeat, [&] { mpx::copy(exec, src, dst); });
  double const copy_gbps = copy_bytes / copy_s / 1e9;
  print_row(Exec::name, "copy (ceiling)", "float32", copy_bytes, copy_s, copy_gbps);

  mpx::loss_value loss(exec);
  auto labels = mpx::make_tensor<std::int32_t>(exec, {rows});
  mpx::fill(exec, labels, std::int32_t{1});

  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    auto const name = mpx::dtype_name<T>;
    double const t = sizeof(T);
    auto x = mpx::make_tensor<T>(exec, {rows, cols});
    auto y = mpx::make_tensor<T>(exec, {rows, cols});
    auto dy = mpx::make_tensor<T>(exec, {rows, cols});
    auto bias = mpx::make_tensor<T>(exec, {cols});
    auto db = mpx::make_tensor<float>(exec, {cols});
    mpx::cast(exec, src, x);
    mpx::cast(exec, src, dy);
    mpx::fill(exec, bias, mpx::cast<T>(0.25f));
    // Bytes: every element read and written once; the bias and db are negligible.
    print_row(Exec::name, "bias+gelu forward", name, 2 * t * n,
              median_seconds(exec, opt.repeat, [&] { mpx::bias_activation_forward(exec, mpx::act::gelu{}, x, bias, y); }),
              copy_gbps);
    print_row(Exec::name, "bias+relu forward", name, 2 * t * n,
              median_seconds(exec, opt.repeat, [&] { mpx::bias_activation_forward(exec, mpx::act::relu{}, x, bias, y); }),
              copy_gbps);
    print_row(Exec::name, "gelu forward (no bias)", name, 2 * t * n,
              median_seconds(exec, opt.repeat, [&] { mpx::activation_forward(exec, mpx::act::gelu{}, x, y); }),
              copy_gbps);
    print_row(Exec::name, "bias+gelu backward + db", name, 3 * t * n,
              median_seconds(exec, opt.repeat,
                             [&] { mpx::bias_activation_backward(exec, mpx::act::gelu{}, x, bias, dy, y, db); }),
              copy_gbps);
    print_row(Exec::name, "bias_gradient (db only)", name, t * n,
              median_seconds(exec, opt.repeat, [&] { mpx::bias_gradient(exec, dy, db); }), copy_gbps);
    print_row(Exec::name, "softmax", name, 2 * t * n,
              median_seconds(exec, opt.repeat, [&] { mpx::softmax<mpx::mixed_float16>(exec, x, y); }), copy_gbps);
    print_row(Exec::name, "softmax backward", name, 3 * t * n,
              median_seconds(exec, opt.repeat, [&] { mpx::softmax_backward(exec, y, dy, x); }), copy_gbps);
    // Rows of 1000 (a classifier head): the warp-per-row path.
    auto x1000 = mpx::view(x).flat(0, static_cast<std::size_t>(rows * cols / 1000 * 1000)).reshape(
        {rows * cols / 1000, 1000});
    auto y1000 = mpx::view(y).flat(0, x1000.size()).reshape(x1000.shape());
    print_row(Exec::name, "softmax, rows of 1000", name, 2 * t * static_cast<double>(x1000.size()),
              median_seconds(exec, opt.repeat, [&] { mpx::softmax(exec, x1000, y1000); }), copy_gbps);
    print_row(Exec::name, "cross-entropy (loss+grad)", name, 2 * t * n,
              median_seconds(exec, opt.repeat,
                             [&] { mpx::sparse_categorical_cross_entropy(exec, x, labels, y, loss); }),
              copy_gbps);
    float const value = loss.read(exec);  // synchronises; also reports a bad label
    if (!(value == value)) std::printf("unexpected NaN loss\n");
  };
  for_type(mpx::half{});
  for_type(mpx::bfloat16{});
  for_type(float{});
}

}  // namespace

int main(int argc, char** argv) try {
  options opt;
  mpx_programs::command_line args(argc, argv, "[--rows R] [--cols C>=1000] [--repeat N] [--executor host|cuda|all]");
  while (args.next()) {
    if (args.is("--rows")) opt.rows = args.whole<std::int64_t>(1, std::int64_t{1} << 20);
    else if (args.is("--cols"))
      opt.cols = args.whole<std::int64_t>(1000, std::int64_t{1} << 24, " (the softmax rows of 1000 are cut from them)");
    else if (args.is("--repeat")) opt.repeat = args.whole<int>(1, 10'000);
    else if (args.is("--executor")) opt.executor = args.choice({"host", "cuda", "all"});
    else args.unknown();
  }
  std::printf("[%lld, %lld] elements, median of %d runs\n", static_cast<long long>(opt.rows),
              static_cast<long long>(opt.cols), opt.repeat);
  std::printf("%-6s %-30s %-9s %10s %9s %9s\n", "exec", "op", "dtype", "time (us)", "GB/s", "of copy");
  return mpx_bench::run_on_executors(opt.executor, [&](auto const& exec) { run_all(exec, opt); });
} catch (...) {
  return mpx_programs::report_failure("activation_bench");
}
