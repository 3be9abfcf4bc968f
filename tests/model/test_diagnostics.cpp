// Model diagnostics on each executor: find_nonfinite names the layer and tensor where a
// NaN or inf first appears (an overflowing forward, NaN from finite numbers, non-finite
// data, an overflowing backward), and probe_loss_scales shows float16 gradients that
// underflow at scale 1, survive a larger scale and overflow a too large one.
#include "../support/testing.hpp"

#include <mpx/layers/attention.hpp>
#include <mpx/layers/dense.hpp>
#include <mpx/layers/softmax_layer.hpp>
#include <mpx/model/diagnostics.hpp>
#include <mpx/model/sequential.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

template <class Exec, class T>
void set_values(Exec const& exec, mpx::tensor_view<T, mpx::memory_space_t<Exec>> dst, std::vector<float> const& values) {
  std::vector<T> typed(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) typed[i] = mpx::cast<T>(values[i]);
  mpx::copy(exec, mpx::tensor_view<T const, mpx::host_space>(typed.data(), dst.shape()), dst);
  exec.synchronize();
}

// A custom layer that computes x / x: 1, or NaN where x is 0 (as a layer that divides by
// a value that can be 0 does). It is built from mpx::transform, so it runs on either
// executor.
struct self_ratio_op {
  template <class T>
  MPX_HD T operator()(T x) const noexcept {
    return mpx::cast<T>(mpx::cast<float>(x) / mpx::cast<float>(x));
  }
};

template <class Policy>
class self_ratio : public mpx::layer_base {
 public:
  using policy = Policy;
  using input_type = typename Policy::storage_type;
  using output_type = typename Policy::storage_type;
  static constexpr std::string_view kind = "SelfRatio";

  [[nodiscard]] mpx::shape compute_output_shape(mpx::shape const& in) const { return in; }
  template <mpx::executor Exec>
  void build(Exec const&, mpx::shape const& in, std::uint64_t) {
    mark_built(in, in);
  }
  template <mpx::executor Exec>
  void reserve(Exec const&, std::int64_t batch) {
    reserved_batch_ = batch;
  }
  template <mpx::executor Exec, class Space = mpx::memory_space_t<Exec>>
  void forward(Exec const& exec, mpx::tensor_view<input_type const, Space> x, mpx::tensor_view<output_type, Space> y,
               bool) {
    check_input(x.shape(), y.shape());
    mpx::transform(exec, y, self_ratio_op{}, x);
  }
  template <mpx::executor Exec, class Space = mpx::memory_space_t<Exec>>
  void backward(Exec const& exec, mpx::tensor_view<input_type const, Space> x, mpx::tensor_view<output_type const, Space> y,
                mpx::tensor_view<output_type const, Space>, mpx::tensor_view<input_type, Space> dx) {
    check_input(x.shape(), y.shape());
    if (dx.data() != nullptr) mpx::fill(exec, dx, mpx::cast<input_type>(0.0f));  // x / x is constant
  }
  template <mpx::memory_space Space>
  void append_parameters(std::vector<mpx::parameter<Space>>&) {}
  [[nodiscard]] std::size_t parameter_count() const noexcept { return 0; }
};

}  // namespace

