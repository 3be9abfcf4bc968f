// The attention core in fp8 (kernels/fp8_attention.hpp, causal_self_attention's
// fp8_attention): against a float64 reference that quantizes where cuDNN's fp8 SDPA
// does, at awkward token counts, with and without dropout; the amaxes it records; the
// layer's refusals.
#include "support/reference/fp8_tensorwise.hpp"
#include "support/reference/fused_attention.hpp"
#include "support/testing.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using mpx::float8_e4m3;
using mpx::float8_e5m2;

// The spacing of Format's values around |x| (its subnormal spacing below the normals).
template <class Format>
double fp8_step(double x) {
  constexpr int mantissa = std::is_same_v<Format, float8_e4m3> ? 3 : 2;
  constexpr int min_exponent = std::is_same_v<Format, float8_e4m3> ? -6 : -14;
  int const e = std::max(static_cast<int>(std::floor(std::log2(std::max(std::abs(x), 1e-30)))), min_exponent);
  return std::ldexp(1.0, e - mantissa);
}

// x rounded to float (as the kernel holds it), cast at `scale` and dequantised.
template <class Format>
double quantized(double x, float scale) {
  return mpx_test::reference::dequantised<Format>(static_cast<float>(x), scale);
}

// The scales a pass cast with, as floats.
struct core_scales {
  float qkv, s, o, d_o, dp, dqkv;
};

// The core in float64. `internal` quantizes P and dS as the kernel does (e4m3 and e5m2
// at their scales); without it they stay exact, to show the test sees that quantization.
struct core_reference {
  std::size_t B, T, H, hw;
  double logit_scale;
  std::vector<double> keep;  // [B*H, T, T]: 0 or 1/(1-rate); empty: no dropout
  core_scales sc;
  bool internal = true;
  std::vector<double> o, dqkv;  // O [B*T, H*hw] and dQ dK dV [B*T, 3*H*hw], before their casts
  double amax_s = 0, amax_o = 0, amax_dp = 0, amax_dqkv = 0;

  void run(std::vector<double> const& qkv, std::vector<double> const& d_o) {
    std::size_t const W = H * hw;
    auto at = [&](std::size_t part, std::size_t b, std::size_t t, std::size_t h) { return (b * T + t) * 3 * W + part * W + h * hw; };
    auto orow = [&](std::size_t b, std::size_t t, std::size_t h) { return (b * T + t) * W + h * hw; };
    auto p8 = [&](double p) { return internal ? quantized<float8_e4m3>(p, sc.s) : p; };
    auto ds8 = [&](double d) { return internal ? quantized<float8_e5m2>(d, sc.dp) : d; };
    o.assign(B * T * W, 0.0);
    dqkv.assign(B * T * 3 * W, 0.0);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h) {
        std::size_t const bh = b * H + h;
        std::vector<double> p(T * T, 0.0), kept(T * T, 0.0);
        for (std::size_t i = 0; i < T; ++i) {
          std::vector<double> s(i + 1);
          double m = -INFINITY;
          for (std::size_t j = 0; j <= i; ++j) {
            double dot = 0;
            for (std::size_t d = 0; d < hw; ++d) dot += qkv[at(0, b, i, h) + d] * qkv[at(1, b, j, h) + d];
            s[j] = dot * logit_scale;
            m = std::max(m, s[j]);
          }
          double l = 0;
          for (double v : s) l += std::exp(v - m);
          for (std::size_t j = 0; j <= i; ++j) {
            p[i * T + j] = std::exp(s[j] - m) / l;
            kept[i * T + j] = keep.empty() ? 1.0 : keep[(bh * T + i) * T + j];
            double const pd = p[i * T + j] * kept[i * T + j];
            amax_s = std::max(amax_s, pd);
            for (std::size_t d = 0; d < hw; ++d) o[orow(b, i, h) + d] += p8(pd) * qkv[at(2, b, j, h) + d];
          }
          for (std::size_t d = 0; d < hw; ++d) amax_o = std::max(amax_o, std::abs(o[orow(b, i, h) + d]));
        }
        // D from the O the kernel cast (e4m3) and dO, as cuDNN reads them.
        std::vector<double> delta(T, 0.0);
        for (std::size_t i = 0; i < T; ++i)
          for (std::size_t d = 0; d < hw; ++d)
            delta[i] += d_o[orow(b, i, h) + d] * quantized<float8_e4m3>(o[orow(b, i, h) + d], sc.o);
        for (std::size_t i = 0; i < T; ++i)
          for (std::size_t j = 0; j <= i; ++j) {
            double dp = 0;
            for (std::size_t d = 0; d < hw; ++d) dp += d_o[orow(b, i, h) + d] * qkv[at(2, b, j, h) + d];
            double const pij = p[i * T + j], kij = kept[i * T + j];
            double const ds = pij * (dp * kij - delta[i]) * logit_scale;
            amax_dp = std::max(amax_dp, std::abs(ds));
            for (std::size_t d = 0; d < hw; ++d) {
              dqkv[at(0, b, i, h) + d] += ds8(ds) * qkv[at(1, b, j, h) + d];
              dqkv[at(1, b, j, h) + d] += ds8(ds) * qkv[at(0, b, i, h) + d];
              dqkv[at(2, b, j, h) + d] += p8(pij * kij) * d_o[orow(b, i, h) + d];
            }
          }
      }
    for (double v : dqkv) amax_dqkv = std::max(amax_dqkv, std::abs(v));
  }
};

