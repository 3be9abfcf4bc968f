// The API fuzzer's optim group: mpx::unscale_and_check over gradient lists of mixed
// dtypes, every optimizer's step (sgd, adam, adamw; float master weights or none, with
// stochastic rounding), and loss_scale_optimizer's step with a dynamic or static loss
// scaler. Each update is checked against a float64 transcription of the documented
// rule (docs/optimizers.md, docs/loss_scaling.md) that carries a running bound on the
// error float arithmetic may make (see `tracked`), so the bound is derived, not tuned.

#include "groups.hpp"

#include <mpx/optim/adam.hpp>
#include <mpx/optim/loss_scale_optimizer.hpp>
#include <mpx/optim/sgd.hpp>
#include <mpx/scaling/loss_scaler.hpp>
#include <mpx/scaling/unscale_and_check.hpp>

#include <memory>
#include <optional>

// Aliasing: a gradient listed twice, a parameter listed twice and a gradient in its own
// value's memory must be refused, naming "overlap" (the fuzzer first found them
// accepted; gradient_list and optimizer_core now check). Otherwise the views drawn are
// disjoint, each with its own offset and guard bands.
// Known: the unscaled value is checked as the kernel (and PyTorch) computes it,
// cast<T>(float(g) * factor), rounded to float and then to T; inverse_scale's comment says
// "rounded once", which holds for float gradients only.

namespace mpx_fuzz::api {
namespace optim_detail {

using space = mpx::host_space;
using param = mpx::parameter<space>;

// --- A running error bound (Higham's standard model, with underflow) ----------------
// `x` is the exact (float64) value of what the documented rule computes, `e` a bound on
// how far the float computation of it may be: each float operation on operands within
// their bounds lands within (the operands' propagated error) + u * |result| (rounding,
// u = 2^-24) + eta (half the spacing of float's subnormals, for a product or quotient
// that underflows; sums of floats are exact there). Whenever a value might overflow
// float (where float would give inf and float64 not), or a zero or sign is uncertain
// next to an infinity, the value is `wild` (e = inf): it is not checked, only run.
struct tracked {
  double x = 0, e = 0;
  bool wild() const { return std::isinf(e); }
};

inline constexpr double u_float = 0x1p-24;
inline constexpr double eta_float = 0x1p-150;
inline double const float_overflow = static_cast<double>(std::numeric_limits<float>::max()) + 0x1p103;

inline tracked exact(double x) { return {x, 0}; }
inline tracked wild_value() { return {0, HUGE_VAL}; }

//! The result of one float operation whose exact value is z and whose propagated error is e0.
inline tracked rounded(double z, double e0, bool underflows) {
  if (std::isnan(e0) || std::isinf(e0)) return wild_value();
  if (!std::isfinite(z)) return {z, 0};
  double e = e0 + u_float * (std::fabs(z) + e0) + (underflows ? eta_float : 0) + 0x1p-50 * std::fabs(z);
  if (std::fabs(z) + e >= float_overflow) {
    if (std::fabs(z) - e >= float_overflow) return {std::copysign(HUGE_VAL, z), 0};
    return wild_value();
  }
  return {z, e};
}
inline bool special(tracked a) { return !std::isfinite(a.x); }
inline bool zero_uncertain(tracked a) { return std::isfinite(a.x) && std::fabs(a.x) <= a.e; }

inline tracked add(tracked a, tracked b) {
  if (a.wild() || b.wild()) return wild_value();
  if (special(a) || special(b)) return {a.x + b.x, 0};
  return rounded(a.x + b.x, a.e + b.e, false);
}
inline tracked neg(tracked a) { return {-a.x, a.e}; }
inline tracked sub(tracked a, tracked b) { return add(a, neg(b)); }
inline tracked mul(tracked a, tracked b) {
  if (a.wild() || b.wild()) return wild_value();
  if (special(a) || special(b)) {
    if ((special(a) && zero_uncertain(b) && b.e > 0) || (special(b) && zero_uncertain(a) && a.e > 0)) return wild_value();
    return {a.x * b.x, 0};
  }
  return rounded(a.x * b.x, std::fabs(a.x) * b.e + std::fabs(b.x) * a.e + a.e * b.e, true);
}
inline tracked div(tracked a, tracked b) {
  if (a.wild() || b.wild()) return wild_value();
  if (zero_uncertain(b) && (b.e > 0 || b.x == 0)) {
    if (b.e == 0 && a.e == 0) return {a.x / b.x, 0};  // an exact division by an exact zero
    return wild_value();
  }
  if (special(a) || special(b)) return {a.x / b.x, 0};
  double const z = a.x / b.x;
  double const e0 = (std::fabs(a.x) * b.e + std::fabs(b.x) * a.e) / (std::fabs(b.x) * (std::fabs(b.x) - b.e));
  return rounded(z, e0, true);
}
inline tracked square_root(tracked a) {
  if (a.wild()) return wild_value();
  if (special(a)) return {std::sqrt(a.x), 0};
  if (a.x < 0 && a.x + a.e >= 0) return wild_value();
  if (a.x < 0) return {std::sqrt(a.x), 0};  // NaN, surely
  double const z = std::sqrt(a.x);
  double const e0 = z > 0 ? std::min(std::sqrt(a.e), a.e / z) : std::sqrt(a.e);
  return rounded(z, e0, false);
}
//! A float constant the code computes once in float from exact operands (1 - beta1).
inline tracked float_constant(double z) { return rounded(z, 0, true); }

//! The float value w stored as T: rounded to nearest even, or stochastically (to one of
//! the two neighbours of the float, so within one spacing of it).
template <class T>
tracked round_to(tracked w, bool stochastic) {
  if constexpr (std::is_same_v<T, float>) {
    return w;
  } else {
    if (w.wild() || special(w)) return w;
    using traits = mpx::dtype_traits<T>;
    double const max = mpx::detail::to_double(traits::max());
    double const below_max =
        mpx::detail::to_double(mpx::detail::from_bits<T>(static_cast<typename traits::bits_type>(mpx::bits(traits::max()) - 1)));
    double const overflow = max + (max - below_max) / 2;
    double const spacing0 = mpx::detail::to_double(mpx::detail::from_bits<T>(typename traits::bits_type(1)));
    double const u = unit_roundoff<T>();
    if (stochastic) {
      if (std::fabs(w.x) + w.e >= max) return wild_value();
      return {w.x, w.e + 2 * u * (std::fabs(w.x) + w.e) + spacing0};
    }
    if (std::fabs(w.x) - w.e >= overflow) return {std::copysign(HUGE_VAL, w.x), 0};
    if (std::fabs(w.x) + w.e >= overflow) return wild_value();
    return {w.x, w.e + u * (std::fabs(w.x) + w.e) + spacing0 / 2};
  }
}

inline void check_tracked(call_name const& call, std::string_view what, std::size_t i, double got, tracked ref) {
  if (ref.wild()) return;
  require_near(call, what, i, got, ref.x, ref.e);
}

// --- Tensors of any of the three dtypes ---------------------------------------------
template <class G>
struct element_of;
template <class T>
struct element_of<guarded<T>> {
  using type = T;
};
//! The element type of a guarded<T> (as a generic lambda sees it).
template <class G>
using elem_t = typename element_of<std::remove_cvref_t<G>>::type;

enum class kind { f16, bf16, f32 };
inline char const* kind_name(kind k) { return k == kind::f16 ? "float16" : k == kind::bf16 ? "bfloat16" : "float32"; }

//! A guarded tensor of half, bfloat16 or float, chosen at run time.
struct any_guarded {
  kind k{};
  std::unique_ptr<guarded<mpx::half>> h;
  std::unique_ptr<guarded<mpx::bfloat16>> b;
  std::unique_ptr<guarded<float>> f;

