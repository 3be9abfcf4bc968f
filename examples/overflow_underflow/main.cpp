// Why does a mixed-precision model fail to train, and why is my gradient zero?
//
// Part 1 squares 1e8 and 1e-8 in float32, bfloat16 and float16: in half the first
// overflows to inf and the second underflows to 0, and so does the gradient of x^2.
// Part 2 stores a realistic spread of gradients in half with and without a loss scale
// and counts, with mpx::stats, how many are lost, on the host and (built with nvcc, on
// a machine with a GPU) on the GPU.
//
//   overflow_underflow [--executor auto|host|cuda] [--size N]
#include <mpx/mpx.hpp>

#include "../common/command_line.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace {

// The value as stored in T, printed; "inf" and "0" are the failures this example is about.
template <class T>
std::string in(double x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.6g", mpx::detail::to_double(mpx::cast<T>(x)));
  return text;
}

// a * b computed in T: each operand stored in T, the product rounded to T.
template <class T>
double product_in(double a, double b) {
  float const p = mpx::cast<float>(mpx::cast<T>(a)) * mpx::cast<float>(mpx::cast<T>(b));
  return mpx::detail::to_double(mpx::cast<T>(p));
}

void row(char const* what, std::string const& f32, std::string const& bf16, std::string const& f16) {
  std::printf("  %-40s %14s %14s %14s\n", what, f32.c_str(), bf16.c_str(), f16.c_str());
}

template <class F>
void row_of(char const* what, F&& value_in) {
  row(what, value_in(float{}), value_in(mpx::bfloat16{}), value_in(mpx::half{}));
}

void part1_scalars() {
  std::printf("Part 1: the same numbers in three dtypes\n");
  row("", "float32", "bfloat16", "float16");
  auto show = [](double v) {
    char text[32];
    std::snprintf(text, sizeof text, "%.6g", v);
    return std::string(text);
  };
  row_of("x = 1e8", [](auto t) { return in<decltype(t)>(1e8); });
  row_of("x * x  (x = 1e8)", [&](auto t) { return show(product_in<decltype(t)>(1e8, 1e8)); });
  row_of("x = 1e4", [](auto t) { return in<decltype(t)>(1e4); });
  row_of("x * x  (x = 1e4, half's max is 65504)", [&](auto t) { return show(product_in<decltype(t)>(1e4, 1e4)); });
  row_of("x = 1e-8", [](auto t) { return in<decltype(t)>(1e-8); });
  row_of("x * x  (x = 1e-8)", [&](auto t) { return show(product_in<decltype(t)>(1e-8, 1e-8)); });
  // Backpropagation multiplies small numbers: an upstream gradient of 1e-4 times a
  // weight of 1e-4 is the next layer's gradient, 1e-8, which half cannot hold.
  row_of("gradient g = 1e-4 times weight w = 1e-4", [&](auto t) { return show(product_in<decltype(t)>(1e-4, 1e-4)); });
  double const scale = 32768;  // Keras's initial loss scale, 2^15
  row_of("... with the loss scaled by 2^15", [&](auto t) { return show(product_in<decltype(t)>(1e-4 * scale, 1e-4)); });
  row_of("... unscaled in float32 by the optimizer", [&](auto t) {
    return show(product_in<decltype(t)>(1e-4 * scale, 1e-4) / scale);
  });
  std::printf("  float16 keeps 5 exponent bits: |x| > 65504 overflows to inf, |x| < 2^-25 = 3e-8 becomes 0.\n"
              "  bfloat16 keeps float32's range with 8 bits of precision. A loss scale multiplies the loss\n"
              "  (and so every gradient) into half's range; the optimizer divides it out in float32.\n\n");
}

// Gradients as a deep network produces them: magnitudes spread log-uniformly over
// 1e-10 .. 1e-2, both signs.
std::vector<float> typical_gradients(std::size_t n) {
  std::mt19937_64 gen(42);
  std::uniform_real_distribution<double> exponent(-10, -2);
  std::vector<float> g(n);
  for (auto& x : g) x = static_cast<float>((gen() & 1 ? -1 : 1) * std::pow(10.0, exponent(gen)));
  return g;
}

