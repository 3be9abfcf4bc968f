// mpx::fp8_gemm on each executor: seeded fp8 operands of varied exponents, the three
// format pairs, C in half, bfloat16 and float, alpha/beta (beta = 0 over a NaN-poisoned
// C), batches, inverse scales that are not 1, against a float64 product of the widened
// fp8 values within the float-sum bound; the whole recipe (quantise float data with
// cast_to_fp8 / cast_to_fp8_transposed, multiply with the states' inverse scales)
// against the float64 product of the original data within the fp8 rounding bound; and
// the refusals. Awkward sizes and every transpose run on the host; the sizes and the
// layout cuBLASLt's fp8 kernels take run on both executors.
#include "../support/reference/matmul.hpp"
#include "../support/testing.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace fp8_gemm_cases {

//! Whether this executor can run an fp8 product here (the host always; a GPU from sm_89).
template <class Exec>
bool runs_fp8_products([[maybe_unused]] Exec const& exec) {
#if MPX_HAS_CUDA
  if constexpr (!mpx::is_host_executor_v<Exec>) {
    int device = 0, major = 0, minor = 0;
    MPX_CUDA_CHECK(cudaGetDevice(&device));
    MPX_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    MPX_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    return major * 10 + minor >= 89;
  }
#endif
  return true;
}

//! On a GPU older than sm_89: fp8_gemm refuses a product that meets every other rule,
//! naming the device. Returns whether the case can go on.
template <class Exec>
bool fp8_products_here_or_refused(Exec const& exec) {
  if (runs_fp8_products(exec)) return true;
  auto const a = mpx::make_tensor<mpx::float8_e4m3>(exec, {16, 16});
  auto const b = mpx::make_tensor<mpx::float8_e4m3>(exec, {16, 16});
  auto c = mpx::make_tensor<float>(exec, {16, 16});
  auto const s = mpx_test::upload(exec, std::vector<float>{1.0f});
  CHECK_THROWS_TYPE_WITH(mpx::fp8_gemm(exec, a, s.data(), b, s.data(), c, {.transpose_b = true}),
                         mpx::invalid_argument,
                         Catch::Matchers::Contains("fp8 products need an Ada (sm_89) or Hopper (sm_90) GPU or newer"));
  WARN("this GPU has no fp8 tensor cores: only the refusal was checked");
  return false;
}

//! The inverse scales every product uses: not 1, so a product that drops one fails.
inline constexpr float a_inverse = 0.125f;
inline constexpr float b_inverse = 3.0f;

struct product {
  std::int64_t batch = 0;  // 0: matrices; otherwise rank-3 tensors
  std::int64_t m, n, k;
  bool ta = false, tb = true;
  bool share_b = false;  // B a matrix beside batches of A and C
  float alpha = 1.0f, beta = 0.0f;
};

std::string describe(product const& p) {
  std::ostringstream os;
  os << "batch=" << p.batch << " M=" << p.m << " N=" << p.n << " K=" << p.k << " ta=" << p.ta << " tb=" << p.tb
     << " share_b=" << p.share_b << " alpha=" << p.alpha << " beta=" << p.beta;
  return os.str();
}

mpx::shape stored_shape(std::int64_t batch, bool shared, std::int64_t rows, std::int64_t cols) {
  if (batch == 0 || shared) return mpx::shape{rows, cols};
  return mpx::shape{batch, rows, cols};
}

//! fp8 values with exponents from the format's smallest subnormal to 2^4 (subnormals
//! among them) and random signs; every 61st a zero (none in operands too small for the
//! reference's guard against zeros).
template <class F>
std::vector<F> fp8_values(std::size_t n, std::uint64_t stream) {
  std::mt19937_64 gen(mpx_test::seed + 7919 * stream);
  std::uniform_real_distribution<double> mantissa(1.0, 2.0);
  int const smallest = std::ilogb(mpx::detail::to_double(mpx::dtype_traits<F>::min_subnormal()));
  std::uniform_int_distribution<int> exponent(smallest, 4);
  std::bernoulli_distribution negative(0.5);
  std::vector<F> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    double const x = i % 61 == 60 ? 0.0 : std::ldexp(mantissa(gen), exponent(gen));
    out[i] = mpx::cast<F>(negative(gen) ? -x : x);
  }
  return out;
}

