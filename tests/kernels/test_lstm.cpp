// lstm_forward and lstm_backward for every dtype on each executor, against a float64
// LSTM and its backpropagation through time (whose gradients are checked by finite
// differences), on seeded random inputs of awkward shapes; outputs poisoned first.
//
// The bound. One reference function is written over a number type: with `double` it is
// the float64 LSTM; with `ball` it carries, next to each exact value v, a radius e that
// bounds how far mpx's result for that quantity can be from v. Each operation grows the
// radius as the worst case of what mpx does there:
//   a + b, a * b         |a| e_b + |b| e_a + e_a e_b, plus one float rounding u_f (|v| + e)
//   sigmoid, tanh        Lipschitz constants 1/4 and 1, plus 4 u_f (expf, tanhf, division)
//   sigmoid', tanh'      Lipschitz constants 0.0963 (max |sigmoid''|) and 0.7699 (max
//                        |tanh''|), plus 8 u_f
//   a sum of n products  (a gemm, float sums) the products' radii plus gamma_n sum |terms|
//   stored to T          u_T (|v| + e): h_t each step, the gate gradients, dx
// The radius is thus a worst-case bound that follows the recurrence step by step: 16-bit
// storage rounds h_t every step, the rounding enters the next step's pre-activations
// through R, and the bound of h_t grows with t (as fast as the data let it: the tests use
// a recurrent kernel with column sums of |R| about 1/2, as a trained LSTM's contracting
// recurrence). Asserted: |mpx - v| <= 2 e + 2^-60, the factor 2 for float operations
// mpx performs in another order than the reference (the radius counts one rounding per
// operation, mpx may use one or two more in a fused step).
#include "../support/nn_reference.hpp"
#include "../support/reference/activation.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

using mpx_test::to_d;
using mpx_test::uf;
using mpx_test::poisoned;
using mpx_test::widen;


// ---- the number types of the reference ----

//! An exact value and a bound on mpx's distance from it (see the top of the file).
struct ball {
  double v = 0, e = 0;
};

ball operator+(ball a, ball b) {
  double const v = a.v + b.v;
  double const e = a.e + b.e;
  return {v, e + uf * (std::fabs(v) + e)};
}
ball operator*(ball a, ball b) {
  double const v = a.v * b.v;
  double const e = std::fabs(a.v) * b.e + std::fabs(b.v) * a.e + a.e * b.e;
  return {v, e + uf * (std::fabs(v) + e)};
}

// The gates' functions in float64 (tests/support/reference/activation.hpp), under the
// names the reference below calls for both number types.
double sig(double x) { return mpx_test::reference::sigmoid_f(x); }
double dsig(double x) { return mpx_test::reference::sigmoid_df(x); }
double tnh(double x) { return mpx_test::reference::tanh_f(x); }
double dtnh(double x) { return mpx_test::reference::tanh_df(x); }

ball sig(ball a) { return {sig(a.v), std::min(0.25 * a.e, 1.0) + 4 * uf}; }
ball tnh(ball a) { return {tnh(a.v), std::min(a.e, 2.0) + 4 * uf}; }
ball dsig(ball a) { return {dsig(a.v), std::min(0.0963 * a.e, 0.25) + 8 * uf}; }
ball dtnh(ball a) { return {dtnh(a.v), std::min(0.7699 * a.e, 1.0) + 8 * uf}; }

//! x rounded to storage T: the float64 reference does not round; the bound grows.
template <class T>
double store(double x) {
  return x;
}
template <class T>
ball store(ball a) {
  return {a.v, a.e + mpx_test::unit_roundoff<T>() * (std::fabs(a.v) + a.e)};
}

//! A sum of products in float (a gemm): the terms' radii plus gamma_n sum |terms|.
double fsum(std::vector<double> const& terms) {
  double s = 0;
  for (double t : terms) s += t;
  return s;
}
ball fsum(std::vector<ball> const& terms) {
  double v = 0, e = 0, mag = 0;
  for (ball const& t : terms) {
    v += t.v;
    e += t.e;
    mag += std::fabs(t.v) + t.e;
  }
  double const n = static_cast<double>(terms.size()) + 1;
  return {v, e + n * uf / (1 - n * uf) * mag};
}

