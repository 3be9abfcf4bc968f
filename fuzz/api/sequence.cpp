// The API fuzzer's sequence group: causal self-attention (the kernels permute_heads,
// causal_softmax and its backward, and the causal_self_attention layer forward and
// backward) and the LSTM (lstm_forward and lstm_backward, and the lstm layer), under
// float32, mixed_float16 and mixed_bfloat16, at awkward batch, sequence, head and unit
// counts, with hostile values and calls made invalid on purpose.
//
// The bound. A float64 reference is written over `ball`, a number that carries its exact
// value v and a radius e bounding how far mpx's result can be from v, as
// tests/kernels/test_lstm.cpp and docs/lstm.md ("Error bounds") bound the LSTM:
//   a float + or *          the operands' radii propagated, plus one rounding 2^-24 (|v| + e)
//   a float sum of n terms  (a gemm, a row reduction) the terms' radii plus
//                           gamma_{n+4} sum |terms|, gamma_k = k 2^-24 / (1 - k 2^-24)
//   sigmoid, tanh           Lipschitz 1/4 and 1 (capped at their ranges), plus 4 2^-24
//   sigmoid', tanh'         Lipschitz max|sigmoid''| = 0.0963, max|tanh''| = 0.7699, plus 8 2^-24
//   softmax of a row        p_j (e^{2E} - 1) for logits off by at most E, plus
//                           (4 valid + 8) 2^-24 for the float exp, sum and division
//                           (each exp(x_j - m) is off by <= 3u absolute since x - m <= 0,
//                           the sum by valid 3u + its own rounding, s >= 1)
//   a store to 16 bits      u_S (|v| + e) plus half the smallest subnormal
// and an element is checked as |mpx - v| <= 2 e + 2^-60 (the factor 2 for float
// operations done in another order, as test_lstm.cpp asserts). Where float could
// overflow (|v| + e past FLT_MAX) the radius becomes infinite: the value is not checked,
// but a NaN the float64 reference makes (from a NaN or inf input) must be NaN in mpx,
// and a value certainly past a 16-bit format's range when stored is exactly ±inf (the
// float16 logit overflow docs/transformers.md describes: the softmax row becomes NaN).

#include "groups.hpp"

#include <mpx/core/policy.hpp>
#include <mpx/kernels/attention.hpp>
#include <mpx/kernels/lstm.hpp>
#include <mpx/layers/attention.hpp>
#include <mpx/layers/lstm.hpp>

#include <cfloat>
#include <functional>
#include <type_traits>