//! The allowed error of one element of C per unit of its magnitude sum: C's rounding,
//! and the sum of exact products on this executor (mpx_test::fp8_sum_bound: float on
//! the host, about 14 bits within an fp8 instruction on Hopper).
template <class TC, class Exec>
double sum_bound(std::int64_t k) {
  double const u_out = std::ldexp(1.0, -(mpx::dtype_traits<TC>::mantissa_bits + 1));
  return u_out + mpx_test::fp8_sum_bound<Exec>(k);
}

//! Runs one product on `exec` and checks every element of C against float64.
template <class TA, class TB, class TC, class Exec>
void run_and_check(Exec const& exec, product const& p) {
  CAPTURE(mpx::dtype_name<TA>, mpx::dtype_name<TB>, mpx::dtype_name<TC>, describe(p));
  std::int64_t const nb = p.batch == 0 ? 1 : p.batch;
  auto const a_shape = p.ta ? stored_shape(p.batch, false, p.k, p.m) : stored_shape(p.batch, false, p.m, p.k);
  auto const b_shape = p.tb ? stored_shape(p.batch, p.share_b, p.n, p.k) : stored_shape(p.batch, p.share_b, p.k, p.n);
  auto const c_shape = stored_shape(p.batch, false, p.m, p.n);
  auto const salt = static_cast<std::uint64_t>(((p.m * 131 + p.n) * 131 + p.k) * 131 + nb) * 4 + p.ta * 2 + p.tb;
  auto const a = fp8_values<TA>(a_shape.size(), salt);
  auto const b = fp8_values<TB>(b_shape.size(), salt + 1);
  std::vector<TC> const c0 = p.beta == 0 ? std::vector<TC>(c_shape.size(), mpx_test::poison<TC>())
                                         : mpx_test::random_values<TC>(c_shape.size(), -1, 1, salt + 2);
  auto const ad = mpx_test::upload(exec, a, a_shape);
  auto const bd = mpx_test::upload(exec, b, b_shape);
  auto cd = mpx_test::upload(exec, c0, c_shape);
  auto const sa = mpx_test::upload(exec, std::vector<float>{a_inverse});
  auto const sb = mpx_test::upload(exec, std::vector<float>{b_inverse});
  mpx::fp8_gemm(exec, ad, sa.data(), bd, sb.data(), cd,
                {.transpose_a = p.ta, .transpose_b = p.tb, .alpha = p.alpha, .beta = p.beta});
  auto const got = mpx_test::download(exec, cd);

  std::int64_t const stride_a = p.batch == 0 ? 0 : p.m * p.k;
  std::int64_t const stride_b = p.batch == 0 || p.share_b ? 0 : p.k * p.n;
  double const dequant = static_cast<double>(p.alpha) * a_inverse * b_inverse;
  double const bound = sum_bound<TC, Exec>(p.k);
  double const tiny = mpx::detail::to_double(mpx::dtype_traits<TC>::min_subnormal());
  std::size_t bad = 0, worst = 0;
  double worst_ratio = 0, nonzero = 0;
  for (std::int64_t bi = 0; bi < nb; ++bi)
    for (std::int64_t i = 0; i < p.m; ++i)
      for (std::int64_t j = 0; j < p.n; ++j) {
        auto const at = static_cast<std::size_t>((bi * p.m + i) * p.n + j);
        mpx_test::reference::matrix<TA> const op_a{a.data() + bi * stride_a, p.m, p.k, p.ta};
        mpx_test::reference::matrix<TB> const op_b{b.data() + bi * stride_b, p.k, p.n, p.tb};
        auto const [exact, magnitude] = mpx_test::reference::gemm_entry(
            op_a, op_b, i, j, p.k, dequant, static_cast<double>(p.beta), mpx::detail::to_double(c0[at]));
        nonzero += std::abs(exact);
        double const error = std::abs(mpx::detail::to_double(got[at]) - exact);
        double const ratio =
            std::isnan(error) ? std::numeric_limits<double>::infinity() : error / (bound * magnitude + tiny);
        if (!(ratio <= 1)) ++bad;
        if (!(ratio <= worst_ratio)) {
          worst = at;
          worst_ratio = ratio;
        }
      }
  REQUIRE(nonzero > 0);  // a reference of zeros would accept anything
  INFO(bad << " elements beyond the bound " << bound << "; worst at " << worst << ": got "
           << mpx_test::describe(got[worst]) << " (error / allowed = " << worst_ratio << ")");
  CHECK(bad == 0);
}

