// The typed layers as layers, for every dtype on each executor: that each computes the
// right function of its input and of its own parameters (read back from the layer, or
// written into it through append_parameters), with the right gradients for both, through
// build / reserve / forward / backward; their parameter lists, initialisers and errors.
// The kernels underneath have their own, tighter tests; these bounds are wide enough for
// any correct wiring and far too narrow for a wrong one (a transposed product, a swapped
// gamma and beta, the derivative taken at the output, an ignored config value).
//
// Bounds asserted per element (u_T storage's unit roundoff, u_f = 2^-24, u_a the
// product's: u_f for float operands, 2 u_f for 16-bit ones; S = sum_k |x||w|):
//   dense   the layer sees pre' = round_T(x W) + b, |pre' - pre| <= d = u_T |z| + (in + 4) u_a S
//           + u_f (|z| + |b|) + min_subnormal_T, so
//           y   |y - ref|  <= u_T |ref| + 1.13 d + 8 u_f (|ref| + |pre|) + min_subnormal_T
//           dz  e_dz <= u_T |dz| + |dy| (L d + 16 u_f (1 + |pre|)) + min_subnormal_T, L = 1 for
//               sigmoid, tanh, gelu (|f''| < 1), 0 for linear, relu; relu adds |dy| where
//               |pre| <= d (the kink may fall on either side);
//           dW, dx, db: the error of the product (or column sum) of |dz| + e_dz, plus the
//               propagated e_dz, plus one rounding u_T |ref|.
//   norms   as tests/kernels/test_norm.cpp with k = n + 40 roundings for a statistic of n
//           values.
//   activation, softmax: one rounding u_T |ref| plus a few dozen float roundings.
#include "../support/reference/activation.hpp"
#include "../support/nn_reference.hpp"
#include "../support/reference/matmul.hpp"
#include "../support/reference/normalization.hpp"
#include "../support/reference/softmax.hpp"

#include <mpx/layers/activation_layer.hpp>
#include <mpx/layers/batch_norm.hpp>
#include <mpx/layers/dense.hpp>
#include <mpx/layers/dropout.hpp>
#include <mpx/layers/flatten.hpp>
#include <mpx/layers/layer_norm.hpp>
#include <mpx/layers/softmax_layer.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

static_assert(mpx::layer<mpx::dense<mpx::mixed_float16>>);
static_assert(mpx::layer<mpx::batch_norm<mpx::mixed_bfloat16>>);
static_assert(mpx::layer<mpx::layer_norm<mpx::float32>>);
static_assert(mpx::layer<mpx::dropout<mpx::float32>>);
static_assert(mpx::layer<mpx::flatten<mpx::float32>>);
static_assert(mpx::layer<mpx::activation_layer<mpx::float32>>);
static_assert(mpx::layer<mpx::softmax_layer<mpx::float32>>);

namespace {

using mpx_test::to_d;
using mpx_test::uf;
using mpx_test::poisoned;
using mpx_test::widen;

template <class T>
using policy_of = mpx_test::preset_policy<T>;

constexpr mpx::activation all_activations[] = {mpx::activation::linear, mpx::activation::relu,
                                               mpx::activation::sigmoid,  mpx::activation::tanh,
                                               mpx::activation::gelu,    mpx::activation::gelu_tanh};
static_assert(std::size(all_activations) == mpx::activations::size, "every listed activation is tested");


// The views the layer API takes (its Space is deduced, so a tensor is not converted).
template <class T, class Space>
mpx::tensor_view<T const, Space> cview(mpx::tensor<T, Space> const& t) {
  return t.view();
}
template <class T, class Space>
mpx::tensor_view<T, Space> mview(mpx::tensor<T, Space>& t) {
  return t.view();
}


mpx::shape make_shape(std::vector<std::int64_t> const& e) {
  return mpx::shape(std::span<std::int64_t const>(e.data(), e.size()));
}
mpx::shape batched(std::int64_t batch, std::vector<std::int64_t> sample) {
  sample.insert(sample.begin(), batch);
  return make_shape(sample);
}

//! Writes host values into a tensor a layer handed out (a parameter or a statistic).
template <class T, class Exec, class Space>
void assign(Exec const& exec, mpx::tensor_ref<Space> const& ref, std::vector<T> const& values) {
  auto const v = ref.template as<T>();
  REQUIRE(v.size() == values.size());
  mpx::copy(exec, mpx::tensor_view<T const, mpx::host_space>(values.data(), v.shape()), v);
  exec.synchronize();
}
template <class T, class Exec, class Space>
std::vector<T> fetch(Exec const& exec, mpx::tensor_ref<Space> const& ref) {
  return mpx_test::download(exec, ref.template as<T>());
}
template <class T, class Exec, class Space>
void poison_ref(Exec const& exec, mpx::tensor_ref<Space> const& ref) {
  mpx::fill(exec, ref.template as<T>(), mpx_test::poison<T>());
}

// ---- float64 references ----

double act_forward(mpx::activation a, double x) { return mpx_test::reference::activation_of(a).f(x); }
double act_derivative(mpx::activation a, double x) { return mpx_test::reference::activation_of(a).df(x); }

//! y = act(x W + b) over [rows, in] x [in, units] and its gradients for the loss sum(dy * y);
//! z_abs: the sum of |x_ik W_kj| of each z = x W.
struct dense_reference {
  std::vector<double> z, z_abs, y, dz, dw, db, dx;
};
dense_reference reference_dense(std::vector<double> const& x, std::vector<double> const& w,
                                std::vector<double> const& b, std::vector<double> const& dy, std::size_t rows,
                                std::size_t in, std::size_t units, mpx::activation a) {
  namespace ref = mpx_test::reference;
  auto z = ref::matmul_with_magnitudes(x, w, rows, in, units);
  dense_reference r{std::move(z.c), std::move(z.magnitude), std::vector<double>(rows * units),
                    std::vector<double>(rows * units), {}, {}, {}};
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < units; ++j) {
      std::size_t const o = i * units + j;
      r.y[o] = act_forward(a, r.z[o] + b[j]);
      r.dz[o] = dy[o] * act_derivative(a, r.z[o] + b[j]);
    }
  r.dw = ref::matmul(x, r.dz, in, rows, units, true, false);
  r.db = ref::column_sums(r.dz, units);
  r.dx = ref::matmul(r.dz, w, rows, units, in, false, true);
  return r;
}

//! Normalisation of x [rows, cols] with gamma, beta per column: over each column (batch
//! norm) or each row (layer norm); and its gradients for the loss sum(dy * y)
//! (tests/support/reference/normalization.hpp).
using norm_reference = mpx_test::reference::matrix_normalization;
using mpx_test::reference::normalize_matrix;

// ---- dense ----

struct dense_case {
  std::int64_t batch, steps, in, units;  // steps 0: input [batch, in]; else [batch, steps, in]
};

struct nonzero_totals {
  double y = 0, dw = 0, db = 0, dx = 0;
};