// How an fp8 output matches its reference: the share of elements whose cast is the
// reference's cast exactly, and whether every other lies within one step of the format.
struct match {
  double exact = 0;
  bool within_a_step = true;
};
template <class Format>
match compare(std::vector<Format> const& got, std::vector<double> const& want, float scale) {
  match m;
  std::size_t same = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    double const g = mpx::detail::to_double(got[i]) * static_cast<double>(1.0f / scale);
    double const w = quantized<Format>(want[i], scale);
    if (g == w) {
      ++same;
      continue;
    }
    double const step = fp8_step<Format>(want[i] * scale) / scale;
    if (!(std::abs(g - want[i]) <= 1.5 * step)) {
      if (m.within_a_step) UNSCOPED_INFO("element " << i << ": got " << g << ", want " << want[i]);
      m.within_a_step = false;
    }
  }
  m.exact = static_cast<double>(same) / static_cast<double>(got.size());
  return m;
}

// One forward and backward of the core, its scales from a first pass's amaxes (delayed
// scaling's second step), against the reference.
template <class Exec>
void check_core(Exec const& exec, std::size_t B, std::size_t T, std::size_t H, std::size_t hw, float rate) {
  INFO("B=" << B << " T=" << T << " H=" << H << " head width " << hw << " dropout " << rate);
  std::size_t const W = H * hw, rows = B * T;
  mpx::attention_dims const d{static_cast<std::int64_t>(B), static_cast<std::int64_t>(T), static_cast<std::int64_t>(H),
                              static_cast<std::int64_t>(hw)};
  mpx::fp8_tensor_scale<float8_e4m3, Exec> qkv_s(exec), s_s(exec), o_s(exec);
  mpx::fp8_tensor_scale<float8_e5m2, Exec> d_o_s(exec), dp_s(exec), dqkv_s(exec);
  mpx::fp8_attention_scales const states{qkv_s.data(), s_s.data(), o_s.data(), d_o_s.data(), dp_s.data(), dqkv_s.data()};
  mpx::shape const qkv_shape{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(3 * W)},
      o_shape{static_cast<std::int64_t>(rows), static_cast<std::int64_t>(W)};
  auto const x = mpx_test::upload(exec, mpx_test::random_values<float>(rows * 3 * W, -2, 2, 700 + T), qkv_shape);
  auto const g = mpx_test::upload(exec, mpx_test::random_values<float>(rows * W, -1, 1, 701 + T), o_shape);
  auto qkv8 = mpx_test::poisoned<float8_e4m3>(exec, qkv_shape);
  auto d_o8 = mpx_test::poisoned<float8_e5m2>(exec, o_shape);
  mpx::shape const rows_shape{static_cast<std::int64_t>(B * H * T)};
  auto stats = mpx_test::poisoned<float>(exec, rows_shape), delta = mpx_test::poisoned<float>(exec, rows_shape);
  std::uint64_t const count = 3;  // the dropout's count of forwards, where the executor computes
  auto step = mpx_test::upload(exec, std::vector<std::uint64_t>{count}, mpx::shape{1});
  mpx::fp8_attention_problem const problem{d, qkv8.data(), stats.data(), states, 1.0f / std::sqrt(static_cast<float>(hw)),
                                           mpx::dropout_options{rate, 41, 0, step.data()}};
  auto o8 = mpx_test::poisoned<float8_e4m3>(exec, o_shape);
  auto dqkv8 = mpx_test::poisoned<float8_e5m2>(exec, qkv_shape);
  auto pass = [&] {
    mpx::cast_to_fp8(exec, mpx::view(x), qkv_s, mpx::view(qkv8));
    mpx::cast_to_fp8(exec, mpx::view(g), d_o_s, mpx::view(d_o8));
    mpx::fp8_attention_forward(exec, problem, o8.data());
    mpx::fp8_attention_backward(exec, problem, o8.data(), d_o8.data(), delta.data(), dqkv8.data());
  };
  pass();  // with scales of 1: records the amaxes the next pass's scales come from
  for (auto* s : {&qkv_s, &s_s, &o_s}) mpx::update_fp8_scale(exec, *s, mpx::delayed_scaling{});
  for (auto* s : {&d_o_s, &dp_s, &dqkv_s}) mpx::update_fp8_scale(exec, *s, mpx::delayed_scaling{});
  core_scales const used{qkv_s.values(exec).scale, s_s.values(exec).scale,  o_s.values(exec).scale,
                         d_o_s.values(exec).scale, dp_s.values(exec).scale, dqkv_s.values(exec).scale};
  for (float s : {used.qkv, used.s, used.o, used.d_o, used.dqkv}) REQUIRE(s != 1.0f);
  if (T > 1) REQUIRE(used.dp != 1.0f);  // (one token: dS = dP - D, zero or a rounding error)
  o8 = mpx_test::poisoned<float8_e4m3>(exec, o8.shape());
  dqkv8 = mpx_test::poisoned<float8_e5m2>(exec, dqkv8.shape());
  mpx::fill(exec, mpx::view(stats), std::numeric_limits<float>::quiet_NaN());  // the problem reads this buffer
  pass();

  // The reference reads the fp8 inputs the kernel read, dequantised.
  auto const qkv = mpx_test::download(exec, qkv8);
  auto const d_o = mpx_test::download(exec, d_o8);
  std::vector<double> qkv_d(qkv.size()), d_o_d(d_o.size());
  for (std::size_t i = 0; i < qkv.size(); ++i) qkv_d[i] = mpx::detail::to_double(qkv[i]) * static_cast<double>(1.0f / used.qkv);
  for (std::size_t i = 0; i < d_o.size(); ++i) d_o_d[i] = mpx::detail::to_double(d_o[i]) * static_cast<double>(1.0f / used.d_o);
  core_reference ref{B, T, H, hw, 1.0 / std::sqrt(static_cast<double>(hw)), {}, used, true, {}, {}, 0, 0, 0, 0};
  if (rate > 0) {  // the masks of the unfused path: mpx's Philox at (bh * T + i) * T + j, the count folded in
    ref.keep.assign(B * H * T * T, 0.0);
    mpx::dropout_options const folded{rate, 41, count, nullptr};
    for (std::size_t e = 0; e < ref.keep.size(); ++e)
      ref.keep[e] = mpx::dropout_keeps(folded, e) ? 1.0 / (1.0 - static_cast<double>(rate)) : 0.0;
  }
  ref.run(qkv_d, d_o_d);
  core_reference plain = ref;
  plain.internal = false;
  plain.run(qkv_d, d_o_d);

  auto const o = mpx_test::download(exec, o8);
  auto const dqkv = mpx_test::download(exec, dqkv8);
  match const mo = compare(o, ref.o, used.o), md = compare(dqkv, ref.dqkv, used.dqkv);
  match const po = compare(o, plain.o, used.o), pd = compare(dqkv, plain.dqkv, used.dqkv);
  INFO("O: " << mo.exact << " of the casts exact (" << po.exact << " against P unquantized); dQKV: " << md.exact << " ("
             << pd.exact << " against P and dS unquantized)");
  CHECK(mo.within_a_step);
  CHECK(md.within_a_step);
  // On the host every cast matched (against P and dS unquantized: 61 to 65% at more than
  // one token); a contracted multiply-add elsewhere may move a few across a midpoint.
  CHECK(mo.exact > 0.99);
  CHECK(md.exact > 0.98);
  if (T > 1) {  // the quantization of P and dS is what the reference matches (one token: P = 1, exact)
    CHECK(1 - po.exact > 10 * (1 - mo.exact));
    CHECK(1 - pd.exact > 10 * (1 - md.exact));
  }
  // Each row's log-sum-exp written; the amaxes recorded in this step (not yet moved to
  // the history) within float's rounding of the reference's.
  for (float s : mpx_test::download(exec, stats)) REQUIRE(std::isfinite(s));
  auto const recorded = [&](auto const& state) {
    return static_cast<double>(mpx::detail::bit_cast<float>(state.values(exec).step_amax_bits));
  };
  auto const near = [](double got, double want, double relative) {
    INFO("amax " << got << ", reference " << want);
    CHECK(std::abs(got - want) <= relative * want);
  };
  near(recorded(s_s), ref.amax_s, 1e-5);
  near(recorded(o_s), ref.amax_o, 3e-2);
  near(recorded(dp_s), ref.amax_dp, 3e-2);
  near(recorded(dqkv_s), ref.amax_dqkv, 3e-2);

  // The same inputs give the same bits.
  auto const o_first = o;
  o8 = mpx_test::poisoned<float8_e4m3>(exec, o8.shape());
  mpx::fp8_attention_forward(exec, problem, o8.data());
  auto const bits = [](std::vector<float8_e4m3> const& v) {
    std::vector<std::uint8_t> b;
    for (auto e : v) b.push_back(mpx::detail::bit_cast<std::uint8_t>(e));
    return b;
  };
  CHECK(bits(mpx_test::download(exec, o8)) == bits(o_first));
}