//! Calls f(TA{}, TB{}) for the three format pairs fp8_gemm offers.
template <class F>
void for_each_pair(F&& f) {
  f(mpx::float8_e4m3{}, mpx::float8_e4m3{});
  f(mpx::float8_e4m3{}, mpx::float8_e5m2{});
  f(mpx::float8_e5m2{}, mpx::float8_e4m3{});
}

//! Products that meet the GPU's rules (B transposed, K and N multiples of 16), for
//! both executors; M is free.
std::vector<product> gpu_shaped_products() {
  std::vector<product> out;
  for (auto [m, n, k] : {std::tuple{16, 16, 16}, {33, 32, 64}, {64, 48, 96}, {1, 16, 144}})
    for (int regime = 0; regime < 2; ++regime)
      out.push_back(product{.m = m, .n = n, .k = k, .alpha = regime ? -0.75f : 1.0f, .beta = regime ? 0.5f : 0.0f});
  return out;
}

//! Quantises float data as a layer does: the first step records the amax (delayed
//! scaling, one step of history), the update sets scale = 448 / amax, the second step
//! casts with it.
template <class Exec, class Cast>
void quantise_twice(Exec const& exec, mpx::fp8_tensor_scale<mpx::float8_e4m3, Exec>& state, Cast&& cast) {
  mpx::delayed_scaling const recipe{.history_length = 1};
  cast();
  mpx::update_fp8_scale(exec, state, recipe);
  cast();
}

}  // namespace fp8_gemm_cases

TEMPLATE_LIST_TEST_CASE("fp8_gemm is within the float-sum bound of float64 for every format pair and C type",
                        "[fp8_gemm]", mpx_test::executors) {
  using namespace fp8_gemm_cases;
  TestType exec;
  if (!fp8_products_here_or_refused(exec)) return;
  std::vector<product> problems = gpu_shaped_products();
  if constexpr (mpx::is_host_executor_v<TestType>) {
    // The host takes every size and layout.
    for (std::int64_t m : {1, 7, 33, 50})
      for (std::int64_t n : {1, 7, 33, 50})
        for (std::int64_t k : {1, 7, 33, 50})
          for (int t = 0; t < 4; ++t) {
            bool const odd = (m + n + k + t) % 2 != 0;
            problems.push_back(product{.m = m, .n = n, .k = k, .ta = (t & 1) != 0, .tb = (t & 2) != 0,
                                       .alpha = odd ? -0.75f : 1.0f, .beta = odd ? 0.5f : 0.0f});
          }
  }
  for_each_pair([&](auto ta, auto tb) {
    using TA = decltype(ta);
    using TB = decltype(tb);
    for (product const& p : problems) {
      run_and_check<TA, TB, mpx::half>(exec, p);
      run_and_check<TA, TB, mpx::bfloat16>(exec, p);
      run_and_check<TA, TB, float>(exec, p);
    }
  });
}

TEMPLATE_LIST_TEST_CASE("fp8_gemm over batches, with B shared or not", "[fp8_gemm]", mpx_test::executors) {
  using namespace fp8_gemm_cases;
  TestType exec;
  if (!fp8_products_here_or_refused(exec)) return;
  for (std::int64_t batch : {1, 3})
    for (bool share_b : {false, true})
      for (float beta : {0.0f, -1.5f}) {
        product const p{.batch = batch, .m = 17, .n = 32, .k = 48, .share_b = share_b, .alpha = 2.0f, .beta = beta};
        run_and_check<mpx::float8_e4m3, mpx::float8_e5m2, mpx::bfloat16>(exec, p);
        run_and_check<mpx::float8_e4m3, mpx::float8_e4m3, float>(exec, p);
      }
}