// ---- the reference LSTM over a number type ----

struct lstm_dims {
  std::size_t n, t, f, u;
};

//! The inputs as exact values: x [N, T, F], W [F, 4U], R [U, 4U], b [4U], h0, c0 [N, U],
//! dh [N, T, U].
struct lstm_inputs {
  lstm_dims d;
  std::vector<double> x, w, r, b, h0, c0, dh;
};

template <class Num>
struct lstm_result {
  std::vector<Num> z;   // [T][N][4U] pre-activations
  std::vector<Num> c;   // [T + 1][N][U]
  std::vector<Num> h;   // [T + 1][N][U] as the next step reads it (stored)
  std::vector<Num> dz;  // [T][N][4U] (stored)
  std::vector<Num> dx, dw, dr, db;
};

template <class Num>
std::vector<Num> exact(std::vector<double> const& v) {
  std::vector<Num> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = Num{v[i]};
  return out;
}

template <class Num, class S>
lstm_result<Num> ref_lstm(lstm_inputs const& in, bool backward = true) {
  auto const [N, T, F, U] = in.d;
  auto const x = exact<Num>(in.x), w = exact<Num>(in.w), r = exact<Num>(in.r), b = exact<Num>(in.b);
  lstm_result<Num> out;
  out.z.resize(T * N * 4 * U);
  out.c = exact<Num>(in.c0);
  out.h = exact<Num>(in.h0);
  out.c.resize((T + 1) * N * U);
  out.h.resize((T + 1) * N * U);
  std::vector<Num> terms;
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t n = 0; n < N; ++n) {
      Num* z = &out.z[(t * N + n) * 4 * U];
      Num const* hp = &out.h[(t * N + n) * U];
      Num const* cp = &out.c[(t * N + n) * U];
      for (std::size_t col = 0; col < 4 * U; ++col) {
        terms.clear();
        for (std::size_t f = 0; f < F; ++f) terms.push_back(x[(n * T + t) * F + f] * w[f * 4 * U + col]);
        for (std::size_t k = 0; k < U; ++k) terms.push_back(hp[k] * r[k * 4 * U + col]);
        z[col] = fsum(terms) + b[col];
      }
      for (std::size_t j = 0; j < U; ++j) {
        Num const ct = sig(z[U + j]) * cp[j] + sig(z[j]) * tnh(z[2 * U + j]);
        out.c[((t + 1) * N + n) * U + j] = ct;
        out.h[((t + 1) * N + n) * U + j] = store<S>(sig(z[3 * U + j]) * tnh(ct));
      }
    }
  if (!backward) return out;

  out.dz.resize(T * N * 4 * U);
  std::vector<Num> dh_rec(N * U), dc(N * U);
  for (std::size_t t = T; t-- > 0;) {
    for (std::size_t n = 0; n < N; ++n)
      for (std::size_t j = 0; j < U; ++j) {
        Num const* z = &out.z[(t * N + n) * 4 * U];
        Num* dz = &out.dz[(t * N + n) * 4 * U];
        std::size_t const k = n * U + j;
        Num const ct = out.c[(t + 1) * N * U + k], cp = out.c[t * N * U + k];
        Num const dh = Num{in.dh[(n * T + t) * U + j]} + dh_rec[k];
        Num const dct = dc[k] + dh * sig(z[3 * U + j]) * dtnh(ct);
        dz[j] = store<S>(dct * tnh(z[2 * U + j]) * dsig(z[j]));
        dz[U + j] = store<S>(dct * cp * dsig(z[U + j]));
        dz[2 * U + j] = store<S>(dct * sig(z[j]) * dtnh(z[2 * U + j]));
        dz[3 * U + j] = store<S>(dh * tnh(ct) * dsig(z[3 * U + j]));
        dc[k] = dct * sig(z[U + j]);
      }
    for (std::size_t n = 0; n < N; ++n)
      for (std::size_t k = 0; k < U; ++k) {
        terms.clear();
        for (std::size_t col = 0; col < 4 * U; ++col)
          terms.push_back(out.dz[(t * N + n) * 4 * U + col] * r[k * 4 * U + col]);
        dh_rec[n * U + k] = fsum(terms);
      }
  }
  out.dx.resize(N * T * F);
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t f = 0; f < F; ++f) {
        terms.clear();
        for (std::size_t col = 0; col < 4 * U; ++col)
          terms.push_back(out.dz[(t * N + n) * 4 * U + col] * w[f * 4 * U + col]);
        out.dx[(n * T + t) * F + f] = store<S>(fsum(terms));
      }
  auto const over_steps = [&](auto const& operand, std::size_t row) {
    terms.clear();
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t n = 0; n < N; ++n) terms.push_back(operand(t, n) * out.dz[(t * N + n) * 4 * U + row]);
    return fsum(terms);
  };
  out.dw.resize(F * 4 * U);
  out.dr.resize(U * 4 * U);
  out.db.resize(4 * U);
  for (std::size_t col = 0; col < 4 * U; ++col) {
    for (std::size_t f = 0; f < F; ++f)
      out.dw[f * 4 * U + col] = over_steps([&](std::size_t t, std::size_t n) { return x[(n * T + t) * F + f]; }, col);
    for (std::size_t k = 0; k < U; ++k)
      out.dr[k * 4 * U + col] = over_steps([&](std::size_t t, std::size_t n) { return out.h[(t * N + n) * U + k]; }, col);
    out.db[col] = over_steps([](std::size_t, std::size_t) { return Num{1.0}; }, col);
  }
  return out;
}

