// cast_to_fp8_transposed: bit for bit the host executor's cast_to_fp8 followed by a
// transpose (the reference is computed on the host from the inputs copied back, so a GPU
// kernel is checked against the host's, not only against its own flat cast), the same
// amax recorded, for every input dtype and both formats, awkward shapes (1 x 1, 3 x 70,
// 33 x 65, more than one tile each way) and a batch; NaN and inf in x as cast_to_fp8
// treats them; the padded casts (zeros past K, for fp8_gemm's K); shape errors naming
// both shapes. Outputs are poisoned with NaN, and only a NaN input may give a NaN.
#include "support/testing.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
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

//! out with each row of `cols` values padded with zeros to `pitch`.
template <class F>
std::vector<F> padded(std::vector<F> const& in, std::int64_t cols, std::int64_t pitch) {
  std::int64_t const rows = cols ? static_cast<std::int64_t>(in.size()) / cols : 0;
  std::vector<F> out(static_cast<std::size_t>(rows * pitch), mpx::cast<F>(0.0f));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      out[static_cast<std::size_t>(r * pitch + c)] = in[static_cast<std::size_t>(r * cols + c)];
  return out;
}

//! The host executor's cast_to_fp8 of x (copied back from wherever the case runs) with a
//! state of `scale`, and the step amax it recorded: the reference of every cast here.
template <class Format, class T>
std::pair<std::vector<Format>, std::uint32_t> host_cast(std::vector<T> const& x, float scale) {
  mpx::host_executor const host;
  mpx::fp8_tensor_scale<Format, mpx::host_executor> state(host, mpx::delayed_scaling{}, scale);
  auto const xh = mpx_test::upload(host, x);
  auto out = mpx_test::poisoned<Format>(host, xh.shape());
  mpx::cast_to_fp8(host, xh, state, out);
  return {mpx_test::download(host, out), state.values(host).step_amax_bits};
}

//! Fails unless got has a NaN exactly where expected has one (a poisoned element that no
//! kernel wrote is a NaN where a number belongs).
template <class F>
void check_nan_only_where_expected(std::vector<F> const& got, std::vector<F> const& expected) {
  REQUIRE(got.size() == expected.size());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) bad += mpx::is_nan(got[i]) != mpx::is_nan(expected[i]);
  CHECK(bad == 0);
}

//! x [batch, rows, cols] (rank 2 when batch is 0) through cast_to_fp8_transposed (and,
//! with pad > 0, cast_to_fp8_transposed_padded to rows + pad) on `exec`, and through the
//! host's cast_to_fp8 + a transpose, each with its own state of scale 3: the outputs bit
//! for bit (zeros in the padding), the step amaxes equal and equal to |x|'s maximum.
template <class Format, class T, class Exec>
void check_against_cast(Exec const& exec, std::vector<T> const& x, std::int64_t batch, std::int64_t rows,
                        std::int64_t cols, std::int64_t pad = 0) {
  CAPTURE(mpx::dtype_name<Format>, mpx::dtype_name<T>, batch, rows, cols, pad);
  std::int64_t const nb = batch == 0 ? 1 : batch, pitch = rows + pad;
  mpx::shape const x_shape = batch == 0 ? mpx::shape{rows, cols} : mpx::shape{batch, rows, cols};
  mpx::shape const out_shape = batch == 0 ? mpx::shape{cols, pitch} : mpx::shape{batch, cols, pitch};
  auto const xd = mpx_test::upload(exec, x, x_shape);
  mpx::fp8_tensor_scale<Format, Exec> state(exec, mpx::delayed_scaling{}, 3.0f);
  auto out = mpx_test::poisoned<Format>(exec, out_shape);
  if (pad == 0) mpx::cast_to_fp8_transposed(exec, xd, state, out);
  else mpx::cast_to_fp8_transposed_padded(exec, xd, state, out);
  auto const [flat, reference_amax] = host_cast<Format>(mpx_test::download(exec, xd), 3.0f);
  auto const expected = padded(transposed(flat, nb, rows, cols), rows, pitch);
  auto const got = mpx_test::download(exec, out);
  CHECK(mpx_test::first_mismatch(got, expected) == "");
  check_nan_only_where_expected(got, expected);
  std::uint32_t const got_amax = state.values(exec).step_amax_bits;
  CHECK(got_amax == reference_amax);
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

// The padded casts give fp8_gemm a K that is a multiple of 16 (a ragged batch is the K of
// a weight gradient): zeros past K, the amax of x alone.
TEMPLATE_LIST_TEST_CASE("the padded fp8 casts write zeros past K and are otherwise the plain casts",
                        "[scaling][fp8]", mpx_test::executors) {
  using namespace fp8_transpose_cases;
  TestType exec;
  std::uint64_t stream = 0;
  for (auto [batch, rows, cols] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{0, 13, 48},
                                   {0, 1, 1},
                                   {0, 70, 33},
                                   {2, 33, 20}}) {
    auto const x = mpx_test::random_values<mpx::bfloat16>(static_cast<std::size_t>((batch ? batch : 1) * rows * cols),
                                                          -200, 200, 950 + stream++);
    std::int64_t const pad = mpx::fp8_gemm_padded_extent(rows) - rows + (rows == 1 ? 16 : 0);
    check_against_cast<mpx::float8_e4m3>(exec, x, batch, rows, cols, pad);
    check_against_cast<mpx::float8_e5m2>(exec, x, batch, rows, cols, pad);

    // cast_to_fp8_padded: x [..., cols] -> [..., Kp], K = cols.
    std::int64_t const kp = mpx::fp8_gemm_padded_extent(cols) + (cols % 16 == 0 ? 16 : 0);
    mpx::shape const x_shape = batch == 0 ? mpx::shape{rows, cols} : mpx::shape{batch, rows, cols};
    mpx::shape const out_shape = batch == 0 ? mpx::shape{rows, kp} : mpx::shape{batch, rows, kp};
    auto const xd = mpx_test::upload(exec, x, x_shape);
    mpx::fp8_tensor_scale<mpx::float8_e4m3, TestType> state(exec, mpx::delayed_scaling{}, 3.0f);
    auto out = mpx_test::poisoned<mpx::float8_e4m3>(exec, out_shape);
    mpx::cast_to_fp8_padded(exec, xd, state, out);
    auto const [flat, amax] = host_cast<mpx::float8_e4m3>(mpx_test::download(exec, xd), 3.0f);
    auto const expected = padded(flat, cols, kp);
    auto const got = mpx_test::download(exec, out);
    CHECK(mpx_test::first_mismatch(got, expected) == "");
    check_nan_only_where_expected(got, expected);
    CHECK(state.values(exec).step_amax_bits == amax);
  }
  using Catch::Matchers::Contains;
  mpx::fp8_tensor_scale<mpx::float8_e4m3, TestType> state(exec);
  auto const x = mpx::make_tensor<float>(exec, {3, 20});
  auto narrow = mpx::make_tensor<mpx::float8_e4m3>(exec, {3, 16});
  CHECK_THROWS_TYPE_WITH(mpx::cast_to_fp8_padded(exec, x, state, narrow), mpx::shape_error,
                         Contains("x has shape [3, 20], out has shape [3, 16]"));
  auto short_t = mpx::make_tensor<mpx::float8_e4m3>(exec, {20, 2});
  CHECK_THROWS_TYPE_WITH(mpx::cast_to_fp8_transposed_padded(exec, x, state, short_t), mpx::shape_error,
                         Contains("x has shape [3, 20], out has shape [20, 2]"));
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
