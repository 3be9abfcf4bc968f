// Block-scaled fp8 (quantize_fp8_blocks, fp8_block_gemm) on each executor: every
// quantized value and scale against a reference that computes each block's amax, scale
// and rounding straight from the definition, on awkward shapes (K and outer not
// multiples of 128), both orientations, the three block kinds, float and bfloat16
// inputs, power-of-two scales or not; zero, subnormal, NaN and inf blocks; where the
// scales lie (cuBLASLt's layouts); the product against a float64 product of the
// dequantised values within the float-sum bound, and against the original data within
// the fp8 rounding; the refusals.
#include "../support/reference/fp8_blocks.hpp"
#include "../support/testing.hpp"

#include <mpx/kernels/fp8_block_gemm.hpp>
#include <mpx/kernels/fp8_block_quantize.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace fp8_block_cases {

using e4m3 = mpx::float8_e4m3;
using e8m0 = mpx::float8_e8m0;
using mpx_test::reference::expected_blocks;
using mpx_test::reference::reference_quantize;

//! Values spread over many binades (so blocks differ in scale), some blocks scaled up
//! or down by 2^±20 as a whole, a few huge outliers.
std::vector<float> block_data(std::size_t n, std::uint64_t stream) {
  auto v = mpx_test::random_values<float>(n, -1, 1, stream);
  for (std::size_t i = 0; i < n; ++i) {
    std::size_t const b = i / 97;
    if (b % 5 == 1) v[i] *= 0x1p-20f;
    if (b % 7 == 3) v[i] *= 0x1p20f;
    if (i % 211 == 17) v[i] = 3.0e4f;
  }
  return v;
}

template <class In, class Exec>
void quantize_and_compare(Exec const& exec, std::int64_t rows, std::int64_t cols, bool k_contiguous,
                          mpx::fp8_block_kind kind, bool pow2, std::vector<float> data) {
  CAPTURE(rows, cols, k_contiguous, mpx::detail::block_kind_name(kind), pow2, mpx::dtype_name<In>);
  std::vector<In> x(data.size());
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = mpx::cast<In>(data[i]);
  std::vector<float> as_float(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) as_float[i] = mpx::cast<float>(x[i]);
  auto const want = reference_quantize(as_float, rows, cols, k_contiguous, kind, pow2);
  mpx::fp8_block_scale_layout const layout{kind, k_contiguous ? rows : cols, k_contiguous ? cols : rows};
  auto const xd = mpx_test::upload(exec, x, mpx::shape{rows, cols});
  auto values = mpx_test::poisoned<e4m3>(exec, mpx::shape{layout.outer, layout.padded_k()});
  auto count = mpx_test::upload(exec, std::vector<unsigned>{0u});
  std::vector<float> got_scales;
  if (layout.e8m0_scales()) {
    auto scales = mpx_test::poisoned<e8m0>(exec, mpx::shape{layout.count()});
    mpx::quantize_fp8_blocks<e4m3>(exec, xd, k_contiguous, kind, pow2, values, scales, count.data());
    std::vector<std::uint8_t> bytes;
    for (e8m0 s : mpx_test::download(exec, scales)) {
      bytes.push_back(mpx::e8m0_bits(s));
      got_scales.push_back(mpx::e8m0_to_float(s));
    }
    INFO("E8M0 scales: " << mpx_test::first_mismatch(bytes, want.e8m0));
    CHECK(mpx_test::first_mismatch(bytes, want.e8m0).empty());
  } else {
    auto scales = mpx_test::poisoned<float>(exec, mpx::shape{layout.count()});
    mpx::quantize_fp8_blocks<e4m3>(exec, xd, k_contiguous, kind, pow2, values, scales, count.data());
    got_scales = mpx_test::download(exec, scales);
  }
  INFO("values: " << mpx_test::first_mismatch(mpx_test::download(exec, values), want.values));
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, values), want.values).empty());
  INFO("scales: " << mpx_test::first_mismatch(got_scales, want.inverse_scales));
  CHECK(mpx_test::first_mismatch(got_scales, want.inverse_scales).empty());
  CHECK(mpx_test::download(exec, count)[0] == want.nonfinite);
  for (float s : got_scales) REQUIRE((std::isfinite(s) && s > 0.0f));
}