// ---- running mpx ----

struct lstm_case {
  lstm_dims d;
  bool initial_state = false;
  double w_range = 1.0;       // W uniform in +-w_range / sqrt(F)
  double r_range = 1.0;       // R uniform in +-r_range / U: column sums of |R| about r_range / 2
  double forget_bias = 1.0;   // added to b_f (Keras's unit_forget_bias)
  double input_bias = 0.0;    // added to b_i
};



std::int64_t i64(std::size_t v) { return static_cast<std::int64_t>(v); }

template <class T>
lstm_inputs random_inputs(lstm_case const& c, std::uint64_t stream, std::vector<T>& x, std::vector<T>& w,
                          std::vector<T>& r, std::vector<float>& b, std::vector<T>& h0, std::vector<float>& c0,
                          std::vector<T>& dh) {
  auto const [N, T_, F, U] = c.d;
  double const wr = c.w_range / std::sqrt(static_cast<double>(std::max<std::size_t>(F, 1)));
  double const rr = c.r_range / static_cast<double>(U);
  x = mpx_test::random_values<T>(N * T_ * F, -1, 1, stream + 1);
  w = mpx_test::random_values<T>(F * 4 * U, -wr, wr, stream + 2);
  r = mpx_test::random_values<T>(U * 4 * U, -rr, rr, stream + 3);
  b = mpx_test::random_values<float>(4 * U, -0.5, 0.5, stream + 4);
  for (std::size_t j = 0; j < U; ++j) {
    b[j] += static_cast<float>(c.input_bias);
    b[U + j] += static_cast<float>(c.forget_bias);
  }
  h0 = c.initial_state ? mpx_test::random_values<T>(N * U, -0.5, 0.5, stream + 5) : std::vector<T>(N * U, T{});
  c0 = c.initial_state ? mpx_test::random_values<float>(N * U, -1, 1, stream + 6) : std::vector<float>(N * U, 0.0f);
  if (!c.initial_state) {
    for (auto& v : h0) v = mpx::cast<T>(0.0f);
  }
  dh = mpx_test::random_values<T>(N * T_ * U, -1, 1, stream + 7);
  return lstm_inputs{c.d, widen(x), widen(w), widen(r), widen(b), widen(h0), widen(c0), widen(dh)};
}

