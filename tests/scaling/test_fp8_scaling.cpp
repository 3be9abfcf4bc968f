// Per-tensor fp8 scaling: the cast values bit for bit against saturate_cast of the
// scaled input, the recorded amax against the float64 maximum, the scale of delayed
// and current scaling step after step against the float64 formula, NaN and inf
// inputs, all-zero tensors, and the checkpoint round trip and refusals.
#include "support/testing.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace {

// The float64 reference of one tensor's scaling (Transformer Engine's recipe, written
// out): the history as doubles, the scale rounded once to float.
struct fp8s_reference {
  double fp8_max;
  double margin_factor;
  std::vector<double> history;
  std::size_t position = 0;
  float scale = 1.0f;
  std::uint64_t nonfinite = 0;

  // max(Format) / (amax * 2^margin), unless amax is zero or not finite.
  void set_scale_from(double amax) {
    if (!(amax > 0) || !std::isfinite(amax)) return;
    double const s = fp8_max / amax * margin_factor;
    scale = s > std::numeric_limits<float>::max() ? std::numeric_limits<float>::max() : static_cast<float>(s);
  }
  void delayed_update(double amax) {
    history[position] = amax;
    position = (position + 1) % history.size();
    double m = 0;
    for (double h : history) m = (std::isnan(h) || std::isnan(m)) ? std::nan("") : std::max(m, h);
    set_scale_from(m);
    if (!std::isfinite(amax)) ++nonfinite;
  }
};

template <class T>
double fp8s_amax(std::vector<T> const& x) {
  double m = 0;
  for (T v : x) {
    double const a = std::fabs(mpx::detail::to_double(v));
    m = (std::isnan(a) || std::isnan(m)) ? std::nan("") : std::max(m, a);
  }
  return m;
}

// The documented contract: saturate_cast<Format>(float(x) * scale), element for element.
template <class Format, class T>
std::vector<Format> fp8s_expected(std::vector<T> const& x, float scale) {
  std::vector<Format> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = mpx::saturate_cast<Format>(mpx::cast<float>(x[i]) * scale);
  return out;
}

inline float fp8s_step_amax(mpx::fp8_scale_values const& v) {
  return mpx::detail::bit_cast<float>(v.step_amax_bits);
}

// What every finished step leaves in the state, against the reference.
inline void fp8s_check_finished_step(mpx::fp8_scale_values const& after, float scale, double amax,
                                     std::uint64_t steps) {
  CHECK(after.scale == scale);
  CHECK(after.inverse_scale == 1.0f / scale);
  CHECK(static_cast<double>(after.last_amax) == amax);
  CHECK(after.step_amax_bits == 0u);
  CHECK(after.steps == steps);
}

// Casts x with the state's recipe into a NaN-poisoned output; returns the output, and
// fails where it holds a NaN that x does not (an element the cast did not write, so
// that comparing two casts cannot pass on poison alone).
template <class Exec, class Format, class T, class Recipe>
std::vector<Format> fp8s_cast(Exec const& exec, std::vector<T> const& x, mpx::fp8_tensor_scale<Format, Exec>& state,
                              Recipe const& recipe) {
  mpx::shape const shape{static_cast<std::int64_t>(x.size())};
  auto const dx = mpx_test::upload(exec, x, shape);
  auto out = mpx_test::poisoned<Format>(exec, shape);
  mpx::cast_to_fp8(exec, dx, state, out, recipe);
  auto got = mpx_test::download(exec, out);
  std::size_t unwritten = 0;
  for (std::size_t i = 0; i < got.size(); ++i) unwritten += mpx::is_nan(got[i]) && !mpx::is_nan(x[i]);
  CHECK(unwritten == 0);
  return got;
}

// Inputs for step k: sizes cycle through the awkward ones, magnitudes through nine
// decades (some steps saturate at the initial scale, some underflow).
template <class T>
std::vector<T> fp8s_step_input(std::size_t k, std::uint64_t stream) {
  static constexpr std::size_t sizes[] = {1000, 7, 65537, 1, 0, 1000, 7};
  static constexpr double magnitudes[] = {3.0, 1e3, 0.02, 5e4, 1.0, 1e-3, 200.0, 0.5, 30.0};
  double const hi = magnitudes[k % 9];
  return mpx_test::random_values<T>(sizes[k % 7], -hi, hi, stream + k);
}

