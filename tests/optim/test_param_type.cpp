// Optimizers without master weights (a policy whose param_type is its storage type):
// the lost-update failure of round-to-nearest and its cure by stochastic rounding, the
// update formula against float64 with one rounding per step, stochastic rounding's
// reproducibility and bias, and checkpoints that keep (and check) the rounding.
#include "support/testing.hpp"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

using mpx_test::download;
using mpx_test::upload;

template <class Exec>
using param_list = std::vector<mpx::parameter<mpx::memory_space_t<Exec>>>;

// The distance between x's two neighbours in T (x finite, between them or on one).
template <class T>
double param_type_gap(double x) {
  int e = 0;
  std::frexp(x == 0 ? 1e-30 : x, &e);  // |x| = m * 2^e, m in [0.5, 1)
  int const mantissa = static_cast<int>(mpx::dtype_traits<T>::mantissa_bits);
  int const min_exp = 2 - static_cast<int>(mpx::dtype_traits<T>::exponent_bias);  // exponent of the smallest normal
  return std::ldexp(1.0, std::max(e - 1, min_exp) - mantissa);
}

// Where a dtype's parameters are in the optimizer's dtype order: the counter's top byte.
template <class T>
std::uint32_t param_type_stream(std::uint32_t index) {
  for (std::size_t d = 0; d < mpx::detail::all_dtypes.size(); ++d)
    if (mpx::detail::all_dtypes[d] == mpx::dtype_id_of<T>) return static_cast<std::uint32_t>(d) << 24 | index;
  return ~0u;
}

template <class T, class Exec>
void param_type_write(Exec const& exec, std::vector<T> const& values, mpx::tensor<T, mpx::memory_space_t<Exec>>& to) {
  mpx::copy(exec, mpx::tensor_view<T const, mpx::host_space>(values.data(), to.shape()), to);
}

constexpr mpx::master_weight_options param_type_nearest{mpx::master_weights::none, false, 0};
constexpr mpx::master_weight_options param_type_stochastic(std::uint64_t seed) {
  return {mpx::master_weights::none, true, seed};
}

// (a) ----------------------------------------------------------------------------------

TEMPLATE_LIST_TEST_CASE("param_type: 1e-4 updates on bfloat16 1.0 are lost to rounding to nearest; stochastic "
                        "rounding and float masters keep them",
                        "[optim][param_type]", mpx_test::executors) {
  TestType exec;
  constexpr std::size_t n = 16384;
  constexpr int steps = 1000;
  constexpr float lr = 1e-4f;
  double const expected = 1.0 - steps * 1e-4;  // float64: 0.9
  // Below 1.0 bfloat16's spacing is 2^-8: a 1e-4 step is 1/39 of its half, 2^-9.
  auto run = [&](auto t, mpx::master_weight_options masters) {
    using T = decltype(t);
    auto w = upload(exec, std::vector<T>(n, mpx::cast<T>(1.0f)));
    auto g = upload(exec, std::vector<T>(n, mpx::cast<T>(1.0f)));
    auto opt = mpx::sgd(exec, param_list<TestType>{{"w", mpx::view(w), mpx::view(g)}}, lr, {}, masters);
    for (int s = 0; s < steps; ++s) opt.step(exec);
    std::vector<double> out;
    for (auto x : download(exec, w)) out.push_back(mpx::cast<double>(x));
    return out;
  };
  auto mean = [](std::vector<double> const& v) {
    double s = 0;
    for (double x : v) s += x;
    return s / static_cast<double>(v.size());
  };

  auto const nearest = run(mpx::bfloat16{}, param_type_nearest);
  for (double x : nearest) REQUIRE(x == 1.0);  // 1000 updates, every one lost

  // Each element ends within a few spacings of 0.9 (its rounding errors are a martingale
  // of variance <= 1000 * (2^-8)^2 / 4, sd 0.062); the mean of 16384 has sd 4.9e-4:
  // 3e-3 is 6 sd, and with the fixed seed the outcome is fixed anyway.
  auto const stochastic = run(mpx::bfloat16{}, param_type_stochastic(mpx_test::seed));
  INFO("bfloat16 stochastic mean " << mean(stochastic));
  CHECK(std::abs(mean(stochastic) - expected) < 3e-3);
  // Half (spacing 2^-11 below 1, half-spacing 2.4e-4 > 1e-4) loses them too and is cured alike.
  CHECK(mean(run(mpx::half{}, param_type_nearest)) == 1.0);
  auto const half_stochastic = run(mpx::half{}, param_type_stochastic(mpx_test::seed));
  INFO("half stochastic mean " << mean(half_stochastic));
  CHECK(std::abs(mean(half_stochastic) - expected) < 5e-4);

  // Float master weights (today's default) keep them exactly: 0.9 within bfloat16's rounding.
  for (double x : run(mpx::bfloat16{}, mpx::master_weight_options{})) REQUIRE(std::abs(x - expected) <= 0.5 / 256);
}