template <class Got>
void check_all(std::string const& what, std::vector<Got> const& got, std::vector<ball> const& ref, double& nonzero) {
  mpx_test::bound_checker chk(what);
  REQUIRE(got.size() == ref.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    chk.check(i, to_d(got[i]), ref[i].v, 2 * ref[i].e + std::ldexp(1.0, -60));
    nonzero += std::fabs(ref[i].v);
  }
  if (got.empty()) return;
  MPX_REQUIRE_WITHIN(chk);
}

template <class T, class Exec>
void run_lstm(Exec const& exec, lstm_case const& c, std::uint64_t stream) {
  using P = mpx_test::preset_policy<T>;
  auto const [N, T_, F, U] = c.d;
  std::vector<T> x, w, r, h0, dh;
  std::vector<float> b, c0;
  lstm_inputs const in = random_inputs<T>(c, stream, x, w, r, b, h0, c0, dh);
  auto const xd = mpx_test::upload(exec, x, {i64(N), i64(T_), i64(F)});
  auto const wd = mpx_test::upload(exec, w, {i64(F), i64(4 * U)});
  auto const rd = mpx_test::upload(exec, r, {i64(U), i64(4 * U)});
  auto const bd = mpx_test::upload(exec, b, {i64(4 * U)});
  auto const dhd = mpx_test::upload(exec, dh, {i64(N), i64(T_), i64(U)});
  auto h = poisoned<T>(exec, {i64(N), i64(T_), i64(U)});
  auto ws = poisoned<float>(exec, {i64(mpx::lstm_workspace_elements<P>(i64(N), i64(T_), i64(F), i64(U)))});
  if (c.initial_state) {
    auto const h0d = mpx_test::upload(exec, h0, {i64(N), i64(U)});
    auto const c0d = mpx_test::upload(exec, c0, {i64(N), i64(U)});
    mpx::lstm_forward<P>(exec, xd, wd, rd, bd, h0d, c0d, h, ws);
  } else {
    mpx::lstm_forward<P>(exec, xd, wd, rd, bd, h, ws);
  }
  auto dx = poisoned<T>(exec, {i64(N), i64(T_), i64(F)});
  auto dw = poisoned<float>(exec, {i64(F), i64(4 * U)});
  auto dr = poisoned<float>(exec, {i64(U), i64(4 * U)});
  auto db = poisoned<float>(exec, {i64(4 * U)});
  mpx::lstm_backward<P>(exec, dhd, wd, rd, dx, dw, dr, db, ws);

  auto const ref = ref_lstm<ball, T>(in);
  // The reference's h [T + 1][N][U] (h_0 first) as the user's [N, T, U].
  std::vector<ball> ref_h(N * T_ * U);
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t t = 0; t < T_; ++t)
      for (std::size_t j = 0; j < U; ++j) ref_h[(n * T_ + t) * U + j] = ref.h[((t + 1) * N + n) * U + j];
  INFO(mpx::dtype_name<T> << " N=" << N << " T=" << T_ << " F=" << F << " U=" << U
                          << " initial_state=" << c.initial_state);
  std::string const name = "lstm " + std::string(mpx::dtype_name<T>);
  double nonzero = 0;
  check_all(name + " h", mpx_test::download(exec, h), ref_h, nonzero);
  check_all(name + " dx", mpx_test::download(exec, dx), ref.dx, nonzero);
  check_all(name + " dkernel", mpx_test::download(exec, dw), ref.dw, nonzero);
  check_all(name + " drecurrent_kernel", mpx_test::download(exec, dr), ref.dr, nonzero);
  check_all(name + " dbias", mpx_test::download(exec, db), ref.db, nonzero);
  REQUIRE(nonzero > 0);  // the reference is not all zeros
}

}  // namespace

