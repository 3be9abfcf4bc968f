// Embeddings (kernels/embedding.hpp, layers/embedding.hpp): the lookup with and without
// position embeddings, the deterministic scatter-add of the table's gradient and the
// position gradient, for every dtype on each executor against float64 references on
// awkward sizes with repeated ids, outputs poisoned first; out-of-range ids refused on
// the host and flagged on the GPU; the layer's parameters and shapes.
#include "../support/exact_values.hpp"
#include "../support/nn_reference.hpp"

#include <mpx/layers/embedding.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace {

static_assert(mpx::layer<mpx::embedding<mpx::float32>>);

struct embedding_case {
  std::size_t vocab, width, batch, sequence;
};

// One-row tables, widths around the 128-column tiles, more tokens than the 1024-id
// tiles, and vocabularies smaller than the token count (every id repeats).
std::vector<embedding_case> embedding_cases() {
  return {{1, 1, 1, 1}, {1, 7, 3, 5}, {7, 1, 2, 9}, {7, 33, 4, 31}, {300, 7, 1, 1000},
          {256, 130, 3, 700}, {5, 128, 17, 64}, {2, 129, 1, 2050}};
}

std::vector<std::int32_t> random_ids(std::size_t n, std::size_t vocab, std::uint64_t stream) {
  std::mt19937_64 gen(mpx_test::seed + stream);
  // Half the ids from the first three rows, so rows repeat even in a large vocabulary.
  std::uniform_int_distribution<std::size_t> any(0, vocab - 1), few(0, std::min<std::size_t>(vocab, 3) - 1);
  std::vector<std::int32_t> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<std::int32_t>(i % 2 ? any(gen) : few(gen));
  return out;
}

// Multiples of 1/16 in [-2, 2]: exact in every dtype, and every float sum below exact.
template <class T>
std::vector<T> sixteenths(std::size_t n, std::uint64_t stream) {
  return mpx_test::random_multiples<T>(n, 32, 16, stream);
}

mpx::shape ids_shape(embedding_case const& c) {
  return {static_cast<std::int64_t>(c.batch), static_cast<std::int64_t>(c.sequence)};
}
mpx::shape rows_shape(embedding_case const& c) {
  return {static_cast<std::int64_t>(c.batch), static_cast<std::int64_t>(c.sequence),
          static_cast<std::int64_t>(c.width)};
}

// float64 references.
std::vector<double> lookup_reference(std::vector<std::int32_t> const& ids, std::vector<double> const& table,
                                     std::vector<double> const* positions, embedding_case const& c) {
  std::vector<double> y(ids.size() * c.width);
  for (std::size_t n = 0; n < ids.size(); ++n)
    for (std::size_t d = 0; d < c.width; ++d)
      y[n * c.width + d] = table[static_cast<std::size_t>(ids[n]) * c.width + d] +
                           (positions ? (*positions)[(n % c.sequence) * c.width + d] : 0.0);
  return y;
}
std::vector<double> scatter_reference(std::vector<std::int32_t> const& ids, std::vector<double> const& dy,
                                      embedding_case const& c) {
  std::vector<double> dw(c.vocab * c.width, 0.0);
  for (std::size_t n = 0; n < ids.size(); ++n)
    for (std::size_t d = 0; d < c.width; ++d) dw[static_cast<std::size_t>(ids[n]) * c.width + d] += dy[n * c.width + d];
  return dw;
}

template <class T>
std::vector<T> rounded_to(std::vector<double> const& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = mpx::cast<T>(v[i]);
  return out;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("embedding lookups, with and without positions, match float64", "[embedding]",
                        mpx_test::executors) {
  TestType exec;
  mpx_test::for_each_dtype([&](auto tag) {
    using T = decltype(tag);
    for (auto const& c : embedding_cases()) {
      std::size_t const tokens = c.batch * c.sequence;
      std::size_t const context = c.sequence + 3;  // more positions than used
      auto const ids = random_ids(tokens, c.vocab, 1 + tokens);
      auto const table = mpx_test::random_values<T>(c.vocab * c.width, -2, 2, 2 + tokens);
      auto const pos = mpx_test::random_values<T>(context * c.width, -1, 1, 3 + tokens);
      auto const ids_d = mpx_test::upload(exec, ids, ids_shape(c));
      auto const table_d =
          mpx_test::upload(exec, table, {static_cast<std::int64_t>(c.vocab), static_cast<std::int64_t>(c.width)});
      auto const pos_d =
          mpx_test::upload(exec, pos, {static_cast<std::int64_t>(context), static_cast<std::int64_t>(c.width)});
      auto y = mpx_test::poisoned<T>(exec, rows_shape(c));
      auto yp = mpx_test::poisoned<T>(exec, rows_shape(c));
      mpx::embedding_forward(exec, ids_d, table_d, y);
      mpx::embedding_forward(exec, ids_d, table_d, pos_d, yp);
      auto const wt = mpx_test::widen(table);
      auto const wp = mpx_test::widen(pos);
      INFO(mpx::dtype_name<T> << " vocab=" << c.vocab << " width=" << c.width << " batch=" << c.batch
                              << " sequence=" << c.sequence);
      // Without positions the rows are copied exactly.
      REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, y), rounded_to<T>(lookup_reference(ids, wt, nullptr, c)))
                  .empty());
      // With them: one float addition, rounded once to T.
      auto const ref = lookup_reference(ids, wt, &wp, c);
      auto const got = mpx_test::download(exec, yp);
      mpx_test::bound_checker check(std::string("embedding + positions ") + std::string(mpx::dtype_name<T>));
      for (std::size_t i = 0; i < ref.size(); ++i)
        check.check(i, mpx_test::to_d(got[i]), ref[i],
                    (mpx_test::unit_roundoff<T>() + mpx_test::uf) * std::fabs(ref[i]) + mpx_test::min_subnormal<T>());
      MPX_REQUIRE_WITHIN(check);
    }
  });
}

