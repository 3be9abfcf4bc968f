// Microbenchmark of the foundation's memory-bound kernels: all_finite, stats,
// log2_histogram, cast and scale over N elements of each dtype, reported in GB/s beside a copy of the same bytes
// measured in the same run (memcpy on the host, a device-to-device cudaMemcpyAsync on
// the GPU). Every op moves each byte once, so the copy is its ceiling.
//
//   numerics_bench [--elements N] [--repeat R] [--executor host|cuda|all]
//
// Build with nvcc (numerics_bench.cu) for the CUDA rows; bench/NOTES.md has the
// predictions and the results.
#include <mpx/mpx.hpp>

#include "executors.hpp"
#include "timing.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace {

using mpx_bench::median_seconds;

struct options {
  std::size_t elements = std::size_t{1} << 26;
  int repeat = 10;
  std::string executor = "all";
};

void print_row(std::string_view exec, std::string_view op, std::string_view dtype, double bytes, double seconds,
               double copy_gbps) {
  double const gbps = bytes / seconds / 1e9;
  std::printf("%-6s %-22s %-9s %10.1f %9.1f %8.1f%%\n", std::string(exec).c_str(), std::string(op).c_str(),
              std::string(dtype).c_str(), seconds * 1e6, gbps, 100.0 * gbps / copy_gbps);
}

template <class Exec>
void run_all(Exec const& exec, options const& opt) {
  auto const n = static_cast<std::int64_t>(opt.elements);
  // The copy ceiling: float elements, read once and written once.
  auto src = mpx::make_tensor<float>(exec, {n});
  auto dst = mpx::make_tensor<float>(exec, {n});
  mpx::fill(exec, src, 0.5f);
  mpx::fill(exec, dst, 0.0f);
  double const copy_bytes = 2.0 * static_cast<double>(src.size_bytes());
  double const copy_s = median_seconds(exec, opt.repeat, [&] { mpx::copy(exec, src, dst); });
  double const copy_gbps = copy_bytes / copy_s / 1e9;
  std::printf("%-6s %-22s %-9s %10.1f %9.1f %8.1f%%\n", std::string(Exec::name).c_str(), "copy (ceiling)", "float32",
              copy_s * 1e6, copy_gbps, 100.0);

  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    auto const name = mpx::dtype_name<T>;
    auto x = mpx::make_tensor<T>(exec, {n});
    mpx::cast(exec, src, x);
    double const bytes = static_cast<double>(x.size_bytes());
    volatile bool sink_finite = true;
    print_row(Exec::name, "all_finite", name, bytes,
              median_seconds(exec, opt.repeat, [&] { sink_finite = mpx::all_finite(exec, x); }), copy_gbps);
    volatile std::size_t sink_nan = 0;
    print_row(Exec::name, "stats", name, bytes,
              median_seconds(exec, opt.repeat, [&] { sink_nan = mpx::stats(exec, x).nan; }), copy_gbps);
    print_row(Exec::name, "log2_histogram", name, bytes,
              median_seconds(exec, opt.repeat, [&] { sink_nan = mpx::log2_histogram(exec, x).nan; }), copy_gbps);
    print_row(Exec::name, "scale (in place)", name, 2 * bytes,
              median_seconds(exec, opt.repeat, [&] { mpx::scale(exec, x, 1.0f); }), copy_gbps);
    if constexpr (!std::is_same_v<T, float>) {
      print_row(Exec::name, std::string("cast float32->") + std::string(name), name,
                bytes + static_cast<double>(src.size_bytes()),
                median_seconds(exec, opt.repeat, [&] { mpx::cast(exec, src, x); }), copy_gbps);
      print_row(Exec::name, std::string("cast ") + std::string(name) + "->float32", name,
                bytes + static_cast<double>(src.size_bytes()),
                median_seconds(exec, opt.repeat, [&] { mpx::cast(exec, x, dst); }), copy_gbps);
    }
    (void)sink_finite;
    (void)sink_nan;
  };
  for_type(mpx::half{});
  for_type(mpx::bfloat16{});
  for_type(float{});
}

}  // namespace

int main(int argc, char** argv) try {
  options opt;
  mpx_programs::command_line args(argc, argv, "[--elements N] [--repeat R] [--executor host|cuda|all]");
  while (args.next()) {
    if (args.is("--elements")) opt.elements = args.whole<std::size_t>(1, std::size_t{1} << 32);
    else if (args.is("--repeat")) opt.repeat = args.whole<int>(1, 10'000);
    else if (args.is("--executor")) opt.executor = args.choice({"host", "cuda", "all"});
    else args.unknown();
  }
  std::printf("%zu elements, median of %d runs\n", opt.elements, opt.repeat);
  std::printf("%-6s %-22s %-9s %10s %9s %9s\n", "exec", "op", "dtype", "time (us)", "GB/s", "of copy");
  return mpx_bench::run_on_executors(opt.executor, [&](auto const& exec) { run_all(exec, opt); });
} catch (...) {
  return mpx_programs::report_failure("numerics_bench");
}
