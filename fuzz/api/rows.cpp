// The API fuzzer's rows group: the kernels that work along a row or down a column
// (softmax, layer and batch norm), dropout, the losses and the embedding, each against
// a float64 reference (tests/support/reference/) within the bound its doc states
// (docs/norms_and_dropout.md, docs/activations_softmax_losses.md), or bit for bit where
// the contract is exact (dropout, the embedding's gather and its token-order sums).

#include "groups.hpp"

#include "../../tests/support/reference/activation.hpp"
#include "../../tests/support/reference/normalization.hpp"
#include "../../tests/support/reference/softmax.hpp"

#include <mpx/kernels/activation.hpp>
#include <mpx/kernels/batch_norm.hpp>
#include <mpx/kernels/dropout.hpp>
#include <mpx/kernels/embedding.hpp>
#include <mpx/kernels/layer_norm.hpp>
#include <mpx/kernels/softmax.hpp>
#include <mpx/losses/binary_cross_entropy.hpp>
#include <mpx/losses/cross_entropy.hpp>
#include <mpx/losses/loss_value.hpp>
#include <mpx/losses/mean_squared_error.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace mpx_fuzz::api::rows_detail {

//! Runs a valid call in place (`in`'s buffer is the output; only when In and Out are one
//! type) or into `out`, checks the guards of whichever buffer was written, and returns
//! what it holds. run(input view, output view).
template <class In, class Out, class Run>
std::vector<Out> run_in_place_or_apart(call_name const& call, bool in_place, guarded<In>& in, std::string_view in_name,
                                       guarded<Out>& out, std::string_view out_name, Run&& run) {
  if constexpr (std::is_same_v<In, Out>) {
    if (in_place) {
      require_accepted(call, [&] { run(in.view(), in.view()); });
      in.require_guards_intact(call, std::string(in_name) + " (in place)");
      return in.values();
    }
  }
  require_accepted(call, [&] { run(in.cview(), out.view()); });
  out.require_guards_intact(call, out_name);
  return out.values();
}
template <class T>
std::vector<double> wide(std::vector<T> const& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = mpx::detail::to_double(v[i]);
  return out;
}

using mpx::detail::to_double;
inline constexpr double uf = 0x1p-24;
inline constexpr double inf = std::numeric_limits<double>::infinity();

template <class T>
struct tag {
  using type = T;
};

//! Calls f(tag<T>) for a storage dtype drawn from half, bfloat16, float.
template <class F>
void with_dtype(draw& d, F&& f) {
  switch (d.below(3)) {
    case 0: f(tag<mpx::half>{}); break;
    case 1: f(tag<mpx::bfloat16>{}); break;
    default: f(tag<float>{}); break;
  }
}
//! An output dtype: the input's or float.
template <class T, class F>
void with_out_dtype(draw& d, F&& f) {
  if (d.coin()) f(tag<float>{});
  else f(tag<T>{});
}

template <class T>
double smallest_subnormal() {
  return to_double(mpx::dtype_traits<T>::min_subnormal());
}
//! Where rounding to T overflows: max plus half an ulp of max.
template <class T>
double overflow_threshold() {
  double const max = to_double(mpx::dtype_traits<T>::max());
  return max + std::ldexp(1.0, std::ilogb(max) - mpx::dtype_traits<T>::mantissa_bits - 1);
}

//! A tolerance that a non-finite input term made NaN or infinite asks nothing finite.
inline double sane(double tol) { return std::isnan(tol) ? inf : tol; }

//! require_near for an output of dtype T: a reference beyond T's range is due as the
//! infinity it rounds to, and a result within `tol` of that threshold may be either.
template <class T>
void near(call_name const& call, std::string_view what, std::size_t i, double got, double ref, double tol) {
  tol = sane(tol);
  if (std::isfinite(ref) && std::fabs(ref) + tol >= overflow_threshold<T>()) {
    if (std::isinf(got) && (got > 0) == (ref > 0)) return;
    if (std::fabs(ref) >= overflow_threshold<T>()) ref = std::copysign(inf, ref);
  }
  if (std::isinf(ref) && std::isfinite(got) && std::fabs(got) + tol >= overflow_threshold<T>() &&
      (got > 0) == (ref > 0) && std::fabs(got) >= to_double(mpx::dtype_traits<T>::max()))
    return;
  require_near(call, what, i, got, ref, tol);
}

//! A value of T, hostile or not, with finite magnitudes clamped to `limit`: where float
//! arithmetic would overflow (a sum of squares, a product) and float64 would not, the
//! two disagree by design, which is not what a case checks. NaN, infinities, zeros and
//! subnormals pass through.
template <class T>
T value_within(draw& d, bool hostile, double limit) {
  T v = d.value<T>(hostile);
  double const x = to_double(v);
  if (std::isfinite(x) && std::fabs(x) > limit) v = mpx::cast<T>(std::copysign(limit, x));
  return v;
}
template <class T>
std::vector<T> values_within(draw& d, std::size_t n, bool hostile, double limit) {
  std::vector<T> v(n);
  for (auto& x : v) x = value_within<T>(d, hostile, limit);
  return v;
}

//! Row-major extents of rank 1 to 3 whose last extent (the row) is at most max_cols.
inline std::vector<std::int64_t> row_extents(draw& d, std::size_t min_rank = 1, std::int64_t max_cols = 300) {
  std::size_t const rank = min_rank + d.below(4 - min_rank);
  auto e = d.extents(rank, 300);
  e.back() = std::min<std::int64_t>(e.back(), max_cols);
  return e;
}
inline std::string shape_string(std::vector<std::int64_t> const& e) { return mpx::shape(e).to_string(); }
//! The extents with the last one changed: a mismatched output or gradient.
inline std::vector<std::int64_t> off_by_one(std::vector<std::int64_t> e) {
  e.back() += 1;
  return e;
}
inline std::size_t count(std::vector<std::int64_t> const& e) {
  std::size_t n = 1;
  for (auto x : e) n *= static_cast<std::size_t>(x);
  return n;
}

//! Two views of one buffer (T is their dtype) that overlap by all but `shift` elements:
//! the partial aliasing every in-place-capable op must refuse.
template <class T>
struct overlapping {
  guarded<T> buffer;
  std::vector<std::int64_t> extents;
  std::size_t shift;
  overlapping(mpx::host_executor const& exec, std::vector<std::int64_t> e, draw& d)
      : buffer(exec, {static_cast<std::int64_t>(count(e)) * 2}, 0), extents(std::move(e)),
        shift(1 + d.below(std::max<std::size_t>(count(extents) - 1, 1))) {}
  mpx::tensor_view<T> first() { return {buffer.data(), mpx::shape(extents)}; }
  mpx::tensor_view<T> second() { return {buffer.data() + shift, mpx::shape(extents)}; }
};

// ---- softmax and log_softmax ----

