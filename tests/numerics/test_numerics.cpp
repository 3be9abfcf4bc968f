// all_finite, count_nonfinite, stats and sum_of_squares on each executor: non-finite
// values planted where vectorised kernels go wrong (first, last, inside a vector, in
// the tail, behind a misaligned start), and statistics against a float64 reference.
#include "../support/testing.hpp"

#include <mpx/numerics/thrust.hpp>
#include <thrust/host_vector.h>
#include <thrust/system/cpp/execution_policy.h>
#if MPX_HAS_CUDA
#include <thrust/device_vector.h>
#endif

#include <algorithm>
#include <cmath>
#include <set>

namespace {

template <class T>
mpx::numerics_stats reference_stats(std::vector<T> const& v) {
  mpx::numerics_stats s;
  s.size = v.size();
  double absmax = 0, min_abs = INFINITY;
  double const min_normal = mpx::detail::to_double(mpx::dtype_traits<T>::min_normal());
  for (T const& x : v) {
    double const d = mpx::detail::to_double(x);
    if (std::isnan(d)) ++s.nan;
    else if (std::isinf(d)) ++s.inf;
    else if (d == 0) ++s.zero;
    else {
      double const a = std::fabs(d);
      absmax = std::max(absmax, a);
      min_abs = std::min(min_abs, a);
      s.subnormal += a < min_normal;
      s.underflow_in_half += a <= 0x1p-25;  // rounds to zero in half (the tie goes to even, zero)
      s.overflow_in_half += a >= 65520.0;   // rounds to inf in half
      s.at_max += a == mpx::detail::to_double(mpx::dtype_traits<T>::max());
    }
  }
  s.absmax = static_cast<float>(absmax);
  s.min_abs_nonzero = std::isinf(min_abs) ? 0.0f : static_cast<float>(min_abs);
  return s;
}

template <class T>
std::vector<T> mixed_magnitudes(std::size_t n, std::uint64_t stream) {
  std::mt19937_64 gen(mpx_test::seed + stream);
  std::uniform_real_distribution<double> exponent(-40, 40);
  std::vector<T> v(n);
  for (auto& x : v) {
    std::uint64_t const r = gen();
    x = (r % 17 == 0) ? mpx::cast<T>(0.0) : mpx::cast<T>((r & 1 ? -1 : 1) * std::exp2(exponent(gen)));
  }
  return v;
}

//! floor(log2 |x|) per element from frexp in float64, the zeros, NaN and inf apart.
template <class T>
mpx::exponent_histogram reference_histogram(std::vector<T> const& v) {
  mpx::exponent_histogram h;
  for (T const& x : v) {
    double const d = mpx::detail::to_double(x);
    if (std::isnan(d)) ++h.nan;
    else if (std::isinf(d)) ++h.inf;
    else if (d == 0) ++h.zero;
    else {
      int e = 0;
      std::frexp(d, &e);  // |d| = m 2^e, m in [0.5, 1): floor(log2 |d|) = e - 1
      ++h.counts[static_cast<std::size_t>(e - 1 - mpx::exponent_histogram::min_exponent)];
    }
  }
  return h;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("log2_histogram counts every exponent as float64's frexp does", "[numerics][histogram]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t n : mpx_test::awkward_sizes()) {
      auto values = mixed_magnitudes<T>(n, 100 + n);
      if (n > 10) {
        values[1] = mpx::dtype_traits<T>::quiet_nan();
        values[n - 1] = mpx::dtype_traits<T>::infinity();
        values[n / 2] = mpx::dtype_traits<T>::min_subnormal();
        values[n / 3] = mpx::dtype_traits<T>::max();
        values[n / 4] = mpx::cast<T>(-1.0f);                 // exactly 2^0
        values[n / 5] = mpx::dtype_traits<T>::min_normal();  // the first normal binade
        values[n / 6] = mpx::cast<T>(-3 * mpx::cast<float>(mpx::dtype_traits<T>::min_subnormal()));  // 2^(min + 1)
      }
      auto const d = mpx_test::upload(exec, values);
      auto const got = mpx::log2_histogram(exec, d);
      auto const expected = reference_histogram(values);
      INFO(mpx::dtype_name<T> << " n=" << n);
      REQUIRE(got.counts == expected.counts);
      REQUIRE(got.zero == expected.zero);
      REQUIRE(got.nan == expected.nan);
      REQUIRE(got.inf == expected.inf);
      REQUIRE(got.size() == n);
      if (n > 1000) REQUIRE((expected.zero > 0 && expected.count(-1) > 0));  // the reference has things to find
    }
  };
  mpx_test::for_each_dtype(for_type);
  // float32's own subnormals, down to 2^-149.
  std::vector<float> const tiny = {0x1p-149f, 0x1p-148f, 0x1.8p-140f, 0x1p-127f, 0x1.fffffcp-127f, 0x1p-126f};
  auto const t = mpx::log2_histogram(exec, mpx_test::upload(exec, tiny));
  CHECK(t.count(-149) == 1);
  CHECK(t.count(-148) == 1);
  CHECK(t.count(-140) == 1);
  CHECK(t.count(-127) == 2);
  CHECK(t.count(-126) == 1);
}

