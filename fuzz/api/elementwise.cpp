// The API fuzzer's elementwise group: fill, cast (every pair of dtypes), scale, axpy,
// copy, the fp8 casts with a scale and an amax (plain, transposed, padded), and the
// reductions and checks (count_nonfinite, all_finite, stats, sum_of_squares,
// log2_histogram, column_sum), on the host executor. Casts and element-wise ops are
// exact (one documented rounding each): their references round in double here, apart
// from mpx; sums get the float summation bound.

#include "groups.hpp"

#include <mpx/exec/copy.hpp>
#include <mpx/kernels/column_reduce.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/numerics/finite.hpp>
#include <mpx/numerics/histogram.hpp>
#include <mpx/numerics/stats.hpp>
#include <mpx/numerics/sum_of_squares.hpp>
#include <mpx/scaling/fp8_scaling.hpp>

#include <array>
#include <bit>
#include <cfloat>
#include <optional>
#include <utility>

namespace mpx_fuzz::api {

namespace elementwise_detail {

using mpx::bfloat16;
using mpx::float8_e4m3;
using mpx::float8_e5m2;
using mpx::half;

template <class T>
struct tag {
  using type = T;
};

//! f(tag<T>{}) for one of mpx's five dtypes.
template <class F>
void any_dtype(std::size_t i, F&& f) {
  switch (i % 5) {
    case 0: return f(tag<half>{});
    case 1: return f(tag<bfloat16>{});
    case 2: return f(tag<float>{});
    case 3: return f(tag<float8_e4m3>{});
    default: return f(tag<float8_e5m2>{});
  }
}

//! The sum policies with float accumulation (the only ones the reductions accept).
template <class F>
void float_sum_policy(std::size_t i, F&& f) {
  switch (i % 3) {
    case 0: return f(tag<mpx::float32>{});
    case 1: return f(tag<mpx::mixed_float16>{});
    default: return f(tag<mpx::mixed_bfloat16>{});
  }
}

inline std::size_t count(std::vector<std::int64_t> const& e) {
  std::size_t n = 1;
  for (auto x : e) n *= static_cast<std::size_t>(x);
  return n;
}
inline std::string shape_string(std::vector<std::int64_t> const& e) { return mpx::shape(std::span(e)).to_string(); }

//! Rank 0 (one element) to max_rank, extents as harness.hpp draws them.
inline std::vector<std::int64_t> draw_shape(draw& d, std::size_t max_rank, std::size_t min_rank = 0) {
  return d.extents(min_rank + d.below(max_rank - min_rank + 1), 257);
}

//! A shape that differs from e: one extent off by one, an extra axis of 1 (the same
//! element count), or one axis fewer.
inline std::vector<std::int64_t> other_shape(draw& d, std::vector<std::int64_t> e) {
  switch (d.below(3)) {
    case 0:
      if (!e.empty()) {
        auto& x = e[d.below(e.size())];
        x = x > 0 && d.coin() ? x - 1 : x + 1;
        return e;
      }
      [[fallthrough]];
    case 1: e.push_back(1); return e;
    default:
      if (!e.empty()) e.pop_back();
      else e.push_back(2);
      return e;
  }
}

//! x rounded to T as mpx::cast (saturate false) or mpx::saturate_cast (true) document
//! it (docs/types_and_casts.md, docs/dtypes.md): to nearest, ties to even, subnormals
//! kept, -0 kept; beyond the range inf, or for e4m3 (no inf) NaN, or ±max saturating.
//! Written from the format's parameters alone, apart from mpx's rounding.
template <class T>
double round_ref(double x, bool saturate) {
  using traits = mpx::dtype_traits<T>;
  double const max = mpx::detail::to_double(traits::max());
  double const overflow = saturate ? max : traits::has_infinity ? HUGE_VAL : std::numeric_limits<double>::quiet_NaN();
  if (std::isnan(x)) return x;
  if (std::isinf(x)) return std::copysign(overflow, x);
  double const a = std::fabs(x);
  if (a == 0) return x;
  int const min_exponent = 1 - traits::exponent_bias;
  int const quantum = std::max(std::ilogb(a), min_exponent) - traits::mantissa_bits;
  double const r = std::ldexp(std::nearbyint(std::ldexp(a, -quantum)), quantum);  // the default mode: ties to even
  return std::copysign(r > max ? overflow : r, x);
}

inline bool same_value(double got, double want) {
  if (std::isnan(want) || std::isnan(got)) return std::isnan(want) && std::isnan(got);
  return got == want && std::signbit(got) == std::signbit(want);
}

inline void require_exact(call_name const& call, std::string_view what, std::size_t i, double got, double want) {
  if (same_value(got, want)) return;
  std::ostringstream os;
  os.precision(17);
  os << call.str() << ": " << what << "[" << i << "] is " << got << ", " << want << " was due exactly";
  fail(os.str());
}

//! A refused call must leave its output as it was: still all poison.
template <class T>
void require_untouched(call_name const& call, guarded<T> const& out, std::string_view what) {
  for (std::size_t i = 0; i < out.size(); ++i)
    if (mpx::bits(out.data()[i]) != mpx::bits(poison<T>()))
      fail(call.str() + ": a refused call wrote " + std::string(what) + "[" + std::to_string(i) + "]");
  out.require_guards_intact(call, what);
}

//! Two views that overlap in memory but not element for element, in one buffer: a at
//! some offset, b a whole number of max(sizeof) bytes before or after it (the same start
//! too, where `same_start` says that start is a partial overlap, as for two element
//! sizes). Empty when the sizes leave no such placement.
class overlap {
 public:
  template <class A, class B>
  static std::optional<std::pair<A*, B*>> place(overlap& o, draw& d, std::size_t na, std::size_t nb, bool same_start) {
    std::size_t const u = std::max(sizeof(A), sizeof(B));
    std::size_t const bytes_a = na * sizeof(A), bytes_b = nb * sizeof(B);
    if (na == 0 || nb == 0) return std::nullopt;
    auto const before = static_cast<std::int64_t>((bytes_b + u - 1) / u) - 1;  // b may start this many units before a
    auto const after = static_cast<std::int64_t>((bytes_a + u - 1) / u) - 1;   // ... or after
    std::vector<std::int64_t> shifts;
    for (std::int64_t k = -before; k <= after; ++k)
      if (k != 0 || same_start) shifts.push_back(k);
    if (shifts.empty()) return std::nullopt;
    std::int64_t const k = shifts[d.below(shifts.size())];
    std::size_t const base = (bytes_b + 16) / 16 * 16;
    o.words_.assign((base + bytes_a + bytes_b + 32) / 8, 0x5A5A'5A5A'5A5A'5A5Aull);
    auto* bytes = reinterpret_cast<unsigned char*>(o.words_.data());
    o.before_ = o.words_;
    return std::pair{reinterpret_cast<A*>(bytes + base),
                     reinterpret_cast<B*>(bytes + static_cast<std::int64_t>(base) + k * static_cast<std::int64_t>(u))};
  }
  //! A refused call writes nothing.
  void require_untouched(call_name const& call) const {
    if (words_ != before_) fail(call.str() + ": a refused call wrote into the overlapping views");
  }

 private:
  std::vector<std::uint64_t> words_, before_;
};

// ---- fill, cast, scale, axpy, copy ----------------------------------------------------

template <class T>
void fill_case(draw& d, mpx::host_executor const& exec) {
  auto const e = draw_shape(d, 3);
  guarded<T> x(exec, e, d);
  T const value = d.value<T>(true);
  call_name call("fill ");
  call << shape_text<T>(e) << "+" << x.offset() << " with " << mpx::detail::to_double(value);
  require_accepted(call, [&] { mpx::fill(exec, x.view(), value); });
  std::vector<T> const want(x.size(), value);
  auto const got = x.values();
  require_same<T>(call, "x", got, want);
  x.require_guards_intact(call, "x");
}

template <class From, class To>
void cast_case(draw& d, mpx::host_executor const& exec) {
  auto const e = draw_shape(d, 3);
  std::size_t const n = count(e);
  bool const hostile = d.coin();
  std::size_t const mode = d.below(8);  // 0-4 into another tensor, 5 in place, 6 shapes differ, 7 partial overlap
  call_name call("cast ");
  call << shape_text<From>(e);
  if (mode == 7) {
    overlap o;
    if (auto p = overlap::place<From, To>(o, d, n, n, sizeof(From) != sizeof(To))) {
      call << " -> " << mpx::dtype_name<To> << " overlapping it by " << (reinterpret_cast<char*>(p->second) - reinterpret_cast<char*>(p->first)) << " bytes";
      require_refusal(call, {"overlap"}, [&] {
        mpx::cast(exec, mpx::tensor_view<From const>{p->first, mpx::shape(std::span(e))},
                  mpx::tensor_view<To>{p->second, mpx::shape(std::span(e))});
      });
      o.require_untouched(call);
      return;
    }
  }
  guarded<From> src(exec, e, d);
  src.assign(d.values<From>(n, hostile));
  call << "+" << src.offset() << " -> ";
  if (mode == 6) {
    auto const e2 = other_shape(d, e);
    guarded<To> dst(exec, e2, d);
    call << shape_text<To>(e2) << " (shapes differ)";
    require_refusal(call, {"src has shape " + shape_string(e), "dst has shape " + shape_string(e2)}, [&] { mpx::cast(exec, src.cview(), dst.view()); });
    require_untouched(call, dst, "dst");
    return;
  }
  auto const in = src.values();
  std::vector<double> got(n);
  if (mode == 5 && sizeof(From) == sizeof(To)) {
    call << mpx::dtype_name<To> << " in place";
    mpx::tensor_view<To> dst{reinterpret_cast<To*>(src.data()), mpx::shape(std::span(e))};
    require_accepted(call, [&] { mpx::cast(exec, src.cview(), dst); });
    for (std::size_t i = 0; i < n; ++i) got[i] = mpx::detail::to_double(dst.data()[i]);
    src.require_guards_intact(call, "src (the output)");
  } else {
    guarded<To> dst(exec, e, d);
    call << shape_text<To>(e) << "+" << dst.offset();
    require_accepted(call, [&] { mpx::cast(exec, src.cview(), dst.view()); });
    for (std::size_t i = 0; i < n; ++i) got[i] = mpx::detail::to_double(dst.data()[i]);
    dst.require_guards_intact(call, "dst");
    src.require_guards_intact(call, "src");
    require_same<From>(call, "src (an input)", src.values(), in);
  }
  for (std::size_t i = 0; i < n; ++i) require_exact(call, "dst", i, got[i], round_ref<To>(mpx::detail::to_double(in[i]), false));
}

//! float(x) * factor in float, as IEEE rounds it: the product of two floats is exact
//! in double, so one rounding to float gives the float product.
inline double float_product(double x, float factor) { return static_cast<float>(x * static_cast<double>(factor)); }

template <class T>
void scale_case(draw& d, mpx::host_executor const& exec) {
  auto const e = draw_shape(d, 3);
  std::size_t const n = count(e);
  bool const hostile = d.coin();
  float const factor = d.value<float>(d.coin());
  guarded<T> x(exec, e, d);
  x.assign(d.values<T>(n, hostile));
  auto const in = x.values();
  call_name call("scale ");
  call << shape_text<T>(e) << "+" << x.offset() << " by " << factor;
  require_accepted(call, [&] { mpx::scale(exec, x.view(), factor); });
  // Documented: computed in float and rounded once to T.
  for (std::size_t i = 0; i < n; ++i)
    require_exact(call, "x", i, mpx::detail::to_double(x.data()[i]),
                  round_ref<T>(float_product(mpx::detail::to_double(in[i]), factor), false));
  x.require_guards_intact(call, "x");
}

template <class X, class Y>
void axpy_case(draw& d, mpx::host_executor const& exec) {
  auto const e = draw_shape(d, 3);
  std::size_t const n = count(e);
  bool const hostile = d.coin();
  float const alpha = d.value<float>(d.coin());
  std::size_t const mode = d.below(8);  // 0-4 separate, 5 x is y, 6 shapes differ, 7 partial overlap
  call_name call("axpy ");
  call << alpha << " * " << shape_text<X>(e);
  if (mode == 7) {
    overlap o;
    if (auto p = overlap::place<Y, X>(o, d, n, n, sizeof(X) != sizeof(Y))) {
      call << " + " << mpx::dtype_name<Y> << " overlapping it";
      require_refusal(call, {"overlap"}, [&] {
        mpx::axpy(exec, alpha, mpx::tensor_view<X const>{p->second, mpx::shape(std::span(e))},
                  mpx::tensor_view<Y>{p->first, mpx::shape(std::span(e))});
      });
      o.require_untouched(call);
      return;
    }
  }
  guarded<Y> y(exec, e, d);
  y.assign(d.values<Y>(n, hostile));
  if (mode == 6) {
    auto const e2 = other_shape(d, e);
    guarded<X> x(exec, e2, d);
    x.assign(d.values<X>(x.size(), hostile));
    call << " (x " << shape_text<X>(e2) << ", shapes differ) + " << shape_text<Y>(e);
    auto const before = y.values();
    require_refusal(call, {"x has shape " + shape_string(e2), "y has shape " + shape_string(e)}, [&] { mpx::axpy(exec, alpha, x.cview(), y.view()); });
    require_same<Y>(call, "y (refused)", y.values(), before);
    return;
  }
  auto const y0 = y.values();
  std::vector<X> x0(n);
  std::optional<guarded<X>> xg;
  X const* xp = nullptr;
  if (mode == 5 && sizeof(X) == sizeof(Y)) {
    call << " + y, x in y's memory";
    if (n) std::memcpy(static_cast<void*>(x0.data()), y0.data(), n * sizeof(X));
    xp = reinterpret_cast<X const*>(y.data());
  } else {
    xg.emplace(exec, e, d);
    xg->assign(d.values<X>(n, hostile));
    x0 = xg->values();
    xp = xg->data();
    call << "+" << xg->offset() << " + " << shape_text<Y>(e) << "+" << y.offset();
  }
  require_accepted(call, [&] { mpx::axpy(exec, alpha, mpx::tensor_view<X const>{xp, mpx::shape(std::span(e))}, y.view()); });
  // Documented: alpha * x + y in float with one rounding (an FMA; std::fma on floats
  // rounds once), then rounded to Y.
  for (std::size_t i = 0; i < n; ++i) {
    float const f = std::fma(alpha, static_cast<float>(mpx::detail::to_double(x0[i])),
                             static_cast<float>(mpx::detail::to_double(y0[i])));
    require_exact(call, "y", i, mpx::detail::to_double(y.data()[i]), round_ref<Y>(f, false));
  }
  y.require_guards_intact(call, "y");
  if (xg) {
    xg->require_guards_intact(call, "x");
    require_same<X>(call, "x (an input)", xg->values(), x0);
  }
}

template <class T>
void copy_case(draw& d, mpx::host_executor const& exec) {
  auto const e = draw_shape(d, 3);
  std::size_t const n = count(e);
  std::size_t const mode = d.below(8);  // 0-4 separate, 5 onto itself, 6 shapes differ, 7 partial overlap
  call_name call("copy ");
  call << shape_text<T>(e);
  if (mode == 7) {
    overlap o;
    if (auto p = overlap::place<T, T>(o, d, n, n, false)) {
      call << " onto itself shifted by " << (p->second - p->first) << " elements";
      require_refusal(call, {"overlap"}, [&] {
        mpx::copy(exec, mpx::tensor_view<T const>{p->first, mpx::shape(std::span(e))},
                  mpx::tensor_view<T>{p->second, mpx::shape(std::span(e))});
      });
      o.require_untouched(call);
      return;
    }
  }
  guarded<T> src(exec, e, d);
  src.assign(d.values<T>(n, true));
  auto const in = src.values();
  call << "+" << src.offset();
  if (mode == 6) {
    auto const e2 = other_shape(d, e);
    guarded<T> dst(exec, e2, d);
    call << " -> " << shape_text<T>(e2) << " (shapes differ)";
    require_refusal(call, {"src has shape " + shape_string(e), "dst has shape " + shape_string(e2)}, [&] { mpx::copy(exec, src.cview(), dst.view()); });
    require_untouched(call, dst, "dst");
    return;
  }
  if (mode == 5) {
    call << " onto itself";
    require_accepted(call, [&] { mpx::copy(exec, src.cview(), src.view()); });
    for (std::size_t i = 0; i < n; ++i)  // bit for bit, NaN payloads included: a copy is memory
      if (mpx::bits(src.data()[i]) != mpx::bits(in[i])) fail(call.str() + ": changed element " + std::to_string(i));
    src.require_guards_intact(call, "src");
    return;
  }
  guarded<T> dst(exec, e, d);
  call << " -> +" << dst.offset();
  require_accepted(call, [&] { mpx::copy(exec, src.cview(), dst.view()); });
  for (std::size_t i = 0; i < n; ++i)
    if (mpx::bits(dst.data()[i]) != mpx::bits(in[i])) fail(call.str() + ": dst[" + std::to_string(i) + "] differs from src");
  dst.require_guards_intact(call, "dst");
  src.require_guards_intact(call, "src");
}

// ---- fp8 casts with a scale -------------------------------------------------------------

inline std::uint32_t magnitude_bits_of(double x) {
  return std::bit_cast<std::uint32_t>(static_cast<float>(x)) & 0x7FFF'FFFFu;
}

//! The scale for an amax, as the header documents it (Transformer Engine's
//! compute_scale_from_amax: (max / amax) * 2^-margin in float; a NaN, inf or zero amax
//! keeps the previous scale, an overflow gives FLT_MAX, an underflow keeps the previous).
template <class F8>
float scale_from_amax(float amax, int margin, float previous) {
  if (!(amax > 0.0f) || std::isinf(amax)) return previous;
  float const s = (static_cast<float>(mpx::detail::to_double(mpx::dtype_traits<F8>::max())) / amax) * std::ldexp(1.0f, -margin);
  if (std::isinf(s)) return FLT_MAX;
  return s > 0.0f ? s : previous;
}

inline void require_float_bits(call_name const& call, std::string_view what, float got, float want) {
  if (std::isnan(got) && std::isnan(want)) return;
  if (std::bit_cast<std::uint32_t>(got) != std::bit_cast<std::uint32_t>(want)) {
    std::ostringstream os;
    os.precision(9);
    os << call.str() << ": the state's " << what << " is " << got << ", " << want << " was due";
    fail(os.str());
  }
}

template <class In, class F8>
void fp8_case(draw& d, mpx::host_executor const& exec) {
  enum { plain, transposed, padded, transposed_padded };
  static constexpr char const* names[] = {"cast_to_fp8", "cast_to_fp8_transposed", "cast_to_fp8_padded",
                                          "cast_to_fp8_transposed_padded"};
  int const layout = static_cast<int>(d.below(4));
  bool const current = layout == plain && d.coin();
  std::vector<std::int64_t> xe = layout == plain     ? draw_shape(d, 3)
                                 : layout == padded ? d.extents(1 + d.below(3), 129)
                                                    : d.extents(2 + d.below(2), 129);
  std::size_t const r = xe.size();
  std::vector<std::int64_t> oe = xe;
  if (layout == transposed || layout == transposed_padded) std::swap(oe[r - 1], oe[r - 2]);
  if (layout == padded || layout == transposed_padded) oe[r - 1] += static_cast<std::int64_t>(d.below(9));
  std::uint32_t const history = d.pick<std::uint32_t>({1, 2, 3, 16, mpx::fp8_max_history});
  int const margin = static_cast<int>(d.pick<unsigned>({0, 0, 1, 3, 64}));
  float const initial = d.pick<float>({1.0f, 0.5f, 16.0f, 0x1p-7f, 3.0f, 0x1p100f});
  bool const hostile = d.coin();
  std::size_t const mode = d.below(12);  // 0-6 valid; 7 shapes, 8 overlap, 9 margin, 10 initial scale, 11 history

  call_name call(names[layout]);
  call << " " << shape_text<In>(xe) << " -> " << shape_text<F8>(oe) << (current ? " current" : " delayed")
       << " history " << history << " margin " << margin << " scale " << initial;

  mpx::delayed_scaling const delayed{history, margin};
  mpx::current_scaling const now{margin};
  auto const make_state = [&](float scale) {
    return current ? mpx::fp8_tensor_scale<F8, mpx::host_executor>(exec, now, scale)
                   : mpx::fp8_tensor_scale<F8, mpx::host_executor>(exec, delayed, scale);
  };
  auto const run = [&](auto x, auto& state, auto out) {
    switch (layout) {
      case plain:
        if (current) mpx::cast_to_fp8(exec, x, state, out, now);
        else mpx::cast_to_fp8(exec, x, state, out, delayed);
        break;
      case transposed: mpx::cast_to_fp8_transposed(exec, x, state, out, delayed); break;
      case padded: mpx::cast_to_fp8_padded(exec, x, state, out, delayed); break;
      default: mpx::cast_to_fp8_transposed_padded(exec, x, state, out, delayed); break;
    }
  };

  if (mode == 10) {
    float const bad = d.pick<float>({0.0f, -1.0f, -0.0f, HUGE_VALF, std::numeric_limits<float>::quiet_NaN()});
    call << " (initial scale " << bad << ")";
    require_refusal(call, {"initial scale"}, [&] { (void)make_state(bad); });
    return;
  }
  if (mode == 11 && !current) {
    std::uint32_t const bad = d.pick<std::uint32_t>({0, mpx::fp8_max_history + 1, 1u << 31});
    call << " (history_length " << bad << ")";
    require_refusal(call, {"history_length"}, [&] {
      (void)mpx::fp8_tensor_scale<F8, mpx::host_executor>(exec, mpx::delayed_scaling{bad, margin}, initial);
    });
    return;
  }
  auto state = make_state(initial);
  if (mode == 9) {
    int const bad = d.pick<int>({-1, 65, -64, 1000});
    call << " (margin " << bad << ")";
    std::size_t const n = count(xe);
    guarded<In> x(exec, xe, d);
    x.assign(d.values<In>(n, hostile));
    guarded<F8> out(exec, oe, d);
    auto const before = state.values(exec);
    require_refusal(call, {"margin"}, [&] {
      if (current) mpx::cast_to_fp8(exec, x.cview(), state, out.view(), mpx::current_scaling{bad});
      else mpx::update_fp8_scale(exec, state, mpx::delayed_scaling{history, bad});
    });
    if (current) require_untouched(call, out, "out");
    auto const after = state.values(exec);
    if (std::memcmp(&before, &after, sizeof before) != 0) fail(call.str() + ": a refused call changed the state");
    return;
  }
  if (mode == 8) {
    overlap o;
    std::size_t const nx = count(xe), no = count(oe);
    if (auto p = overlap::place<In, F8>(o, d, nx, no, true)) {
      call << " (out overlaps x)";
      require_refusal(call, {"overlap"}, [&] {
        run(mpx::tensor_view<In const>{p->first, mpx::shape(std::span(xe))}, state,
            mpx::tensor_view<F8>{p->second, mpx::shape(std::span(oe))});
      });
      o.require_untouched(call);
      return;
    }
  }
  if (mode == 7) {
    // Out of a shape the layout refuses: an extra axis of 1, the last extent one short
    // of what it needs (or one more, where it must match), or another leading extent.
    std::vector<std::int64_t> bad = oe;
    std::size_t const how = d.below(3);
    if (how == 0 || r == 0) bad.push_back(1);
    else if (how == 1) {
      bool const pads = layout == padded || layout == transposed_padded;
      std::int64_t const need = layout == padded ? xe[r - 1] : layout == transposed_padded ? xe[r - 2] : -1;
      if (!pads) bad[r - 1] += 1;
      else if (need > 0) bad[r - 1] = need - 1;
      else bad.push_back(1);
    } else if (r >= 2) {
      bad[0] += 1;
    } else {
      bad.push_back(1);
    }
    std::size_t const n = count(xe);
    guarded<In> x(exec, xe, d);
    x.assign(d.values<In>(n, hostile));
    guarded<F8> out(exec, bad, d);
    call << " (out " << shape_text<F8>(bad) << ")";
    require_refusal(call, {shape_string(xe), shape_string(bad)}, [&] { run(x.cview(), state, out.view()); });
    require_untouched(call, out, "out");
    return;
  }

  // A valid call: one cast (two in one step with delayed scaling, now and then), then
  // for delayed scaling maybe the update.
  std::size_t const n = count(xe);
  guarded<In> x(exec, xe, d);
  x.assign(d.values<In>(n, hostile));
  guarded<F8> out(exec, oe, d);
  call << " x+" << x.offset() << " out+" << out.offset();
  auto const in = x.values();
  bool const twice = !current && d.below(4) == 0;
  bool const update = !current && d.coin();
  if (twice) call << ", cast twice";
  if (update) call << ", then update_fp8_scale";
  require_accepted(call, [&] {
    run(x.cview(), state, out.view());
    if (twice) run(x.cview(), state, out.view());
    if (update) mpx::update_fp8_scale(exec, state, delayed);
  });
  x.require_guards_intact(call, "x");
  out.require_guards_intact(call, "out");
  require_same<In>(call, "x (an input)", x.values(), in);

  std::uint32_t amax_bits = 0;
  for (auto v : in) amax_bits = std::max(amax_bits, magnitude_bits_of(mpx::detail::to_double(v)));
  float const amax = std::bit_cast<float>(amax_bits);
  float const cast_scale = current ? scale_from_amax<F8>(amax, margin, initial) : initial;

  // The output, element by element (docs/fp8.md: saturate_cast<Format>(float(x) * scale),
  // zeros in the padding).
  auto const want_at = [&](std::size_t i) -> double {
    if (layout == plain) return round_ref<F8>(float_product(mpx::detail::to_double(in[i]), cast_scale), true);
    std::size_t const pitch = static_cast<std::size_t>(oe[r - 1]);
    std::size_t const row = i / pitch, c = i % pitch;
    if (layout == padded) {
      std::size_t const k = static_cast<std::size_t>(xe[r - 1]);
      return c < k ? round_ref<F8>(float_product(mpx::detail::to_double(in[row * k + c]), cast_scale), true) : 0.0;
    }
    // transposed: x [B, R, C] -> out [B, C, pitch]; out[b][j][c] = x[b][c][j] for c < R
    std::size_t const rows = static_cast<std::size_t>(xe[r - 2]), cols = static_cast<std::size_t>(xe[r - 1]);
    std::size_t const b = cols ? row / cols : 0, j = cols ? row % cols : 0;
    if (c >= rows) return 0.0;
    return round_ref<F8>(float_product(mpx::detail::to_double(in[(b * rows + c) * cols + j]), cast_scale), true);
  };
  for (std::size_t i = 0; i < out.size(); ++i) require_exact(call, "out", i, mpx::detail::to_double(out.data()[i]), want_at(i));

  auto const v = state.values(exec);
  if (current || update) {
    // The step is finished: amax into the history (delayed), the new scale, counters.
    float const scale = current ? cast_scale : scale_from_amax<F8>(amax, margin, initial);
    require_float_bits(call, "scale", v.scale, scale);
    require_float_bits(call, "inverse_scale", v.inverse_scale, 1.0f / scale);
    require_float_bits(call, "last_amax", v.last_amax, amax);
    if (v.step_amax_bits != 0 || v.steps != 1 || v.nonfinite_steps != (std::isfinite(amax) ? 0u : 1u))
      fail(call.str() + ": the state's step amax, steps or nonfinite_steps is wrong after the step");
    if (!current) {
      require_float_bits(call, "history[0]", v.history[0], amax);
      if (v.position != 1 % history || v.history_length != history)
        fail(call.str() + ": the state's history position or length is wrong after the step");
    }
  } else {
    // The bits of |x|'s maximum (any NaN's bits lie above +inf's; its payload is free).
    bool const right = std::isnan(amax) ? v.step_amax_bits > 0x7F80'0000u : v.step_amax_bits == amax_bits;
    if (!right)
      fail(call.str() + ": the step amax is " + std::to_string(v.step_amax_bits) + " (bits), " +
           std::to_string(amax_bits) + " was due");
    require_float_bits(call, "scale", v.scale, initial);
    if (v.steps != 0) fail(call.str() + ": a cast counted a step");
  }
}

// ---- reductions and checks ----------------------------------------------------------------

template <class T>
void nonfinite_case(draw& d, mpx::host_executor const& exec) {
  auto const e = draw_shape(d, 3);
  guarded<T> x(exec, e, d);
  x.assign(d.values<T>(x.size(), d.coin()));
  call_name call("count_nonfinite and all_finite ");
  call << shape_text<T>(e) << "+" << x.offset();
  std::size_t want = 0;
  for (double v : x.wide()) want += std::isfinite(v) ? 0 : 1;
  std::size_t got = 0;
  bool all = false;
  require_accepted(call, [&] {
    got = mpx::count_nonfinite(exec, x.cview());
    all = mpx::all_finite(exec, x.cview());
  });
  if (got != want) fail(call.str() + ": counted " + std::to_string(got) + ", " + std::to_string(want) + " was due");
  if (all != (want == 0)) fail(call.str() + ": all_finite disagrees with the count");
  x.require_guards_intact(call, "x");
}

template <class T>
void stats_case(draw& d, mpx::host_executor const& exec) {
  using traits = mpx::dtype_traits<T>;
  auto const e = draw_shape(d, 3);
  guarded<T> x(exec, e, d);
  x.assign(d.values<T>(x.size(), d.coin()));
  call_name call("stats ");
  call << shape_text<T>(e) << "+" << x.offset();
  mpx::numerics_stats want;
  double const min_normal = mpx::detail::to_double(traits::min_normal()), max = mpx::detail::to_double(traits::max());
  double absmax = 0, min_abs = HUGE_VAL;
  for (double v : x.wide()) {
    ++want.size;
    double const a = std::fabs(v);
    if (std::isnan(v)) ++want.nan;
    else if (std::isinf(v)) ++want.inf;
    else if (v == 0) ++want.zero;
    else {
      want.subnormal += a < min_normal;
      want.underflow_in_half += a <= 0x1p-25;  // docs/types_and_casts.md: rounds to 0 up to min_subnormal / 2
      want.overflow_in_half += a >= 65520;     // ... and to inf from 65520
      want.at_max += a == max;
      absmax = std::max(absmax, a);
      min_abs = std::min(min_abs, a);
    }
  }
  want.absmax = static_cast<float>(absmax);  // exact: every dtype widens to float
  want.min_abs_nonzero = min_abs == HUGE_VAL ? 0.0f : static_cast<float>(min_abs);
  mpx::numerics_stats got;
  require_accepted(call, [&] { got = mpx::stats(exec, x.cview()); });
  if (!(got == want)) fail(call.str() + ": " + mpx::to_string(got) + ", due: " + mpx::to_string(want));
  x.require_guards_intact(call, "x");
}

template <class T>
void histogram_case(draw& d, mpx::host_executor const& exec) {
  auto const e = draw_shape(d, 3);
  guarded<T> x(exec, e, d);
  x.assign(d.values<T>(x.size(), d.coin()));
  call_name call("log2_histogram ");
  call << shape_text<T>(e) << "+" << x.offset();
  mpx::exponent_histogram want;
  for (double v : x.wide()) {
    if (std::isnan(v)) ++want.nan;
    else if (std::isinf(v)) ++want.inf;
    else if (v == 0) ++want.zero;
    else {
      int exponent = 0;
      (void)std::frexp(v, &exponent);  // |v| = m 2^exponent, m in [0.5, 1): floor(log2 |v|) = exponent - 1
      ++want.counts[static_cast<std::size_t>(exponent - 1 - mpx::exponent_histogram::min_exponent)];
    }
  }
  mpx::exponent_histogram got;
  require_accepted(call, [&] { got = mpx::log2_histogram(exec, x.cview()); });
  if (got.counts != want.counts || got.zero != want.zero || got.nan != want.nan || got.inf != want.inf)
    fail(call.str() + ": the histogram differs:\n" + got.to_string() + "due:\n" + want.to_string());
  x.require_guards_intact(call, "x");
}

//! A float sum of terms, then rounded to Y, against the float64 sum `ref`: `err` bounds
//! the float sum's error (the caller's summation bound), the rounding to Y adds its unit
//! roundoff of the result and half its smallest subnormal. Beyond Y's range the result
//! overflows (inf, or NaN for e4m3 whose mpx::cast has no inf); within `err` of that
//! edge either is right.
template <class Y>
void require_rounded_sum(call_name const& call, std::string_view what, std::size_t i, double got, double ref, double err) {
  using traits = mpx::dtype_traits<Y>;
  if (std::isnan(ref) || std::isinf(ref)) {
    return require_near(call, what, i, got, round_ref<Y>(ref, false), 0);
  }
  double const max = mpx::detail::to_double(traits::max());
  // The smallest magnitude that rounds past max: max + half an ulp of max.
  double const edge = max + std::ldexp(1.0, std::ilogb(max) - traits::mantissa_bits - 1);
  double const tol = err + unit_roundoff<Y>() * (std::fabs(ref) + err) +
                     mpx::detail::to_double(traits::min_subnormal()) / 2;
  double const overflowed = round_ref<Y>(std::copysign(HUGE_VAL, ref), false);
  if (std::fabs(ref) - err > edge) return require_near(call, what, i, got, overflowed, 0);
  if (std::fabs(ref) + err >= edge && same_value(got, overflowed)) return;
  require_near(call, what, i, got, ref, tol);
}

template <class T, class Policy>
void sum_of_squares_case(draw& d, mpx::host_executor const& exec) {
  auto const e = draw_shape(d, 3);
  guarded<T> x(exec, e, d);
  x.assign(d.values<T>(x.size(), d.coin()));
  call_name call("sum_of_squares<");
  call << Policy::name << "> " << shape_text<T>(e) << "+" << x.offset();
  double ref = 0;
  for (double v : x.wide()) ref += v * v;  // exact enough: 2 x 24-bit squares in a 53-bit sum
  // Each square is rounded to float once and the sum has n - 1 roundings in whatever
  // order: |err| <= (n + 4) 2^-24 sum x^2 (the brief's bound for float-summed products),
  // plus 2^-150 for each square that underflows in float (a subnormal sum is exact).
  double const n = static_cast<double>(x.size());
  double const err = (n + 4) * 0x1p-24 * ref + n * 0x1p-150;
  float got = 0;
  require_accepted(call, [&] { got = mpx::sum_of_squares<Policy>(exec, x.cview()); });
  require_rounded_sum<float>(call, "the sum", 0, got, ref, err);
  x.require_guards_intact(call, "x");
}

//! column_sum's y against the float64 column sums of x (`wide`, [rows, cols]).
template <class Y>
void require_column_sums(call_name const& call, std::vector<double> const& wide, std::size_t rows, std::size_t cols,
                         Y const* y) {
  for (std::size_t j = 0; j < cols; ++j) {
    double sum = 0, abs_finite = 0;
    for (std::size_t i = 0; i < rows; ++i) {
      double const v = wide[i * cols + j];
      sum += v;
      if (std::isfinite(v)) abs_finite += std::fabs(v);
    }
    // Any order of float additions: |err| <= (rows + 4) 2^-24 sum |x| (Higham's bound,
    // the one tests/kernels/test_column_reduce.cpp tightens by depth). Where the finite
    // terms could overflow a float partial sum (hostile ±max in float), a partial inf
    // may meet an opposite one: nothing is checked there but that y[j] was written.
    double const err = (static_cast<double>(rows) + 4) * 0x1p-24 * abs_finite;
    if (abs_finite + err >= static_cast<double>(FLT_MAX)) {
      if (mpx::bits(y[j]) == mpx::bits(poison<Y>()) && !mpx::dtype8<Y>)
        fail(call.str() + ": y[" + std::to_string(j) + "] was not written");
      continue;
    }
    require_rounded_sum<Y>(call, "y", j, mpx::detail::to_double(y[j]), sum, err);
  }
}

template <class T, class Y, class Policy>
void column_sum_case(draw& d, mpx::host_executor const& exec) {
  auto const e = draw_shape(d, 3, 1);
  std::size_t const cols = static_cast<std::size_t>(e.back()), n = count(e), rows = cols ? n / cols : 0;
  bool const hostile = d.coin();
  std::size_t const mode = d.below(8);  // 0-5 valid, 6 y's shape wrong, 7 y overlaps x
  call_name call("column_sum<");
  call << Policy::name << "> " << shape_text<T>(e);
  if (mode == 7) {
    // Not refused, and rightly: column_sum reads all of x into partial sums (host
    // scratch, or the GPU's first kernel) before it writes y (the finish step, or the
    // second kernel in stream order), so a y that overlaps x is well defined. It must
    // give the column sums of x as it was before the call.
    overlap o;
    if (auto p = overlap::place<T, Y>(o, d, n, cols, true)) {
      call << " -> " << mpx::dtype_name<Y> << "[" << cols << "] overlapping x";
      auto const values = d.values<T>(n, hostile);
      std::copy(values.begin(), values.end(), p->first);
      std::vector<double> wide(n);
      for (std::size_t i = 0; i < n; ++i) wide[i] = mpx::detail::to_double(values[i]);
      require_accepted(call, [&] {
        mpx::column_sum<Policy>(exec, mpx::tensor_view<T const>{p->first, mpx::shape(std::span(e))},
                                mpx::tensor_view<Y>{p->second, mpx::shape{static_cast<std::int64_t>(cols)}});
      });
      require_column_sums<Y>(call, wide, rows, cols, p->second);
      return;
    }
  }
  guarded<T> x(exec, e, d);
  x.assign(d.values<T>(n, hostile));
  call << "+" << x.offset();
  if (mode == 6) {
    std::vector<std::int64_t> ye{static_cast<std::int64_t>(cols)};
    switch (d.below(3)) {
      case 0: ye[0] += 1; break;
      case 1: ye.insert(ye.begin(), 1); break;
      default: ye = {}; break;
    }
    guarded<Y> y(exec, ye, d);
    call << " -> " << shape_text<Y>(ye) << " (y's shape is wrong)";
    require_refusal(call, {shape_string(e), shape_string(ye)}, [&] { mpx::column_sum<Policy>(exec, x.cview(), y.view()); });
    require_untouched(call, y, "y");
    return;
  }
  guarded<Y> y(exec, {static_cast<std::int64_t>(cols)}, d);
  call << " -> " << shape_text<Y>({static_cast<std::int64_t>(cols)}) << "+" << y.offset();
  require_accepted(call, [&] { mpx::column_sum<Policy>(exec, x.cview(), y.view()); });
  require_column_sums<Y>(call, x.wide(), rows, cols, y.data());
  y.require_guards_intact(call, "y");
  x.require_guards_intact(call, "x");
}

}  // namespace elementwise_detail

void run_elementwise(draw& d) {
  using namespace elementwise_detail;
  mpx::host_executor const exec;
  std::size_t const op = d.below(11);
  std::size_t const t1 = d.byte(), t2 = d.byte(), p = d.byte();
  switch (op) {
    case 0: return any_dtype(t1, [&](auto a) { fill_case<typename decltype(a)::type>(d, exec); });
    case 1:
      return any_dtype(t1, [&](auto a) {
        any_dtype(t2, [&](auto b) { cast_case<typename decltype(a)::type, typename decltype(b)::type>(d, exec); });
      });
    case 2: return any_dtype(t1, [&](auto a) { scale_case<typename decltype(a)::type>(d, exec); });
    case 3:
      return any_dtype(t1, [&](auto a) {
        any_dtype(t2, [&](auto b) { axpy_case<typename decltype(a)::type, typename decltype(b)::type>(d, exec); });
      });
    case 4: return any_dtype(t1, [&](auto a) { copy_case<typename decltype(a)::type>(d, exec); });
    case 5: {
      auto const in = [&](auto f) {
        switch (t1 % 3) {
          case 0: return f(tag<half>{});
          case 1: return f(tag<bfloat16>{});
          default: return f(tag<float>{});
        }
      };
      return in([&](auto a) {
        if (t2 % 2) fp8_case<typename decltype(a)::type, float8_e4m3>(d, exec);
        else fp8_case<typename decltype(a)::type, float8_e5m2>(d, exec);
      });
    }
    case 6: return any_dtype(t1, [&](auto a) { nonfinite_case<typename decltype(a)::type>(d, exec); });
    case 7: return any_dtype(t1, [&](auto a) { stats_case<typename decltype(a)::type>(d, exec); });
    case 8:
      return any_dtype(t1, [&](auto a) {
        float_sum_policy(p, [&](auto q) { sum_of_squares_case<typename decltype(a)::type, typename decltype(q)::type>(d, exec); });
      });
    case 9: return any_dtype(t1, [&](auto a) { histogram_case<typename decltype(a)::type>(d, exec); });
    default:
      return any_dtype(t1, [&](auto a) {
        any_dtype(t2, [&](auto b) {
          float_sum_policy(p, [&](auto q) {
            column_sum_case<typename decltype(a)::type, typename decltype(b)::type, typename decltype(q)::type>(d, exec);
          });
        });
      });
  }
}

}  // namespace mpx_fuzz::api
