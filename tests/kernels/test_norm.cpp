// layer_norm and batch_norm, forward and backward, for every dtype on each executor,
// against float64 references (whose gradients are checked by finite differences), on
// seeded random inputs of awkward shapes; outputs poisoned first.
//
// Bounds asserted per element (u_T storage's unit roundoff, u_f = 2^-24; k the number
// of float roundings a statistic's sum may carry: cols / 32 + 40 along a row, min(N,
// 256) + N / 256 + 40 down a column; kappa = max|x| * rstd, how far the data sit from 0
// in units of their spread, which scales the error of the float mean):
//   forward   |y - ref|  <= u_T |ref| + 4 k u_f (1 + kappa) (|gamma| + 1) + |beta| u_f
//   dx        |dx - ref| <= u_T |ref| + 4 k u_f (1 + kappa) rstd (|g| + m|g| + (|xhat| + 1) m|g xhat|)
//   dgamma    |err| <= 4 k u_f (1 + kappa) sum|dy| (1 + |xhat|);  dbeta |err| <= k u_f sum|dy|
// (g = dy gamma, m|.| the mean of |.| along the normalised axis).
#include "../support/nn_reference.hpp"
#include "../support/reference/normalization.hpp"

#include <algorithm>
#include <cmath>

namespace {

using mpx_test::to_d;
using mpx_test::uf;
using mpx_test::poisoned;
using mpx_test::widen;

constexpr std::size_t extents[] = {1, 2, 7, 33, 1000};

// The float64 references normalise groups: rows (layer norm) or columns (batch norm)
// (tests/support/reference/normalization.hpp).
using mpx_test::reference::column_groups;
using mpx_test::reference::row_groups;

mpx::shape shape_of(std::size_t rows, std::size_t cols) {
  return mpx::shape{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
}
mpx::shape vec(std::size_t n) { return mpx::shape{static_cast<std::int64_t>(n)}; }

// Checks forward and backward results of a normalisation against the references.
// groups along the normalised axis: layer norm rows (per_group = cols), batch norm
// columns (per_group = rows).
template <class T, class At>
void check_against_reference(std::string const& name, std::vector<T> const& x, std::vector<T> const& dy,
                             std::vector<float> const& gamma, std::vector<float> const& beta, std::size_t groups,
                             std::size_t per_group, At at, bool by_group, double eps, std::vector<T> const& got_y,
                             std::vector<T> const& got_dx, std::vector<float> const& got_dgamma,
                             std::vector<float> const& got_dbeta, std::vector<float> const& got_mean,
                             std::vector<float> const& got_rstd, double k_stat, double k_param) {
  double const uT = mpx_test::unit_roundoff<T>();
  auto const xd = widen(x), dyd = widen(dy), gd = widen(gamma), bd = widen(beta);
  auto const f = mpx_test::reference::normalize(xd, groups, per_group, at, gd, bd, by_group, eps);
  auto const b = mpx_test::reference::normalize_backward(f, dyd, groups, per_group, at, gd, by_group, gamma.size());
  mpx_test::bound_checker fwd(name + " forward"), stats(name + " statistics"), bwd(name + " dx"),
      dg(name + " dgamma"), db(name + " dbeta");
  std::vector<double> param_abs_dy(gamma.size()), param_abs_dyx(gamma.size()), param_kappa(gamma.size());
  double nonzero = 0;
  for (std::size_t g = 0; g < groups; ++g) {
    double xmax = 0, mg = 0, mgx = 0;
    for (std::size_t e = 0; e < per_group; ++e) {
      std::size_t const i = at(g, e);
      std::size_t const p = by_group ? g : e;
      xmax = std::max(xmax, std::fabs(xd[i]));
      mg += std::fabs(dyd[i] * gd[p]) / static_cast<double>(per_group);
      mgx += std::fabs(dyd[i] * gd[p] * f.xhat[i]) / static_cast<double>(per_group);
    }
    double const kappa = xmax * f.rstd[g];
    stats.check(g, got_mean[g], f.mean[g], 4 * k_stat * uf * xmax);
    stats.check(g, got_rstd[g], f.rstd[g], 4 * k_stat * uf * (1 + kappa) * f.rstd[g]);
    for (std::size_t e = 0; e < per_group; ++e) {
      std::size_t const i = at(g, e);
      std::size_t const p = by_group ? g : e;
      double const scale = 4 * k_stat * uf * (1 + kappa);
      fwd.check(i, to_d(got_y[i]), f.y[i],
                uT * std::fabs(f.y[i]) + scale * (std::fabs(gd[p]) + 1) + std::fabs(bd[p]) * uf);
      double const gi = std::fabs(dyd[i] * gd[p]);
      bwd.check(i, to_d(got_dx[i]), b.dx[i],
                uT * std::fabs(b.dx[i]) + scale * f.rstd[g] * (gi + mg + (std::fabs(f.xhat[i]) + 1) * mgx) +
                    mpx_test::min_subnormal<T>());
      nonzero += std::fabs(f.y[i]) + std::fabs(b.dx[i]);
      param_abs_dy[p] += std::fabs(dyd[i]);
      param_abs_dyx[p] += std::fabs(dyd[i]) * (1 + std::fabs(f.xhat[i])) * (1 + kappa);
    }
  }
  for (std::size_t p = 0; p < gamma.size(); ++p) {
    dg.check(p, got_dgamma[p], b.dgamma[p], 4 * (k_param + k_stat) * uf * param_abs_dyx[p]);
    db.check(p, got_dbeta[p], b.dbeta[p], k_param * uf * param_abs_dy[p]);
  }
  REQUIRE(nonzero > 0);  // the reference is not all zeros
  MPX_REQUIRE_WITHIN(stats);
  MPX_REQUIRE_WITHIN(fwd);
  MPX_REQUIRE_WITHIN(bwd);
  MPX_REQUIRE_WITHIN(dg);
  MPX_REQUIRE_WITHIN(db);
}

double column_roundings(std::size_t n) {
  return static_cast<double>(std::min<std::size_t>(n, 256) + n / 256 + 40);
}
double row_roundings(std::size_t n) { return static_cast<double>(n) / 32 + 40; }


// Runs layer norm forward and backward on `exec` and checks against float64.
template <class T, class Exec>
void run_layer_norm(Exec const& exec, std::vector<T> const& x, std::vector<T> const& dy, std::size_t rows,
                    std::size_t cols, std::uint64_t stream) {
  auto const s = shape_of(rows, cols);
  auto const gamma = mpx_test::random_values<float>(cols, 0.5, 2, stream + 1);
  auto const beta = mpx_test::random_values<float>(cols, -1, 1, stream + 2);
  auto const xd = mpx_test::upload(exec, x, s);
  auto const dyd = mpx_test::upload(exec, dy, s);
  auto const gd = mpx_test::upload(exec, gamma, vec(cols));
  auto const bd = mpx_test::upload(exec, beta, vec(cols));
  auto y = poisoned<T>(exec, s);
  auto dx = poisoned<T>(exec, s);
  auto mean = poisoned<float>(exec, vec(rows));
  auto rstd = poisoned<float>(exec, vec(rows));
  auto dgamma = poisoned<float>(exec, vec(cols));
  auto dbeta = poisoned<float>(exec, vec(cols));
  float const eps = 1e-5f;
  mpx::layer_norm_forward<mpx::mixed_float16>(exec, xd, gd, bd, y, mean, rstd, eps);
  mpx::layer_norm_backward<mpx::mixed_bfloat16>(exec, xd, dyd, gd, mean, rstd, dx, dgamma, dbeta);
  INFO(mpx::dtype_name<T> << " rows=" << rows << " cols=" << cols);
  check_against_reference<T>("layer_norm " + std::string(mpx::dtype_name<T>), x, dy, gamma, beta, rows, cols,
                             row_groups{cols}, false, eps, mpx_test::download(exec, y), mpx_test::download(exec, dx),
                             mpx_test::download(exec, dgamma), mpx_test::download(exec, dbeta),
                             mpx_test::download(exec, mean), mpx_test::download(exec, rstd), row_roundings(cols),
                             column_roundings(rows));
}

template <class T, class Exec>
void run_batch_norm(Exec const& exec, std::vector<T> const& x, std::vector<T> const& dy, std::size_t rows,
                    std::size_t cols, std::uint64_t stream) {
  auto const s = shape_of(rows, cols);
  auto const gamma = mpx_test::random_values<float>(cols, 0.5, 2, stream + 1);
  auto const beta = mpx_test::random_values<float>(cols, -1, 1, stream + 2);
  auto const run_mean0 = mpx_test::random_values<float>(cols, -1, 1, stream + 3);
  auto const run_var0 = mpx_test::random_values<float>(cols, 0.5, 2, stream + 4);
  auto const xd = mpx_test::upload(exec, x, s);
  auto const dyd = mpx_test::upload(exec, dy, s);
  auto const gd = mpx_test::upload(exec, gamma, vec(cols));
  auto const bd = mpx_test::upload(exec, beta, vec(cols));
  auto run_mean = mpx_test::upload(exec, run_mean0, vec(cols));
  auto run_var = mpx_test::upload(exec, run_var0, vec(cols));
  auto y = poisoned<T>(exec, s);
  auto dx = poisoned<T>(exec, s);
  auto mean = poisoned<float>(exec, vec(cols));
  auto invstd = poisoned<float>(exec, vec(cols));
  auto dgamma = poisoned<float>(exec, vec(cols));
  auto dbeta = poisoned<float>(exec, vec(cols));
  mpx::batch_norm_options const o{0.9f, 1e-3f};
  mpx::batch_norm_forward_training<mpx::mixed_float16>(exec, xd, gd, bd, y, run_mean, run_var, mean, invstd, o);
  mpx::batch_norm_backward(exec, xd, dyd, gd, mean, invstd, dx, dgamma, dbeta);
  INFO(mpx::dtype_name<T> << " rows=" << rows << " cols=" << cols);
  double const k = column_roundings(rows);
  check_against_reference<T>("batch_norm " + std::string(mpx::dtype_name<T>), x, dy, gamma, beta, cols, rows,
                             column_groups{cols}, true, o.eps, mpx_test::download(exec, y), mpx_test::download(exec, dx),
                             mpx_test::download(exec, dgamma), mpx_test::download(exec, dbeta),
                             mpx_test::download(exec, mean), mpx_test::download(exec, invstd), k, k);

  // Running statistics: Keras's momentum, the unbiased batch variance.
  auto const xw = widen(x);
  auto const f =
      mpx_test::reference::normalize(xw, cols, rows, column_groups{cols}, widen(gamma), widen(beta), true, o.eps);
  auto const rm = mpx_test::download(exec, run_mean);
  auto const rv = mpx_test::download(exec, run_var);
  mpx_test::bound_checker running("batch_norm running statistics");
  for (std::size_t j = 0; j < cols; ++j) {
    double const var = 1 / (f.rstd[j] * f.rstd[j]) - o.eps;
    double const unbiased = var * static_cast<double>(rows) / static_cast<double>(rows - 1);
    double const m = 0.9 * run_mean0[j] + 0.1 * f.mean[j];
    double const v = 0.9 * run_var0[j] + 0.1 * unbiased;
    double xmax = 0;
    for (std::size_t r = 0; r < rows; ++r) xmax = std::max(xmax, std::fabs(xw[r * cols + j]));
    running.check(j, rm[j], m, 8 * k * uf * (std::fabs(run_mean0[j]) + xmax));
    running.check(cols + j, rv[j], v, 8 * k * uf * (std::fabs(run_var0[j]) + xmax * xmax + 1e-3));
  }
  MPX_REQUIRE_WITHIN(running);

  // Inference from the updated running statistics.
  auto yi = poisoned<T>(exec, s);
  mpx::batch_norm_forward_inference(exec, xd, gd, bd, run_mean, run_var, yi, o.eps);
  auto const got = mpx_test::download(exec, yi);
  mpx_test::bound_checker inf("batch_norm inference");
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::size_t const j = i % cols;
    double const rs = 1 / std::sqrt(static_cast<double>(rv[j]) + o.eps);
    double const ref = (xw[i] - rm[j]) * rs * gamma[j] + beta[j];
    inf.check(i, to_d(got[i]), ref,
              mpx_test::unit_roundoff<T>() * std::fabs(ref) +
                  8 * uf * (std::fabs(xw[i]) + std::fabs(rm[j]) + 1) * rs * (std::fabs(gamma[j]) + 1) +
                  4 * uf * std::fabs(beta[j]));
  }
  MPX_REQUIRE_WITHIN(inf);
}

}  // namespace

