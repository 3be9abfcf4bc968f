// NVFP4 (quantize_nvfp4, and fp8_block_gemm on its operands) on each executor: every
// code, block scale and the tensor scale against a reference that computes them from
// the definition (tests/support/reference/nvfp4.hpp) on awkward shapes, both
// orientations, 1x16 and 16x16 blocks, float and bfloat16 inputs; the Hadamard transform
// against its matrix; stochastic rounding's neighbours and mean; zero, subnormal, NaN
// and inf blocks; the product against a float64 product of the dequantised values within
// the float-sum bound and against the original data; the refusals.
#include "../support/reference/nvfp4.hpp"
#include "../support/testing.hpp"

#include <mpx/kernels/fp8_block_gemm.hpp>
#include <mpx/kernels/fp8_block_quantize.hpp>
#include <mpx/kernels/nvfp4_quantize.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace nvfp4_cases {

using mpx_test::reference::expected_nvfp4;
using mpx_test::reference::reference_nvfp4;
using mpx_test::reference::unpacked_codes;

//! Values over many binades, some 16-blocks scaled by 2^±12 as a whole, a few outliers.
std::vector<float> nvfp4_data(std::size_t n, std::uint64_t stream) {
  auto v = mpx_test::random_values<float>(n, -1, 1, stream);
  for (std::size_t i = 0; i < n; ++i) {
    std::size_t const b = i / 23;
    if (b % 5 == 1) v[i] *= 0x1p-12f;
    if (b % 7 == 3) v[i] *= 0x1p12f;
    if (i % 211 == 17) v[i] = 3.0e4f;
  }
  return v;
}

//! What quantize_nvfp4 wrote, downloaded.
struct quantized_nvfp4 {
  std::vector<std::uint8_t> codes, scales;
  float amax, decode;
  unsigned nonfinite;
};

template <class In, class Exec>
quantized_nvfp4 run_quantize(Exec const& exec, std::vector<float> const& data, std::int64_t rows, std::int64_t cols,
                             bool k_contiguous, mpx::nvfp4_quantize_options const& options) {
  std::vector<In> x(data.size());
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = mpx::cast<In>(data[i]);
  mpx::fp8_block_scale_layout const layout{mpx::fp8_block_kind::vec16, k_contiguous ? rows : cols,
                                           k_contiguous ? cols : rows};
  auto const xd = mpx_test::upload(exec, x, mpx::shape{rows, cols});
  auto values = mpx_test::poisoned<mpx::float4_e2m1x2>(exec, mpx::shape{layout.outer, layout.padded_k() / 2});
  auto scales = mpx_test::poisoned<mpx::float8_e4m3>(exec, mpx::shape{layout.count()});
  auto tensor_scale = mpx_test::poisoned<float>(exec, mpx::shape{2});
  auto count = mpx_test::upload(exec, std::vector<unsigned>{0u});
  mpx::quantize_nvfp4(exec, xd, k_contiguous, options, values, scales, tensor_scale, count.data());
  quantized_nvfp4 q;
  q.codes = unpacked_codes(mpx_test::download(exec, values));
  for (auto s : mpx_test::download(exec, scales)) q.scales.push_back(mpx::bits(s));
  auto const t = mpx_test::download(exec, tensor_scale);
  q.amax = t[0];
  q.decode = t[1];
  q.nonfinite = mpx_test::download(exec, count)[0];
  return q;
}