TEMPLATE_LIST_TEST_CASE("log2_histogram shows where float16 loses a gradient, and a scale shifts it",
                        "[numerics][histogram]", mpx_test::executors) {
  TestType exec;
  std::vector<float> grads;
  for (int i = 0; i < 300; ++i) grads.push_back(std::ldexp(1.0f + static_cast<float>(i % 7) / 8, -30 + i % 12));
  auto g = mpx_test::upload(exec, grads);
  auto const before = mpx::log2_histogram(exec, g);
  CHECK(before.count_between(-30, -19) == 300);
  CHECK(before.count_between(-149, -26) == 125);  // exponents -30 ... -26: 0 in half
  auto const text = before.to_string();
  CHECK_THAT(text, Catch::Contains("2^-30") && Catch::Contains("0 in half") && Catch::Contains("subnormal in half"));
  mpx::scale(exec, g, 65536.0f);  // 2^16: exact in float, every exponent + 16
  auto const after = mpx::log2_histogram(exec, g);
  for (int e = -30; e <= -19; ++e) CHECK(after.count(e + 16) == before.count(e));
  CHECK(after.count_between(-149, -26) == 0);
  auto const empty = mpx::log2_histogram(exec, mpx_test::upload(exec, std::vector<float>{}));
  CHECK(empty.size() == 0);
  CHECK(empty.to_string() == "(empty)\n");
}