template <class Exec, class Format, class T>
void fp8s_check_delayed_run(Exec const& exec, std::uint32_t length, int margin) {
  CAPTURE(mpx::dtype_name<Format>, mpx::dtype_name<T>, length, margin);
  mpx::delayed_scaling const recipe{length, margin};
  mpx::fp8_tensor_scale<Format, Exec> state(exec, recipe);
  fp8s_reference ref{mpx::detail::to_double(mpx::dtype_traits<Format>::max()), std::ldexp(1.0, -margin),
                     std::vector<double>(length, 0.0)};
  std::size_t nonzero_amaxes = 0;
  for (std::size_t k = 0; k < 20; ++k) {
    CAPTURE(k);
    auto const x = fp8s_step_input<T>(k, 100 * length + static_cast<std::uint64_t>(margin));
    auto const got = fp8s_cast(exec, x, state, recipe);
    // cast with the scale of the steps before this one
    CHECK(mpx_test::first_mismatch(got, fp8s_expected<Format>(x, ref.scale)) == "");
    double const amax = fp8s_amax(x);
    nonzero_amaxes += amax > 0;
    auto const before = state.values(exec);
    CHECK(static_cast<double>(fp8s_step_amax(before)) == amax);
    mpx::update_fp8_scale(exec, state, recipe);
    ref.delayed_update(amax);
    auto const after = state.values(exec);
    fp8s_check_finished_step(after, ref.scale, amax, k + 1);
    CHECK(after.position == ref.position);
    for (std::size_t i = 0; i < length; ++i) CHECK(static_cast<double>(after.history[i]) == ref.history[i]);
  }
  CHECK(nonzero_amaxes > 10);  // the reference did not run on empty inputs only
}

