// Dropout: Philox4x32-10 against Random123's known-answer vectors; forward and backward
// for every dtype on each executor, the mask compared bit for bit with the host's
// generator (so on the GPU this shows host and device draw the same mask); the kept
// share within a binomial bound; reproducibility from (seed, offset); rate 0 and 1.
#include "../support/nn_reference.hpp"

#include <cmath>

namespace {

std::vector<std::size_t> dropout_sizes() { return {0, 1, 2, 3, 7, 33, 1000, 4099, 65537}; }

template <class Exec>
std::vector<std::uint8_t> mask_of(Exec const& exec, mpx::dropout_options const& o, std::size_t n) {
  auto x = mpx_test::upload(exec, std::vector<float>(n, 1.0f));
  auto y = mpx::make_tensor<float>(exec, mpx::shape{static_cast<std::int64_t>(n)});
  auto m = mpx_test::upload(exec, std::vector<std::uint8_t>(n, 0x5A));
  mpx::dropout_forward(exec, o, x, y, m);
  return mpx_test::download(exec, m);
}

}  // namespace

TEST_CASE("philox4x32_10 matches Random123's known-answer vectors", "[dropout]") {
  struct kat {
    mpx::philox_counter ctr;
    mpx::philox_key key;
    std::uint32_t expected[4];
  };
  // Random123 kat_vectors, philox4x32 with 10 rounds.
  kat const kats[] = {
      {{{0, 0, 0, 0}}, {{0, 0}}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}}, {{0xffffffff, 0xffffffff}},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}}, {{0xa4093822, 0x299f31d0}},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (auto const& k : kats) {
    auto const r = mpx::philox4x32_10(k.ctr, k.key);
    for (int i = 0; i < 4; ++i) {
      INFO("word " << i);
      CHECK(r.v[i] == k.expected[i]);
    }
  }
  // Usable in constant expressions too.
  static_assert(mpx::philox4x32_10({{0, 0, 0, 0}}, {{0, 0}}).v[0] == 0x6627e8d5u);
}

TEMPLATE_LIST_TEST_CASE("dropout keeps 1 - rate of the elements, scaled, with the host's mask", "[dropout]",
                        mpx_test::executors) {
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (float rate : {0.1f, 0.5f, 0.9f}) {
      mpx::dropout_options const o{rate, 0x1234'5678'9ABC'DEF0ull, 7};
      float const scale = 1.0f / (1.0f - rate);
      for (std::size_t n : dropout_sizes()) {
        mpx::shape const s{static_cast<std::int64_t>(n)};
        auto const x = mpx_test::random_values<T>(n, -4, 4, 81 + n);
        auto const dy = mpx_test::random_values<T>(n, -4, 4, 82 + n);
        auto const xd = mpx_test::upload(exec, x, s);
        auto const dyd = mpx_test::upload(exec, dy, s);
        auto y = mpx::make_tensor<T>(exec, s);
        auto y2 = mpx::make_tensor<T>(exec, s);
        auto dx = mpx::make_tensor<T>(exec, s);
        auto dx2 = mpx::make_tensor<T>(exec, s);
        mpx::fill(exec, y, mpx_test::poison<T>());
        mpx::fill(exec, y2, mpx_test::poison<T>());
        mpx::fill(exec, dx, mpx_test::poison<T>());
        mpx::fill(exec, dx2, mpx_test::poison<T>());
        auto mask = mpx_test::upload(exec, std::vector<std::uint8_t>(n, 0x5A), s);
        mpx::dropout_forward(exec, o, xd, y, mask);
        mpx::dropout_forward(exec, o, xd, y2);
        mpx::dropout_backward(exec, o, dyd, dx, mask);
        mpx::dropout_backward(exec, o, dyd, dx2);
        auto const got_y = mpx_test::download(exec, y);
        auto const got_m = mpx_test::download(exec, mask);
        auto const got_dx = mpx_test::download(exec, dx);
        INFO(mpx::dtype_name<T> << " rate=" << rate << " n=" << n);
        std::vector<T> want_y(n), want_dx(n);
        std::size_t kept = 0, mask_bad = 0;
        for (std::size_t i = 0; i < n; ++i) {
          bool const k = mpx::dropout_keeps(o, i);
          kept += k;
          if (got_m[i] != (k ? 1 : 0)) ++mask_bad;
          want_y[i] = mpx::cast<T>(mpx::cast<float>(x[i]) * (k ? scale : 0.0f));
          want_dx[i] = mpx::cast<T>(mpx::cast<float>(dy[i]) * (k ? scale : 0.0f));
        }
        REQUIRE(mask_bad == 0);
        REQUIRE(mpx_test::first_mismatch(got_y, want_y).empty());
        REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, y2), want_y).empty());
        REQUIRE(mpx_test::first_mismatch(got_dx, want_dx).empty());
        REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, dx2), want_dx).empty());
        // Binomial: |kept - n p| <= 6 sigma + 1 (fails by chance with probability ~1e-9).
        double const p = 1.0 - static_cast<double>(rate);
        double const nd = static_cast<double>(n);
        INFO("kept " << kept << " of " << n);
        REQUIRE(std::fabs(static_cast<double>(kept) - nd * p) <= 6 * std::sqrt(nd * p * (1 - p)) + 1);
      }
    }
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("dropout is reproducible from its seed and offset", "[dropout]", mpx_test::executors) {
  TestType exec;
  std::size_t const n = 4099;
  mpx::dropout_options const a{0.5f, 42, 0};
  auto const m1 = mask_of(exec, a, n);
  auto const m2 = mask_of(exec, a, n);
  REQUIRE(m1 == m2);
  mpx::dropout_options b = a;
  b.seed = 43;
  REQUIRE(mask_of(exec, b, n) != m1);
  mpx::dropout_options c = a;
  c.offset = 1;
  REQUIRE(mask_of(exec, c, n) != m1);
  // The seed's upper half matters too.
  mpx::dropout_options d = a;
  d.seed = a.seed | (1ull << 40);
  REQUIRE(mask_of(exec, d, n) != m1);

  // A step count read where the kernel runs is added to the offset: offset 5 plus a
  // count of 2, advanced once to 3, draws what offset 8 draws (the upper 32 bits too).
  auto step = mpx_test::upload(exec, std::vector<std::uint64_t>{2}, {1});
  mpx::advance_dropout_step(exec, mpx::view(step));
  mpx::dropout_options counted{0.5f, 42, 5, step.data()};
  mpx::dropout_options fixed{0.5f, 42, 8};
  CHECK(mask_of(exec, counted, n) == mask_of(exec, fixed, n));
  auto const high = mpx_test::upload(exec, std::vector<std::uint64_t>{0xFFFF'FFFFull}, {1});
  counted.offset_step = high.data();
  counted.offset = 1;
  fixed.offset = 0x1'0000'0000ull;
  CHECK(mask_of(exec, counted, n) == mask_of(exec, fixed, n));
  CHECK_THROWS_TYPE_WITH(mpx::dropout_keeps(counted, 0), mpx::invalid_argument, Catch::Contains("offset_step"));
}

TEMPLATE_LIST_TEST_CASE("dropout with rate 0 is the identity; rate 1 and out-of-range rates are refused",
                        "[dropout]", mpx_test::executors) {
  using Catch::Matchers::Contains;
  TestType exec;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    std::size_t const n = 1000;
    auto const x = mpx_test::random_values<T>(n, -100, 100, 91);
    auto const xd = mpx_test::upload(exec, x);
    auto y = mpx::make_tensor<T>(exec, mpx::shape{1000});
    mpx::fill(exec, y, mpx_test::poison<T>());
    mpx::dropout_forward(exec, mpx::dropout_options{0.0f, 5, 0}, xd, y);
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, y), x).empty());
    for (float bad : {1.0f, -0.1f, 1.5f, NAN})
      CHECK_THROWS_TYPE_WITH(mpx::dropout_forward(exec, mpx::dropout_options{bad, 5, 0}, xd, y),
                             mpx::invalid_argument, Contains("rate must be in [0, 1)"));
  };
  mpx_test::for_each_dtype(for_type);
}