TEST_CASE("the float64 normalisation gradients agree with finite differences", "[norm]") {
  std::size_t const rows = 3, cols = 5;
  auto const x = mpx_test::random_values<double>(rows * cols, -2, 2, 1);
  auto const dy = mpx_test::random_values<double>(rows * cols, -1, 1, 2);
  for (bool batch : {false, true}) {
    std::size_t const params = batch ? rows : cols;  // one gamma per group (batch) or per element (layer)
    auto const gamma = mpx_test::random_values<double>(params, 0.5, 2, 3);
    auto const beta = mpx_test::random_values<double>(params, -1, 1, 4);
    // Both references normalise groups; they differ in whether gamma and beta belong to
    // the group (batch norm: a channel) or to the position within it (layer norm). Which
    // flat index an element of a group has (row_groups, column_groups) does not change the calculus.
    auto forward = [&](std::vector<double> const& xs, std::vector<double> const& gs, std::vector<double> const& bs) {
      return mpx_test::reference::normalize(xs, rows, cols, row_groups{cols}, gs, bs, batch, 1e-5);
    };
    auto loss = [&](std::vector<double> const& xs, std::vector<double> const& gs, std::vector<double> const& bs) {
      auto const y = forward(xs, gs, bs).y;
      double l = 0;
      for (std::size_t i = 0; i < y.size(); ++i) l += dy[i] * y[i];
      return l;
    };
    auto const g =
        mpx_test::reference::normalize_backward(forward(x, gamma, beta), dy, rows, cols, row_groups{cols}, gamma,
                                                batch, params);
    for (std::size_t i = 0; i < x.size(); ++i) {
      auto const at_x = [&](double v) {
        auto xs = x;
        xs[i] = v;
        return loss(xs, gamma, beta);
      };
      double const fd = mpx_test::finite_difference(at_x, x[i]);
      INFO("batch=" << batch << " dx i=" << i);
      REQUIRE(std::fabs(fd - g.dx[i]) <= 1e-7);
    }
    for (std::size_t p = 0; p < params; ++p) {
      auto const at_gamma = [&](double v) {
        auto gs = gamma;
        gs[p] = v;
        return loss(x, gs, beta);
      };
      auto const at_beta = [&](double v) {
        auto bs = beta;
        bs[p] = v;
        return loss(x, gamma, bs);
      };
      double const fg = mpx_test::finite_difference(at_gamma, gamma[p]);
      double const fb = mpx_test::finite_difference(at_beta, beta[p]);
      INFO("batch=" << batch << " p=" << p);
      REQUIRE(std::fabs(fg - g.dgamma[p]) <= 1e-7);
      REQUIRE(std::fabs(fb - g.dbeta[p]) <= 1e-7);
    }
  }
}