namespace mpx_fuzz::api {

namespace sequence_detail {

using mpx::host_space;

inline constexpr double inf = HUGE_VAL;
inline constexpr double uf = 0x1p-24;

// ---- ball arithmetic (see the top of the file) ----

struct ball {
  double v = 0, e = 0;
};

inline bool known(ball a) { return std::isfinite(a.e); }

//! The result of one float operation whose exact value is v, the operands' radii
//! propagated to e.
inline ball rounded(double v, double e) {
  if (std::isnan(v)) return {v, 0};
  if (!(e < inf)) return {v, inf};
  if (std::isinf(v)) return {v, 0};  // an exact inf operand with known finite others
  e += uf * (std::fabs(v) + e) + 0x1p-149;
  if (std::fabs(v) + e > FLT_MAX) e = inf;
  return {v, e};
}

//! a * b for radii, 0 * inf being 0 (a radius of 0 times anything adds nothing).
inline double rprod(double a, double b) { return a == 0 || b == 0 ? 0 : a * b; }

//! The exact product of two balls, not rounded (a gemm term): an infinite operand
//! times an operand that may be 0 is unknowable (NaN or inf in float).
inline ball exact_product(ball a, ball b) {
  double const v = a.v * b.v;
  if (std::isnan(v)) return {v, 0};
  if (!known(a) || !known(b)) return {v, inf};
  if (std::isinf(a.v) || std::isinf(b.v)) {
    ball const other = std::isinf(a.v) ? b : a;
    if (other.e > 0 && std::fabs(other.v) <= other.e) return {v, inf};
    return {v, 0};
  }
  return {v, rprod(std::fabs(a.v), b.e) + rprod(std::fabs(b.v), a.e) + rprod(a.e, b.e)};
}

inline ball operator*(ball a, ball b) {
  ball const p = exact_product(a, b);
  return rounded(p.v, p.e);
}
inline ball operator+(ball a, ball b) {
  if (!known(a) || !known(b)) return {a.v + b.v, inf};
  return rounded(a.v + b.v, a.e + b.e);
}
inline ball operator-(ball a) { return {-a.v, a.e}; }
inline ball operator-(ball a, ball b) { return a + -b; }

//! A float sum of n terms (exact products or values), in any order.
inline ball float_sum(std::vector<ball> const& terms) {
  double v = 0, e = 0, mag = 0;
  for (ball const& t : terms) {
    v += t.v;
    e += t.e;
    if (std::isfinite(t.v)) mag += std::fabs(t.v) + t.e;
  }
  if (std::isnan(v)) return {v, 0};
  if (!(e < inf) || mag > FLT_MAX / 2) return {v, inf};  // partial sums may overflow float
  if (std::isinf(v)) return {v, 0};
  double const k = static_cast<double>(terms.size()) + 4;
  e += k * uf / (1 - k * uf) * mag + k * 0x1p-149;
  if (std::fabs(v) + e > FLT_MAX) e = inf;
  return {v, e};
}

// The gate functions in float64, as mpx's act::sigmoid and act::tanh define them.
inline double sig(double x) { return 1.0 / (1.0 + std::exp(-x)); }
inline double dsig(double x) {
  double const e = std::exp(-std::fabs(x));
  return e / ((1 + e) * (1 + e));
}
inline double dtnh(double x) {
  double const e = std::exp(-2 * std::fabs(x));
  return 4 * e / ((1 + e) * (1 + e));
}
inline ball sig(ball a) { return {sig(a.v), known(a) ? std::min(0.25 * a.e, 1.0) + 4 * uf : inf}; }
inline ball tnh(ball a) { return {std::tanh(a.v), known(a) ? std::min(a.e, 2.0) + 4 * uf : inf}; }
inline ball dsig(ball a) { return {dsig(a.v), known(a) ? std::min(0.0963 * a.e, 0.25) + 8 * uf : inf}; }
inline ball dtnh(ball a) { return {dtnh(a.v), known(a) ? std::min(0.7699 * a.e, 1.0) + 8 * uf : inf}; }

//! A float value stored to S: exact for float; for 16 bits one rounding, and ±inf when
//! the value is certainly past the format's range.
template <class S>
ball store(ball a) {
  if constexpr (std::is_same_v<S, float>) {
    return a;
  } else {
    if (std::isnan(a.v) || std::isinf(a.v) || !known(a)) return a;
    using traits = mpx::dtype_traits<S>;
    double const max = mpx::detail::to_double(traits::max());
    // max plus half an ulp of max rounds to inf (max's last bit is odd), anything below to max.
    double const overflow = max + std::ldexp(1.0, std::ilogb(max) - traits::mantissa_bits - 1);
    if (std::fabs(a.v) - a.e >= overflow) return {std::copysign(inf, a.v), 0};
    double const tiny = mpx::detail::to_double(mpx::detail::from_bits<S>(typename traits::bits_type(1))) / 2;
    double const e = a.e + unit_roundoff<S>() * (std::fabs(a.v) + a.e) + tiny;
    return {a.v, std::fabs(a.v) + e >= overflow ? inf : e};
  }
}

//! Checks got[i] against its ball: NaN exactly where the reference is NaN; otherwise,
//! where the radius is known, within 2 e.
inline void check(call_name const& call, std::string_view what, std::size_t i, double got, ball want) {
  if (std::isnan(want.v)) {
    require_near(call, what, i, got, want.v, 0);
    return;
  }
  if (!known(want)) return;
  require_near(call, what, i, got, want.v, 2 * want.e + 0x1p-60);
}

template <class T>
void check_all(call_name const& call, std::string_view what, guarded<T> const& got, std::vector<ball> const& want) {
  got.require_guards_intact(call, what);
  if (got.size() != want.size()) fail(call.str() + ": " + std::string(what) + " reference size mismatch (harness)");
  for (std::size_t i = 0; i < want.size(); ++i) check(call, what, i, mpx::detail::to_double(got.data()[i]), want[i]);
}

template <class T>
std::vector<ball> exact_balls(guarded<T> const& g) {
  std::vector<ball> out(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) out[i] = {mpx::detail::to_double(g.data()[i]), 0};
  return out;
}

//! C [M, N] = alpha op(A) op(B), float sums; A [M, K] (or [K, M] transposed), B [K, N]
//! (or [N, K]).
inline std::vector<ball> product(std::vector<ball> const& a, std::vector<ball> const& b, std::size_t M, std::size_t K,
                                 std::size_t N, bool ta = false, bool tb = false, double alpha = 1) {
  std::vector<ball> c(M * N), terms(K);
  for (std::size_t m = 0; m < M; ++m)
    for (std::size_t n = 0; n < N; ++n) {
      for (std::size_t k = 0; k < K; ++k)
        terms[k] = exact_product(ta ? a[k * M + m] : a[m * K + k], tb ? b[n * K + k] : b[k * N + n]);
      c[m * N + n] = float_sum(terms);
      if (alpha != 1) c[m * N + n] = c[m * N + n] * ball{alpha, 0};
    }
  return c;
}

template <class S>
std::vector<ball> stored(std::vector<ball> v) {
  for (auto& x : v) x = store<S>(x);
  return v;
}

//! The softmax of one row of logits in float (mpx::causal_softmax's row): NaN for every
//! entry when a logit is NaN or +inf, or when every logit is -inf.
inline std::vector<ball> softmax_row(std::vector<ball> const& x) {
  double m = -inf;
  bool nan = false, unknown = false;
  double spread = 0;
  for (ball const& b : x) {
    nan = nan || std::isnan(b.v);
    m = std::max(m, b.v);
    if (!known(b)) unknown = true;
    else if (std::isfinite(b.v)) spread = std::max(spread, b.e);
  }
  std::vector<ball> p(x.size());
  double s = 0;
  for (ball const& b : x) s += std::exp(b.v - m);
  for (std::size_t j = 0; j < x.size(); ++j) {
    double const v = nan ? NAN : std::exp(x[j].v - m) / s;
    if (std::isnan(v)) p[j] = {v, 0};
    else if (unknown) p[j] = {v, inf};
    else if (std::isinf(x[j].v)) p[j] = {v, 0};  // -inf: exactly 0
    else p[j] = {v, std::min(v * std::expm1(2 * spread), 1.0) + (4.0 * static_cast<double>(x.size()) + 8) * uf};
  }
  return p;
}

template <class T>
std::string dtype_text() {
  return std::string(mpx::dtype_name<T>);
}

template <class S>
constexpr char const* policy_text() {
  if constexpr (std::is_same_v<S, float>) return "float32";
  else if constexpr (std::is_same_v<S, mpx::half>) return "mixed_float16";
  else return "mixed_bfloat16";
}
template <class S>
using policy_of = std::conditional_t<std::is_same_v<S, float>, mpx::float32,
                                     std::conditional_t<std::is_same_v<S, mpx::half>, mpx::mixed_float16, mpx::mixed_bfloat16>>;

//! Calls f with a std::type_identity of half, bfloat16 or float.
template <class F>
void with_storage(draw& d, F&& f) {
  switch (d.below(3)) {
    case 0: f(std::type_identity<float>{}); break;
    case 1: f(std::type_identity<mpx::half>{}); break;
    default: f(std::type_identity<mpx::bfloat16>{}); break;
  }
}

//! n values for a tensor of T, moderate ones scaled by `scale` (weights), hostile ones
//! where `hostile`.
template <class T>
std::vector<T> scaled_values(draw& d, std::size_t n, bool hostile, double scale) {
  std::vector<T> v(n);
  for (auto& x : v) {
    T const y = d.value<T>(hostile);
    double const w = mpx::detail::to_double(y);
    x = std::isfinite(w) && std::fabs(w) <= 64 && scale != 1 ? mpx::cast<T>(w * scale) : y;
  }
  return v;
}

inline std::int64_t i64(std::size_t v) { return static_cast<std::int64_t>(v); }
inline std::size_t uz(std::int64_t v) { return static_cast<std::size_t>(v); }

// ---- permute_heads: an exact copy between the tokens and heads layouts ----

template <class T>
void run_permute_heads(draw& d) {
  mpx::host_executor exec;
  auto const e = d.extents(4, 9, max_elements / 3);
  mpx::attention_dims dims{e[0], e[1], e[2], e[3]};
  std::int64_t const parts = d.coin() ? 3 : 1;
  bool const to_heads = d.coin();
  std::int64_t const total = parts * dims.rows() * dims.width();
  std::uint8_t const invalid = d.byte() % 8;  // 0: tokens one short, 1: heads one long, 2: overlapping
  std::int64_t const tok_n = invalid == 0 ? total - 1 : total;
  std::int64_t const head_n = invalid == 1 ? total + 1 : total;
  call_name call("permute_heads");
  call << " " << shape_text<T>({tok_n}) << " <-> " << shape_text<T>({head_n}) << " dims [" << dims.batch << ","
       << dims.tokens << "," << dims.heads << "," << dims.head_width << "] parts " << parts
       << (to_heads ? " to heads" : " to tokens");
  if (invalid == 0 && tok_n >= 0) {
    guarded<T> tokens(exec, {tok_n}, d), heads(exec, {head_n}, d);
    require_refusal(call, {"permute_heads", "tokens"}, [&] { mpx::permute_heads(exec, tokens.view(), heads.view(), dims, parts, to_heads); });
    return;
  }
  if (invalid == 1) {
    guarded<T> tokens(exec, {tok_n}, d), heads(exec, {head_n}, d);
    require_refusal(call, {"permute_heads", "heads"}, [&] { mpx::permute_heads(exec, tokens.view(), heads.view(), dims, parts, to_heads); });
    return;
  }
  if (invalid == 2 && total > 1) {  // one buffer for both, the second shifted: a partial overlap
    std::int64_t const shift = 1 + static_cast<std::int64_t>(d.below(uz(total - 1)));
    guarded<T> both(exec, {total + shift}, d);
    call << " overlapping by " << total - shift;
    mpx::tensor_view<T> a(both.data(), mpx::shape{total}), b(both.data() + shift, mpx::shape{total});
    require_refusal(call, {"permute_heads", "overlap"}, [&] { mpx::permute_heads(exec, a, b, dims, parts, to_heads); });
    return;
  }
  guarded<T> tokens(exec, {total}, d), heads(exec, {total}, d);
  guarded<T>& from = to_heads ? tokens : heads;
  from.assign(d.values<T>(uz(total), true));
  require_accepted(call, [&] { mpx::permute_heads(exec, tokens.view(), heads.view(), dims, parts, to_heads); });
  tokens.require_guards_intact(call, "tokens");
  heads.require_guards_intact(call, "heads");
  // heads [parts, B, H, T, dh] against tokens [B, T, parts, H, dh], written out directly.
  std::int64_t const W = dims.width();
  std::vector<T> got(uz(total)), want(uz(total));
  std::size_t e_index = 0;
  for (std::int64_t p = 0; p < parts; ++p)
    for (std::int64_t b = 0; b < dims.batch; ++b)
      for (std::int64_t h = 0; h < dims.heads; ++h)
        for (std::int64_t t = 0; t < dims.tokens; ++t)
          for (std::int64_t j = 0; j < dims.head_width; ++j, ++e_index) {
            std::size_t const ti = uz(((b * dims.tokens + t) * parts + p) * W + h * dims.head_width + j);
            got[e_index] = to_heads ? heads.data()[e_index] : tokens.data()[ti];
            want[e_index] = to_heads ? tokens.data()[ti] : heads.data()[e_index];
          }
  require_same<T>(call, to_heads ? "heads" : "tokens", got, want);
}

// ---- causal_softmax and its backward ----

template <class S, class P>
void run_causal_softmax(draw& d) {
  mpx::host_executor exec;
  auto const e = d.extents(3, 33, max_elements / 64);
  mpx::attention_dims dims{e[0], e[1], e[2], 1};
  std::int64_t const rows = dims.batch * dims.heads * dims.tokens, total = rows * dims.tokens;
  if (total > max_elements) return;
  bool const hostile = d.coin();
  bool const with_lengths = d.coin();
  std::vector<std::int32_t> lengths(uz(dims.batch));
  for (auto& l : lengths) l = static_cast<std::int32_t>(d.below(uz(dims.tokens + 3))) - 1;  // -1 .. T + 1
  std::uint8_t const invalid = d.byte() % 8;  // 0: logits short, 1: p long, 2: p_store short, 3: p_store overlaps logits
  call_name call("causal_softmax");
  call << " logits " << shape_text<S>({rows, dims.tokens}) << " -> float, " << dtype_text<P>() << " dims ["
       << dims.batch << "," << dims.tokens << "," << dims.heads << "]" << (with_lengths ? " lengths" : "")
       << (hostile ? " hostile" : "");
  if (invalid <= 2 && total > 0) {
    call << " (argument " << int(invalid) << " the wrong size)";
    guarded<S> logits(exec, {total - (invalid == 0)}, d);
    guarded<float> p(exec, {total + (invalid == 1)}, d);
    guarded<P> ps(exec, {total - (invalid == 2)}, d);
    std::string_view const name = invalid == 0 ? "logits" : "probabilities";
    require_refusal(call, {"causal_softmax", name},
                    [&] { mpx::causal_softmax(exec, logits.cview(), p.view(), ps.view(), dims, with_lengths ? lengths.data() : nullptr); });
    return;
  }
  guarded<S> logits(exec, {total}, d);
  logits.assign(d.values<S>(uz(total), hostile));
  if (invalid == 3 && total > 1 && sizeof(S) == sizeof(P)) {  // p_store starting inside the logits
    std::int64_t const shift = 1 + static_cast<std::int64_t>(d.below(uz(total - 1)));
    guarded<S> both(exec, {total + shift}, d);
    mpx::tensor_view<S const> l(both.data(), mpx::shape{total});
    mpx::tensor_view<P> ps(reinterpret_cast<P*>(both.data() + shift), mpx::shape{total});
    guarded<float> p(exec, {total}, d);
    call << " p_store overlapping the logits by " << total - shift;
    require_refusal(call, {"causal_softmax", "overlap"}, [&] { mpx::causal_softmax(exec, l, p.view(), ps, dims); });
    return;
  }
  bool const in_place = invalid == 4 && std::is_same_v<S, P>;  // p_store over the logits, element for element
  guarded<float> p(exec, {total}, d);
  guarded<P> ps_own(exec, {total}, d);
  if (in_place) call << " p_store in place";
  mpx::tensor_view<P> ps = in_place ? mpx::tensor_view<P>(reinterpret_cast<P*>(logits.data()), mpx::shape{total}) : ps_own.view();
  auto const in = exact_balls(logits);
  require_accepted(call, [&] { mpx::causal_softmax(exec, logits.cview(), p.view(), ps, dims, with_lengths ? lengths.data() : nullptr); });
  std::vector<ball> want(uz(total)), want_store(uz(total));
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t const i = r % dims.tokens, b = r / dims.tokens / dims.heads;
    std::int64_t const length = with_lengths ? lengths[uz(b)] : dims.tokens;
    std::int64_t const valid = std::max<std::int64_t>(0, std::min(i + 1, length));
    std::vector<ball> const x(in.begin() + r * dims.tokens, in.begin() + r * dims.tokens + valid);
    auto const row = valid > 0 ? softmax_row(x) : std::vector<ball>{};
    for (std::int64_t j = 0; j < dims.tokens; ++j) {
      ball const w = j < valid ? row[uz(j)] : ball{0, 0};  // masked: exactly 0
      want[uz(r * dims.tokens + j)] = w;
      want_store[uz(r * dims.tokens + j)] = store<P>(w);
    }
  }
  check_all(call, "p", p, want);
  if (in_place) {
    logits.require_guards_intact(call, "p_store (in place)");
    for (std::size_t k = 0; k < want.size(); ++k) check(call, "p_store", k, mpx::detail::to_double(ps.data()[k]), want_store[k]);
  } else {
    check_all(call, "p_store", ps_own, want_store);
    logits.require_guards_intact(call, "logits");
  }
}

template <class G>
void run_causal_softmax_backward(draw& d) {
  mpx::host_executor exec;
  auto const e = d.extents(3, 33, max_elements / 64);
  mpx::attention_dims dims{e[0], e[1], e[2], 1};
  std::int64_t const rows = dims.batch * dims.heads * dims.tokens, total = rows * dims.tokens;
  if (total > max_elements) return;
  bool const hostile = d.coin();
  float const scale = d.pick({1.0f, 0.5f, 0.125f, 0.35355339f, 2.0f});
  std::uint8_t const invalid = d.byte() % 8;  // 0: p short, 1: dp long, 2: ds short, 3: ds overlapping dp, 4: in place
  call_name call("causal_softmax_backward");
  call << " p, dp float[" << rows << "," << dims.tokens << "] -> ds " << dtype_text<G>() << " scale " << scale
       << (hostile ? " hostile" : "");
  if (invalid <= 2 && total > 0) {
    guarded<float> p(exec, {total - (invalid == 0)}, d), dp(exec, {total + (invalid == 1)}, d);
    guarded<G> ds(exec, {total - (invalid == 2)}, d);
    std::string_view const name = invalid == 0 ? "p " : invalid == 1 ? "dp " : "ds ";
    call << " (" << name << "the wrong size)";
    require_refusal(call, {"causal_softmax_backward", name},
                    [&] { mpx::causal_softmax_backward(exec, p.cview(), dp.cview(), ds.view(), dims, scale); });
    return;
  }
  guarded<float> p(exec, {total}, d), dp(exec, {total + total}, d);
  p.assign(d.values<float>(uz(total), hostile));
  dp.assign(d.values<float>(uz(total), hostile));
  mpx::tensor_view<float const> dpv(dp.data(), mpx::shape{total});
  if (invalid == 3 && std::is_same_v<G, float> && total > 1) {  // ds starting inside dp
    std::int64_t const shift = 1 + static_cast<std::int64_t>(d.below(uz(total - 1)));
    mpx::tensor_view<G> ds(reinterpret_cast<G*>(dp.data() + shift), mpx::shape{total});
    call << " ds overlapping dp by " << total - shift;
    require_refusal(call, {"causal_softmax_backward", "overlap"},
                    [&] { mpx::causal_softmax_backward(exec, p.cview(), dpv, ds, dims, scale); });
    return;
  }
  bool const in_place = invalid == 4 && std::is_same_v<G, float>;  // ds over dp, element for element
  if (in_place) call << " ds in place over dp";
  guarded<G> ds_own(exec, {total}, d);
  mpx::tensor_view<G> ds = in_place ? mpx::tensor_view<G>(reinterpret_cast<G*>(dp.data()), mpx::shape{total}) : ds_own.view();
  auto const pb = exact_balls(p);
  std::vector<ball> dpb(uz(total));
  for (std::size_t i = 0; i < dpb.size(); ++i) dpb[i] = {dp.data()[i], 0};
  require_accepted(call, [&] { mpx::causal_softmax_backward(exec, p.cview(), dpv, ds, dims, scale); });
  std::vector<ball> want(uz(total)), terms(uz(dims.tokens));
  for (std::int64_t r = 0; r < rows; ++r) {
    std::size_t const at = uz(r * dims.tokens);
    for (std::size_t j = 0; j < terms.size(); ++j) terms[j] = pb[at + j] * dpb[at + j];
    ball const dot = float_sum(terms);
    for (std::size_t j = 0; j < terms.size(); ++j)
      want[at + j] = store<G>((ball{scale, 0} * pb[at + j]) * (dpb[at + j] - dot));
  }
  if (in_place) {
    dp.require_guards_intact(call, "ds (in place)");
    for (std::size_t k = 0; k < want.size(); ++k) check(call, "ds", k, mpx::detail::to_double(ds.data()[k]), want[k]);
  } else {
    check_all(call, "ds", ds_own, want);
    dp.require_guards_intact(call, "dp");
  }
  p.require_guards_intact(call, "p");
}

// ---- the causal_self_attention layer ----

//! The layer in float64 balls: forward y and the gradients of x and of the four
//! parameters, with every store to S that the layer makes (docs/transformers.md's table).
template <class S>
struct attention_reference {
  std::size_t B, T, D, H;
  bool scale_logits;
  std::vector<ball> wqkv, bqkv, wo, bo;
  std::vector<ball> y, dx, dwqkv, dbqkv, dwo, dbo;