//! Quantizes x [rows, cols] into fresh tensors (values, then scales of the kind's
//! format), for the product tests.
template <class Exec>
auto quantized(Exec const& exec, std::vector<float> const& x, std::int64_t rows, std::int64_t cols,
               bool k_contiguous, mpx::fp8_block_kind kind, bool pow2) {
  mpx::fp8_block_scale_layout const layout{kind, k_contiguous ? rows : cols, k_contiguous ? cols : rows};
  auto const xd = mpx_test::upload(exec, x, mpx::shape{rows, cols});
  auto values = mpx_test::poisoned<e4m3>(exec, mpx::shape{layout.outer, layout.padded_k()});
  auto scales = mpx_test::poisoned<float>(exec, mpx::shape{layout.e8m0_scales() ? 0 : layout.count()});
  auto bytes = mpx_test::poisoned<e8m0>(exec, mpx::shape{layout.e8m0_scales() ? layout.count() : 0});
  if (layout.e8m0_scales()) mpx::quantize_fp8_blocks<e4m3>(exec, xd, k_contiguous, kind, pow2, values, bytes);
  else mpx::quantize_fp8_blocks<e4m3>(exec, xd, k_contiguous, kind, pow2, values, scales);
  return std::tuple{std::move(values), std::move(scales), std::move(bytes), layout};
}

//! Each slot's dequantisation factor as a float, whichever format the slots hold.
template <class Exec, class F, class B>
std::vector<float> factors(Exec const& exec, F const& floats, B const& bytes) {
  if (floats.size() != 0) return mpx_test::download(exec, floats);
  std::vector<float> out;
  for (e8m0 s : mpx_test::download(exec, bytes)) out.push_back(mpx::e8m0_to_float(s));
  return out;
}

//! The dequantised operand [outer, padded k] in float64.
std::vector<double> dequantised(std::vector<e4m3> const& v, std::vector<float> const& s,
                                mpx::fp8_block_scale_layout const& layout) {
  std::int64_t const kp = layout.padded_k();
  std::vector<double> out(v.size());
  for (std::int64_t o = 0; o < layout.outer; ++o)
    for (std::int64_t kk = 0; kk < kp; ++kk) {
      auto const i = static_cast<std::size_t>(o * kp + kk);
      out[i] = mpx::detail::to_double(v[i]) *
               static_cast<double>(s[layout.slot(static_cast<std::size_t>(o), static_cast<std::size_t>(kk))]);
    }
  return out;
}

}  // namespace fp8_block_cases

TEMPLATE_LIST_TEST_CASE("quantize_fp8_blocks writes each block's scaled values and inverse scale, as defined",
                        "[fp8][fp8_block]", mpx_test::executors) {
  using namespace fp8_block_cases;
  TestType exec;
  for (auto kind : {mpx::fp8_block_kind::row, mpx::fp8_block_kind::vec128, mpx::fp8_block_kind::tile128,
                    mpx::fp8_block_kind::vec32})
    for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {5, 127}, {3, 129}, {130, 300},
                              {257, 16}, {0, 7}, {7, 0}, {33, 31}, {129, 65}})
      for (bool k_contiguous : {true, false})
        for (bool pow2 : {true, false}) {
          auto const data = block_data(static_cast<std::size_t>(rows * cols), static_cast<std::uint64_t>(rows + cols));
          quantize_and_compare<float>(exec, rows, cols, k_contiguous, kind, pow2, data);
          if (rows == 130) quantize_and_compare<mpx::bfloat16>(exec, rows, cols, k_contiguous, kind, pow2, data);
        }
}