TEMPLATE_LIST_TEST_CASE("layer_norm forward and backward are within the bound of float64", "[norm]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t rows : extents)
      for (std::size_t cols : extents) {
        std::size_t const n = rows * cols;
        auto const x = mpx_test::random_values<T>(n, -3, 5, 41 + n + rows);
        auto const dy = mpx_test::random_values<T>(n, -1, 1, 42 + n + rows);
        run_layer_norm<T>(exec, x, dy, rows, cols, 43 + n);
      }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("batch_norm training, inference and backward are within the bound of float64", "[norm]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t rows : extents)
      for (std::size_t cols : extents) {
        if (rows < 2) continue;  // training needs two rows (refusal tested below)
        std::size_t const n = rows * cols;
        auto const x = mpx_test::random_values<T>(n, -3, 5, 51 + n + rows);
        auto const dy = mpx_test::random_values<T>(n, -1, 1, 52 + n + rows);
        run_batch_norm<T>(exec, x, dy, rows, cols, 53 + n);
      }
    // An NHWC tensor [2, 5, 3, 7] is normalised per channel as [30, 7].
    auto const x = mpx_test::random_values<T>(2 * 5 * 3 * 7, -3, 5, 54);
    mpx::shape const s4{2, 5, 3, 7};
    auto const xd = mpx_test::upload(exec, x, s4);
    auto const gd = mpx_test::upload(exec, std::vector<float>(7, 1.0f), vec(7));
    auto const bd = mpx_test::upload(exec, std::vector<float>(7, 0.0f), vec(7));
    auto rm = mpx_test::upload(exec, std::vector<float>(7, 0.0f), vec(7));
    auto rv = mpx_test::upload(exec, std::vector<float>(7, 1.0f), vec(7));
    auto y4 = poisoned<T>(exec, s4);
    auto y2 = poisoned<T>(exec, shape_of(30, 7));
    auto m = poisoned<float>(exec, vec(7));
    auto is = poisoned<float>(exec, vec(7));
    mpx::batch_norm_forward_training(exec, xd, gd, bd, y4, rm, rv, m, is);
    auto const x2 = mpx_test::upload(exec, x, shape_of(30, 7));
    mpx::batch_norm_forward_training(exec, x2, gd, bd, y2, rm, rv, m, is);
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, y4), mpx_test::download(exec, y2)).empty());
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("norm statistics stay exact under a large common offset", "[norm]", mpx_test::executors) {
  // x = 1000 + noise in [-1, 1), in float: a naive float E[x^2] - E[x]^2 loses the
  // variance (1/3) in the rounding of 1e6 (ulp 0.0625); two passes keep it.
  TestType exec;
  std::size_t const rows = 33, cols = 1000;
  auto x = mpx_test::random_values<float>(rows * cols, -1, 1, 61);
  for (auto& v : x) v += 1000.0f;
  auto const dy = mpx_test::random_values<float>(rows * cols, -1, 1, 62);
  run_layer_norm<float>(exec, x, dy, rows, cols, 63);
  run_batch_norm<float>(exec, x, dy, rows, cols, 64);
  // And a tighter, absolute statement on the normalised values.
  auto const s = shape_of(rows, cols);
  auto const xd = mpx_test::upload(exec, x, s);
  auto const gd = mpx_test::upload(exec, std::vector<float>(cols, 1.0f), vec(cols));
  auto const bd = mpx_test::upload(exec, std::vector<float>(cols, 0.0f), vec(cols));
  auto y = poisoned<float>(exec, s);
  auto mean = poisoned<float>(exec, vec(rows));
  auto rstd = poisoned<float>(exec, vec(rows));
  mpx::layer_norm_forward(exec, xd, gd, bd, y, mean, rstd);
  auto const got = mpx_test::download(exec, y);
  auto const f = mpx_test::reference::normalize(widen(x), rows, cols, row_groups{cols}, std::vector<double>(cols, 1.0),
                                                std::vector<double>(cols, 0.0), false, 1e-5);
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - f.y[i]));
  INFO("worst |y - ref| = " << worst);
  REQUIRE(worst < 1e-3);
}