// (b) ----------------------------------------------------------------------------------

// One element of torch.optim.SGD (momentum, L2 decay) and torch.optim.Adam, in float64.
struct param_type_reference {
  bool adam;
  void step(double& w, double g, double& m, double& v, std::uint64_t t) const {
    if (!adam) {
      g += 0.01 * w;                     // weight_decay
      m = t == 1 ? g : 0.9 * m + g;      // momentum 0.9
      w -= 0.01 * m;                     // lr
      return;
    }
    m = 0.9 * m + 0.1 * g;
    v = 0.999 * v + 0.001 * g * g;
    double const b1 = 1 - std::pow(0.9, static_cast<double>(t)), b2 = 1 - std::pow(0.999, static_cast<double>(t));
    w -= 0.01 / b1 * m / (std::sqrt(v) / std::sqrt(b2) + 1e-8);
  }
};

TEMPLATE_LIST_TEST_CASE("param_type: without masters SGD and Adam match float64 with one rounding per step",
                        "[optim][param_type]", mpx_test::executors) {
  TestType exec;
  auto body = [&](auto t, bool adam) {
    using T = decltype(t);
    INFO(mpx::dtype_traits<T>::name << (adam ? " adam" : " sgd"));
    constexpr std::size_t n = 4099;  // a vector tail
    std::mt19937_64 gen(mpx_test::seed + (adam ? 31 : 32));
    std::uniform_real_distribution<double> dist(-1, 1);
    std::vector<T> w0(n), gv(n);
    for (auto& x : w0) x = mpx::cast<T>(dist(gen));
    auto w = upload(exec, w0);
    auto g = upload(exec, std::vector<T>(n, T{}));
    param_list<TestType> params{{"w", mpx::view(w), mpx::view(g)}};
    std::vector<double> m(n, 0.0), v(n, 0.0);
    param_type_reference const ref{adam};
    auto check_steps = [&](auto& opt) {
      std::vector<T> stored = w0;
      for (std::uint64_t s = 1; s <= 20; ++s) {
        for (auto& x : gv) x = mpx::cast<T>(dist(gen));
        param_type_write(exec, gv, g);
        opt.step(exec);
        auto const now = download(exec, w);
        std::size_t exact = 0;
        for (std::size_t i = 0; i < n; ++i) {
          double r = mpx::cast<double>(stored[i]);  // no master: the step starts from the stored value
          ref.step(r, mpx::cast<double>(gv[i]), m[i], v[i], s);
          double const got = mpx::cast<double>(now[i]);
          if (got == mpx::cast<double>(mpx::cast<T>(r))) ++exact;
          // Float arithmetic moves the result by ~1e-7 relative: a value next to a
          // midpoint may round the other way, never further.
          if (!(std::abs(got - r) <= 0.5 * param_type_gap<T>(r) + 1e-6 * std::abs(r) + 1e-12)) {
            INFO("step " << s << " element " << i << ": " << got << " vs float64 " << r);
            REQUIRE(false);
          }
        }
        CHECK(exact >= n - n / 100);
        stored = now;
      }
    };
    if (adam) {
      auto opt = mpx::adam(exec, params, 1e-2f, {}, param_type_nearest);
      check_steps(opt);
    } else {
      auto opt = mpx::sgd(exec, params, 1e-2f, {.momentum = 0.9f, .weight_decay = 0.01f}, param_type_nearest);
      check_steps(opt);
    }
  };
  for (bool adam : {false, true}) {
    mpx_test::for_each_dtype_in<mpx_test::dtypes16>([&](auto tag) { body(tag, adam); });
  }
}