template <class Exec, class Format, class T>
void fp8s_check_current_run(Exec const& exec, int margin) {
  CAPTURE(mpx::dtype_name<Format>, mpx::dtype_name<T>, margin);
  mpx::current_scaling const recipe{margin};
  mpx::fp8_tensor_scale<Format, Exec> state(exec, recipe);
  fp8s_reference ref{mpx::detail::to_double(mpx::dtype_traits<Format>::max()), std::ldexp(1.0, -margin), {0.0}};
  for (std::size_t k = 0; k < 9; ++k) {
    CAPTURE(k);
    auto const x = fp8s_step_input<T>(k, 7 + static_cast<std::uint64_t>(margin));
    auto const got = fp8s_cast(exec, x, state, recipe);
    double const amax = fp8s_amax(x);
    ref.set_scale_from(amax);  // this very tensor's amax, before its cast
    CHECK(mpx_test::first_mismatch(got, fp8s_expected<Format>(x, ref.scale)) == "");
    auto const after = state.values(exec);
    fp8s_check_finished_step(after, ref.scale, amax, k + 1);
  }
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("cast_to_fp8 with delayed scaling: values, amax and scale against float64", "[scaling][fp8]",
                        mpx_test::executors) {
  TestType exec;
  auto const formats = [&]<class T>(T) {
    for (std::uint32_t length : {1u, 3u, 16u}) {
      fp8s_check_delayed_run<TestType, mpx::float8_e4m3, T>(exec, length, length == 3 ? 2 : 0);
      fp8s_check_delayed_run<TestType, mpx::float8_e5m2, T>(exec, length, length == 16 ? 1 : 0);
    }
  };
  mpx_test::for_each_dtype(formats);
}

TEMPLATE_LIST_TEST_CASE("cast_to_fp8 with current scaling: the scale of this very tensor, then the cast",
                        "[scaling][fp8]", mpx_test::executors) {
  TestType exec;
  mpx_test::for_each_dtype([&]<class T>(T) {
    for (int margin : {0, 3}) {
      fp8s_check_current_run<TestType, mpx::float8_e4m3, T>(exec, margin);
      fp8s_check_current_run<TestType, mpx::float8_e5m2, T>(exec, margin);
    }
  });
}

TEMPLATE_LIST_TEST_CASE("cast_to_fp8 sees a NaN or inf: the scale stays while it is in the history",
                        "[scaling][fp8]", mpx_test::executors) {
  TestType exec;
  using F = mpx::float8_e4m3;
  mpx::delayed_scaling const recipe{3, 0};
  mpx::fp8_tensor_scale<F, TestType> state(exec, recipe, 2.0f);
  auto const finite = mpx_test::random_values<float>(65537, -10.0, 10.0, 1);
  std::vector<mpx::half> with_nan(65537, mpx::half(1.0f));
  with_nan[65536] = mpx::dtype_traits<mpx::half>::quiet_nan();  // the last element: a tail of the grid
  with_nan[3] = mpx::half(-7.0f);

  auto const got = fp8s_cast(exec, with_nan, state, recipe);
  CHECK(mpx_test::first_mismatch(got, fp8s_expected<F>(with_nan, 2.0f)) == "");
  CHECK(mpx::is_nan(got[65536]));
  CHECK(std::isnan(fp8s_step_amax(state.values(exec))));
  mpx::update_fp8_scale(exec, state, recipe);
  auto v = state.values(exec);
  CHECK(v.scale == 2.0f);  // kept
  CHECK(std::isnan(v.last_amax));
  CHECK(v.nonfinite_steps == 1u);
  CHECK(std::isnan(v.history[0]));
  // Two finite steps: the NaN is still in the window of 3, so the scale stays.
  for (int k = 0; k < 2; ++k) {
    (void)fp8s_cast(exec, finite, state, recipe);
    mpx::update_fp8_scale(exec, state, recipe);
    CHECK(state.values(exec).scale == 2.0f);
  }
  // The third one pushes it out: the scale follows the finite amaxes again.
  (void)fp8s_cast(exec, finite, state, recipe);
  mpx::update_fp8_scale(exec, state, recipe);
  v = state.values(exec);
  CHECK(v.scale == static_cast<float>(448.0 / fp8s_amax(finite)));
  CHECK(v.nonfinite_steps == 1u);

  // inf saturates to ±max in the output, and keeps the scale like NaN.
  mpx::fp8_tensor_scale<F, TestType> current(exec, mpx::current_scaling{}, 0.5f);
  std::vector<float> with_inf = {1.0f, -std::numeric_limits<float>::infinity(), 3.0f};
  auto const out = fp8s_cast(exec, with_inf, current, mpx::current_scaling{});
  CHECK(mpx_test::first_mismatch(out, fp8s_expected<F>(with_inf, 0.5f)) == "");
  CHECK(mpx::bits(out[1]) == mpx::bits(mpx::dtype_traits<F>::lowest()));
  v = current.values(exec);
  CHECK(v.scale == 0.5f);
  CHECK(std::isinf(v.last_amax));
  CHECK(v.nonfinite_steps == 1u);
}

TEMPLATE_LIST_TEST_CASE("cast_to_fp8 of an all-zero or empty tensor keeps the scale", "[scaling][fp8]",
                        mpx_test::executors) {
  TestType exec;
  using F = mpx::float8_e5m2;
  for (std::size_t n : {std::size_t{0}, std::size_t{1000}}) {
    CAPTURE(n);
    std::vector<mpx::bfloat16> const zeros(n, mpx::bfloat16(0.0f));
    mpx::fp8_tensor_scale<F, TestType> delayed(exec, mpx::delayed_scaling{4, 0}, 8.0f);
    auto const got = fp8s_cast(exec, zeros, delayed, mpx::delayed_scaling{4, 0});
    CHECK(mpx_test::first_mismatch(got, std::vector<F>(n, mpx::cast<F>(0.0f))) == "");
    mpx::update_fp8_scale(exec, delayed, mpx::delayed_scaling{4, 0});
    CHECK(delayed.values(exec).scale == 8.0f);
    CHECK(delayed.values(exec).nonfinite_steps == 0u);

    mpx::fp8_tensor_scale<F, TestType> current(exec, mpx::current_scaling{}, 8.0f);
    (void)fp8s_cast(exec, zeros, current, mpx::current_scaling{});
    CHECK(current.values(exec).scale == 8.0f);
  }
}

TEMPLATE_LIST_TEST_CASE("a scale beyond float's range becomes the largest float", "[scaling][fp8]",
                        mpx_test::executors) {
  TestType exec;
  using F = mpx::float8_e4m3;
  std::vector<float> const tiny = {1e-38f, -2e-39f};  // 448 / 1e-38 overflows float
  mpx::fp8_tensor_scale<F, TestType> state(exec, mpx::current_scaling{});
  auto const got = fp8s_cast(exec, tiny, state, mpx::current_scaling{});
  float const largest = std::numeric_limits<float>::max();
  CHECK(state.values(exec).scale == largest);
  CHECK(state.values(exec).inverse_scale == 1.0f / largest);
  CHECK(mpx_test::first_mismatch(got, fp8s_expected<F>(tiny, largest)) == "");
}

TEMPLATE_LIST_TEST_CASE("cast_to_fp8 folds the casts of one step into one amax", "[scaling][fp8]",
                        mpx_test::executors) {
  TestType exec;
  using F = mpx::float8_e5m2;
  mpx::delayed_scaling const recipe{2, 0};
  mpx::fp8_tensor_scale<F, TestType> state(exec, recipe);
  auto const big = mpx_test::random_values<float>(1000, -50.0, 50.0, 11);
  auto const small = mpx_test::random_values<mpx::half>(65537, -2.0, 2.0, 12);
  auto const first = fp8s_cast(exec, big, state, recipe);
  auto const second = fp8s_cast(exec, small, state, recipe);  // the same scale: no update between
  CHECK(mpx_test::first_mismatch(second, fp8s_expected<F>(small, 1.0f)) == "");
  double const amax = std::max(fp8s_amax(big), fp8s_amax(small));
  CHECK(fp8s_amax(big) > fp8s_amax(small));
  CHECK(static_cast<double>(fp8s_step_amax(state.values(exec))) == amax);
  mpx::update_fp8_scale(exec, state, recipe);
  CHECK(state.values(exec).scale == static_cast<float>(57344.0 / amax));
}

TEMPLATE_LIST_TEST_CASE("fp8 scaling refuses bad recipes, shapes and states", "[scaling][fp8]",
                        mpx_test::executors) {
  TestType exec;
  using F = mpx::float8_e4m3;
  CHECK_THROWS_AS((mpx::fp8_tensor_scale<F, TestType>(exec, mpx::delayed_scaling{0, 0})), mpx::invalid_argument);
  CHECK_THROWS_AS((mpx::fp8_tensor_scale<F, TestType>(exec, mpx::delayed_scaling{1025, 0})), mpx::invalid_argument);
  CHECK_THROWS_AS((mpx::fp8_tensor_scale<F, TestType>(exec, mpx::delayed_scaling{}, 0.0f)), mpx::invalid_argument);
  mpx::fp8_tensor_scale<F, TestType> state(exec, mpx::delayed_scaling{8, 0});
  CHECK_THROWS_AS(mpx::update_fp8_scale(exec, state, mpx::delayed_scaling{4, 0}), mpx::invalid_argument);
  CHECK_THROWS_AS(mpx::update_fp8_scale(exec, state, mpx::delayed_scaling{8, -1}), mpx::invalid_argument);
  auto x = mpx::make_tensor<float>(exec, {4});
  auto out = mpx::make_tensor<F>(exec, {5});
  CHECK_THROWS_AS(mpx::cast_to_fp8(exec, x, state, out), mpx::shape_error);
  mpx::tensor_view<F, mpx::memory_space_t<TestType>> aliased(reinterpret_cast<F*>(x.data()) + 1, x.shape());
  CHECK_THROWS_AS(mpx::cast_to_fp8(exec, x, state, aliased), mpx::invalid_argument);
  auto v = state.values(exec);
  v.scale = std::numeric_limits<float>::infinity();
  CHECK_THROWS_AS(state.set_values(exec, v), mpx::invalid_argument);
}

TEMPLATE_LIST_TEST_CASE("fp8 scaling state round-trips through a checkpoint and refuses impossible ones",
                        "[scaling][fp8]", mpx_test::executors) {
  TestType exec;
  using F = mpx::float8_e4m3;
  mpx_test::scratch_dir dir("fp8_scaling_" + std::string(TestType::name));
  mpx::delayed_scaling const recipe{5, 1};
  mpx::fp8_tensor_scale<F, TestType> state(exec, recipe);
  for (std::size_t k = 0; k < 7; ++k) {
    (void)fp8s_cast(exec, fp8s_step_input<float>(k, 3), state, recipe);
    mpx::update_fp8_scale(exec, state, recipe);
  }
  auto const saved = state.values(exec);
  {
    mpx::detail::checkpoint_writer out("mpx::test");
    state.save(exec, out, "dense0/input");
    out.commit(dir / "good.mpx");
  }
  mpx::fp8_tensor_scale<F, TestType> restored(exec, recipe);
  {
    mpx::detail::checkpoint_reader const in(dir / "good.mpx", "mpx::test");
    restored.load(exec, in, "dense0/input");
  }
  auto const back = restored.values(exec);
  CHECK(std::memcmp(&back, &saved, sizeof back) == 0);

  auto refused = [&](std::string const& file, auto&& make, std::string const& message, auto& into) {
    {
      mpx::detail::checkpoint_writer out("mpx::test");
      make(out);
      out.commit(dir / file);
    }
    mpx::detail::checkpoint_reader const in(dir / file, "mpx::test");
    CHECK_THROWS_TYPE_WITH(into.load(exec, in, "t"), mpx::checkpoint_error, Catch::Contains(message));
  };
  auto with_state = [&](mpx::fp8_scale_values const& v, std::string_view format = "float8_e4m3fn") {
    return [v, format](mpx::detail::checkpoint_writer& out) {
      out.add("t/format", std::span(reinterpret_cast<std::byte const*>(format.data()), format.size()));
      out.add_value("t/state", v);
    };
  };
  mpx::fp8_tensor_scale<F, TestType> other_length(exec, mpx::delayed_scaling{6, 0});
  refused("length.mpx", with_state(saved), "history of 5 steps, this one of 6", other_length);
  refused("format.mpx", with_state(saved, "float8_e5m2"), "is for float8_e5m2", restored);
  auto bad = saved;
  bad.scale = -1.0f;
  refused("negative.mpx", with_state(bad), "not positive and finite", restored);
  bad.scale = std::numeric_limits<float>::quiet_NaN();
  refused("nan.mpx", with_state(bad), "not positive and finite", restored);
  bad = saved;
  bad.inverse_scale *= 2.0f;
  refused("inverse.mpx", with_state(bad), "inverse scale", restored);
  bad = saved;
  bad.position = 5;
  refused("position.mpx", with_state(bad), "past its length", restored);
  bad = saved;
  bad.history[2] = -1.0f;
  refused("history.mpx", with_state(bad), "history slot 2", restored);
  // Nothing was changed by the refusals.
  auto const still = restored.values(exec);
  CHECK(std::memcmp(&still, &saved, sizeof still) == 0);
  // The restored state goes on exactly as the original.
  auto const x = fp8s_step_input<float>(8, 3);
  CHECK(mpx_test::first_mismatch(fp8s_cast(exec, x, restored, recipe), fp8s_cast(exec, x, state, recipe)) == "");
  mpx::update_fp8_scale(exec, restored, recipe);
  mpx::update_fp8_scale(exec, state, recipe);
  auto const a = restored.values(exec), b = state.values(exec);
  CHECK(std::memcmp(&a, &b, sizeof a) == 0);
}

// The example of docs/fp8.md (quoted there between the markers).
TEMPLATE_LIST_TEST_CASE("fp8 scaling: the example of docs/fp8.md", "[scaling][fp8]", mpx_test::executors) {
  TestType exec;
  std::vector<float> const activations = {0.5f, -3.0f, 12.0f, 0.25f};
  auto x = mpx_test::upload(exec, activations);
  // [fp8 example]
  mpx::delayed_scaling const recipe{16, 0};                   // 16 steps of amax history, no margin
  mpx::fp8_tensor_scale<mpx::float8_e4m3, decltype(exec)> scale(exec, recipe);  // scale 1
  auto x8 = mpx::make_tensor<mpx::float8_e4m3>(exec, x.shape());
  for (int step = 0; step < 2; ++step) {
    mpx::cast_to_fp8(exec, x, scale, x8);        // x8 = saturate(x * scale); amax(|x|) recorded
    // ... x8 feeds an fp8 product; its result is multiplied by scale.inverse_scale_data() ...
    mpx::update_fp8_scale(exec, scale, recipe);  // scale = 448 / max(history), on the executor
  }
  mpx::fp8_scale_values const v = scale.values(exec);  // synchronises
  // v.scale == 448 / 12 (rounded to float); v.last_amax == 12; v.steps == 2
  // [fp8 example]
  CHECK(v.scale == 448.0f / 12.0f);
  CHECK(v.inverse_scale == 1.0f / v.scale);
  CHECK(v.last_amax == 12.0f);
  CHECK(v.steps == 2u);
  // The second step cast with 448 / 12: 12 became 448, the largest e4m3 value.
  CHECK(mpx::bits(mpx_test::download(exec, x8)[2]) == mpx::bits(mpx::dtype_traits<mpx::float8_e4m3>::max()));
}