TEMPLATE_LIST_TEST_CASE("a NaN in the input of a normalisation never passes as a number", "[norm]",
                        mpx_test::executors) {
  TestType exec;
  std::size_t const rows = 7, cols = 33;
  auto const s = shape_of(rows, cols);
  auto x = mpx_test::random_values<float>(rows * cols, -1, 1, 71);
  x[2 * cols + 5] = NAN;  // row 2, column 5
  auto const xd = mpx_test::upload(exec, x, s);
  auto const gd = mpx_test::upload(exec, std::vector<float>(cols, 1.0f), vec(cols));
  auto const bd = mpx_test::upload(exec, std::vector<float>(cols, 0.0f), vec(cols));
  auto y = poisoned<float>(exec, s);
  auto mean = poisoned<float>(exec, vec(rows));
  auto rstd = poisoned<float>(exec, vec(rows));
  mpx::layer_norm_forward(exec, xd, gd, bd, y, mean, rstd);
  auto const ly = mpx_test::download(exec, y);
  for (std::size_t c = 0; c < cols; ++c) REQUIRE(std::isnan(ly[2 * cols + c]));
  for (std::size_t c = 0; c < cols; ++c) REQUIRE(std::isfinite(ly[3 * cols + c]));

  auto rm = mpx_test::upload(exec, std::vector<float>(cols, 0.0f), vec(cols));
  auto rv = mpx_test::upload(exec, std::vector<float>(cols, 1.0f), vec(cols));
  auto bm = poisoned<float>(exec, vec(cols));
  auto bi = poisoned<float>(exec, vec(cols));
  mpx::batch_norm_forward_training(exec, xd, gd, bd, y, rm, rv, bm, bi);
  auto const by = mpx_test::download(exec, y);
  auto const brm = mpx_test::download(exec, rm);
  for (std::size_t r = 0; r < rows; ++r) REQUIRE(std::isnan(by[r * cols + 5]));
  REQUIRE(std::isnan(brm[5]));
  REQUIRE(std::isfinite(by[6]));
}

