// mpx::gemm for every dtype on each executor: seeded random operands of awkward shapes,
// all four transpose combinations, alpha/beta (beta = 0 over a NaN-poisoned C), batches
// with and without a shared operand, checked against a float64 product with the
// documented error bound; NaN propagation; shape errors and their messages.
#include "../support/reference/matmul.hpp"
#include "../support/testing.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

namespace {

// A policy that sums in half, declared deliberate below: CUBLAS_COMPUTE_16F on the GPU.
using half_sums = mpx::policy<mpx::half, mpx::half, mpx::half>;

}  // namespace

template <>
inline constexpr bool mpx::enable_half_accumulation<half_sums> = true;

namespace {

template <class T>
struct policy_for;
template <>
struct policy_for<float> {
  using type = mpx::float32;
};
template <>
struct policy_for<mpx::half> {
  using type = mpx::mixed_float16;
};
template <>
struct policy_for<mpx::bfloat16> {
  using type = mpx::mixed_bfloat16;
};

//! The documented bound (docs/gemm.md): |C - exact| <= bound * (|alpha| sum_k |a||b| +
//! |beta| |C0|) + min_subnormal(TC). u_acc is 2^-24 for float operands (fp32 FMA), 2^-23
//! for 16-bit operands (tensor cores add with truncation), 2^-11 for half sums; u_out is
//! the output's rounding (2^-24 float, 2^-11 half, 2^-8 bfloat16).
template <class TIn, class TC, class Acc = float>
double error_bound(std::int64_t k) {
  double const u_out = std::ldexp(1.0, -(mpx::dtype_traits<TC>::mantissa_bits + 1));
  double const u_acc = std::is_same_v<Acc, mpx::half>  ? std::ldexp(1.0, -11)
                       : std::is_same_v<TIn, float> ? std::ldexp(1.0, -24)
                                                    : std::ldexp(1.0, -23);
  return u_out + static_cast<double>(k + 4) * u_acc;
}

struct problem {
  std::int64_t batch = 0;  // 0: plain matrices; otherwise rank-3 tensors
  std::int64_t m, n, k;
  bool ta = false, tb = false;
  bool share_a = false, share_b = false;  // a rank-2 operand beside batches
  float alpha = 1.0f, beta = 0.0f;
};

std::string describe(problem const& p) {
  std::ostringstream os;
  os << "batch=" << p.batch << " M=" << p.m << " N=" << p.n << " K=" << p.k << " ta=" << p.ta << " tb=" << p.tb
     << " share_a=" << p.share_a << " share_b=" << p.share_b << " alpha=" << p.alpha << " beta=" << p.beta;
  return os.str();
}

mpx::shape matrix_shape(std::int64_t batch, bool shared, std::int64_t rows, std::int64_t cols) {
  if (batch == 0 || shared) return mpx::shape{rows, cols};
  return mpx::shape{batch, rows, cols};
}

//! One element of C in float64 (tests/support/reference/matmul.hpp): alpha * sum over kk
//! of op(A)[bi][i][kk] * op(B)[bi][kk][j] + beta * c_old, and the sum of the terms'
//! magnitudes the error bound scales. sa, sb: the batch strides (0: a shared operand).
template <class T>
mpx_test::reference::product_entry reference_product(std::vector<T> const& a, std::vector<T> const& b,
                                                     std::int64_t sa, std::int64_t sb, bool ta, bool tb,
                                                     std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t bi,
                                                     std::int64_t i, std::int64_t j, double alpha, double beta,
                                                     double c_old) {
  mpx_test::reference::matrix<T> const op_a{a.data() + bi * sa, m, k, ta}, op_b{b.data() + bi * sb, k, n, tb};
  return mpx_test::reference::gemm_entry(op_a, op_b, i, j, k, alpha, beta, c_old);
}

struct outcome {
  std::size_t worst = 0;      // index of the largest error relative to what is allowed
  double worst_ratio = 0;     // error / allowed there (infinite for NaN)
  std::size_t bad = 0;
};

//! Runs one product on `exec` and checks every element of C against float64.
template <class Policy, class TC, class Exec>
outcome run_and_check(Exec const& exec, problem const& p) {
  using T = typename Policy::storage_type;
  using Acc = typename Policy::accumulate_type;
  std::int64_t const nb = p.batch == 0 ? 1 : p.batch;
  auto const a_shape = p.ta ? matrix_shape(p.batch, p.share_a, p.k, p.m) : matrix_shape(p.batch, p.share_a, p.m, p.k);
  auto const b_shape = p.tb ? matrix_shape(p.batch, p.share_b, p.n, p.k) : matrix_shape(p.batch, p.share_b, p.k, p.n);
  auto const c_shape = matrix_shape(p.batch, false, p.m, p.n);
  std::uint64_t const salt =
      static_cast<std::uint64_t>(p.m * 1000003 + p.n * 1009 + p.k * 7 + nb) * 4 + p.ta * 2 + p.tb;
  auto const a = mpx_test::random_values<T>(a_shape.size(), -1, 1, salt);
  auto const b = mpx_test::random_values<T>(b_shape.size(), -1, 1, salt + 1);
  std::vector<TC> c0 = p.beta == 0 ? std::vector<TC>(c_shape.size(), mpx_test::poison<TC>())
                                   : mpx_test::random_values<TC>(c_shape.size(), -1, 1, salt + 2);

  auto const ad = mpx_test::upload(exec, a, a_shape);
  auto const bd = mpx_test::upload(exec, b, b_shape);
  auto cd = mpx_test::upload(exec, c0, c_shape);
  mpx::gemm<Policy>(exec, ad, bd, cd, {.transpose_a = p.ta, .transpose_b = p.tb, .alpha = p.alpha, .beta = p.beta});
  auto const got = mpx_test::download(exec, cd);

  std::int64_t const sa = p.share_a || p.batch == 0 ? 0 : p.m * p.k;
  std::int64_t const sb = p.share_b || p.batch == 0 ? 0 : p.k * p.n;
  double const bound = error_bound<T, TC, Acc>(p.k);
  double const tiny = mpx::detail::to_double(mpx::dtype_traits<TC>::min_subnormal());
  outcome out;
  double nonzero = 0;
  for (std::int64_t bi = 0; bi < nb; ++bi)
    for (std::int64_t i = 0; i < p.m; ++i)
      for (std::int64_t j = 0; j < p.n; ++j) {
        std::size_t const at = static_cast<std::size_t>((bi * p.m + i) * p.n + j);
        auto const [exact, scale] = reference_product(a, b, sa, sb, p.ta, p.tb, p.m, p.n, p.k, bi, i, j, p.alpha,
                                                      p.beta, mpx::detail::to_double(c0[at]));
        nonzero += std::abs(exact);
        double const g = mpx::detail::to_double(got[at]);
        double const error = std::abs(g - exact);
        double const allowed = bound * scale + tiny;
        double const ratio = std::isnan(error) ? std::numeric_limits<double>::infinity() : error / allowed;
        if (!(ratio <= 1)) ++out.bad;
        if (!(ratio <= out.worst_ratio)) {
          out.worst = at;
          out.worst_ratio = ratio;
        }
      }
  // A reference of zeros would accept anything.
  REQUIRE(nonzero > 0);
  if (out.bad) {
    INFO(describe(p) << ": " << out.bad << " elements beyond the bound " << bound << "; worst at " << out.worst
                     << ": got " << mpx_test::describe(got[out.worst]) << " (error / allowed = " << out.worst_ratio
                     << ")");
    CHECK(out.bad == 0);
  }
  return out;
}

template <class T>
using policy_of = typename policy_for<T>::type;

}  // namespace