template <class In, class Exec>
void quantize_and_compare(Exec const& exec, std::int64_t rows, std::int64_t cols, bool k_contiguous, bool square,
                          bool hadamard, std::vector<float> const& data) {
  CAPTURE(rows, cols, k_contiguous, square, hadamard, mpx::dtype_name<In>);
  std::vector<float> as_float(data.size());
  for (std::size_t i = 0; i < data.size(); ++i) as_float[i] = mpx::cast<float>(mpx::cast<In>(data[i]));
  mpx::nvfp4_quantize_options const options{.square_blocks = square, .hadamard = hadamard};
  auto const want = reference_nvfp4(as_float, rows, cols, k_contiguous, square, hadamard,
                                    mpx::detail::nvfp4_hadamard_signs(options.hadamard_seed));
  auto const got = run_quantize<In>(exec, data, rows, cols, k_contiguous, options);
  INFO("codes: " << mpx_test::first_mismatch(got.codes, want.codes));
  CHECK(mpx_test::first_mismatch(got.codes, want.codes).empty());
  INFO("scales: " << mpx_test::first_mismatch(got.scales, want.scales));
  CHECK(mpx_test::first_mismatch(got.scales, want.scales).empty());
  CHECK(mpx_test::same_value(got.amax, want.amax));
  CHECK(mpx_test::same_value(got.decode, want.decode));
  CHECK(got.nonfinite == want.nonfinite);
  CHECK((std::isfinite(got.decode) && got.decode > 0.0f));
}

//! Multiples of 2^-6 within ±8: the transform's sums and differences of 16 of them are
//! exact in float, so the double reference and the float butterflies agree bit for bit.
std::vector<float> exact_sum_data(std::size_t n, std::uint64_t stream) {
  auto v = mpx_test::random_values<float>(n, -8, 8, stream);
  for (float& x : v) x = std::round(x * 64.0f) / 64.0f;
  return v;
}

}  // namespace nvfp4_cases

TEMPLATE_LIST_TEST_CASE("quantize_nvfp4 writes each value's e2m1 code, each block's e4m3 scale and the tensor scale, "
                        "as defined",
                        "[nvfp4]", mpx_test::executors) {
  using namespace nvfp4_cases;
  TestType exec;
  for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {5, 17}, {3, 33}, {130, 70}, {17, 16},
                            {0, 7}, {7, 0}, {33, 31}, {129, 65}})
    for (bool k_contiguous : {true, false})
      for (bool square : {false, true}) {
        auto const data = nvfp4_data(static_cast<std::size_t>(rows * cols), static_cast<std::uint64_t>(rows + cols));
        quantize_and_compare<float>(exec, rows, cols, k_contiguous, square, false, data);
        if (rows == 130) quantize_and_compare<mpx::bfloat16>(exec, rows, cols, k_contiguous, square, false, data);
      }
}

TEMPLATE_LIST_TEST_CASE("quantize_nvfp4's Hadamard transform is H diag(signs) / 4 on each 16 along K, and leaves a "
                        "product unchanged",
                        "[nvfp4]", mpx_test::executors) {
  using namespace nvfp4_cases;
  TestType exec;
  for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{5, 40}, {33, 31}, {64, 48}})
    for (bool k_contiguous : {true, false}) {
      auto const data = exact_sum_data(static_cast<std::size_t>(rows * cols), static_cast<std::uint64_t>(rows * 3));
      quantize_and_compare<float>(exec, rows, cols, k_contiguous, false, true, data);
    }
  // The transform is orthogonal: two operands transformed alike keep their products.
  std::int64_t const n = 16;
  std::vector<float> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
  auto const ra = exact_sum_data(16, 1), rb = exact_sum_data(16, 2);
  double exact = 0.0;
  for (std::size_t i = 0; i < 16; ++i) {
    a[i] = ra[i];
    b[i] = rb[i];
    exact += static_cast<double>(a[i]) * b[i];
  }
  auto const sa = reference_nvfp4(a, 1, n, true, false, true, mpx::detail::nvfp4_hadamard_signs(5));
  auto const sb = reference_nvfp4(b, 1, n, true, false, true, mpx::detail::nvfp4_hadamard_signs(5));
  double turned = 0.0;
  for (std::size_t i = 0; i < 16; ++i) turned += static_cast<double>(sa.operand[i]) * sb.operand[i];
  CHECK(turned == exact);
  // The kernel's butterflies are the matrix H diag(signs) / 4 on inputs where both are
  // exact, for many sign patterns (each of the 16 unit vectors and random data).
  for (std::uint64_t seed : {5ull, 6ull, 7ull, 0x4E56'4650'3452'4854ull}) {
    std::uint32_t const signs = mpx::detail::nvfp4_hadamard_signs(seed);
    for (std::size_t unit = 0; unit <= 16; ++unit) {
      std::vector<float> in = unit < 16 ? std::vector<float>(16, 0.0f) : exact_sum_data(16, seed);
      if (unit < 16) in[unit] = 1.0f;
      float v[16];
      for (std::size_t i = 0; i < 16; ++i) v[i] = in[i];
      mpx::detail::hadamard16(v, signs);
      auto const want = mpx_test::reference::hadamard_by_matrix(in, signs);
      for (std::size_t i = 0; i < 16; ++i) CHECK(static_cast<double>(v[i]) == want[i]);
    }
  }
}