TEST_CASE("the float64 LSTM gradients agree with finite differences", "[lstm]") {
  lstm_dims const d{2, 3, 2, 3};
  auto const [N, T, F, U] = d;
  lstm_inputs in{d,
                 mpx_test::random_values<double>(N * T * F, -1, 1, 1),
                 mpx_test::random_values<double>(F * 4 * U, -1, 1, 2),
                 mpx_test::random_values<double>(U * 4 * U, -1, 1, 3),
                 mpx_test::random_values<double>(4 * U, -1, 1, 4),
                 mpx_test::random_values<double>(N * U, -1, 1, 5),
                 mpx_test::random_values<double>(N * U, -1, 1, 6),
                 mpx_test::random_values<double>(N * T * U, -1, 1, 7)};
  // loss = sum over n, t, j of dh * h: its gradient with respect to h is dh.
  auto const loss = [&](lstm_inputs const& p) {
    auto const f = ref_lstm<double, double>(p, false);
    double l = 0;
    for (std::size_t n = 0; n < N; ++n)
      for (std::size_t t = 0; t < T; ++t)
        for (std::size_t j = 0; j < U; ++j) l += p.dh[(n * T + t) * U + j] * f.h[((t + 1) * N + n) * U + j];
    return l;
  };
  auto const g = ref_lstm<double, double>(in);
  auto const check = [&](std::vector<double> lstm_inputs::*member, std::vector<double> const& grad,
                         char const* name) {
    REQUIRE(grad.size() == (in.*member).size());
    for (std::size_t i = 0; i < grad.size(); ++i) {
      auto const at = [&](double v) {
        lstm_inputs p = in;
        (p.*member)[i] = v;
        return loss(p);
      };
      double const fd = mpx_test::finite_difference(at, (in.*member)[i]);
      INFO(name << " i=" << i << " fd=" << fd << " backprop=" << grad[i]);
      REQUIRE(std::fabs(fd - grad[i]) <= 1e-7 * (1 + std::fabs(fd)));
    }
  };
  check(&lstm_inputs::x, g.dx, "dx");
  check(&lstm_inputs::w, g.dw, "dkernel");
  check(&lstm_inputs::r, g.dr, "drecurrent_kernel");
  check(&lstm_inputs::b, g.db, "dbias");

  // The bound-carrying reference computes the same values.
  auto const gb = ref_lstm<ball, double>(in);
  for (std::size_t i = 0; i < g.dr.size(); ++i) REQUIRE(gb.dr[i].v == g.dr[i]);
  for (std::size_t i = 0; i < g.h.size(); ++i) REQUIRE(gb.h[i].v == g.h[i]);
}

TEMPLATE_LIST_TEST_CASE("lstm forward and backward are within the bound of float64", "[lstm]",
                        mpx_test::executors) {
  TestType exec;
  std::vector<lstm_case> const cases = {
      {{1, 1, 1, 1}},         {{1, 10, 3, 5}},       {{7, 10, 1, 32}},        {{7, 1, 9, 5}, true},
      {{2, 3, 4, 32}, true},  {{3, 10, 6, 7}, true}, {{1, 25, 16, 8}},        {{5, 4, 33, 3}},
  };
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    std::uint64_t stream = 100;
    for (lstm_case const& c : cases) run_lstm<T>(exec, c, stream += 10);
  };
  mpx_test::for_each_dtype(for_type);
}