TEMPLATE_LIST_TEST_CASE("a planted NaN or inf is found wherever it sits", "[numerics]", mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t n : {1ul, 7ul, 8ul, 9ul, 33ul, 1021ul, 65537ul, 1000003ul}) {
      auto values = mpx_test::random_values<T>(n, -1000, 1000, n);
      {
        auto const clean = mpx_test::upload(exec, values);
        INFO(mpx::dtype_name<T> << " n=" << n << " clean");
        REQUIRE(mpx::all_finite(exec, clean));
        REQUIRE(mpx::count_nonfinite(exec, clean) == 0);
      }
      std::vector<std::size_t> places = {0, n - 1, n / 2, n > 4 ? n - 3 : 0, n > 12 ? std::size_t{11} : 0};
      std::mt19937_64 gen(mpx_test::seed + n);
      for (int r = 0; r < 5; ++r) places.push_back(gen() % n);
      for (std::size_t place : places) {
        for (T bad : {mpx::dtype_traits<T>::quiet_nan(), mpx::dtype_traits<T>::infinity(),
                      mpx::cast<T>(-mpx::detail::to_double(mpx::dtype_traits<T>::infinity()))}) {
          auto planted = values;
          planted[place] = bad;
          auto const d = mpx_test::upload(exec, planted);
          INFO(mpx::dtype_name<T> << " n=" << n << " at " << place << " value " << mpx_test::describe(bad));
          REQUIRE_FALSE(mpx::all_finite(exec, d));
          REQUIRE(mpx::count_nonfinite(exec, d) == 1);
          // The same search through a view that starts misaligned.
          if (place > 0) REQUIRE(mpx::count_nonfinite(exec, mpx::view(d).flat(1, n - 1)) == 1);
        }
      }
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("stats match a float64 reference", "[numerics]", mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t n : mpx_test::awkward_sizes()) {
      auto values = mixed_magnitudes<T>(n, n);
      if (n > 10) {
        values[3] = mpx::dtype_traits<T>::quiet_nan();
        values[n - 1] = mpx::dtype_traits<T>::infinity();
        values[n / 2] = mpx::dtype_traits<T>::min_subnormal();
      }
      auto const d = mpx_test::upload(exec, values);
      auto const got = mpx::stats(exec, d);
      auto const expected = reference_stats(values);
      INFO(mpx::dtype_name<T> << " n=" << n << "\n got      " << got << "\n expected " << expected);
      REQUIRE(got == expected);
      if (n > 1000) {
        // The reference must have something to find, or this test proves nothing.
        REQUIRE(expected.zero > 0);
        REQUIRE(expected.nan == 1);
        REQUIRE(expected.subnormal > 0);
        if (!std::is_same_v<T, mpx::half>) {
          REQUIRE(expected.underflow_in_half > 0);
          REQUIRE(expected.overflow_in_half > 0);
        }
      }
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("stats explain a gradient that becomes zero in half", "[numerics]", mpx_test::executors) {
  TestType exec;
  // Gradients of size 1e-8 (typical of a deep layer): all of them vanish in half.
  std::vector<float> grads(1000, 1e-8f);
  auto const d = mpx_test::upload(exec, grads);
  auto const s = mpx::stats(exec, d);
  CHECK(s.underflow_in_half == 1000);
  CHECK(s.underflow_in_half_share() == 1.0);
  // Scaled by 2^15 they survive.
  auto scaled = mpx_test::upload(exec, grads);
  mpx::scale(exec, scaled, 32768.0f);
  CHECK(mpx::stats(exec, scaled).underflow_in_half == 0);
}

TEMPLATE_LIST_TEST_CASE("sum_of_squares accumulates in float to float64 accuracy", "[numerics]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t n : mpx_test::awkward_sizes()) {
      auto const values = mpx_test::random_values<T>(n, -3, 3, 7);
      double exact = 0;
      for (T x : values) exact += mpx::detail::to_double(x) * mpx::detail::to_double(x);
      auto const d = mpx_test::upload(exec, values);
      float const got = mpx::sum_of_squares<mpx::mixed_float16>(exec, d);
      INFO(mpx::dtype_name<T> << " n=" << n << " got " << got << " exact " << exact);
      REQUIRE(std::fabs(got - exact) <= 1e-5 * exact + 1e-30);
    }
    // Far past half's range: 256 values of 300 sum to 2.3e7 in float.
    std::vector<T> big(256, mpx::cast<T>(300.0f));
    auto const d = mpx_test::upload(exec, big);
    REQUIRE(mpx::sum_of_squares<mpx::mixed_float16>(exec, d) ==
            static_cast<float>(256.0 * mpx::detail::to_double(big[0]) * mpx::detail::to_double(big[0])));
    // A non-finite gradient gives a non-finite norm: clipping can never hide it.
    big[17] = mpx::dtype_traits<T>::quiet_nan();
    auto const bad = mpx_test::upload(exec, big);
    REQUIRE(std::isnan(mpx::sum_of_squares<mpx::float32>(exec, bad)));
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("empty tensors are finite and have empty stats", "[numerics]", mpx_test::executors) {
  TestType exec;
  auto const e = mpx::make_tensor<float>(exec, {0});
  CHECK(mpx::all_finite(exec, e));
  CHECK(mpx::stats(exec, e) == mpx::numerics_stats{});
  CHECK(mpx::sum_of_squares<mpx::float32>(exec, e) == 0.0f);
}

namespace {

//! The Thrust execution policy of an executor: the host system's on the host, the CUDA
//! system's on the executor's stream.
template <class Exec>
auto thrust_policy_of([[maybe_unused]] Exec const& exec) {
  if constexpr (mpx::is_host_executor_v<Exec>) {
    return thrust::cpp::par;
  } else {
#if MPX_HAS_CUDA
    return thrust::cuda::par_nosync.on(exec.stream());
#endif
  }
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("the checks as Thrust algorithms find what mpx's executors find", "[numerics][thrust]",
                        mpx_test::executors) {
  TestType exec;
  auto const policy = thrust_policy_of(exec);
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t n : mpx_test::awkward_sizes()) {
      auto values = mixed_magnitudes<T>(n, n + 101);
      if (n > 10) {
        values[5] = mpx::dtype_traits<T>::quiet_nan();
        values[n - 2] = -mpx::dtype_traits<T>::infinity();
        values[n / 2 + 1] = mpx::dtype_traits<T>::min_subnormal();
      }
      auto const d = mpx_test::upload(exec, values);
      T const* const first = d.data();
      T const* const last = first + n;
      auto const expected = reference_stats(values);
      INFO(mpx::dtype_name<T> << " n=" << n);
      REQUIRE(mpx::stats(policy, first, last) == expected);
      REQUIRE(mpx::stats(policy, first, last) == mpx::stats(exec, d));
      REQUIRE(mpx::count_nonfinite(policy, first, last) == expected.nonfinite());
      REQUIRE(mpx::all_finite(policy, first, last) == (expected.nonfinite() == 0));
      if (n > 1000) {  // (something to find)
        REQUIRE(expected.nan == 1);
        REQUIRE(expected.inf >= 1);
        REQUIRE(expected.subnormal >= 1);
      }
      // The sum of squares of the finite values, against float64: in Thrust's order, so
      // the bound is a sequential sum's, gamma(n + 1) for n + 1 float roundings (the
      // squares and the additions; a tree on the GPU does better).
      auto const finite = mpx_test::random_values<T>(n, -3, 3, n + 202);
      double exact = 0;
      for (T x : finite) exact += mpx::detail::to_double(x) * mpx::detail::to_double(x);
      auto const f = mpx_test::upload(exec, finite);
      float const got = mpx::sum_of_squares<mpx::mixed_float16>(policy, f.data(), f.data() + n);
      INFO("sum of squares " << got << " exact " << exact);
      double const roundings = static_cast<double>(n + 1) * 0x1p-24;
      REQUIRE(std::fabs(got - exact) <= roundings / (1 - roundings) * exact + 1e-30);
    }
  };
  mpx_test::for_each_dtype(for_type);
  // A NaN makes the sum NaN, as on an executor: clipping by the norm cannot hide it.
  auto const bad = mpx_test::upload(exec, std::vector<float>{1.0f, NAN, 2.0f});
  REQUIRE(std::isnan(mpx::sum_of_squares<mpx::float32>(policy, bad.data(), bad.data() + 3)));
}

TEST_CASE("the Thrust checks take Thrust's containers and the host policies", "[numerics][thrust]") {
  thrust::host_vector<mpx::bfloat16> v(1000, mpx::cast<mpx::bfloat16>(1e-8f));
  v[999] = mpx::dtype_traits<mpx::bfloat16>::quiet_nan();
  auto const s = mpx::stats(thrust::host, v.begin(), v.end());
  CHECK(s.size == 1000);
  CHECK(s.nan == 1);
  CHECK(s.underflow_in_half == 999);
  CHECK(mpx::count_nonfinite(thrust::cpp::par, v.cbegin(), v.cend()) == 1);
  CHECK_FALSE(mpx::all_finite(thrust::host, v.begin(), v.end()));
  CHECK(mpx::all_finite(thrust::host, v.begin(), v.begin() + 999));
  CHECK(mpx::stats(thrust::host, v.begin(), v.begin()) == mpx::numerics_stats{});
}

#if MPX_HAS_CUDA
TEST_CASE("the Thrust checks take a device_vector on the device policy", "[numerics][thrust][cuda]") {
  // Its iterators hand the element functions device references, which they must not see.
  std::vector<mpx::half> host = mpx_test::random_values<mpx::half>(4099, -3, 3, 303);
  host[17] = mpx::dtype_traits<mpx::half>::infinity();
  thrust::device_vector<mpx::half> const device(host.begin(), host.end());
  CHECK(mpx::stats(thrust::device, device.begin(), device.end()) == reference_stats(host));
  CHECK(mpx::count_nonfinite(thrust::device, device.begin(), device.end()) == 1);
  CHECK_FALSE(mpx::all_finite(thrust::device, device.begin(), device.end()));
  CHECK(mpx::all_finite(thrust::device, device.begin() + 18, device.end()));
}
#endif

#if MPX_HAS_CUDA
namespace test_numerics_block {
//! Counts the non-finite values of x with the block-level check, twice in the same
//! kernel (the second call reuses the block's shared memory: it must agree).
template <int Threads, class T>
__global__ void __launch_bounds__(Threads)
    count_twice_kernel(T const* x, std::size_t n, unsigned long long* first, unsigned long long* second) {
  unsigned bad = 0;
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * Threads;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * Threads + threadIdx.x; i < n; i += stride)
    bad += mpx::is_finite(x[i]) ? 0u : 1u;
  mpx::block_add_nonfinite<Threads>(bad, first);
  mpx::block_add_nonfinite<Threads>(bad, second);
}

template <int Threads, class T>
void check_block_count(mpx::cuda_executor const& exec, std::vector<T> const& values, std::size_t expected) {
  auto const x = mpx_test::upload(exec, values);
  auto counters = mpx_test::upload(exec, std::vector<unsigned long long>{0, 0});
  unsigned const grid = static_cast<unsigned>(std::min<std::size_t>((values.size() + Threads - 1) / Threads, 37));
  count_twice_kernel<Threads><<<grid, Threads, 0, exec.stream()>>>(x.data(), values.size(), counters.data(),
                                                                   counters.data() + 1);
  MPX_CUDA_CHECK_LAUNCH("test_numerics_block::count_twice_kernel");
  auto const counts = mpx::to_host(exec, counters);
  INFO(mpx::dtype_name<T> << " n=" << values.size() << " threads=" << Threads);
  CHECK(counts[0] == expected);
  CHECK(counts[1] == expected);
  CHECK(mpx::count_nonfinite(exec, x) == expected);
}
}  // namespace test_numerics_block

TEST_CASE("block_add_nonfinite counts what count_nonfinite counts, per block of any width", "[numerics][cuda]") {
  mpx::cuda_executor exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t n : {1ul, 31ul, 257ul, 4099ul, 65537ul, 300007ul}) {
      auto values = mpx_test::random_values<T>(n, -1000, 1000, n);
      std::mt19937_64 gen(mpx_test::seed + 3 * n);
      std::size_t const planted = n < 5 ? n : 5 + gen() % 40;
      std::set<std::size_t> places;
      while (places.size() < std::min(planted, n)) places.insert(gen() % n);
      int k = 0;
      for (std::size_t p : places)
        values[p] = (k++ % 2) ? mpx::dtype_traits<T>::quiet_nan() : mpx::dtype_traits<T>::infinity();
      test_numerics_block::check_block_count<64>(exec, values, places.size());
      test_numerics_block::check_block_count<256>(exec, values, places.size());
      test_numerics_block::check_block_count<1024>(exec, values, places.size());
    }
  };
  mpx_test::for_each_dtype(for_type);
}
#endif