// (c) ----------------------------------------------------------------------------------

TEST_CASE("param_type: stochastic_round is exactly unbiased over all its random words", "[optim][param_type]") {
  // bfloat16 keeps the top 16 bits: over the 2^16 values of the low random bits the sum
  // of the results is exactly 2^16 * x.
  std::mt19937 gen(mpx_test::seed + 40);
  std::uniform_real_distribution<float> dist(-3, 3);
  for (int trial = 0; trial < 64; ++trial) {
    float const x = trial == 0 ? 1.0f - 1e-4f : trial == 1 ? -1e-30f : dist(gen);
    double sum = 0;
    for (std::uint32_t r = 0; r < (1u << 16); ++r) sum += mpx::cast<double>(mpx::detail::stochastic_round<mpx::bfloat16>(x, r));
    INFO("x = " << x);
    REQUIRE(sum == static_cast<double>(x) * 65536.0);
  }
  // half compares the top 24 random bits with (x - lower) / gap: over all 2^24 of them
  // the mean is x up to 2^-24 of a gap.
  for (float const x : {1.0f - 1e-4f, -0.3f, 3e-6f}) {
    double sum = 0;
    for (std::uint32_t k = 0; k < (1u << 24); ++k)
      sum += mpx::cast<double>(mpx::detail::stochastic_round<mpx::half>(x, k << 8));
    INFO("x = " << x);
    REQUIRE(std::abs(sum / 16777216.0 - x) <= 0x1p-24 * param_type_gap<mpx::half>(x));
  }
  // Representable values, infinities and NaN are left as they are.
  CHECK(mpx::cast<float>(mpx::detail::stochastic_round<mpx::bfloat16>(1.5f, 0xFFFFu)) == 1.5f);
  CHECK(mpx::cast<float>(mpx::detail::stochastic_round<mpx::half>(1.5f, ~0u)) == 1.5f);
  CHECK(mpx::is_inf(mpx::detail::stochastic_round<mpx::bfloat16>(INFINITY, 0xFFFFu)));
  CHECK(mpx::is_nan(mpx::detail::stochastic_round<mpx::half>(NAN, 0u)));
}

TEMPLATE_LIST_TEST_CASE("param_type: stochastic rounding is reproducible, the same bits on every executor, and "
                        "unbiased",
                        "[optim][param_type]", mpx_test::executors) {
  TestType exec;
  auto body = [&](auto t) {
    using T = decltype(t);
    INFO(mpx::dtype_traits<T>::name);
    constexpr std::size_t n = 16384 + 3;
    // w on a 2^-7 grid in [1, 2), g = k / 128, lr 2^-10: w - lr * g is exact in float, so
    // a fused multiply-add on the GPU computes what the host does, and the expected bits
    // follow from the rounding formula alone.
    std::mt19937_64 gen(mpx_test::seed + 41);
    std::uniform_int_distribution<int> grid(0, 127), k(-128, 128);
    std::vector<T> w0(n), gv(n);
    for (std::size_t i = 0; i < n; ++i) {
      w0[i] = mpx::cast<T>(1.0 + grid(gen) / 128.0);
      gv[i] = mpx::cast<T>(k(gen) / 128.0);
    }
    constexpr float lr = 0x1p-10f;
    auto run = [&](std::uint64_t seed) {
      auto w_other = upload(exec, std::vector<T>(5, mpx::cast<T>(1.0f)));  // parameter 0 of this dtype
      auto g_other = upload(exec, std::vector<T>(5, T{}));
      auto w = upload(exec, w0);
      auto g = upload(exec, gv);
      auto opt = mpx::sgd(exec,
                          param_list<TestType>{{"other", mpx::view(w_other), mpx::view(g_other)},
                                               {"w", mpx::view(w), mpx::view(g)}},
                          lr, {}, param_type_stochastic(seed));
      opt.step(exec);
      return download(exec, w);
    };
    auto const a = run(7), b = run(7), c = run(8);
    std::size_t same_as_c = 0, matches = 0;
    double bias = 0;  // in gaps
    mpx::detail::weight_rounding const rounding{true, 7, 0};
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(mpx::bits(a[i]) == mpx::bits(b[i]));
      if (mpx::bits(a[i]) == mpx::bits(c[i])) ++same_as_c;
      float const exact = mpx::cast<float>(w0[i]) - lr * mpx::cast<float>(gv[i]);
      auto const draws = rounding.draws(1, param_type_stream<T>(1), i / 4);
      if (mpx::bits(a[i]) == mpx::bits(mpx::detail::stochastic_round<T>(exact, draws.v[i % 4]))) ++matches;
      bias += (mpx::cast<double>(a[i]) - exact) / param_type_gap<T>(exact);
    }
    CHECK(matches == n);       // the formula, bit for bit, on this executor
    CHECK(same_as_c < n);      // another seed draws otherwise
    // Each error lies within one gap with mean 0 and sd <= 1/2: the mean of 16387 has
    // sd <= 0.0039 gaps, and the bound is 8 of them (fixed seed: it cannot flake).
    bias /= static_cast<double>(n);
    INFO("mean rounding error " << bias << " gaps");
    CHECK(std::abs(bias) < 0.03);
  };
  mpx_test::for_each_dtype_in<mpx_test::dtypes16>(body);
}