template <class X, class Y>
void softmax_forward_case(draw& d, bool log) {
  mpx::host_executor exec;
  auto const ext = row_extents(d);
  bool const hostile = d.coin();
  unsigned const variant = d.below(10);
  call_name call(log ? "log_softmax " : "softmax ");
  auto const run = [&](auto x, auto y) {
    if (log) mpx::log_softmax(exec, x, y);
    else mpx::softmax(exec, x, y);
  };
  if (variant == 0) {  // y of another shape
    guarded<X> x(exec, ext, d);
    guarded<Y> y(exec, off_by_one(ext), d);
    call << shape_text<X>(ext) << " -> " << shape_text<Y>(y.extents());
    require_refusal(call, {"x has shape " + shape_string(ext), "y has shape " + shape_string(y.extents())},
                    [&] { run(x.cview(), y.view()); });
    return;
  }
  if constexpr (std::is_same_v<X, Y>) {
    if (variant == 1 && count(ext) >= 2) {  // y overlapping x, shifted
      overlapping<X> o(exec, ext, d);
      call << shape_text<X>(ext) << " -> itself shifted by " << o.shift;
      require_refusal(call, {"y", "x", "overlap"}, [&] { run(o.first(), o.second()); });
      return;
    }
  }
  bool const in_place = std::is_same_v<X, Y> && variant == 2;
  guarded<X> x(exec, ext, d);
  x.assign(d.values<X>(x.size(), hostile));
  guarded<Y> y_out(exec, ext, d);
  auto const xs = x.wide();
  call << shape_text<X>(ext) << "+" << x.offset() << (in_place ? " in place" : " -> ") << shape_text<Y>(ext);
  std::vector<double> const got = wide(run_in_place_or_apart(call, in_place, x, "x", y_out, "y", run));
  std::size_t const cols = static_cast<std::size_t>(ext.back());
  if (cols == 0) return;
  // docs/activations_softmax_losses.md: k = cols/32 + 48, d = |x - max|;
  // softmax (u_T + (k + 2d) u_f)|ref| + sub_T, log_softmax u_T|ref| + (k + 2d + |log S|) u_f.
  double const uT = unit_roundoff<Y>(), k = static_cast<double>(cols) / 32 + 48;
  for (std::size_t r = 0; r < xs.size() / cols; ++r) {
    std::vector<double> const row(xs.begin() + static_cast<std::ptrdiff_t>(r * cols),
                                  xs.begin() + static_cast<std::ptrdiff_t>((r + 1) * cols));
    auto const ref = mpx_test::reference::softmax_row(row, log);
    auto const st = mpx_test::reference::softmax_statistics_of(row);
    for (std::size_t c = 0; c < cols; ++c) {
      double const dist = std::isfinite(row[c]) ? std::fabs(row[c] - st.max) : 0.0;
      double const tol = log ? uT * std::fabs(ref[c]) + (k + 2 * dist + std::fabs(std::log(st.sum))) * uf
                             : (uT + (k + 2 * dist) * uf) * std::fabs(ref[c]) + smallest_subnormal<Y>();
      near<Y>(call, "y", r * cols + c, got[r * cols + c], ref[c], tol);
    }
  }
}

template <class T, class DX>
void softmax_backward_case(draw& d, bool log) {
  mpx::host_executor exec;
  auto const ext = row_extents(d);
  bool const hostile = d.coin();
  unsigned const variant = d.below(10);
  call_name call(log ? "log_softmax_backward " : "softmax_backward ");
  auto const run = [&](auto y, auto dy, auto dx) {
    if (log) mpx::log_softmax_backward(exec, y, dy, dx);
    else mpx::softmax_backward(exec, y, dy, dx);
  };
  if (variant == 0) {  // dx or dy of another shape
    bool const bad_dx = d.coin();
    guarded<T> y(exec, ext, d), dy(exec, bad_dx ? ext : off_by_one(ext), d);
    guarded<DX> dx(exec, bad_dx ? off_by_one(ext) : ext, d);
    call << shape_text<T>(ext) << " dy " << shape_text<T>(dy.extents()) << " dx " << shape_text<DX>(dx.extents());
    require_refusal(call, {"y has shape " + shape_string(ext), (bad_dx ? "dx has shape " : "dy has shape ") + shape_string(off_by_one(ext))},
                    [&] { run(y.cview(), dy.cview(), dx.view()); });
    return;
  }
  if constexpr (std::is_same_v<T, DX>) {
    if (variant == 1 && count(ext) >= 2) {  // dx overlapping dy, shifted
      guarded<T> y(exec, ext, d);
      overlapping<T> o(exec, ext, d);
      call << shape_text<T>(ext) << " dx = dy shifted by " << o.shift;
      require_refusal(call, {"dx", "dy", "overlap"}, [&] { run(y.cview(), o.first(), o.second()); });
      return;
    }
  }
  bool const in_place = std::is_same_v<T, DX> && variant == 2;
  // Log-probabilities are at most 0 and probabilities at most 1; beyond e^60 (log) the
  // float exp overflows where float64's does not.
  guarded<T> y(exec, ext, d), dy(exec, ext, d);
  y.assign(values_within<T>(d, y.size(), hostile, log ? 60.0 : 1e4));
  dy.assign(values_within<T>(d, dy.size(), hostile, 1e4));
  guarded<DX> dx(exec, ext, d);
  auto const ys = y.wide(), dys = dy.wide();
  call << shape_text<T>(ext) << "+" << y.offset() << (in_place ? " dx = dy" : " -> ") << shape_text<DX>(ext);
  std::vector<double> const got = wide(run_in_place_or_apart(
      call, in_place, dy, "dy", dx, "dx", [&](auto dy_view, auto dx_view) { run(y.cview(), dy_view, dx_view); }));
  std::size_t const cols = static_cast<std::size_t>(ext.back());
  if (cols == 0) return;
  // u_T|ref| + k u_f (the formula's terms in absolute value) + sub_T, k = cols/32 + 48;
  // for softmax also |y| cols sub_f / 2: each product y dy of the dot that underflows
  // float loses up to half a float subnormal, and y multiplies what the dot lost.
  double const uT = unit_roundoff<DX>(), k = static_cast<double>(cols) / 32 + 48;
  for (std::size_t r = 0; r < ys.size() / cols; ++r) {
    auto const at = [&](std::vector<double> const& v) {
      return std::vector<double>(v.begin() + static_cast<std::ptrdiff_t>(r * cols),
                                 v.begin() + static_cast<std::ptrdiff_t>((r + 1) * cols));
    };
    auto const yr = at(ys), dyr = at(dys);
    auto const ref = mpx_test::reference::softmax_backward_row(yr, dyr, log);
    for (std::size_t c = 0; c < cols; ++c) {
      double const terms = log ? std::fabs(dyr[c]) + std::exp(yr[c]) * ref.abs_dot
                               : std::fabs(yr[c]) * (std::fabs(dyr[c]) + ref.abs_dot);
      double const underflow = log ? 0.0 : std::fabs(yr[c]) * static_cast<double>(cols) * 0x1p-150;
      double const tol = uT * std::fabs(ref.dx[c]) + k * uf * terms + underflow + smallest_subnormal<DX>();
      near<DX>(call, "dx", r * cols + c, got[r * cols + c], ref.dx[c], tol);
    }
  }
}

// ---- layer norm and batch norm ----

//! An eps: valid ones of both conventions, or (bad) one the norms refuse.
inline float draw_eps(draw& d, bool bad, float fallback) {
  if (bad) return d.pick<float>({0.0f, -1e-5f, std::numeric_limits<float>::quiet_NaN(), -INFINITY});
  return d.pick<float>({fallback, 1e-5f, 1e-3f, 1.0f, 1e-12f});
}

inline std::vector<float> parameters(draw& d, std::size_t n) {
  std::vector<float> v(n);
  for (auto& x : v) x = d.value<float>(false);
  return v;
}
inline std::vector<double> widen(std::vector<float> const& v) { return {v.begin(), v.end()}; }


//! The bounds of docs/norms_and_dropout.md ("Error bounds"), for one group (a row of
//! layer norm, a column of batch norm): k roundings, kappa = max|x| rstd.
struct norm_bound {
  double k, kappa;
};

