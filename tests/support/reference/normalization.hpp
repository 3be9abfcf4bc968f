// The float64 normalisations every norm test checks against (the layer_norm and
// batch_norm kernels and layers): groups of values normalised to mean 0 and variance 1
// (two passes), scaled by gamma and shifted by beta, and the gradients for the loss
// sum(dy * y). Layer norm's group is a row and its gamma belongs to the position within
// the row; batch norm's group is a column (a channel) and its gamma belongs to the group.
#pragma once

#include <cmath>
#include <cstddef>
#include <utility>
#include <vector>

namespace mpx_test::reference {

//! at(g, e): the flat index of element e of group g in a row-major [rows, cols] matrix.
//! Layer norm: the groups are the rows.
struct row_groups {
  std::size_t cols;
  std::size_t operator()(std::size_t g, std::size_t e) const { return g * cols + e; }
};
//! Batch norm: the groups are the columns.
struct column_groups {
  std::size_t cols;
  std::size_t operator()(std::size_t g, std::size_t e) const { return e * cols + g; }
};

//! The forward pass and its statistics per group (var: the biased variance).
struct normalization {
  std::vector<double> y, xhat, mean, var, rstd;
};

//! Normalises each of `groups` groups of `per_group` elements of x (at: row_groups or
//! column_groups); gamma[p], beta[p] with p the group (gamma_by_group) or the element's
//! position in it.
template <class At>
normalization normalize(std::vector<double> const& x, std::size_t groups, std::size_t per_group, At at,
                        std::vector<double> const& gamma, std::vector<double> const& beta, bool gamma_by_group,
                        double eps) {
  normalization out{std::vector<double>(x.size()), std::vector<double>(x.size()), std::vector<double>(groups),
                    std::vector<double>(groups), std::vector<double>(groups)};
  for (std::size_t g = 0; g < groups; ++g) {
    double s = 0;
    for (std::size_t e = 0; e < per_group; ++e) s += x[at(g, e)];
    double const m = s / static_cast<double>(per_group);
    double q = 0;
    for (std::size_t e = 0; e < per_group; ++e) q += (x[at(g, e)] - m) * (x[at(g, e)] - m);
    out.mean[g] = m;
    out.var[g] = q / static_cast<double>(per_group);
    out.rstd[g] = 1 / std::sqrt(out.var[g] + eps);
    for (std::size_t e = 0; e < per_group; ++e) {
      std::size_t const i = at(g, e);
      std::size_t const p = gamma_by_group ? g : e;
      out.xhat[i] = (x[i] - m) * out.rstd[g];
      out.y[i] = out.xhat[i] * gamma[p] + beta[p];
    }
  }
  return out;
}

struct normalization_gradients {
  std::vector<double> dx, dgamma, dbeta;
};

//! The gradients of x, gamma and beta (`params` of each) for the loss sum(dy * y), from
//! the forward pass f of the same groups.
template <class At>
normalization_gradients normalize_backward(normalization const& f, std::vector<double> const& dy, std::size_t groups,
                                           std::size_t per_group, At at, std::vector<double> const& gamma,
                                           bool gamma_by_group, std::size_t params) {
  normalization_gradients out{std::vector<double>(dy.size()), std::vector<double>(params),
                              std::vector<double>(params)};
  double const n = static_cast<double>(per_group);
  for (std::size_t g = 0; g < groups; ++g) {
    double sa = 0, sb = 0;
    for (std::size_t e = 0; e < per_group; ++e) {
      std::size_t const i = at(g, e);
      std::size_t const p = gamma_by_group ? g : e;
      double const gi = dy[i] * gamma[p];
      sa += gi;
      sb += gi * f.xhat[i];
      out.dgamma[p] += dy[i] * f.xhat[i];
      out.dbeta[p] += dy[i];
    }
    for (std::size_t e = 0; e < per_group; ++e) {
      std::size_t const i = at(g, e);
      std::size_t const p = gamma_by_group ? g : e;
      out.dx[i] = f.rstd[g] * (dy[i] * gamma[p] - sa / n - f.xhat[i] * sb / n);
    }
  }
  return out;
}

//! Batch norm (per_column: each column a group, gamma and beta its own) or layer norm
//! (each row a group, gamma and beta per column) of a row-major [rows, cols] x: the
//! forward pass and the gradients for the loss sum(dy * y).
struct matrix_normalization {
  normalization forward;
  normalization_gradients backward;
};
inline matrix_normalization normalize_matrix(std::vector<double> const& x, std::vector<double> const& dy,
                                             std::vector<double> const& gamma, std::vector<double> const& beta,
                                             std::size_t rows, std::size_t cols, bool per_column, double eps) {
  auto run = [&](auto at, std::size_t groups, std::size_t per_group) {
    auto f = normalize(x, groups, per_group, at, gamma, beta, per_column, eps);
    auto g = normalize_backward(f, dy, groups, per_group, at, gamma, per_column, cols);
    return matrix_normalization{std::move(f), std::move(g)};
  };
  return per_column ? run(column_groups{cols}, cols, rows) : run(row_groups{cols}, rows, cols);
}

}  // namespace mpx_test::reference