TEMPLATE_LIST_TEST_CASE("quantize_fp8_blocks: zero and subnormal blocks get finite scales, NaN and inf stay "
                        "non-finite and are counted",
                        "[fp8][fp8_block]", mpx_test::executors) {
  using namespace fp8_block_cases;
  TestType exec;
  std::int64_t const rows = 3, cols = 300;
  auto data = block_data(static_cast<std::size_t>(rows * cols), 99);
  for (std::int64_t k = 0; k < 128; ++k) data[static_cast<std::size_t>(k)] = 0.0f;  // block (0, 0): zeros
  for (std::int64_t k = 128; k < 256; ++k)  // block (0, 1): float subnormals
    data[static_cast<std::size_t>(k)] = (k % 2 ? 1.0f : -3.0f) * std::numeric_limits<float>::denorm_min();
  data[static_cast<std::size_t>(cols + 5)] = std::numeric_limits<float>::quiet_NaN();  // block (1, 0)
  data[static_cast<std::size_t>(cols + 200)] = std::numeric_limits<float>::infinity();  // block (1, 1)
  data[static_cast<std::size_t>(2 * cols + 290)] = -std::numeric_limits<float>::infinity();  // block (2, 2)
  for (auto kind : {mpx::fp8_block_kind::row, mpx::fp8_block_kind::vec128, mpx::fp8_block_kind::tile128,
                    mpx::fp8_block_kind::vec32})
    for (bool pow2 : {true, false}) quantize_and_compare<float>(exec, rows, cols, true, kind, pow2, data);

  // And what that means: the NaN and the infinities are NaN in the values, the rest of
  // their blocks is scaled from its finite values (448 at the largest), the zero block
  // is zeros.
  mpx::fp8_block_scale_layout const layout{mpx::fp8_block_kind::vec128, rows, cols};
  auto const xd = mpx_test::upload(exec, data, mpx::shape{rows, cols});
  auto values = mpx_test::poisoned<e4m3>(exec, mpx::shape{rows, layout.padded_k()});
  auto scales = mpx_test::poisoned<float>(exec, mpx::shape{layout.count()});
  auto count = mpx_test::upload(exec, std::vector<unsigned>{0u});
  mpx::quantize_fp8_blocks<e4m3>(exec, xd, true, layout.kind, false, values, scales, count.data());
  auto const v = mpx_test::download(exec, values);
  auto const kp = static_cast<std::size_t>(layout.padded_k());
  for (std::size_t k = 0; k < 128; ++k) CHECK(mpx::detail::to_double(v[k]) == 0.0);
  CHECK(mpx::is_nan(v[kp + 5]));
  CHECK(mpx::is_nan(v[kp + 200]));
  CHECK(mpx::is_nan(v[2 * kp + 290]));
  CHECK(mpx_test::download(exec, count)[0] == 3u);
  double largest = 0;
  for (std::size_t k = 0; k < 128; ++k)
    if (k != 5) largest = std::max(largest, std::fabs(mpx::detail::to_double(v[kp + k])));
  CHECK(largest == 448.0);
}

TEMPLATE_LIST_TEST_CASE("quantize_fp8_blocks puts each block's scale where cuBLASLt reads it", "[fp8][fp8_block]",
                        mpx_test::executors) {
  using namespace fp8_block_cases;
  TestType exec;
  // An operand [outer, K] whose block (ob, kb) has amax 2^(ob + 2 kb) exactly: the
  // inverse scale of that block is 2^(ob + 2 kb) / 256 (power-of-two scales; 448's
  // power of two is 256), so each slot says which block it holds.
  std::int64_t const outer = 261, k = 300;  // outer not a multiple of 4: the padding shows
  for (auto kind : {mpx::fp8_block_kind::vec128, mpx::fp8_block_kind::tile128}) {
    CAPTURE(mpx::detail::block_kind_name(kind));
    bool const tiles = kind == mpx::fp8_block_kind::tile128;
    std::vector<float> x(static_cast<std::size_t>(outer * k));
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t kk = 0; kk < k; ++kk) {
        std::int64_t const ob = tiles ? o / 128 : o % 16, kb = kk / 128;
        bool const peak = kk % 128 == 0 && (tiles ? o % 128 == 0 : true);
        x[static_cast<std::size_t>(o * k + kk)] = std::ldexp(peak ? 1.0f : 0.25f, static_cast<int>(ob + 2 * kb));
      }
    mpx::fp8_block_scale_layout const layout{kind, outer, k};
    auto const xd = mpx_test::upload(exec, x, mpx::shape{outer, k});
    auto values = mpx_test::poisoned<e4m3>(exec, mpx::shape{outer, layout.padded_k()});
    auto scales = mpx_test::poisoned<float>(exec, mpx::shape{layout.count()});
    mpx::quantize_fp8_blocks<e4m3>(exec, xd, true, kind, true, values, scales);
    auto const s = mpx_test::download(exec, scales);
    std::int64_t const kb_count = 3, outer_pad = (outer + 3) / 4 * 4, kb_pad = 4;
    for (std::int64_t o = 0; o < outer; o += tiles ? 128 : 1)
      for (std::int64_t kb = 0; kb < kb_count; ++kb) {
        std::int64_t const ob = tiles ? o / 128 : o % 16;
        std::size_t const slot =
            static_cast<std::size_t>(tiles ? (o / 128) * kb_pad + kb : kb * outer_pad + o);  // the documented layouts
        INFO("o " << o << " kb " << kb);
        CHECK(s[slot] == std::ldexp(1.0f, static_cast<int>(ob + 2 * kb) - 8));
      }
  }
}