TEMPLATE_LIST_TEST_CASE("quantize_nvfp4: 16x16 blocks give a weight the same values read either way", "[nvfp4]",
                        mpx_test::executors) {
  using namespace nvfp4_cases;
  TestType exec;
  std::int64_t const rows = 50, cols = 70;  // partial 16x16 tiles on both edges; K padded to 96 and 64
  auto const data = nvfp4_data(static_cast<std::size_t>(rows * cols), 11);
  mpx::nvfp4_quantize_options const options{.square_blocks = true};
  auto const as_is = run_quantize<float>(exec, data, rows, cols, true, options);
  auto const turned = run_quantize<float>(exec, data, rows, cols, false, options);
  mpx::fp8_block_scale_layout const l1{mpx::fp8_block_kind::vec16, rows, cols}, l2{mpx::fp8_block_kind::vec16, cols, rows};
  std::size_t differ = 0;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      auto const i = static_cast<std::size_t>(r * l1.padded_k() + c), j = static_cast<std::size_t>(c * l2.padded_k() + r);
      differ += as_is.codes[i] != turned.codes[j];
      differ += as_is.scales[l1.slot(static_cast<std::size_t>(r), static_cast<std::size_t>(c))] !=
                turned.scales[l2.slot(static_cast<std::size_t>(c), static_cast<std::size_t>(r))];
    }
  CHECK(differ == 0);
  CHECK(as_is.decode == turned.decode);
  // 1x16 blocks do not: the transposed blocks' scales differ somewhere.
  auto const rows_only = run_quantize<float>(exec, data, rows, cols, true, {});
  auto const rows_turned = run_quantize<float>(exec, data, rows, cols, false, {});
  std::size_t differ_1x16 = 0;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      differ_1x16 += rows_only.codes[static_cast<std::size_t>(r * l1.padded_k() + c)] !=
                     rows_turned.codes[static_cast<std::size_t>(c * l2.padded_k() + r)];
  CHECK(differ_1x16 > 0);
}