// The largest |a - b| over the largest |b| (infinite where a is not finite).
double largest_difference(std::vector<double> const& a, std::vector<double> const& b) {
  double m = 0, e = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return std::numeric_limits<double>::infinity();
    m = std::max(m, std::abs(b[i]));
    e = std::max(e, std::abs(a[i] - b[i]));
  }
  return e / m;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("the fp8 attention core matches float64 quantized where cuDNN's fp8 attention quantizes",
                        "[attention][fp8][fp8_attention]", mpx_test::executors) {
  TestType exec;
  check_core(exec, 2, 37, 2, 64, 0.0f);
  check_core(exec, 1, 129, 1, 128, 0.0f);
  check_core(exec, 1, 1, 1, 16, 0.0f);
  check_core(exec, 2, 45, 2, 64, 0.2f);
}

// On a GPU (Hopper and later) where cuDNN is linked, the fp8 core is cuDNN's fp8 SDPA;
// elsewhere mpx's, the core the test above checks.
TEMPLATE_LIST_TEST_CASE("causal_self_attention with fp8_attention trains near its bfloat16 core, and refuses what it "
                        "cannot run",
                        "[attention][layers][fp8][fp8_attention]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  mpx::shape const s{2, 21, 64};
  auto const x = mpx_test::upload(exec, mpx_test::random_values<mpx::bfloat16>(s.size(), -1.5, 1.5, 31), s);
  auto const dy = mpx_test::upload(exec, mpx_test::random_values<mpx::bfloat16>(s.size(), -1, 1, 32), s);
  // The same layer (same seed, same weights) with its core in bfloat16 and in fp8: two
  // steps, so the delayed scales of the second come from the first's amaxes.
  // With dropout both run unfused, so both draw mpx's masks (cuDNN's would differ, and
  // mpx does not run fp8 attention with dropout through cuDNN: see docs/transformers.md).
  auto run = [&](bool fp8_core, float dropout) {
    mpx::causal_self_attention<mpx::mixed_fp8> layer(
        {.heads = 2, .dropout = dropout, .fused = dropout == 0.0f, .fp8_attention = fp8_core});
    CHECK(layer.fp8_core() == fp8_core);
    layer.set_name("attention");
    layer.build(exec, {21, 64}, 5);
    layer.reserve(exec, 2);
    auto y = mpx_test::poisoned<mpx::bfloat16>(exec, s), dx = mpx_test::poisoned<mpx::bfloat16>(exec, s);
    for (int step = 0; step < 2; ++step) {
      layer.forward(exec, mpx::view(x), mpx::view(y), true);
      layer.backward(exec, mpx::view(x), mpx::tensor_view<mpx::bfloat16 const, space>(mpx::view(y)), mpx::view(dy),
                     mpx::view(dx));
    }
    if constexpr (mpx::is_host_executor_v<TestType>) CHECK_FALSE(layer.fused());  // the host runs mpx's core
    if (fp8_core) {
      if constexpr (mpx::is_host_executor_v<TestType>) {
        auto const sc = layer.template attention_core_scales<TestType>();
        std::array<mpx::fp8_scale_values const*, 6> const all{sc.qkv, sc.s, sc.o, sc.d_o, sc.dp, sc.dqkv};
        for (auto const* v : all) CHECK(v->scale != 1.0f);
      }
      CHECK_THROWS_TYPE_WITH(layer.template probabilities<space>(2), mpx::invalid_argument,
                             Catch::Matchers::Contains("fp8"));
      std::vector<mpx::fp8_scales_entry<TestType>> entries;
      layer.append_fp8_scales(entries);
      REQUIRE(entries.size() == 3);  // the two projections and the core
      CHECK(entries[2].name == "attention/attention_core");
      CHECK(entries[2].watched.size() == 6);  // all delayed under mixed_fp8
    }
    // mpx's masks where it drops: the same draws as the bfloat16 core's (compared below)
    auto const keeps = dropout > 0 ? layer.latest_dropout_keeps(exec) : std::vector<std::uint8_t>{};
    return std::tuple{mpx_test::widen(mpx_test::download(exec, y)), mpx_test::widen(mpx_test::download(exec, dx)), keeps};
  };
  for (float dropout : {0.0f, 0.15f}) {
    INFO("dropout " << dropout);
    auto const [y16, dx16, keeps16] = run(false, dropout);
    auto const [y8, dx8, keeps8] = run(true, dropout);
    CHECK(keeps8 == keeps16);  // the fp8 core drops what the bfloat16 core drops
    std::size_t dropped = 0;  // weights on or below the diagonal that the forward dropped
    for (std::size_t e = 0; e < keeps8.size(); ++e) dropped += e % 21 <= e / 21 % 21 && keeps8[e] == 0;
    CHECK((dropout > 0) == (dropped > 0));
    double const ey = largest_difference(y8, y16), edx = largest_difference(dx8, dx16);
    INFO("fp8 core against bfloat16 core: y " << ey << ", dx " << edx);
    CHECK(ey < 0.1);
    CHECK(edx < 0.2);
    CHECK(ey > 0);  // it did run another arithmetic
  }

  // Under a policy without fp8 the option has nothing to act on (a shadow's float32
  // twin, a tier that leaves fp8): the core runs in the storage dtype.
  mpx::causal_self_attention<mpx::mixed_bfloat16> plain({.heads = 2, .fp8_attention = true});
  CHECK_FALSE(plain.fp8_core());
  auto in_a_model = mpx::sequential<mpx::float32>(mpx::causal_self_attention<>({.heads = 2, .fp8_attention = true}));
  CHECK_FALSE(in_a_model.template layer<0>().fp8_core());
  // Under a block recipe it could act and cannot: refused, when the model gives the policy too.
  CHECK_THROWS_TYPE_WITH(mpx::causal_self_attention<mpx::mixed_fp8_block>({.heads = 2, .fp8_attention = true}),
                         mpx::invalid_argument, Catch::Matchers::Contains("block-scaled"));
  auto block_model = [] {
    return mpx::sequential<mpx::mixed_mxfp8>(mpx::causal_self_attention<>({.heads = 2, .fp8_attention = true}));
  };
  CHECK_THROWS_TYPE_WITH(block_model(), mpx::invalid_argument, Catch::Matchers::Contains("block-scaled"));
  mpx::causal_self_attention<mpx::mixed_fp8_current> wide({.heads = 1, .fp8_attention = true});
  CHECK_THROWS_TYPE_WITH(wide.build(exec, {4, 512}, 1), mpx::invalid_argument, Catch::Matchers::Contains("up to 256"));
}

