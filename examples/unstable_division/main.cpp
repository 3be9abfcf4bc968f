// A custom layer that divides by a sum, and why it returns NaN under mixed_float16.
//
// The layer turns each row of non-negative values into proportions, y = x / sum(x), as
// a Keras user writes it in a custom layer: `x / tf.reduce_sum(x, axis=-1,
// keepdims=True)`. Under mixed_float16 the row sum is a float16 tensor: a row whose sum
// passes 65504 stores it as inf, and every output of that row becomes 0; a row that is
// all zeros (a ReLU that switched a sample off) divides 0 by 0 and gives NaN, and the
// NaN reaches the loss and the gradients. mpx::stats of the output counts both.
//
// The stable rewrite sums in float (the policy's accumulate type) and divides by
// sum + epsilon, rounding to half once at the end. Epsilon has a cost in half too: the
// gradient of an all-zero row is dy / epsilon, so Keras's epsilon() of 1e-7 makes it
// 1e7, inf in float16; 1e-3 keeps it finite. Part 2 shows the same division inside a
// hand-written softmax, exp(s) / sum(exp(s)), where exp already overflows for s > 11.09,
// and mpx::softmax, which subtracts the row's max and sums in float.
//
// The layer models mpx::layer (include/mpx/layers/layer.hpp): it can go into
// mpx::sequential beside the built-in layers. Part 3 does that, and asks
// mpx::find_nonfinite which layer of the model made the NaN, and why.
//
//   unstable_division [--executor auto|host|cuda]
#include <mpx/mpx.hpp>

#include "../common/command_line.hpp"

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

// ---- the custom layer -------------------------------------------------------------

struct divide_by_row_sum_config {
  bool stable = false;     //!< sum in float and divide by sum + epsilon
  float epsilon = 1e-3f;   //!< used when stable
};

//! One row: y = x / s with s the row sum, in one of the two forms; saves s (as float)
//! for the backward pass. MPX_HD: the host loop and the CUDA kernel below share it.
template <class T>
MPX_HD void divide_row(divide_by_row_sum_config c, T const* x, T* y, float* saved_sum, std::int64_t n) {
  float sum = 0;
  for (std::int64_t i = 0; i < n; ++i) sum += mpx::cast<float>(x[i]);
  // Naive: the sum is a tensor of the layer's dtype, as tf.reduce_sum returns it.
  float const s = c.stable ? sum + c.epsilon : mpx::cast<float>(mpx::cast<T>(sum));
  for (std::int64_t i = 0; i < n; ++i) y[i] = mpx::cast<T>(mpx::cast<float>(x[i]) / s);
  *saved_sum = s;
}

//! dx_j = (dy_j - sum_i dy_i y_i) / s, with the s the forward pass divided by.
template <class T>
MPX_HD void divide_row_backward(T const* y, T const* dy, T* dx, float s, std::int64_t n) {
  float dot = 0;
  for (std::int64_t i = 0; i < n; ++i) dot += mpx::cast<float>(dy[i]) * mpx::cast<float>(y[i]);
  for (std::int64_t i = 0; i < n; ++i) dx[i] = mpx::cast<T>((mpx::cast<float>(dy[i]) - dot) / s);
}

#if MPX_HAS_CUDA
// One thread per row: the point here is the numerics, not the speed.
template <class T>
__global__ void divide_rows_kernel(divide_by_row_sum_config c, T const* x, T* y, float* sums, std::int64_t rows,
                                   std::int64_t n) {
  std::int64_t const r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < rows) divide_row(c, x + r * n, y + r * n, sums + r, n);
}
template <class T>
__global__ void divide_rows_backward_kernel(T const* y, T const* dy, T* dx, float const* sums, std::int64_t rows,
                                            std::int64_t n) {
  std::int64_t const r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < rows) divide_row_backward(y + r * n, dy + r * n, dx + r * n, sums[r], n);
}
#endif

template <class Policy = mpx::model_policy>
class divide_by_row_sum : public mpx::layer_base {
 public:
  using policy = Policy;
  using input_type = typename Policy::storage_type;
  using output_type = typename Policy::storage_type;
  static constexpr std::string_view kind = "DivideByRowSum";