TEMPLATE_LIST_TEST_CASE("the embedding gradients are exact scatter-adds and column sums, every row written",
                        "[embedding]", mpx_test::executors) {
  TestType exec;
  mpx_test::for_each_dtype([&](auto tag) {
    using T = decltype(tag);
    for (auto const& c : embedding_cases()) {
      std::size_t const tokens = c.batch * c.sequence;
      std::size_t const context = c.sequence + 2;
      auto const ids = random_ids(tokens, c.vocab, 11 + tokens);
      auto const dy = sixteenths<T>(tokens * c.width, 12 + tokens);
      auto const ids_d = mpx_test::upload(exec, ids, ids_shape(c));
      auto const dy_d = mpx_test::upload(exec, dy, rows_shape(c));
      auto dw = mpx_test::poisoned<T>(exec, {static_cast<std::int64_t>(c.vocab), static_cast<std::int64_t>(c.width)});
      auto dp = mpx_test::poisoned<T>(exec, {static_cast<std::int64_t>(context), static_cast<std::int64_t>(c.width)});
      mpx::embedding_backward(exec, ids_d, dy_d, dw);
      mpx::position_embedding_backward(exec, dy_d, dp);
      auto const wdy = mpx_test::widen(dy);
      auto const ref_dw = scatter_reference(ids, wdy, c);
      std::vector<double> ref_dp(context * c.width, 0.0);
      for (std::size_t n = 0; n < tokens; ++n)
        for (std::size_t d = 0; d < c.width; ++d) ref_dp[(n % c.sequence) * c.width + d] += wdy[n * c.width + d];
      bool nonzero = false;
      for (double v : ref_dw) nonzero |= v != 0;
      INFO(mpx::dtype_name<T> << " vocab=" << c.vocab << " width=" << c.width << " batch=" << c.batch
                              << " sequence=" << c.sequence);
      REQUIRE(nonzero);
      // The float sums are exact (multiples of 1/16 below 2^13): one rounding, to T.
      REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, dw), rounded_to<T>(ref_dw)).empty());
      REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, dp), rounded_to<T>(ref_dp)).empty());
    }
  });
}

TEMPLATE_LIST_TEST_CASE("the table's gradient has the same bits on every executor and every run", "[embedding]",
                        mpx_test::executors) {
  TestType exec;
  mpx::host_executor host;
  for (auto const& c : embedding_cases()) {
    std::size_t const tokens = c.batch * c.sequence;
    auto const ids = random_ids(tokens, c.vocab, 21 + tokens);
    auto const dy = mpx_test::random_values<mpx::bfloat16>(tokens * c.width, -3, 3, 22 + tokens);  // sums round
    mpx::shape const dw_shape{static_cast<std::int64_t>(c.vocab), static_cast<std::int64_t>(c.width)};
    auto const ids_d = mpx_test::upload(exec, ids, ids_shape(c));
    auto const dy_d = mpx_test::upload(exec, dy, rows_shape(c));
    auto dw = mpx_test::poisoned<float>(exec, dw_shape);
    auto again = mpx_test::poisoned<float>(exec, dw_shape);
    mpx::embedding_backward(exec, ids_d, dy_d, dw);
    mpx::embedding_backward(exec, ids_d, dy_d, again);
    auto const got = mpx_test::download(exec, dw);
    // The float64 reference decides within float's rounding of a token-order sum.
    auto const ref = scatter_reference(ids, mpx_test::widen(dy), c);
    std::vector<double> abs_dy(dy.size());
    for (std::size_t i = 0; i < dy.size(); ++i) abs_dy[i] = std::fabs(mpx_test::to_d(dy[i]));
    auto const abs_ref = scatter_reference(ids, abs_dy, c);
    mpx_test::bound_checker check("embedding gradient");
    for (std::size_t i = 0; i < ref.size(); ++i)
      check.check(i, got[i], ref[i], static_cast<double>(tokens) * mpx_test::uf * abs_ref[i]);
    INFO("vocab=" << c.vocab << " width=" << c.width << " tokens=" << tokens);
    MPX_REQUIRE_WITHIN(check);
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(exec, again), got).empty());
    // The host's loop and the GPU's threads add in the same (token) order.
    auto const ids_h = mpx_test::upload(host, ids, ids_shape(c));
    auto const dy_h = mpx_test::upload(host, dy, rows_shape(c));
    auto dw_h = mpx_test::poisoned<float>(host, dw_shape);
    mpx::embedding_backward(host, ids_h, dy_h, dw_h);
    REQUIRE(mpx_test::first_mismatch(mpx_test::download(host, dw_h), got).empty());
  }
}