// The cell state integrates: with a forget gate near 1 (bias 6: f = 0.9975) and small
// increments i g (about 0.01), c is a long sum whose terms are far below c itself. A
// 16-bit cell state would drop most of each increment; the bound, which keeps c in
// float, catches that. (R is tiny here, so that h's own rounding, which does not
// integrate, stays out of the way.)
TEMPLATE_LIST_TEST_CASE("lstm keeps a long-memory cell state in float", "[lstm]", mpx_test::executors) {
  TestType exec;
  lstm_case c{{3, 200, 2, 4}};
  c.w_range = 0.15;
  c.r_range = 0.004;
  c.forget_bias = 6;
  c.input_bias = -2;
  auto for_type = [&](auto tag) { run_lstm<decltype(tag)>(exec, c, 900); };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("lstm_backward accumulates on request and can run twice", "[lstm]", mpx_test::executors) {
  TestType exec;
  using P = mpx::mixed_float16;
  using mpx::half;
  std::int64_t const N = 3, T = 4, F = 5, U = 6;
  lstm_case const c{{3, 4, 5, 6}};
  std::vector<half> x, w, r, h0, dh;
  std::vector<float> b, c0;
  (void)random_inputs<half>(c, 50, x, w, r, b, h0, c0, dh);
  auto const xd = mpx_test::upload(exec, x, {N, T, F});
  auto const wd = mpx_test::upload(exec, w, {F, 4 * U});
  auto const rd = mpx_test::upload(exec, r, {U, 4 * U});
  auto const bd = mpx_test::upload(exec, b, {4 * U});
  auto const dhd = mpx_test::upload(exec, dh, {N, T, U});
  auto h = poisoned<half>(exec, {N, T, U});
  auto ws = poisoned<float>(exec, {i64(mpx::lstm_workspace_elements<P>(N, T, F, U))});
  mpx::lstm_forward<P>(exec, xd, wd, rd, bd, h, ws);
  auto dx = poisoned<half>(exec, {N, T, F});
  auto dw = poisoned<float>(exec, {F, 4 * U});
  auto dr = poisoned<float>(exec, {U, 4 * U});
  auto db = poisoned<float>(exec, {4 * U});
  mpx::lstm_backward<P>(exec, dhd, wd, rd, dx, dw, dr, db, ws);
  auto const dx1 = mpx_test::download(exec, dx);
  auto const dw1 = mpx_test::download(exec, dw);
  auto const dr1 = mpx_test::download(exec, dr);
  auto const db1 = mpx_test::download(exec, db);
  mpx::lstm_backward<P>(exec, dhd, wd, rd, dx, dw, dr, db, ws, mpx::lstm_backward_options{true});
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, dx), dx1).empty());
  auto doubled = [](std::vector<float> v) {
    for (float& e : v) e *= 2;
    return v;
  };
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, dw), doubled(dw1)).empty());
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, dr), doubled(dr1)).empty());
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, db), doubled(db1)).empty());
}

TEMPLATE_LIST_TEST_CASE("lstm with no steps or no sequences: empty h, zero parameter gradients", "[lstm]",
                        mpx_test::executors) {
  TestType exec;
  using P = mpx::float32;
  for (auto [N, T] : {std::pair<std::int64_t, std::int64_t>{0, 3}, {2, 0}}) {
    std::int64_t const F = 3, U = 2;
    auto x = mpx::make_tensor<float>(exec, {N, T, F});
    auto w = mpx_test::upload(exec, mpx_test::random_values<float>(F * 4 * U, -1, 1, 1), {F, 4 * U});
    auto r = mpx_test::upload(exec, mpx_test::random_values<float>(U * 4 * U, -1, 1, 2), {U, 4 * U});
    auto b = mpx_test::upload(exec, mpx_test::random_values<float>(4 * U, -1, 1, 3), {4 * U});
    auto h = mpx::make_tensor<float>(exec, {N, T, U});
    auto dh = mpx::make_tensor<float>(exec, {N, T, U});
    auto dx = mpx::make_tensor<float>(exec, {N, T, F});
    auto ws = mpx::make_tensor<float>(exec, {i64(mpx::lstm_workspace_elements<P>(N, T, F, U))});
    mpx::lstm_forward<P>(exec, x, w, r, b, h, ws);
    auto dw = poisoned<float>(exec, {F, 4 * U});
    auto dr = poisoned<float>(exec, {U, 4 * U});
    auto db = poisoned<float>(exec, {4 * U});
    mpx::lstm_backward<P>(exec, dh, w, r, dx, dw, dr, db, ws);
    for (auto const& grads : {mpx_test::download(exec, dw), mpx_test::download(exec, dr), mpx_test::download(exec, db)})
      for (float g : grads) REQUIRE(g == 0.0f);
  }
}

