// mpx::unscale_and_check over gradient lists: unscaled values exact to one rounding,
// NaN and inf found wherever they are planted (first element, last, inside a vector
// load, in a tail, in the 200th tensor, in a second launch table) and named, never a
// false alarm, norms against float64, clipping, deferred unscaling, determinism.
#include "support/testing.hpp"

#include <cmath>
#include <limits>
#include <random>
#include <variant>

namespace {

using mpx_test::download;
using mpx_test::upload;

// A list of gradients of mixed dtypes and awkward sizes, with host copies in float64 for
// the references. Tensor i is half, bfloat16 or float in turn; some are views that start
// one element into their allocation, so they are misaligned for vector loads.
template <class Exec>
struct mixed_gradients {
  using space = mpx::memory_space_t<Exec>;
  template <class T>
  using owned = mpx::tensor<T, space>;

  std::vector<std::variant<owned<mpx::half>, owned<mpx::bfloat16>, owned<float>, owned<mpx::float8_e4m3>>> storage;
  std::vector<mpx::tensor_ref<space>> refs;
  std::vector<std::vector<double>> values;  // what each gradient holds, exactly

  mixed_gradients(Exec const& exec, std::size_t count, std::uint64_t stream, double magnitude = 1.0,
                  std::size_t max_size = 5000) {
    std::mt19937_64 gen(mpx_test::seed + stream);
    auto const awkward = mpx_test::awkward_sizes();
    for (std::size_t i = 0; i < count; ++i) {
      std::size_t n = i % 5 == 0 ? awkward[gen() % awkward.size()] : 1 + gen() % max_size;
      n = std::min<std::size_t>(n, 70000);
      bool const offset = i % 7 == 3 && n > 1;
      std::vector<double> v(n);
      std::uniform_real_distribution<double> dist(-magnitude, magnitude);
      for (auto& x : v) x = dist(gen);
      switch (i % 3) {
        case 0: add<mpx::half>(exec, v, offset); break;
        case 1: add<mpx::bfloat16>(exec, v, offset); break;
        default: add<float>(exec, v, offset); break;
      }
    }
  }

  // Stores v rounded to T (and remembers the rounded values); with `offset`, behind one
  // extra leading element.
  template <class T>
  void add(Exec const& exec, std::vector<double> v, bool offset) {
    std::vector<T> host(v.size() + (offset ? 1 : 0), mpx::cast<T>(0.0f));
    for (std::size_t k = 0; k < v.size(); ++k) {
      host[k + (offset ? 1 : 0)] = mpx::cast<T>(v[k]);
      v[k] = mpx::detail::to_double(host[k + (offset ? 1 : 0)]);
    }
    auto t = upload(exec, host);
    auto view = mpx::view(t).flat(offset ? 1 : 0, v.size());
    refs.emplace_back(view);
    storage.emplace_back(std::move(t));
    values.push_back(std::move(v));
  }

  //! Writes x into element k of gradient i (and the host copy).
  void plant(Exec const& exec, std::size_t i, std::size_t k, float x) {
    mpx::visit_dtype(refs[i].dtype(), [&](auto t) {
      using T = decltype(t);
      auto one = upload(exec, std::vector<T>{mpx::cast<T>(x)});
      mpx::copy(exec, mpx::view(one), refs[i].template as<T>().flat(k, 1));
      exec.synchronize();
    });
    values[i][k] = x;
  }

  template <class T>
  std::vector<double> contents(Exec const& exec, std::size_t i) const {
    std::vector<double> out;
    for (T x : download(exec, refs[i].template as<T>())) out.push_back(mpx::detail::to_double(x));
    return out;
  }
};

// The float64 reference of what a check reports in unscaled units.
struct reference_check {
  std::vector<double> norms;
  double norm = 0;
  int first_nonfinite = -1;
};
reference_check reference(std::vector<std::vector<double>> const& values, double inverse_scale) {
  reference_check r;
  double total = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    double s = 0;
    for (double x : values[i]) {
      double const y = x * inverse_scale;
      if (!std::isfinite(y) && r.first_nonfinite < 0) r.first_nonfinite = static_cast<int>(i);
      s += y * y;
    }
    r.norms.push_back(std::sqrt(s));
    total += s;
  }
  r.norm = std::sqrt(total);
  return r;
}