  static std::vector<ball> column_sums(std::vector<ball> const& m, std::size_t rows, std::size_t cols) {
    std::vector<ball> out(cols), terms(rows);
    for (std::size_t c = 0; c < cols; ++c) {
      for (std::size_t r = 0; r < rows; ++r) terms[r] = m[r * cols + c];
      out[c] = store<S>(float_sum(terms));
    }
    return out;
  }

  void run(std::vector<ball> const& x, std::vector<ball> const* dy) {
    std::size_t const N = B * T, dh = D / H;
    double const alpha = scale_logits ? static_cast<double>(1.0f / std::sqrt(static_cast<float>(dh))) : 1.0;
    // qkv = x W + b: the product stored, the bias added in float, stored again.
    auto qkv = stored<S>(product(x, wqkv, N, D, 3 * D));
    for (std::size_t i = 0; i < qkv.size(); ++i) qkv[i] = store<S>(qkv[i] + bqkv[i % (3 * D)]);
    auto at = [&](std::vector<ball> const& m, std::size_t part, std::size_t b, std::size_t t, std::size_t h,
                  std::size_t j) -> ball const& { return m[(b * T + t) * 3 * D + part * D + h * dh + j]; };
    std::vector<ball> p(B * H * T * T, ball{0, 0}), pst(B * H * T * T, ball{0, 0}), o(N * D);
    std::vector<ball> terms;
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h)
        for (std::size_t i = 0; i < T; ++i) {
          // The logits of every key (the product computes the masked ones too: a NaN or
          // inf there is masked, not propagated).
          std::vector<ball> logits(i + 1);
          for (std::size_t j = 0; j <= i; ++j) {
            terms.resize(dh);
            for (std::size_t c = 0; c < dh; ++c) terms[c] = exact_product(at(qkv, 0, b, i, h, c), at(qkv, 1, b, j, h, c));
            ball l = float_sum(terms);
            if (alpha != 1) l = l * ball{alpha, 0};
            logits[j] = store<S>(l);
          }
          auto const row = softmax_row(logits);
          for (std::size_t j = 0; j <= i; ++j) {
            p[((b * H + h) * T + i) * T + j] = row[j];
            pst[((b * H + h) * T + i) * T + j] = store<S>(row[j]);
          }
          for (std::size_t c = 0; c < dh; ++c) {
            terms.resize(T);  // o = p_store v over every key, the masked ones 0
            for (std::size_t j = 0; j < T; ++j) terms[j] = exact_product(pst[((b * H + h) * T + i) * T + j], at(qkv, 2, b, j, h, c));
            o[(b * T + i) * D + h * dh + c] = store<S>(float_sum(terms));
          }
        }
    y = stored<S>(product(o, wo, N, D, D));
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = store<S>(y[i] + bo[i % D]);
    if (!dy) return;
    // The output projection's backward pass.
    dwo = stored<S>(product(o, *dy, D, N, D, true));
    dbo = column_sums(*dy, N, D);
    auto const dout = stored<S>(product(*dy, wo, N, D, D, false, true));
    std::vector<ball> dqkv(N * 3 * D);
    auto dat = [&](std::size_t part, std::size_t b, std::size_t t, std::size_t h, std::size_t j) -> ball& {
      return dqkv[(b * T + t) * 3 * D + part * D + h * dh + j];
    };
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h) {
        auto pr = [&](std::size_t i, std::size_t j) -> ball const& { return p[((b * H + h) * T + i) * T + j]; };
        auto ps = [&](std::size_t i, std::size_t j) -> ball const& { return pst[((b * H + h) * T + i) * T + j]; };
        auto dO = [&](std::size_t i, std::size_t c) -> ball const& { return dout[(b * T + i) * D + h * dh + c]; };
        // dV = P_store^T dO
        terms.resize(T);
        for (std::size_t j = 0; j < T; ++j)
          for (std::size_t c = 0; c < dh; ++c) {
            for (std::size_t i = 0; i < T; ++i) terms[i] = exact_product(ps(i, j), dO(i, c));
            dat(2, b, j, h, c) = store<S>(float_sum(terms));
          }
        // dP = dO V^T (float), dS = scale p (dP - sum p dP), stored.
        std::vector<ball> ds(T * T);
        for (std::size_t i = 0; i < T; ++i) {
          std::vector<ball> dp(T);
          terms.resize(dh);
          for (std::size_t j = 0; j < T; ++j) {
            for (std::size_t c = 0; c < dh; ++c) terms[c] = exact_product(dO(i, c), at(qkv, 2, b, j, h, c));
            dp[j] = float_sum(terms);
          }
          std::vector<ball> pd(T);
          for (std::size_t j = 0; j < T; ++j) pd[j] = pr(i, j) * dp[j];
          ball const dot = float_sum(pd);
          for (std::size_t j = 0; j < T; ++j) ds[i * T + j] = store<S>((ball{alpha, 0} * pr(i, j)) * (dp[j] - dot));
        }
        // dQ = dS K, dK = dS^T Q
        terms.resize(T);
        for (std::size_t i = 0; i < T; ++i)
          for (std::size_t c = 0; c < dh; ++c) {
            for (std::size_t j = 0; j < T; ++j) terms[j] = exact_product(ds[i * T + j], at(qkv, 1, b, j, h, c));
            dat(0, b, i, h, c) = store<S>(float_sum(terms));
            for (std::size_t j = 0; j < T; ++j) terms[j] = exact_product(ds[j * T + i], at(qkv, 0, b, j, h, c));
            dat(1, b, i, h, c) = store<S>(float_sum(terms));
          }
      }
    dwqkv = stored<S>(product(x, dqkv, D, N, 3 * D, true));
    dbqkv = column_sums(dqkv, N, 3 * D);
    dx = stored<S>(product(dqkv, wqkv, N, 3 * D, D, false, true));
  }
};