TEMPLATE_LIST_TEST_CASE("quantize_fp8_blocks puts MXFP8's E8M0 scales in cuBLASLt's 128x4 tiles", "[fp8][fp8_block]",
                        mpx_test::executors) {
  using namespace fp8_block_cases;
  TestType exec;
  // Block (o, kb) of [outer, K] has amax 2^p exactly, p = o % 29 + 3 kb - 20, so its
  // E8M0 byte is p - 8 + 127; an all-zero block (the padding) has the floor's, 9.
  std::int64_t const outer = 261, k = 300, blocks = 10;  // 300 pads to 320: 10 blocks of 32
  auto const p_of = [](std::int64_t o, std::int64_t kb) { return static_cast<int>(o % 29 + 3 * kb - 20); };
  for (bool k_contiguous : {true, false}) {
    CAPTURE(k_contiguous);
    std::vector<float> x(static_cast<std::size_t>(outer * k));
    for (std::int64_t o = 0; o < outer; ++o)
      for (std::int64_t kk = 0; kk < k; ++kk) {
        float const v = std::ldexp(kk % 32 == 5 ? 1.0f : 0.75f, p_of(o, kk / 32));
        x[static_cast<std::size_t>(k_contiguous ? o * k + kk : kk * outer + o)] = v;
      }
    auto const xd = mpx_test::upload(exec, x, k_contiguous ? mpx::shape{outer, k} : mpx::shape{k, outer});
    mpx::fp8_block_scale_layout const layout{mpx::fp8_block_kind::vec32, outer, k};
    REQUIRE(layout.count() == 384 * 12);
    auto values = mpx_test::poisoned<e4m3>(exec, mpx::shape{outer, layout.padded_k()});
    auto scales = mpx_test::poisoned<e8m0>(exec, mpx::shape{layout.count()});
    mpx::quantize_fp8_blocks<e4m3>(exec, xd, k_contiguous, layout.kind, true, values, scales);
    auto const got = mpx_test::download(exec, scales);
    // The scales as a padded [384, 12] matrix, then laid out as the documented tiles:
    // [384 / 128, 12 / 4] tiles of 512 bytes, row r and block c of a tile at
    // 16 (r % 32) + 4 (r / 32) + c.
    std::size_t mismatches = 0, checked = 0;
    for (std::int64_t r = 0; r < 384; ++r)
      for (std::int64_t c = 0; c < 12; ++c) {
        int const want = r < outer && c < blocks ? p_of(r, c) - 8 + 127 : 9;
        std::int64_t const tile = (r / 128) * 3 + c / 4, rr = r % 128;
        std::int64_t const at = tile * 512 + (rr % 32) * 16 + (rr / 32) * 4 + c % 4;
        if (mpx::e8m0_bits(got[static_cast<std::size_t>(at)]) != want && mismatches++ == 0)
          FAIL_CHECK("row " << r << " block " << c << ": byte " << int(mpx::e8m0_bits(got[static_cast<std::size_t>(at)]))
                            << ", expected " << want);
        ++checked;
      }
    CHECK(mismatches == 0);
    CHECK(checked == got.size());  // every byte is some block's (no slot left unwritten)
  }
}