// How far a fused fp8 attention's y and dx may lie from mpx's fp8 core's, relative to the
// largest value. cuDNN's fp8 graph casts P = softmax(S) to e4m3, as mpx's core does, but
// its single-pass kernel may cast exp(S - the row's max) and divide by the row's sum after
// P V. The host's float64 fused attention does either: the normalised cast matches mpx's
// core to the bit on these shapes; the other differs by up to 5.6e-2 in y and 5.9e-2 in
// dx over ten seeds (2.4e-2 and 3.2e-2 at this test's), and the bound covers both.
constexpr double fp8_fused_bound = 8e-2;

// `steps` training steps of causal_self_attention<mixed_fp8> with the core in fp8 (heads
// of 128, seed 8) on bfloat16 x and dy, fused where it can be, else on mpx's core: the
// last step's y and dx, whether it ran fused, and the amaxes its six scale states took
// from it. (The first step casts with every scale 1; later ones with the scales the
// amaxes gave.)
struct fp8_core_step_result {
  std::vector<double> y, dx;
  bool fused = false;
  std::array<float, 6> amaxes{};  // last_amax of qkv, s, o, d_o, dp, dqkv
};
template <class Exec, class X>
fp8_core_step_result fp8_core_step(Exec const& exec, X const& x, X const& dy, bool fused, int steps = 1) {
  using space = mpx::memory_space_t<Exec>;
  mpx::shape const s = x.shape();
  mpx::causal_self_attention<mpx::mixed_fp8> layer({.heads = 2, .fused = fused, .fp8_attention = true});
  layer.build(exec, {s[1], s[2]}, 8);
  layer.reserve(exec, s[0]);
  auto y = mpx_test::poisoned<mpx::bfloat16>(exec, s), dx = mpx_test::poisoned<mpx::bfloat16>(exec, s);
  for (int i = 0; i < steps; ++i) {
    layer.forward(exec, mpx::view(x), mpx::view(y), true);
    layer.backward(exec, mpx::view(x), mpx::tensor_view<mpx::bfloat16 const, space>(mpx::view(y)), mpx::view(dy),
                   mpx::view(dx));
  }
  fp8_core_step_result out{mpx_test::widen(mpx_test::download(exec, y)), mpx_test::widen(mpx_test::download(exec, dx)),
                           layer.fused(), {}};
  auto const sc = layer.template attention_core_scales<Exec>();
  mpx::fp8_scale_values* const states[] = {sc.qkv, sc.s, sc.o, sc.d_o, sc.dp, sc.dqkv};
  for (std::size_t i = 0; i < 6; ++i) {
    auto const v = mpx_test::download(exec, mpx::tensor_view<mpx::fp8_scale_values const, space>(states[i], mpx::shape{1}));
    out.amaxes[i] = v[0].last_amax;
  }
  return out;
}