namespace {
template <class T>
struct saturate_into {
  MPX_HD T operator()(float x) const noexcept { return mpx::saturate_cast<T>(x); }
};
}  // namespace

TEMPLATE_LIST_TEST_CASE("stats, histogram and finite checks of every fp8 pattern match float64", "[numerics][fp8]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t n : {256ul, 1000ul, 65537ul}) {
      std::vector<T> values(n);
      for (std::size_t i = 0; i < n; ++i) values[i] = mpx::detail::from_bits<T>(static_cast<std::uint8_t>(i * 37 % 256));
      auto const d = mpx_test::upload(exec, values);
      auto const got = mpx::stats(exec, d);
      auto const expected = reference_stats(values);
      INFO(mpx::dtype_name<T> << " n=" << n << "\n got      " << got << "\n expected " << expected);
      REQUIRE(got == expected);
      REQUIRE(expected.at_max > 0);
      REQUIRE(expected.subnormal > 0);
      auto const h = mpx::log2_histogram(exec, d);
      auto const h_expected = reference_histogram(values);
      REQUIRE(h.counts == h_expected.counts);
      REQUIRE(h.nan == h_expected.nan);
      REQUIRE(h.inf == h_expected.inf);
      REQUIRE(h.zero == h_expected.zero);
      REQUIRE(mpx::count_nonfinite(exec, d) == expected.nan + expected.inf);
    }
  };
  mpx_test::for_each_dtype_in<mpx_test::dtypes8>(for_type);
  // Pattern by pattern: e4m3's 448 is finite, S.1111.111 its only non-finite value.
  auto const e4 = mpx_test::upload(exec, std::vector<mpx::float8_e4m3>{mpx::dtype_traits<mpx::float8_e4m3>::max(),
                                                                       mpx::dtype_traits<mpx::float8_e4m3>::lowest()});
  CHECK(mpx::all_finite(exec, e4));
  auto const h = mpx::log2_histogram(exec, e4);
  CHECK(h.count(8) == 2);  // 448 = 1.75 * 2^8
}