#if MPX_HAS_CUDA
namespace {
// Five steps of `make`'s optimizer from w0 with the given gradients; the values after them.
template <class T, class Exec, class Make>
std::vector<T> param_type_steps(Exec const& exec, std::vector<T> const& w0, std::vector<std::vector<T>> const& grads,
                                Make const& make) {
  auto w = upload(exec, w0);
  auto g = mpx::make_tensor<T>(exec, w.shape());
  auto opt = make(exec, param_list<Exec>{{"w", mpx::view(w), mpx::view(g)}});
  for (auto const& step : grads) {
    mpx::copy(exec, mpx::tensor_view<T const, mpx::host_space>(step.data(), w.shape()), g);
    opt.step(exec);
  }
  return download(exec, w);
}
}  // namespace

// The update's products are rounded on their own on both executors (detail::mul_rn):
// nvcc would fuse `w - lr * g`, the momentum and the moments into FMAs, which round
// once where the host rounds twice. Random values make nearly every product and sum
// inexact, so a fused update differs from the host's in the last bit of many elements.
// Adam's betas make its bias corrections exact (powers of 1/2 and 3/4).
TEST_CASE("param_type: the GPU's updates equal the host's bit for bit (no fused multiply-add)",
          "[optim][param_type][cuda]") {
  mpx::host_executor const host;
  mpx::cuda_executor const gpu;
  constexpr std::size_t n = 4099;
  auto compare = [&](auto t, auto const& make, char const* what) {
    using T = decltype(t);
    auto const w0 = mpx_test::random_values<T>(n, -1.0, 1.0, 91);
    std::vector<std::vector<T>> grads;
    for (std::uint64_t s = 0; s < 5; ++s) grads.push_back(mpx_test::random_values<T>(n, -0.5, 0.5, 92 + s));
    auto const on_host = param_type_steps(host, w0, grads, make);
    auto const on_gpu = param_type_steps(gpu, w0, grads, make);
    INFO(what << " over " << mpx::dtype_traits<T>::name);
    CHECK_FALSE(mpx_test::first_mismatch(on_host, w0).empty());  // the steps moved the weights
    CHECK(mpx_test::first_mismatch(on_gpu, on_host).empty());
  };
  mpx::sgd_options const momentum{.momentum = 0.9f, .weight_decay = 0.01f};
  mpx::sgd_options const nesterov{.momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true};
  mpx::adam_options const adam{.beta1 = 0.5f, .beta2 = 0.75f, .epsilon = 1e-3f, .weight_decay = 0.01f};
  mpx::adamw_options const adamw{.beta1 = 0.5f, .beta2 = 0.75f, .epsilon = 1e-3f, .weight_decay = 0.03f};
  float const lr = 0.01f;
  compare(float{}, [&](auto const& e, auto p) { return mpx::sgd(e, std::move(p), lr, momentum); }, "sgd, momentum");
  compare(float{}, [&](auto const& e, auto p) { return mpx::sgd(e, std::move(p), lr, nesterov); }, "sgd, nesterov");
  compare(float{}, [&](auto const& e, auto p) { return mpx::adam(e, std::move(p), lr, adam); }, "adam");
  compare(float{}, [&](auto const& e, auto p) { return mpx::adamw(e, std::move(p), lr, adamw); }, "adamw");
  // Float master weights, and none with stochastic rounding (the draws alike by design).
  compare(mpx::half{}, [&](auto const& e, auto p) { return mpx::adam(e, std::move(p), lr, adam); }, "adam, masters");
  compare(mpx::bfloat16{},
          [&](auto const& e, auto p) { return mpx::sgd(e, std::move(p), lr, momentum, param_type_stochastic(5)); },
          "sgd, stochastic rounding");
  compare(mpx::bfloat16{},
          [&](auto const& e, auto p) { return mpx::adamw(e, std::move(p), lr, adamw, param_type_stochastic(5)); },
          "adamw, stochastic rounding");
}
#endif