TEMPLATE_LIST_TEST_CASE("fp8_block_gemm is the float product of the dequantised operands, and near the original "
                        "data's",
                        "[fp8][fp8_block]", mpx_test::executors) {
  using namespace fp8_block_cases;
  TestType exec;
  struct pair_kind {
    mpx::fp8_block_kind a, b;
  };
  for (auto kinds : {pair_kind{mpx::fp8_block_kind::row, mpx::fp8_block_kind::row},
                     pair_kind{mpx::fp8_block_kind::vec128, mpx::fp8_block_kind::vec128},
                     pair_kind{mpx::fp8_block_kind::vec128, mpx::fp8_block_kind::tile128},
                     pair_kind{mpx::fp8_block_kind::tile128, mpx::fp8_block_kind::vec128},
                     pair_kind{mpx::fp8_block_kind::vec32, mpx::fp8_block_kind::vec32}})
    for (auto [m, n, k] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{1, 16, 1}, {7, 32, 129},
                           {130, 48, 300}, {33, 144, 256}, {129, 16, 40}})
      for (bool pow2 : {true, false})
        for (float beta : {0.0f, 0.5f}) {
          CAPTURE(mpx::detail::block_kind_name(kinds.a), mpx::detail::block_kind_name(kinds.b), m, n, k, pow2, beta);
          bool const mx = kinds.a == mpx::fp8_block_kind::vec32;
          if (!mpx_test::block_fp8_products_here(exec, mx)) {
            WARN(std::string(mx ? "MXFP8 products need Blackwell (sm_100) or newer"
                                : "these block-scaled fp8 products need Hopper (sm_90)") +
                 ": only the quantize passes run here");
            continue;
          }
          auto const a = block_data(static_cast<std::size_t>(m * k), static_cast<std::uint64_t>(m * 7 + k));
          auto const b = block_data(static_cast<std::size_t>(k * n), static_cast<std::uint64_t>(n * 11 + k));
          // A [M, K] as it is; B from a weight-like [K, N], read transposed.
          auto const [aq, as, ab, la] = quantized(exec, a, m, k, true, kinds.a, pow2);
          auto const [bq, bs, bb, lb] = quantized(exec, b, k, n, false, kinds.b, pow2);
          auto const c0 = beta == 0.0f ? std::vector<float>(static_cast<std::size_t>(m * n), mpx_test::poison<float>())
                                       : mpx_test::random_values<float>(static_cast<std::size_t>(m * n), -1, 1, 5);
          auto c = mpx_test::upload(exec, c0, mpx::shape{m, n});
          using space = mpx::memory_space_t<TestType>;
          if (mx)
            mpx::fp8_block_gemm(exec, mpx::fp8_block_operand<e4m3, space, e8m0>{mpx::view(aq), mpx::view(ab), la},
                                mpx::fp8_block_operand<e4m3, space, e8m0>{mpx::view(bq), mpx::view(bb), lb}, c, 1.5f,
                                beta);
          else
            mpx::fp8_block_gemm(exec, mpx::fp8_block_operand<e4m3, space>{mpx::view(aq), mpx::view(as), la},
                                mpx::fp8_block_operand<e4m3, space>{mpx::view(bq), mpx::view(bs), lb}, c, 1.5f, beta);
          auto const got = mpx_test::download(exec, c);
          auto const ax = dequantised(mpx_test::download(exec, aq), factors(exec, as, ab), la);
          auto const bx = dequantised(mpx_test::download(exec, bq), factors(exec, bs, bb), lb);
          std::int64_t const kp = la.padded_k();
          double const bound = mpx_test::fp8_sum_bound<TestType>(kp) + std::ldexp(1.0, -24);
          std::size_t bad = 0, far = 0;
          double err2 = 0, ref2 = 0;
          for (std::int64_t i = 0; i < m; ++i)
            for (std::int64_t j = 0; j < n; ++j) {
              double exact = 0, magnitude = 0, original = 0;
              for (std::int64_t kk = 0; kk < kp; ++kk) {
                double const p = ax[static_cast<std::size_t>(i * kp + kk)] * bx[static_cast<std::size_t>(j * kp + kk)];
                exact += p;
                magnitude += std::fabs(p);
                if (kk < k)
                  original += static_cast<double>(a[static_cast<std::size_t>(i * k + kk)]) *
                              static_cast<double>(b[static_cast<std::size_t>(kk * n + j)]);
              }
              auto const at = static_cast<std::size_t>(i * n + j);
              double const c_in = beta == 0.0f ? 0.0 : static_cast<double>(c0[at]);
              double const want = 1.5 * exact + beta * c_in;
              double const allowed = bound * (1.5 * magnitude + std::fabs(beta * c_in)) + 1e-37;
              if (!(std::fabs(static_cast<double>(got[at]) - want) <= allowed)) ++bad;
              double const o = 1.5 * original + beta * c_in;
              err2 += (static_cast<double>(got[at]) - o) * (static_cast<double>(got[at]) - o);
              ref2 += o * o;
              if (std::isnan(got[at])) ++far;
            }
          CHECK(bad == 0);
          CHECK(far == 0);
          // The quantization itself: e4m3 keeps 3 bits, so a few percent of the product's
          // size, never more (a scale applied the wrong way round is off by 2^10 or more).
          CHECK(std::sqrt(err2) <= 0.08 * std::sqrt(ref2));
        }
}