TEMPLATE_LIST_TEST_CASE("gemm is within its error bound of float64 for awkward shapes and every transpose", "[gemm]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::int64_t m : {1, 7, 31, 64, 129})
      for (std::int64_t n : {1, 7, 31, 64, 129})
        for (std::int64_t k : {1, 7, 31, 64, 129})
          for (int t = 0; t < 4; ++t) {
            problem p{.m = m, .n = n, .k = k, .ta = (t & 1) != 0, .tb = (t & 2) != 0};
            // Alternate the two regimes so every shape and transpose meets each over the loop.
            if ((m + n + k + t) % 2) {
              p.alpha = -0.75f;
              p.beta = 0.5f;
            }
            run_and_check<policy_of<T>, T>(exec, p);
          }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("gemm of 16-bit operands writes a float C when asked", "[gemm]", mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::int64_t s : {1, 31, 129})
      for (int t = 0; t < 4; ++t)
        for (float beta : {0.0f, -1.5f}) {
          problem const p{.m = s, .n = s + 2, .k = 2 * s + 1, .ta = (t & 1) != 0, .tb = (t & 2) != 0, .alpha = 2,
                          .beta = beta};
          run_and_check<policy_of<T>, float>(exec, p);
        }
  };
  mpx_test::for_each_dtype_in<mpx_test::dtypes16>(for_type);
}

TEMPLATE_LIST_TEST_CASE("gemm over batches, with and without a shared operand", "[gemm]", mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::int64_t batch : {1, 3})
      for (int share = 0; share < 3; ++share)  // none, A shared, B shared (the foldable case)
        for (int t = 0; t < 4; ++t)
          for (float beta : {0.0f, 0.25f}) {
            problem const p{.batch = batch, .m = 31, .n = 7, .k = 64, .ta = (t & 1) != 0, .tb = (t & 2) != 0,
                            .share_a = share == 1, .share_b = share == 2, .alpha = 1.5f, .beta = beta};
            run_and_check<policy_of<T>, T>(exec, p);
          }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("gemm with K = 0 or alpha = 0 scales C by beta and reads neither A nor B", "[gemm]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    using P = policy_of<T>;
    std::vector<T> const c0 = mpx_test::random_values<T>(6, -1, 1, 3);
    // K = 0: op(A) op(B) is a matrix of zeros.
    auto const a0 = mpx::make_tensor<T>(exec, {2, 0});
    auto const b0 = mpx::make_tensor<T>(exec, {0, 3});
    auto c = mpx_test::upload(exec, std::vector<T>(6, mpx_test::poison<T>()), {2, 3});
    mpx::gemm<P>(exec, a0, b0, c);
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, c), std::vector<T>(6, mpx::cast<T>(0.0f))).empty());
    auto c2 = mpx_test::upload(exec, c0, {2, 3});
    mpx::gemm<P>(exec, a0, b0, c2, {.beta = 2.0f});
    std::vector<T> doubled(6);
    for (std::size_t i = 0; i < 6; ++i) doubled[i] = mpx::cast<T>(2.0f * mpx::cast<float>(c0[i]));
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, c2), doubled).empty());
    // alpha = 0: A and B full of NaN are not read (as in BLAS).
    auto const an = mpx_test::upload(exec, std::vector<T>(8, mpx_test::poison<T>()), {2, 4});
    auto const bn = mpx_test::upload(exec, std::vector<T>(12, mpx_test::poison<T>()), {4, 3});
    auto c3 = mpx_test::upload(exec, c0, {2, 3});
    mpx::gemm<P>(exec, an, bn, c3, {.alpha = 0.0f, .beta = 2.0f});
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, c3), doubled).empty());
    // Empty C: nothing to do, nothing read.
    auto empty = mpx::make_tensor<T>(exec, {0, 3});
    mpx::gemm<P>(exec, mpx::make_tensor<T>(exec, {0, 4}), bn, empty);
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("gemm propagates NaN from A and B into exactly the outputs they touch", "[gemm]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    std::int64_t const m = 33, n = 17, k = 65;
    for (int t = 0; t < 4; ++t) {
      bool const ta = t & 1, tb = t & 2;
      auto a = mpx_test::random_values<T>(static_cast<std::size_t>(m * k), -1, 1, 10 + t);
      auto b = mpx_test::random_values<T>(static_cast<std::size_t>(k * n), -1, 1, 20 + t);
      std::int64_t const row = 5, col = 11, kk = 40;  // NaN at op(A)[row][kk] and op(B)[kk][col]
      T const nan = mpx::dtype_traits<T>::quiet_nan();
      a[static_cast<std::size_t>(ta ? kk * m + row : row * k + kk)] = nan;
      b[static_cast<std::size_t>(tb ? col * k + kk : kk * n + col)] = nan;
      auto const ad = mpx_test::upload(exec, a, ta ? mpx::shape{k, m} : mpx::shape{m, k});
      auto const bd = mpx_test::upload(exec, b, tb ? mpx::shape{n, k} : mpx::shape{k, n});
      auto c = mpx_test::upload(exec, std::vector<T>(static_cast<std::size_t>(m * n), mpx_test::poison<T>()), {m, n});
      mpx::gemm<policy_of<T>>(exec, ad, bd, c, {.transpose_a = ta, .transpose_b = tb});
      auto const got = mpx_test::download(exec, c);
      std::size_t wrong = 0;
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) {
          bool const should_be_nan = i == row || j == col;
          if (mpx::is_nan(got[static_cast<std::size_t>(i * n + j)]) != should_be_nan) ++wrong;
        }
      INFO(mpx::dtype_name<T> << " ta=" << ta << " tb=" << tb);
      REQUIRE(wrong == 0);
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("gemm accepts views at any offset", "[gemm]", mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    std::int64_t const m = 64, n = 48, k = 72;
    auto const a = mpx_test::random_values<T>(static_cast<std::size_t>(m * k + 1), -1, 1, 30);
    auto const b = mpx_test::random_values<T>(static_cast<std::size_t>(k * n + 3), -1, 1, 31);
    auto const ad = mpx_test::upload(exec, a);
    auto const bd = mpx_test::upload(exec, b);
    auto cd = mpx_test::upload(exec, std::vector<T>(static_cast<std::size_t>(m * n + 5), mpx_test::poison<T>()));
    // Views one, three and five elements in: no longer 16-byte aligned.
    auto const av = mpx::view(ad).flat(1, static_cast<std::size_t>(m * k)).reshape({m, k});
    auto const bv = mpx::view(bd).flat(3, static_cast<std::size_t>(k * n)).reshape({k, n});
    auto cv = mpx::view(cd).flat(5, static_cast<std::size_t>(m * n)).reshape({m, n});
    mpx::gemm<policy_of<T>>(exec, av, bv, cv);
    auto const got = mpx_test::download(exec, cd);
    double const bound = error_bound<T, T>(k);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < 5; ++i) bad += !mpx::is_nan(got[i]);  // before the view: untouched
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        mpx_test::reference::matrix<T> const av_ref{a.data() + 1, m, k}, bv_ref{b.data() + 3, k, n};
        auto const [exact, scale] = mpx_test::reference::dot(av_ref, bv_ref, i, j, k);
        double const g = mpx::detail::to_double(got[static_cast<std::size_t>(5 + i * n + j)]);
        bad += !(std::abs(g - exact) <= bound * scale + 1e-30);
      }
    INFO(mpx::dtype_name<T>);
    REQUIRE(bad == 0);
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("gemm under a deliberate half-accumulating policy", "[gemm]", mpx_test::executors) {
  TestType exec;
  for (std::int64_t s : {1, 7, 64, 129})
    for (int t = 0; t < 4; ++t) {
      problem const p{.m = s, .n = s, .k = s, .ta = (t & 1) != 0, .tb = (t & 2) != 0, .alpha = 1, .beta = 0.5f};
      run_and_check<half_sums, mpx::half>(exec, p);
    }
}