template <class S>
void run_attention_layer(draw& d) {
  using P = policy_of<S>;
  mpx::host_executor exec;
  std::int64_t const heads = d.pick<std::int64_t>({1, 2, 3, 4, 1, 2});
  std::int64_t const head_width = d.pick<std::int64_t>({1, 2, 3, 4, 5, 8});
  std::int64_t const B = d.pick<std::int64_t>({1, 2, 3, 1});
  std::int64_t const T = std::min<std::int64_t>(d.extent(17), 17);
  std::int64_t const D = heads * head_width;
  bool const scale_logits = !(d.byte() % 4 == 0);
  bool const backward = d.coin();
  bool const hostile = d.byte() % 4 == 0;
  std::uint8_t const invalid = d.byte() % 12;
  call_name call("causal_self_attention<");
  call << policy_text<S>() << ">(" << heads << (scale_logits ? "" : ", unscaled") << ") x " << shape_text<S>({B, T, D})
       << (backward ? " forward+backward" : " forward") << (hostile ? " hostile" : "");
  if (invalid == 0) {
    call << " heads 0 or negative";
    require_refusal(call, {"causal_self_attention", "heads"},
                    [&] { mpx::causal_self_attention<P> layer(d.pick<std::int64_t>({0, -1, -3})); });
    return;
  }
  if (invalid == 1 && heads > 1) {  // a width the heads do not divide
    std::int64_t const width = D + 1;
    call << " built for width " << width;
    mpx::causal_self_attention<P> layer(heads);
    layer.set_name("attention");
    require_refusal(call, {"attention", "heads", "[" + std::to_string(T) + ", " + std::to_string(width) + "]"},
                    [&] { layer.build(exec, mpx::shape{T, width}, 1); });
    return;
  }
  if (invalid == 2) {  // width 0
    call << " built for width 0";
    mpx::causal_self_attention<P> layer(heads);
    layer.set_name("attention");
    require_refusal(call, {"attention", "width"}, [&] { layer.build(exec, mpx::shape{T, 0}, 1); });
    return;
  }
  mpx::causal_self_attention<P> layer(heads, scale_logits);
  layer.set_name("attention");
  if (T == 0) {  // no tokens: refused when built (the projections could not run)
    require_refusal(call, {"attention", "[tokens, width]"}, [&] { layer.build(exec, mpx::shape{T, D}, 7); });
    return;
  }
  require_accepted(call, [&] { layer.build(exec, mpx::shape{T, D}, 7); });
  if (invalid == 3 || invalid == 4 || invalid == 5) {  // another sequence length, an empty batch, another output
    std::int64_t const xt = invalid == 3 ? T + 1 + static_cast<std::int64_t>(d.below(3)) : T;
    std::int64_t const xb = invalid == 4 ? 0 : B;
    std::int64_t const yt = invalid == 5 ? T + 1 : T;
    guarded<S> x(exec, {xb, xt, D}, d), y(exec, {B, yt, D}, d);
    call << " given x " << shape_text<S>({xb, xt, D}) << ", y " << shape_text<S>({B, yt, D});
    require_refusal(call, {"attention", invalid == 5 ? "output" : "input"},
                    [&] { layer.forward(exec, x.cview(), y.view(), false); });
    return;
  }
  std::vector<mpx::parameter<host_space>> params;
  layer.template append_parameters<host_space>(params);
  if (params.size() != 4) fail(call.str() + ": " + std::to_string(params.size()) + " parameters, 4 due");
  // Parameters with a spread of moderate values (scaled to keep the logits in range, as
  // trained weights are), biases included.
  double const wscale = 1.0 / (8.0 * std::sqrt(static_cast<double>(std::max<std::int64_t>(D, 1))));
  std::vector<std::vector<ball>> pb(4);
  for (std::size_t i = 0; i < 4; ++i) {
    auto v = params[i].value.template as<S>();
    auto const values = scaled_values<S>(d, v.size(), false, i % 2 ? 1.0 / 16 : wscale);
    std::copy(values.begin(), values.end(), v.data());
    pb[i].resize(v.size());
    for (std::size_t k = 0; k < v.size(); ++k) pb[i][k] = {mpx::detail::to_double(v.data()[k]), 0};
  }
  std::size_t const n = uz(B * T * D);
  guarded<S> x(exec, {B, T, D}, d), y(exec, {B, T, D}, d), dy(exec, {B, T, D}, d), dx(exec, {B, T, D}, d);
  x.assign(scaled_values<S>(d, n, hostile, 1.0 / 8));
  dy.assign(scaled_values<S>(d, n, false, 1.0 / 8));
  attention_reference<S> ref{uz(B), uz(T), uz(D), uz(heads), scale_logits, pb[0], pb[1], pb[2], pb[3], {}, {}, {}, {}, {}, {}};
  auto const dyb = exact_balls(dy);
  ref.run(exact_balls(x), backward ? &dyb : nullptr);
  require_accepted(call, [&] { layer.forward(exec, x.cview(), y.view(), true); });
  check_all(call, "y", y, ref.y);
  if (!backward) return;
  for (auto& p : params) {
    auto g = p.gradient.template as<S>();
    std::fill_n(g.data(), g.size(), poison<S>());
  }
  require_accepted(call, [&] { layer.backward(exec, x.cview(), y.cview(), dy.cview(), dx.view()); });
  check_all(call, "dx", dx, ref.dx);
  std::vector<ball> const* want[] = {&ref.dwqkv, &ref.dbqkv, &ref.dwo, &ref.dbo};
  for (std::size_t i = 0; i < 4; ++i) {
    auto g = params[i].gradient.template as<S>();
    for (std::size_t k = 0; k < g.size(); ++k) check(call, params[i].name, k, mpx::detail::to_double(g.data()[k]), (*want[i])[k]);
  }
  x.require_guards_intact(call, "x");
  dy.require_guards_intact(call, "dy");
}

