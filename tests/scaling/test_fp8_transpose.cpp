// cast_to_fp8_transposed: bit for bit cast_to_fp8 followed by a transpose on the host,
// the same amax recorded, for every input dtype and both formats, awkward shapes
// (1 x 1, 3 x 70, 33 x 65, more than one tile each way) and a batch; NaN and inf in x as
// cast_to_fp8 treats them; shape errors naming both shapes.
#include "support/testing.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace fp8_transpose_cases {

//! out[b][j][i] = in[b][i][j] for in [batch, rows, cols].
template <class T>
std::vector<T> transposed(std::vector<T> const& in, std::int64_t batch, std::int64_t rows, std::int64_t cols) {
  std::vector<T> out(in.size());
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j) {
        auto const from = static_cast<std::size_t>((b * rows + i) * cols + j);
        out[static_cast<std::size_t>((b * cols + j) * rows + i)] = in[from];
      }
  return out;
}

//! x [batch, rows, cols] (rank 2 when batch is 0) through cast_to_fp8_transposed and
//! through cast_to_fp8 + a host transpose, each with its own state of scale 3: the
//! outputs bit for bit, the step amaxes equal and equal to |x|'s maximum.
template <class Format, class T, class Exec>
void check_against_cast(Exec const& exec, std::vector<T> const& x, std::int64_t batch, std::int64_t rows,
                        std::int64_t cols) {
  CAPTURE(mpx::dtype_name<Format>, mpx::dtype_name<T>, batch, rows, cols);
  std::int64_t const nb = batch == 0 ? 1 : batch;
  mpx::shape const x_shape = batch == 0 ? mpx::shape{rows, cols} : mpx::shape{batch, rows, cols};
  mpx::shape const out_shape = batch == 0 ? mpx::shape{cols, rows} : mpx::shape{batch, cols, rows};
  auto const xd = mpx_test::upload(exec, x, x_shape);
  mpx::fp8_tensor_scale<Format, Exec> state(exec, mpx::delayed_scaling{}, 3.0f);
  mpx::fp8_tensor_scale<Format, Exec> reference_state(exec, mpx::delayed_scaling{}, 3.0f);
  auto out = mpx_test::poisoned<Format>(exec, out_shape);
  auto flat = mpx_test::poisoned<Format>(exec, x_shape);
  mpx::cast_to_fp8_transposed(exec, xd, state, out);
  mpx::cast_to_fp8(exec, xd, reference_state, flat);
  auto const expected = transposed(mpx_test::download(exec, flat), nb, rows, cols);
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, out), expected) == "");
  std::uint32_t const got_amax = state.values(exec).step_amax_bits;
  CHECK(got_amax == reference_state.values(exec).step_amax_bits);
  double amax = 0;
  for (T v : x) {
    double const a = std::fabs(mpx::detail::to_double(v));
    amax = (std::isnan(a) || std::isnan(amax)) ? std::nan("") : std::max(amax, a);
  }
  double const recorded = mpx::detail::bit_cast<float>(got_amax);
  if (std::isnan(amax)) CHECK(std::isnan(recorded));
  else CHECK(recorded == amax);
}

}  // namespace fp8_transpose_cases

TEMPLATE_LIST_TEST_CASE("cast_to_fp8_transposed is cast_to_fp8 and a transpose, bit for bit, with the same amax",
                        "[scaling][fp8]", mpx_test::executors) {
  using namespace fp8_transpose_cases;
  TestType exec;
  auto for_input = [&](auto tag) {
    using T = decltype(tag);
    std::uint64_t stream = 0;
    // Batch 0: a matrix. 33 x 65 and 70 x 100 need several tiles each way, and partial ones.
    for (auto [batch, rows, cols] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{0, 1, 1},
                                     {0, 3, 70},
                                     {0, 70, 3},
                                     {0, 33, 65},
                                     {0, 64, 32},
                                     {0, 70, 100},
                                     {2, 33, 65},
                                     {3, 1, 40}}) {
      // Up to 200 * 3 = 600: e4m3 saturates (448) for some, e5m2 does not.
      auto const x = mpx_test::random_values<T>(static_cast<std::size_t>((batch ? batch : 1) * rows * cols), -200,
                                                200, 900 + stream++);
      check_against_cast<mpx::float8_e4m3>(exec, x, batch, rows, cols);
      check_against_cast<mpx::float8_e5m2>(exec, x, batch, rows, cols);
    }
  };
  mpx_test::for_each_dtype(for_input);
}