template <class Exec>
mpx::tensor<float, mpx::memory_space_t<Exec>> scale_on(Exec const& exec, float s) {
  return upload(exec, std::vector<float>{s});
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("unscale_and_check in place: every value rounded once, norms as in float64", "[scaling]",
                        mpx_test::executors) {
  TestType exec;
  mixed_gradients<TestType> g(exec, 60, 1);
  auto const before = g.values;
  mpx::gradient_list<TestType> list(exec, g.refs);
  float const scale = 1024.0f;
  auto s = scale_on(exec, scale);
  mpx::unscale_and_check(exec, list, s.data());
  auto const summary = list.summary(exec);
  CHECK(summary.found_nonfinite == 0);
  CHECK(summary.first_nonfinite == -1);
  CHECK(summary.clip_coefficient == 1.0f);
  CHECK(summary.gradient_factor == 1.0f);

  auto const ref = reference(before, 1.0 / scale);
  REQUIRE(ref.norm > 0);
  CHECK(std::abs(summary.norm - ref.norm) <= 1e-5 * ref.norm);
  auto const norms = list.norms(exec);
  for (std::size_t i = 0; i < g.refs.size(); ++i) {
    INFO("gradient " << i << " (" << mpx::to_string(g.refs[i].dtype()) << ", " << g.refs[i].size() << " elements)");
    // Unscaling by a power of two is exact unless it leaves the subnormal range; the
    // norm of the written values is within float rounding of float64's.
    CHECK(std::abs(norms[i] - ref.norms[i]) <= 1e-5 * ref.norms[i] + 1e-30);
    mpx::visit_dtype(g.refs[i].dtype(), [&](auto t) {
      using T = decltype(t);
      auto const got = g.template contents<T>(exec, i);
      for (std::size_t k = 0; k < got.size(); ++k) {
        double const expected = mpx::detail::to_double(mpx::cast<T>(static_cast<float>(before[i][k]) / scale));
        if (got[k] != expected) FAIL("element " << k << ": got " << got[k] << ", expected " << expected);
      }
    });
  }
}

TEMPLATE_LIST_TEST_CASE("unscale_and_check with an inverse scale multiplies by it exactly, as GradScaler does",
                        "[scaling]", mpx_test::executors) {
  TestType exec;
  mixed_gradients<TestType> g(exec, 30, 7);
  auto const before = g.values;
  mpx::gradient_list<TestType> list(exec, g.refs);
  // Not a power of two, and one whose reciprocal's reciprocal is not itself in float: a
  // scale given as 1 / inverse would unscale by a neighbouring float.
  float const inverse = 0.003f;
  REQUIRE(1.0f / (1.0f / inverse) != inverse);
  auto s = scale_on(exec, inverse);
  mpx::unscale_and_check(exec, list, mpx::inverse_scale{s.data()});
  CHECK(list.summary(exec).found_nonfinite == 0);
  for (std::size_t i = 0; i < g.refs.size(); ++i) {
    INFO("gradient " << i << " (" << mpx::to_string(g.refs[i].dtype()) << ")");
    mpx::visit_dtype(g.refs[i].dtype(), [&](auto t) {
      using T = decltype(t);
      auto const got = g.template contents<T>(exec, i);
      for (std::size_t k = 0; k < got.size(); ++k) {
        double const expected = mpx::detail::to_double(mpx::cast<T>(static_cast<float>(before[i][k]) * inverse));
        if (got[k] != expected) FAIL("element " << k << ": got " << got[k] << ", expected " << expected);
      }
    });
  }
}

TEMPLATE_LIST_TEST_CASE("unscale_and_check deferred leaves the gradients untouched and reports the factor",
                        "[scaling]", mpx_test::executors) {
  TestType exec;
  mixed_gradients<TestType> g(exec, 40, 2, 30000.0);
  mpx::gradient_list<TestType> list(exec, g.refs);
  auto s = scale_on(exec, 65536.0f);
  mpx::unscale_and_check(exec, list, s.data(), 0.0f, mpx::unscaling::deferred);
  auto const summary = list.summary(exec);
  CHECK(summary.found_nonfinite == 0);
  CHECK(summary.gradient_factor == 1.0f / 65536.0f);
  auto const ref = reference(g.values, 1.0 / 65536.0);
  CHECK(std::abs(summary.norm - ref.norm) <= 1e-5 * ref.norm);
  for (std::size_t i = 0; i < g.refs.size(); ++i) {
    mpx::visit_dtype(g.refs[i].dtype(), [&](auto t) {
      INFO("gradient " << i);
      CHECK(g.template contents<decltype(t)>(exec, i) == g.values[i]);
    });
  }
}

TEMPLATE_LIST_TEST_CASE("unscale_and_check finds NaN and inf wherever they are and names the first gradient",
                        "[scaling]", mpx_test::executors) {
  TestType exec;
  float const nan = std::numeric_limits<float>::quiet_NaN();
  float const inf = std::numeric_limits<float>::infinity();
  struct planting {
    char const* where;
    std::size_t tensor;  // in a list of 250
    std::size_t element; // from the start; SIZE_MAX: the last
  };
  std::size_t const last = static_cast<std::size_t>(-1);
  std::vector<planting> const plantings = {
      {"first element of the first gradient", 0, 0},
      {"last element of the last gradient", 249, last},
      {"inside a 16-byte load (element 5)", 31, 5},
      {"in the scalar tail of a tensor whose size is not a multiple of 8", 44, last},
      {"in the 200th gradient", 199, 1},
      {"in a misaligned view (starts one element in)", 10, 0},
  };
  for (auto const& p : plantings) {
    for (float bad : {nan, inf, -inf}) {
      for (auto mode : {mpx::unscaling::in_place, mpx::unscaling::deferred}) {
        mixed_gradients<TestType> g(exec, 250, 3, 1.0, 700);
        REQUIRE(g.refs[p.tensor].size() > std::max<std::size_t>(p.element == last ? 0 : p.element, 5));
        std::size_t const k = p.element == last ? g.refs[p.tensor].size() - 1 : p.element;
        g.plant(exec, p.tensor, k, bad);
        mpx::gradient_list<TestType> list(exec, g.refs);
        auto s = scale_on(exec, 8.0f);
        mpx::unscale_and_check(exec, list, s.data(), 1.0f, mode);
        auto const summary = list.summary(exec);
        INFO(p.where << ", value " << bad << (mode == mpx::unscaling::deferred ? ", deferred" : ", in place"));
        CHECK(summary.found_nonfinite == 1);
        CHECK(summary.first_nonfinite == static_cast<std::int32_t>(p.tensor));
        CHECK(summary.last_nonfinite == static_cast<std::int32_t>(p.tensor));
        CHECK_FALSE(mpx::is_finite(summary.norm));
      }
    }
  }
  // Two bad gradients: the earlier one in list order is named, whatever the dtype order.
  mixed_gradients<TestType> g(exec, 250, 4, 1.0, 700);
  g.plant(exec, 181, 0, inf);  // float
  g.plant(exec, 120, 2, nan);  // half
  mpx::gradient_list<TestType> list(exec, g.refs);
  auto s = scale_on(exec, 1.0f);
  mpx::unscale_and_check(exec, list, s.data());
  CHECK(list.summary(exec).first_nonfinite == 120);
  CHECK(list.summary(exec).last_nonfinite == 181);  // the later one: nearest the cause in a model's backward order
}

TEMPLATE_LIST_TEST_CASE("unscale_and_check never raises a false alarm", "[scaling]", mpx_test::executors) {
  TestType exec;
  // The largest finite values of each dtype, unscaled by 1: still finite.
  mixed_gradients<TestType> g(exec, 90, 5);
  for (std::size_t i = 0; i < g.refs.size(); ++i) {
    if (g.refs[i].size() == 0) continue;
    mpx::visit_dtype(g.refs[i].dtype(), [&](auto t) {
      g.plant(exec, i, 0, static_cast<float>(mpx::dtype_traits<decltype(t)>::max()));
    });
  }
  mpx::gradient_list<TestType> list(exec, g.refs);
  auto s = scale_on(exec, 1.0f);
  for (auto mode : {mpx::unscaling::in_place, mpx::unscaling::deferred}) {
    mpx::unscale_and_check(exec, list, s.data(), 0.0f, mode);
    auto const summary = list.summary(exec);
    CHECK(summary.found_nonfinite == 0);
    CHECK(summary.first_nonfinite == -1);
  }
  // A finite value that overflows when unscaled (a scale below 1) is non-finite.
  mixed_gradients<TestType> h(exec, 3, 6);
  h.plant(exec, 2, 0, 3e38f);  // float
  mpx::gradient_list<TestType> big(exec, h.refs);
  auto half_scale = scale_on(exec, 0.5f);
  mpx::unscale_and_check(exec, big, half_scale.data());
  CHECK(big.summary(exec).first_nonfinite == 2);
}

TEMPLATE_LIST_TEST_CASE("unscale_and_check over more gradients than one launch holds", "[scaling]",
                        mpx_test::executors) {
  TestType exec;
  // 1,610 single-pointer rows fit one launch's parameters: 10,000 tiny gradients, 3,333
  // or 3,334 of each dtype, need three launches per dtype, each gradient in exactly one.
  // The inf is in a third launch (gradient 9,901 is bfloat16 number 3,300 of its dtype).
  std::size_t const planted = 9901;
  mixed_gradients<TestType> g(exec, 10000, 7, 1.0, 40);
  g.plant(exec, planted, 0, std::numeric_limits<float>::infinity());
  mpx::gradient_list<TestType> list(exec, g.refs);
  auto s = scale_on(exec, 2.0f);
  mpx::unscale_and_check(exec, list, s.data(), 0.0f, mpx::unscaling::deferred);
  CHECK(list.summary(exec).first_nonfinite == static_cast<std::int32_t>(planted));
  CHECK(list.summary(exec).last_nonfinite == static_cast<std::int32_t>(planted));
  auto const ref = reference(g.values, 0.5);
  auto const norms = list.norms(exec);
  for (std::size_t i = 0; i < g.refs.size(); ++i) {
    if (i == planted) continue;
    INFO("gradient " << i);
    REQUIRE(std::abs(norms[i] - ref.norms[i]) <= 1e-5 * ref.norms[i] + 1e-30);
  }
}

TEMPLATE_LIST_TEST_CASE("unscale_and_check clips by global norm in unscaled units, deterministically", "[scaling]",
                        mpx_test::executors) {
  TestType exec;
  mixed_gradients<TestType> g(exec, 30, 8, 1000.0);
  auto const ref = reference(g.values, 1.0 / 4096.0);
  mpx::gradient_list<TestType> list(exec, g.refs);
  auto s = scale_on(exec, 4096.0f);
  float const max_norm = static_cast<float>(ref.norm / 3);
  mpx::unscale_and_check(exec, list, s.data(), max_norm, mpx::unscaling::deferred);
  auto const first = list.summary(exec);
  CHECK(std::abs(first.clip_coefficient - max_norm / first.norm) <= 1e-6f);
  CHECK(std::abs(first.gradient_factor - first.clip_coefficient / 4096.0f) <= 1e-6f * first.gradient_factor);
  // A norm under the limit is not scaled up.
  mpx::unscale_and_check(exec, list, s.data(), static_cast<float>(ref.norm * 2), mpx::unscaling::deferred);
  CHECK(list.summary(exec).clip_coefficient == 1.0f);
  // Run after run, bit for bit.
  for (int run = 0; run < 5; ++run) {
    mpx::unscale_and_check(exec, list, s.data(), max_norm, mpx::unscaling::deferred);
    auto const again = list.summary(exec);
    CHECK(mpx::bits(again.norm) == mpx::bits(first.norm));
    CHECK(mpx::bits(again.clip_coefficient) == mpx::bits(first.clip_coefficient));
  }
}

TEMPLATE_LIST_TEST_CASE("gradient_list refuses names that do not match its gradients", "[scaling]",
                        mpx_test::executors) {
  TestType exec;
  mixed_gradients<TestType> g(exec, 3, 9);
  CHECK_THROWS_TYPE_WITH(mpx::gradient_list<TestType>(exec, g.refs, {"a", "b"}), mpx::invalid_argument,
                         Catch::Contains("2 names for 3 gradients"));
  mpx::gradient_list<TestType> named(exec, g.refs, {"dense/kernel", "dense/bias", "norm/gamma"});
  CHECK(named.name(2) == "norm/gamma");
  mpx::gradient_list<TestType> unnamed(exec, g.refs);
  CHECK(unnamed.name(1) == "gradient 1");
}

TEMPLATE_LIST_TEST_CASE("gradient_list refuses gradients that share memory: in place they would be unscaled twice",
                        "[scaling]", mpx_test::executors) {
  TestType exec;
  auto a = mpx::make_tensor<float>(exec, {10});
  auto b = mpx::make_tensor<mpx::half>(exec, {4});
  using ref = mpx::tensor_ref<mpx::memory_space_t<TestType>>;
  CHECK_THROWS_TYPE_WITH(mpx::gradient_list<TestType>(exec, {ref(a), ref(b), ref(a)}, {"x", "y", "z"}),
                         mpx::invalid_argument,
                         Catch::Contains("gradient_list: 'x' and 'z' overlap in memory (a gradient listed twice?"));
  // A view into the middle of another gradient overlaps it too, whatever its dtype.
  mpx::tensor_view<mpx::half, mpx::memory_space_t<TestType>> const inside(reinterpret_cast<mpx::half*>(a.data() + 9),
                                                                          mpx::shape{1});
  CHECK_THROWS_TYPE_WITH(mpx::gradient_list<TestType>(exec, {ref(inside), ref(b), ref(a)}), mpx::invalid_argument,
                         Catch::Contains("'gradient 0' and 'gradient 2' overlap"));
  // Neighbours that only touch, and empty tensors anywhere, are fine.
  mpx::tensor_view<float, mpx::memory_space_t<TestType>> const first(a.data(), mpx::shape{5}), second(a.data() + 5, mpx::shape{5}),
      none(a.data() + 2, mpx::shape{0});
  CHECK_NOTHROW(mpx::gradient_list<TestType>(exec, {ref(first), ref(second), ref(none), ref(b)}));
}

namespace test_unscale_and_check {

//! 32 chunks: as many as a warp's lanes, so a tensor of more has lanes that fold two.
constexpr std::size_t warp_path_chunks = 32;
constexpr std::size_t chunk = mpx::detail::multi_tensor_chunk;

}  // namespace test_unscale_and_check

// The finishing pass folds each tensor's chunks with the lanes of a warp (a tensor of
// more than 32 chunks, over 524,288 elements, gives some lanes two or more), eight
// tensors to a block, the blocks' results then folded by one. Here: large tensors of each
// dtype (just over 32 chunks, exactly 32, 40, one misaligned), among 1,100 small ones,
// one large at index 1,050 (in a late block); non-finite values in their last chunks,
// and a small tensor's beating a later large one's.
TEMPLATE_LIST_TEST_CASE("unscale_and_check folds tensors of over 32 chunks by warps, late chunks included", "[scaling]",
                        mpx_test::executors) {
  TestType exec;
  using test_unscale_and_check::chunk;
  constexpr std::size_t just_over = test_unscale_and_check::warp_path_chunks * chunk + 5;  // 33 chunks
  mixed_gradients<TestType> g(exec, 0, 11);
  std::mt19937_64 gen(mpx_test::seed + 12);
  auto values = [&](std::size_t n) {
    std::uniform_real_distribution<double> dist(-1, 1);
    std::vector<double> v(n);
    for (auto& x : v) x = dist(gen);
    return v;
  };
  std::size_t const count = 1100, late_large = 1050;
  for (std::size_t i = 0; i < count; ++i) {
    switch (i) {
      case 1: g.template add<float>(exec, values(just_over), false); break;
      case 3: g.template add<mpx::half>(exec, values(32 * chunk + 1), true); break;  // misaligned view
      case 5: g.template add<float>(exec, values(32 * chunk), false); break;         // 32 chunks: a thread's
      case 6: g.template add<mpx::bfloat16>(exec, values(40 * chunk), false); break;
      case late_large: g.template add<float>(exec, values(34 * chunk + 7), false); break;
      default:
        if (i % 3 == 0) g.template add<mpx::half>(exec, values(1 + i % 13), false);
        else if (i % 3 == 1) g.template add<mpx::bfloat16>(exec, values(1 + i % 13), false);
        else g.template add<float>(exec, values(1 + i % 13), false);
    }
  }
  mpx::gradient_list<TestType> list(exec, g.refs);
  auto eight = scale_on(exec, 8.0f);
  auto check = [&](std::int32_t expected_first, std::int32_t expected_last = -1) {
    mpx::unscale_and_check(exec, list, eight.data(), 0.0f, mpx::unscaling::deferred);
    auto const summary = list.summary(exec);
    CHECK(summary.first_nonfinite == expected_first);
    CHECK(summary.last_nonfinite == expected_last);
    CHECK(summary.found_nonfinite == (expected_first >= 0 ? 1u : 0u));
    if (expected_first >= 0) {
      CHECK_FALSE(mpx::is_finite(summary.norm));
      return;
    }
    auto const ref = reference(g.values, 1.0 / 8);
    REQUIRE(ref.norm > 0);
    CHECK(std::abs(summary.norm - ref.norm) <= 1e-5 * ref.norm);
    auto const norms = list.norms(exec);
    std::size_t bad = 0, first = 0;
    for (std::size_t i = 0; i < count; ++i)
      if (!(std::abs(norms[i] - ref.norms[i]) <= 1e-5 * ref.norms[i] + 1e-30) && bad++ == 0) first = i;
    INFO(bad << " tensor norms off; first: " << first << " (" << g.refs[first].size() << " elements): got "
              << norms[first] << ", float64 " << ref.norms[first]);
    CHECK(bad == 0);
  };
  float const inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  check(-1);
  struct planting {
    std::size_t tensor, element;
    float value;
  };
  auto plant_all = [&](std::vector<planting> const& ps, std::int32_t expected_first) {
    std::vector<float> kept;
    for (auto const& p : ps) {
      kept.push_back(static_cast<float>(g.values[p.tensor][p.element]));
      g.plant(exec, p.tensor, p.element, p.value);
    }
    std::int32_t expected_last = -1;
    for (auto const& p : ps) expected_last = std::max(expected_last, static_cast<std::int32_t>(p.tensor));
    INFO("expected first non-finite gradient: " << expected_first << ", last: " << expected_last);
    check(expected_first, expected_last);
    for (std::size_t i = ps.size(); i-- > 0;) g.plant(exec, ps[i].tensor, ps[i].element, kept[i]);
  };
  plant_all({{1, 32 * chunk + 3, inf}}, 1);                        // the 33rd chunk, 5 elements long
  plant_all({{3, 32 * chunk, -inf}}, 3);                           // the misaligned half's last chunk, 1 element
  plant_all({{late_large, 34 * chunk + 6, nan}}, 1050);            // the second warp pass, last element
  plant_all({{late_large, 17 * chunk, nan}, {700, 0, -inf}}, 700); // a thread's tensor before a warp's
  plant_all({{late_large, 3, inf}, {6, 40 * chunk - 1, nan}}, 6);  // a warp's tensor before another warp's
  plant_all({{5, 32 * chunk - 1, inf}}, 5);                        // exactly 32 chunks: the thread path
  check(-1);  // every planted value restored: no stale verdict

  // In place: the large tensors' values, each rounded once.
  auto const before = g.values;
  mpx::unscale_and_check(exec, list, eight.data());
  CHECK(list.summary(exec).found_nonfinite == 0);
  for (std::size_t i : {std::size_t{1}, std::size_t{3}, std::size_t{5}, std::size_t{6}, late_large}) {
    mpx::visit_dtype(g.refs[i].dtype(), [&](auto t) {
      using T = decltype(t);
      auto const got = g.template contents<T>(exec, i);
      std::size_t bad = 0, first = 0;
      for (std::size_t k = 0; k < got.size(); ++k) {
        double const expected = mpx::detail::to_double(mpx::cast<T>(static_cast<float>(before[i][k]) / 8.0f));
        if (!(got[k] == expected) && bad++ == 0) first = k;
      }
      INFO("gradient " << i << ": " << bad << " values off; first at " << first);
      CHECK(bad == 0);
    });
  }
}

namespace test_unscale_and_check {

//! The finishing pass alone on made-up chunk results: `tensors` tensors, tensor t of
//! t % 5 chunks (some empty), chunk values from `value`, non-finite flags on the tensors
//! in `bad`; returns the per-tensor sums and the summary, as `exec` computed them.
template <class Exec, class Value>
std::pair<std::vector<float>, mpx::gradient_summary> finish_pass(Exec const& exec, std::size_t tensors, Value value,
                                                                 std::vector<std::size_t> const& bad) {
  std::vector<std::uint32_t> ranges(2 * tensors);
  std::vector<mpx::detail::chunk_partial> partials;
  for (std::size_t t = 0; t < tensors; ++t) {
    ranges[2 * t] = static_cast<std::uint32_t>(partials.size());
    for (std::size_t c = 0; c < t % 5; ++c) {
      bool const flagged = c + 1 == t % 5 && std::find(bad.begin(), bad.end(), t) != bad.end();
      partials.push_back({value(t, c), flagged ? 1u : 0u});
    }
    ranges[2 * t + 1] = static_cast<std::uint32_t>(partials.size());
  }
  auto const r = upload(exec, ranges);
  auto const p = upload(exec, partials);
  auto sums = upload(exec, std::vector<float>(tensors, std::numeric_limits<float>::quiet_NaN()));  // poisoned
  auto summary = upload(exec, std::vector<mpx::gradient_summary>{{7u, 7, -7.0f, -7.0f, -7.0f, 7}});
  auto verdicts = mpx::make_tensor<mpx::detail::tensor_verdict>(exec, mpx::shape{std::int64_t{mpx::detail::max_item_blocks}});
  mpx::detail::reduce_items<mpx::detail::item_kind::row>(
      exec, tensors, mpx::detail::combine_verdicts{},
      mpx::detail::finish_check_tensor{r.data(), p.data(), sums.data()},
      mpx::detail::finish_check_summary{0.0f, nullptr, false, false, summary.data()}, verdicts.data());
  return {download(exec, sums), download(exec, summary)[0]};
}

}  // namespace test_unscale_and_check

// More tensors than the pass has warps (1,024 blocks of 8): warps fold several tensors,
// the host's emulation wraps; empty tensors among them; non-finite tensors on both sides
// of index 8,192. Integer chunk sums are exact in any order; random ones must give the
// host's bits on the GPU.
TEMPLATE_LIST_TEST_CASE("unscale_and_check's finishing pass folds each of 9,000 tensors once, in the host's order",
                        "[scaling]", mpx_test::executors) {
  using test_unscale_and_check::finish_pass;
  TestType exec;
  std::size_t const tensors = 9000;
  auto const integer = [](std::size_t t, std::size_t c) { return static_cast<float>(t % 7 + c); };
  auto const [sums, summary] = finish_pass(exec, tensors, integer, {3, 8191, 8192, 8999});
  double total = 0;
  std::size_t wrong = 0;
  for (std::size_t t = 0; t < tensors; ++t) {
    double want = 0;
    for (std::size_t c = 0; c < t % 5; ++c) want += integer(t, c);
    total += want;
    wrong += sums[t] != want;
  }
  CHECK(wrong == 0);
  CHECK(summary.found_nonfinite == 1u);
  CHECK(summary.first_nonfinite == 3);
  CHECK(summary.last_nonfinite == 8999);
  CHECK(summary.norm == static_cast<float>(std::sqrt(total)));  // the total is an exact integer too
  CHECK(summary.clip_coefficient == 1.0f);
  CHECK(summary.gradient_factor == 1.0f);

  auto const none = finish_pass(exec, tensors, integer, {}).second;
  CHECK(none.found_nonfinite == 0u);
  CHECK(none.first_nonfinite == -1);
  CHECK(none.last_nonfinite == -1);
  auto const empty = finish_pass(exec, 0, integer, {}).second;
  CHECK((empty.found_nonfinite == 0u && empty.first_nonfinite == -1 && empty.norm == 0.0f));

  std::mt19937_64 gen(mpx_test::seed + 41);
  std::vector<float> random(5 * tensors);
  std::uniform_real_distribution<float> dist(0.0f, 1.0f);
  for (float& x : random) x = dist(gen);
  auto const value = [&](std::size_t t, std::size_t c) { return random[5 * t + c]; };
  auto const here = finish_pass(exec, tensors, value, {});
  auto const host = finish_pass(mpx::host_executor{}, tensors, value, {});
  CHECK(here.first == host.first);  // bit for bit, on the GPU too
  CHECK(here.second.norm == host.second.norm);
}

namespace test_unscale_and_check {

// The order unscale_and_check sums squares in, written out plainly (the library's is
// exec/lanes.hpp and kernels/multi_tensor.hpp's reduce_in_chunk). A chunk of 16,384
// elements is read by 256 lanes in columns: single elements up to the first 16-byte
// boundary, then 16-byte vectors, then single elements. Lane l adds up columns l,
// l + 256, ... in order, a column's squares in order, every square rounded to float
// first. The lanes are combined as a warp's shuffles do (for offset 16, 8, 4, 2, 1: lane
// i takes lane i + offset), then the 8 warps' results the same way. A tensor's chunk sums
// are combined the same way by the 32 lanes of one warp.
float rounded(float x) {
  volatile float v = x;  // no fused multiply-add, no wider intermediate
  return v;
}
float butterfly(std::vector<float> v) {
  for (std::size_t offset = 16; offset > 0; offset /= 2)
    for (std::size_t i = 0; i < offset; ++i) v[i] = rounded(v[i] + v[i + offset]);
  return v[0];
}
float in_lanes_order(std::vector<float> const& columns, std::size_t lanes) {
  std::vector<float> slot(lanes, 0.0f);
  for (std::size_t c = 0; c < columns.size(); ++c) slot[c % lanes] = rounded(slot[c % lanes] + columns[c]);
  if (lanes == 32) return butterfly(slot);
  std::vector<float> warps(32, 0.0f);
  for (std::size_t w = 0; w < lanes / 32; ++w)
    warps[w] = butterfly({slot.begin() + 32 * w, slot.begin() + 32 * (w + 1)});
  return butterfly(warps);
}
float tensor_sum_of_squares(std::vector<float> const& y, std::size_t head, std::size_t width) {
  std::vector<float> chunk_sums;
  for (std::size_t begin = 0; begin < y.size(); begin += chunk) {
    std::size_t const n = std::min(chunk, y.size() - begin), h = std::min(head, n);
    auto const square = [&](std::size_t i) { return rounded(y[begin + i] * y[begin + i]); };
    std::vector<float> columns;
    std::size_t i = 0;
    for (; i < h; ++i) columns.push_back(square(i));
    for (; i + width <= n; i += width) {
      float s = square(i);
      for (std::size_t k = 1; k < width; ++k) s = rounded(s + square(i + k));
      columns.push_back(s);
    }
    for (; i < n; ++i) columns.push_back(square(i));
    chunk_sums.push_back(in_lanes_order(columns, 256));
  }
  return in_lanes_order(chunk_sums, 32);
}

//! Gradients of four dtypes (float8_e4m3: 16 to a vector) and of sizes around the chunk
//! and the vector, every other one a view one element off alignment; values of spread
//! magnitudes, so that the order of the additions shows in the last bits. The same
//! list, bit for bit, on any executor.
template <class Exec>
mixed_gradients<Exec> ordered_gradients(Exec const& exec) {
  mixed_gradients<Exec> g(exec, 0, 0);
  std::mt19937_64 gen(mpx_test::seed + 51);
  std::size_t const sizes[] = {1, 7, 9, 33, 1000, chunk - 1, chunk, chunk + 1, 3 * chunk + 11, 40 * chunk + 3};
  for (std::size_t s = 0; s < std::size(sizes); ++s) {
    for (std::size_t d = 0; d < 4; ++d) {
      std::vector<double> v(sizes[s]);
      std::uniform_real_distribution<double> unit(-1, 1);
      for (auto& x : v) {
        double const u = unit(gen);
        x = std::ldexp(u, static_cast<int>(gen() % 13) - 6);
      }
      bool const offset = (s + d) % 2 == 1;
      if (d == 0) g.template add<mpx::half>(exec, v, offset);
      else if (d == 1) g.template add<mpx::bfloat16>(exec, v, offset);
      else if (d == 2) g.template add<float>(exec, v, offset);
      else g.template add<mpx::float8_e4m3>(exec, v, offset);
    }
  }
  return g;
}

}  // namespace test_unscale_and_check

// One math on both executors: every chunk's sum of squares is taken in the order the
// GPU's threads take it, so a run on the host is the GPU run's exact reference (the norm
// and the clipping factor, to the bit).
TEMPLATE_LIST_TEST_CASE("unscale_and_check sums in its lanes' order: the same bits on every executor", "[scaling]",
                        mpx_test::executors) {
  using namespace test_unscale_and_check;
  TestType exec;
  auto g = ordered_gradients(exec);
  mpx::gradient_list<TestType> list(exec, g.refs);
  auto s = scale_on(exec, 4.0f);
  for (auto mode : {mpx::unscaling::deferred, mpx::unscaling::in_place}) {  // deferred first: same values
    mpx::unscale_and_check(exec, list, s.data(), 0.0f, mode);
    auto const norms = list.norms(exec);
    std::size_t checked = 0;
    for (std::size_t i = 0; i < g.refs.size(); ++i) {
      mpx::visit_dtype(g.refs[i].dtype(), [&](auto t) {
        using T = decltype(t);
        std::vector<float> y;  // the unscaled values (by 1/4: exact)
        for (double x : g.template contents<T>(exec, i))
          y.push_back(static_cast<float>(x) * (mode == mpx::unscaling::deferred ? 0.25f : 1.0f));
        std::size_t const width = 16 / sizeof(T);
        auto const address = reinterpret_cast<std::uintptr_t>(g.refs[i].data());
        std::size_t const misaligned = address % 16 / sizeof(T), head = misaligned ? width - misaligned : 0;
        float const expected = std::sqrt(tensor_sum_of_squares(y, head, width));
        INFO((mode == mpx::unscaling::deferred ? "deferred" : "in place")
             << ", gradient " << i << " (" << mpx::to_string(g.refs[i].dtype()) << ", " << y.size()
             << " elements, head " << head << ")");
        CHECK(norms[i] == expected);
        checked += norms[i] == expected;
      });
    }
    CHECK(checked == g.refs.size());
  }

  // The same gradients on the host, unscaled in the other mode too: the same bits.
  if constexpr (!mpx::is_host_executor_v<TestType>) {
    mpx::host_executor host;
    for (auto mode : {mpx::unscaling::deferred, mpx::unscaling::in_place}) {
      auto here = ordered_gradients(exec);
      auto there = ordered_gradients(host);
      mpx::gradient_list<TestType> here_list(exec, here.refs);
      mpx::gradient_list<mpx::host_executor> there_list(host, there.refs);
      auto here_scale = scale_on(exec, 0.75f);  // not a power of two: the unscaled values round
      auto there_scale = scale_on(host, 0.75f);
      mpx::unscale_and_check(exec, here_list, here_scale.data(), 1.0f, mode);
      mpx::unscale_and_check(host, there_list, there_scale.data(), 1.0f, mode);
      auto const a = here_list.summary(exec), b = there_list.summary(host);
      CHECK(a.norm == b.norm);
      CHECK(a.clip_coefficient == b.clip_coefficient);
      CHECK(a.gradient_factor == b.gradient_factor);
      CHECK(here_list.norms(exec) == there_list.norms(host));
    }
  }
}