TEMPLATE_LIST_TEST_CASE("fp8_block_gemm and quantize_fp8_blocks refuse what they cannot do, naming it",
                        "[fp8][fp8_block][errors]", mpx_test::executors) {
  using namespace fp8_block_cases;
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  auto const x = mpx::make_tensor<float>(exec, {32, 200});
  mpx::fp8_block_scale_layout const row{mpx::fp8_block_kind::row, 32, 200}, vec{mpx::fp8_block_kind::vec128, 32, 200},
      tile{mpx::fp8_block_kind::tile128, 32, 200}, vec_other_k{mpx::fp8_block_kind::vec128, 32, 72};
  auto values = mpx::make_tensor<e4m3>(exec, {32, 256});
  auto short_values = mpx::make_tensor<e4m3>(exec, {32, 200});
  auto scales = mpx::make_tensor<float>(exec, {vec.count()});
  CHECK_THROWS_TYPE_WITH(mpx::quantize_fp8_blocks<e4m3>(exec, x, true, vec.kind, true, short_values, scales),
                         mpx::shape_error, Catch::Matchers::Contains("values has shape [32, 200]"));
  auto few_scales = mpx::make_tensor<float>(exec, {3});
  CHECK_THROWS_TYPE_WITH(mpx::quantize_fp8_blocks<e4m3>(exec, x, true, vec.kind, true, values, few_scales),
                         mpx::shape_error, Catch::Matchers::Contains("inverse_scales has shape [3]"));
  auto row_scales = mpx::make_tensor<float>(exec, {row.count()});
  auto row_values = mpx::make_tensor<e4m3>(exec, {32, row.padded_k()});
  auto tile_scales = mpx::make_tensor<float>(exec, {tile.count()});
  auto c = mpx::make_tensor<float>(exec, {32, 32});
  auto const op = [](auto const& v, auto const& s, mpx::fp8_block_scale_layout l) {
    return mpx::fp8_block_operand<e4m3, space>{mpx::view(v), mpx::view(s), l};
  };
  CHECK_THROWS_TYPE_WITH(mpx::fp8_block_gemm(exec, op(values, tile_scales, tile), op(values, tile_scales, tile), c),
                         mpx::invalid_argument, Catch::Matchers::Contains("both in 128x128 blocks"));
  CHECK_THROWS_TYPE_WITH(mpx::fp8_block_gemm(exec, op(row_values, row_scales, row), op(values, scales, vec), c),
                         mpx::invalid_argument, Catch::Matchers::Contains("rowwise blocks multiply only rowwise"));
  auto other_values = mpx::make_tensor<e4m3>(exec, {32, 128});
  auto other_scales = mpx::make_tensor<float>(exec, {vec_other_k.count()});
  CHECK_THROWS_TYPE_WITH(
      mpx::fp8_block_gemm(exec, op(values, scales, vec), op(other_values, other_scales, vec_other_k), c),
      mpx::shape_error, Catch::Matchers::Contains("A has K = 200 but B has K = 72"));
  CHECK_THROWS_TYPE_WITH(mpx::fp8_block_gemm(exec, op(values, few_scales, vec), op(values, scales, vec), c),
                         mpx::shape_error, Catch::Matchers::Contains("A's inverse scales have shape [3]"));
  auto c_wrong = mpx::make_tensor<float>(exec, {32, 16});
  CHECK_THROWS_TYPE_WITH(mpx::fp8_block_gemm(exec, op(values, scales, vec), op(values, scales, vec), c_wrong),
                         mpx::shape_error, Catch::Matchers::Contains("C has shape [32, 16] but A B^T is [32, 32]"));
  mpx::fp8_block_scale_layout const vec_n{mpx::fp8_block_kind::vec128, 24, 200};
  auto values_n = mpx::make_tensor<e4m3>(exec, {24, 256});
  auto scales_n = mpx::make_tensor<float>(exec, {vec_n.count()});
  auto c_n = mpx::make_tensor<float>(exec, {32, 24});
  CHECK_THROWS_TYPE_WITH(mpx::fp8_block_gemm(exec, op(values, scales, vec), op(values_n, scales_n, vec_n), c_n),
                         mpx::invalid_argument, Catch::Matchers::Contains("got N = 24"));
  // On the GPU the device's checks come before the padding of an M that is not a
  // multiple of 4 (1x128 blocks, M = 7): a C cuBLASLt could not take is refused, not
  // padded into an aligned copy.
  if constexpr (!mpx::is_host_executor_v<TestType>) {
    mpx::fp8_block_scale_layout const vec_m7{mpx::fp8_block_kind::vec128, 7, 200};
    auto values_m7 = mpx::make_tensor<e4m3>(exec, {7, 256});
    auto scales_m7 = mpx::make_tensor<float>(exec, {vec_m7.count()});
    auto c_m7 = mpx::make_tensor<float>(exec, {7 * 32 + 1});
    auto const c_misaligned = mpx::view(c_m7).flat(1, 7 * 32).reshape(mpx::shape{7, 32});
    CHECK_THROWS_TYPE_WITH(
        mpx::fp8_block_gemm(exec, op(values_m7, scales_m7, vec_m7), op(values, scales, vec), c_misaligned),
        mpx::invalid_argument, Catch::Matchers::Contains("must start at 16-byte aligned addresses"));
  }

  // MXFP8's blocks keep E8M0 scales, multiply only their own kind, and say so.
  mpx::fp8_block_scale_layout const mx{mpx::fp8_block_kind::vec32, 32, 200};
  auto mx_values = mpx::make_tensor<e4m3>(exec, {32, mx.padded_k()});
  auto mx_scales = mpx::make_tensor<e8m0>(exec, {mx.count()});
  auto mx_as_floats = mpx::make_tensor<float>(exec, {mx.count()});
  CHECK_THROWS_TYPE_WITH(mpx::quantize_fp8_blocks<e4m3>(exec, x, true, mx.kind, true, mx_values, mx_as_floats),
                         mpx::invalid_argument, Catch::Matchers::Contains("must hold float8_e8m0"));
  auto vec_as_bytes = mpx::make_tensor<e8m0>(exec, {vec.count()});
  CHECK_THROWS_TYPE_WITH(mpx::quantize_fp8_blocks<e4m3>(exec, x, true, vec.kind, true, values, vec_as_bytes),
                         mpx::invalid_argument, Catch::Matchers::Contains("must hold float"));
  auto const mx_op = mpx::fp8_block_operand<e4m3, space, e8m0>{mpx::view(mx_values), mpx::view(mx_scales), mx};
  CHECK_THROWS_TYPE_WITH(mpx::fp8_block_gemm(exec, mx_op, op(values, scales, vec), c), mpx::invalid_argument,
                         Catch::Matchers::Contains("1x32 (MXFP8) blocks multiply only 1x32 (MXFP8) blocks"));
  auto const mx_labelled_vec = mpx::fp8_block_operand<e4m3, space, e8m0>{mpx::view(mx_values), mpx::view(mx_scales), vec};
  CHECK_THROWS_TYPE_WITH(mpx::fp8_block_gemm(exec, mx_labelled_vec, op(values, scales, vec), c),
                         mpx::invalid_argument, Catch::Matchers::Contains("A's layout says 1x128 blocks"));
}