TEMPLATE_LIST_TEST_CASE("gemm refuses shapes that do not agree and names them", "[gemm]", mpx_test::executors) {
  TestType exec;
  using P = mpx::float32;
  auto a = mpx::make_tensor<float>(exec, {3, 4});
  auto b = mpx::make_tensor<float>(exec, {5, 6});
  auto c = mpx::make_tensor<float>(exec, {3, 6});
  using Catch::Matchers::Contains;
  CHECK_THROWS_TYPE_WITH(mpx::gemm<P>(exec, a, b, c), mpx::shape_error,
                         Contains("mpx::gemm: shapes do not agree: A [3, 4], B [5, 6], C [3, 6]: the inner extents "
                                  "differ (4 in A, 5 in B)"));
  // Transposes are named: A [3, 4] transposed is 4 x 3, B [6, 5] transposed is 5 x 6.
  auto b2 = mpx::make_tensor<float>(exec, {6, 5});
  CHECK_THROWS_TYPE_WITH(mpx::gemm<P>(exec, a, b2, c, {.transpose_a = true, .transpose_b = true}), mpx::shape_error,
                         Contains("A [3, 4] transposed, B [6, 5] transposed, C [3, 6]: the inner extents differ (3 in "
                                  "A, 5 in B)"));
  auto b3 = mpx::make_tensor<float>(exec, {4, 7});
  CHECK_THROWS_TYPE_WITH(mpx::gemm<P>(exec, a, b3, c), mpx::shape_error,
                         Contains("A [3, 4], B [4, 7], C [3, 6]: C must be 3 x 7 (M x N) per product"));
  auto v = mpx::make_tensor<float>(exec, {4});
  CHECK_THROWS_TYPE_WITH(mpx::gemm<P>(exec, a, v, c), mpx::shape_error,
                         Contains("each must be a matrix [rows, cols] or a batch of them [batch, rows, cols]"));
  auto a3 = mpx::make_tensor<float>(exec, {2, 3, 4});
  auto b36 = mpx::make_tensor<float>(exec, {4, 6});
  CHECK_THROWS_TYPE_WITH(mpx::gemm<P>(exec, a3, b36, c), mpx::shape_error,
                         Contains("A [2, 3, 4], B [4, 6], C [3, 6]: C must be a batch [batch, M, N] when A or B is "
                                  "one"));
  auto c3 = mpx::make_tensor<float>(exec, {3, 3, 6});
  CHECK_THROWS_TYPE_WITH(mpx::gemm<P>(exec, a3, b36, c3), mpx::shape_error, Contains("the batch extents differ"));
  auto c23 = mpx::make_tensor<float>(exec, {2, 3, 6});
  CHECK_THROWS_TYPE_WITH(mpx::gemm<P>(exec, a, b36, c23), mpx::shape_error,
                         Contains("C is a batch but neither A nor B is one"));
  CHECK_NOTHROW(mpx::gemm<P>(exec, a3, b36, c23));
  CHECK_NOTHROW(mpx::gemm<P>(exec, a, b36, c));
}