TEMPLATE_LIST_TEST_CASE("dropout keeps a NaN NaN, kept or dropped, and refuses mismatched shapes", "[dropout]",
                        mpx_test::executors) {
  using Catch::Matchers::Contains;
  TestType exec;
  std::size_t const n = 64;
  auto const xd = mpx_test::upload(exec, std::vector<float>(n, NAN));
  auto y = mpx::make_tensor<float>(exec, mpx::shape{64});
  mpx::fill(exec, y, 0.0f);
  mpx::dropout_forward(exec, mpx::dropout_options{0.5f, 9, 0}, xd, y);
  for (float v : mpx_test::download(exec, y)) REQUIRE(std::isnan(v));

  auto x2 = mpx::make_tensor<float>(exec, {3, 4});
  auto y2 = mpx::make_tensor<float>(exec, {4, 3});
  auto m2 = mpx::make_tensor<std::uint8_t>(exec, {2, 6});
  auto y3 = mpx::make_tensor<float>(exec, {3, 4});
  CHECK_THROWS_TYPE_WITH(mpx::dropout_forward(exec, mpx::dropout_options{}, x2, y2), mpx::shape_error,
                         Contains("[3, 4]") && Contains("[4, 3]"));
  CHECK_THROWS_TYPE_WITH(mpx::dropout_forward(exec, mpx::dropout_options{}, x2, y3, m2), mpx::shape_error,
                         Contains("[3, 4]") && Contains("[2, 6]"));
  CHECK_THROWS_TYPE_WITH(mpx::dropout_backward(exec, mpx::dropout_options{}, x2, y2), mpx::shape_error,
                         Contains("[3, 4]") && Contains("[4, 3]"));
  CHECK_THROWS_TYPE_WITH(mpx::dropout_backward(exec, mpx::dropout_options{}, x2, y3, m2), mpx::shape_error,
                         Contains("[3, 4]") && Contains("[2, 6]"));

  // In place, or not overlapping at all (a shifted output was accepted: the API fuzzer).
  auto buffer = mpx::make_tensor<float>(exec, {32});
  mpx::fill(exec, buffer, 1.0f);
  auto const at = [&](std::int64_t offset) {
    auto v = mpx::view(buffer);
    return decltype(v)(v.data() + offset, mpx::shape{3, 4});
  };
  mpx::dropout_forward(exec, mpx::dropout_options{}, at(0), at(0));
  CHECK_THROWS_TYPE_WITH(mpx::dropout_forward(exec, mpx::dropout_options{}, at(0), at(1)), mpx::invalid_argument,
                         Contains("y and x overlap"));
  CHECK_THROWS_TYPE_WITH(mpx::dropout_backward(exec, mpx::dropout_options{}, at(3), at(0)), mpx::invalid_argument,
                         Contains("dx and dy overlap"));
}