template <class T, class Exec>
void check_dense(Exec const& exec, mpx::activation a, dense_case const& c, std::uint64_t stream,
                 nonzero_totals& totals) {
  using Space = mpx::memory_space_t<Exec>;
  std::vector<std::int64_t> const sample = c.steps ? std::vector<std::int64_t>{c.steps, c.in}
                                                   : std::vector<std::int64_t>{c.in};
  std::vector<std::int64_t> const out_sample = c.steps ? std::vector<std::int64_t>{c.steps, c.units}
                                                       : std::vector<std::int64_t>{c.units};
  std::size_t const rows = static_cast<std::size_t>(c.batch * (c.steps ? c.steps : 1));
  std::size_t const in = static_cast<std::size_t>(c.in), units = static_cast<std::size_t>(c.units);
  INFO(mpx::dtype_name<T> << " " << mpx::to_string(a) << " batch=" << c.batch << " steps=" << c.steps
                          << " in=" << c.in << " units=" << c.units);

  mpx::dense<policy_of<T>> layer(c.units, a);
  layer.set_name("dense");
  layer.build(exec, make_shape(sample), mpx_test::seed + stream);
  layer.reserve(exec, c.batch);
  REQUIRE(layer.output_shape() == make_shape(out_sample));
  REQUIRE(layer.compute_output_shape(make_shape(sample)) == make_shape(out_sample));

  std::vector<mpx::parameter<Space>> params;
  layer.append_parameters(params);
  REQUIRE(params.size() == 2);
  // A bias of random values, written through the parameter list: the forward pass must
  // read the tensor the optimizer updates.
  assign(exec, params[1].value, mpx_test::random_values<T>(units, -1, 1, stream + 1));
  poison_ref<T>(exec, params[0].gradient);
  poison_ref<T>(exec, params[1].gradient);

  auto const xs = mpx_test::random_values<T>(rows * in, -2, 2, stream + 2);
  auto const dys = mpx_test::random_values<T>(rows * units, -1, 1, stream + 3);
  auto const x = mpx_test::upload(exec, xs, batched(c.batch, sample));
  auto const dy = mpx_test::upload(exec, dys, batched(c.batch, out_sample));
  auto y = poisoned<T>(exec, batched(c.batch, out_sample));
  auto dx = poisoned<T>(exec, batched(c.batch, sample));
  layer.forward(exec, cview(x), mview(y), true);
  layer.backward(exec, cview(x), cview(y), cview(dy), mview(dx));

  auto const w = widen(mpx_test::download(exec, layer.template kernel<Space>()));
  auto const b = widen(mpx_test::download(exec, layer.template bias<Space>()));
  auto const got_y = mpx_test::download(exec, y);
  auto const got_dx = mpx_test::download(exec, dx);
  auto const got_dw = fetch<T>(exec, params[0].gradient);
  auto const got_db = fetch<T>(exec, params[1].gradient);
  auto const xd = widen(xs), dyd = widen(dys);
  auto const r = reference_dense(xd, w, b, dyd, rows, in, units, a);

  double const uT = mpx_test::unit_roundoff<T>();
  double const ua = std::is_same_v<T, float> ? uf : 2 * uf;
  double const tiny = mpx_test::min_subnormal<T>();
  double const smooth = (a == mpx::activation::linear || a == mpx::activation::relu) ? 0 : 1;
  std::string const what = "dense " + std::string(mpx::dtype_name<T>) + " " + std::string(mpx::to_string(a));
  mpx_test::bound_checker fy(what + " y"), fdw(what + " dW"), fdb(what + " db"), fdx(what + " dx");
  std::vector<double> e_dz(rows * units);
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < units; ++j) {
      std::size_t const o = i * units + j;
      double const s = r.z_abs[o];
      double const z = r.z[o], pre = z + b[j];
      double const d = uT * std::fabs(z) + static_cast<double>(in + 4) * ua * s + uf * (std::fabs(z) + std::fabs(b[j])) + tiny;
      fy.check(o, to_d(got_y[o]), r.y[o],
               uT * std::fabs(r.y[o]) + 1.13 * d + 8 * uf * (std::fabs(r.y[o]) + std::fabs(pre)) + tiny);
      e_dz[o] = uT * std::fabs(r.dz[o]) + std::fabs(dyd[o]) * (smooth * d + 16 * uf * (1 + std::fabs(pre))) + tiny;
      if (a == mpx::activation::relu && std::fabs(pre) <= d) e_dz[o] += std::fabs(dyd[o]);
      totals.y += std::fabs(r.y[o]);
    }
  for (std::size_t k = 0; k < in; ++k)
    for (std::size_t j = 0; j < units; ++j) {
      double s = 0, e = 0;
      for (std::size_t i = 0; i < rows; ++i) {
        s += std::fabs(xd[i * in + k]) * (std::fabs(r.dz[i * units + j]) + e_dz[i * units + j]);
        e += std::fabs(xd[i * in + k]) * e_dz[i * units + j];
      }
      std::size_t const o = k * units + j;
      fdw.check(o, to_d(got_dw[o]), r.dw[o], uT * std::fabs(r.dw[o]) + static_cast<double>(rows + 4) * ua * s + e + tiny);
      totals.dw += std::fabs(r.dw[o]);
    }
  for (std::size_t j = 0; j < units; ++j) {
    double s = 0, e = 0;
    for (std::size_t i = 0; i < rows; ++i) {
      s += std::fabs(r.dz[i * units + j]) + e_dz[i * units + j];
      e += e_dz[i * units + j];
    }
    fdb.check(j, to_d(got_db[j]), r.db[j], uT * std::fabs(r.db[j]) + static_cast<double>(rows + 40) * uf * s + e + tiny);
    totals.db += std::fabs(r.db[j]);
  }
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t k = 0; k < in; ++k) {
      double s = 0, e = 0;
      for (std::size_t j = 0; j < units; ++j) {
        s += (std::fabs(r.dz[i * units + j]) + e_dz[i * units + j]) * std::fabs(w[k * units + j]);
        e += e_dz[i * units + j] * std::fabs(w[k * units + j]);
      }
      std::size_t const o = i * in + k;
      fdx.check(o, to_d(got_dx[o]), r.dx[o], uT * std::fabs(r.dx[o]) + static_cast<double>(units + 4) * ua * s + e + tiny);
      totals.dx += std::fabs(r.dx[o]);
    }
  MPX_REQUIRE_WITHIN(fy);
  MPX_REQUIRE_WITHIN(fdw);
  MPX_REQUIRE_WITHIN(fdb);
  MPX_REQUIRE_WITHIN(fdx);
}

// ---- normalisations ----

struct norm_bounds {
  double k_stat, k_param;
};