template <class X, class Y>
void layer_norm_forward_case(draw& d) {
  mpx::host_executor exec;
  auto const ext = row_extents(d);
  bool const hostile = d.coin();
  unsigned const variant = d.below(16);
  std::size_t const cols = static_cast<std::size_t>(ext.back());
  std::size_t const rows = cols ? count(ext) / cols : 0;
  float const eps = draw_eps(d, variant == 1, 1e-5f);
  call_name call("layer_norm_forward ");
  auto const i64 = [](std::size_t n) { return std::vector<std::int64_t>{static_cast<std::int64_t>(n)}; };
  // 1e15: a common offset far beyond the spread, while sums of squares stay in float.
  guarded<X> x(exec, ext, d);
  x.assign(values_within<X>(d, x.size(), hostile, 1e15));
  guarded<float> gamma(exec, i64(cols + (variant == 2)), d), beta(exec, i64(cols + (variant == 3)), d);
  guarded<float> mean(exec, i64(rows + (variant == 4)), d), rstd(exec, i64(rows), d);
  gamma.assign(parameters(d, gamma.size()));
  beta.assign(parameters(d, beta.size()));
  call << shape_text<X>(ext) << "+" << x.offset() << " eps " << eps;
  if (variant >= 1 && variant <= 6) {
    char const* name = variant == 1 ? "eps" : variant == 2 ? "gamma" : variant == 3 ? "beta" : variant == 4 ? "mean" : "y";
    if (variant == 6) {  // y overlapping x
      if constexpr (std::is_same_v<X, Y>) {
        if (count(ext) >= 2) {
          overlapping<X> o(exec, ext, d);
          call << " y = x shifted by " << o.shift;
          require_refusal(call, {"y", "x", "overlap"},
                          [&] { mpx::layer_norm_forward(exec, o.first(), gamma.cview(), beta.cview(), o.second(), mean.view(), rstd.view(), eps); });
          return;
        }
      }
      return;
    }
    auto const y_ext = variant == 5 ? off_by_one(ext) : ext;
    guarded<Y> y(exec, y_ext, d);
    call << " -> " << shape_text<Y>(y_ext) << " (" << name << " wrong)";
    auto const run = [&] {
      mpx::layer_norm_forward(exec, x.cview(), gamma.cview(), beta.cview(), y.view(), mean.view(), rstd.view(), eps);
    };
    if (variant == 5) require_refusal(call, {"x has shape " + shape_string(ext), "y has shape " + shape_string(y_ext)}, run);
    else require_refusal(call, {name}, run);
    return;
  }
  bool const in_place = std::is_same_v<X, Y> && variant == 7;
  guarded<Y> y(exec, ext, d);
  auto const xs = x.wide();
  call << (in_place ? " in place" : " -> ") << shape_text<Y>(ext);
  std::vector<double> const got = wide(run_in_place_or_apart(call, in_place, x, "x", y, "y", [&](auto xv, auto yv) {
    mpx::layer_norm_forward(exec, xv, gamma.cview(), beta.cview(), yv, mean.view(), rstd.view(), eps);
  }));
  mean.require_guards_intact(call, "mean");
  rstd.require_guards_intact(call, "rstd");
  if (rows * cols == 0) return;
  auto const g = widen(gamma.values()), b = widen(beta.values());
  auto const ref = mpx_test::reference::normalize(xs, rows, cols, mpx_test::reference::row_groups{cols}, g, b, false,
                                                  static_cast<double>(eps));
  auto const means = mean.wide(), rstds = rstd.wide();
  double const uT = unit_roundoff<Y>(), k = static_cast<double>(cols) / 32 + 40;
  for (std::size_t r = 0; r < rows; ++r) {
    double max_x = 0;
    for (std::size_t c = 0; c < cols; ++c) max_x = std::max(max_x, std::fabs(xs[r * cols + c]));
    double const kappa = max_x * ref.rstd[r];
    // The doc's bound, + a float subnormal per rounding for a mean of subnormal values.
    near<float>(call, "mean", r, means[r], ref.mean[r], 4 * k * uf * max_x + k * smallest_subnormal<float>());
    near<float>(call, "rstd", r, rstds[r], ref.rstd[r], 4 * k * uf * (1 + kappa) * ref.rstd[r]);
    for (std::size_t c = 0; c < cols; ++c) {
      std::size_t const i = r * cols + c;
      // The doc's bound, + sub_T for a result below T's normal range (as for dx).
      double const tol = uT * std::fabs(ref.y[i]) + 4 * k * uf * (1 + kappa) * (std::fabs(g[c]) + 1) + uf * std::fabs(b[c]) +
                         smallest_subnormal<Y>();
      near<Y>(call, "y", i, got[i], ref.y[i], tol);
    }
  }
}

//! Float64 norm gradients from the statistics the kernel is given (x, its saved mean and
//! rstd as stored), with docs/norms_and_dropout.md's dx, dgamma and dbeta bounds.
struct norm_backward_reference {
  std::vector<double> dx, dgamma, dbeta, dx_tol, dgamma_tol, dbeta_tol;
};
template <class At>
norm_backward_reference norm_backward(std::vector<double> const& x, std::vector<double> const& dy,
                                      std::vector<double> const& gamma, std::vector<double> const& mean,
                                      std::vector<double> const& rstd, std::size_t groups, std::size_t per_group,
                                      At at, bool per_column, std::size_t rows, std::size_t cols, double uT,
                                      double sub_T) {
  mpx_test::reference::normalization f;
  f.xhat.resize(x.size());
  f.rstd = rstd;
  for (std::size_t gi = 0; gi < groups; ++gi)
    for (std::size_t e = 0; e < per_group; ++e) f.xhat[at(gi, e)] = (x[at(gi, e)] - mean[gi]) * rstd[gi];
  auto const back = mpx_test::reference::normalize_backward(f, dy, groups, per_group, at, gamma, per_column, cols);
  norm_backward_reference out{back.dx, back.dgamma, back.dbeta, std::vector<double>(x.size()),
                              std::vector<double>(cols), std::vector<double>(cols)};
  double const n = static_cast<double>(per_group);
  double const k = per_column ? std::min<double>(static_cast<double>(rows), 256) + static_cast<double>(rows / 256) + 40
                              : static_cast<double>(cols) / 32 + 40;
  double const k_col = std::min<double>(static_cast<double>(rows), 256) + static_cast<double>(rows / 256) + 40;
  double kappa_all = 0;
  double const sub_f = smallest_subnormal<float>();
  std::vector<double> kappa(groups);
  for (std::size_t gi = 0; gi < groups; ++gi) {
    double max_x = 0, mg = 0, mgx = 0;
    for (std::size_t e = 0; e < per_group; ++e) {
      std::size_t const i = at(gi, e), p = per_column ? gi : e;
      max_x = std::max(max_x, std::fabs(x[i]));
      mg += std::fabs(dy[i] * gamma[p]) / n;
      mgx += std::fabs(dy[i] * gamma[p] * f.xhat[i]) / n;
    }
    kappa[gi] = max_x * rstd[gi];
    kappa_all = std::max(kappa_all, kappa[gi]);
    for (std::size_t e = 0; e < per_group; ++e) {
      std::size_t const i = at(gi, e), p = per_column ? gi : e;
      // + sub_T: u_T |ref| bounds the rounding to T in T's normal range only; below
      // it the rounding is absolute, up to half T's smallest subnormal. The same holds
      // for the float products inside (g, xhat, their means): 8 sub_f (1 + rstd).
      out.dx_tol[i] = sub_T + 8 * sub_f * (1 + rstd[gi]) + uT * std::fabs(out.dx[i]) + 4 * k * uf * (1 + kappa[gi]) * rstd[gi] *
                                                      (std::fabs(dy[i] * gamma[p]) + mg + (std::fabs(f.xhat[i]) + 1) * mgx);
    }
  }
  for (std::size_t j = 0; j < cols; ++j) {
    double sdy = 0, sdyx = 0;
    for (std::size_t r = 0; r < rows; ++r) {
      std::size_t const i = r * cols + j;
      sdy += std::fabs(dy[i]);
      sdyx += std::fabs(dy[i]) * (1 + std::fabs(f.xhat[i]));
    }
    // + a float subnormal per product summed: dy * xhat below float's normal range
    // rounds absolutely (the doc's bounds are relative).
    out.dgamma_tol[j] = 4 * (k_col + k) * uf * sdyx * (1 + kappa_all) + static_cast<double>(rows + 1) * sub_f;
    out.dbeta_tol[j] = k_col * uf * sdy + sub_f;
  }
  return out;
}

