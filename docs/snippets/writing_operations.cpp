// docs/writing_operations.md: a new operation is one MPX_HD body and one declaration.
// An element-wise op (a clipped ReLU) and a row op (RMS normalisation over the last
// axis), each written once for the host and the GPU, checked here on the host against
// float64.
#include <mpx/mpx.hpp>

#include <cmath>
#include <cstdio>
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
  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