TEMPLATE_LIST_TEST_CASE("stats tell an e4m3 overflow (NaN from cast) from a saturation (448 from saturate_cast)",
                        "[numerics][fp8]", mpx_test::executors) {
  TestType exec;
  std::vector<float> const activations = {1.0f, 1000.0f, -1e6f, 3.0f, 448.0f, 460.0f, 0.001f, NAN, INFINITY, -0.0f};
  auto const in = mpx_test::upload(exec, activations);
  auto check = [&](auto tag, bool saturate, std::size_t nan, std::size_t inf, std::size_t at_max, float absmax) {
    using T = decltype(tag);
    auto out = mpx::make_tensor<T>(exec, in.shape());
    if (saturate) mpx::transform(exec, out, saturate_into<T>{}, in);
    else mpx::cast(exec, in, out);
    auto const s = mpx::stats(exec, out);
    INFO(mpx::dtype_name<T> << (saturate ? " saturate_cast: " : " cast: ") << s);
    CHECK(s.size == activations.size());
    CHECK(s.nan == nan);
    CHECK(s.inf == inf);
    CHECK(s.at_max == at_max);
    CHECK(s.zero == 1);
    CHECK(s.absmax == absmax);
    CHECK(mpx::count_nonfinite(exec, out) == nan + inf);
    CHECK(mpx::to_string(s).ends_with(" at_max=" + std::to_string(at_max)));
  };
  // e4m3: 1000, -1e6 and inf overflow to NaN; 448 and 460 round to 448.
  check(mpx::float8_e4m3{}, false, 4, 0, 2, 448.0f);
  check(mpx::float8_e4m3{}, true, 1, 0, 5, 448.0f);
  // e5m2 has infinities: -1e6 and inf are ±inf after a cast, ±57344 after saturate_cast;
  // 1000 is 1024 in it.
  check(mpx::float8_e5m2{}, false, 1, 2, 0, 1024.0f);
  check(mpx::float8_e5m2{}, true, 1, 0, 2, 57344.0f);
}