template <class X, class DX>
void norm_backward_case(draw& d, bool batch) {
  mpx::host_executor exec;
  auto const ext = row_extents(d);
  bool const hostile = d.coin();
  unsigned const variant = d.below(14);
  std::size_t const cols = static_cast<std::size_t>(ext.back());
  std::size_t const rows = cols ? count(ext) / cols : 0;
  std::size_t const groups = batch ? cols : rows, per_group = batch ? rows : cols;
  call_name call(batch ? "batch_norm_backward " : "layer_norm_backward ");
  auto const i64 = [](std::size_t n) { return std::vector<std::int64_t>{static_cast<std::int64_t>(n)}; };
  guarded<X> x(exec, ext, d), dy(exec, ext, d);
  x.assign(values_within<X>(d, x.size(), hostile, 1e4));
  dy.assign(values_within<X>(d, dy.size(), hostile, 1e4));
  guarded<float> gamma(exec, i64(cols + (variant == 1)), d), mean(exec, i64(groups + (variant == 2)), d),
      rstd(exec, i64(groups), d), dgamma(exec, i64(cols + (variant == 3)), d), dbeta(exec, i64(cols), d);
  gamma.assign(parameters(d, gamma.size()));
  // The saved statistics as the forward pass leaves them: float64 ones rounded to float.
  auto const xs = x.wide(), dys = dy.wide();
  if (variant > 3) {
    auto const f = batch ? mpx_test::reference::normalize(xs, groups, per_group, mpx_test::reference::column_groups{cols},
                                                          std::vector<double>(cols, 1.0), std::vector<double>(cols, 0.0), true, 1e-3)
                         : mpx_test::reference::normalize(xs, groups, per_group, mpx_test::reference::row_groups{cols},
                                                          std::vector<double>(cols, 1.0), std::vector<double>(cols, 0.0), false, 1e-5);
    for (std::size_t gi = 0; gi < groups; ++gi) {
      mean.data()[gi] = static_cast<float>(f.mean[gi]);
      rstd.data()[gi] = static_cast<float>(f.rstd[gi]);
    }
  }
  auto const run = [&](auto dyv, auto dxv) {
    if (batch) mpx::batch_norm_backward(exec, x.cview(), dyv, gamma.cview(), mean.cview(), rstd.cview(), dxv, dgamma.view(), dbeta.view());
    else mpx::layer_norm_backward(exec, x.cview(), dyv, gamma.cview(), mean.cview(), rstd.cview(), dxv, dgamma.view(), dbeta.view());
  };
  call << shape_text<X>(ext) << "+" << x.offset();
  if (variant >= 1 && variant <= 5) {
    if (variant == 5) {  // dx overlapping dy
      if constexpr (std::is_same_v<X, DX>) {
        if (count(ext) >= 2) {
          overlapping<X> o(exec, ext, d);
          call << " dx = dy shifted by " << o.shift;
          require_refusal(call, {"dx", "dy", "overlap"}, [&] { run(o.first(), o.second()); });
        }
      }
      return;
    }
    char const* name = variant == 1 ? "gamma" : variant == 2 ? (batch ? "save_mean" : "mean") : variant == 3 ? "dgamma" : "differ";
    auto const dx_ext = variant == 4 ? off_by_one(ext) : ext;
    guarded<DX> dx(exec, dx_ext, d);
    call << " -> " << shape_text<DX>(dx_ext) << " (" << name << " wrong)";
    auto const refused = [&] { run(dy.cview(), dx.view()); };
    if (variant == 4) require_refusal(call, {"x has shape " + shape_string(ext), "dx has shape " + shape_string(dx_ext)}, refused);
    else require_refusal(call, {name}, refused);
    return;
  }
  bool const in_place = std::is_same_v<X, DX> && variant == 6;
  guarded<DX> dx(exec, ext, d);
  call << (in_place ? " dx = dy" : " -> ") << shape_text<DX>(ext);
  std::vector<double> const got = wide(run_in_place_or_apart(call, in_place, dy, "dy", dx, "dx", run));
  dgamma.require_guards_intact(call, "dgamma");
  dbeta.require_guards_intact(call, "dbeta");
  if (cols == 0) return;
  auto const g = widen(gamma.values());
  auto const m = mean.wide(), s = rstd.wide();
  auto const ref = batch ? norm_backward(xs, dys, g, m, s, groups, per_group, mpx_test::reference::column_groups{cols}, true, rows, cols, unit_roundoff<DX>(), smallest_subnormal<DX>())
                         : norm_backward(xs, dys, g, m, s, groups, per_group, mpx_test::reference::row_groups{cols}, false, rows, cols, unit_roundoff<DX>(), smallest_subnormal<DX>());
  for (std::size_t i = 0; i < got.size(); ++i) near<DX>(call, "dx", i, got[i], ref.dx[i], ref.dx_tol[i]);
  auto const dg = dgamma.wide(), db = dbeta.wide();
  for (std::size_t j = 0; j < cols; ++j) {
    near<float>(call, "dgamma", j, dg[j], ref.dgamma[j], ref.dgamma_tol[j]);
    near<float>(call, "dbeta", j, db[j], ref.dbeta[j], ref.dbeta_tol[j]);
  }
}