TEMPLATE_LIST_TEST_CASE("quantize_nvfp4 rounds stochastically to a neighbour, unbiased, drawn from its counter",
                        "[nvfp4]", mpx_test::executors) {
  using namespace nvfp4_cases;
  TestType exec;
  std::int64_t const rows = 8, cols = 48;
  auto const data = nvfp4_data(static_cast<std::size_t>(rows * cols), 21);
  // Under stochastic rounding each block's scale is the e4m3 at or above amax / 6 * S,
  // so no value saturates and the average is the scaled value itself.
  auto const want = reference_nvfp4(data, rows, cols, true, false, false, 0, true);
  mpx::fp8_block_scale_layout const layout{mpx::fp8_block_kind::vec16, rows, cols};
  std::int64_t const kp = layout.padded_k();
  std::vector<double> scaled(want.codes.size()), lower(want.codes.size()), upper(want.codes.size());
  for (std::size_t i = 0; i < scaled.size(); ++i) {
    auto const o = static_cast<std::int64_t>(i) / kp, kk = static_cast<std::int64_t>(i) % kp;
    float const d = mpx::cast<float>(mpx::detail::from_bits<mpx::float8_e4m3>(
        want.scales[layout.slot(static_cast<std::size_t>(o), static_cast<std::size_t>(kk))]));
    scaled[i] = static_cast<double>(want.operand[i] * (mpx::detail::nvfp4_tensor_encode(want.amax) / d));  // as the kernel
    REQUIRE(std::fabs(scaled[i]) <= 6.0);  // rounded up: nothing saturates
    // The two neighbours, by search.
    double const a = std::fabs(scaled[i]);
    double lo = 0, hi = 0;
    for (int c = 0; c < 8; ++c) {
      double const v = mpx::e2m1_to_float(static_cast<std::uint8_t>(c));
      if (v <= a) lo = v;
      if (v >= a && hi == 0 && (v > 0 || a == 0)) hi = v;
    }
    lower[i] = std::copysign(lo, scaled[i]);
    upper[i] = std::copysign(hi, scaled[i]);
  }
  std::vector<double> sum(want.codes.size(), 0.0);
  constexpr int draws = 400;
  std::vector<std::uint8_t> first;
  for (int d = 0; d < draws; ++d) {
    auto const draw = mpx_test::upload(exec, std::vector<std::uint64_t>{static_cast<std::uint64_t>(d) << 33});
    mpx::nvfp4_quantize_options const options{.draw = draw.data(), .seed = 0x1234'5678'9ABCull};
    auto const got = run_quantize<float>(exec, data, rows, cols, true, options);
    REQUIRE(got.scales == want.scales);  // the scales do not depend on the draws
    if (d == 0) first = got.codes;
    if (d == 1) CHECK(got.codes != first);
    for (std::size_t i = 0; i < got.codes.size(); ++i) {
      double const v = mpx::e2m1_to_float(got.codes[i]);
      if (v != lower[i] && v != upper[i]) {
        CAPTURE(i, scaled[i], v, lower[i], upper[i]);
        REQUIRE(false);  // only the two neighbours
      }
      sum[i] += v;
    }
  }
  // The tensor's largest block asks for amax / 6 * S, which float rounding can put a few
  // ulps above 448: rounded up, its scale stays 448 (0x7E), never 0x7F (NaN).
  float above = 0;
  for (float a = 1.0f; above == 0 && a < 2.0f; a = std::nextafter(a, 2.0f))
    if (a / 6.0f * mpx::detail::nvfp4_tensor_encode(a) > 448.0f) above = a;
  REQUIRE(above > 0);
  std::vector<float> peak(32, 0.25f);
  peak[3] = above;
  auto const peak_draw = mpx_test::upload(exec, std::vector<std::uint64_t>{1u});
  auto const q = run_quantize<float>(exec, peak, 1, 32, true, {.draw = peak_draw.data(), .seed = 3});
  mpx::fp8_block_scale_layout const one_row{mpx::fp8_block_kind::vec16, 1, 32};
  CHECK(q.scales[one_row.slot(0, 0)] == 0x7Eu);
  CHECK(q.codes[3] == 7u);  // 6, saturated by a few ulps
  // Same counter, same bits.
  auto const again_draw = mpx_test::upload(exec, std::vector<std::uint64_t>{0u});
  CHECK(run_quantize<float>(exec, data, rows, cols, true, {.draw = again_draw.data(), .seed = 0x1234'5678'9ABCull})
            .codes == first);
  // Unbiased: the mean of the draws is the scaled value, within 4.5 standard errors of
  // a two-point draw (gap g, probability p: sd g sqrt(p (1 - p))), plus 2^-20 of slack.
  std::size_t far = 0;
  for (std::size_t i = 0; i < sum.size(); ++i) {
    double const g = std::fabs(upper[i] - lower[i]);
    double const p = g > 0 ? std::fabs(scaled[i] - lower[i]) / g : 0.0;
    double const allowed = 4.5 * g * std::sqrt(p * (1 - p) / draws) + 0x1p-20;
    if (std::fabs(sum[i] / draws - scaled[i]) > allowed) ++far;
  }
  CHECK(far == 0);
}