//! Checks y, dx, dgamma, dbeta of a normalisation against normalize_matrix (bounds of
//! tests/kernels/test_norm.cpp).
template <class T>
void check_norm(std::string const& what, std::vector<double> const& x, std::vector<double> const& dy,
                std::vector<double> const& gamma, std::vector<double> const& beta, norm_reference const& r,
                std::size_t rows, std::size_t cols, bool per_column, norm_bounds k, std::vector<T> const& got_y,
                std::vector<T> const& got_dx, std::vector<float> const& got_dgamma,
                std::vector<float> const& got_dbeta) {
  double const uT = mpx_test::unit_roundoff<T>();
  std::size_t const groups = per_column ? cols : rows, n = per_column ? rows : cols;
  auto at = [&](std::size_t g, std::size_t e) { return per_column ? e * cols + g : g * cols + e; };
  mpx_test::bound_checker fy(what + " y"), fdx(what + " dx"), fdg(what + " dgamma"), fdb(what + " dbeta");
  std::vector<double> abs_dy(cols), abs_dyx(cols);
  double nonzero = 0;
  for (std::size_t g = 0; g < groups; ++g) {
    double xmax = 0, mg = 0, mgx = 0;
    for (std::size_t e = 0; e < n; ++e) {
      std::size_t const i = at(g, e), j = i % cols;
      xmax = std::max(xmax, std::fabs(x[i]));
      mg += std::fabs(dy[i] * gamma[j]) / static_cast<double>(n);
      mgx += std::fabs(dy[i] * gamma[j] * r.forward.xhat[i]) / static_cast<double>(n);
    }
    double const kappa = xmax * r.forward.rstd[g];
    double const scale = 4 * k.k_stat * uf * (1 + kappa);
    for (std::size_t e = 0; e < n; ++e) {
      std::size_t const i = at(g, e), j = i % cols;
      fy.check(i, to_d(got_y[i]), r.forward.y[i],
               uT * std::fabs(r.forward.y[i]) + scale * (std::fabs(gamma[j]) + 1) + std::fabs(beta[j]) * uf);
      fdx.check(i, to_d(got_dx[i]), r.backward.dx[i],
                uT * std::fabs(r.backward.dx[i]) +
                    scale * r.forward.rstd[g] *
                        (std::fabs(dy[i] * gamma[j]) + mg + (std::fabs(r.forward.xhat[i]) + 1) * mgx) +
                    mpx_test::min_subnormal<T>());
      abs_dy[j] += std::fabs(dy[i]);
      abs_dyx[j] += std::fabs(dy[i]) * (1 + std::fabs(r.forward.xhat[i])) * (1 + kappa);
      nonzero += std::fabs(r.forward.y[i]) + std::fabs(r.backward.dx[i]);
    }
  }
  for (std::size_t j = 0; j < cols; ++j) {
    fdg.check(j, got_dgamma[j], r.backward.dgamma[j], 4 * (k.k_param + k.k_stat) * uf * abs_dyx[j]);
    fdb.check(j, got_dbeta[j], r.backward.dbeta[j], k.k_param * uf * abs_dy[j]);
  }
  REQUIRE(nonzero > 0);
  MPX_REQUIRE_WITHIN(fy);
  MPX_REQUIRE_WITHIN(fdx);
  MPX_REQUIRE_WITHIN(fdg);
  MPX_REQUIRE_WITHIN(fdb);
}

struct norm_case {
  std::int64_t batch;
  std::vector<std::int64_t> sample;
};

template <class T, class Exec>
void check_batch_norm_layer(Exec const& exec, norm_case const& c, std::uint64_t stream) {
  using Space = mpx::memory_space_t<Exec>;
  mpx::shape const s = batched(c.batch, c.sample);
  std::size_t const cols = static_cast<std::size_t>(c.sample.back()), rows = s.size() / cols;
  INFO(mpx::dtype_name<T> << " batch_norm on " << s.to_string());
  // Not Keras's defaults, so that a layer that ignored its config would be caught.
  mpx::batch_norm_config const config{.momentum = 0.75f, .eps = 0.25f};
  mpx::batch_norm<policy_of<T>> layer(config);
  layer.set_name("bn");
  layer.build(exec, make_shape(c.sample), 0);
  layer.reserve(exec, c.batch);
  std::vector<mpx::parameter<Space>> params;
  layer.append_parameters(params);
  std::vector<std::pair<std::string, mpx::tensor_ref<Space>>> state;
  layer.template append_state<Space>(state);
  REQUIRE(params.size() == 2);
  REQUIRE(state.size() == 2);
  CHECK(params[0].name == "bn/gamma");
  CHECK(params[1].name == "bn/beta");
  CHECK(state[0].first == "bn/moving_mean");
  CHECK(state[1].first == "bn/moving_variance");
  CHECK(params[0].value.dtype() == mpx::dtype_id::float32);
  CHECK(layer.parameter_count() == 2 * cols);
  // Built as Keras builds it: gamma 1, beta 0, moving mean 0, moving variance 1.
  CHECK(fetch<float>(exec, params[0].value) == std::vector<float>(cols, 1.0f));
  CHECK(fetch<float>(exec, params[1].value) == std::vector<float>(cols, 0.0f));
  CHECK(fetch<float>(exec, state[0].second) == std::vector<float>(cols, 0.0f));
  CHECK(fetch<float>(exec, state[1].second) == std::vector<float>(cols, 1.0f));

  auto const gamma = mpx_test::random_values<float>(cols, 0.5, 2, stream + 1);
  auto const beta = mpx_test::random_values<float>(cols, -1, 1, stream + 2);
  auto const mean0 = mpx_test::random_values<float>(cols, -1, 1, stream + 3);
  auto const var0 = mpx_test::random_values<float>(cols, 0.5, 2, stream + 4);
  assign(exec, params[0].value, gamma);
  assign(exec, params[1].value, beta);
  assign(exec, state[0].second, mean0);
  assign(exec, state[1].second, var0);
  poison_ref<float>(exec, params[0].gradient);
  poison_ref<float>(exec, params[1].gradient);

  auto const xs = mpx_test::random_values<T>(s.size(), -3, 5, stream + 5);
  auto const dys = mpx_test::random_values<T>(s.size(), -1, 1, stream + 6);
  auto const x = mpx_test::upload(exec, xs, s);
  auto const dy = mpx_test::upload(exec, dys, s);
  auto y = poisoned<T>(exec, s);
  auto dx = poisoned<T>(exec, s);
  layer.forward(exec, cview(x), mview(y), true);
  layer.backward(exec, cview(x), cview(y), cview(dy), mview(dx));

  auto const xd = widen(xs), dyd = widen(dys), gd = widen(gamma), bd = widen(beta);
  auto const r = normalize_matrix(xd, dyd, gd, bd, rows, cols, true, config.eps);
  double const k = static_cast<double>(rows + 40);
  auto const got_dgamma = fetch<float>(exec, params[0].gradient);
  auto const got_dbeta = fetch<float>(exec, params[1].gradient);
  check_norm<T>("batch_norm " + std::string(mpx::dtype_name<T>), xd, dyd, gd, bd, r, rows, cols, true, {k, k},
                mpx_test::download(exec, y), mpx_test::download(exec, dx), got_dgamma, got_dbeta);

  // Without dx the parameter gradients are the same.
  poison_ref<float>(exec, params[0].gradient);
  poison_ref<float>(exec, params[1].gradient);
  layer.backward(exec, cview(x), cview(y), cview(dy), mpx::tensor_view<T, Space>{});
  CHECK(mpx_test::first_mismatch(fetch<float>(exec, params[0].gradient), got_dgamma) == std::string());
  CHECK(mpx_test::first_mismatch(fetch<float>(exec, params[1].gradient), got_dbeta) == std::string());

  // Running statistics after one training step: momentum * initial + (1 - momentum) *
  // batch statistic, the variance unbiased.
  auto const rm = fetch<float>(exec, state[0].second);
  auto const rv = fetch<float>(exec, state[1].second);
  double const m = config.momentum;
  mpx_test::bound_checker running("batch_norm running statistics");
  for (std::size_t j = 0; j < cols; ++j) {
    double xmax = 0;
    for (std::size_t i = 0; i < rows; ++i) xmax = std::max(xmax, std::fabs(xd[i * cols + j]));
    double const unbiased = r.forward.var[j] * static_cast<double>(rows) / static_cast<double>(rows - 1);
    running.check(j, rm[j], m * mean0[j] + (1 - m) * r.forward.mean[j], 8 * k * uf * (std::fabs(mean0[j]) + xmax));
    running.check(cols + j, rv[j], m * var0[j] + (1 - m) * unbiased,
                  8 * k * uf * (std::fabs(var0[j]) + xmax * xmax + 1));
  }
  MPX_REQUIRE_WITHIN(running);

  // Inference uses the running statistics and leaves them alone.
  auto yi = poisoned<T>(exec, s);
  layer.forward(exec, cview(x), mview(yi), false);
  auto const got = mpx_test::download(exec, yi);
  CHECK(fetch<float>(exec, state[0].second) == rm);
  CHECK(fetch<float>(exec, state[1].second) == rv);
  mpx_test::bound_checker inference("batch_norm " + std::string(mpx::dtype_name<T>) + " inference");
  for (std::size_t i = 0; i < xs.size(); ++i) {
    std::size_t const j = i % cols;
    double const rs = 1 / std::sqrt(static_cast<double>(rv[j]) + config.eps);
    double const ref = (xd[i] - rm[j]) * rs * gd[j] + bd[j];
    inference.check(i, to_d(got[i]), ref,
                    mpx_test::unit_roundoff<T>() * std::fabs(ref) +
                        8 * uf * (std::fabs(xd[i]) + std::fabs(rm[j]) + 1) * rs * (gd[j] + 1) + 4 * uf * std::fabs(bd[j]));
  }
  MPX_REQUIRE_WITHIN(inference);
}