TEMPLATE_LIST_TEST_CASE("fp8_gemm with K = 0 or alpha = 0 scales C by beta and reads neither A, B nor the scales",
                        "[fp8_gemm]", mpx_test::executors) {
  using namespace fp8_gemm_cases;
  TestType exec;
  if (!fp8_products_here_or_refused(exec)) return;
  using F = mpx::float8_e4m3;
  std::vector<float> const c0 = mpx_test::random_values<float>(64, -1, 1, 5);
  std::vector<float> doubled(c0.size());
  for (std::size_t i = 0; i < c0.size(); ++i) doubled[i] = 2.0f * c0[i];
  auto const nan_scale = mpx_test::upload(exec, std::vector<float>{std::numeric_limits<float>::quiet_NaN()});
  // K = 0
  auto c = mpx_test::upload(exec, std::vector<float>(c0.size(), mpx_test::poison<float>()), {4, 16});
  mpx::fp8_gemm(exec, mpx::make_tensor<F>(exec, {4, 0}), nan_scale.data(), mpx::make_tensor<F>(exec, {16, 0}),
                nan_scale.data(), c, {.transpose_b = true});
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, c), std::vector<float>(c0.size(), 0.0f)) == "");
  // alpha = 0 over operands full of NaN
  auto const an = mpx_test::upload(exec, std::vector<F>(64, mpx::dtype_traits<F>::quiet_nan()), {4, 16});
  auto const bn = mpx_test::upload(exec, std::vector<F>(256, mpx::dtype_traits<F>::quiet_nan()), {16, 16});
  auto c2 = mpx_test::upload(exec, c0, {4, 16});
  mpx::fp8_gemm(exec, an, nan_scale.data(), bn, nan_scale.data(), c2, {.transpose_b = true, .alpha = 0, .beta = 2});
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, c2), doubled) == "");
}