// Found by the API fuzzer (fuzz/regressions/api_matmul/gemm_c_overlaps_a): a C over A's
// memory was accepted and multiplied into while A was still being read.
TEMPLATE_LIST_TEST_CASE("gemm and fp8_gemm refuse a C that overlaps A or B", "[gemm]", mpx_test::executors) {
  using Catch::Matchers::Contains;
  TestType exec;
  auto buffer = mpx::make_tensor<float>(exec, {64});
  auto const whole = mpx::view(buffer);
  auto const at = [&](std::size_t offset, mpx::shape s) { return whole.flat(offset, s.size()).reshape(s); };
  auto const a = at(0, {3, 4});
  auto const b = at(20, {4, 3});
  using P = mpx::float32;
  CHECK_THROWS_TYPE_WITH(mpx::gemm<P>(exec, a, b, at(5, {3, 3})), mpx::invalid_argument,
                         Contains("mpx::gemm") && Contains("C and A overlap in memory"));
  CHECK_THROWS_TYPE_WITH(mpx::gemm<P>(exec, a, b, at(0, {3, 3})), mpx::invalid_argument, Contains("C and A overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::gemm<P>(exec, a, b, at(28, {3, 3})), mpx::invalid_argument, Contains("C and B overlap"));
  CHECK_NOTHROW(mpx::gemm<P>(exec, a, b, at(40, {3, 3})));
  // fp8 operands over a float C's bytes.
  using F = mpx::float8_e4m3;
  auto const s = mpx_test::upload(exec, std::vector<float>{1.0f});
  mpx::tensor_view<F const, mpx::space_t<decltype(buffer)>> const a8(reinterpret_cast<F const*>(buffer.data()),
                                                                     mpx::shape{3, 16});
  auto const b8 = mpx::make_tensor<F>(exec, {16, 16});
  CHECK_THROWS_TYPE_WITH(mpx::fp8_gemm(exec, a8, s.data(), b8, s.data(), at(4, {3, 16}), {.transpose_b = true}),
                         mpx::invalid_argument, Contains("mpx::fp8_gemm") && Contains("C and A overlap"));
}

// A batch with a shared B folds into one tall product, unless the tall M would pass
// cuBLASLt's 2^31 - 1 (then it stays a strided batch, which cuBLASLt takes).
TEST_CASE("gemm folds a shared-B batch into one product only where the extents allow", "[gemm]") {
  using mpx::detail::fold_batch;
  mpx::detail::gemm_dims d{.batch = 8, .m = 100, .n = 16, .k = 32, .stride_a = 3200, .stride_b = 0, .stride_c = 1600};
  auto const folded = fold_batch(d, false);
  CHECK(folded.batch == 1);
  CHECK(folded.m == 800);
  CHECK(fold_batch(d, true).batch == 8);  // A transposed: its rows are not the batch's rows
  d.m = 1 << 28;                          // 8 x 2^28 = 2^31 rows
  d.stride_a = d.m * d.k;
  d.stride_c = d.m * d.n;
  auto const kept = fold_batch(d, false);
  CHECK(kept.batch == 8);
  CHECK(kept.m == 1 << 28);
}

TEST_CASE("gemm on the GPU gets operands it must round as Compute temporaries, and a 16-bit C through float",
          "[gemm]") {
  // What cuBLASLt is handed (it takes only Compute operands, and a C of Compute or float),
  // run on the host with a product of the test's own.
  mpx::host_executor const exec;
  mpx::shape const sa{2, 3}, sb{3, 2}, sc{2, 2};
  auto const a = mpx_test::random_values<mpx::half>(6, -4, 4, 1), b = mpx_test::random_values<mpx::half>(6, -4, 4, 2);
  auto const c0 = mpx_test::random_values<mpx::half>(4, -4, 4, 3);
  for (float const beta : {0.0f, 0.5f}) {
    CAPTURE(beta);
    auto c = c0;
    int calls = 0;
    mpx::detail::with_compute_operands<mpx::bfloat16>(
        exec, sa, sb, sc, a.data(), b.data(), beta, c.data(), [&](auto const* a_in, auto const* b_in, auto* c_out) {
          ++calls;
          STATIC_REQUIRE(std::is_same_v<decltype(a_in), mpx::bfloat16 const*>);
          STATIC_REQUIRE(std::is_same_v<decltype(b_in), mpx::bfloat16 const*>);
          STATIC_REQUIRE(std::is_same_v<decltype(c_out), float*>);  // half C: a float temporary
          for (std::size_t i = 0; i < 6; ++i) {
            CHECK(mpx::detail::bit_cast<std::uint16_t>(a_in[i]) ==
                  mpx::detail::bit_cast<std::uint16_t>(mpx::cast<mpx::bfloat16>(a[i])));
            CHECK(mpx::detail::bit_cast<std::uint16_t>(b_in[i]) ==
                  mpx::detail::bit_cast<std::uint16_t>(mpx::cast<mpx::bfloat16>(b[i])));
          }
          for (std::size_t i = 0; i < 4; ++i) {
            if (beta != 0.0f) CHECK(c_out[i] == mpx::cast<float>(c0[i]));  // C is read when beta is not 0
            c_out[i] = 1000.25f + static_cast<float>(i);  // rounded once, back into half
          }
        });
    CHECK(calls == 1);
    for (std::size_t i = 0; i < 4; ++i)
      CHECK(mpx::cast<float>(c[i]) == mpx::cast<float>(mpx::cast<mpx::half>(1000.25f + static_cast<float>(i))));
  }
  // Nothing to round (a float compute type reads 16-bit operands exactly): the caller's
  // own pointers; a float C is the caller's too.
  auto c = c0;
  int calls = 0;
  mpx::detail::with_compute_operands<float>(exec, sa, sb, sc, a.data(), b.data(), 1.0f, c.data(),
                                            [&](auto const* a_in, auto const* b_in, auto* c_out) {
                                              ++calls;
                                              CHECK(a_in == a.data());
                                              CHECK(b_in == b.data());
                                              CHECK(c_out == c.data());
                                            });
  auto const af = mpx_test::random_values<float>(6, -4, 4, 4), bf = mpx_test::random_values<float>(6, -4, 4, 5);
  std::vector<float> cf(4, 7.0f);
  mpx::detail::with_compute_operands<mpx::bfloat16>(exec, sa, sb, sc, af.data(), bf.data(), 1.0f, cf.data(),
                                                    [&](auto const* a_in, auto const*, auto* c_out) {
                                                      ++calls;
                                                      STATIC_REQUIRE(std::is_same_v<decltype(a_in),
                                                                                    mpx::bfloat16 const*>);
                                                      CHECK(c_out == cf.data());
                                                      CHECK(mpx::cast<float>(a_in[0]) ==
                                                            mpx::cast<float>(mpx::cast<mpx::bfloat16>(af[0])));
                                                    });
  CHECK(calls == 2);
}

// What only a GPU runs, checked on the host: the translation of mpx's row-major product
// into cuBLASLt's column-major terms (detail::column_major_terms, after gemm_shapes and
// fold_batch, as cuda_gemm calls them), interpreted as cuBLASLt's documentation defines
// them: D[r + c * ldd] = sum_k op(first)[r, k] op(second)[k, c], where
// op(X)[r, c] = X[c + r * ld] when X is transposed and X[r + c * ld] otherwise, batch
// entry b at b * batch_stride (0: shared). Every transpose pair, batches with A, B or
// neither shared, and the folded shared-B batch; integer operands, so the sums are exact.
TEST_CASE("gemm's cuBLASLt terms, read column-major as cuBLASLt reads them, give the row-major product", "[gemm]") {
  using mpx::detail::column_major_matrix;
  auto const op_rows = [](column_major_matrix const& x) { return x.transposed ? x.cols : x.rows; };
  auto const op_cols = [](column_major_matrix const& x) { return x.transposed ? x.rows : x.cols; };
  // Element (r, c) of op(x), batch entry b, from `data` (which must hold it).
  auto const element = [](std::vector<double> const& data, column_major_matrix const& x, std::int64_t b, std::int64_t r,
                          std::int64_t c) {
    std::int64_t const i = b * x.batch_stride + (x.transposed ? c + r * x.ld : r + c * x.ld);
    REQUIRE(i >= 0);
    REQUIRE(static_cast<std::size_t>(i) < data.size());
    return data[static_cast<std::size_t>(i)];
  };
  std::mt19937 gen(5);
  std::uniform_int_distribution<int> small(-4, 4);
  auto const values = [&](std::int64_t n) {
    std::vector<double> v(static_cast<std::size_t>(n));
    for (double& x : v) x = small(gen);
    return v;
  };
  int checked = 0, folded = 0;
  for (std::int64_t const m : {1, 3, 17})
    for (std::int64_t const n : {1, 5, 16})
      for (std::int64_t const k : {1, 7})
        for (int const batching : {0, 1, 2, 3})  // none; both batched; A shared; B shared
          for (bool const ta : {false, true})
            for (bool const tb : {false, true}) {
              std::int64_t const batch = batching == 0 ? 1 : 3;
              bool const a_batched = batching == 1 || batching == 3, b_batched = batching == 1 || batching == 2;
              mpx::shape const sa = a_batched ? mpx::shape{batch, ta ? k : m, ta ? m : k} : mpx::shape{ta ? k : m, ta ? m : k};
              mpx::shape const sb = b_batched ? mpx::shape{batch, tb ? n : k, tb ? k : n} : mpx::shape{tb ? n : k, tb ? k : n};
              mpx::shape const sc = batching ? mpx::shape{batch, m, n} : mpx::shape{m, n};
              INFO("M=" << m << " N=" << n << " K=" << k << " A " << sa.to_string() << (ta ? " transposed" : "") << ", B "
                        << sb.to_string() << (tb ? " transposed" : ""));
              auto const a = values(static_cast<std::int64_t>(sa.size()));
              auto const b = values(static_cast<std::int64_t>(sb.size()));
              // Row-major, as mpx stores them.
              std::vector<double> want(sc.size());
              for (std::int64_t e = 0; e < batch; ++e)
                for (std::int64_t i = 0; i < m; ++i)
                  for (std::int64_t j = 0; j < n; ++j) {
                    double sum = 0;
                    for (std::int64_t kk = 0; kk < k; ++kk) {
                      std::int64_t const ea = a_batched ? e * m * k : 0, eb = b_batched ? e * k * n : 0;
                      sum += a[static_cast<std::size_t>(ea + (ta ? kk * m + i : i * k + kk))] *
                             b[static_cast<std::size_t>(eb + (tb ? j * k + kk : kk * n + j))];
                    }
                    want[static_cast<std::size_t>((e * m + i) * n + j)] = sum;
                  }
              auto const d = mpx::detail::fold_batch(
                  mpx::detail::gemm_shapes(sa, sb, sc, {.transpose_a = ta, .transpose_b = tb}), ta);
              folded += d.batch != batch;
              auto const t = mpx::detail::column_major_terms(d, ta, tb);
              // What cuBLASLt checks of the layouts.
              REQUIRE_FALSE(t.c.transposed);
              REQUIRE(op_rows(t.first) == t.c.rows);
              REQUIRE(op_cols(t.second) == t.c.cols);
              REQUIRE(op_cols(t.first) == op_rows(t.second));
              for (column_major_matrix const& x : {t.first, t.second, t.c}) REQUIRE(x.ld >= x.rows);
              REQUIRE((t.batch == 1 || t.c.batch_stride >= t.c.rows * t.c.cols));
              std::vector<double> got(want.size(), std::nan(""));
              for (std::int64_t e = 0; e < t.batch; ++e)
                for (std::int64_t r = 0; r < t.c.rows; ++r)
                  for (std::int64_t c = 0; c < t.c.cols; ++c) {
                    double sum = 0;
                    for (std::int64_t kk = 0; kk < op_cols(t.first); ++kk)
                      sum += element(b, t.first, e, r, kk) * element(a, t.second, e, kk, c);
                    std::int64_t const at = e * t.c.batch_stride + r + c * t.c.ld;
                    REQUIRE(static_cast<std::size_t>(at) < got.size());
                    got[static_cast<std::size_t>(at)] = sum;
                  }
              REQUIRE(got == want);
              ++checked;
            }
  CHECK(checked == 3 * 3 * 2 * 4 * 4);
  CHECK(folded > 0);  // the shared-B batches with A as it is fold into one tall product
  // The alignment cuBLASLt is told: the largest power of two dividing the address and the
  // batch stride in bytes, at most 256.
  auto const at = [](std::uintptr_t p) { return reinterpret_cast<void const*>(p); };
  CHECK(mpx::detail::gemm_alignment(at(0x10000), 0) == 256);
  CHECK(mpx::detail::gemm_alignment(at(0x10002), 0) == 2);
  CHECK(mpx::detail::gemm_alignment(at(0x10000), 6) == 2);
  CHECK(mpx::detail::gemm_alignment(at(0x10010), 48) == 16);
  CHECK(mpx::detail::gemm_alignment(at(0x10100), 4096) == 256);
}

TEST_CASE("gemm's host widening and rounding are mpx::cast bit for bit", "[gemm]") {
  auto widen = [](auto tag) {
    using T = decltype(tag);
    std::size_t bad = 0;
    for (std::uint32_t p = 0; p < 0x10000u; ++p) {
      T const x = mpx::detail::from_bits<T>(static_cast<std::uint16_t>(p));
      bad += !mpx_test::same_value(mpx::detail::widen_to_float_fast(x), mpx::cast<float>(x));
      // NaN payloads too: the widened NaN keeps them, as mpx::cast does.
      bad += mpx::bits(mpx::detail::widen_to_float_fast(x)) != mpx::bits(mpx::cast<float>(x));
    }
    INFO(mpx::dtype_name<T>);
    REQUIRE(bad == 0);
  };
  mpx_test::for_each_dtype_in<mpx_test::dtypes16>(widen);

  auto for_type = [](auto tag) {
    using T = decltype(tag);
    std::size_t bad = 0;
    std::uint32_t first = 0;
    // The epilogue rounds whole arrays (detail::round_span): check it in batches.
    std::vector<float> batch;
    std::vector<T> rounded(4096);
    auto flush = [&] {
      mpx::detail::round_span(batch.data(), rounded.data(), batch.size());
      for (std::size_t i = 0; i < batch.size(); ++i)
        if (!mpx_test::same_value(rounded[i], mpx::cast<T>(batch[i])) && bad++ == 0)
          first = mpx::detail::bit_cast<std::uint32_t>(batch[i]);
      batch.clear();
    };
    auto check = [&](std::uint32_t pattern) {
      batch.push_back(mpx::detail::bit_cast<float>(pattern));
      if (batch.size() == rounded.size()) flush();
    };
    // Every 61st float pattern (70 million: every exponent, both signs, NaN and inf),
    // and every pattern near the edges: half's subnormals, its max, the rounding ties.
    for (std::uint64_t p = 0; p <= 0xFFFF'FFFFull; p += 61) check(static_cast<std::uint32_t>(p));
    for (std::uint32_t p = 0; p < (1u << 24); ++p) check(0x3300'0000u + p);  // 2^-25 .. 2^-14 and beyond
    for (std::uint32_t p = 0x477F'E000u; p < 0x4780'2000u; ++p) check(p);      // 65504 .. 65536
    for (std::uint32_t p = 0x7F7F'0000u; p <= 0x7FFF'FFFFu; ++p) check(p);    // float max .. NaN
    flush();
    INFO(mpx::dtype_name<T> << ": first mismatch at float bits 0x" << std::hex << first);
    REQUIRE(bad == 0);
  };
  mpx_test::for_each_dtype_in<mpx_test::dtypes16>(for_type);
}

namespace test_gemm {

//! One product with a long inner extent: few outputs, K in the tens of thousands, the
//! shape for which cuBLASLt's heuristic splits K over several blocks and sums their
//! partial products in its workspace (split-K), and which the host's blocked product
//! walks in gemm_kc-deep slices. Operands are multiples of 1/4 in [-1, 1] (all-positive
//! when `positive`), exact in every dtype, so every product and every partial sum, in
//! any order, is exact in float (multiples of 1/16 below 2^16): a float C must equal
//! the float64 product bit for bit, whatever the split, and a dropped or doubled slice
//! is off by far more than a rounding. A 16-bit C is checked against the documented
//! bound; with positive operands S equals the product, so that bound is tight too.
//! `nan_at_last_k`: op(A)[1][K - 1] is NaN, which must reach row 1 of C and nothing else.
struct long_k_case {
  std::int64_t batch = 0, m, n, k;
  bool ta = false, tb = false, positive = false, nan_at_last_k = false;
  float beta = 0.0f;
};

template <class Policy, class TC, class Exec>
void check_long_k(Exec const& exec, long_k_case const& p) {
  using T = typename Policy::storage_type;
  std::int64_t const nb = p.batch == 0 ? 1 : p.batch;
  auto shape_of = [&](std::int64_t rows, std::int64_t cols) {
    return p.batch == 0 ? mpx::shape{rows, cols} : mpx::shape{p.batch, rows, cols};
  };
  auto const a_shape = p.ta ? shape_of(p.k, p.m) : shape_of(p.m, p.k);
  auto const b_shape = p.tb ? shape_of(p.n, p.k) : shape_of(p.k, p.n);
  auto const c_shape = shape_of(p.m, p.n);
  std::mt19937_64 gen(mpx_test::seed + static_cast<std::uint64_t>(p.m * 131 + p.n * 17 + p.k));
  auto quarters = [&](std::size_t count, bool positive) {
    std::vector<T> v(count);
    for (auto& x : v) {
      auto const q = static_cast<int>(gen() % (positive ? 4 : 9));  // 1..4 or -4..4 quarters
      x = mpx::cast<T>(0.25f * static_cast<float>(positive ? q + 1 : q - 4));
    }
    return v;
  };
  auto a = quarters(a_shape.size(), p.positive);
  auto const b = quarters(b_shape.size(), p.positive);
  std::int64_t const sa = p.batch == 0 ? 0 : p.m * p.k, sb = p.batch == 0 ? 0 : p.k * p.n;
  std::int64_t const nan_row = 1;
  if (p.nan_at_last_k)
    for (std::int64_t bi = 0; bi < nb; ++bi)
      a[static_cast<std::size_t>(bi * sa + (p.ta ? (p.k - 1) * p.m + nan_row : nan_row * p.k + p.k - 1))] =
          mpx::dtype_traits<T>::quiet_nan();
  std::vector<TC> c0(c_shape.size(), mpx_test::poison<TC>());
  if (p.beta != 0.0f)
    for (auto& x : c0) x = mpx::cast<TC>(0.25f * static_cast<float>(static_cast<int>(gen() % 9) - 4));

  auto const ad = mpx_test::upload(exec, a, a_shape);
  auto const bd = mpx_test::upload(exec, b, b_shape);
  auto cd = mpx_test::upload(exec, c0, c_shape);
  mpx::gemm<Policy>(exec, ad, bd, cd, {.transpose_a = p.ta, .transpose_b = p.tb, .beta = p.beta});
  auto const got = mpx_test::download(exec, cd);

  double const bound = error_bound<T, TC>(p.k);
  double const tiny = mpx::detail::to_double(mpx::dtype_traits<TC>::min_subnormal());
  std::size_t bad = 0, first = 0;
  double first_expected = 0, nonzero = 0;
  for (std::int64_t bi = 0; bi < nb; ++bi)
    for (std::int64_t i = 0; i < p.m; ++i)
      for (std::int64_t j = 0; j < p.n; ++j) {
        std::size_t const at = static_cast<std::size_t>((bi * p.m + i) * p.n + j);
        auto const [exact, scale] = reference_product(a, b, sa, sb, p.ta, p.tb, p.m, p.n, p.k, bi, i, j, 1.0,
                                                      p.beta, mpx::detail::to_double(c0[at]));
        double const g = mpx::detail::to_double(got[at]);
        bool ok;
        if (std::isnan(exact)) ok = std::isnan(g);
        else if (std::is_same_v<TC, float>) ok = g == exact;  // exact sums: no rounding anywhere
        else ok = std::abs(g - exact) <= bound * scale + tiny;
        if (!std::isnan(exact)) nonzero += std::abs(exact);
        if (!ok && bad++ == 0) {
          first = at;
          first_expected = exact;
        }
      }
  REQUIRE(nonzero > 0);
  INFO(mpx::dtype_name<T> << " -> " << mpx::dtype_name<TC> << ": batch=" << p.batch << " M=" << p.m << " N=" << p.n
                          << " K=" << p.k << " ta=" << p.ta << " tb=" << p.tb << " beta=" << p.beta << ": " << bad
                          << " bad; first at " << first << ": got "
                          << (got.empty() ? std::string() : mpx_test::describe(got[first])) << ", expected "
                          << first_expected);
  CHECK(bad == 0);
}

}  // namespace test_gemm

TEMPLATE_LIST_TEST_CASE("gemm with a long inner extent (split-K on the GPU, K slices on the host) is exact in float",
                        "[gemm]", mpx_test::executors) {
  TestType exec;
  using test_gemm::long_k_case;
  std::int64_t const slice = mpx::detail::gemm_kc;
  std::vector<long_k_case> const cases = {
      {.m = 1, .n = 1, .k = 65537},
      {.m = 2, .n = 3, .k = 8193, .nan_at_last_k = true},
      {.m = 4, .n = 8, .k = 40009, .tb = true},
      {.m = 8, .n = 8, .k = 16411, .ta = true, .beta = 1.0f},
      {.batch = 3, .m = 5, .n = 7, .k = 12289, .tb = true, .nan_at_last_k = true},
      {.m = 33, .n = 9, .k = 2 * slice + 1, .ta = true, .tb = true},
  };
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (auto const& c : cases) test_gemm::check_long_k<policy_of<T>, float>(exec, c);
    if constexpr (!std::is_same_v<T, float>) {
      for (auto c : cases) {
        c.positive = true;  // S equals the product: the bound is as tight as it gets
        test_gemm::check_long_k<policy_of<T>, T>(exec, c);
      }
    }
  };
  mpx_test::for_each_dtype(for_type);
}

#if MPX_HAS_CUDA
// The first gemm on a stream allocates that stream's cuBLASLt workspace with cudaMalloc,
// which a graph capture cannot record: mpx says so instead of invalidating the capture
// with cudaErrorStreamCaptureUnsupported. Once warmed up, the same gemm captures; the
// graph is launched over a poisoned C and new operands, so only the captured product
// (not the eager warm-up) can write the expected values.
TEST_CASE("gemm inside a CUDA graph capture: refused on a cold stream, captured on a warm one", "[gemm][cuda]") {
  cudaStream_t stream = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess);
  // Tensors made on the stream free themselves on it (cudaFreeAsync): they live in this
  // scope, which ends before the stream is destroyed, also when a REQUIRE throws.
  struct stream_owner {
    cudaStream_t stream;
    ~stream_owner() {
      static_cast<void>(cudaStreamSynchronize(stream));
      mpx::release_gemm_workspace(stream);
      static_cast<void>(cudaStreamDestroy(stream));
    }
  } const owner{stream};
  struct graph_owner {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ~graph_owner() {
      if (exec) cudaGraphExecDestroy(exec);
      if (graph) cudaGraphDestroy(graph);
    }
  };
  {
    mpx::cuda_executor exec(stream);
    auto a = mpx_test::upload(exec, std::vector<float>(6, 1.0f), {2, 3});
    auto b = mpx_test::upload(exec, std::vector<float>(12, 2.0f), {3, 4});
    auto c = mpx::make_tensor<float>(exec, {2, 4});
    exec.synchronize();
    // Captures one gemm into `into`; returns the message of what was thrown, if anything.
    auto capture = [&](graph_owner& into) {
      REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
      std::string error;
      try {
        mpx::gemm<mpx::float32>(exec, a, b, c);
      } catch (mpx::invalid_argument const& e) {
        error = e.what();
      }
      cudaError_t const ended = cudaStreamEndCapture(stream, &into.graph);
      CHECK(ended == cudaSuccess);  // refused before anything invalidated the capture
      return error;
    };
    {
      graph_owner cold;
      CHECK_THAT(capture(cold), Catch::Contains("before capturing"));
    }
    mpx::gemm<mpx::float32>(exec, a, b, c);  // warms the stream up
    CHECK(mpx_test::download(exec, c) == std::vector<float>(8, 6.0f));
    graph_owner warm;
    REQUIRE(capture(warm).empty());
    REQUIRE(warm.graph != nullptr);
    REQUIRE(cudaGraphInstantiate(&warm.exec, warm.graph, 0) == cudaSuccess);
    // Different operands and a poisoned C, written eagerly before the launch: the graph
    // reads and writes the same addresses, so only its product can give 3 * 2 * 3 = 18.
    mpx::fill(exec, a, 3.0f);
    mpx::fill(exec, c, mpx_test::poison<float>());
    REQUIRE(cudaGraphLaunch(warm.exec, stream) == cudaSuccess);
    CHECK(mpx_test::first_mismatch(mpx_test::download(exec, c), std::vector<float>(8, 18.0f)).empty());
    REQUIRE(cudaGraphLaunch(warm.exec, stream) == cudaSuccess);  // replays alike
    CHECK(mpx_test::first_mismatch(mpx_test::download(exec, c), std::vector<float>(8, 18.0f)).empty());
  }  // a, b and c are freed on the stream, which is still alive
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  mpx::release_gemm_resources();
}

// A stream's workspace (32 MiB on Hopper) goes with release_gemm_workspace; a stream
// destroyed without it leaves its workspace to the next stream that gets its handle
// (the driver recycles handles), not to pile up one per destroyed stream. (A capture on a
// recycled handle before any eager gemm is not tried here: docs/gpu_readiness.md lists it.)
TEST_CASE("gemm workspaces: released with their stream, taken over by a recycled handle", "[gemm][cuda]") {
  mpx::release_gemm_resources();
  REQUIRE(mpx::gemm_workspace_bytes() == 0);
  auto run_gemm = [](cudaStream_t stream) {
    mpx::cuda_executor exec(stream);
    auto a = mpx_test::upload(exec, std::vector<float>(6, 1.0f), {2, 3});
    auto b = mpx_test::upload(exec, std::vector<float>(12, 2.0f), {3, 4});
    auto c = mpx_test::poisoned<float>(exec, {2, 4});
    mpx::gemm<mpx::float32>(exec, a, b, c);
    CHECK(mpx_test::download(exec, c) == std::vector<float>(8, 6.0f));
  };
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  run_gemm(s);
  std::size_t const one = mpx::gemm_workspace_bytes();
  CHECK(one > 0);
  mpx::release_gemm_workspace(s);
  CHECK(mpx::gemm_workspace_bytes() == 0);
  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);

  // Streams made, used and destroyed without telling mpx: whenever the driver hands a
  // destroyed stream's handle to the next one, the workspace passes on.
  std::vector<cudaStream_t> seen;
  int recycled = 0;
  for (int i = 0; i < 8; ++i) {
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    if (std::find(seen.begin(), seen.end(), s) != seen.end()) ++recycled;
    seen.push_back(s);
    run_gemm(s);
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
  }
  INFO(recycled << " of 8 streams got a destroyed stream's handle");
  if (recycled == 0) WARN("the driver gave no stream a destroyed stream's handle: the take-over went untested");
  CHECK(mpx::gemm_workspace_bytes() <= static_cast<std::size_t>(8 - recycled) * one);
  mpx::release_gemm_resources();
  CHECK(mpx::gemm_workspace_bytes() == 0);
}
#endif

namespace {
//! gemm under a policy whose compute type differs from its storage: the product of the
//! operands rounded to the compute type, within the float-sum bound, on a poisoned C.
template <class Policy, class Exec>
void check_compute_type(Exec const& exec, std::int64_t m, std::int64_t n, std::int64_t k, bool ta, bool tb) {
  using S = typename Policy::storage_type;
  using Compute = typename Policy::compute_type;
  auto const a = mpx_test::random_values<S>(static_cast<std::size_t>(m * k), -2.0, 2.0, 71);
  auto const b = mpx_test::random_values<S>(static_cast<std::size_t>(k * n), -2.0, 2.0, 72);
  auto const ad = mpx_test::upload(exec, a, ta ? mpx::shape{k, m} : mpx::shape{m, k});
  auto const bd = mpx_test::upload(exec, b, tb ? mpx::shape{n, k} : mpx::shape{k, n});
  auto c = mpx_test::poisoned<S>(exec, mpx::shape{m, n});
  mpx::gemm<Policy>(exec, ad, bd, c, {.transpose_a = ta, .transpose_b = tb});
  auto const got = mpx_test::download(exec, c);
  // The operands as the product reads them: rounded to the compute type.
  auto const through = [](std::vector<S> const& v) {
    std::vector<Compute> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = mpx::cast<Compute>(mpx::cast<float>(v[i]));
    return out;
  };
  auto const ac = through(a), bc = through(b);
  mpx_test::reference::matrix<Compute> const op_a{ac.data(), m, k, ta}, op_b{bc.data(), k, n, tb};
  mpx_test::reference::matrix<S> const stored_a{a.data(), m, k, ta}, stored_b{b.data(), k, n, tb};
  std::size_t bad = 0, changed = 0;
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      auto const [exact, scale] = mpx_test::reference::dot(op_a, op_b, i, j, k);
      double const storage_exact = mpx_test::reference::dot(stored_a, stored_b, i, j, k).exact;
      double const g = mpx::detail::to_double(got[static_cast<std::size_t>(i * n + j)]);
      double const allowed = error_bound<Compute, S>(k) * scale + 1e-30;
      if (!(std::abs(g - exact) <= allowed)) ++bad;
      if (std::abs(storage_exact - exact) > allowed) ++changed;
    }
  INFO(std::string(Policy::name) << " M=" << m << " N=" << n << " K=" << k << " ta=" << ta << " tb=" << tb);
  CHECK(bad == 0);
  // The rounding to the compute type is visible: the storage-precision product differs
  // (somewhere, given enough outputs; one sum of 300 may hide it in its bound).
  if (m * n >= 64) CHECK(changed > 0);
}
}  // namespace