// cuDNN's fp8 attention against mpx's fp8 core, on the same layer and inputs: on a GPU
// (Hopper and later) where cuDNN is linked, the first runs fused. One training step, so
// both cast with the same scales (a second would cast with scales from each one's own
// amaxes, which differ in their last bits and move every rounding). Heads of 128 (what
// cuDNN's fp8 backward takes on Hopper), 2 x 77 tokens. On the host both are mpx's core:
// the same bits.
TEMPLATE_LIST_TEST_CASE("cuDNN's fp8 attention matches mpx's fp8 core where a GPU runs it",
                        "[attention][layers][fp8][fp8_attention][fused]", mpx_test::executors) {
  TestType exec;
  mpx::shape const s{2, 77, 256};
  auto const x = mpx_test::upload(exec, mpx_test::random_values<mpx::bfloat16>(s.size(), -1.5, 1.5, 51), s);
  auto const dy = mpx_test::upload(exec, mpx_test::random_values<mpx::bfloat16>(s.size(), -1, 1, 52), s);
  auto run = [&](bool fused) {
    auto const step = fp8_core_step(exec, x, dy, fused);
    return std::tuple{step.y, step.dx, step.fused};
  };
  auto const [y_fused, dx_fused, fused] = run(true);
  auto const [y_core, dx_core, core_fused] = run(false);
  CHECK_FALSE(core_fused);
  // With dropout the fp8 core never runs through cuDNN (its fp8 backward graph puts no
  // mask on dP): mpx's core runs, and says why.
  {
    mpx::causal_self_attention<mpx::mixed_fp8> dropping({.heads = 2, .dropout = 0.1f, .fp8_attention = true});
    dropping.build(exec, {77, 256}, 8);
    dropping.reserve(exec, 2);
    auto y = mpx_test::poisoned<mpx::bfloat16>(exec, s);
    dropping.forward(exec, mpx::view(x), mpx::view(y), true);
    CHECK_FALSE(dropping.fused());
  }
  if constexpr (mpx::is_host_executor_v<TestType>) {
    CHECK_FALSE(fused);
    CHECK(y_fused == y_core);
    CHECK(dx_fused == dx_core);
  } else {
#if MPX_HAS_CUDNN
    int device = 0, major = 0;
    MPX_CUDA_CHECK(cudaGetDevice(&device));
    MPX_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    INFO("where this fails, the line 'causal_self_attention runs unfused' on stderr says why cuDNN refused");
    CHECK(fused == (major >= 9));
#endif
    // The two differ in the order of their float sums, and so in an fp8 value here and
    // there where a sum lies near a rounding midpoint; and cuDNN's single-pass kernel may
    // cast the probabilities before they are normalised, where mpx's core casts them
    // after (fp8_fused_bound says how far apart that puts them).
    double const ey = largest_difference(y_fused, y_core), edx = largest_difference(dx_fused, dx_core);
    INFO("cuDNN's fp8 attention against mpx's: y " << ey << ", dx " << edx << " of the largest value");
    CHECK(ey < fp8_fused_bound);
    CHECK(edx < fp8_fused_bound);
  }
}