  explicit divide_by_row_sum(divide_by_row_sum_config c = {}) : config_(c) {}
  [[nodiscard]] divide_by_row_sum_config config() const noexcept { return config_; }  // for mpx::sequential

  [[nodiscard]] mpx::shape compute_output_shape(mpx::shape const& in) const { return in; }
  template <mpx::executor Exec>
  void build(Exec const&, mpx::shape const& in, std::uint64_t) {
    if (in.rank() != 1) mpx::detail::fail<mpx::shape_error>(name(), "expects rows, got " + in.to_string());
    mark_built(in, in);
  }
  template <mpx::executor Exec>
  void reserve(Exec const& exec, std::int64_t batch) {
    sums_.ensure(exec, {batch});
    reserved_batch_ = batch;
  }

  template <mpx::executor Exec, class Space = mpx::memory_space_t<Exec>>
  void forward(Exec const& exec, mpx::tensor_view<input_type const, Space> x, mpx::tensor_view<output_type, Space> y,
               bool) {
    std::int64_t const rows = check_input_and_reserve(*this, exec, x.shape(), y.shape()), n = input_shape_[0];
    float* const sums = sums_.template view<Space>({rows}).data();
    if constexpr (mpx::is_host_executor_v<Exec>) {
      for (std::int64_t r = 0; r < rows; ++r) divide_row(config_, x.data() + r * n, y.data() + r * n, sums + r, n);
    } else {
#if MPX_HAS_CUDA
      divide_rows_kernel<<<static_cast<unsigned>((rows + 127) / 128), 128, 0, exec.stream()>>>(config_, x.data(),
                                                                                               y.data(), sums, rows, n);
      MPX_CUDA_CHECK_LAUNCH("divide_rows_kernel");
#endif
    }
  }

  template <mpx::executor Exec, class Space = mpx::memory_space_t<Exec>>
  void backward([[maybe_unused]] Exec const& exec, mpx::tensor_view<input_type const, Space> x,
                mpx::tensor_view<output_type const, Space> y, mpx::tensor_view<output_type const, Space> dy,
                mpx::tensor_view<input_type, Space> dx) {
    std::int64_t const rows = check_input(x.shape(), y.shape()), n = input_shape_[0];
    if (dx.data() == nullptr) return;  // no parameters: nothing else to compute
    float const* const sums = sums_.template view<Space>({rows}).data();
    if constexpr (mpx::is_host_executor_v<Exec>) {
      for (std::int64_t r = 0; r < rows; ++r)
        divide_row_backward(y.data() + r * n, dy.data() + r * n, dx.data() + r * n, sums[r], n);
    } else {
#if MPX_HAS_CUDA
      divide_rows_backward_kernel<<<static_cast<unsigned>((rows + 127) / 128), 128, 0, exec.stream()>>>(
          y.data(), dy.data(), dx.data(), sums, rows, n);
      MPX_CUDA_CHECK_LAUNCH("divide_rows_backward_kernel");
#endif
    }
  }

  template <mpx::memory_space Space>
  void append_parameters(std::vector<mpx::parameter<Space>>&) {}
  [[nodiscard]] std::size_t parameter_count() const noexcept { return 0; }

  //! The divisor of each row in the latest forward pass (float), for diagnostics.
  template <mpx::memory_space Space>
  [[nodiscard]] mpx::tensor_view<float, Space> divisors(std::int64_t rows) const {
    return sums_.template view<Space>({rows});
  }

 private:
  divide_by_row_sum_config config_;
  mpx::detail::layer_tensor<float> sums_;
};

static_assert(mpx::layer<divide_by_row_sum<mpx::mixed_float16>>, "divide_by_row_sum must model mpx::layer");

// ---- the demonstration ------------------------------------------------------------

constexpr std::int64_t rows = 64, cols = 64;
constexpr std::int64_t large_rows = 8, empty_rows = 8;  // the first 8 rows are large, the last 8 empty

//! Rows of non-negative values: most in [0, 1), 8 rows of values in [1000, 3000) (each
//! fits in half; their sum, about 128000, does not), 8 rows of zeros.
std::vector<float> make_rows() {
  std::mt19937_64 gen(3);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> x(rows * cols);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      float const u = unit(gen);
      x[static_cast<std::size_t>(r * cols + c)] = r < large_rows ? 1000 + 2000 * u : r >= rows - empty_rows ? 0 : u;
    }
  return x;
}

