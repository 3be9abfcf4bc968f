// Past 2^31 elements: tensors of 2^31 + 17 elements through every path whose index
// could wrap in 32 bits (elementwise and casts, the reductions and finite checks,
// unscale-and-check over a list that crosses 2^31 in total, the optimizer step, column
// and row reductions), checking the elements at the far end. 16- and 8-bit dtypes keep
// the host's peak near 8 GiB. Tagged [2g]: the build runs them as their own test
// (host_past_2g), beside the host suite; the CUDA suite runs them on the GPU.
#include "../support/testing.hpp"

#include <mpx/kernels/activation.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/kernels/softmax.hpp>
#include <mpx/numerics/finite.hpp>
#include <mpx/numerics/stats.hpp>
#include <mpx/numerics/sum_of_squares.hpp>
#include <mpx/optim/sgd.hpp>
#include <mpx/scaling/unscale_and_check.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>


namespace large_tensors {

constexpr std::size_t past_2g = (std::size_t{1} << 31) + 17;
constexpr std::size_t tail = 17;

// The last `tail` elements of x as floats.
template <class Exec, class T, class Space>
std::vector<float> last_values(Exec const& exec, mpx::tensor<T, Space> const& x) {
  std::vector<float> out;
  for (T v : mpx_test::download(exec, x.view().flat(x.size() - tail, tail))) out.push_back(mpx::cast<float>(v));
  return out;
}

// Writes `values` (as T) over the last elements of x.
template <class Exec, class T, class Space>
void set_last(Exec const& exec, mpx::tensor<T, Space>& x, std::vector<float> const& values) {
  std::vector<T> typed;
  for (float v : values) typed.push_back(mpx::cast<T>(v));
  mpx::copy(exec, mpx::tensor_view<T const, mpx::host_space>(typed.data(), {static_cast<std::int64_t>(typed.size())}),
            x.view().flat(x.size() - typed.size(), typed.size()));
}

std::vector<float> ramp() {
  std::vector<float> v(tail);
  for (std::size_t i = 0; i < tail; ++i) v[i] = 0.25f * static_cast<float>(i + 1);
  return v;
}

TEMPLATE_LIST_TEST_CASE("past 2^31 elements: elementwise, casts, reductions and finite checks reach the last element",
                        "[2g]", mpx_test::executors) {
  if (MPX_TEST_UNDER_ASAN) return;
  TestType exec;
  auto x = mpx::make_tensor<mpx::half>(exec, {static_cast<std::int64_t>(past_2g)});
  mpx::fill(exec, x, mpx::cast<mpx::half>(1.0f));
  set_last(exec, x, ramp());
  mpx::scale(exec, x, 2.0f);
  std::vector<float> doubled = ramp();
  for (float& v : doubled) v *= 2;
  CHECK(last_values(exec, x) == doubled);
  CHECK(mpx::cast<float>(mpx_test::download(exec, x.view().flat(0, 1))[0]) == 2.0f);

  {  // a cast into fp8, its last elements
    auto y = mpx::make_tensor<mpx::float8_e4m3>(exec, {static_cast<std::int64_t>(past_2g)});
    mpx::cast(exec, x, y);
    std::vector<float> rounded;
    for (float v : doubled) rounded.push_back(mpx::cast<float>(mpx::cast<mpx::float8_e4m3>(v)));
    CHECK(last_values(exec, y) == rounded);
  }

  // sum of squares: 2^31 twos and the ramp
  double expected = 4.0 * static_cast<double>(past_2g - tail);
  for (float v : doubled) expected += static_cast<double>(v) * v;
  double const sum = mpx::sum_of_squares<mpx::mixed_float16>(exec, x);
  CHECK(std::abs(sum - expected) <= 1e-5 * expected);

  // the finite checks see values planted at the very end
  set_last(exec, x, {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()});
  CHECK(mpx::count_nonfinite(exec, x) == 2);  // (all_finite is count_nonfinite == 0)
  mpx::numerics_stats const s = mpx::stats(exec, x);
  CHECK(s.size == past_2g);
  CHECK(s.nan == 1);
  CHECK(s.inf == 1);
  CHECK(s.absmax == doubled[tail - 3]);  // the largest ramp value the NaN and inf left
}

TEMPLATE_LIST_TEST_CASE("past 2^31 elements: unscale-and-check over a list that crosses 2^31 in total, and an "
                        "optimizer step over one parameter past it",
                        "[2g]", mpx_test::executors) {
  if (MPX_TEST_UNDER_ASAN) return;
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  std::int64_t const half_count = (std::int64_t{1} << 30) + 9;  // two of them: 2^31 + 18
  {
    auto a = mpx::make_tensor<mpx::half>(exec, {half_count});
    auto b = mpx::make_tensor<mpx::half>(exec, {half_count});
    mpx::fill(exec, a, mpx::cast<mpx::half>(0.5f));
    mpx::fill(exec, b, mpx::cast<mpx::half>(0.5f));
    mpx::gradient_list<TestType> list(exec, {a, b}, {"a", "b"});
    auto scale = mpx_test::upload(exec, std::vector<float>{0.5f}, mpx::shape{1});
    mpx::unscale_and_check(exec, list, scale.data());
    auto const norms = list.norms(exec);
    double const each = std::sqrt(static_cast<double>(half_count));  // 2^30 + 9 ones, unscaled
    CHECK(std::abs(norms[1] - each) <= 1e-5 * each);
    CHECK(last_values(exec, b) == std::vector<float>(tail, 1.0f));  // unscaled in place to the very end
    set_last(exec, b, {std::numeric_limits<float>::infinity()});
    mpx::unscale_and_check(exec, list, scale.data());
    auto const summary = list.summary(exec);
    CHECK(summary.found_nonfinite == 1);
    CHECK(summary.first_nonfinite == 1);
    CHECK(summary.last_nonfinite == 1);
  }
  {  // SGD on a bfloat16 parameter of 2^31 + 17 values, without master weights: w -= 0.5 * g
    auto w = mpx::make_tensor<mpx::bfloat16>(exec, {static_cast<std::int64_t>(past_2g)});
    auto g = mpx::make_tensor<mpx::bfloat16>(exec, {static_cast<std::int64_t>(past_2g)});
    mpx::fill(exec, w, mpx::cast<mpx::bfloat16>(1.0f));
    mpx::fill(exec, g, mpx::cast<mpx::bfloat16>(1.0f));
    set_last(exec, g, ramp());
    mpx::sgd optimizer(exec, std::vector<mpx::parameter<Space>>{{"w", w, g}}, 0.5f, {},
                       mpx::master_weight_options{.master = mpx::master_weights::none});
    optimizer.step(exec);
    std::vector<float> expected = ramp();
    for (float& v : expected) v = 1.0f - 0.5f * v;
    CHECK(last_values(exec, w) == expected);
    CHECK(mpx::cast<float>(mpx_test::download(exec, w.view().flat(0, 1))[0]) == 0.5f);
  }
}

TEMPLATE_LIST_TEST_CASE("past 2^31 elements: a column reduction and a row reduction over [2^21 + 1, 1024]", "[2g]",
                        mpx_test::executors) {
  if (MPX_TEST_UNDER_ASAN) return;
  TestType exec;
  std::int64_t const rows = (std::int64_t{1} << 21) + 1, cols = 1024;
  auto x = mpx::make_tensor<mpx::half>(exec, {rows, cols});
  mpx::fill(exec, x, mpx::cast<mpx::half>(1.0f));
  set_last(exec, x, ramp());  // the last row's last 17 columns

  auto db = mpx::make_tensor<float>(exec, {cols});
  mpx::bias_gradient(exec, x, db);
  auto const sums = mpx_test::download(exec, db);
  CHECK(sums[0] == static_cast<float>(rows));  // 2^21 + 1 ones, exact in float
  for (std::size_t j = 0; j < tail; ++j)
    CHECK(sums[static_cast<std::size_t>(cols) - tail + j] == static_cast<float>(rows - 1) + ramp()[j]);

  mpx::softmax(exec, x, x);  // in place: the last row's weights follow its values
  auto const last_row = mpx_test::download(exec, x.view().flat(x.size() - static_cast<std::size_t>(cols), cols));
  double total = 0;
  for (auto v : last_row) total += mpx::cast<float>(v);
  CHECK(std::abs(total - 1.0) < 2e-3);
  CHECK(mpx::cast<float>(last_row.back()) > mpx::cast<float>(last_row.front()));  // e^4.25 against e^1
  CHECK(mpx::cast<float>(mpx_test::download(exec, x.view().flat(0, 1))[0]) == mpx::cast<float>(mpx::cast<mpx::half>(1.0f / 1024)));
}

}  // namespace large_tensors