TEMPLATE_LIST_TEST_CASE("find_nonfinite names the layer and tensor where NaN or inf first appears", "[model][diagnostics]",
                        mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  std::int64_t const n = 16;

  SECTION("a float16 output that overflows from finite inputs") {
    auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(4, mpx::activation::relu), mpx::dense<>(3),
                                                     mpx::softmax_layer<mpx::float32>());
    model.build(exec, {5}, 1);
    set_values(exec, model.template layer<0>().template kernel<space>(), std::vector<float>(20, 100.0f));
    auto x = mpx_test::upload(exec, std::vector<float>(n * 5, 200.0f), {n, 5});  // 5 x 200 x 100 = 1e5 > 65504
    model.forward(exec, mpx::tensor_view<float const, space>(mpx::view(x)), false);
    auto const f = mpx::find_nonfinite(exec, model);
    REQUIRE(f);
    CHECK(f->layer == "dense");
    CHECK(f->kind == "Dense");
    CHECK(f->policy == "mixed_float16");
    CHECK(f->pass == "forward");
    CHECK(f->tensor == "output");
    CHECK(f->dtype == mpx::dtype_id::float16);
    CHECK(f->stats.inf == static_cast<std::size_t>(n * 4));
    CHECK(f->read_stats.absmax == 200.0f);
    auto const why = f->explanation();
    INFO(why);
    CHECK_THAT(why, Catch::Contains("dense (Dense, mixed_float16): its forward pass wrote 0 NaN and 64 inf"));
    CHECK_THAT(why, Catch::Contains("an overflow") && Catch::Contains("65504"));
  }

  SECTION("NaN from finite numbers: a custom layer that divides 0 by 0") {
    auto model = mpx::sequential<mpx::float32>(mpx::dense<>(2, mpx::activation::relu), self_ratio<mpx::float32>());
    model.build(exec, {2}, 1);
    set_values(exec, model.template layer<0>().template kernel<space>(), {1.0f, -1.0f, 1.0f, -1.0f});
    auto x = mpx_test::upload(exec, std::vector<float>(n * 2, 1.0f), {n, 2});  // relu: (2, 0); then 2/2 and 0/0
    model.forward(exec, mpx::tensor_view<float const, space>(mpx::view(x)), false);
    auto const f = mpx::find_nonfinite(exec, model);
    REQUIRE(f);
    CHECK(f->layer == "self_ratio");
    CHECK(f->kind == "SelfRatio");
    CHECK(f->stats.nan == static_cast<std::size_t>(n));
    CHECK(f->read_stats.absmax == 2.0f);
    CHECK_THAT(f->explanation(), Catch::Contains("invalid operation"));
  }

  SECTION("float16 attention logits that overflow are named as such, with what to do") {
    std::int64_t const tokens = 8, width = 64;
    for (bool scaled : {false, true}) {
      auto model = mpx::sequential<mpx::mixed_float16>(mpx::causal_self_attention<>(1, scaled));
      model.build(exec, {tokens, width}, 4);
      auto x = mpx_test::upload(exec, mpx_test::random_values<float>(static_cast<std::size_t>(tokens * width), 200, 240, 3),
                                {1, tokens, width});  // large activations: unscaled, q·k passes 65504
      model.forward(exec, mpx::tensor_view<float const, space>(mpx::view(x)), false);
      auto const f = mpx::find_nonfinite(exec, model);
      INFO("scaled " << scaled);
      if (scaled) {
        CHECK_FALSE(f);
        continue;
      }
      REQUIRE(f);
      CHECK(f->kind == "MultiHeadAttention");
      CHECK(f->pass == "forward");
      CHECK_THAT(f->explanation(), Catch::Contains("logits q·kᵀ overflowing float16 (65504)") &&
                                       Catch::Contains("1/sqrt(head width)") && Catch::Contains("bfloat16") &&
                                       Catch::Contains("float32 policy"));
      CHECK_THAT(f->explanation(), !Catch::Contains("add an epsilon"));
    }
  }

  SECTION("weights an earlier update made infinite") {
    auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(3), mpx::dense<>(2));
    model.build(exec, {2}, 1);
    std::vector<float> w(6, 0.5f);
    w[4] = std::numeric_limits<float>::infinity();
    set_values(exec, model.template layer<1>().template kernel<space>(), w);
    auto x = mpx_test::upload(exec, std::vector<float>(n * 2, 1.0f), {n, 2});
    model.forward(exec, mpx::tensor_view<float const, space>(mpx::view(x)), false);
    auto const f = mpx::find_nonfinite(exec, model);
    REQUIRE(f);
    CHECK(f->layer == "dense_1");
    CHECK(f->tensor == "dense_1/kernel value");
    CHECK(f->stats.inf == 1);
    CHECK_THAT(f->explanation(), Catch::Contains("an earlier update wrote NaN or inf"));
  }

  SECTION("data that is not finite is named as the model's input") {
    auto model = mpx::sequential<mpx::mixed_bfloat16>(mpx::dense<>(3), mpx::dense<>(2));
    model.build(exec, {4}, 1);
    std::vector<float> xs(n * 4, 0.5f);
    xs[37] = std::nanf("");
    auto x = mpx_test::upload(exec, xs, {n, 4});
    model.forward(exec, mpx::tensor_view<float const, space>(mpx::view(x)), false);
    auto const f = mpx::find_nonfinite(exec, model);
    REQUIRE(f);
    CHECK(f->layer == "(model input)");
    CHECK(f->stats.nan == 1);
    CHECK_THAT(f->explanation(), Catch::Contains("data"));
  }

  SECTION("a backward pass whose float16 gradients overflow") {
    auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(4, mpx::activation::tanh), mpx::dense<>(3));
    model.build(exec, {5}, 2);
    auto x = mpx_test::upload(exec, mpx_test::random_values<float>(n * 5, -1, 1, 3), {n, 5});
    model.forward(exec, mpx::tensor_view<float const, space>(mpx::view(x)), true);
    CHECK_FALSE(mpx::find_nonfinite(exec, model));  // the forward pass is fine
    // dL/dy of 30000 everywhere, as a scaled loss gradient: 16 samples sum past 65504.
    auto dy = mpx_test::upload(exec, std::vector<float>(n * 3, 30000.0f), {n, 3});
    model.backward(exec, mpx::tensor_view<float const, space>(mpx::view(dy)));
    auto const f = mpx::find_nonfinite(exec, model);
    REQUIRE(f);
    CHECK(f->layer == "dense_1");
    CHECK(f->pass == "backward");
    CHECK(f->tensor == "dense_1/kernel gradient");
    CHECK_FALSE(f->read_known);  // backpropagation began at this layer
    CHECK_THAT(f->explanation(), Catch::Contains("the loss scale is too large"));
  }

  SECTION("a cast the model inserted overflows float16: forward and backward") {
    auto up = mpx::sequential(mpx::dense<mpx::float32>(2), mpx::dense<mpx::mixed_float16>(3));
    up.build(exec, {2}, 1);
    set_values(exec, up.template layer<0>().template kernel<space>(), std::vector<float>(4, 1e5f));
    auto x = mpx_test::upload(exec, std::vector<float>(n * 2, 1.0f), {n, 2});  // 2e5: finite in float
    up.forward(exec, mpx::tensor_view<float const, space>(mpx::view(x)), false);
    auto const f = mpx::find_nonfinite(exec, up);
    REQUIRE(f);
    CHECK(f->layer == "(cast to float16 for dense_1)");
    CHECK(f->pass == "forward");
    CHECK(f->read_stats.absmax == 2e5f);
    CHECK_THAT(f->explanation(), Catch::Contains("the cast the model inserted"));

    auto down = mpx::sequential(mpx::dense<mpx::mixed_float16>(3), mpx::dense<mpx::float32>(2));
    down.build(exec, {2}, 1);
    set_values(exec, down.template layer<1>().template kernel<space>(), std::vector<float>(6, 1.0f));
    auto small = mpx_test::upload(exec, std::vector<float>(n * 2, 0.01f), {n, 2});
    down.forward(exec, mpx::tensor_view<float const, space>(mpx::view(small)), true);
    auto dy = mpx_test::upload(exec, std::vector<float>(n * 2, 1e5f), {n, 2});  // float dx = 2e5 per element
    down.backward(exec, mpx::tensor_view<float const, space>(mpx::view(dy)));
    auto const g = mpx::find_nonfinite(exec, down);
    REQUIRE(g);
    CHECK(g->layer == "(cast to float16 for dense)");
    CHECK(g->pass == "backward");
    CHECK(g->tensor == "output gradient");
  }

  SECTION("everything finite; no forward yet is an error") {
    auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(3, mpx::activation::relu), mpx::dense<>(2));
    model.build(exec, {4}, 1);
    CHECK_THROWS_TYPE_WITH(mpx::find_nonfinite(exec, model), mpx::invalid_argument,
                           Catch::Contains("no forward has run yet"));
    auto x = mpx_test::upload(exec, mpx_test::random_values<float>(n * 4, -1, 1, 4), {n, 4});
    model.forward(exec, mpx::tensor_view<float const, space>(mpx::view(x)), true);
    auto dy = mpx_test::upload(exec, mpx_test::random_values<float>(n * 2, -1, 1, 5), {n, 2});
    model.backward(exec, mpx::tensor_view<float const, space>(mpx::view(dy)));
    CHECK_FALSE(mpx::find_nonfinite(exec, model));
    auto const layers = model.template trace<space>();
    REQUIRE(layers.size() == 2);
    CHECK(layers[0].input_gradient.size() == 0);  // the first layer has no dx
    CHECK(layers[0].output_gradient.size() == static_cast<std::size_t>(n * 3));
    CHECK(layers[1].output_gradient.size() == 0);  // the caller's dy
    CHECK(layers[1].parameters.size() == 2);
  }
}