TEMPLATE_LIST_TEST_CASE("normalisations refuse mismatched shapes, naming both", "[norm]", mpx_test::executors) {
  using Catch::Matchers::Contains;
  TestType exec;
  auto x = mpx::make_tensor<float>(exec, {3, 4});
  auto y = mpx::make_tensor<float>(exec, {3, 4});
  auto bad_y = mpx::make_tensor<float>(exec, {4, 3});
  auto p4 = mpx::make_tensor<float>(exec, {4});
  auto p5 = mpx::make_tensor<float>(exec, {5});
  auto r3 = mpx::make_tensor<float>(exec, {3});
  auto r2 = mpx::make_tensor<float>(exec, {2});
  CHECK_THROWS_TYPE_WITH(mpx::layer_norm_forward(exec, x, p4, p4, bad_y, r3, r3), mpx::shape_error,
                         Contains("[3, 4]") && Contains("[4, 3]"));
  CHECK_THROWS_TYPE_WITH(mpx::layer_norm_forward(exec, x, p5, p4, y, r3, r3), mpx::shape_error,
                         Contains("[5]") && Contains("[3, 4]"));
  CHECK_THROWS_TYPE_WITH(mpx::layer_norm_forward(exec, x, p4, p4, y, r2, r3), mpx::shape_error,
                         Contains("[2]") && Contains("[3, 4]"));
  CHECK_THROWS_TYPE_WITH(mpx::layer_norm_backward(exec, x, bad_y, p4, r3, r3, y, p4, p4), mpx::shape_error,
                         Contains("[3, 4]") && Contains("[4, 3]"));
  CHECK_THROWS_TYPE_WITH(mpx::batch_norm_forward_training(exec, x, p4, p4, y, p4, p5, p4, p4), mpx::shape_error,
                         Contains("[5]") && Contains("[3, 4]"));
  CHECK_THROWS_TYPE_WITH(mpx::batch_norm_forward_inference(exec, x, p4, p4, p4, p4, bad_y), mpx::shape_error,
                         Contains("[3, 4]") && Contains("[4, 3]"));
  CHECK_THROWS_TYPE_WITH(mpx::batch_norm_backward(exec, x, y, p4, p4, r3, y, p4, p4), mpx::shape_error,
                         Contains("[3]") && Contains("[3, 4]"));
  // Training needs two rows per channel (the unbiased running variance).
  auto x1 = mpx::make_tensor<float>(exec, {1, 4});
  auto y1 = mpx::make_tensor<float>(exec, {1, 4});
  CHECK_THROWS_TYPE_WITH(mpx::batch_norm_forward_training(exec, x1, p4, p4, y1, p4, p4, p4, p4),
                         mpx::invalid_argument, Contains("at least 2 rows"));
}