// ---- the LSTM ----

struct lstm_dims {
  std::size_t n, t, f, u;
};

struct lstm_result {
  std::vector<ball> h;  // [N, T, U], the user's layout
  std::vector<ball> dx, dw, dr, db;
};

//! One LSTM cell stepped over time in float64 balls (docs/lstm.md: gate order i, f, c, o;
//! c_t = sigmoid(z_f) c_{t-1} + sigmoid(z_i) tanh(z_c), h_t = sigmoid(z_o) tanh(c_t)
//! stored to S), and its backpropagation through time as lstm_backward computes it.
template <class S>
lstm_result lstm_reference(lstm_dims dm, std::vector<ball> const& x, std::vector<ball> const& w,
                           std::vector<ball> const& r, std::vector<ball> const& b, std::vector<ball> const& h0,
                           std::vector<ball> const& c0, std::vector<ball> const* dh_in,
                           std::vector<ball> const* old_dw, std::vector<ball> const* old_dr,
                           std::vector<ball> const* old_db) {
  auto const [N, T, F, U] = dm;
  std::vector<ball> z(T * N * 4 * U), c((T + 1) * N * U), h((T + 1) * N * U), terms;
  std::copy(c0.begin(), c0.end(), c.begin());
  std::copy(h0.begin(), h0.end(), h.begin());
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t n = 0; n < N; ++n) {
      ball* zt = z.data() + (t * N + n) * 4 * U;
      ball const* hp = h.data() + (t * N + n) * U;
      ball const* cp = c.data() + (t * N + n) * U;
      for (std::size_t col = 0; col < 4 * U; ++col) {
        // x W (one float sum), then h R added onto it (another), then the bias.
        terms.resize(F);
        for (std::size_t f = 0; f < F; ++f) terms[f] = exact_product(x[(n * T + t) * F + f], w[f * 4 * U + col]);
        ball const xw = float_sum(terms);
        terms.resize(U);
        for (std::size_t k = 0; k < U; ++k) terms[k] = exact_product(hp[k], r[k * 4 * U + col]);
        terms.push_back(xw);
        zt[col] = float_sum(terms) + b[col];
      }
      for (std::size_t j = 0; j < U; ++j) {
        ball const ct = sig(zt[U + j]) * cp[j] + sig(zt[j]) * tnh(zt[2 * U + j]);
        c[((t + 1) * N + n) * U + j] = ct;
        h[((t + 1) * N + n) * U + j] = store<S>(sig(zt[3 * U + j]) * tnh(ct));
      }
    }
  lstm_result out;
  out.h.resize(N * T * U);
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t j = 0; j < U; ++j) out.h[(n * T + t) * U + j] = h[((t + 1) * N + n) * U + j];
  if (!dh_in) return out;

  std::vector<ball> dz(T * N * 4 * U), dh_rec(N * U), dc(N * U);
  for (std::size_t t = T; t-- > 0;) {
    bool const last = t + 1 == T;
    for (std::size_t n = 0; n < N; ++n)
      for (std::size_t j = 0; j < U; ++j) {
        ball const* zt = z.data() + (t * N + n) * 4 * U;
        ball* d = dz.data() + (t * N + n) * 4 * U;
        std::size_t const k = n * U + j;
        ball const ct = c[(t + 1) * N * U + k], cp = c[t * N * U + k];
        ball const dh = last ? (*dh_in)[(n * T + t) * U + j] : (*dh_in)[(n * T + t) * U + j] + dh_rec[k];
        ball const dct0 = dh * sig(zt[3 * U + j]) * dtnh(ct);
        ball const dct = last ? dct0 : dc[k] + dct0;
        d[j] = store<S>(dct * tnh(zt[2 * U + j]) * dsig(zt[j]));
        d[U + j] = store<S>(dct * cp * dsig(zt[U + j]));
        d[2 * U + j] = store<S>(dct * sig(zt[j]) * dtnh(zt[2 * U + j]));
        d[3 * U + j] = store<S>(dh * tnh(ct) * dsig(zt[3 * U + j]));
        dc[k] = dct * sig(zt[U + j]);
      }
    if (t == 0) break;
    terms.resize(4 * U);
    for (std::size_t n = 0; n < N; ++n)
      for (std::size_t k = 0; k < U; ++k) {
        for (std::size_t col = 0; col < 4 * U; ++col) terms[col] = exact_product(dz[(t * N + n) * 4 * U + col], r[k * 4 * U + col]);
        dh_rec[n * U + k] = float_sum(terms);
      }
  }
  out.dx.resize(N * T * F);
  terms.resize(4 * U);
  for (std::size_t n = 0; n < N; ++n)
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t f = 0; f < F; ++f) {
        for (std::size_t col = 0; col < 4 * U; ++col) terms[col] = exact_product(dz[(t * N + n) * 4 * U + col], w[f * 4 * U + col]);
        out.dx[(n * T + t) * F + f] = store<S>(float_sum(terms));
      }
  // With accumulate, the kernel and recurrent kernel gradients are products with beta = 1:
  // a BLAS may start its sum from the old value, so the old value is one more term of the
  // float sum (its magnitude enters the bound even where the result cancels it). The bias
  // gradient is summed apart and added once.
  auto const over_steps = [&](auto const& operand, std::size_t col, ball const* old) {
    terms.resize(T * N);
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t n = 0; n < N; ++n) terms[t * N + n] = exact_product(operand(t, n), dz[(t * N + n) * 4 * U + col]);
    if (old) terms.push_back(*old);
    return float_sum(terms);
  };
  out.dw.resize(F * 4 * U);
  out.dr.resize(U * 4 * U);
  out.db.resize(4 * U);
  for (std::size_t col = 0; col < 4 * U; ++col) {
    for (std::size_t f = 0; f < F; ++f)
      out.dw[f * 4 * U + col] = over_steps([&](std::size_t t, std::size_t n) { return x[(n * T + t) * F + f]; }, col,
                                           old_dw ? &(*old_dw)[f * 4 * U + col] : nullptr);
    for (std::size_t k = 0; k < U; ++k)
      out.dr[k * 4 * U + col] = over_steps([&](std::size_t t, std::size_t n) { return h[(t * N + n) * U + k]; }, col,
                                           old_dr ? &(*old_dr)[k * 4 * U + col] : nullptr);
    ball const g = over_steps([](std::size_t, std::size_t) { return ball{1, 0}; }, col, nullptr);
    out.db[col] = old_db ? (*old_db)[col] + g : g;
  }
  return out;
}