TEMPLATE_LIST_TEST_CASE("quantize_nvfp4 lays the block scales in cuBLASLt's 128x4 tiles, as documented",
                        "[nvfp4]", mpx_test::executors) {
  using namespace nvfp4_cases;
  TestType exec;
  // 300 rows (3 tiles down, the last partial), K = 200: 13 blocks of 16 (the last
  // partial), padded to 224 values (14 blocks) and the scales to 16 blocks (4 tiles
  // across). Block (o, kb) holds 2^-j, j = (o % 7 + kb) % 10, and smaller values, the
  // tensor's amax 1: its scale is e4m3(448 * 2^-j), exact.
  std::int64_t const outer = 300, k = 200, blocks = 13;
  auto const j_of = [](std::int64_t o, std::int64_t kb) { return static_cast<int>((o % 7 + kb) % 10); };
  for (bool k_contiguous : {true, false}) {
    CAPTURE(k_contiguous);
    std::vector<float> x(static_cast<std::size_t>(outer * k));
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t kk = 0; kk < k; ++kk)
        x[static_cast<std::size_t>(k_contiguous ? o * k + kk : kk * outer + o)] =
            std::ldexp(kk % 16 == 3 ? 1.0f : 0.75f, -j_of(o, kk / 16));
    x[0] = 1.0f;  // block (0, 0) has j = 0 anyway: the tensor's amax is 1
    auto const q = run_quantize<float>(exec, x, k_contiguous ? outer : k, k_contiguous ? k : outer, k_contiguous, {});
    mpx::fp8_block_scale_layout const layout{mpx::fp8_block_kind::vec16, outer, k};
    REQUIRE(layout.count() == 384 * 16);
    std::size_t mismatches = 0;
    for (std::int64_t r = 0; r < 384; ++r)
      for (std::int64_t c = 0; c < 16; ++c) {
        std::uint8_t const want =
            r < outer && c < blocks ? mpx::bits(mpx::cast<mpx::float8_e4m3>(std::ldexp(448.0f, -j_of(r, c)))) : 0x01;
        std::int64_t const tile = (r / 128) * 4 + c / 4, rr = r % 128;
        std::int64_t const at = tile * 512 + (rr % 32) * 16 + (rr / 32) * 4 + c % 4;
        if (q.scales[static_cast<std::size_t>(at)] != want && mismatches++ == 0)
          FAIL_CHECK("row " << r << " block " << c << ": byte " << int(q.scales[static_cast<std::size_t>(at)])
                            << ", expected " << int(want));
      }
    CHECK(mismatches == 0);
  }
}

TEMPLATE_LIST_TEST_CASE("quantize_nvfp4: zero and subnormal blocks get finite scales, NaN and inf blocks a NaN scale, "
                        "counted",
                        "[nvfp4]", mpx_test::executors) {
  using namespace nvfp4_cases;
  TestType exec;
  std::int64_t const rows = 3, cols = 70;
  auto data = nvfp4_data(static_cast<std::size_t>(rows * cols), 5);
  for (std::size_t k = 0; k < 16; ++k) data[k] = 0.0f;  // block (0, 0): zeros
  for (std::size_t k = 16; k < 32; ++k) data[k] = (k % 2 ? 1.0f : -3.0f) * std::numeric_limits<float>::denorm_min();
  data[static_cast<std::size_t>(cols + 5)] = std::numeric_limits<float>::quiet_NaN();
  data[static_cast<std::size_t>(cols + 40)] = std::numeric_limits<float>::infinity();
  data[static_cast<std::size_t>(2 * cols + 69)] = -std::numeric_limits<float>::infinity();
  for (bool square : {false, true}) quantize_and_compare<float>(exec, rows, cols, true, square, false, data);
  auto const got = run_quantize<float>(exec, data, rows, cols, true, {});
  CHECK(got.nonfinite == 3u);
  mpx::fp8_block_scale_layout const layout{mpx::fp8_block_kind::vec16, rows, cols};
  CHECK(got.scales[layout.slot(1, 0)] == 0x7Fu);
  CHECK(got.scales[layout.slot(1, 32)] == 0x7Fu);
  CHECK(got.scales[layout.slot(2, 64)] == 0x7Fu);
  CHECK(got.scales[layout.slot(0, 0)] == 0x01u);  // the floor, 2^-9
  CHECK(got.scales[layout.slot(0, 16)] == 0x01u);
  // An all-zero tensor, and one of float subnormals: finite, positive scales.
  for (float v : {0.0f, std::numeric_limits<float>::denorm_min()}) {
    std::vector<float> flat(static_cast<std::size_t>(rows * cols), v);
    quantize_and_compare<float>(exec, rows, cols, false, false, false, flat);
    auto const q = run_quantize<float>(exec, flat, rows, cols, true, {});
    CHECK((std::isfinite(q.decode) && q.decode > 0.0f));
    for (auto s : q.scales) CHECK((s != 0u && s != 0x7Fu));
  }
}