TEMPLATE_LIST_TEST_CASE("gemm reads its operands in the policy's compute type", "[gemm][compute_type]",
                        mpx_test::executors) {
  TestType const exec;
  // Float activations with bfloat16 products (tensor cores over float storage).
  using float_bf16 = mpx::policy<float, mpx::bfloat16>;
  // Half operands read in bfloat16 (three mantissa bits fewer); float read in half.
  using half_bf16 = mpx::policy<mpx::half, mpx::bfloat16>;
  using float_half = mpx::policy<float, mpx::half>;
  for (auto [m, n, k] : {std::array<std::int64_t, 3>{37, 19, 45}, {1, 1, 300}, {64, 48, 32}}) {
    for (bool ta : {false, true}) {
      check_compute_type<float_bf16>(exec, m, n, k, ta, !ta);
      check_compute_type<half_bf16>(exec, m, n, k, ta, ta);
      check_compute_type<float_half>(exec, m, n, k, !ta, ta);
    }
  }
}

TEMPLATE_LIST_TEST_CASE("a float compute type over 16-bit storage is the storage product", "[gemm][compute_type]",
                        mpx_test::executors) {
  TestType const exec;
  // Every bfloat16 is a float: "compute in float" reads the same values.
  auto const a = mpx_test::random_values<mpx::bfloat16>(33 * 41, -1.0, 1.0, 81);
  auto const b = mpx_test::random_values<mpx::bfloat16>(41 * 17, -1.0, 1.0, 82);
  auto const ad = mpx_test::upload(exec, a, mpx::shape{33, 41});
  auto const bd = mpx_test::upload(exec, b, mpx::shape{41, 17});
  auto c1 = mpx_test::poisoned<float>(exec, mpx::shape{33, 17});
  auto c2 = mpx_test::poisoned<float>(exec, mpx::shape{33, 17});
  mpx::gemm<mpx::mixed_bfloat16>(exec, ad, bd, c1);
  mpx::gemm<mpx::policy<mpx::bfloat16, float>>(exec, ad, bd, c2);
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, c2), mpx_test::download(exec, c1)).empty());
}