template <class S, class Bias, class DH>
void run_lstm_kernel(draw& d) {
  using P = policy_of<S>;
  mpx::host_executor exec;
  std::int64_t const N = std::min<std::int64_t>(d.extent(7), 7), T = std::min<std::int64_t>(d.extent(13), 13);
  std::int64_t const F = std::min<std::int64_t>(d.extent(9), 9), U = std::min<std::int64_t>(d.extent(9), 9);
  bool const initial_state = d.coin();
  bool const backward = d.coin();
  bool const accumulate = backward && d.coin();
  bool const hostile = d.byte() % 4 == 0;
  std::uint8_t const invalid = d.byte() % 16;
  call_name call(backward ? "lstm_forward+lstm_backward<" : "lstm_forward<");
  call << policy_text<S>() << "> x " << shape_text<S>({N, T, F}) << " U " << U << " bias " << dtype_text<Bias>()
       << " dh " << dtype_text<DH>() << (initial_state ? " h0,c0" : "") << (accumulate ? " accumulate" : "")
       << (hostile ? " hostile" : "");
  std::size_t const needed = mpx::lstm_workspace_elements<P>(N, T, F, U);
  // Shapes, each one wrong when the case says so.
  std::int64_t const wf = invalid == 1 ? F + 1 : F, hu = invalid == 4 ? U + 1 : U, bu = invalid == 3 ? 4 * U + 1 : 4 * U;
  std::vector<std::int64_t> const r_shape = invalid == 2 ? std::vector<std::int64_t>{U, 4 * U + 4} : std::vector<std::int64_t>{U, 4 * U};
  std::int64_t const ws_n = invalid == 5 && needed > 0 ? i64(needed) - 1 : i64(needed) + static_cast<std::int64_t>(d.below(3));
  std::int64_t const h0n = invalid == 6 && initial_state ? N + 1 : N, c0u = invalid == 7 && initial_state ? U + 1 : U;
  guarded<S> x(exec, {N, T, F}, d), w(exec, {wf, 4 * U}, d), r(exec, r_shape, d), h(exec, {N, T, hu}, d);
  guarded<Bias> b(exec, {bu}, d);
  guarded<S> h0(exec, {h0n, U}, d);
  guarded<float> c0(exec, {N, c0u}, d), ws(exec, {ws_n}, d);
  auto const forward = [&] {
    if (initial_state)
      mpx::lstm_forward<P>(exec, x.cview(), w.cview(), r.cview(), b.cview(), h0.cview(), c0.cview(), h.view(), ws.view());
    else
      mpx::lstm_forward<P>(exec, x.cview(), w.cview(), r.cview(), b.cview(), h.view(), ws.view());
  };
  if (invalid >= 1 && invalid <= 7 && !(invalid == 5 && needed == 0) && !(invalid >= 6 && !initial_state)) {
    static constexpr std::string_view names[] = {"", "kernel", "recurrent_kernel", "bias", "h ", "workspace", "h0", "c0"};
    call << " (" << names[invalid] << " the wrong shape)";
    require_refusal(call, {"lstm_forward", names[invalid]}, forward);
    return;
  }
  x.assign(d.values<S>(x.size(), hostile));
  double const wscale = 1.0 / std::sqrt(static_cast<double>(std::max<std::int64_t>(F, 1))) / 16;
  w.assign(scaled_values<S>(d, w.size(), false, wscale));
  r.assign(scaled_values<S>(d, r.size(), false, 1.0 / (32.0 * static_cast<double>(std::max<std::int64_t>(U, 1)))));
  b.assign(scaled_values<Bias>(d, b.size(), false, 1.0 / 32));
  if (initial_state) {
    h0.assign(scaled_values<S>(d, h0.size(), false, 1.0 / 64));
    c0.assign(scaled_values<float>(d, c0.size(), hostile, 1.0 / 16));
  }
  require_accepted(call, forward);
  auto const zeros = [](std::size_t n) { return std::vector<ball>(n, ball{0, 0}); };
  lstm_dims const dm{uz(N), uz(T), uz(F), uz(U)};
  auto const xb = exact_balls(x), wb = exact_balls(w), rb = exact_balls(r), bb = exact_balls(b);
  auto const h0b = initial_state ? exact_balls(h0) : zeros(uz(N * U));
  auto const c0b = initial_state ? exact_balls(c0) : zeros(uz(N * U));
  if (!backward) {
    auto const ref = lstm_reference<S>(dm, xb, wb, rb, bb, h0b, c0b, nullptr, nullptr, nullptr, nullptr);
    check_all(call, "h", h, ref.h);
  } else {
    std::uint8_t const binvalid = d.byte() % 12;
    std::int64_t const dxf = binvalid == 1 ? F + 1 : F, dwf = binvalid == 2 ? F + 1 : F,
                       dru = binvalid == 3 ? U + 1 : U, dbu = binvalid == 4 ? 4 * U + 1 : 4 * U,
                       bws = binvalid == 5 && needed > 0 ? i64(needed) - 1 : ws_n;
    guarded<DH> dh(exec, {N, T, U}, d);
    guarded<S> dx(exec, {N, T, dxf}, d);
    guarded<float> dw(exec, {dwf, 4 * U}, d), dr(exec, {dru, 4 * U}, d), db(exec, {dbu}, d);
    mpx::tensor_view<float> wsv(ws.data(), mpx::shape{bws});
    auto const run_backward = [&] {
      mpx::lstm_backward<P>(exec, dh.cview(), w.cview(), r.cview(), dx.view(), dw.view(), dr.view(), db.view(), wsv,
                            mpx::lstm_backward_options{accumulate});
    };
    if (binvalid >= 1 && binvalid <= 5 && !(binvalid == 5 && needed == 0)) {
      static constexpr std::string_view names[] = {"", "dx", "dkernel", "drecurrent_kernel", "dbias", "workspace"};
      call << " (backward: " << names[binvalid] << " the wrong shape)";
      require_refusal(call, {"lstm_backward", names[binvalid]}, run_backward);
      return;
    }
    dh.assign(scaled_values<DH>(d, dh.size(), hostile, 1.0 / 4));
    if (accumulate) {
      dw.assign(scaled_values<float>(d, dw.size(), false, 1.0 / 8));
      dr.assign(scaled_values<float>(d, dr.size(), false, 1.0 / 8));
      db.assign(scaled_values<float>(d, db.size(), false, 1.0 / 8));
    }
    auto const old_dw = exact_balls(dw), old_dr = exact_balls(dr), old_db = exact_balls(db), dhb = exact_balls(dh);
    require_accepted(call, run_backward);
    auto const ref = lstm_reference<S>(dm, xb, wb, rb, bb, h0b, c0b, &dhb, accumulate ? &old_dw : nullptr,
                                       accumulate ? &old_dr : nullptr, accumulate ? &old_db : nullptr);
    check_all(call, "h", h, ref.h);
    check_all(call, "dx", dx, ref.dx);
    check_all(call, "dkernel", dw, ref.dw);
    check_all(call, "drecurrent_kernel", dr, ref.dr);
    check_all(call, "dbias", db, ref.db);
    dh.require_guards_intact(call, "dh");
  }
  x.require_guards_intact(call, "x");
  w.require_guards_intact(call, "kernel");
  r.require_guards_intact(call, "recurrent_kernel");
  b.require_guards_intact(call, "bias");
  ws.require_guards_intact(call, "workspace");
}