TEST_CASE("find_nonfinite's explanation reads an fp8 tensor's range from its traits", "[numerics][fp8]") {
  CHECK(mpx::detail::largest_finite_text(mpx::dtype_id::float16) == "65504");
  CHECK(mpx::detail::largest_finite_text(mpx::dtype_id::bfloat16) == "3.4e38");
  CHECK(mpx::detail::largest_finite_text(mpx::dtype_id::float32) == "3.4e38");
  CHECK(mpx::detail::largest_finite_text(mpx::dtype_id::float8_e4m3) == "448");
  CHECK(mpx::detail::largest_finite_text(mpx::dtype_id::float8_e5m2) == "57344");
  mpx::numerics_stats s;
  s.size = 64;
  s.nan = 3;
  s.at_max = 2;
  s.absmax = 448;
  mpx::nonfinite_finding f{"dense", "Dense", "some_policy", "forward", "output", mpx::dtype_id::float8_e4m3, s, {}, true};
  auto const why = f.explanation();
  INFO(why);
  CHECK_THAT(why, Catch::Contains("float8_e4m3fn's largest finite value (448)") && Catch::Contains("an overflow") &&
                      Catch::Contains("has no infinity") && Catch::Contains("2 values sit at ±448"));
  f.pass = "backward";
  CHECK_THAT(f.explanation(), Catch::Contains("the loss scale is too large") && Catch::Contains("float8_e4m3fn"));
  // A NaN in a format with infinity is still an invalid operation, not an overflow.
  f.pass = "forward";
  f.dtype = mpx::dtype_id::float8_e5m2;
  CHECK_THAT(f.explanation(), Catch::Contains("invalid operation") && !Catch::Contains("an overflow"));
  s.nan = 0;
  s.inf = 1;
  f.stats = s;
  CHECK_THAT(f.explanation(), Catch::Contains("float8_e5m2's largest finite value (57344)") &&
                                  !Catch::Contains("has no infinity"));
}