TEMPLATE_LIST_TEST_CASE("fp8_block_gemm on NVFP4 operands is the float product of the dequantised values", "[nvfp4]",
                        mpx_test::executors) {
  using namespace nvfp4_cases;
  TestType exec;
  if (!mpx_test::block_fp8_products_here(exec, true)) {
    WARN("skipped: cuBLASLt's NVFP4 products need Blackwell (sm_100) or newer");
    return;
  }
  for (auto [m, n, k] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{5, 16, 17}, {33, 48, 100}, {130, 32, 257}})
    for (bool hadamard : {false, true}) {
      CAPTURE(m, n, k, hadamard);
      auto const ad = nvfp4_data(static_cast<std::size_t>(m * k), 31);
      auto const bd = mpx_test::random_values<float>(static_cast<std::size_t>(n * k), -2, 2, 32);
      mpx::nvfp4_quantize_options const options{.hadamard = hadamard};
      mpx::fp8_block_scale_layout const la{mpx::fp8_block_kind::vec16, m, k}, lb{mpx::fp8_block_kind::vec16, n, k};
      auto const a_x = mpx_test::upload(exec, ad, mpx::shape{m, k});
      auto const b_x = mpx_test::upload(exec, bd, mpx::shape{k, n});  // B read transposed: a weight [in, out]
      auto av = mpx_test::poisoned<mpx::float4_e2m1x2>(exec, mpx::shape{m, la.padded_k() / 2});
      auto as = mpx_test::poisoned<mpx::float8_e4m3>(exec, mpx::shape{la.count()});
      auto at = mpx_test::poisoned<float>(exec, mpx::shape{2});
      auto bv = mpx_test::poisoned<mpx::float4_e2m1x2>(exec, mpx::shape{n, lb.padded_k() / 2});
      auto bs = mpx_test::poisoned<mpx::float8_e4m3>(exec, mpx::shape{lb.count()});
      auto bt = mpx_test::poisoned<float>(exec, mpx::shape{2});
      mpx::quantize_nvfp4(exec, a_x, true, options, av, as, at);
      mpx::quantize_nvfp4(exec, b_x, false, options, bv, bs, bt);
      auto const c0 = mpx_test::random_values<float>(static_cast<std::size_t>(m * n), -1, 1, 33);
      auto c = mpx_test::upload(exec, c0, mpx::shape{m, n});
      float const alpha = 0.75f, beta = hadamard ? 0.5f : 0.0f;  // beta: the GPU reads it from device memory
      mpx::fp8_block_gemm(exec, mpx::nvfp4_operand<mpx::memory_space_t<TestType>>{av, as, la, at},
                          mpx::nvfp4_operand<mpx::memory_space_t<TestType>>{bv, bs, lb, bt}, c, alpha, beta);
      auto got = mpx_test::download(exec, c);
      for (std::size_t i = 0; i < got.size(); ++i) got[i] -= beta * c0[i];  // exact: c0 * 0.5
      auto const qa = reference_nvfp4(ad, m, k, true, false, hadamard, mpx::detail::nvfp4_hadamard_signs(options.hadamard_seed));
      auto const qb = reference_nvfp4(bd, k, n, false, false, hadamard, mpx::detail::nvfp4_hadamard_signs(options.hadamard_seed));
      auto const da = mpx_test::reference::dequantised_nvfp4(qa.codes, qa.scales, 1.0f, la);
      auto const db = mpx_test::reference::dequantised_nvfp4(qb.codes, qb.scales, 1.0f, lb);
      std::int64_t const kp = la.padded_k();
      double const dec = static_cast<double>(qa.decode) * qb.decode * alpha;
      double worst = 0.0, err_sq = 0.0, ref_sq = 0.0;
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          double sum = 0.0, magnitude = 0.0, original = 0.0;
          for (std::int64_t kk = 0; kk < kp; ++kk) {
            double const p = da[static_cast<std::size_t>(i * kp + kk)] * db[static_cast<std::size_t>(j * kp + kk)];
            sum += p;
            magnitude += std::fabs(p);
            if (kk < k)
              original += static_cast<double>(ad[static_cast<std::size_t>(i * k + kk)]) *
                          bd[static_cast<std::size_t>(kk * n + j)];
          }
          double const g = got[static_cast<std::size_t>(i * n + j)];
          REQUIRE(std::isfinite(g));
          // Each dequantised value carries one rounding (the block scale times the decode
          // factor on the host; alpha's on the GPU): 2^-23 of each term.
          double const bound = (mpx_test::fp8_sum_bound<TestType>(kp) + 0x1p-23) * magnitude * dec;
          worst = std::max(worst, std::fabs(g - sum * dec) / (bound > 0 ? bound : 1.0));
          err_sq += (g - alpha * original) * (g - alpha * original);
          ref_sq += alpha * original * alpha * original;
        }
      CHECK(worst <= 1.0);
      // And what 4 bits buy: the product of the original data within about 15%.
      CHECK(std::sqrt(err_sq / ref_sq) < 0.15);
    }
  // A NaN in A's row 1 marks its block with the NaN scale (e2m1 has no NaN): row 1 of C
  // is NaN and nothing else is, on the GPU as on the host.
  std::int64_t const m = 4, n = 16, k = 40;
  auto ad = nvfp4_data(static_cast<std::size_t>(m * k), 41);
  ad[static_cast<std::size_t>(k + 20)] = std::numeric_limits<float>::quiet_NaN();
  auto const bd = mpx_test::random_values<float>(static_cast<std::size_t>(n * k), -2, 2, 42);
  mpx::fp8_block_scale_layout const la{mpx::fp8_block_kind::vec16, m, k}, lb{mpx::fp8_block_kind::vec16, n, k};
  auto const a_x = mpx_test::upload(exec, ad, mpx::shape{m, k});
  auto const b_x = mpx_test::upload(exec, bd, mpx::shape{n, k});
  auto av = mpx::make_tensor<mpx::float4_e2m1x2>(exec, mpx::shape{m, la.padded_k() / 2});
  auto as = mpx::make_tensor<mpx::float8_e4m3>(exec, mpx::shape{la.count()});
  auto at = mpx::make_tensor<float>(exec, mpx::shape{2});
  auto bv = mpx::make_tensor<mpx::float4_e2m1x2>(exec, mpx::shape{n, lb.padded_k() / 2});
  auto bs = mpx::make_tensor<mpx::float8_e4m3>(exec, mpx::shape{lb.count()});
  auto bt = mpx::make_tensor<float>(exec, mpx::shape{2});
  auto count = mpx_test::upload(exec, std::vector<unsigned>{0u});
  mpx::quantize_nvfp4(exec, a_x, true, {}, av, as, at, count.data());
  mpx::quantize_nvfp4(exec, b_x, true, {}, bv, bs, bt);
  auto c = mpx_test::poisoned<mpx::bfloat16>(exec, mpx::shape{m, n});
  mpx::fp8_block_gemm(exec, mpx::nvfp4_operand<mpx::memory_space_t<TestType>>{av, as, la, at},
                      mpx::nvfp4_operand<mpx::memory_space_t<TestType>>{bv, bs, lb, bt}, c);
  auto const got = mpx_test::download(exec, c);
  CHECK(mpx_test::download(exec, count)[0] == 1u);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      CAPTURE(i, j);
      CHECK(mpx::is_nan(got[static_cast<std::size_t>(i * n + j)]) == (i == 1));
    }
}