template <class T, class Exec>
void check_layer_norm_layer(Exec const& exec, norm_case const& c, std::uint64_t stream) {
  using Space = mpx::memory_space_t<Exec>;
  mpx::shape const s = batched(c.batch, c.sample);
  std::size_t const cols = static_cast<std::size_t>(c.sample.back()), rows = s.size() / cols;
  INFO(mpx::dtype_name<T> << " layer_norm on " << s.to_string());
  mpx::layer_norm_config const config{.eps = 0.25f};
  mpx::layer_norm<policy_of<T>> layer(config);
  layer.set_name("ln");
  layer.build(exec, make_shape(c.sample), 0);
  layer.reserve(exec, c.batch);
  std::vector<mpx::parameter<Space>> params;
  layer.append_parameters(params);
  REQUIRE(params.size() == 2);
  CHECK(params[0].name == "ln/gamma");
  CHECK(params[1].name == "ln/beta");
  CHECK(params[1].value.dtype() == mpx::dtype_id::float32);
  CHECK(layer.parameter_count() == 2 * cols);
  CHECK(fetch<float>(exec, params[0].value) == std::vector<float>(cols, 1.0f));
  CHECK(fetch<float>(exec, params[1].value) == std::vector<float>(cols, 0.0f));

  auto const gamma = mpx_test::random_values<float>(cols, 0.5, 2, stream + 1);
  auto const beta = mpx_test::random_values<float>(cols, -1, 1, stream + 2);
  assign(exec, params[0].value, gamma);
  assign(exec, params[1].value, beta);
  poison_ref<float>(exec, params[0].gradient);
  poison_ref<float>(exec, params[1].gradient);

  auto const xs = mpx_test::random_values<T>(s.size(), -3, 5, stream + 5);
  auto const dys = mpx_test::random_values<T>(s.size(), -1, 1, stream + 6);
  auto const x = mpx_test::upload(exec, xs, s);
  auto const dy = mpx_test::upload(exec, dys, s);
  auto y = poisoned<T>(exec, s);
  auto dx = poisoned<T>(exec, s);
  layer.forward(exec, cview(x), mview(y), true);
  layer.backward(exec, cview(x), cview(y), cview(dy), mview(dx));

  auto const xd = widen(xs), dyd = widen(dys), gd = widen(gamma), bd = widen(beta);
  auto const r = normalize_matrix(xd, dyd, gd, bd, rows, cols, false, config.eps);
  auto const got_dgamma = fetch<float>(exec, params[0].gradient);
  auto const got_dbeta = fetch<float>(exec, params[1].gradient);
  check_norm<T>("layer_norm " + std::string(mpx::dtype_name<T>), xd, dyd, gd, bd, r, rows, cols, false,
                {static_cast<double>(cols + 40), static_cast<double>(rows + 40)}, mpx_test::download(exec, y),
                mpx_test::download(exec, dx), got_dgamma, got_dbeta);

  poison_ref<float>(exec, params[0].gradient);
  poison_ref<float>(exec, params[1].gradient);
  layer.backward(exec, cview(x), cview(y), cview(dy), mpx::tensor_view<T, Space>{});
  CHECK(mpx_test::first_mismatch(fetch<float>(exec, params[0].gradient), got_dgamma) == std::string());
  CHECK(mpx_test::first_mismatch(fetch<float>(exec, params[1].gradient), got_dbeta) == std::string());

  // Training and inference are the same function for layer norm.
  auto yi = poisoned<T>(exec, s);
  layer.forward(exec, cview(x), mview(yi), false);
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, yi), mpx_test::download(exec, y)) == std::string());
}

}  // namespace

// ---------------------------------------------------------------------------------------
// dense

TEST_CASE("the float64 dense reference's gradients agree with finite differences", "[layers][dense]") {
  std::size_t const rows = 2, in = 3, units = 2;
  auto const x = mpx_test::random_values<double>(rows * in, -2, 2, 1);
  auto const w = mpx_test::random_values<double>(in * units, -1, 1, 2);
  auto const b = mpx_test::random_values<double>(units, -1, 1, 3);
  auto const dy = mpx_test::random_values<double>(rows * units, -1, 1, 4);
  for (mpx::activation a : all_activations) {
    INFO(mpx::to_string(a));
    auto const r = reference_dense(x, w, b, dy, rows, in, units, a);
    for (std::size_t o = 0; o < rows * units; ++o)
      REQUIRE(std::fabs(r.z[o] + b[o % units]) > 1e-3);  // away from relu's kink
    auto loss = [&](std::vector<double> const& xs, std::vector<double> const& ws, std::vector<double> const& bs) {
      auto const y = reference_dense(xs, ws, bs, dy, rows, in, units, a).y;
      double l = 0;
      for (std::size_t i = 0; i < y.size(); ++i) l += dy[i] * y[i];
      return l;
    };
    auto check = [&](char const* what, std::vector<double> const& v, std::vector<double> const& grad, auto with) {
      for (std::size_t i = 0; i < v.size(); ++i) {
        double const fd = mpx_test::finite_difference(
            [&](double t) {
              auto u = v;
              u[i] = t;
              return with(u);
            },
            v[i]);
        INFO(what << "[" << i << "]: finite difference " << fd << ", analytic " << grad[i]);
        REQUIRE(std::fabs(fd - grad[i]) <= 1e-7 * (1 + std::fabs(fd)));
      }
    };
    check("dx", x, r.dx, [&](std::vector<double> const& u) { return loss(u, w, b); });
    check("dW", w, r.dw, [&](std::vector<double> const& u) { return loss(x, u, b); });
    check("db", b, r.db, [&](std::vector<double> const& u) { return loss(x, w, u); });
  }
}