// The recipe a layer follows: quantise the activations X [M, K] with cast_to_fp8 and the
// weights, held as W^T [K, N], with cast_to_fp8_transposed (which gives the K-contiguous
// [N, K] the GPU needs), each with its own fp8_tensor_scale; multiply with the states'
// inverse scales. Against the float64 product of the original data: each operand carries
// e4m3's rounding (relative 2^-4 for normals, absolute 2^-10 / scale below 2^-6 / scale),
// plus the float sums.
TEMPLATE_LIST_TEST_CASE("fp8_gemm after cast_to_fp8 and cast_to_fp8_transposed is the float product within fp8 "
                        "rounding",
                        "[fp8_gemm]", mpx_test::executors) {
  using namespace fp8_gemm_cases;
  using F = mpx::float8_e4m3;
  TestType exec;
  if (!fp8_products_here_or_refused(exec)) return;
  for (auto [m, n, k] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{16, 32, 64}, {37, 48, 160}}) {
    CAPTURE(m, n, k);
    auto const x = mpx_test::random_values<float>(static_cast<std::size_t>(m * k), -3, 3, 40 + m);
    auto const wt = mpx_test::random_values<float>(static_cast<std::size_t>(k * n), -0.05, 0.05, 41 + n);  // W^T
    auto const xd = mpx_test::upload(exec, x, {m, k});
    auto const wtd = mpx_test::upload(exec, wt, {k, n});
    mpx::fp8_tensor_scale<F, TestType> x_state(exec, mpx::delayed_scaling{.history_length = 1});
    mpx::fp8_tensor_scale<F, TestType> w_state(exec, mpx::delayed_scaling{.history_length = 1});
    auto x8 = mpx_test::poisoned<F>(exec, {m, k});
    auto w8 = mpx_test::poisoned<F>(exec, {n, k});
    quantise_twice(exec, x_state, [&] { mpx::cast_to_fp8(exec, xd, x_state, x8); });
    quantise_twice(exec, w_state, [&] { mpx::cast_to_fp8_transposed(exec, wtd, w_state, w8); });
    auto c = mpx_test::poisoned<float>(exec, {m, n});
    mpx::fp8_gemm(exec, x8, x_state.inverse_scale_data(), w8, w_state.inverse_scale_data(), c,
                  {.transpose_b = true});
    auto const got = mpx_test::download(exec, c);

    double const x_inverse = x_state.values(exec).inverse_scale, w_inverse = w_state.values(exec).inverse_scale;
    REQUIRE(x_inverse != 1.0);  // the scales came from the data
    REQUIRE(w_inverse != 1.0);
    // |dequantised - x| <= (2^-4 + 2^-22) |x| + 2^-10 * inverse (the 2^-22: float's
    // roundings of x * scale and of the inverse).
    auto const operand_error = [](double v, double inverse) {
      return (std::ldexp(1.0, -4) + std::ldexp(1.0, -22)) * std::abs(v) + std::ldexp(1.0, -10) * inverse;
    };
    double const sum_u = sum_bound<float, TestType>(k);
    std::size_t bad = 0, worst = 0;
    double worst_ratio = 0;
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        double exact = 0, allowed = 0, magnitude = 0;
        for (std::int64_t kk = 0; kk < k; ++kk) {
          double const xv = x[static_cast<std::size_t>(i * k + kk)];
          double const wv = wt[static_cast<std::size_t>(kk * n + j)];
          double const ex = operand_error(xv, x_inverse), ew = operand_error(wv, w_inverse);
          exact += xv * wv;
          allowed += ex * std::abs(wv) + (std::abs(xv) + ex) * ew;
          magnitude += (std::abs(xv) + ex) * (std::abs(wv) + ew);
        }
        allowed += sum_u * magnitude;
        auto const at = static_cast<std::size_t>(i * n + j);
        double const error = std::abs(static_cast<double>(got[at]) - exact);
        double const ratio = std::isnan(error) ? std::numeric_limits<double>::infinity() : error / allowed;
        if (!(ratio <= 1)) ++bad;
        if (!(ratio <= worst_ratio)) {
          worst = at;
          worst_ratio = ratio;
        }
      }
    INFO(bad << " elements beyond the fp8 bound; worst at " << worst << ": got " << got[worst]
             << " (error / allowed = " << worst_ratio << ")");
    CHECK(bad == 0);
  }
}

