// The float64 softmax of one row every softmax test checks against (the softmax kernels
// and layer, the cross-entropy losses, attention's weights): its statistics, the
// output (plain or log) under mpx's edge semantics, the backward pass, and the
// cross-entropy of a row against its label.
#pragma once

#include <mpx/core/cast.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace mpx_test::reference {

//! A row's maximum and the sum of exp(x - max).
struct softmax_statistics {
  double max, sum;
};
//! The statistics of the n values at x, read in float64.
template <class T>
softmax_statistics softmax_statistics_of(T const* x, std::size_t n) {
  double m = -INFINITY;
  for (std::size_t c = 0; c < n; ++c) m = std::max(m, mpx::detail::to_double(x[c]));
  double s = 0;
  for (std::size_t c = 0; c < n; ++c) s += std::exp(mpx::detail::to_double(x[c]) - m);
  return {m, s};
}
inline softmax_statistics softmax_statistics_of(std::vector<double> const& x) {
  return softmax_statistics_of(x.data(), x.size());
}

//! softmax(x) (log: log_softmax(x)) under mpx's edge semantics (kernels/softmax.hpp):
//! -inf entries get 0 (log: -inf); a row with a NaN or +inf, or all -inf, is NaN
//! throughout.
inline std::vector<double> softmax_row(std::vector<double> const& x, bool log = false) {
  double m = -INFINITY;
  bool poisoned = false;
  for (double v : x) {
    poisoned = poisoned || std::isnan(v) || v == INFINITY;
    if (!std::isnan(v)) m = std::max(m, v);
  }
  if (poisoned || m == -INFINITY) return std::vector<double>(x.size(), NAN);
  double s = 0;
  for (double v : x) s += std::exp(v - m);
  std::vector<double> y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = log ? (x[i] - m) - std::log(s) : std::exp(x[i] - m) / s;
  return y;
}

//! The backward pass of softmax_row from its output y (log: log_softmax's) and dy, with
//! dot = sum dy y (log: sum dy) and the sum of its terms' magnitudes.
struct softmax_gradient {
  std::vector<double> dx;
  double dot, abs_dot;
};
inline softmax_gradient softmax_backward_row(std::vector<double> const& y, std::vector<double> const& dy,
                                             bool log = false) {
  softmax_gradient r{std::vector<double>(y.size()), 0, 0};
  for (std::size_t i = 0; i < y.size(); ++i) {
    r.dot += log ? dy[i] : dy[i] * y[i];
    r.abs_dot += log ? std::fabs(dy[i]) : std::fabs(dy[i] * y[i]);
  }
  for (std::size_t i = 0; i < y.size(); ++i) r.dx[i] = log ? dy[i] - std::exp(y[i]) * r.dot : y[i] * (dy[i] - r.dot);
  return r;
}

//! The cross-entropy of logits x against class `label`: log sum exp(x) - x[label].
inline double cross_entropy_row(std::vector<double> const& x, int label) {
  auto const st = softmax_statistics_of(x);
  return std::log(st.sum) + st.max - x[static_cast<std::size_t>(label)];
}

}  // namespace mpx_test::reference