// In place is fine (each element is read before it is written); an output shifted over
// an input would be written before the input is read (found by the API fuzzer).
TEMPLATE_LIST_TEST_CASE("normalisations run in place but refuse an output shifted over an input", "[norm]",
                        mpx_test::executors) {
  using Catch::Matchers::Contains;
  TestType exec;
  auto buffer = mpx::make_tensor<float>(exec, {32});
  auto const at = [&](std::int64_t offset) {
    auto v = mpx::view(buffer);
    return decltype(v)(v.data() + offset, mpx::shape{3, 4});
  };
  mpx::fill(exec, buffer, 0.5f);
  auto x = mpx::make_tensor<float>(exec, {3, 4});
  mpx::fill(exec, x, 0.25f);
  auto p4 = mpx::make_tensor<float>(exec, {4}), q4 = mpx::make_tensor<float>(exec, {4});
  auto r3 = mpx::make_tensor<float>(exec, {3}), s3 = mpx::make_tensor<float>(exec, {3});
  mpx::fill(exec, p4, 1.0f);
  mpx::fill(exec, q4, 1.0f);
  mpx::layer_norm_forward(exec, at(0), p4, p4, at(0), r3, s3);
  mpx::layer_norm_backward(exec, x, at(16), p4, r3, s3, at(16), q4, q4);
  CHECK_THROWS_TYPE_WITH(mpx::layer_norm_forward(exec, at(0), p4, p4, at(2), r3, s3), mpx::invalid_argument,
                         Contains("y and x overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::layer_norm_backward(exec, x, at(0), p4, r3, s3, at(5), q4, q4), mpx::invalid_argument,
                         Contains("dx and dy overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::layer_norm_backward(exec, at(1), x, p4, r3, s3, at(0), q4, q4), mpx::invalid_argument,
                         Contains("dx and x overlap"));
  mpx::batch_norm_forward_inference(exec, at(0), p4, p4, p4, p4, at(0));
  CHECK_THROWS_TYPE_WITH(mpx::batch_norm_forward_inference(exec, at(0), p4, p4, p4, p4, at(4)),
                         mpx::invalid_argument, Contains("y and x overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::batch_norm_forward_training(exec, at(4), p4, p4, at(0), p4, p4, q4, q4),
                         mpx::invalid_argument, Contains("y and x overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::batch_norm_backward(exec, x, at(0), p4, p4, p4, at(7), q4, q4), mpx::invalid_argument,
                         Contains("dx and dy overlap"));
}