  any_guarded(mpx::host_executor const& exec, kind k_, std::vector<std::int64_t> e, std::int64_t offset) : k(k_) {
    if (k == kind::f16) h = std::make_unique<guarded<mpx::half>>(exec, std::move(e), offset);
    else if (k == kind::bf16) b = std::make_unique<guarded<mpx::bfloat16>>(exec, std::move(e), offset);
    else f = std::make_unique<guarded<float>>(exec, std::move(e), offset);
  }
  template <class F>
  decltype(auto) visit(F&& fn) {
    if (k == kind::f16) return fn(*h);
    if (k == kind::bf16) return fn(*b);
    return fn(*f);
  }
  std::size_t size() { return visit([](auto& g) { return g.size(); }); }
  mpx::tensor_ref<space> ref() { return visit([](auto& g) { return mpx::tensor_ref<space>(g.view()); }); }
  std::vector<double> wide() { return visit([](auto& g) { return g.wide(); }); }
  //! The raw bits of the view, to compare what must not change.
  std::vector<std::uint32_t> bits() {
    return visit([](auto& g) {
      std::vector<std::uint32_t> out;
      for (auto x : g.values()) out.push_back(static_cast<std::uint32_t>(mpx::bits(x)));
      return out;
    });
  }
  void fill(draw& d, bool hostile) {
    visit([&](auto& g) { g.assign(d.values<elem_t<decltype(g)>>(g.size(), hostile)); });
  }
  void guards(call_name const& call, std::string const& what) {
    visit([&](auto& g) { g.require_guards_intact(call, what); });
  }
};

inline kind draw_kind(draw& d) { return d.pick({kind::f16, kind::bf16, kind::f32}); }

inline std::string extents_text(std::vector<std::int64_t> const& e) {
  std::string s = "[";
  for (std::size_t i = 0; i < e.size(); ++i) s += (i ? "," : "") + std::to_string(e[i]);
  return s + "]";
}

inline void require_same_bits(call_name const& call, std::string const& what, std::vector<std::uint32_t> const& got,
                              std::vector<std::uint32_t> const& before) {
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != before[i])
      fail(call.str() + ": " + what + "[" + std::to_string(i) + "] changed (bits " + std::to_string(before[i]) + " -> " +
           std::to_string(got[i]) + ") where nothing may change");
}

// --- unscale_and_check ----------------------------------------------------------------

//! x * factor rounded once to float, then to T: what the documented unscaling computes
//! (the product of two floats is exact in float64, so the float rounding here is exact).
template <class T>
double unscaled_value(double g, float factor, bool& nonfinite, bool in_place) {
  float const x = static_cast<float>(g * static_cast<double>(factor));
  if (!in_place) {
    nonfinite = !std::isfinite(x);
    return x;
  }
  double const y = mpx::detail::to_double(mpx::cast<T>(x));
  nonfinite = !std::isfinite(y);
  return y;
}

//! The float64 norm of values whose squares a float sum folds in some order, with its
//! bound: each square rounded (u and eta), a sum of n terms in any order within
//! (n - 1) u of the sum of magnitudes, then a rounded square root (see `tracked`).
inline tracked norm_of(std::vector<double> const& v) {
  double s = 0;
  for (double x : v) s += x * x;
  double const n = static_cast<double>(v.size());
  double const es = (n + 1) * u_float * s * 1.01 + n * eta_float + 0x1p-50 * s;
  tracked sum{s, es};
  if (s + es >= float_overflow) return wild_value();
  return square_root(sum);
}

//! PyTorch's clip coefficient from the norm: max_norm / (norm + 1e-6), at most 1 (min
//! is 1-Lipschitz, so the bound carries over); 1 when max_norm <= 0 or NaN.
inline tracked clip_of(tracked norm, float max_norm) {
  if (!(max_norm > 0)) return exact(1);
  tracked const c = div(exact(max_norm), add(norm, exact(static_cast<double>(1e-6f))));
  if (c.wild()) return c;
  return {std::min(c.x, 1.0), c.e};
}

inline void run_unscale(draw& d) {
  mpx::host_executor exec;
  std::size_t const count = d.below(6);
  bool const hostile = d.coin();
  bool const inverse = d.coin();
  bool const in_place = d.coin();
  float const scale = d.pick<float>({1.0f, 32768.0f, 65536.0f, 1024.0f, 0.5f, 3.0f, 1e-3f, 1000.0f, 0x1p-10f, 0x1p-126f,
                                     1e30f, 0.0f, -2.0f, std::numeric_limits<float>::quiet_NaN(), HUGE_VALF});
  float const max_norm = d.pick<float>({0.0f, 0.0f, 1.0f, 0.5f, 1e-3f, 100.0f, -1.0f, std::numeric_limits<float>::quiet_NaN()});
  std::size_t const names_variant = d.below(8);  // 0: names of the wrong count (refused); 1-3 names; else none
  call_name call("unscale_and_check");
  call << (in_place ? " in_place" : " deferred") << (inverse ? " inverse_scale " : " scale ") << scale << " max_norm "
       << max_norm << " [";
  std::vector<any_guarded> grads;
  grads.reserve(count);
  std::int64_t const budget = max_elements / static_cast<std::int64_t>(std::max<std::size_t>(count, 1));
  for (std::size_t i = 0; i < count; ++i) {
    kind const k = draw_kind(d);
    auto e = d.extents(1 + d.below(2), 257, budget);
    call << (i ? ", " : "") << kind_name(k) << extents_text(e);
    grads.emplace_back(exec, k, e, static_cast<std::int64_t>(d.byte() % 8));
    grads.back().fill(d, hostile);
    call << "+" << grads.back().visit([](auto& g) { return g.offset(); });
  }
  call << "]";
  std::vector<mpx::tensor_ref<space>> refs;
  for (auto& g : grads) refs.push_back(g.ref());
  std::vector<std::string> names;
  if (names_variant == 0) {
    std::size_t const n = count >= 2 && d.coin() ? count - 1 : count + 1;  // never 0: no names is valid
    for (std::size_t i = 0; i < n; ++i) names.push_back("n" + std::to_string(i));
    call << " with " << names.size() << " names";
    require_refusal(call, {"names", "gradients"}, [&] { mpx::gradient_list<mpx::host_executor> list(exec, refs, names); });
    return;
  }
  if (names_variant <= 3)
    for (std::size_t i = 0; i < count; ++i) names.push_back("layer" + std::to_string(i) + "/w");
  if (std::size_t const twice = d.byte() >= 240 && count > 0 ? d.below(count) : count;
      twice < count && refs[twice].size() != 0) {  // a gradient listed twice: unscaled twice in place, so refused
    refs.push_back(refs[twice]);
    if (!names.empty()) names.push_back("again");
    call << " with gradient " << twice << " listed twice";
    require_refusal(call, {"overlap"}, [&] { mpx::gradient_list<mpx::host_executor> list(exec, refs, names); });
    return;
  }

  std::vector<std::vector<double>> before;
  std::vector<std::vector<std::uint32_t>> before_bits;
  for (auto& g : grads) before.push_back(g.wide()), before_bits.push_back(g.bits());

  std::optional<mpx::gradient_list<mpx::host_executor>> list;
  require_accepted(call, [&] { list.emplace(exec, refs, names); });
  if (list->size() != count) fail(call.str() + ": the list holds " + std::to_string(list->size()) + " gradients");
  auto const mode = in_place ? mpx::unscaling::in_place : mpx::unscaling::deferred;
  mpx::tensor<float> s = mpx::make_tensor<float>(exec, mpx::shape{1});
  s.data()[0] = scale;
  require_accepted(call, [&] {
    if (inverse) mpx::unscale_and_check(exec, *list, mpx::inverse_scale{s.data()}, max_norm, mode);
    else mpx::unscale_and_check(exec, *list, s.data(), max_norm, mode);
  });
  float const factor = inverse ? scale : 1.0f / scale;  // documented: x * (1 / scale), or x * inverse as given

  std::int32_t first = -1, last = -1;
  std::vector<double> all;
  std::vector<tracked> tensor_norms;
  for (std::size_t t = 0; t < count; ++t) {
    std::string const what = "gradient " + std::to_string(t);
    grads[t].guards(call, what);
    std::vector<double> expected(before[t].size());
    bool bad_tensor = false;
    grads[t].visit([&](auto& g) {
      using T = elem_t<decltype(g)>;
      for (std::size_t i = 0; i < expected.size(); ++i) {
        bool bad = false;
        expected[i] = unscaled_value<T>(before[t][i], factor, bad, in_place);
        bad_tensor |= bad;
      }
      if (in_place) {
        std::vector<T> want(expected.size());
        for (std::size_t i = 0; i < want.size(); ++i) want[i] = mpx::cast<T>(static_cast<float>(expected[i]));
        auto const got = g.values();
        require_same<T>(call, what + " (unscaled in place, x * (1 / scale) exactly)", got, want);
      }
    });
    if (!in_place) require_same_bits(call, what + " (deferred: left scaled)", grads[t].bits(), before_bits[t]);
    if (bad_tensor) {
      if (first < 0) first = static_cast<std::int32_t>(t);
      last = static_cast<std::int32_t>(t);
    }
    tensor_norms.push_back(bad_tensor ? wild_value() : norm_of(expected));
    all.insert(all.end(), expected.begin(), expected.end());
  }
  auto const summary = list->summary(exec);
  if (summary.found_nonfinite != (first >= 0 ? 1u : 0u) || summary.first_nonfinite != first || summary.last_nonfinite != last)
    fail(call.str() + ": the verdict says found " + std::to_string(summary.found_nonfinite) + ", first " +
         std::to_string(summary.first_nonfinite) + ", last " + std::to_string(summary.last_nonfinite) + "; due: found " +
         std::to_string(first >= 0) + ", first " + std::to_string(first) + ", last " + std::to_string(last));
  auto const norms = list->norms(exec);
  if (norms.size() != count) fail(call.str() + ": norms() has the wrong size");
  for (std::size_t t = 0; t < count; ++t) check_tracked(call, "norms()", t, norms[t], tensor_norms[t]);
  if (first >= 0) {
    if (std::isfinite(summary.norm)) fail(call.str() + ": a finite norm with a non-finite gradient");
    return;
  }
  tracked const norm = norm_of(all);
  check_tracked(call, "norm", 0, summary.norm, norm);
  check_tracked(call, "clip_coefficient", 0, summary.clip_coefficient, clip_of(norm, max_norm));
  if (!(max_norm > 0) && summary.clip_coefficient != 1.0f) fail(call.str() + ": clipping without a max_norm");
  float const want_factor = in_place ? summary.clip_coefficient : summary.clip_coefficient * factor;
  if (mpx::bits(summary.gradient_factor) != mpx::bits(want_factor) && !(std::isnan(want_factor) && std::isnan(summary.gradient_factor)))
    fail(call.str() + ": gradient_factor " + std::to_string(summary.gradient_factor) + ", clip_coefficient" +
         (in_place ? "" : " * inverse scale") + " = " + std::to_string(want_factor) + " due");
}

// --- The optimizers -------------------------------------------------------------------
enum class rule_kind { sgd, adam, adamw };

struct hyper {
  rule_kind rule{};
  float lr = 1e-3f;
  mpx::sgd_options sgd{};
  mpx::adam_options adam{};
  mpx::master_weight_options masters{};
};

//! One element's state in the reference: the float master weight (or the value itself),
//! the rule's slots.
struct element_state {
  tracked w, s0, s1;
};

//! One step of the documented rule (docs/optimizers.md, PyTorch's) on one element, in
//! tracked float operations, in the order the docs write them.
inline void reference_step(hyper const& h, std::uint64_t t, tracked g, element_state& st) {
  tracked const lr = exact(h.lr);
  if (h.rule == rule_kind::sgd) {
    auto const& o = h.sgd;
    if (o.weight_decay != 0) g = add(g, mul(exact(o.weight_decay), st.w));
    if (o.momentum != 0) {
      st.s0 = t == 1 ? g : add(mul(exact(o.momentum), st.s0), mul(float_constant(1.0 - o.dampening), g));
      g = o.nesterov ? add(g, mul(exact(o.momentum), st.s0)) : st.s0;
    }
    st.w = sub(st.w, mul(lr, g));
    return;
  }
  auto const& o = h.adam;
  if (o.weight_decay != 0) {
    if (h.rule == rule_kind::adamw) st.w = sub(st.w, mul(mul(lr, exact(o.weight_decay)), st.w));
    else g = add(g, mul(exact(o.weight_decay), st.w));
  }
  // The bias corrections: in float64, rounded once to float (docs/optimizers.md).
  double const bias1 = 1 - std::pow(static_cast<double>(o.beta1), static_cast<double>(t));
  double const bias2 = 1 - std::pow(static_cast<double>(o.beta2), static_cast<double>(t));
  tracked const step_size = float_constant(static_cast<double>(h.lr) / bias1);
  tracked const inverse_sqrt_bias2 = float_constant(1 / std::sqrt(bias2));
  st.s0 = add(st.s0, mul(float_constant(1.0 - o.beta1), sub(g, st.s0)));
  st.s1 = add(mul(exact(o.beta2), st.s1), mul(mul(float_constant(1.0 - o.beta2), g), g));
  st.w = sub(st.w, div(mul(step_size, st.s0), add(mul(square_root(st.s1), inverse_sqrt_bias2), exact(o.epsilon))));
}

//! Parameters, their gradients, and the reference state of every element.
struct model_under_test {
  std::vector<any_guarded> values, grads;
  std::vector<std::vector<element_state>> state;
  std::vector<std::string> names;
};

inline void draw_model(draw& d, mpx::host_executor const& exec, model_under_test& m, call_name& call, bool hostile) {
  std::size_t const count = d.below(5);
  std::int64_t const budget = max_elements / 2 / static_cast<std::int64_t>(std::max<std::size_t>(count, 1));
  m.values.reserve(count);
  m.grads.reserve(count);
  call << " [";
  for (std::size_t i = 0; i < count; ++i) {
    kind const k = draw_kind(d);
    auto e = d.extents(1 + d.below(2), 257, budget);
    m.names.push_back("p" + std::to_string(i));
    m.values.emplace_back(exec, k, e, static_cast<std::int64_t>(d.byte() % 8));
    m.grads.emplace_back(exec, k, e, static_cast<std::int64_t>(d.byte() % 8));
    m.values.back().fill(d, hostile);
    call << (i ? ", " : "") << kind_name(k) << extents_text(e) << "+" << m.values.back().visit([](auto& g) { return g.offset(); });
    std::vector<element_state> st;
    for (double w : m.values.back().wide()) st.push_back({exact(w), exact(0), exact(0)});
    m.state.push_back(std::move(st));
  }
  call << "]";
}

inline std::vector<param> parameters_of(model_under_test& m) {
  std::vector<param> out;
  for (std::size_t i = 0; i < m.values.size(); ++i) out.push_back({m.names[i], m.values[i].ref(), m.grads[i].ref(), {}});
  return out;
}

//! Hyperparameters: valid ones drawn from what training uses, the edges included (0
//! rates and decays, beta 0, momentum 1, epsilon 1).
inline hyper draw_hyper(draw& d, rule_kind rule, call_name& call) {
  hyper h;
  h.rule = rule;
  h.lr = d.pick<float>({1e-3f, 0.1f, 0.01f, 1.0f, 0.0f, 0.5f, 3e-4f});
  call << (rule == rule_kind::sgd ? "sgd" : rule == rule_kind::adam ? "adam" : "adamw") << " lr " << h.lr;
  if (rule == rule_kind::sgd) {
    h.sgd.momentum = d.pick<float>({0.0f, 0.9f, 0.5f, 1.0f});
    h.sgd.dampening = h.sgd.momentum > 0 ? d.pick<float>({0.0f, 0.1f, 0.5f}) : 0.0f;
    h.sgd.weight_decay = d.pick<float>({0.0f, 1e-2f, 0.1f});
    h.sgd.nesterov = h.sgd.momentum > 0 && h.sgd.dampening == 0 && d.coin();
    call << " momentum " << h.sgd.momentum << " dampening " << h.sgd.dampening << " weight_decay " << h.sgd.weight_decay
         << (h.sgd.nesterov ? " nesterov" : "");
  } else {
    h.adam.beta1 = d.pick<float>({0.9f, 0.0f, 0.5f, 0.99f});
    h.adam.beta2 = d.pick<float>({0.999f, 0.0f, 0.9f, 0.99f});
    h.adam.epsilon = d.pick<float>({1e-8f, 1e-6f, 1e-3f, 1.0f});
    h.adam.weight_decay = d.pick<float>({0.0f, 1e-2f, 0.1f});
    call << " betas " << h.adam.beta1 << "," << h.adam.beta2 << " epsilon " << h.adam.epsilon << " weight_decay "
         << h.adam.weight_decay;
  }
  if (d.coin()) {
    h.masters.master = mpx::master_weights::none;
    h.masters.stochastic_rounding = d.coin();
    h.masters.seed = d.byte();
    call << (h.masters.stochastic_rounding ? " no masters, stochastic" : " no masters");
  }
  return h;
}

//! One optimizer of any rule, made from the drawn hyperparameters.
template <class F>
void with_optimizer(mpx::host_executor const& exec, std::vector<param> params, hyper const& h, F&& fn) {
  if (h.rule == rule_kind::sgd) {
    mpx::sgd opt(exec, std::move(params), h.lr, h.sgd, h.masters);
    fn(opt);
  } else if (h.rule == rule_kind::adam) {
    mpx::adam opt(exec, std::move(params), h.lr, h.adam, h.masters);
    fn(opt);
  } else {
    mpx::adamw_options const o{h.adam.beta1, h.adam.beta2, h.adam.epsilon, h.adam.weight_decay};
    mpx::adamw opt(exec, std::move(params), h.lr, o, h.masters);
    fn(opt);
  }
}

//! Checks every value against the reference after step t (the stored value: the
//! reference master weight rounded to T, or itself for float).
inline void check_values(call_name const& call, model_under_test& m, hyper const& h, std::size_t step) {
  for (std::size_t p = 0; p < m.values.size(); ++p) {
    std::string const what = "step " + std::to_string(step) + " " + m.names[p];
    m.values[p].guards(call, what + " value");
    m.grads[p].guards(call, what + " gradient");
    m.values[p].visit([&](auto& g) {
      using T = elem_t<decltype(g)>;
      auto const got = g.wide();
      bool const stochastic = h.masters.master == mpx::master_weights::none && h.masters.stochastic_rounding;
      for (std::size_t i = 0; i < got.size(); ++i) {
        auto& st = m.state[p][i];
        tracked const stored = round_to<T>(st.w, stochastic);
        check_tracked(call, what, i, got[i], stored);
        // Without master weights the next step starts from the stored value.
        if (!std::is_same_v<T, float> && h.masters.master == mpx::master_weights::none)
          st.w = std::isnan(got[i]) || stored.wild() ? stored : tracked{got[i], 0};
      }
    });
  }
}

inline void run_optimizer(draw& d, rule_kind rule) {
  mpx::host_executor exec;
  call_name call("");
  hyper h = draw_hyper(d, rule, call);
  bool const hostile = d.coin();
  model_under_test m;
  draw_model(d, exec, m, call, hostile);
  std::size_t const steps = 1 + d.below(3);
  call << " steps " << steps;

  // The invalid variants: each must be refused when the optimizer is made (or stepped),
  // naming what is wrong.
  std::size_t const variant = d.byte() < 176 ? 0 : 1 + d.below(7);
  auto params = parameters_of(m);
  auto const make = [&](hyper const& hh, std::vector<param> ps) { with_optimizer(exec, std::move(ps), hh, [](auto&) {}); };
  if (variant == 1 && !params.empty()) {  // a gradient of another shape or dtype than its parameter
    std::size_t const p = d.below(params.size());
    auto& v = m.values[p];
    bool const other_dtype = d.coin();
    kind const k = other_dtype ? (v.k == kind::f32 ? kind::f16 : kind::f32) : v.k;
    auto e = v.visit([](auto& g) { return g.extents(); });
    if (!other_dtype) {
      if (e.size() == 2 && e[0] != e[1]) std::swap(e[0], e[1]);
      else e.back() += 1;
    }
    any_guarded wrong(exec, k, e, 0);
    params[p].gradient = wrong.ref();
    call << " with " << m.names[p] << "'s gradient " << kind_name(k) << extents_text(e);
    require_refusal(call, {"'" + m.names[p] + "'", "gradient"}, [&] { make(h, params); });
    return;
  }
  if (variant == 2) {  // a learning rate that is negative, NaN or infinite
    hyper bad = h;
    bad.lr = d.pick<float>({-0.1f, std::numeric_limits<float>::quiet_NaN(), HUGE_VALF, -HUGE_VALF, -0x1p-149f});
    call << " with learning rate " << bad.lr;
    require_refusal(call, {"learning rate"}, [&] { make(bad, params); });
    return;
  }
  if (variant == 3) {  // an option out of its range
    hyper bad = h;
    float const nan = std::numeric_limits<float>::quiet_NaN();
    std::string name;
    if (rule == rule_kind::sgd) {
      switch (d.below(3)) {
        case 0: bad.sgd.momentum = d.pick<float>({-0.5f, nan, -HUGE_VALF}), name = "momentum"; break;
        case 1: bad.sgd.nesterov = true, bad.sgd.momentum = 0, name = "Nesterov"; break;
        default: bad.sgd.nesterov = true, bad.sgd.momentum = 0.9f, bad.sgd.dampening = 0.5f, name = "Nesterov"; break;
      }
      call << " with momentum " << bad.sgd.momentum << " dampening " << bad.sgd.dampening << (bad.sgd.nesterov ? " nesterov" : "");
    } else {
      switch (d.below(3)) {
        case 0: bad.adam.beta1 = d.pick<float>({1.0f, -0.1f, nan, 1.5f}), name = "beta1 and beta2"; break;
        case 1: bad.adam.beta2 = d.pick<float>({1.0f, -0.1f, nan, HUGE_VALF}), name = "beta1 and beta2"; break;
        default: bad.adam.epsilon = d.pick<float>({0.0f, -1e-8f, nan, -0.0f}), name = "epsilon"; break;
      }
      call << " with betas " << bad.adam.beta1 << "," << bad.adam.beta2 << " epsilon " << bad.adam.epsilon;
    }
    require_refusal(call, {name}, [&] { make(bad, params); });
    return;
  }
  if (variant == 4) {  // stochastic rounding with float master weights
    hyper bad = h;
    bad.masters = {mpx::master_weights::float32, true, 0};
    call << " with float32 masters and stochastic rounding";
    require_refusal(call, {"stochastic rounding"}, [&] { make(bad, params); });
    return;
  }
  if (variant == 5 && !params.empty()) {  // a step with no backward since the last (model-owned gradients)
    auto count = std::make_shared<mpx::model_history>();
    for (auto& p : params) p.written_by = count;
    if (d.coin()) {  // or the model was built again after the optimizer was made: its tensors are freed
      call << " after the model was built again";
      count->passes = 1;
      with_optimizer(exec, params, h, [&](auto& opt) {
        count->builds = 1;
        auto const before = m.values[0].bits();
        require_refusal(call, {"no longer the model's", "last build"}, [&] { opt.step(exec); });
        require_same_bits(call, "p0 after the refused step", m.values[0].bits(), before);
      });
      return;
    }
    bool const second = d.coin();
    call << (second ? " a second step with no backward" : " a step before any backward");
    with_optimizer(exec, params, h, [&](auto& opt) {
      if (second) {
        count->passes = 1;
        require_accepted(call, [&] { opt.step(exec); });
      }
      auto const before = m.values[0].bits();
      require_refusal(call, {"backward", "allow_step_without_backward"}, [&] { opt.step(exec); });
      require_same_bits(call, "p0 after the refused step", m.values[0].bits(), before);
    });
    return;
  }
  if (variant == 7 && !params.empty()) {  // a parameter listed twice, or a gradient in its value's memory
    std::size_t const p = d.below(params.size());
    if (params[p].value.size() == 0) return;  // an empty tensor shares no memory
    if (d.coin()) {
      params.push_back(params[p]);
      call << " with " << m.names[p] << " listed twice";
    } else {
      params[p].gradient = params[p].value;
      call << " with " << m.names[p] << "'s gradient in its value's memory";
    }
    require_refusal(call, {"overlap", "'" + m.names[p] + "'"}, [&] { make(h, params); });
    return;
  }
  if (variant == 6) {  // A weight decay or dampening that is negative, NaN or infinite
    hyper bad = h;
    float const v = d.pick<float>({std::numeric_limits<float>::quiet_NaN(), HUGE_VALF, -0.1f});
    std::string name = "weight_decay";
    if (rule == rule_kind::sgd && d.coin()) bad.sgd.momentum = 0.9f, bad.sgd.nesterov = false, bad.sgd.dampening = v, name = "dampening";
    else if (rule == rule_kind::sgd) bad.sgd.weight_decay = v;
    else bad.adam.weight_decay = v;
    call << " with " << name << " " << v;
    if (name == "dampening" && v < 0) return;  // a negative dampening is PyTorch's too: allowed
    require_refusal(call, {name}, [&] { make(bad, params); });
    return;
  }

  // A valid call: steps on hand-written gradients, each checked against the reference.
  // With a model's count attached (and the opt-out set), the refusal must not fire.
  bool const owned = variant == 7;
  if (owned) {
    auto count = std::make_shared<mpx::model_history>();
    for (auto& p : params) p.written_by = count;
    call << " (owned, allow_step_without_backward)";
  }
  with_optimizer(exec, params, h, [&](auto& opt) {
    if (owned) opt.allow_step_without_backward(true);
    for (std::size_t t = 1; t <= steps; ++t) {
      bool const hostile_grads = d.coin();
      for (auto& g : m.grads) g.fill(d, hostile_grads);
      std::vector<std::vector<std::uint32_t>> grad_bits;
      for (auto& g : m.grads) grad_bits.push_back(g.bits());
      require_accepted(call, [&] { opt.step(exec); });
      for (std::size_t p = 0; p < m.values.size(); ++p) {
        require_same_bits(call, "step " + std::to_string(t) + " " + m.names[p] + " gradient (read only)", m.grads[p].bits(), grad_bits[p]);
        auto const g = m.grads[p].wide();
        for (std::size_t i = 0; i < g.size(); ++i) reference_step(h, t, exact(g[i]), m.state[p][i]);
      }
      check_values(call, m, h, t);
      if (opt.steps(exec) != t) fail(call.str() + ": steps() is " + std::to_string(opt.steps(exec)) + " after " + std::to_string(t));
    }
  });
}

// --- loss_scale_optimizer -------------------------------------------------------------

//! docs/loss_scaling.md's rule, transcribed from the docs (not mpx's code): a dynamic
//! rule, or a static one (fixed scale, always at its floor).
struct scale_reference {
  bool dynamic;
  mpx::dynamic_scale_rule r;
  float scale;
  std::int32_t good = 0, left;
  std::uint64_t applied = 0, skipped = 0;
  std::uint32_t at_minimum = 0, last_skipped = 0;