TEMPLATE_LIST_TEST_CASE("lstm refuses mismatched shapes, naming both", "[lstm]", mpx_test::executors) {
  using Catch::Matchers::Contains;
  TestType exec;
  using P = mpx::float32;
  std::int64_t const N = 2, T = 3, F = 4, U = 5;
  auto x = mpx::make_tensor<float>(exec, {N, T, F});
  auto w = mpx::make_tensor<float>(exec, {F, 4 * U});
  auto bad_w = mpx::make_tensor<float>(exec, {F + 1, 4 * U});
  auto r = mpx::make_tensor<float>(exec, {U, 4 * U});
  auto bad_r = mpx::make_tensor<float>(exec, {U, 3 * U});
  auto b = mpx::make_tensor<float>(exec, {4 * U});
  auto bad_b = mpx::make_tensor<float>(exec, {U});
  auto h = mpx::make_tensor<float>(exec, {N, T, U});
  auto bad_h = mpx::make_tensor<float>(exec, {T, N, U});
  auto h0 = mpx::make_tensor<float>(exec, {N, U + 1});
  auto c0 = mpx::make_tensor<float>(exec, {N, U});
  auto ws = mpx::make_tensor<float>(exec, {i64(mpx::lstm_workspace_elements<P>(N, T, F, U))});
  auto small_ws = mpx::make_tensor<float>(exec, {10});
  auto dx = mpx::make_tensor<float>(exec, {N, T, F});
  auto bad_dx = mpx::make_tensor<float>(exec, {N, T, F + 2});
  auto dw = mpx::make_tensor<float>(exec, {F, 4 * U});
  auto dr = mpx::make_tensor<float>(exec, {U, 4 * U});
  auto db = mpx::make_tensor<float>(exec, {4 * U});
  auto x2 = mpx::make_tensor<float>(exec, {N * T, F});

  CHECK_THROWS_TYPE_WITH(mpx::lstm_forward<P>(exec, x, bad_w, r, b, h, ws), mpx::shape_error,
                         Contains("mpx::lstm_forward") && Contains("[5, 20]") && Contains("[2, 3, 4]"));
  CHECK_THROWS_TYPE_WITH(mpx::lstm_forward<P>(exec, x, w, bad_r, b, h, ws), mpx::shape_error,
                         Contains("mpx::lstm_forward") && Contains("[5, 15]") && Contains("[2, 3, 4]"));
  CHECK_THROWS_TYPE_WITH(mpx::lstm_forward<P>(exec, x, w, r, bad_b, h, ws), mpx::shape_error,
                         Contains("[5]") && Contains("[5, 20]"));
  CHECK_THROWS_TYPE_WITH(mpx::lstm_forward<P>(exec, x, w, r, b, bad_h, ws), mpx::shape_error,
                         Contains("[3, 2, 5]") && Contains("[2, 3, 4]"));
  CHECK_THROWS_TYPE_WITH(mpx::lstm_forward<P>(exec, x2, w, r, b, h, ws), mpx::shape_error,
                         Contains("mpx::lstm_forward") && Contains("[6, 4]"));
  CHECK_THROWS_TYPE_WITH(mpx::lstm_forward<P>(exec, x, w, r, b, h0, c0, h, ws), mpx::shape_error,
                         Contains("h0") && Contains("[2, 6]") && Contains("[2, 3, 4]"));
  CHECK_THROWS_TYPE_WITH(mpx::lstm_forward<P>(exec, x, w, r, b, h, small_ws), mpx::shape_error,
                         Contains("workspace") && Contains("[10]") && Contains("lstm_workspace_elements"));
  CHECK_THROWS_TYPE_WITH(mpx::lstm_backward<P>(exec, h, w, r, bad_dx, dw, dr, db, ws), mpx::shape_error,
                         Contains("mpx::lstm_backward") && Contains("[2, 3, 6]") && Contains("[2, 3, 5]"));
  CHECK_THROWS_TYPE_WITH(mpx::lstm_backward<P>(exec, h, w, bad_r, dx, dw, dr, db, ws), mpx::shape_error,
                         Contains("mpx::lstm_backward") && Contains("[5, 15]") && Contains("[2, 3, 5]"));
  CHECK_THROWS_TYPE_WITH(mpx::lstm_backward<P>(exec, h, w, r, dx, dr, dr, db, ws), mpx::shape_error,
                         Contains("dkernel") && Contains("[5, 20]") && Contains("[4, 20]"));
  CHECK_THROWS_TYPE_WITH(mpx::lstm_backward<P>(exec, h, w, r, dx, dw, dr, bad_b, ws), mpx::shape_error,
                         Contains("dbias") && Contains("[5]"));
  CHECK_THROWS_TYPE_WITH(mpx::lstm_backward<P>(exec, h, w, r, dx, dw, dr, db, small_ws), mpx::shape_error,
                         Contains("mpx::lstm_backward") && Contains("[10]"));
  CHECK_THROWS_TYPE_WITH(mpx::lstm_workspace_elements<P>(-1, 2, 3, 4), mpx::invalid_argument, Contains("N = -1"));
}

