// The float64 matrix product every product test checks against (gemm, fp8_gemm, dense,
// attention, residual blocks): one element at a time with the sum of its terms'
// magnitudes, which a float sum's error bound scales, or whole row-major matrices.
// Each element sums its K terms in order of k, starting from 0.
#pragma once

#include <mpx/core/cast.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace mpx_test::reference {

//! op(X), read in float64 from row-major storage: op(X) is [rows, cols]; X is stored
//! [rows, cols], or [cols, rows] when transposed (gemm's transpose flags).
template <class T>
struct matrix {
  T const* data;
  std::int64_t rows, cols;
  bool transposed = false;
  [[nodiscard]] double operator()(std::int64_t i, std::int64_t j) const {
    return mpx::detail::to_double(data[static_cast<std::size_t>(transposed ? j * rows + i : i * cols + j)]);
  }
};
template <class T>
matrix(T const*, std::int64_t, std::int64_t, bool) -> matrix<T>;

//! One element of a product in float64, and the sum of the magnitudes of its terms.
struct product_entry {
  double exact = 0, magnitude = 0;
};

//! sum over kk < k of a(i, kk) b(kk, j).
template <class A, class B>
product_entry dot(A const& a, B const& b, std::int64_t i, std::int64_t j, std::int64_t k) {
  product_entry r;
  for (std::int64_t kk = 0; kk < k; ++kk) {
    double const t = a(i, kk) * b(kk, j);
    r.exact += t;
    r.magnitude += std::abs(t);
  }
  return r;
}

//! gemm's element: alpha (a b)(i, j) + beta c_old; beta = 0 does not read c_old (a NaN
//! poison there is not part of the product).
template <class A, class B>
product_entry gemm_entry(A const& a, B const& b, std::int64_t i, std::int64_t j, std::int64_t k, double alpha,
                         double beta, double c_old) {
  product_entry r = dot(a, b, i, j, k);
  r.exact *= alpha;
  r.magnitude *= std::abs(alpha);
  if (beta != 0) {
    r.exact += beta * c_old;
    r.magnitude += std::abs(beta * c_old);
  }
  return r;
}

//! C = op(A) op(B) over row-major float64 matrices: op(A) [m, k], op(B) [k, n], C [m, n];
//! with the sum of |terms| of each element.
struct product {
  std::vector<double> c, magnitude;
};
inline product matmul_with_magnitudes(std::vector<double> const& a, std::vector<double> const& b, std::size_t m,
                                      std::size_t k, std::size_t n, bool transpose_a = false,
                                      bool transpose_b = false) {
  auto const sm = static_cast<std::int64_t>(m), sk = static_cast<std::int64_t>(k), sn = static_cast<std::int64_t>(n);
  matrix const am{a.data(), sm, sk, transpose_a};
  matrix const bm{b.data(), sk, sn, transpose_b};
  product p{std::vector<double>(m * n), std::vector<double>(m * n)};
  for (std::int64_t i = 0; i < sm; ++i)
    for (std::int64_t j = 0; j < sn; ++j) {
      auto const e = dot(am, bm, i, j, sk);
      p.c[static_cast<std::size_t>(i * sn + j)] = e.exact;
      p.magnitude[static_cast<std::size_t>(i * sn + j)] = e.magnitude;
    }
  return p;
}
//! C = op(A) op(B), as matmul_with_magnitudes, the product alone.
inline std::vector<double> matmul(std::vector<double> const& a, std::vector<double> const& b, std::size_t m,
                                  std::size_t k, std::size_t n, bool transpose_a = false, bool transpose_b = false) {
  return matmul_with_magnitudes(a, b, m, k, n, transpose_a, transpose_b).c;
}

//! The sums of the columns of a row-major [rows, cols] matrix (a bias gradient), row by
//! row in order.
inline std::vector<double> column_sums(std::vector<double> const& x, std::size_t cols) {
  std::vector<double> s(cols, 0.0);
  for (std::size_t i = 0; i < x.size(); ++i) s[i % cols] += x[i];
  return s;
}

}  // namespace mpx_test::reference