TEMPLATE_LIST_TEST_CASE("cast_to_fp8_transposed sees a NaN or inf as cast_to_fp8 does", "[scaling][fp8]",
                        mpx_test::executors) {
  using namespace fp8_transpose_cases;
  TestType exec;
  using F = mpx::float8_e4m3;
  std::int64_t const rows = 33, cols = 65;
  auto x = mpx_test::random_values<float>(static_cast<std::size_t>(rows * cols), -1, 1, 77);
  x[5 * cols + 40] = std::numeric_limits<float>::infinity();
  check_against_cast<F>(exec, x, 0, rows, cols);  // inf: saturates to max, the amax is inf
  x[20 * cols + 7] = std::numeric_limits<float>::quiet_NaN();
  check_against_cast<F>(exec, x, 0, rows, cols);  // NaN: stays NaN, the amax is NaN

  // The NaN step keeps the scale, as after cast_to_fp8.
  mpx::delayed_scaling const recipe{.history_length = 1};
  mpx::fp8_tensor_scale<F, TestType> state(exec, recipe, 3.0f);
  auto const xd = mpx_test::upload(exec, x, {rows, cols});
  auto out = mpx_test::poisoned<F>(exec, {cols, rows});
  mpx::cast_to_fp8_transposed(exec, xd, state, out);
  auto const got = mpx_test::download(exec, out);
  CHECK(mpx::is_nan(got[7 * rows + 20]));
  CHECK(mpx::bits(got[40 * rows + 5]) == mpx::bits(mpx::dtype_traits<F>::max()));
  mpx::update_fp8_scale(exec, state, recipe);
  auto const after = state.values(exec);
  CHECK(after.scale == 3.0f);
  CHECK(std::isnan(after.last_amax));
  CHECK(after.nonfinite_steps == 1u);
}

TEMPLATE_LIST_TEST_CASE("cast_to_fp8_transposed of an empty matrix writes and records nothing", "[scaling][fp8]",
                        mpx_test::executors) {
  TestType exec;
  using F = mpx::float8_e5m2;
  mpx::fp8_tensor_scale<F, TestType> state(exec);
  auto const x = mpx::make_tensor<mpx::half>(exec, {0, 5});
  auto out = mpx::make_tensor<F>(exec, {5, 0});
  mpx::cast_to_fp8_transposed(exec, x, state, out);
  CHECK(state.values(exec).step_amax_bits == 0u);
}

TEMPLATE_LIST_TEST_CASE("cast_to_fp8_transposed refuses shapes that are not transposes and names both",
                        "[scaling][fp8]", mpx_test::executors) {
  using Catch::Matchers::Contains;
  TestType exec;
  using F = mpx::float8_e4m3;
  mpx::fp8_tensor_scale<F, TestType> state(exec);
  auto const x = mpx::make_tensor<float>(exec, {3, 70});
  auto same = mpx::make_tensor<F>(exec, {3, 70});
  CHECK_THROWS_TYPE_WITH(mpx::cast_to_fp8_transposed(exec, x, state, same), mpx::shape_error,
                         Contains("mpx::cast_to_fp8_transposed: out must have x's shape with the last two extents "
                                  "swapped; x has shape [3, 70], out has shape [3, 70]"));
  auto flat = mpx::make_tensor<F>(exec, {210});
  CHECK_THROWS_TYPE_WITH(mpx::cast_to_fp8_transposed(exec, x, state, flat), mpx::shape_error,
                         Contains("x has shape [3, 70], out has shape [210]"));
  auto const v = mpx::make_tensor<float>(exec, {210});
  CHECK_THROWS_TYPE_WITH(mpx::cast_to_fp8_transposed(exec, v, state, flat), mpx::shape_error,
                         Contains("x must be a matrix [rows, cols] or a batch of them"));
  auto const xb = mpx::make_tensor<float>(exec, {2, 3, 4});
  auto other_batch = mpx::make_tensor<F>(exec, {3, 4, 3});
  CHECK_THROWS_TYPE_WITH(mpx::cast_to_fp8_transposed(exec, xb, state, other_batch), mpx::shape_error,
                         Contains("x has shape [2, 3, 4], out has shape [3, 4, 3]"));
  auto ok = mpx::make_tensor<F>(exec, {2, 4, 3});
  auto const ones = mpx_test::upload(exec, std::vector<float>(24, 1.0f), {2, 3, 4});
  CHECK_NOTHROW(mpx::cast_to_fp8_transposed(exec, ones, state, ok));
  mpx::tensor_view<F, mpx::memory_space_t<TestType>> aliased(reinterpret_cast<F*>(x.data()) + 1, {70, 3});
  CHECK_THROWS_AS(mpx::cast_to_fp8_transposed(exec, x, state, aliased), mpx::invalid_argument);
}