template <class X, class Y>
void batch_norm_forward_case(draw& d) {
  mpx::host_executor exec;
  auto const ext = row_extents(d);
  bool const hostile = d.coin();
  bool const training = d.coin();
  unsigned const variant = d.below(16);
  std::size_t const cols = static_cast<std::size_t>(ext.back());
  std::size_t const rows = cols ? count(ext) / cols : 0;
  mpx::batch_norm_options options;
  options.eps = draw_eps(d, variant == 1, 1e-3f);
  options.momentum = variant == 2 ? d.pick<float>({-0.25f, 1.5f, std::numeric_limits<float>::quiet_NaN()})
                                  : d.pick<float>({0.99f, 0.9f, 0.0f, 1.0f});
  call_name call(training ? "batch_norm_forward_training " : "batch_norm_forward_inference ");
  auto const i64 = [](std::size_t n) { return std::vector<std::int64_t>{static_cast<std::int64_t>(n)}; };
  guarded<X> x(exec, ext, d);
  x.assign(values_within<X>(d, x.size(), hostile, 1e15));
  guarded<float> gamma(exec, i64(cols + (variant == 3)), d), beta(exec, i64(cols), d),
      running_mean(exec, i64(cols), d), running_var(exec, i64(cols + (variant == 4)), d),
      save_mean(exec, i64(cols), d), save_invstd(exec, i64(cols), d);
  gamma.assign(parameters(d, gamma.size()));
  beta.assign(parameters(d, beta.size()));
  running_mean.assign(parameters(d, running_mean.size()));
  {
    auto v = parameters(d, running_var.size());
    for (auto& e : v) e = std::fabs(e);  // a variance
    running_var.assign(v);
  }
  auto const run = [&](auto xv, auto yv) {
    if (training)
      mpx::batch_norm_forward_training(exec, xv, gamma.cview(), beta.cview(), yv, running_mean.view(),
                                       running_var.view(), save_mean.view(), save_invstd.view(), options);
    else
      mpx::batch_norm_forward_inference(exec, xv, gamma.cview(), beta.cview(), running_mean.cview(),
                                        running_var.cview(), yv, options.eps);
  };
  call << shape_text<X>(ext) << "+" << x.offset() << " eps " << options.eps << " momentum " << options.momentum;
  bool const refused_for_rows = training && cols > 0 && rows < 2;
  if ((variant >= 1 && variant <= 6) || refused_for_rows) {
    if (variant == 6 && !refused_for_rows) {
      if constexpr (std::is_same_v<X, Y>) {
        if (count(ext) >= 2) {
          overlapping<X> o(exec, ext, d);
          call << " y = x shifted by " << o.shift;
          require_refusal(call, {"y", "x", "overlap"}, [&] { run(o.first(), o.second()); });
        }
      }
      return;
    }
    auto const y_ext = variant == 5 ? off_by_one(ext) : ext;
    guarded<Y> y(exec, y_ext, d);
    std::string_view const name = variant == 5                   ? "differ"
                                  : variant == 1                 ? "eps"
                                  : variant == 3                 ? "gamma"
                                  : variant == 4                 ? "running_var"
                                  : variant == 2 && training     ? "momentum"
                                  : refused_for_rows             ? "at least 2 rows"
                                                                 : "";
    call << " -> " << shape_text<Y>(y_ext) << " (" << name << " wrong)";
    if (name.empty()) {  // momentum out of range is not an inference argument
      require_accepted(call, [&] { run(x.cview(), y.view()); });
      return;
    }
    auto const refused = [&] { run(x.cview(), y.view()); };
    if (variant == 5) require_refusal(call, {"x has shape " + shape_string(ext), "y has shape " + shape_string(y_ext)}, refused);
    else require_refusal(call, {name}, refused);
    return;
  }
  bool const in_place = std::is_same_v<X, Y> && variant == 7;
  guarded<Y> y(exec, ext, d);
  auto const xs = x.wide();
  auto const rm0 = running_mean.wide(), rv0 = running_var.wide();
  call << (in_place ? " in place" : " -> ") << shape_text<Y>(ext);
  std::vector<double> const got = wide(run_in_place_or_apart(call, in_place, x, "x", y, "y", run));
  for (auto* t : {&running_mean, &running_var, &save_mean, &save_invstd}) t->require_guards_intact(call, "a statistic");
  if (rows * cols == 0) return;
  auto const g = widen(gamma.values()), b = widen(beta.values());
  double const uT = unit_roundoff<Y>(), eps = static_cast<double>(options.eps);
  double const k = std::min<double>(static_cast<double>(rows), 256) + static_cast<double>(rows / 256) + 40;
  if (!training) {
    // One element: (x - mean) * (1 / sqrt(var + eps)) * gamma + beta, some 8 float
    // roundings of the terms in absolute value, then the rounding to y's dtype.
    for (std::size_t i = 0; i < got.size(); ++i) {
      std::size_t const j = i % cols;
      double const s = 1 / std::sqrt(rv0[j] + eps);
      double const ref = (xs[i] - rm0[j]) * s * g[j] + b[j];
      double const tol = uT * std::fabs(ref) + 8 * uf * ((std::fabs(xs[i]) + std::fabs(rm0[j])) * s * std::fabs(g[j]) + std::fabs(b[j])) +
                         smallest_subnormal<Y>();
      near<Y>(call, "y", i, got[i], ref, tol);
    }
    return;
  }
  auto const ref = mpx_test::reference::normalize(xs, cols, rows, mpx_test::reference::column_groups{cols}, g, b, true, eps);
  auto const sm = save_mean.wide(), si = save_invstd.wide(), rm = running_mean.wide(), rv = running_var.wide();
  double const mom = static_cast<double>(options.momentum), n = static_cast<double>(rows);
  for (std::size_t j = 0; j < cols; ++j) {
    double max_x = 0;
    for (std::size_t r = 0; r < rows; ++r) max_x = std::max(max_x, std::fabs(xs[r * cols + j]));
    double const kappa = max_x * ref.rstd[j];
    double const mean_tol = 4 * k * uf * max_x + k * smallest_subnormal<float>();  // + subnormal roundings, as for layer norm
    near<float>(call, "save_mean", j, sm[j], ref.mean[j], mean_tol);
    near<float>(call, "save_invstd", j, si[j], ref.rstd[j], 4 * k * uf * (1 + kappa) * ref.rstd[j]);
    for (std::size_t r = 0; r < rows; ++r) {
      std::size_t const i = r * cols + j;
      double const tol = uT * std::fabs(ref.y[i]) + 4 * k * uf * (1 + kappa) * (std::fabs(g[j]) + 1) + uf * std::fabs(b[j]) +
                         smallest_subnormal<Y>();
      near<Y>(call, "y", i, got[i], ref.y[i], tol);
    }
    // The running statistics (no bound in the docs; derived): the float mean is off by
    // at most mean_tol = delta; the float sum of squared deviations from it is the exact
    // one plus n delta^2 (the cross term sums to 0) plus k roundings, so the biased
    // variance is off by k u_f var + delta^2 (taken as 4 k u_f var + 2 delta^2), the
    // unbiased one by n / (n - 1) times that; the update adds 4 roundings of its terms.
    // A squared deviation below float's range rounds to a subnormal (or 0): half the
    // smallest subnormal each, n of them in the sum, so one subnormal after dividing by
    // n - 1; the update's roundings add up to 3 more.
    double const unbiased = ref.var[j] * n / (n - 1);
    double const rm_ref = mom * rm0[j] + (1 - mom) * ref.mean[j];
    double const rv_ref = mom * rv0[j] + (1 - mom) * unbiased;
    double const var_tol = (4 * k * uf * ref.var[j] + 2 * mean_tol * mean_tol) * n / (n - 1) + smallest_subnormal<float>();
    near<float>(call, "running_mean", j, rm[j], rm_ref,
                (1 - mom) * mean_tol + 4 * uf * (std::fabs(mom * rm0[j]) + std::fabs((1 - mom) * ref.mean[j])) +
                    3 * smallest_subnormal<float>());
    near<float>(call, "running_var", j, rv[j], rv_ref,
                (1 - mom) * var_tol + 4 * uf * (std::fabs(mom * rv0[j]) + std::fabs((1 - mom) * unbiased)) +
                    3 * smallest_subnormal<float>());
  }
}

// ---- dropout ----