//! The lstm layer: what lstm_forward and lstm_backward give for its parameters, bit for
//! bit (the layer adds only the last-step selection and the gradient casts), and its
//! refusals.
template <class S>
void run_lstm_layer(draw& d) {
  using P = policy_of<S>;
  mpx::host_executor exec;
  std::int64_t const N = std::max<std::int64_t>(1, std::min<std::int64_t>(d.extent(5), 5));
  std::int64_t const T = std::min<std::int64_t>(d.extent(11), 11), F = std::min<std::int64_t>(d.extent(7), 7);
  std::int64_t const U = std::min<std::int64_t>(d.extent(7), 7);
  bool const sequences = d.coin();
  bool const hostile = d.byte() % 4 == 0;
  std::uint8_t const invalid = d.byte() % 10;
  call_name call("lstm<");
  call << policy_text<S>() << ">(" << U << (sequences ? ", return_sequences" : "") << ") x "
       << shape_text<S>({N, T, F}) << (hostile ? " hostile" : "");
  if (U <= 0 || invalid == 1) {
    std::int64_t const units = U <= 0 ? U : -1;
    call << " units " << units;
    require_refusal(call, {"lstm", "units"}, [&] { mpx::lstm<P> layer(units, sequences); });
    return;
  }
  mpx::lstm<P> layer(U, sequences);
  layer.set_name("lstm");
  if (T < 1 || F < 1) {
    require_refusal(call, {"lstm", "[steps, features]"}, [&] { layer.build(exec, mpx::shape{T, F}, 3); });
    return;
  }
  require_accepted(call, [&] { layer.build(exec, mpx::shape{T, F}, 3); });
  std::vector<std::int64_t> const y_shape = sequences ? std::vector<std::int64_t>{N, T, U} : std::vector<std::int64_t>{N, U};
  if (invalid == 2 || invalid == 3) {  // a longer sequence than built for, an empty batch
    std::int64_t const xt = invalid == 2 ? T + 1 : T, xn = invalid == 3 ? 0 : N;
    guarded<S> x(exec, {xn, xt, F}, d), y(exec, y_shape, d);
    call << " given x " << shape_text<S>({xn, xt, F});
    require_refusal(call, {"lstm", "input"}, [&] { layer.forward(exec, x.cview(), y.view(), true); });
    return;
  }
  std::vector<mpx::parameter<host_space>> params;
  layer.template append_parameters<host_space>(params);
  if (params.size() != 3) fail(call.str() + ": " + std::to_string(params.size()) + " parameters, 3 due");
  auto w = params[0].value.template as<S>();
  auto r = params[1].value.template as<S>();
  auto b = params[2].value.template as<float>();
  guarded<S> x(exec, {N, T, F}, d), y(exec, y_shape, d), dy(exec, y_shape, d), dx(exec, {N, T, F}, d);
  x.assign(d.values<S>(x.size(), hostile));
  dy.assign(scaled_values<S>(d, dy.size(), false, 1.0 / 4));
  require_accepted(call, [&] { layer.forward(exec, x.cview(), y.view(), true); });
  require_accepted(call, [&] { layer.backward(exec, x.cview(), y.cview(), dy.cview(), dx.view()); });
  // The same through the kernels.
  auto ws = mpx::make_tensor<float>(exec, mpx::shape{i64(mpx::lstm_workspace_elements<P>(N, T, F, U))});
  auto h = mpx::make_tensor<S>(exec, mpx::shape{N, T, U});
  auto dh = mpx::make_tensor<S>(exec, mpx::shape{N, T, U});
  auto kdx = mpx::make_tensor<S>(exec, mpx::shape{N, T, F});
  auto kdw = mpx::make_tensor<float>(exec, w.shape());
  auto kdr = mpx::make_tensor<float>(exec, r.shape());
  auto kdb = mpx::make_tensor<float>(exec, b.shape());
  mpx::lstm_forward<P>(exec, x.cview(), mpx::tensor_view<S const>(w), mpx::tensor_view<S const>(r),
                       mpx::tensor_view<float const>(b), h, ws);
  std::vector<S> want_y;
  std::fill_n(dh.data(), dh.size(), mpx::cast<S>(0.0f));
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t j = 0; j < U; ++j) {
        std::size_t const k = uz((n * T + t) * U + j);
        if (sequences) {
          want_y.push_back(h.data()[k]);
          dh.data()[k] = dy.data()[k];
        } else if (t == T - 1) {
          want_y.push_back(h.data()[k]);
          dh.data()[k] = dy.data()[uz(n * U + j)];
        }
      }
  mpx::lstm_backward<P>(exec, dh, mpx::tensor_view<S const>(w), mpx::tensor_view<S const>(r), kdx, kdw, kdr, kdb, ws);
  auto const cast_all = [](mpx::tensor<float> const& v) {
    std::vector<S> out(v.size());
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = mpx::cast<S>(v.data()[i]);
    return out;
  };
  y.require_guards_intact(call, "y");
  dx.require_guards_intact(call, "dx");
  require_same<S>(call, "y", y.values(), want_y);
  require_same<S>(call, "dx", dx.values(), std::vector<S>(kdx.data(), kdx.data() + kdx.size()));
  auto const dwv = params[0].gradient.template as<S>(), drv = params[1].gradient.template as<S>();
  auto const dbv = params[2].gradient.template as<float>();
  require_same<S>(call, "kernel gradient", std::span<S const>(dwv.data(), dwv.size()), cast_all(kdw));
  require_same<S>(call, "recurrent_kernel gradient", std::span<S const>(drv.data(), drv.size()), cast_all(kdr));
  require_same<float>(call, "bias gradient", std::span<float const>(dbv.data(), dbv.size()),
                      std::span<float const>(kdb.data(), kdb.size()));
}

}  // namespace sequence_detail