//! host floats rounded to half, in a tensor where exec computes.
template <class Exec>
auto to_half_tensor(Exec const& exec, std::vector<float> const& values, mpx::shape s) {
  std::vector<mpx::half> rounded(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) rounded[i] = mpx::cast<mpx::half>(values[i]);
  auto t = mpx::make_tensor<mpx::half>(exec, s);
  mpx::copy(exec, mpx::tensor_view<mpx::half const>(rounded.data(), s), t);
  exec.synchronize();  // before `rounded` is freed
  return t;
}

void print_stats(char const* what, mpx::numerics_stats const& s) {
  std::printf("  %-34s %6zu %6zu %7zu %11.4g %15zu\n", what, s.nan, s.inf, s.zero, static_cast<double>(s.absmax),
              s.overflow_in_half);
}
void print_header(char const* first) {
  std::printf("  %-34s %6s %6s %7s %11s %15s\n", first, "NaN", "inf", "zero", "absmax", "overflow in half");
}

template <class Exec>
void part1_division(Exec const& exec) {
  using Space = mpx::memory_space_t<Exec>;
  using half = mpx::half;
  std::printf("Part 1: y = x / sum(x) over %lld rows of %lld under mixed_float16, %s executor\n"
              "  rows 0-7 hold values in [1000, 3000) (row sum ~128000 > 65504), rows 56-63 are all zero\n\n",
              static_cast<long long>(rows), static_cast<long long>(cols), std::string(Exec::name).c_str());
  std::vector<float> const host_x = make_rows();
  auto const x = to_half_tensor(exec, host_x, {rows, cols});
  // The gradient arriving from above: uniform in [-1, 1).
  std::vector<float> host_dy(host_x.size());
  std::mt19937_64 gen(5);
  std::uniform_real_distribution<float> sym(-1.0f, 1.0f);
  for (auto& v : host_dy) v = sym(gen);
  auto const dy = to_half_tensor(exec, host_dy, {rows, cols});
  std::printf("  input x: %s\n\n", mpx::to_string(mpx::stats(exec, x)).c_str());

  auto y = mpx::make_tensor<half>(exec, {rows, cols});
  auto dx = mpx::make_tensor<half>(exec, {rows, cols});
  print_header("");
  auto run = [&](char const* name, divide_by_row_sum_config c) {
    divide_by_row_sum<mpx::mixed_float16> layer(c);
    layer.set_name(name);
    layer.build(exec, {cols}, 0);
    layer.reserve(exec, rows);
    layer.forward(exec, x.view(), y.view(), true);
    layer.backward(exec, x.view(), mpx::view(std::as_const(y)), dy.view(),
                   dx.view());
    std::printf("  %s\n", name);
    print_stats("    the divisor per row (float)", mpx::stats(exec, layer.template divisors<Space>(rows)));
    print_stats("    output y (half)", mpx::stats(exec, y));
    print_stats("    input gradient dx (half)", mpx::stats(exec, dx));
    auto const host_y = mpx::to_host(exec, y);
    std::printf("    row 0 (large): y[0] = %g, row 63 (empty): y[0] = %g, row 20: y[0] = %g\n",
                mpx::detail::to_double(host_y[0]), mpx::detail::to_double(host_y[63 * cols]),
                mpx::detail::to_double(host_y[20 * cols]));
  };
  run("naive: x / sum stored in half", {.stable = false});
  run("stable: float sum, x / (sum + 1e-7)", {.stable = true, .epsilon = 1e-7f});
  run("stable: float sum, x / (sum + 1e-3)", {.stable = true, .epsilon = 1e-3f});
  std::printf("\n  Naive: where the divisor is inf in half (the large rows) every output of the row is 0,\n"
              "  silently: no NaN, no error; where it is 0 (the empty rows) 0/0 gives NaN, which flows on into\n"
              "  dx. Summing in float keeps the large rows; epsilon turns the empty rows' outputs into 0, but\n"
              "  their gradient is dy / epsilon: past 65504 with epsilon = 1e-7, so inf in half.\n\n");
}