TEST_CASE("fp8_block_gemm's GPU checks, on the host: alignment, and which device has which scale mode",
          "[fp8][fp8_block][errors]") {
  using namespace fp8_block_cases;
  using space = mpx::host_space;
  mpx::host_executor exec;
  mpx::fp8_block_scale_layout const vec{mpx::fp8_block_kind::vec128, 32, 256}, mx{mpx::fp8_block_kind::vec32, 32, 256};
  auto values = mpx::make_tensor<e4m3>(exec, {32, 256});
  auto scales = mpx::make_tensor<float>(exec, {vec.count() + 4});
  auto mx_scales = mpx::make_tensor<e8m0>(exec, {mx.count()});
  auto c = mpx::make_tensor<float>(exec, {32, 32});
  mpx::fp8_block_operand<e4m3, space> const a{mpx::view(values), mpx::view(scales).flat(0, vec.count()), vec};
  mpx::fp8_block_operand<e4m3, space, e8m0> const a_mx{mpx::view(values), mpx::view(mx_scales), mx};
  mpx::detail::gemm_dims const d{.batch = 1, .m = 32, .n = 32, .k = 256, .stride_a = 0, .stride_b = 0, .stride_c = 0};
  mpx::gemm_options const o{.transpose_a = false, .transpose_b = true};
  auto const check = [&](auto const& x, mpx::compute_capability cc) {
    mpx::detail::check_block_gemm_device(d, o, x, x, c.data(), cc, mpx::source_location::current());
  };
  CHECK_NOTHROW(check(a, {9, 0}));
  CHECK_THROWS_TYPE_WITH(check(a, {10, 0}), mpx::invalid_argument,
                         Catch::Contains("(rowwise, 1x128, 128x128) on Hopper (sm_90) only; this device is sm_10x"));
  CHECK_THROWS_TYPE_WITH(check(a, {8, 9}), mpx::invalid_argument, Catch::Contains("this device is sm_8x"));
  CHECK_THROWS_TYPE_WITH(check(a_mx, {9, 0}), mpx::invalid_argument,
                         Catch::Contains("MXFP8 products (1x32 blocks, E8M0 scales) on Blackwell (sm_100) and newer"));
  CHECK_NOTHROW(check(a_mx, {10, 0}));
  CHECK_NOTHROW(check(a_mx, {12, 0}));
  // The mode is A's: B in 128x128 tiles beside A in 1x128 blocks is Hopper's too.
  mpx::fp8_block_scale_layout const tile{mpx::fp8_block_kind::tile128, 32, 256};
  auto tile_scales = mpx::make_tensor<float>(exec, {tile.count()});
  mpx::fp8_block_operand<e4m3, space> const b_tile{mpx::view(values), mpx::view(tile_scales), tile};
  CHECK_NOTHROW(mpx::detail::check_block_gemm_device(d, o, a, b_tile, c.data(), {9, 0}, mpx::source_location::current()));
  CHECK_THROWS_WITH(
      mpx::detail::check_block_gemm_device(d, o, a, b_tile, c.data(), {10, 0}, mpx::source_location::current()),
      Catch::Contains("on Hopper (sm_90) only"));
  // How each kind's scales reach cuBLASLt (its mode, mapped in one place for the GPU).
  using mpx::detail::lt_operand_scaling;
  STATIC_REQUIRE(mpx::detail::lt_scaling_of(mpx::fp8_block_kind::row) == lt_operand_scaling::row);
  STATIC_REQUIRE(mpx::detail::lt_scaling_of(mpx::fp8_block_kind::vec128) == lt_operand_scaling::vec128);
  STATIC_REQUIRE(mpx::detail::lt_scaling_of(mpx::fp8_block_kind::tile128) == lt_operand_scaling::tile128);
  STATIC_REQUIRE(mpx::detail::lt_scaling_of(mpx::fp8_block_kind::vec32) == lt_operand_scaling::vec32);
  STATIC_REQUIRE(mpx::detail::lt_scaling_of(mpx::fp8_block_kind::vec16) == lt_operand_scaling::vec16);
  // Scales at an offset that is not 16 bytes are refused on any device.
  mpx::fp8_block_operand<e4m3, space> const shifted{mpx::view(values), mpx::view(scales).flat(1, vec.count()), vec};
  CHECK_THROWS_TYPE_WITH(check(shifted, {9, 0}), mpx::invalid_argument,
                         Catch::Contains("inverse scales must start at 16-byte aligned addresses"));
  // fp8_gemm's own rule: Ada (sm_89) or newer.
  auto const check_fp8 = [&](mpx::compute_capability cc) {
    mpx::detail::check_fp8_gemm_device(d, o, values.data(), values.data(), c.data(), cc,
                                       mpx::source_location::current());
  };
  CHECK_NOTHROW(check_fp8({8, 9}));
  CHECK_THROWS_TYPE_WITH(check_fp8({8, 0}), mpx::invalid_argument,
                         Catch::Contains("need an Ada (sm_89) or Hopper (sm_90) GPU or newer; this device is sm_80"));
}