TEMPLATE_LIST_TEST_CASE("an id outside the vocabulary is an error on the host and a flag on the GPU", "[embedding]",
                        mpx_test::executors) {
  TestType exec;
  std::vector<std::int32_t> const ids = {0, 2, 5, 1, -1, 3};
  auto const ids_d = mpx_test::upload(exec, ids, {2, 3});
  auto const table = mpx_test::upload(exec, mpx_test::random_values<float>(4 * 3, -1, 1, 31), {4, 3});
  auto y = mpx_test::poisoned<float>(exec, {2, 3, 3});
  auto dw = mpx_test::poisoned<float>(exec, {4, 3});
  auto const dy = mpx_test::upload(exec, std::vector<float>(18, 1.0f), {2, 3, 3});
  if constexpr (mpx::is_host_executor_v<TestType>) {
    CHECK_THROWS_TYPE_WITH(mpx::embedding_forward(exec, ids_d, table, y), mpx::invalid_argument,
                           Catch::Contains("token id 5 at position 2") && Catch::Contains("[0, 4)"));
    CHECK_THROWS_TYPE_WITH(mpx::embedding_backward(exec, ids_d, dy, dw), mpx::invalid_argument,
                           Catch::Contains("token id 5"));
  } else {
    auto flag = mpx_test::upload(exec, std::vector<int>{0});
    mpx::embedding_forward(exec, ids_d, table, y, flag.data());
    CHECK(mpx_test::download(exec, flag)[0] == 1);
    auto const got = mpx_test::download(exec, y);
    for (std::size_t d = 0; d < 3; ++d) {
      CHECK(got[2 * 3 + d] == 0.0f);  // id 5
      CHECK(got[4 * 3 + d] == 0.0f);  // id -1
    }
    mpx::embedding_backward(exec, ids_d, dy, dw);  // the bad ids add to no row
    auto const g = mpx_test::download(exec, dw);
    CHECK(g[0] == 1.0f);  // id 0 once
    CHECK(g[3 * 3] == 1.0f);  // id 3 once
  }
  auto wrong = mpx::make_tensor<float>(exec, {2, 3, 4});
  CHECK_THROWS_TYPE_WITH(mpx::embedding_forward(exec, ids_d, table, wrong), mpx::shape_error,
                         Catch::Contains("[2, 3, 4]") && Catch::Contains("[4, 3]"));
  auto short_positions = mpx::make_tensor<float>(exec, {2, 3});
  CHECK_THROWS_TYPE_WITH(mpx::embedding_forward(exec, ids_d, table, short_positions, y), mpx::shape_error,
                         Catch::Contains("context >= the sequence length 3"));
}