// Host paths only (the CUDA suite's binary holds a CUDA context, which a fork does not
// carry, and its products are cuBLASLt's).
#if !MPX_HAS_CUDA
TEST_CASE("gemm of subnormal bfloat16 operands stays within the bound of the host path that runs it", "[gemm]") {
  // The oneDNN path multiplies bfloat16 on the CPU's bfloat16 instructions, which read
  // subnormal operands as zero and flush subnormal partial sums and bfloat16 results:
  // docs/gemm.md adds |alpha| 2^-126 (2K + sum_k (|a_ik| + |b_kj|)), and 2^-126 for a
  // bfloat16 C, for it. The other paths keep subnormals, within the ordinary bound.
  mpx::host_executor const exec;
  std::int64_t const m = 5, n = 7, k = 33;
  auto a = mpx_test::random_values<mpx::bfloat16>(static_cast<std::size_t>(m * k), -1, 1, 91);
  for (auto& x : a)  // all below 2^-126, so that what a flush loses is the whole result
    x = mpx::cast<mpx::bfloat16>(std::ldexp(mpx::cast<float>(x), -127));
  auto const b = mpx_test::random_values<mpx::bfloat16>(static_cast<std::size_t>(k * n), -1, 1, 92);
  auto const ad = mpx_test::upload(exec, a, mpx::shape{m, k});
  auto const bd = mpx_test::upload(exec, b, mpx::shape{k, n});
  auto c = mpx_test::poisoned<float>(exec, mpx::shape{m, n});
  auto c16 = mpx_test::poisoned<mpx::bfloat16>(exec, mpx::shape{m, n});  // rounded by oneDNN itself
  mpx::gemm<mpx::mixed_bfloat16>(exec, ad, bd, c);
  mpx::gemm<mpx::mixed_bfloat16>(exec, ad, bd, c16);
  auto const got = mpx_test::download(exec, c);
  auto const got16 = mpx_test::download(exec, c16);
  bool const flushes = std::string(mpx::gemm_host_library) == "oneDNN";
  double const bound = error_bound<mpx::bfloat16, float>(k);
  double const bound16 = error_bound<mpx::bfloat16, mpx::bfloat16>(k);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      auto const [exact, scale] = reference_product(a, b, 0, 0, false, false, m, n, k, 0, i, j, 1.0, 0.0, 0.0);
      double magnitudes = 0;
      for (std::int64_t kk = 0; kk < k; ++kk)
        magnitudes += std::abs(mpx::detail::to_double(a[static_cast<std::size_t>(i * k + kk)])) +
                      std::abs(mpx::detail::to_double(b[static_cast<std::size_t>(kk * n + j)]));
      double const flushed = flushes ? std::ldexp(2.0 * static_cast<double>(k) + magnitudes, -126) : 0.0;
      double const allowed = bound * scale + std::ldexp(1.0, -149) + flushed;
      double const g = got[static_cast<std::size_t>(i * n + j)];
      INFO("C[" << i << "][" << j << "] = " << g << ", float64 " << exact << ", allowed " << allowed << " ("
                << mpx::gemm_host_library << ")");
      CHECK(std::abs(g - exact) <= allowed);
      // A bfloat16 C: its own rounding, and on the oneDNN path results below 2^-126 flushed.
      double const g16 = mpx::detail::to_double(got16[static_cast<std::size_t>(i * n + j)]);
      double const allowed16 =
          bound16 * scale + std::ldexp(1.0, -133) + flushed + (flushes ? std::ldexp(1.0, -126) : 0.0);
      INFO("bfloat16 C[" << i << "][" << j << "] = " << g16 << ", allowed " << allowed16);
      CHECK(std::abs(g16 - exact) <= allowed16);
    }
}