// (d) ----------------------------------------------------------------------------------

TEMPLATE_LIST_TEST_CASE("param_type: checkpoints without masters resume bit-identically; a master mismatch is refused",
                        "[optim][param_type][checkpoint]", mpx_test::executors) {
  TestType exec;
  auto const dir = std::filesystem::temp_directory_path() /
                   ("mpx_param_type_test_" + std::string(TestType::name) + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  constexpr std::size_t n = 1000;
  std::mt19937_64 gen(mpx_test::seed + 50);
  std::uniform_real_distribution<double> dist(-1, 1);
  std::vector<mpx::bfloat16> w0(n);
  for (auto& x : w0) x = mpx::cast<mpx::bfloat16>(dist(gen));
  std::vector<std::vector<mpx::bfloat16>> grads(10, std::vector<mpx::bfloat16>(n));
  for (auto& gs : grads)
    for (auto& x : gs) x = mpx::cast<mpx::bfloat16>(dist(gen) * 1e-2);

  struct model {
    mpx::tensor<mpx::bfloat16, mpx::memory_space_t<TestType>> w, g;
    mpx::adam<TestType> opt;
  };
  auto make = [&](mpx::master_weight_options masters) {
    auto w = upload(exec, w0);
    auto g = upload(exec, grads[0]);
    param_list<TestType> params{{"w", mpx::view(w), mpx::view(g)}};
    mpx::adam<TestType> opt(exec, params, 1e-3f, {}, masters);
    return model{std::move(w), std::move(g), std::move(opt)};
  };
  auto steps = [&](model& m, std::size_t from, std::size_t to) {
    for (std::size_t s = from; s < to; ++s) {
      param_type_write(exec, grads[s], m.g);
      m.opt.step(exec);
    }
  };
  auto bits_of = [&](model const& m) {
    std::vector<std::uint16_t> out;
    for (auto x : download(exec, m.w)) out.push_back(mpx::bits(x));
    return out;
  };

  // A stochastic run saved after 5 steps and resumed by an optimizer made with another
  // seed (the file's is restored) ends where the uninterrupted run does, bit for bit.
  auto const path = dir / "stochastic.mpxckpt";
  auto a = make(param_type_stochastic(1234));
  steps(a, 0, 5);
  a.opt.save(exec, path);
  {
    mpx::detail::checkpoint_reader in(path, "mpx::optimizer");
    CHECK_FALSE(in.contains("master/0"));  // no master section
    CHECK(in.value<std::uint64_t>("optimizer/rounding seed") == 1234);
  }
  auto b = make(param_type_stochastic(999));
  b.opt.load(exec, path);
  CHECK(b.opt.master_options().seed == 1234);
  CHECK(b.opt.steps(exec) == 5);
  CHECK(bits_of(b) == bits_of(a));
  steps(a, 5, 10);
  steps(b, 5, 10);
  CHECK(bits_of(b) == bits_of(a));

  // A file with masters into one without, and the reverse, and nearest against
  // stochastic: refused, nothing changed.
  auto const with_masters = dir / "masters.mpxckpt";
  auto c = make(mpx::master_weight_options{});
  steps(c, 0, 3);
  c.opt.save(exec, with_masters);
  auto refused = [&](mpx::master_weight_options masters, std::filesystem::path const& p, char const* why) {
    auto d = make(masters);
    auto const before = bits_of(d);
    INFO(why);
    CHECK_THROWS_TYPE_WITH(d.opt.load(exec, p), mpx::checkpoint_error, Catch::Contains(why));
    CHECK(bits_of(d) == before);
    CHECK(d.opt.steps(exec) == 0);
  };
  refused(param_type_stochastic(1234), with_masters, "master weights \"float32\"; this one has \"none, stochastic");
  refused(mpx::master_weight_options{}, path, "master weights \"none, stochastic rounding\"; this one has \"float32\"");
  refused(param_type_nearest, path, "this one has \"none, rounded to nearest even\"");
  // The matching kind loads: masters into masters.
  auto e = make(mpx::master_weight_options{});
  e.opt.load(exec, with_masters);
  CHECK(bits_of(e) == bits_of(c));
  // A file from before master weights were optional (no such section) reads as float32.
  auto const older = dir / "older.mpxckpt";
  {
    mpx::detail::checkpoint_reader in(with_masters, "mpx::optimizer");
    mpx::detail::checkpoint_writer out("mpx::optimizer");
    for (auto const& name : in.unread_sections())
      if (name != "optimizer/master weights") out.add(name, in.section(name));
    out.commit(older);
  }
  auto f = make(mpx::master_weight_options{});
  f.opt.load(exec, older);
  CHECK(bits_of(f) == bits_of(c));
  refused(param_type_nearest, older, "master weights \"float32\"; this one has \"none, rounded to nearest even\"");
  std::filesystem::remove_all(dir);
}

TEMPLATE_LIST_TEST_CASE("param_type: master_weights_for follows the policy; stochastic rounding needs no masters",
                        "[optim][param_type]", mpx_test::executors) {
  TestType exec;
  using pure_bfloat16 = mpx::policy<mpx::bfloat16, mpx::bfloat16, float, mpx::bfloat16>;
  static_assert(mpx::master_weights_for<mpx::mixed_bfloat16>().master == mpx::master_weights::float32);
  static_assert(mpx::master_weights_for<mpx::mixed_bfloat16>(true).stochastic_rounding == false);
  static_assert(mpx::master_weights_for<pure_bfloat16>().master == mpx::master_weights::none);
  static_assert(mpx::master_weights_for<pure_bfloat16>(true, 5).stochastic_rounding);
  static_assert(mpx::master_weights_for<pure_bfloat16>(true, 5).seed == 5);
  auto w = upload(exec, std::vector<mpx::bfloat16>(4, mpx::cast<mpx::bfloat16>(1.0f)));
  auto g = upload(exec, std::vector<mpx::bfloat16>(4, mpx::cast<mpx::bfloat16>(1.0f)));
  param_list<TestType> params{{"w", mpx::view(w), mpx::view(g)}};
  CHECK_THROWS_TYPE_WITH(mpx::sgd(exec, params, 1e-4f, {}, mpx::master_weight_options{.stochastic_rounding = true}),
                         mpx::invalid_argument, Catch::Contains("only without master weights"));
  // A policy-derived optimizer: no masters, so lr 1e-4 on 1.0 is lost to nearest rounding.
  auto opt = mpx::sgd(exec, params, 1e-4f, {}, mpx::master_weights_for<pure_bfloat16>());
  opt.step(exec);
  for (auto x : download(exec, w)) CHECK(mpx::cast<float>(x) == 1.0f);
  // ... and by hand, with stochastic rounding and its seed (as docs/optimizers.md shows).
  auto opt2 = mpx::adam(exec, params, 1e-3f, {}, {mpx::master_weights::none, true, 1234});
  CHECK(opt2.master_options().stochastic_rounding);
  CHECK(opt2.master_options().seed == 1234);
}

}  // namespace