template <class Exec>
void part2_gradients(Exec const& exec, std::vector<float> const& host_gradients) {
  std::printf("Part 2: %zu gradients (|g| from 1e-10 to 1e-2) stored in a 16-bit type, %s executor\n",
              host_gradients.size(), std::string(Exec::name).c_str());
  std::printf("  %-10s %-12s %12s %12s %12s %16s\n", "dtype", "loss scale", "became 0", "became inf", "survived",
              "verdict");
  auto const gradients = [&] {
    auto t = mpx::make_tensor<float>(exec, {static_cast<std::int64_t>(host_gradients.size())});
    mpx::copy(exec, mpx::tensor_view<float const>(host_gradients.data(), t.shape()), t);
    return t;
  }();

  auto one = [&](auto dtype_tag, double scale) {
    using T = decltype(dtype_tag);
    auto scaled = mpx::make_tensor<float>(exec, gradients.shape());
    mpx::copy(exec, gradients, scaled);
    mpx::scale(exec, scaled, static_cast<float>(scale));  // what scaling the loss does to every gradient
    auto stored = mpx::make_tensor<T>(exec, gradients.shape());
    mpx::cast(exec, scaled, stored);  // what storing them in the policy's dtype does
    mpx::numerics_stats const s = mpx::stats(exec, stored);
    double const n = static_cast<double>(s.size);
    char const* verdict = s.inf ? "overflow: skip" : s.zero > s.size / 100 ? "underflow" : "trains";
    std::printf("  %-10s %-12.0f %11.2f%% %11.2f%% %11.2f%% %16s\n", std::string(mpx::dtype_name<T>).c_str(), scale,
                100.0 * static_cast<double>(s.zero) / n, 100.0 * static_cast<double>(s.inf) / n,
                100.0 * static_cast<double>(s.size - s.zero - s.inf) / n, verdict);
  };
  one(mpx::half{}, 1);
  one(mpx::half{}, 1024);
  one(mpx::half{}, 32768);
  one(mpx::half{}, 16777216);
  one(mpx::bfloat16{}, 1);
  std::printf("  Without scaling, float16 loses every gradient below 3e-8; 2^15 (Keras's start) saves them;\n"
              "  2^24 pushes the largest past 65504, so a dynamic loss scaler skips that step and halves the\n"
              "  scale. bfloat16 needs no scaling: its range is float32's.\n\n");
}

}  // namespace

int main(int argc, char** argv) try {
  std::string executor = "auto";
  std::size_t size = std::size_t{1} << 20;
  mpx_programs::command_line args(argc, argv, "[--executor auto|host|cuda] [--size N]");
  while (args.next()) {
    if (args.is("--executor")) executor = args.choice({"auto", "host", "cuda"});
    else if (args.is("--size")) size = args.whole<std::size_t>(1, std::size_t{1} << 30);
    else args.unknown();
  }

  part1_scalars();
  auto const gradients = typical_gradients(size);
  bool gpu = false;
#if MPX_HAS_CUDA
  int devices = 0;
  gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#endif
  if (executor == "host" || executor == "auto") part2_gradients(mpx::host_executor{}, gradients);
  if (executor == "cuda" || (executor == "auto" && gpu)) {
#if MPX_HAS_CUDA
    if (!gpu) throw mpx::error("--executor cuda: no GPU is visible to this process");
    part2_gradients(mpx::cuda_executor{}, gradients);
#else
    throw mpx::error("--executor cuda: this binary was built without nvcc; rebuild with -Dcuda=enabled");
#endif
  } else if (executor == "auto") {
    std::printf("No GPU here: the table above came from the host executor. On a GPU the same calls run as\n"
                "CUDA kernels (mpx::cuda_executor) and print the same counts.\n");
  }
  return 0;
} catch (...) {
  return mpx_programs::report_failure("overflow_underflow");
}