TEST_CASE("gemm still multiplies in a process forked after a host product", "[gemm]") {
  // oneDNN's OpenMP threads do not survive fork(): the child multiplies on one thread
  // rather than waiting forever for the others. An alarm turns a hang into a failure.
  mpx::host_executor const exec;
  auto const a = mpx_test::random_values<float>(64 * 48, -1, 1, 93);
  auto const b = mpx_test::random_values<float>(48 * 32, -1, 1, 94);
  auto const ad = mpx_test::upload(exec, a, mpx::shape{64, 48});
  auto const bd = mpx_test::upload(exec, b, mpx::shape{48, 32});
  auto parent = mpx_test::poisoned<float>(exec, mpx::shape{64, 32});
  mpx::gemm<mpx::float32>(exec, ad, bd, parent);
  std::vector<float> const expected = mpx_test::download(exec, parent);
  ::fflush(nullptr);
  pid_t const child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::alarm(60);
    int status = 0;
    try {
      auto c = mpx_test::poisoned<float>(exec, mpx::shape{64, 32});
      mpx::gemm<mpx::float32>(exec, ad, bd, c);
      std::vector<float> const got = mpx_test::download(exec, c);
      double const bound = error_bound<float, float>(48) * 48.0 * 2.0;  // |a||b| <= 1 per term, twice over
      for (std::size_t i = 0; i < got.size(); ++i)
        if (!(std::abs(static_cast<double>(got[i]) - expected[i]) <= bound)) status = 2;
    } catch (...) {
      status = 3;
    }
    ::_exit(status);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  INFO("the child " << (WIFSIGNALED(status) ? "was killed by signal " + std::to_string(WTERMSIG(status))
                                            : "exited with " + std::to_string(WEXITSTATUS(status))));
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
}
#endif