TEMPLATE_LIST_TEST_CASE("probe_loss_scales: float16 gradients underflow at scale 1, survive a larger one, overflow a "
                        "too large one",
                        "[model][diagnostics]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  std::int64_t const n = 64;
  // Small inputs give the first layer's kernel gradients far below float16's smallest
  // subnormal (2^-24) at scale 1.
  auto xs = mpx_test::random_values<float>(n * 6, -2e-6, 2e-6, 6);
  auto const draws = mpx_test::random_values<float>(n, 0, 4, 7);
  std::vector<std::int32_t> labels(n);
  for (std::int64_t i = 0; i < n; ++i) labels[i] = std::min(3, static_cast<std::int32_t>(draws[i]));
  auto x = mpx_test::upload(exec, xs, {n, 6});
  auto y = mpx_test::upload(exec, labels, {n});
  auto probe = [&](auto model, std::vector<float> scales = {1.0f, 256.0f, 65536.0f, 16777216.0f, 4294967296.0f}) {
    model.build(exec, {6}, 3);
    return mpx::probe_loss_scales(exec, model, mpx::tensor_view<float const, space>(mpx::view(x)),
                                  mpx::tensor_view<std::int32_t const, space>(mpx::view(y)), std::move(scales));
  };
  auto const half = probe(mpx::sequential<mpx::mixed_float16>(mpx::dense<>(8, mpx::activation::tanh), mpx::dense<>(4),
                                                              mpx::softmax_layer<mpx::float32>()));
  INFO(half.to_string());
  REQUIRE(half.rows.size() == 4);
  CHECK(half.rows[0].parameter == "dense/kernel");
  CHECK(half.rows[0].dtype == mpx::dtype_id::float16);
  CHECK(half.rows[0].size == 48);
  CHECK(half.rows[0].zero_share[0] > 0.5);   // scale 1: lost to underflow
  CHECK(half.rows[0].zero_share[2] < 0.05);  // 2^16: kept
  CHECK(half.rows[0].nonfinite[2] == 0);
  bool overflowed = false;
  for (auto const& r : half.rows) overflowed = overflowed || r.nonfinite[4] > 0;
  CHECK(overflowed);  // 2^32 times a gradient of ~1/64 passes 65504
  CHECK(half.recommended_scale >= 65536.0f);
  CHECK(half.recommended_scale < 4294967296.0f);
  auto const table = half.to_string();
  CHECK_THAT(table, Catch::Contains("dense/kernel") && Catch::Contains("2^16") && Catch::Contains("inf"));

  // float32 gradients neither underflow nor overflow at these scales.
  auto const single = probe(mpx::sequential<mpx::float32>(mpx::dense<>(8, mpx::activation::tanh), mpx::dense<>(4),
                                                          mpx::softmax_layer<mpx::float32>()));
  CHECK(single.rows[0].zero_share[0] == 0.0);
  CHECK(single.recommended_scale == 4294967296.0f);
  CHECK_THAT(single.to_string(), Catch::Contains("needs no loss scale"));
  CHECK_THAT(half.to_string(), !Catch::Contains("needs no loss scale"));

  // One scale cannot show a scale recovering anything: no "needs no loss scale" then.
  auto const one = probe(mpx::sequential<mpx::mixed_float16>(mpx::dense<>(8, mpx::activation::tanh), mpx::dense<>(4),
                                                             mpx::softmax_layer<mpx::float32>()),
                         {1.0f});
  CHECK(one.recommended_scale == 1.0f);
  CHECK_THAT(one.to_string(), !Catch::Contains("needs no loss scale") && Catch::Contains("2^0"));
  auto const decimal = probe(mpx::sequential<mpx::float32>(mpx::dense<>(4), mpx::softmax_layer<mpx::float32>()),
                             {1.0f, 1000.0f});
  CHECK_THAT(decimal.to_string(), Catch::Contains(" 1000") && Catch::Contains("2^0"));
  auto unbuilt = mpx::sequential<mpx::float32>(mpx::dense<>(2));  // the scales are checked first
  CHECK_THROWS_TYPE_WITH(mpx::probe_loss_scales(exec, unbuilt, mpx::tensor_view<float const, space>(mpx::view(x)),
                                                mpx::tensor_view<std::int32_t const, space>(mpx::view(y)), {0.0f}),
                         mpx::invalid_argument, Catch::Contains("every scale must be finite and > 0"));
  CHECK_THROWS_TYPE_WITH(mpx::probe_loss_scales(exec, unbuilt, mpx::tensor_view<float const, space>(mpx::view(x)),
                                                mpx::tensor_view<std::int32_t const, space>(mpx::view(y)), {}),
                         mpx::invalid_argument, Catch::Contains("at least one loss scale"));
}