//! exp(x), in float, rounded once to the output's dtype (as a half exp would give it).
struct exp_op {
  template <class T>
  MPX_HD T operator()(T x) const noexcept {
    return mpx::cast<T>(::expf(mpx::cast<float>(x)));
  }
};

template <class Exec>
void part2_softmax(Exec const& exec) {
  using half = mpx::half;
  std::printf("Part 2: a hand-written softmax, exp(s) / sum(exp(s)), against mpx::softmax\n"
              "  %lld rows of %lld attention-like scores s ~ N(0, 4^2): exp(s) overflows half for s > 11.09\n\n",
              static_cast<long long>(rows), static_cast<long long>(cols));
  std::mt19937_64 gen(11);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::vector<float> host_s(rows * cols);
  for (auto& v : host_s) v = normal(gen);
  auto const s = to_half_tensor(exec, host_s, {rows, cols});

  auto e = mpx::make_tensor<half>(exec, {rows, cols});
  mpx::transform(exec, e, exp_op{}, s);  // exp in half, as the layer's compute dtype gives it
  auto y = mpx::make_tensor<half>(exec, {rows, cols});
  divide_by_row_sum<mpx::mixed_float16> layer({.stable = true, .epsilon = 1e-3f});  // even the stable division
  layer.build(exec, {cols}, 0);
  layer.forward(exec, mpx::view(std::as_const(e)), y.view(), false);

  auto p = mpx::make_tensor<half>(exec, {rows, cols});
  mpx::softmax<mpx::mixed_float16>(exec, s, p);

  print_header("");
  print_stats("exp(s) in half", mpx::stats(exec, e));
  print_stats("exp(s) / (sum + 1e-3)", mpx::stats(exec, y));
  print_stats("mpx::softmax(s)", mpx::stats(exec, p));
  std::printf("\n  Once exp(s) is inf, no care in the division helps: inf / inf is NaN, and the rest of that row\n"
              "  becomes x / inf = 0. mpx::softmax subtracts the row's max first (every exp is then at most 1)\n"
              "  and sums in float; its zeros are probabilities below half's smallest subnormal.\n");
}

template <class Exec>
void part3_find_the_layer(Exec const& exec) {
  std::printf("\nPart 3: in a model, which layer made the NaN? mpx::find_nonfinite after a forward pass\n"
              "  Dense(%lld, relu) -> DivideByRowSum (naive) -> Dense(4), all mixed_float16, on the rows of part 1\n\n",
              static_cast<long long>(cols));
  auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(cols, mpx::activation::relu), divide_by_row_sum<>(),
                                                   mpx::dense<>(4));
  model.build(exec, {cols}, 7);
  auto const x = to_half_tensor(exec, make_rows(), {rows, cols});
  model.forward(exec, mpx::view(x), true);
  if (auto const finding = mpx::find_nonfinite(exec, model))
    std::printf("  %s\n", finding->explanation().c_str());
  else
    std::printf("  every tensor is finite\n");
}

bool gpu_available() {
#if MPX_HAS_CUDA
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#else
  return false;
#endif
}

template <class Exec>
void run_all(Exec const& exec) {
  part1_division(exec);
  part2_softmax(exec);
  part3_find_the_layer(exec);
}

}  // namespace

int main(int argc, char** argv) try {
  std::string executor = "auto";
  mpx_programs::command_line args(argc, argv, "[--executor auto|host|cuda]");
  while (args.next()) {
    if (args.is("--executor")) executor = args.choice({"auto", "host", "cuda"});
    else args.unknown();
  }
  bool const gpu = gpu_available();
  if (executor == "cuda" || (executor == "auto" && gpu)) {
#if MPX_HAS_CUDA
    if (!gpu) throw mpx::error("--executor cuda: no GPU is visible to this process");
    run_all(mpx::cuda_executor{});
#else
    throw mpx::error("--executor cuda: this binary was built without nvcc; rebuild with -Dcuda=enabled");
#endif
  } else {
    run_all(mpx::host_executor{});
  }
  return 0;
} catch (...) {
  return mpx_programs::report_failure("unstable_division");
}