template <class X, class Y>
void dropout_case(draw& d) {
  mpx::host_executor exec;
  auto const ext = d.extents(1 + d.below(3), 300);
  bool const hostile = d.coin();
  unsigned const variant = d.below(12);
  mpx::dropout_options options;
  options.rate = variant == 0 ? d.pick<float>({1.0f, -0.125f, 1.5f, std::numeric_limits<float>::quiet_NaN(), INFINITY})
                              : d.pick<float>({0.0f, 0.1f, 0.5f, 0.9f, static_cast<float>(d.byte()) / 256.0f});
  options.seed = d.u32();
  options.offset = d.byte();
  bool const backward = d.coin(), with_mask = d.coin();
  call_name call(backward ? "dropout_backward " : "dropout_forward ");
  call << "rate " << options.rate << " seed " << options.seed << " offset " << options.offset
       << (with_mask ? " with mask " : " ");
  guarded<X> x(exec, ext, d);
  x.assign(d.values<X>(x.size(), hostile));
  guarded<std::uint8_t> mask(exec, variant == 2 ? off_by_one(ext) : ext, d);
  // The mask dropout_keeps says the forward pass draws (documented: the same bits).
  std::vector<std::uint8_t> keeps(x.size());
  if (options.rate >= 0.0f && options.rate < 1.0f)
    for (std::size_t i = 0; i < keeps.size(); ++i) keeps[i] = mpx::dropout_keeps(options, i) ? 1 : 0;
  if (backward && with_mask) mask.assign(keeps);
  auto const run = [&](auto in, auto out) {
    if (backward && with_mask) mpx::dropout_backward(exec, options, in, out, mask.cview());
    else if (backward) mpx::dropout_backward(exec, options, in, out);
    else if (with_mask) mpx::dropout_forward(exec, options, in, out, mask.view());
    else mpx::dropout_forward(exec, options, in, out);
  };
  call << shape_text<X>(ext) << "+" << x.offset();
  if (variant <= 3) {
    if (variant == 3) {
      if constexpr (std::is_same_v<X, Y>) {
        if (count(ext) >= 2) {
          overlapping<X> o(exec, ext, d);
          call << " out = in shifted by " << o.shift;
          require_refusal(call, {backward ? "dx" : "y", backward ? "dy" : "x", "overlap"}, [&] { run(o.first(), o.second()); });
        }
      }
      return;
    }
    if (variant == 2 && !with_mask) return;
    auto const y_ext = variant == 1 ? off_by_one(ext) : ext;
    guarded<Y> y(exec, y_ext, d);
    call << " -> " << shape_text<Y>(y_ext);
    if (variant == 0) require_refusal(call, {"rate"}, [&] { run(x.cview(), y.view()); });
    else require_refusal(call, {"has shape " + shape_string(ext), "has shape " + shape_string(off_by_one(ext))}, [&] { run(x.cview(), y.view()); });
    return;
  }
  bool const in_place = std::is_same_v<X, Y> && variant == 4;
  guarded<Y> y(exec, ext, d);
  auto const xv = x.values();
  call << (in_place ? " in place" : " -> ") << shape_text<Y>(ext);
  std::vector<Y> const got = run_in_place_or_apart(call, in_place, x, "x", y, "y", run);
  // docs/norms_and_dropout.md: exact, cast<T>(float(x) * (kept ? 1/(1-rate) : 0)).
  float const scale = 1.0f / (1.0f - options.rate);
  std::vector<Y> expected(xv.size());
  std::size_t kept = 0;
  for (std::size_t i = 0; i < xv.size(); ++i) {
    expected[i] = mpx::cast<Y>(mpx::cast<float>(xv[i]) * (keeps[i] ? scale : 0.0f));
    kept += keeps[i];
  }
  require_same<Y>(call, backward ? "dx" : "y", got, expected);
  if (with_mask && !backward) {
    mask.require_guards_intact(call, "mask");
    auto const m = mask.values();
    for (std::size_t i = 0; i < m.size(); ++i)
      if (m[i] != keeps[i])
        fail(call.str() + ": mask[" + std::to_string(i) + "] is " + std::to_string(m[i]) + ", dropout_keeps says " +
             std::to_string(keeps[i]));
  }
  // The count kept: within 6 sqrt(n p (1 - p)) + 1 of n p (the doc's statistical bound).
  double const n = static_cast<double>(xv.size()), p = 1.0 - static_cast<double>(options.rate);
  if (std::fabs(static_cast<double>(kept) - n * p) > 6 * std::sqrt(n * p * (1 - p)) + 1)
    fail(call.str() + ": kept " + std::to_string(kept) + " of " + std::to_string(xv.size()) + " elements");
}

// ---- losses ----

//! The loss value's bound (docs/activations_softmax_losses.md, tests/losses/test_losses.cpp):
//! (4 sqrt(n) + C/32 + 64) u_f (|ref| + the mean magnitude of the terms' float parts),
//! + 2 float subnormals: a term below float's normal range (a square, log1p(e^-|x|))
//! rounds absolutely, by up to half of one, and so does the mean.
inline double loss_tolerance(double n, double classes, double ref, double mean_magnitude) {
  return (4 * std::sqrt(n) + classes / 32 + 64) * uf * (std::fabs(ref) + mean_magnitude) +
         2 * smallest_subnormal<float>();
}

template <class X, class G>
void cross_entropy_case(draw& d) {
  mpx::host_executor exec;
  auto const ext = row_extents(d, 2, 200);
  bool const hostile = d.coin();
  unsigned const variant = d.below(12);
  std::size_t const classes = static_cast<std::size_t>(ext.back());
  std::vector<std::int64_t> const label_ext(ext.begin(), ext.end() - 1);
  std::size_t const rows = count(label_ext);
  float const scale_value = d.pick<float>({0.0f, 1.0f, 1024.0f, 65536.0f, 0.5f});
  float const* scale = scale_value == 0.0f ? nullptr : &scale_value;
  call_name call("sparse_categorical_cross_entropy ");
  guarded<X> x(exec, ext, d);
  x.assign(values_within<X>(d, x.size(), hostile, 1e30));
  guarded<std::int32_t> labels(exec, variant == 1 ? off_by_one(label_ext) : label_ext, d);
  for (std::size_t i = 0; i < labels.size(); ++i)
    labels.data()[i] = classes ? static_cast<std::int32_t>(d.below(classes)) : 0;
  mpx::loss_value loss(exec);
  call << shape_text<X>(ext) << "+" << x.offset() << " scale " << scale_value;
  if (variant == 0 && rows > 0 && classes > 0) {  // a label out of range
    std::size_t const at = d.below(rows);
    std::int32_t const bad = d.pick<std::int32_t>({-1, static_cast<std::int32_t>(classes), std::numeric_limits<std::int32_t>::min(), std::numeric_limits<std::int32_t>::max()});
    labels.data()[at] = bad;
    guarded<G> grad(exec, ext, d);
    call << " label " << bad << " at " << at;
    require_refusal(call, {"label", std::to_string(bad)}, [&] {
      mpx::sparse_categorical_cross_entropy(exec, x.cview(), labels.cview(), grad.view(), loss, scale);
    });
    grad.require_guards_intact(call, "gradient");
    for (std::size_t i = 0; i < grad.size(); ++i)
      if (mpx::bits(grad.data()[i]) != mpx::bits(poison<G>())) fail(call.str() + ": wrote the gradient before refusing");
    return;
  }
  if (variant == 1) {
    guarded<G> grad(exec, ext, d);
    call << " labels " << shape_string(labels.extents());
    require_refusal(call, {"labels", shape_string(labels.extents())}, [&] {
      mpx::sparse_categorical_cross_entropy(exec, x.cview(), labels.cview(), grad.view(), loss, scale);
    });
    return;
  }
  if constexpr (std::is_same_v<X, G>) {
    if (variant == 2 && count(ext) >= 1) {  // the gradient over the logits
      call << " gradient = logits";
      require_refusal(call, {"gradient", "logits", "overlap"}, [&] {
        mpx::sparse_categorical_cross_entropy(exec, x.cview(), labels.cview(), x.view(), loss, scale);
      });
      return;
    }
  }
  if (rows > 0 && classes == 0) {
    guarded<G> grad(exec, ext, d);
    require_refusal(call, {"no classes"}, [&] {
      mpx::sparse_categorical_cross_entropy(exec, x.cview(), labels.cview(), grad.view(), loss, scale);
    });
    return;
  }
  guarded<G> grad(exec, ext, d);
  call << " -> " << shape_text<G>(ext);
  float value = 0;
  require_accepted(call, [&] {
    mpx::sparse_categorical_cross_entropy(exec, x.cview(), labels.cview(), grad.view(), loss, scale);
    value = loss.read(exec);
  });
  grad.require_guards_intact(call, "gradient");
  auto const xs = x.wide(), gs = grad.wide();
  double const factor = (scale ? static_cast<double>(scale_value) : 1.0) / static_cast<double>(rows);
  double const uT = unit_roundoff<G>(), C = static_cast<double>(classes);
  double total = 0, magnitude = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    std::vector<double> const row(xs.begin() + static_cast<std::ptrdiff_t>(r * classes),
                                  xs.begin() + static_cast<std::ptrdiff_t>((r + 1) * classes));
    int const label = labels.data()[r];
    auto const p = mpx_test::reference::softmax_row(row);
    auto const st = mpx_test::reference::softmax_statistics_of(row);
    // The loss of a row: log S - (x_label - max); a NaN or +inf anywhere makes it NaN.
    bool const poisoned = std::isnan(p[0]);
    double const term = poisoned ? NAN : std::log(st.sum) - (row[static_cast<std::size_t>(label)] - st.max);
    total += term;
    // log S is within a few u_f of exact in absolute terms (S >= 1); x_label - max rounds once.
    magnitude += 1 + std::fabs(std::log(st.sum)) + std::fabs(row[static_cast<std::size_t>(label)] - st.max);
    for (std::size_t c = 0; c < classes; ++c) {
      double const ref = (p[c] - (static_cast<int>(c) == label ? 1.0 : 0.0)) * factor;
      double const dist = std::isfinite(row[c]) ? std::fabs(row[c] - st.max) : 0.0;
      double const tol = uT * std::fabs(ref) + (C / 32 + 64 + 2 * dist) * uf * factor + smallest_subnormal<G>();
      near<G>(call, "gradient", r * classes + c, gs[r * classes + c], ref, tol);
    }
  }
  double const mean = rows ? total / static_cast<double>(rows) : 0.0;
  near<float>(call, "loss", 0, value, mean,
              loss_tolerance(static_cast<double>(rows), C, mean, rows ? magnitude / static_cast<double>(rows) : 0.0));
}