void run_sequence(draw& d) {
  using namespace sequence_detail;
  switch (d.byte() % 6) {
    case 0:
      with_storage(d, [&](auto s) { run_permute_heads<typename decltype(s)::type>(d); });
      break;
    case 1:
      with_storage(d, [&](auto s) {
        with_storage(d, [&](auto p) { run_causal_softmax<typename decltype(s)::type, typename decltype(p)::type>(d); });
      });
      break;
    case 2:
      with_storage(d, [&](auto g) { run_causal_softmax_backward<typename decltype(g)::type>(d); });
      break;
    case 3:
      with_storage(d, [&](auto s) { run_attention_layer<typename decltype(s)::type>(d); });
      break;
    case 4:
      with_storage(d, [&](auto s) {
        using S = typename decltype(s)::type;
        bool const float_bias = d.coin(), float_dh = d.coin();
        if (float_bias && float_dh) run_lstm_kernel<S, float, float>(d);
        else if (float_bias) run_lstm_kernel<S, float, S>(d);
        else if (float_dh) run_lstm_kernel<S, S, float>(d);
        else run_lstm_kernel<S, S, S>(d);
      });
      break;
    default:
      with_storage(d, [&](auto s) { run_lstm_layer<typename decltype(s)::type>(d); });
      break;
  }
}

}  // namespace mpx_fuzz::api