TEMPLATE_LIST_TEST_CASE("dense forward and backward match float64 for every activation and awkward shapes",
                        "[layers][dense]", mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (mpx::activation a : all_activations) {
      nonzero_totals totals;
      std::uint64_t stream = 100;
      for (std::int64_t in : {1, 7, 33})
        for (std::int64_t units : {1, 5, 17})
          for (std::int64_t batch : {1, 3, 13})
            for (std::int64_t steps : {0, 4}) check_dense<T>(exec, a, {batch, steps, in, units}, stream += 10, totals);
      // The references are not all zeros (relu's could be, for one small case).
      CHECK(totals.y > 0);
      CHECK(totals.dw > 0);
      CHECK(totals.db > 0);
      CHECK(totals.dx > 0);
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("dense backward with an empty dx writes only the parameter gradients", "[layers][dense]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (mpx::activation a : {mpx::activation(mpx::activation::linear), mpx::activation(mpx::activation::gelu),
                              mpx::activation(mpx::activation::gelu_tanh)}) {
      INFO(mpx::dtype_name<T> << " " << mpx::to_string(a));
      mpx::dense<policy_of<T>> layer(5, a);
      layer.set_name("dense");
      layer.build(exec, mpx::shape{3, 7}, 11);
      layer.reserve(exec, 2);
      std::vector<mpx::parameter<Space>> params;
      layer.append_parameters(params);
      assign(exec, params[1].value, mpx_test::random_values<T>(5, -1, 1, 201));
      auto const xs = mpx_test::random_values<T>(2 * 3 * 7, -2, 2, 202);
      auto const dys = mpx_test::random_values<T>(2 * 3 * 5, -1, 1, 203);
      auto const x = mpx_test::upload(exec, xs, {2, 3, 7});
      auto const dy = mpx_test::upload(exec, dys, {2, 3, 5});
      auto y = poisoned<T>(exec, {2, 3, 5});
      auto dx = poisoned<T>(exec, {2, 3, 7});

      layer.forward(exec, cview(x), mview(y), true);
      auto const y_first = mpx_test::download(exec, y);
      poison_ref<T>(exec, params[0].gradient);
      poison_ref<T>(exec, params[1].gradient);
      layer.backward(exec, cview(x), cview(y), cview(dy), mpx::tensor_view<T, Space>{});
      auto const dw_alone = fetch<T>(exec, params[0].gradient);
      auto const db_alone = fetch<T>(exec, params[1].gradient);
      // Nothing the layer was given changed.
      CHECK(mpx_test::first_mismatch(mpx_test::download(exec, x), xs) == std::string());
      CHECK(mpx_test::first_mismatch(mpx_test::download(exec, dy), dys) == std::string());
      CHECK(mpx_test::first_mismatch(mpx_test::download(exec, y), y_first) == std::string());

      // The same step with dx: the same parameter gradients, bit for bit.
      layer.forward(exec, cview(x), mview(y), true);
      poison_ref<T>(exec, params[0].gradient);
      poison_ref<T>(exec, params[1].gradient);
      layer.backward(exec, cview(x), cview(y), cview(dy), mview(dx));
      CHECK(mpx_test::first_mismatch(fetch<T>(exec, params[0].gradient), dw_alone) == std::string());
      CHECK(mpx_test::first_mismatch(fetch<T>(exec, params[1].gradient), db_alone) == std::string());
      auto const got_dx = mpx_test::download(exec, dx);
      CHECK(std::none_of(got_dx.begin(), got_dx.end(), [](T v) { return mpx::is_nan(v); }));
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("dense hands out its parameters by name, shape and dtype", "[layers][dense]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    mpx::dense<policy_of<T>> layer(17, mpx::activation::tanh);
    layer.set_name("dense");
    CHECK_FALSE(layer.built());
    layer.build(exec, mpx::shape{4, 33}, 5);
    CHECK(layer.built());
    CHECK(layer.input_shape() == mpx::shape{4, 33});
    CHECK(layer.output_shape() == mpx::shape{4, 17});
    CHECK(layer.parameter_count() == 33 * 17 + 17);
    std::vector<mpx::parameter<Space>> params;
    layer.append_parameters(params);
    REQUIRE(params.size() == 2);
    CHECK(params[0].name == "dense/kernel");
    CHECK(params[1].name == "dense/bias");
    CHECK(params[0].value.shape() == mpx::shape{33, 17});
    CHECK(params[1].value.shape() == mpx::shape{17});
    for (auto const& p : params) {
      CHECK(p.value.dtype() == mpx::dtype_id_of<T>);
      CHECK(p.gradient.dtype() == mpx::dtype_id_of<T>);
      CHECK(p.gradient.shape() == p.value.shape());
      CHECK(p.gradient.data() != p.value.data());
    }
    CHECK(params[0].value.data() == layer.template kernel<Space>().data());
    CHECK(params[1].value.data() == layer.template bias<Space>().data());
    CHECK(params[0].gradient.data() == layer.template kernel_gradient<Space>().data());
    CHECK(params[1].gradient.data() == layer.template bias_gradient<Space>().data());
    // The bias starts at zero (Keras's default).
    CHECK(fetch<T>(exec, params[1].value) == std::vector<T>(17, T(0.0f)));
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("dense initialises its kernel as Keras does, reproducibly", "[layers][dense][init]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  auto kernel_of = [&](auto tag, mpx::dense_config config, mpx::shape sample, std::uint64_t seed, auto const& on) {
    using T = decltype(tag);
    using S = mpx::memory_space_t<std::remove_cvref_t<decltype(on)>>;
    mpx::dense<policy_of<T>> layer(config);
    layer.set_name("dense");
    layer.build(on, sample, seed);
    return widen(mpx_test::download(on, layer.template kernel<S>()));
  };
  // fan_in is the last input axis (64, not 3 * 64), fan_out the units.
  std::int64_t const in = 64, units = 48;
  mpx::shape const sample{3, in};
  double const n = static_cast<double>(in * units);

  auto const glorot = kernel_of(float{}, {.units = units}, sample, 7, exec);
  double const limit = std::sqrt(6.0 / static_cast<double>(in + units));
  double sum = 0, largest = 0;
  for (double v : glorot) {
    sum += v;
    largest = std::max(largest, std::fabs(v));
  }
  INFO("glorot_uniform: limit " << limit << ", largest " << largest << ", mean " << sum / n);
  CHECK(largest <= limit);
  CHECK(largest >= 0.98 * limit);  // a smaller fan would give a larger limit, a larger fan a smaller one
  CHECK(std::fabs(sum / n) <= 4 * limit / std::sqrt(3 * n));  // four standard errors of the mean

  auto const he = kernel_of(float{}, {.units = units, .kernel_initializer = mpx::initializer::he_uniform}, sample, 7, exec);
  double const he_limit = std::sqrt(6.0 / static_cast<double>(in));
  double he_largest = 0;
  for (double v : he) he_largest = std::max(he_largest, std::fabs(v));
  INFO("he_uniform: limit " << he_limit << ", largest " << he_largest);
  CHECK(he_largest <= he_limit);
  CHECK(he_largest >= 0.98 * he_limit);

  auto const normal =
      kernel_of(float{}, {.units = units, .kernel_initializer = mpx::initializer::glorot_normal}, sample, 7, exec);
  double sq = 0, normal_largest = 0;
  for (double v : normal) {
    sq += v * v;
    normal_largest = std::max(normal_largest, std::fabs(v));
  }
  double const stddev = std::sqrt(2.0 / static_cast<double>(in + units));
  INFO("glorot_normal: stddev " << std::sqrt(sq / n) << ", expected " << stddev);
  CHECK(std::fabs(std::sqrt(sq / n) / stddev - 1) < 0.06);
  CHECK(normal_largest <= 2 * stddev / 0.87962566103423978 * (1 + 1e-6));  // truncated at two deviations

  // Same seed, same values; another seed, other values; the dtype only rounds them.
  CHECK(kernel_of(float{}, {.units = units}, sample, 7, exec) == glorot);
  auto const other = kernel_of(float{}, {.units = units}, sample, 8, exec);
  std::size_t same = 0;
  for (std::size_t i = 0; i < other.size(); ++i) same += other[i] == glorot[i];
  CHECK(same < other.size() / 100);
  auto const as_half = kernel_of(mpx::half{}, {.units = units}, sample, 7, exec);
  auto const as_bf16 = kernel_of(mpx::bfloat16{}, {.units = units}, sample, 7, exec);
  for (std::size_t i = 0; i < glorot.size(); ++i) {
    INFO("element " << i);
    REQUIRE(as_half[i] == to_d(mpx::cast<mpx::half>(static_cast<float>(glorot[i]))));
    REQUIRE(as_bf16[i] == to_d(mpx::cast<mpx::bfloat16>(static_cast<float>(glorot[i]))));
  }
  // The bias gets its own stream (not the kernel's first values) when it is random.
  mpx::dense<mpx::float32> random_bias({.units = units, .bias_initializer = mpx::initializer::glorot_uniform});
  random_bias.build(exec, sample, 7);
  auto const bias = widen(mpx_test::download(exec, random_bias.template bias<Space>()));
  CHECK(std::vector<double>(glorot.begin(), glorot.begin() + units) != bias);

  // The host builds the same values as this test's executor (the GPU in the CUDA suite).
  mpx::host_executor host;
  CHECK(kernel_of(float{}, {.units = units}, sample, 7, host) == glorot);
  CHECK(kernel_of(mpx::half{}, {.units = units}, sample, 7, host) == as_half);
}

// ---------------------------------------------------------------------------------------
// normalisations

TEMPLATE_LIST_TEST_CASE("the batch_norm layer trains, updates its statistics and infers as float64 says",
                        "[layers][norm]", mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    std::uint64_t stream = 300;
    for (norm_case const& c : {norm_case{13, {7}}, norm_case{4, {3, 5}}, norm_case{2, {2, 2, 3}}, norm_case{1, {9, 1}},
                               norm_case{3, {33}}})
      check_batch_norm_layer<T>(exec, c, stream += 10);
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("the layer_norm layer normalises each sample's last axis as float64 says", "[layers][norm]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    std::uint64_t stream = 400;
    for (norm_case const& c : {norm_case{3, {33}}, norm_case{2, {4, 9}}, norm_case{1, {7}}, norm_case{5, {2, 1}}})
      check_layer_norm_layer<T>(exec, c, stream += 10);
  };
  mpx_test::for_each_dtype(for_type);
}

// ---------------------------------------------------------------------------------------
// dropout

TEMPLATE_LIST_TEST_CASE("the dropout layer: identity in inference, one mask per training step", "[layers][dropout]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    INFO(mpx::dtype_name<T>);
    std::vector<std::int64_t> const sample{50, 8};
    std::int64_t const batch = 10;
    mpx::shape const s = batched(batch, sample);
    float const rate = 0.3f;
    auto make = [&](std::uint64_t seed) {
      mpx::dropout<policy_of<T>> layer(rate);
      layer.set_name("dropout");
      layer.build(exec, make_shape(sample), seed);
      layer.reserve(exec, batch);
      return layer;
    };
    auto layer = make(1234);
    CHECK(layer.parameter_count() == 0);
    std::vector<mpx::parameter<Space>> params;
    layer.append_parameters(params);
    CHECK(params.empty());

    // Nonzero inputs, so a zero in the output is a dropped element.
    auto xs = mpx_test::random_values<T>(s.size(), 0.25, 2, 501);
    for (std::size_t i = 1; i < xs.size(); i += 2) xs[i] = mpx::cast<T>(-to_d(xs[i]));
    auto const dys = mpx_test::random_values<T>(s.size(), 0.25, 2, 502);
    auto const x = mpx_test::upload(exec, xs, s);
    auto const dy = mpx_test::upload(exec, dys, s);
    auto y = poisoned<T>(exec, s);
    auto dx = poisoned<T>(exec, s);

    layer.forward(exec, cview(x), mview(y), false);
    CHECK(mpx_test::first_mismatch(mpx_test::download(exec, y), xs) == std::string());
    layer.backward(exec, cview(x), cview(y), cview(dy), mview(dx));
    CHECK(mpx_test::first_mismatch(mpx_test::download(exec, dx), dys) == std::string());

    // Training: dropped elements are 0, the others x / (1 - rate); dx uses the same mask.
    auto train = [&](auto& l) {
      mpx::fill(exec, y, mpx_test::poison<T>());
      mpx::fill(exec, dx, mpx_test::poison<T>());
      l.forward(exec, cview(x), mview(y), true);
      l.backward(exec, cview(x), cview(y), cview(dy), mview(dx));
      auto const got_y = mpx_test::download(exec, y);
      auto const got_dx = mpx_test::download(exec, dx);
      std::vector<bool> kept(got_y.size());
      mpx_test::bound_checker fy("dropout y"), fdx("dropout dx");
      double const scale = 1.0 / (1.0 - rate), uT = mpx_test::unit_roundoff<T>();
      std::size_t dropped = 0;
      for (std::size_t i = 0; i < got_y.size(); ++i) {
        kept[i] = to_d(got_y[i]) != 0;
        dropped += !kept[i];
        double const ry = kept[i] ? to_d(xs[i]) * scale : 0.0, rdx = kept[i] ? to_d(dys[i]) * scale : 0.0;
        fy.check(i, to_d(got_y[i]), ry, (uT + 4 * uf) * std::fabs(ry));
        fdx.check(i, to_d(got_dx[i]), rdx, (uT + 4 * uf) * std::fabs(rdx));
      }
      MPX_REQUIRE_WITHIN(fy);
      MPX_REQUIRE_WITHIN(fdx);
      double const share = static_cast<double>(dropped) / static_cast<double>(got_y.size());
      INFO("dropped share " << share << " for rate " << rate);
      CHECK(std::fabs(share - rate) <= 4 * std::sqrt(rate * (1 - rate) / static_cast<double>(got_y.size())));
      return kept;
    };
    auto const first = train(layer);
    auto const second = train(layer);
    std::size_t differ = 0;
    for (std::size_t i = 0; i < first.size(); ++i) differ += first[i] != second[i];
    CHECK(differ > first.size() / 5);  // two independent masks differ in 2 rate (1 - rate) = 42% of places

    // Reproducible from the seed: a new layer with the same seed repeats both steps.
    auto again = make(1234);
    CHECK(train(again) == first);
    CHECK(train(again) == second);
    auto other = make(4321);
    CHECK(train(other) != first);

    // After an inference forward, backward passes dy through.
    layer.forward(exec, cview(x), mview(y), false);
    layer.backward(exec, cview(x), cview(y), cview(dy), mview(dx));
    CHECK(mpx_test::first_mismatch(mpx_test::download(exec, dx), dys) == std::string());
  };
  mpx_test::for_each_dtype(for_type);
}

// ---------------------------------------------------------------------------------------
// flatten, activation, softmax

TEMPLATE_LIST_TEST_CASE("the flatten layer reshapes forward and back", "[layers]", mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    mpx::flatten<policy_of<T>> layer;
    layer.set_name("flatten");
    layer.build(exec, mpx::shape{3, 4, 5}, 0);
    layer.reserve(exec, 2);
    CHECK(layer.output_shape() == mpx::shape{60});
    CHECK(layer.parameter_count() == 0);
    auto const xs = mpx_test::random_values<T>(120, -2, 2, 601);
    auto const dys = mpx_test::random_values<T>(120, -2, 2, 602);
    auto const x = mpx_test::upload(exec, xs, {2, 3, 4, 5});
    auto const dy = mpx_test::upload(exec, dys, {2, 60});
    auto y = poisoned<T>(exec, {2, 60});
    auto dx = poisoned<T>(exec, {2, 3, 4, 5});
    layer.forward(exec, cview(x), mview(y), true);
    layer.backward(exec, cview(x), cview(y), cview(dy), mview(dx));
    CHECK(mpx_test::first_mismatch(mpx_test::download(exec, y), xs) == std::string());
    CHECK(mpx_test::first_mismatch(mpx_test::download(exec, dx), dys) == std::string());
    layer.backward(exec, cview(x), cview(y), cview(dy), mpx::tensor_view<T, Space>{});  // no dx: nothing to do
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("the activation layer applies its activation and its derivative at x", "[layers]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    mpx::shape const s{3, 4, 5};
    auto const xs = mpx_test::random_values<T>(s.size(), -4, 4, 701);
    auto const dys = mpx_test::random_values<T>(s.size(), -1, 1, 702);
    auto const x = mpx_test::upload(exec, xs, s);
    auto const dy = mpx_test::upload(exec, dys, s);
    double const uT = mpx_test::unit_roundoff<T>(), tiny = mpx_test::min_subnormal<T>();
    for (mpx::activation a : all_activations) {
      std::string const what = "activation " + std::string(mpx::dtype_name<T>) + " " + std::string(mpx::to_string(a));
      mpx::activation_layer<policy_of<T>> layer(a);
      layer.set_name("act");
      layer.build(exec, mpx::shape{4, 5}, 0);
      layer.reserve(exec, 3);
      auto y = poisoned<T>(exec, s);
      auto dx = poisoned<T>(exec, s);
      layer.forward(exec, cview(x), mview(y), true);
      layer.backward(exec, cview(x), cview(y), cview(dy), mview(dx));
      auto const got_y = mpx_test::download(exec, y);
      auto const got_dx = mpx_test::download(exec, dx);
      mpx_test::bound_checker fy(what + " y"), fdx(what + " dx");
      for (std::size_t i = 0; i < xs.size(); ++i) {
        double const xv = to_d(xs[i]), ry = act_forward(a, xv), rdx = to_d(dys[i]) * act_derivative(a, xv);
        fy.check(i, to_d(got_y[i]), ry, uT * std::fabs(ry) + 8 * uf * (std::fabs(ry) + std::fabs(xv)) + tiny);
        fdx.check(i, to_d(got_dx[i]), rdx, uT * std::fabs(rdx) + 16 * uf * std::fabs(to_d(dys[i])) * (1 + std::fabs(xv)) + tiny);
      }
      MPX_REQUIRE_WITHIN(fy);
      MPX_REQUIRE_WITHIN(fdx);
      layer.backward(exec, cview(x), cview(y), cview(dy), mpx::tensor_view<T, Space>{});
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("the softmax layer normalises the last axis, and its backward uses its output", "[layers]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    std::size_t const cols = 7;
    mpx::shape const s{2, 3, 7};
    std::size_t const rows = s.size() / cols;
    auto const xs = mpx_test::random_values<T>(s.size(), -4, 4, 801);
    auto const dys = mpx_test::random_values<T>(s.size(), -1, 1, 802);
    auto const x = mpx_test::upload(exec, xs, s);
    auto const dy = mpx_test::upload(exec, dys, s);
    mpx::softmax_layer<policy_of<T>> layer;
    layer.set_name("softmax");
    layer.build(exec, mpx::shape{3, 7}, 0);
    layer.reserve(exec, 2);
    auto y = poisoned<T>(exec, s);
    auto dx = poisoned<T>(exec, s);
    layer.forward(exec, cview(x), mview(y), true);
    layer.backward(exec, cview(x), cview(y), cview(dy), mview(dx));
    auto const got_y = mpx_test::download(exec, y);
    auto const got_dx = mpx_test::download(exec, dx);
    double const uT = mpx_test::unit_roundoff<T>(), tiny = mpx_test::min_subnormal<T>();
    std::string const what = "softmax " + std::string(mpx::dtype_name<T>);
    mpx_test::bound_checker fy(what + " y"), fdx(what + " dx");
    auto const row_of = [&](auto const& v, std::size_t r) {
      std::vector<double> out(cols);
      for (std::size_t j = 0; j < cols; ++j) out[j] = to_d(v[r * cols + j]);
      return out;
    };
    for (std::size_t r = 0; r < rows; ++r) {
      auto const y_ref = mpx_test::reference::softmax_row(row_of(xs, r));
      // The backward pass is a function of the forward's (rounded) output.
      auto const y_got = row_of(got_y, r), dy_row = row_of(dys, r);
      auto const back = mpx_test::reference::softmax_backward_row(y_got, dy_row);
      for (std::size_t j = 0; j < cols; ++j) {
        std::size_t const i = r * cols + j;
        double const ref = y_ref[j];
        fy.check(i, to_d(got_y[i]), ref, uT * ref + 64 * uf * ref + tiny);
      }
      for (std::size_t j = 0; j < cols; ++j) {
        std::size_t const i = r * cols + j;
        double const yv = y_got[j], ref = back.dx[j];
        fdx.check(i, to_d(got_dx[i]), ref,
                  uT * std::fabs(ref) + 8 * static_cast<double>(cols + 8) * uf * yv * (std::fabs(dy_row[j]) + back.abs_dot) + tiny);
      }
    }
    MPX_REQUIRE_WITHIN(fy);
    MPX_REQUIRE_WITHIN(fdx);
    layer.backward(exec, cview(x), cview(y), cview(dy), mpx::tensor_view<T, Space>{});
  };
  mpx_test::for_each_dtype(for_type);
}

// ---------------------------------------------------------------------------------------
// errors

TEMPLATE_LIST_TEST_CASE("dense refuses misuse, naming itself and the shapes", "[layers][errors]",
                        mpx_test::executors) {
  using Catch::Matchers::Contains;
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  using P = mpx::float32;
  auto x = mpx::make_tensor<float>(exec, {3, 7});
  auto y = mpx::make_tensor<float>(exec, {3, 5});
  auto dx = mpx::make_tensor<float>(exec, {3, 7});
  mpx::fill(exec, x, 1.0f);
  mpx::fill(exec, y, 1.0f);

  mpx::dense<P> fc(5, mpx::activation::relu);
  fc.set_name("dense");
  std::vector<mpx::parameter<Space>> params;
  CHECK_THROWS_TYPE_WITH(fc.forward(exec, cview(x), mview(y), true), mpx::invalid_argument,
                         Contains("dense") && Contains("before build"));
  CHECK_THROWS_TYPE_WITH(fc.backward(exec, cview(x), cview(y), cview(y), mview(dx)), mpx::invalid_argument,
                         Contains("dense") && Contains("before build"));
  CHECK_THROWS_TYPE_WITH(fc.reserve(exec, 3), mpx::invalid_argument, Contains("dense") && Contains("before build"));
  CHECK_THROWS_TYPE_WITH(fc.append_parameters(params), mpx::invalid_argument,
                         Contains("dense") && Contains("before build"));
  CHECK_THROWS_TYPE_WITH(mpx::dense<P>(0), mpx::invalid_argument, Contains("units must be positive"));

  // Built but not reserved: the first forward reserves the workspace for its batch.
  mpx::dense<P> unreserved(5, mpx::activation::relu);
  unreserved.set_name("dense");
  unreserved.build(exec, mpx::shape{7}, 1);
  CHECK(unreserved.reserved_batch() == 0);
  unreserved.forward(exec, cview(x), mview(y), true);
  CHECK(unreserved.reserved_batch() == 3);

  fc.build(exec, mpx::shape{7}, 1);
  fc.reserve(exec, 3);
  fc.forward(exec, cview(x), mview(y), true);  // the right shapes pass

  auto x6 = mpx::make_tensor<float>(exec, {3, 6});
  CHECK_THROWS_TYPE_WITH(fc.forward(exec, cview(x6), mview(y), true), mpx::shape_error,
                         Contains("dense") && Contains("input has shape [3, 6]") && Contains("[batch, 7]"));
  auto x_flat = mpx::make_tensor<float>(exec, {21});
  CHECK_THROWS_TYPE_WITH(fc.forward(exec, cview(x_flat), mview(y), true), mpx::shape_error,
                         Contains("dense") && Contains("[21]") && Contains("[batch, 7]"));
  auto y4 = mpx::make_tensor<float>(exec, {3, 4});
  CHECK_THROWS_TYPE_WITH(fc.forward(exec, cview(x), mview(y4), true), mpx::shape_error,
                         Contains("dense") && Contains("output has shape [3, 4]") && Contains("[batch, 5]"));
  auto y2 = mpx::make_tensor<float>(exec, {2, 5});
  CHECK_THROWS_TYPE_WITH(fc.forward(exec, cview(x), mview(y2), true), mpx::shape_error,
                         Contains("dense") && Contains("[3, 7]") && Contains("[2, 5]") && Contains("different batches"));
  auto x0 = mpx::make_tensor<float>(exec, {0, 7});
  auto y0 = mpx::make_tensor<float>(exec, {0, 5});
  CHECK_THROWS_TYPE_WITH(fc.forward(exec, cview(x0), mview(y0), true), mpx::shape_error,
                         Contains("dense") && Contains("[0, 7]") && Contains("the batch is empty"));
  // A larger batch than reserved grows the workspace.
  auto x_big = mpx::make_tensor<float>(exec, {4, 7});
  auto y_big = mpx::make_tensor<float>(exec, {4, 5});
  mpx::fill(exec, x_big, 1.0f);
  fc.forward(exec, cview(x_big), mview(y_big), true);
  CHECK(fc.reserved_batch() == 4);
  CHECK_THROWS_TYPE_WITH(fc.backward(exec, cview(x), cview(y), cview(y4), mview(dx)), mpx::shape_error,
                         Contains("dense") && Contains("output gradient") && Contains("[3, 4]"));
  CHECK_THROWS_TYPE_WITH(fc.backward(exec, cview(x), cview(y), cview(y), mview(x6)), mpx::shape_error,
                         Contains("dense") && Contains("input gradient") && Contains("[3, 6]") &&
                             Contains("[batch, 7]"));

  // Declared with 5 input features, built for 6.
  mpx::dense<P> declared(5, 3, mpx::activation::linear);
  declared.set_name("dense");
  CHECK_THROWS_TYPE_WITH(declared.build(exec, mpx::shape{6}, 0), mpx::shape_error,
                         Contains("dense") && Contains("declared with 5 input features") && Contains("[6]"));
  CHECK_FALSE(declared.built());
  declared.build(exec, mpx::shape{2, 5}, 0);  // a rank-3 input of 5 features is fine
  CHECK(declared.output_shape() == mpx::shape{2, 3});
}

TEMPLATE_LIST_TEST_CASE("every layer names itself and both shapes when given the wrong input", "[layers][errors]",
                        mpx_test::executors) {
  using Catch::Matchers::Contains;
  TestType exec;
  using P = mpx::mixed_float16;
  using T = mpx::half;
  auto x = mpx::make_tensor<T>(exec, {3, 7});
  auto y = mpx::make_tensor<T>(exec, {3, 7});
  auto x6 = mpx::make_tensor<T>(exec, {3, 6});
  auto x0 = mpx::make_tensor<T>(exec, {0, 7});
  auto y0 = mpx::make_tensor<T>(exec, {0, 7});
  auto check = [&](auto layer, std::string const& name) {
    INFO(name);
    layer.set_name(name);
    CHECK_THROWS_TYPE_WITH(layer.forward(exec, cview(x), mview(y), true), mpx::invalid_argument,
                           Contains(name) && Contains("before build"));
    layer.build(exec, mpx::shape{7}, 0);
    layer.reserve(exec, 3);
    CHECK_THROWS_TYPE_WITH(layer.forward(exec, cview(x6), mview(y), true), mpx::shape_error,
                           Contains(name) && Contains("[3, 6]") && Contains("[batch, 7]"));
    CHECK_THROWS_TYPE_WITH(layer.forward(exec, cview(x0), mview(y0), false), mpx::shape_error,
                           Contains(name) && Contains("the batch is empty"));
  };
  check(mpx::batch_norm<P>(), "bn");
  check(mpx::layer_norm<P>(), "ln");
  check(mpx::dropout<P>(0.5f), "drop");
  check(mpx::activation_layer<P>(mpx::activation::gelu), "act");
  check(mpx::softmax_layer<P>(), "softmax");

  mpx::flatten<P> flat;
  flat.set_name("flat");
  flat.build(exec, mpx::shape{7}, 0);
  CHECK_THROWS_TYPE_WITH(flat.forward(exec, cview(x6), mview(x6), true), mpx::shape_error,
                         Contains("flat") && Contains("[3, 6]") && Contains("[batch, 7]"));

  CHECK_THROWS_TYPE_WITH(mpx::dropout<P>(1.0f), mpx::invalid_argument, Contains("rate"));
  CHECK_THROWS_TYPE_WITH(mpx::dropout<P>(-0.1f), mpx::invalid_argument, Contains("rate"));

  // Batch normalisation in training needs two rows per channel.
  mpx::batch_norm<P> bn;
  bn.set_name("bn");
  bn.build(exec, mpx::shape{7}, 0);
  bn.reserve(exec, 1);
  auto x1 = mpx::make_tensor<T>(exec, {1, 7});
  auto y1 = mpx::make_tensor<T>(exec, {1, 7});
  CHECK_THROWS_TYPE_WITH(bn.forward(exec, cview(x1), mview(y1), true), mpx::invalid_argument,
                         Contains("at least 2 rows"));
}