TEMPLATE_LIST_TEST_CASE("lstm refuses an output that shares memory with another tensor of the call", "[lstm]",
                        mpx_test::executors) {
  using Catch::Matchers::Contains;
  TestType exec;
  using P = mpx::float32;
  using space = mpx::memory_space_t<TestType>;
  std::int64_t const N = 2, T = 3, F = 4, U = 5;
  auto x = mpx::make_tensor<float>(exec, {N, T, F});
  auto w = mpx::make_tensor<float>(exec, {F, 4 * U});
  auto r = mpx::make_tensor<float>(exec, {U, 4 * U});
  auto b = mpx::make_tensor<float>(exec, {4 * U});
  auto h = mpx::make_tensor<float>(exec, {N, T, U});
  auto ws = mpx::make_tensor<float>(exec, {i64(mpx::lstm_workspace_elements<P>(N, T, F, U))});
  auto dw = mpx::make_tensor<float>(exec, {F, 4 * U});
  auto dr = mpx::make_tensor<float>(exec, {U, 4 * U});
  auto db = mpx::make_tensor<float>(exec, {4 * U});
  // h written over the recurrent kernel it reads at every step, c0 inside the workspace.
  mpx::tensor_view<float, space> const h_in_r(r.data(), {N, T, U});
  CHECK_THROWS_TYPE_WITH(mpx::lstm_forward<P>(exec, x, w, r, b, h_in_r, ws), mpx::invalid_argument,
                         Contains("mpx::lstm_forward: h and recurrent_kernel overlap in memory"));
  mpx::tensor_view<float, space> const c0_in_ws(ws.data() + 3, {N, U});
  auto h0 = mpx::make_tensor<float>(exec, {N, U});
  CHECK_THROWS_TYPE_WITH(mpx::lstm_forward<P>(exec, x, w, r, b, h0, c0_in_ws, h, ws), mpx::invalid_argument,
                         Contains("the workspace and c0 overlap in memory"));
  mpx::lstm_forward<P>(exec, x, w, r, b, h, ws);  // apart, it runs
  // dx over dh, and dbias inside dkernel.
  mpx::tensor_view<float, space> const dx_over_dh(h.data(), {N, T, F});
  CHECK_THROWS_TYPE_WITH(mpx::lstm_backward<P>(exec, h, w, r, dx_over_dh, dw, dr, db, ws), mpx::invalid_argument,
                         Contains("mpx::lstm_backward: dx and dh overlap in memory"));
  mpx::tensor_view<float, space> const db_in_dw(dw.data() + 10, {4 * U});
  CHECK_THROWS_TYPE_WITH(mpx::lstm_backward<P>(exec, h, w, r, x, dw, dr, db_in_dw, ws), mpx::invalid_argument,
                         Contains("dkernel and dbias overlap in memory"));
}