template <class P, class G>
void pointwise_loss_case(draw& d, bool bce) {
  mpx::host_executor exec;
  auto const ext = d.extents(1 + d.below(3), 300);
  bool const hostile = d.coin();
  unsigned const variant = d.below(12);
  float const scale_value = d.pick<float>({0.0f, 1.0f, 1024.0f, 0.5f});
  float const* scale = scale_value == 0.0f ? nullptr : &scale_value;
  call_name call(bce ? "binary_cross_entropy " : "mean_squared_error ");
  // 1e15: squares and sums of n terms stay in float.
  guarded<P> p(exec, ext, d), t(exec, variant == 0 ? off_by_one(ext) : ext, d);
  p.assign(values_within<P>(d, p.size(), hostile, 1e15));
  for (std::size_t i = 0; i < t.size(); ++i) {
    // BCE targets are probabilities: 0 and 1 exactly (hostile), or any in between.
    if (bce) t.data()[i] = hostile && d.coin() ? mpx::cast<P>(d.coin() ? 1.0 : 0.0) : mpx::cast<P>(d.byte() / 255.0);
    else t.data()[i] = value_within<P>(d, hostile, 1e15);
  }
  mpx::loss_value loss(exec);
  auto const run = [&](auto grad) {
    if (bce) mpx::binary_cross_entropy(exec, p.cview(), t.cview(), grad, loss, scale);
    else mpx::mean_squared_error(exec, p.cview(), t.cview(), grad, loss, scale);
  };
  call << shape_text<P>(ext) << "+" << p.offset() << " targets " << shape_text<P>(t.extents()) << " scale " << scale_value;
  if (variant <= 1) {
    guarded<G> grad(exec, variant == 1 ? off_by_one(ext) : ext, d);
    call << " -> " << shape_text<G>(grad.extents());
    require_refusal(call, {"predictions has shape " + shape_string(ext), shape_string(off_by_one(ext))}, [&] { run(grad.view()); });
    return;
  }
  guarded<G> grad(exec, ext, d);
  call << " -> " << shape_text<G>(ext);
  float value = 0;
  require_accepted(call, [&] {
    run(grad.view());
    value = loss.read(exec);
  });
  grad.require_guards_intact(call, "gradient");
  auto const ps = p.wide(), ts = t.wide(), gs = grad.wide();
  std::size_t const n = ps.size();
  double const factor = n ? (scale ? static_cast<double>(scale_value) : 1.0) / static_cast<double>(n) : 0.0;
  double total = 0, magnitudes = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double const x = ps[i], z = ts[i];
    double term, dterm, magnitude;
    if (bce) {
      term = std::max(x, 0.0) - x * z + std::log1p(std::exp(-std::fabs(x)));
      double const e = std::exp(-std::fabs(x));
      double const s = x >= 0 ? 1 / (1 + e) : e / (1 + e);
      dterm = s - z;
      magnitude = s + std::fabs(z);
    } else {
      term = (x - z) * (x - z);
      dterm = 2 * (x - z);
      magnitude = 2 * (std::fabs(x) + std::fabs(z));
    }
    total += term;
    // The float parts of a term, as the tests take them: |x| + 1 (BCE), the square (MSE).
    magnitudes += bce ? std::fabs(x) + 1 : term;
    // Derived (no bound documented for these two): the derivative is a few float
    // operations on its terms (within 4 u_f of their magnitudes), times the float
    // factor (one rounding, and its own), then rounded once to G.
    double const ref = dterm * factor;
    double const tol = unit_roundoff<G>() * std::fabs(ref) + 8 * uf * magnitude * factor + smallest_subnormal<G>();
    near<G>(call, "gradient", i, gs[i], ref, tol);
  }
  double const mean = n ? total / static_cast<double>(n) : 0.0;
  near<float>(call, "loss", 0, value, mean,
              loss_tolerance(static_cast<double>(n), 0, mean, n ? magnitudes / static_cast<double>(n) : 0.0));
}

// ---- embedding ----

template <class W, class Y>
void embedding_case(draw& d) {
  mpx::host_executor exec;
  auto const ids_ext = d.extents(1 + d.below(2), 64, 256);
  std::int64_t const vocab = d.extent(50), width = d.extent(40);
  bool const backward = d.coin(), with_positions = !backward && d.coin();
  unsigned const variant = d.below(12);
  std::size_t const tokens = count(ids_ext);
  std::int64_t const sequence = ids_ext.back();
  std::int64_t const context = std::max<std::int64_t>(
      sequence + static_cast<std::int64_t>(d.below(3)) - (variant == 2 ? 1 + static_cast<std::int64_t>(d.below(2)) : 0), 0);
  auto y_ext = ids_ext;
  y_ext.push_back(width);
  call_name call(backward ? "embedding_backward " : "embedding_forward ");
  guarded<std::int32_t> ids(exec, ids_ext, d);
  for (std::size_t i = 0; i < tokens; ++i) ids.data()[i] = vocab ? static_cast<std::int32_t>(d.below(static_cast<std::size_t>(vocab))) : 0;
  if (variant == 0 && tokens > 0)
    ids.data()[d.below(tokens)] = d.pick<std::int32_t>({-1, static_cast<std::int32_t>(vocab), std::numeric_limits<std::int32_t>::min()});
  bool bad_id = false;  // also every id of an empty vocabulary
  for (std::size_t i = 0; i < tokens; ++i) bad_id = bad_id || ids.data()[i] < 0 || ids.data()[i] >= vocab;
  guarded<W> table(exec, {vocab, width}, d);
  table.assign(d.values<W>(table.size(), d.coin()));
  guarded<W> positions(exec, {context, width}, d);
  positions.assign(d.values<W>(positions.size(), false));
  call << "ids " << shape_string(ids_ext) << " table " << shape_text<W>(table.extents());
  if (with_positions) call << " positions " << shape_string(positions.extents());
  auto const out_ext = variant == 1 ? off_by_one(y_ext) : y_ext;
  guarded<Y> out(exec, out_ext, d);  // y, or dy backward
  if (backward) out.assign(d.values<Y>(out.size(), d.coin()));
  call << (backward ? " dy " : " -> ") << shape_text<Y>(out_ext);
  auto const run = [&] {
    if (backward) mpx::embedding_backward(exec, ids.cview(), out.cview(), table.view());
    else if (with_positions) mpx::embedding_forward(exec, ids.cview(), table.cview(), positions.cview(), out.view());
    else mpx::embedding_forward(exec, ids.cview(), table.cview(), out.view());
  };
  bool const positions_short = with_positions && context < sequence;
  if (variant == 1 || positions_short) {
    require_refusal(call, {positions_short && variant != 1 ? "positions" : "output"}, run);
    return;
  }
  // An id out of range is refused whenever the call has work to do: a call with nothing
  // to gather (forward: no token or width 0) or no table to write (backward: vocab x
  // width 0) returns before it reads an id, as the kernels say.
  bool const has_work = backward ? vocab * width > 0 : static_cast<std::int64_t>(tokens) * width > 0;
  if (bad_id && has_work) {
    call << " (an id out of range)";
    require_refusal(call, {"token id"}, run);
    return;
  }
  if (bad_id) return;
  if (!backward) {
    require_accepted(call, run);
    out.require_guards_intact(call, "y");
    // Exact: table[id, :] (+ positions[t, :]) in float, rounded once.
    std::vector<Y> expected(out.size());
    for (std::size_t n = 0; n < tokens; ++n)
      for (std::int64_t j = 0; j < width; ++j) {
        float v = mpx::cast<float>(table.data()[ids.data()[n] * width + j]);
        if (with_positions) v += mpx::cast<float>(positions.data()[static_cast<std::int64_t>(n) % sequence * width + j]);
        expected[n * static_cast<std::size_t>(width) + static_cast<std::size_t>(j)] = mpx::cast<Y>(v);
      }
    require_same<Y>(call, "y", out.values(), expected);
    return;
  }
  // Backward writes the table's gradient in W; dy is Y: the sums run in float in token
  // order and are rounded once (the header's contract, host and GPU alike): exact.
  std::fill_n(table.data(), table.size(), poison<W>());
  require_accepted(call, run);
  table.require_guards_intact(call, "d_table");
  std::vector<float> acc(table.size(), 0.0f);
  for (std::size_t n = 0; n < tokens; ++n)
    for (std::int64_t j = 0; j < width; ++j)
      acc[static_cast<std::size_t>(ids.data()[n] * width + j)] += mpx::cast<float>(out.data()[n * static_cast<std::size_t>(width) + static_cast<std::size_t>(j)]);
  std::vector<W> expected(acc.size());
  for (std::size_t i = 0; i < acc.size(); ++i) expected[i] = mpx::cast<W>(acc[i]);
  require_same<W>(call, "d_table", table.values(), expected);
}