TEMPLATE_LIST_TEST_CASE("fp8_gemm refuses shapes that do not agree, null scales and, on the GPU, other layouts",
                        "[fp8_gemm]", mpx_test::executors) {
  using Catch::Matchers::Contains;
  using F = mpx::float8_e4m3;
  TestType exec;
  auto const s = mpx_test::upload(exec, std::vector<float>{1.0f});
  auto const a = mpx::make_tensor<F>(exec, {16, 32});
  auto const b = mpx::make_tensor<F>(exec, {48, 16});  // [N, K] with K = 16: disagrees with A's K = 32
  auto c = mpx::make_tensor<float>(exec, {16, 48});
  CHECK_THROWS_TYPE_WITH(mpx::fp8_gemm(exec, a, s.data(), b, s.data(), c, {.transpose_b = true}), mpx::shape_error,
                         Contains("A [16, 32], B [48, 16] transposed, C [16, 48]: the inner extents differ (32 in A, "
                                  "16 in B)"));
  auto const b2 = mpx::make_tensor<F>(exec, {48, 32});
  CHECK_THROWS_TYPE_WITH(mpx::fp8_gemm(exec, a, nullptr, b2, s.data(), c, {.transpose_b = true}),
                         mpx::invalid_argument, Contains("an inverse scale is null"));
  if constexpr (!mpx::is_host_executor_v<TestType>) {
    // Checked before the device's capability: refused on any GPU.
    auto const at = mpx::make_tensor<F>(exec, {32, 16});
    CHECK_THROWS_TYPE_WITH(
        mpx::fp8_gemm(exec, at, s.data(), b2, s.data(), c, {.transpose_a = true, .transpose_b = true}),
        mpx::invalid_argument, Contains("cast_to_fp8_transposed"));
    auto const bk = mpx::make_tensor<F>(exec, {32, 48});
    CHECK_THROWS_TYPE_WITH(mpx::fp8_gemm(exec, a, s.data(), bk, s.data(), c), mpx::invalid_argument,
                           Contains("transpose_a = false, transpose_b = false"));
    auto const a24 = mpx::make_tensor<F>(exec, {16, 24});
    auto const b24 = mpx::make_tensor<F>(exec, {48, 24});
    CHECK_THROWS_TYPE_WITH(mpx::fp8_gemm(exec, a24, s.data(), b24, s.data(), c, {.transpose_b = true}),
                           mpx::invalid_argument, Contains("got K = 24"));
    auto const b20 = mpx::make_tensor<F>(exec, {20, 32});
    auto c20 = mpx::make_tensor<mpx::half>(exec, {16, 20});
    CHECK_THROWS_TYPE_WITH(mpx::fp8_gemm(exec, a, s.data(), b20, s.data(), c20, {.transpose_b = true}),
                           mpx::invalid_argument, Contains("N must be a multiple of 16") && Contains("got N = 20"));
    // N = 24 with a float C: 96-byte rows of C, yet N is not a multiple of 16 (cuBLASLt's
    // fp8 rule, as PyTorch's _scaled_mm states it): mpx's message, not cuBLASLt's status.
    auto const b24n = mpx::make_tensor<F>(exec, {24, 32});
    auto c24 = mpx::make_tensor<float>(exec, {16, 24});
    CHECK_THROWS_TYPE_WITH(mpx::fp8_gemm(exec, a, s.data(), b24n, s.data(), c24, {.transpose_b = true}),
                           mpx::invalid_argument, Contains("N must be a multiple of 16") && Contains("got N = 24"));
    auto const big = mpx::make_tensor<F>(exec, {16 * 32 + 1});
    auto const shifted = mpx::view(big).flat(1, 16 * 32).reshape({16, 32});
    CHECK_THROWS_TYPE_WITH(mpx::fp8_gemm(exec, shifted, s.data(), b2, s.data(), c, {.transpose_b = true}),
                           mpx::invalid_argument, Contains("16-byte aligned"));
  } else {
    // The host takes every layout, K, N and alignment (mpx's fp8 layers apply the GPU's
    // rules on the host themselves: tests/layers/test_fp8_layers.cpp).
    auto const at = mpx_test::upload(exec, std::vector<F>(32 * 16, mpx::cast<F>(1.0f)), {32, 16});
    auto const bk = mpx_test::upload(exec, std::vector<F>(32 * 48, mpx::cast<F>(0.5f)), {32, 48});
    CHECK_NOTHROW(mpx::fp8_gemm(exec, at, s.data(), bk, s.data(), c, {.transpose_a = true}));
    CHECK(mpx_test::download(exec, c)[0] == 16.0f);
  }
}

TEST_CASE("the transposed fp8 cast's grid covers every tile within CUDA's limits", "[fp8]") {
  using mpx::detail::fp8_transposed_grid_of;
  // One block per 32 x 32 tile of out [cols, pitch] and one per batch entry.
  auto g = fp8_transposed_grid_of(3, 33, 64);
  CHECK(g.x == 2);
  CHECK(g.y == 2);
  CHECK(g.z == 3);
  g = fp8_transposed_grid_of(1, 1, 1);
  CHECK((g.x == 1 && g.y == 1 && g.z == 1));
  g = fp8_transposed_grid_of(1, 32, 31);
  CHECK((g.x == 1 && g.y == 1));
  // Capped at 65,535 blocks a dimension; the kernel's loops reach the tiles beyond.
  g = fp8_transposed_grid_of(70000, std::int64_t{32} * 65535 + 1, std::int64_t{32} * 70000);
  CHECK((g.x == 65535 && g.y == 65535 && g.z == 65535));
  g = fp8_transposed_grid_of(65534, std::int64_t{32} * 65534, 32);
  CHECK((g.x == 65534 && g.y == 1 && g.z == 65534));
}