TEMPLATE_LIST_TEST_CASE("NVFP4 refusals: shapes, layouts and the fp8 quantizer name what is wrong", "[nvfp4]",
                        mpx_test::executors) {
  TestType exec;
  auto const x = mpx_test::upload(exec, std::vector<float>(5 * 40, 1.0f), mpx::shape{5, 40});
  mpx::fp8_block_scale_layout const l{mpx::fp8_block_kind::vec16, 5, 40};
  auto values = mpx::make_tensor<mpx::float4_e2m1x2>(exec, mpx::shape{5, l.padded_k() / 2});
  auto scales = mpx::make_tensor<mpx::float8_e4m3>(exec, mpx::shape{l.count()});
  auto ts = mpx::make_tensor<float>(exec, mpx::shape{2});
  auto wrong_values = mpx::make_tensor<mpx::float4_e2m1x2>(exec, mpx::shape{5, 40});
  CHECK_THROWS_WITH(mpx::quantize_nvfp4(exec, x, true, {}, wrong_values, scales, ts),
                    Catch::Contains("values has shape [5, 40]") && Catch::Contains("[5, 32] pairs of e2m1"));
  auto wrong_ts = mpx::make_tensor<float>(exec, mpx::shape{1});
  CHECK_THROWS_WITH(mpx::quantize_nvfp4(exec, x, true, {}, values, scales, wrong_ts),
                    Catch::Contains("tensor_scale has shape [1]"));
  auto fp8_values = mpx::make_tensor<mpx::float8_e4m3>(exec, mpx::shape{5, 64});
  auto float_scales = mpx::make_tensor<float>(exec, mpx::shape{l.count()});
  CHECK_THROWS_WITH(mpx::quantize_fp8_blocks<mpx::float8_e4m3>(exec, x, true, mpx::fp8_block_kind::vec16, false,
                                                               fp8_values, float_scales),
                    Catch::Contains("mpx::quantize_nvfp4"));
  mpx::quantize_nvfp4(exec, x, true, {}, values, scales, ts);
  using space = mpx::memory_space_t<TestType>;
  mpx::nvfp4_operand<space> const a{values, scales, l, ts};
  auto c = mpx::make_tensor<float>(exec, mpx::shape{5, 16});
  mpx::fp8_block_scale_layout const lb{mpx::fp8_block_kind::vec16, 16, 40};
  auto bv = mpx::make_tensor<mpx::float4_e2m1x2>(exec, mpx::shape{16, lb.padded_k() / 2});
  auto bs = mpx::make_tensor<mpx::float8_e4m3>(exec, mpx::shape{lb.count()});
  mpx::nvfp4_operand<space> const no_tensor_scale{bv, bs, lb};
  CHECK_THROWS_WITH(mpx::fp8_block_gemm(exec, a, no_tensor_scale, c),
                    Catch::Contains("B's tensor scale has shape") && Catch::Contains("carries [2]"));
  mpx::fp8_block_scale_layout const mx{mpx::fp8_block_kind::vec32, 16, 40};
  mpx::nvfp4_operand<space> const wrong_kind{bv, bs, mx, ts};
  CHECK_THROWS_WITH(mpx::fp8_block_gemm(exec, a, wrong_kind, c), Catch::Contains("B's layout says 1x32 (MXFP8)"));
}