TEMPLATE_LIST_TEST_CASE("the embedding layer: parameters, forward, backward and bad ids", "[embedding][layers]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  using P = mpx::mixed_bfloat16;
  using T = P::storage_type;
  std::size_t const vocab = 11, width = 6, sequence = 5, batch = 3;
  mpx::embedding<P> layer(vocab, width, 8);
  layer.set_name("embedding");
  CHECK_THROWS_AS(layer.compute_output_shape(mpx::shape{9}), mpx::shape_error);  // longer than the context
  layer.build(exec, mpx::shape{static_cast<std::int64_t>(sequence)}, 7);
  layer.reserve(exec, batch);
  CHECK(layer.output_shape() == mpx::shape{5, 6});
  CHECK(layer.parameter_count() == (vocab + 8) * width);
  std::vector<mpx::parameter<Space>> params;
  layer.append_parameters(params);
  REQUIRE(params.size() == 2);
  CHECK(params[0].name == "embedding/embeddings");
  CHECK(params[1].name == "embedding/positions");

  auto const ids = random_ids(batch * sequence, vocab, 41);
  auto const ids_d = mpx_test::upload(exec, ids, {static_cast<std::int64_t>(batch), static_cast<std::int64_t>(sequence)});
  mpx::shape const ys{static_cast<std::int64_t>(batch), static_cast<std::int64_t>(sequence),
                      static_cast<std::int64_t>(width)};
  auto y = mpx_test::poisoned<T>(exec, ys);
  layer.forward(exec, mpx::tensor_view<std::int32_t const, Space>(ids_d.view()), y.view(), true);
  auto const table = mpx_test::widen(mpx_test::download(exec, layer.template embeddings<Space>()));
  auto const pos = mpx_test::widen(mpx_test::download(exec, layer.template positions<Space>()));
  bool initialised = false;
  for (double v : table) initialised |= v != 0 && std::fabs(v) <= 0.05;
  CHECK(initialised);
  embedding_case const c{vocab, width, batch, sequence};
  auto const ref = lookup_reference(ids, table, &pos, c);
  auto const got = mpx_test::download(exec, y);
  mpx_test::bound_checker check("embedding layer forward");
  for (std::size_t i = 0; i < ref.size(); ++i)
    check.check(i, mpx_test::to_d(got[i]), ref[i], mpx_test::unit_roundoff<T>() * std::fabs(ref[i]) + 1e-30);
  MPX_REQUIRE_WITHIN(check);

  auto const dy = sixteenths<T>(batch * sequence * width, 42);
  auto const dy_d = mpx_test::upload(exec, dy, ys);
  layer.backward(exec, mpx::tensor_view<std::int32_t const, Space>(ids_d.view()),
                 mpx::tensor_view<T const, Space>(y.view()), mpx::tensor_view<T const, Space>(dy_d.view()),
                 mpx::tensor_view<std::int32_t, Space>{});
  auto const dw = mpx_test::download(exec, layer.template embeddings_gradient<Space>());
  CHECK(mpx_test::first_mismatch(dw, rounded_to<T>(scatter_reference(ids, mpx_test::widen(dy), c))).empty());
  auto const dp = mpx_test::download(exec, layer.template positions_gradient<Space>());
  std::vector<double> ref_dp(8 * width, 0.0);
  for (std::size_t n = 0; n < batch * sequence; ++n)
    for (std::size_t d = 0; d < width; ++d) ref_dp[(n % sequence) * width + d] += mpx_test::to_d(dy[n * width + d]);
  CHECK(mpx_test::first_mismatch(dp, rounded_to<T>(ref_dp)).empty());

  CHECK_FALSE(layer.ids_out_of_range(exec));
  auto const bad = mpx_test::upload(exec, std::vector<std::int32_t>(batch * sequence, 11),
                                    {static_cast<std::int64_t>(batch), static_cast<std::int64_t>(sequence)});
  if constexpr (mpx::is_host_executor_v<TestType>) {
    mpx::tensor_view<std::int32_t const, Space> const bad_ids(bad.view());
    CHECK_THROWS_TYPE_WITH(layer.forward(exec, bad_ids, y.view(), true), mpx::invalid_argument,
                           Catch::Contains("embedding") && Catch::Contains("token id 11"));
  } else {
    layer.forward(exec, mpx::tensor_view<std::int32_t const, Space>(bad.view()), y.view(), true);
    CHECK(layer.ids_out_of_range(exec, true));
    CHECK_FALSE(layer.ids_out_of_range(exec));
  }
}

// (model.summary() does not compile yet for a model whose input is int32: it names the
// dtype of an inserted cast with mpx::dtype_name, which knows only floating dtypes.)
TEST_CASE("an embedding starts a sequential model: forward and backward", "[embedding][layers]") {
  mpx::host_executor exec;
  auto model = mpx::sequential<mpx::mixed_float16>(mpx::embedding<>(13, 8, 6), mpx::flatten<>(),
                                                   mpx::dense<>(5, mpx::activation::gelu_tanh));
  model.build(exec, mpx::shape{6}, 3);
  model.reserve(exec, 2);
  CHECK(model.parameter_count() == (13 + 6) * 8 + 6 * 8 * 5 + 5);
  auto const ids = mpx_test::upload(exec, random_ids(12, 13, 51), {2, 6});
  auto const out = model.forward(exec, mpx::tensor_view<std::int32_t const>(ids.view()), true);
  REQUIRE(out.shape() == mpx::shape{2, 5});
  auto const dy = mpx_test::upload(exec, std::vector<mpx::half>(10, mpx::cast<mpx::half>(0.5f)), {2, 5});
  model.backward(exec, mpx::tensor_view<mpx::half const>(dy.view()));
  bool some = false;
  for (auto const& p : model.parameters(exec)) {
    if (p.name != "embedding/embeddings") continue;
    for (auto g : mpx_test::download(exec, p.gradient.template as<mpx::half>())) some |= mpx::cast<float>(g) != 0;
  }
  CHECK(some);
}
