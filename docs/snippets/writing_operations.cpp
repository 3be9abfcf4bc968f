// docs/writing_operations.md: a new operation is one MPX_HD body and one declaration.
// An element-wise op (a clipped ReLU), a row op (RMS normalisation over the last axis)
// and a row reduction of a type of its own (each row's mean of its positive elements),
// each written once for the host and the GPU, checked here on the host against float64.
#include <mpx/mpx.hpp>

#include <cmath>
#include <cstdio>
#include <type_traits>
#include <vector>

using mpx::half;

// ---- an element op: y[i] = min(max(x[i], 0), ceiling), in float, rounded once ------

template <class X, class Y>
struct clipped_relu_element {  // the body: pointers and sizes only
  X const* x;
  Y* y;
  float ceiling;
  MPX_HD void operator()(std::size_t i) const {
    float const v = mpx::cast<float>(x[i]);
    y[i] = mpx::cast<Y>(v > 0.0f ? (v < ceiling ? v : ceiling) : (v == v ? 0.0f : v));  // NaN stays NaN
  }
};

// The declaration: what the arguments must be, checked once, then the dispatch.
template <mpx::executor Exec, mpx::tensor_like X, mpx::tensor_like Y>
void clipped_relu(Exec const& exec, X&& x, Y&& y, float ceiling) {
  auto [xv, yv] = mpx::detail::views_for<Exec>(x, y);  // views, and a compile error if Exec cannot reach them
  mpx::detail::require_same_shape("clipped_relu", xv.shape(), yv.shape());
  mpx::for_each_index(exec, xv.size(),
                      clipped_relu_element<mpx::value_t<X>, mpx::value_t<Y>>{xv.data(), yv.data(), ceiling});
}

// ---- a row op: y = x / sqrt(mean(x^2) + eps) along the last axis -----------------

template <class X, class Y>
struct rms_norm_row {
  X const* x;
  Y* y;  // may be x: a lane writes only the columns it alone reads
  std::size_t cols;
  float eps;
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t r) const {
    X const* xr = x + r * cols;
    float const sum_of_squares = lanes.reduce(cols, mpx::lane_sum{}, [&](std::size_t c) {
      float const v = mpx::cast<float>(xr[c]);
      return v * v;
    });
    float const scale = 1.0f / ::sqrtf(sum_of_squares / static_cast<float>(cols) + eps);
    lanes.for_each(cols, [&](std::size_t c) { y[r * cols + c] = mpx::cast<Y>(mpx::cast<float>(xr[c]) * scale); });
  }
};

template <mpx::executor Exec, mpx::tensor_like X, mpx::tensor_like Y>
void rms_norm(Exec const& exec, X&& x, Y&& y, float eps = 1e-6f) {
  auto [xv, yv] = mpx::detail::views_for<Exec>(x, y);
  mpx::detail::require_same_shape("rms_norm", xv.shape(), yv.shape());
  auto const [rows, cols] = mpx::detail::last_axis_rows("rms_norm", xv.shape());
  mpx::for_each_row(exec, rows, cols, rms_norm_row<mpx::value_t<X>, mpx::value_t<Y>>{xv.data(), yv.data(), cols, eps});
}

// ---- a reduction of your own type: each row's mean of its positive elements --------

struct sum_count {  // trivially copyable, whole 32-bit words; member initializers are fine
  float sum = 0.0f;
  unsigned count = 0;
};
struct add_sum_count {
  using value_type = sum_count;
  MPX_HD static sum_count identity() noexcept { return {}; }
  MPX_HD sum_count operator()(sum_count a, sum_count b) const noexcept {
    return {mpx::add_rn(a.sum, b.sum), a.count + b.count};
  }
};

template <class X>
struct positive_mean_row {
  X const* x;
  float* mean;
  std::size_t cols;
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t r) const {
    X const* xr = x + r * cols;
    sum_count const pos = lanes.reduce(cols, add_sum_count{}, [&](std::size_t c) {
      float const v = mpx::cast<float>(xr[c]);
      return v > 0.0f ? sum_count{v, 1u} : sum_count{};
    });
    lanes.once([&] { mean[r] = pos.count ? pos.sum / static_cast<float>(pos.count) : 0.0f; });
  }
};

template <mpx::executor Exec, mpx::tensor_like X, mpx::tensor_like M>
void positive_mean(Exec const& exec, X&& x, M&& mean) {
  static_assert(std::is_same_v<mpx::value_t<M>, float>, "positive_mean writes float means");
  auto [xv, mv] = mpx::detail::views_for<Exec>(x, mean);
  auto const [rows, cols] = mpx::detail::last_axis_rows("positive_mean", xv.shape());
  if (mv.size() != rows) mpx::detail::fail<mpx::shape_error>("positive_mean", "expects one mean per row");
  mpx::for_each_row(exec, rows, cols, positive_mean_row<mpx::value_t<X>>{xv.data(), mv.data(), cols});
}

int main() {
  bool ok = true;
  mpx::host_executor exec;

  auto x = mpx::make_tensor<half>(exec, {3, 5});
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = mpx::cast<half>(static_cast<float>(i) - 6.5f);
  auto y = mpx::make_tensor<half>(exec, x.shape());
  clipped_relu(exec, x, y, 4.0f);
  for (std::size_t i = 0; i < x.size(); ++i) {
    double const v = static_cast<double>(i) - 6.5;
    ok &= mpx::cast<float>(y[i]) == static_cast<float>(std::min(std::max(v, 0.0), 4.0));
  }

  auto r = mpx::make_tensor<float>(exec, x.shape());
  rms_norm(exec, x, r);
  for (std::size_t row = 0; row < 3; ++row) {
    double squares = 0.0;
    for (std::size_t c = 0; c < 5; ++c) squares += std::pow(mpx::cast<float>(x[row * 5 + c]), 2);
    double const scale = 1.0 / std::sqrt(squares / 5 + 1e-6);
    for (std::size_t c = 0; c < 5; ++c)
      ok &= std::fabs(r[row * 5 + c] - mpx::cast<float>(x[row * 5 + c]) * scale) < 1e-6;
  }
  std::printf("rms_norm row 0: %.5f %.5f %.5f %.5f %.5f\n", r[0], r[1], r[2], r[3], r[4]);

  auto means = mpx::make_tensor<float>(exec, {3});
  positive_mean(exec, x, means);
  for (std::size_t row = 0; row < 3; ++row) {
    double sum = 0.0;
    int count = 0;
    for (std::size_t c = 0; c < 5; ++c)
      if (float const v = mpx::cast<float>(x[row * 5 + c]); v > 0.0f) sum += v, ++count;
    ok &= means[row] == static_cast<float>(count ? sum / count : 0.0);
  }
  std::printf("positive means: %.2f %.2f %.2f\n", means[0], means[1], means[2]);
  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