TEMPLATE_LIST_TEST_CASE("probe_loss_scales leaves a model's fp8 scales as they were", "[model][diagnostics][fp8]",
                        mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  std::int64_t const n = 32;
  auto const xs = mpx_test::random_values<float>(n * 16, -3, 3, 11);
  std::vector<std::int32_t> labels(n);
  for (std::int64_t i = 0; i < n; ++i) labels[i] = static_cast<std::int32_t>(i % 4);
  auto x = mpx_test::upload(exec, xs, {n, 16});
  auto y = mpx_test::upload(exec, labels, {n});
  auto model = mpx::sequential<mpx::mixed_fp8>(mpx::dense<>(16, mpx::activation::tanh),
                                               mpx::dense<mpx::without_fp8<mpx::mixed_fp8>>(4),
                                               mpx::softmax_layer<mpx::float32>());
  model.build(exec, {16}, 3);  // fp8 products take multiples of 16
  auto const& products = model.template layer<0>().products();
  auto const state = [&] {
    std::vector<mpx::fp8_scale_values> out;
    out.push_back(products.template scale<mpx::operand_role::activation>(exec).values(exec));
    out.push_back(products.template scale<mpx::operand_role::weight>(exec).values(exec));
    out.push_back(products.template scale<mpx::operand_role::gradient>(exec).values(exec));
    return out;
  };
  auto const before = state();
  // Each backward ends a delayed-scaling step for the layer: without the restore the
  // amax history would hold the probe's (three scales: three updates).
  auto const probe = mpx::probe_loss_scales(exec, model, mpx::tensor_view<float const, space>(mpx::view(x)),
                                            mpx::tensor_view<std::int32_t const, space>(mpx::view(y)),
                                            {1.0f, 1024.0f, 1e30f});
  CHECK(probe.rows.size() == 4);
  auto const after = state();
  for (std::size_t i = 0; i < before.size(); ++i) {
    INFO("role " << i);
    CHECK(after[i].steps == before[i].steps);
    CHECK(std::memcmp(&after[i], &before[i], sizeof(mpx::fp8_scale_values)) == 0);
  }
}