#if !MPX_HAS_CUDA
// The fused fp8 path on the host (the host suite only): with the float64 fused attention
// of tests/support/reference/fused_attention.hpp registered for host memory, the layer
// runs its fused fp8 path there as it does through cuDNN on a GPU: the fp8 Q K V, O, dO
// and dQ dK dV handed over in place, the scales gathered into their slots before each
// pass and the amaxes folded back after. Two steps, so the second casts with six
// different scales (the first casts with every scale 1, where a scale gathered into the
// wrong slot would pass). Held to mpx's core within the GPU case's bound, with P cast
// either way cuDNN's kernel may cast it (fp8_fused_bound), and the amaxes the six scale
// states took from the step near the core's (a slot gathered or folded into the wrong
// state is off by far more).
TEST_CASE("on the host with a float64 fused attention registered, the fused fp8 core matches mpx's fp8 core",
          "[attention][layers][fp8][fp8_attention][fused]") {
  mpx::host_executor exec;
  mpx_test::reference::host_fused_attention_registered host;
  mpx::shape const s{2, 77, 256};
  auto const x = mpx_test::upload(exec, mpx_test::random_values<mpx::bfloat16>(s.size(), -1.5, 1.5, 51), s);
  auto const dy = mpx_test::upload(exec, mpx_test::random_values<mpx::bfloat16>(s.size(), -1, 1, 52), s);
  auto const core = fp8_core_step(exec, x, dy, false, 2);
  CHECK_FALSE(core.fused);
  for (bool const unnormalized : {false, true}) {
    INFO((unnormalized ? "P cast before it is normalised" : "P cast normalised, as the graph says"));
    host.backend.fp8_probabilities_unnormalized = unnormalized;
    host.backend.forwards.clear();
    host.backend.backwards.clear();
    auto const fused = fp8_core_step(exec, x, dy, true, 2);
    CHECK(fused.fused);
    REQUIRE(host.backend.forwards.size() == 2);
    REQUIRE(host.backend.backwards.size() == 2);
    CHECK(host.backend.forwards[0].io == mpx::fused_attention_io::float8);
    double const ey = largest_difference(fused.y, core.y), edx = largest_difference(fused.dx, core.dx);
    INFO("the float64 fused fp8 attention against mpx's core: y " << ey << ", dx " << edx << " of the largest value");
    CHECK(ey < fp8_fused_bound);
    CHECK(edx < fp8_fused_bound);
    // The amaxes: within 1% where the arithmetic is the core's, 10% where P is cast
    // unnormalised (O, and with it dO's and the gradients', move by a few percent).
    double const tolerance = unnormalized ? 0.1 : 0.01;
    char const* const names[] = {"qkv", "s", "o", "d_o", "dp", "dqkv"};
    for (std::size_t i = 0; i < 6; ++i) {
      INFO(names[i] << ": amax " << fused.amaxes[i] << " fused, " << core.amaxes[i] << " on the core");
      CHECK(core.amaxes[i] > 0);
      CHECK(std::abs(fused.amaxes[i] - core.amaxes[i]) <= tolerance * core.amaxes[i]);
    }
  }
  host.backend.fp8_probabilities_unnormalized = false;
}
#endif