// ---- activations ----

template <class X, class Y>
void activation_case(draw& d) {
  mpx::host_executor exec;
  auto const ext = d.extents(1 + d.below(3), 300);
  bool const hostile = d.coin(), backward = d.coin();
  unsigned const variant = d.below(10);
  std::string_view const names[] = {"linear", "relu", "sigmoid", "tanh", "gelu", "gelu_tanh"};
  mpx::activation const act = mpx::activation::from_name(names[d.below(std::size(names))]);
  auto const ref = mpx_test::reference::activation_of(act);
  call_name call(backward ? "activation_backward " : "activation_forward ");
  call << act.name() << " ";
  // Backward: |x| <= 1e4 keeps gelu_tanh's x^3 inside float (beyond it float's f' is
  // inf * 0 where float64's is 0; the doc's forms are exact in float64 for |x| <= 30).
  guarded<X> x(exec, ext, d), dy(exec, ext, d);
  x.assign(backward ? values_within<X>(d, x.size(), hostile, 1e4) : d.values<X>(x.size(), hostile));
  dy.assign(values_within<X>(d, dy.size(), hostile, 1e30));
  auto const run_on = [&](auto in, auto out) {  // in: x forward, dy backward
    mpx::with_activation(act, [&](auto f) {
      if (backward) mpx::activation_backward(exec, f, x.cview(), in, out);
      else mpx::activation_forward(exec, f, in, out);
    });
  };
  auto const run = [&](auto out) { run_on(backward ? dy.cview() : x.cview(), out); };
  call << shape_text<X>(ext) << "+" << x.offset();
  if (variant == 0) {
    guarded<Y> y(exec, off_by_one(ext), d);
    call << " -> " << shape_text<Y>(y.extents());
    require_refusal(call, {"has shape " + shape_string(ext), "has shape " + shape_string(y.extents())}, [&] { run(y.view()); });
    return;
  }
  if constexpr (std::is_same_v<X, Y>) {
    if (variant == 1 && count(ext) >= 2) {  // the output shifted over the input
      overlapping<X> o(exec, ext, d);
      call << " -> the input shifted by " << o.shift;
      require_refusal(call, {"overlap"}, [&] { run_on(o.first(), o.second()); });
      return;
    }
  }
  bool const in_place = std::is_same_v<X, Y> && variant == 2;
  guarded<Y> y(exec, ext, d);
  auto const xs = x.wide(), dys = dy.wide();
  call << (in_place ? " in place" : " -> ") << shape_text<Y>(ext);
  std::vector<double> const got = wide(run_in_place_or_apart(call, in_place, backward ? dy : x, backward ? "dy" : "x", y,
                                                               "y", run_on));
  // docs/activations_softmax_losses.md: forward (u_T + 32 u_f)|ref| + 32 u_f + sub_T,
  // backward (u_T + 32 u_f)|ref| + 32 u_f |dy| + sub_T.
  double const uT = unit_roundoff<Y>();
  for (std::size_t i = 0; i < got.size(); ++i) {
    // A NaN x gives NaN both ways for every activation but the identity (whose
    // derivative is 1): the contract (relu "NaN stays NaN, both ways"), which the shared
    // float64 relu, written for numbers, does not model.
    double r = backward ? dys[i] * ref.df(xs[i]) : ref.f(xs[i]);
    if (std::isnan(xs[i]) && !(backward && act == mpx::activation::linear)) r = NAN;
    // An infinite dy times a derivative below float's normal range (gelu's far left
    // tail): float's f'(x) may underflow to 0 and give inf * 0 = NaN where float64's
    // tiny f' gives the infinity. Either is float arithmetic as documented.
    if (backward && std::isinf(dys[i]) && std::isfinite(xs[i]) && ref.df(xs[i]) != 0 &&
        std::fabs(ref.df(xs[i])) < 0x1p-126 && std::isnan(got[i]))
      continue;
    double const tol = (uT + 32 * uf) * std::fabs(r) + 32 * uf * (backward ? std::fabs(dys[i]) : 1.0) + smallest_subnormal<Y>();
    near<Y>(call, backward ? "dx" : "y", i, got[i], r, tol);
  }
}

}  // namespace mpx_fuzz::api::rows_detail

namespace mpx_fuzz::api {

void run_rows(draw& d) {
  using namespace rows_detail;
  unsigned const op = d.byte() % 13;
  with_dtype(d, [&](auto in) {
    using T = typename decltype(in)::type;
    with_out_dtype<T>(d, [&](auto out) {
      using U = typename decltype(out)::type;
      switch (op) {
        case 0: softmax_forward_case<T, U>(d, false); break;
        case 1: softmax_forward_case<T, U>(d, true); break;
        case 2: softmax_backward_case<T, U>(d, false); break;
        case 3: softmax_backward_case<T, U>(d, true); break;
        case 4: layer_norm_forward_case<T, U>(d); break;
        case 5: norm_backward_case<T, U>(d, false); break;
        case 6: batch_norm_forward_case<T, U>(d); break;
        case 7: norm_backward_case<T, U>(d, true); break;
        case 8: dropout_case<T, U>(d); break;
        case 9: cross_entropy_case<T, U>(d); break;
        case 10: pointwise_loss_case<T, U>(d, d.coin()); break;
        case 11: embedding_case<T, U>(d); break;
        default: activation_case<T, U>(d); break;
      }
    });
  });
}

}  // namespace mpx_fuzz::api