  void step(bool found) {
    last_skipped = found ? 1 : 0;
    if (found) {
      skipped += 1;
      at_minimum = !dynamic || scale <= r.min_scale ? at_minimum + 1 : 0;
      if (!dynamic) return;
      good = 0;
      if (left > 0) left -= 1;
      if (left == 0) scale = std::max(scale * r.backoff_factor, r.min_scale);
      return;
    }
    applied += 1;
    at_minimum = 0;
    if (!dynamic) return;
    good += 1;
    if (good == r.growth_interval) {
      good = 0;
      left = r.hysteresis;
      float const grown = scale * r.growth_factor;
      if (std::isfinite(grown)) scale = std::min(grown, r.max_scale);
    }
  }
  bool matches(mpx::loss_scale_state const& s) const {
    return mpx::bits(s.scale) == mpx::bits(scale) && s.applied_steps == applied && s.skipped_steps == skipped &&
           s.overflows_at_minimum == at_minimum && s.last_step_skipped == last_skipped &&
           (!dynamic || (s.good_steps == good && s.overflows_left == left));
  }
};

inline void run_loss_scale(draw& d) {
  mpx::host_executor exec;
  call_name call("loss_scale_optimizer ");
  rule_kind const rule = d.pick({rule_kind::sgd, rule_kind::adam, rule_kind::adamw});
  hyper h = draw_hyper(d, rule, call);
  bool const dynamic = d.coin();
  mpx::dynamic_scale_rule r;
  r.initial_scale = d.pick<float>({1024.0f, 1.0f, 2.0f, 32768.0f, 65536.0f, 3.0f, 0.5f, 0x1p100f});
  r.growth_factor = d.pick<float>({2.0f, 4.0f, 1.0f, 3.0f});
  r.backoff_factor = d.pick<float>({0.5f, 0.25f, 1.0f, 0.75f});
  r.growth_interval = 1 + static_cast<std::int32_t>(d.below(3));
  r.hysteresis = 1 + static_cast<std::int32_t>(d.below(2));
  r.min_scale = std::min(r.initial_scale, d.pick<float>({1.0f, 0.25f, 1024.0f}));
  r.max_scale = d.pick<float>({std::numeric_limits<float>::max(), 65536.0f, r.initial_scale});
  if (r.max_scale < r.initial_scale) r.max_scale = r.initial_scale;
  r.report_after = 1 + static_cast<std::uint32_t>(d.below(3));
  float const clip = d.pick<float>({0.0f, 0.0f, 1.0f, 1e-2f, 100.0f});
  if (dynamic)
    call << " dynamic scale " << r.initial_scale << " growth " << r.growth_factor << "/" << r.growth_interval << " backoff "
         << r.backoff_factor << " hysteresis " << r.hysteresis << " min " << r.min_scale << " max " << r.max_scale;
  else
    call << " static scale " << r.initial_scale;
  call << " report_after " << r.report_after << " clip " << clip;

  // Invalid scalers: refused when made, naming what is wrong.
  if (d.byte() >= 208) {
    float const nan = std::numeric_limits<float>::quiet_NaN();
    float const bad_scale = d.pick<float>({0.0f, -1.0f, nan, HUGE_VALF, -0.0f});
    if (!dynamic) {
      call << " with scale " << bad_scale;
      require_refusal(call, {"loss scale"}, [&] { mpx::static_loss_scaler<mpx::host_executor> s(exec, bad_scale); });
      return;
    }
    mpx::dynamic_scale_rule bad = r;
    std::string name;
    switch (d.below(6)) {
      case 0: bad.initial_scale = bad_scale, name = "initial_scale"; break;
      case 1: bad.growth_interval = -static_cast<std::int32_t>(d.below(2)), name = "growth_interval"; break;
      case 2: bad.backoff_factor = d.pick<float>({0.0f, 1.5f, nan, -0.5f}), name = "backoff_factor"; break;
      case 3: bad.growth_factor = d.pick<float>({0.5f, nan, 0.0f}), name = "growth_factor"; break;
      case 4: bad.hysteresis = 0, name = "hysteresis"; break;
      default: bad.report_after = 0, name = "report_after"; break;
    }
    call << " with a bad " << name;
    require_refusal(call, {name}, [&] { mpx::dynamic_loss_scaler<mpx::host_executor> s(exec, bad); });
    return;
  }

  model_under_test m;
  draw_model(d, exec, m, call, d.coin());
  std::size_t const steps = 1 + d.below(4);
  call << " steps " << steps;
  mpx::static_scale_rule sr{r.initial_scale, r.report_after};
  auto const body = [&](auto& opt, auto& scaler) {
    std::size_t reports = 0;
    mpx::loss_scale_optimizer lso(std::move(opt), std::move(scaler), {clip});
    lso.scaler().on_stuck([&](mpx::loss_scale_report const&) { ++reports; });
    scale_reference want{dynamic, r, r.initial_scale, 0, r.hysteresis};
    std::size_t want_reports = 0;
    for (std::size_t t = 1; t <= steps; ++t) {
      bool const hostile_grads = d.coin();
      for (auto& g : m.grads) g.fill(d, hostile_grads);
      std::vector<std::vector<std::uint32_t>> grad_bits, value_bits;
      for (auto& g : m.grads) grad_bits.push_back(g.bits());
      for (auto& v : m.values) value_bits.push_back(v.bits());
      float const scale = want.scale;
      float const inverse = 1.0f / scale;
      require_accepted(call, [&] { lso.step(exec); });
      // The verdict: found exactly when a gradient times the inverse scale, in float, is not finite.
      bool found = false;
      std::vector<double> unscaled;
      for (std::size_t p = 0; p < m.grads.size(); ++p) {
        require_same_bits(call, "step " + std::to_string(t) + " " + m.names[p] + " gradient (read only)", m.grads[p].bits(), grad_bits[p]);
        for (double g : m.grads[p].wide()) {
          float const x = static_cast<float>(g * static_cast<double>(inverse));
          found |= !std::isfinite(x);
          unscaled.push_back(x);
        }
      }
      auto const verdict = lso.last_check(exec);
      if ((verdict.found_nonfinite != 0) != found)
        fail(call.str() + ": step " + std::to_string(t) + " found_nonfinite is " + std::to_string(verdict.found_nonfinite));
      std::uint64_t const applied_before = want.applied;
      want.step(found);
      if (want.at_minimum == r.report_after) ++want_reports;
      if (found) {
        // Skipped: every value bit for bit as it was (the masters and slots show in the next applied step).
        for (std::size_t p = 0; p < m.values.size(); ++p)
          require_same_bits(call, "skipped step " + std::to_string(t) + " " + m.names[p], m.values[p].bits(), value_bits[p]);
      } else {
        // Applied: the factor the optimizer reads is clip * (1 / scale); then the rule on g * factor.
        tracked const norm = norm_of(unscaled);
        check_tracked(call, "norm", 0, verdict.norm, norm);
        check_tracked(call, "clip_coefficient", 0, verdict.clip_coefficient, clip_of(norm, clip));
        if (mpx::bits(verdict.gradient_factor) != mpx::bits(verdict.clip_coefficient * inverse))
          fail(call.str() + ": step " + std::to_string(t) + " gradient_factor is not clip_coefficient * (1 / scale)");
        for (std::size_t p = 0; p < m.values.size(); ++p) {
          auto const g = m.grads[p].wide();
          for (std::size_t i = 0; i < g.size(); ++i)
            reference_step(h, applied_before + 1, mul(exact(g[i]), exact(verdict.gradient_factor)), m.state[p][i]);
        }
        check_values(call, m, h, t);
      }
      auto const got = lso.scaler().state(exec);
      if (!want.matches(got))
        fail(call.str() + ": after step " + std::to_string(t) + " the scaler's state is scale " + std::to_string(got.scale) +
             " good " + std::to_string(got.good_steps) + " left " + std::to_string(got.overflows_left) + " applied " +
             std::to_string(got.applied_steps) + " skipped " + std::to_string(got.skipped_steps) + " at minimum " +
             std::to_string(got.overflows_at_minimum) + "; the documented rule gives scale " + std::to_string(want.scale) +
             " good " + std::to_string(want.good) + " left " + std::to_string(want.left) + " applied " +
             std::to_string(want.applied) + " skipped " + std::to_string(want.skipped) + " at minimum " +
             std::to_string(want.at_minimum));
      if (lso.optimizer().steps(exec) != want.applied)
        fail(call.str() + ": the optimizer counts " + std::to_string(lso.optimizer().steps(exec)) + " steps, " +
             std::to_string(want.applied) + " applied");
      if (reports != want_reports)
        fail(call.str() + ": " + std::to_string(reports) + " stuck reports after step " + std::to_string(t) + ", " +
             std::to_string(want_reports) + " due");
    }
  };
  with_optimizer(exec, parameters_of(m), h, [&](auto& opt) {
    if (dynamic) {
      mpx::dynamic_loss_scaler<mpx::host_executor> scaler(exec, r);
      body(opt, scaler);
    } else {
      mpx::static_loss_scaler<mpx::host_executor> scaler(exec, sr.scale, sr.report_after);
      body(opt, scaler);
    }
  });
}

}  // namespace optim_detail

void run_optim(draw& d) {
  using namespace optim_detail;
  switch (d.below(5)) {
    case 0: run_unscale(d); break;
    case 1: run_optimizer(d, rule_kind::sgd); break;
    case 2: run_optimizer(d, rule_kind::adam); break;
    case 3: run_optimizer(d, rule_kind::adamw); break;
    default: run_loss_scale(d); break;
  }
}

}  // namespace mpx_fuzz::api
