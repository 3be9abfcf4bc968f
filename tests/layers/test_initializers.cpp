// The initialisers beyond Keras's: normal(stddev) (GPT-2's 0.02, nn.Embedding's 1),
// uniform(limit), torch_linear (nn.Linear's and nn.Conv2d's default, weight and bias) and
// gpt2_residual(layers); and the layers that take them (dense, conv2d's bias, the
// embedding, causal_self_attention's three). What must hold: each draws the distribution
// it names (mean, deviation and bounds, against the formula in double), reproducibly; a
// normal is not truncated; a bad parameter is refused by name.
#include "../support/testing.hpp"

#include <mpx/layers/attention.hpp>
#include <mpx/layers/conv2d.hpp>
#include <mpx/layers/dense.hpp>
#include <mpx/layers/embedding.hpp>
#include <mpx/layers/initializers.hpp>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace initializer_tests {

struct moments {
  double mean = 0, stddev = 0, largest = 0;
  std::size_t n = 0, nonfinite = 0;
};

template <class T>
moments moments_of(std::vector<T> const& v) {
  moments m;
  m.n = v.size();
  double sum = 0, sq = 0;
  for (T const& x : v) {
    double const d = static_cast<double>(mpx::cast<float>(x));
    m.nonfinite += std::isfinite(d) ? 0 : 1;
    sum += d;
    sq += d * d;
    m.largest = std::max(m.largest, std::fabs(d));
  }
  m.mean = sum / static_cast<double>(m.n);
  m.stddev = std::sqrt(sq / static_cast<double>(m.n) - m.mean * m.mean);
  CHECK(m.nonfinite == 0);  // NaN would pass none of the comparisons below anyway
  return m;
}

// A normal of deviation sigma: mean within 4 standard errors, deviation within 4 % (n of
// some thousands), and values beyond 2 sigma present (not truncated, as Keras's are).
void check_normal(moments const& m, double sigma) {
  INFO("n " << m.n << " mean " << m.mean << " stddev " << m.stddev << " largest " << m.largest << ", sigma " << sigma);
  CHECK(std::fabs(m.mean) <= 4 * sigma / std::sqrt(static_cast<double>(m.n)));
  CHECK(std::fabs(m.stddev / sigma - 1) < 0.04);
  CHECK(m.largest > 2.5 * sigma);
  CHECK(m.largest < 6 * sigma);
}

// U(-limit, limit): inside the bounds, reaching close to them, deviation limit/sqrt(3).
void check_uniform(moments const& m, double limit) {
  INFO("n " << m.n << " mean " << m.mean << " stddev " << m.stddev << " largest " << m.largest << ", limit " << limit);
  CHECK(m.largest <= limit * (1 + 1e-6));
  CHECK(m.largest >= 0.98 * limit);
  CHECK(std::fabs(m.stddev / (limit / std::sqrt(3.0)) - 1) < 0.04);
  CHECK(std::fabs(m.mean) <= 4 * limit / std::sqrt(3.0 * static_cast<double>(m.n)));
}

}  // namespace initializer_tests

TEMPLATE_LIST_TEST_CASE("normal, uniform, torch_linear and gpt2_residual draw what they name, reproducibly",
                        "[layers][init]", mpx_test::executors) {
  using namespace initializer_tests;
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  std::int64_t const in = 96, units = 80;
  auto kernel_and_bias = [&](mpx::initializer kernel, mpx::initializer bias, std::uint64_t seed) {
    mpx::dense<mpx::float32> layer({.units = units, .kernel_initializer = kernel, .bias_initializer = bias});
    layer.build(exec, {in}, seed);
    return std::make_pair(mpx_test::download(exec, layer.template kernel<Space>()),
                          mpx_test::download(exec, layer.template bias<Space>()));
  };
  auto const [normal, normal_bias] = kernel_and_bias(mpx::initializer::normal(0.02), mpx::initializer::zeros, 3);
  check_normal(moments_of(normal), 0.02);
  CHECK(normal_bias == std::vector<float>(units, 0.0f));
  CHECK(kernel_and_bias(mpx::initializer::normal(0.02), mpx::initializer::zeros, 3).first == normal);
  CHECK(kernel_and_bias(mpx::initializer::normal(0.02), mpx::initializer::zeros, 4).first != normal);

  check_uniform(moments_of(kernel_and_bias(mpx::initializer::uniform(0.3), mpx::initializer::zeros, 5).first), 0.3);

  // PyTorch's nn.Linear(in, units): weight and bias U(+-1/sqrt(in)), each its own stream.
  auto const [torch_kernel, torch_bias] = kernel_and_bias(mpx::initializer::torch_linear, mpx::initializer::torch_linear, 6);
  double const bound = 1 / std::sqrt(static_cast<double>(in));
  check_uniform(moments_of(torch_kernel), bound);
  auto const b = moments_of(torch_bias);
  CHECK(b.largest <= bound * (1 + 1e-6));
  CHECK(b.largest >= 0.5 * bound);  // 80 values: near the bound, not at it
  CHECK(std::vector<float>(torch_kernel.begin(), torch_kernel.begin() + units) != torch_bias);

  // GPT-2's residual projection for 6 layers: 0.02 / sqrt(12).
  CHECK(mpx::initializer::gpt2_residual(6) == mpx::initializer::normal(0.02 / std::sqrt(12.0)));
  check_normal(moments_of(kernel_and_bias(mpx::initializer::gpt2_residual(6), mpx::initializer::zeros, 7).first),
               0.02 / std::sqrt(12.0));

  // Named in messages and summaries as a user writes them.
  CHECK(mpx::to_string(mpx::initializer::normal(0.02)) == "normal(0.02)");
  CHECK(mpx::to_string(mpx::initializer::torch_linear) == "torch_linear");
  CHECK(mpx::to_string(mpx::initializer::glorot_uniform) == "glorot_uniform");

  // A negative or non-finite deviation is refused by name, at build.
  for (double bad : {-0.02, static_cast<double>(NAN), static_cast<double>(INFINITY)}) {
    mpx::dense<mpx::float32> layer({.units = 4, .kernel_initializer = mpx::initializer::normal(bad)});
    CHECK_THROWS_TYPE_WITH(layer.build(exec, {3}, 1), mpx::invalid_argument,
                           Catch::Contains("mpx::initialize") && Catch::Contains("must be finite and >= 0"));
  }

  // Rounded once to the storage type, the same values as float's.
  mpx::dense<mpx::mixed_bfloat16> narrow({.units = units, .kernel_initializer = mpx::initializer::normal(0.02)});
  narrow.build(exec, {in}, 3);
  auto const narrow_kernel = mpx_test::download(exec, narrow.template kernel<Space>());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < normal.size(); ++i)
    differ += mpx::cast<float>(narrow_kernel[i]) == mpx::cast<float>(mpx::cast<mpx::bfloat16>(normal[i])) ? 0 : 1;
  CHECK(differ == 0);
}

TEMPLATE_LIST_TEST_CASE("the embedding, conv2d's bias and the attention's projections take the initialisers",
                        "[layers][init]", mpx_test::executors) {
  using namespace initializer_tests;
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  // nn.Embedding's N(0, 1) for the tokens, GPT-2's 0.02 for the positions.
  mpx::embedding<mpx::float32> e({.vocab_size = 200, .width = 32, .context = 100,
                                  .embeddings_initializer = mpx::initializer::normal(1.0),
                                  .positions_initializer = mpx::initializer::normal(0.02)});
  e.build(exec, {100}, 11);
  check_normal(moments_of(mpx_test::download(exec, e.template embeddings<Space>())), 1.0);
  check_normal(moments_of(mpx_test::download(exec, e.template positions<Space>())), 0.02);

  // nn.Conv2d(8, 64, 3): bias U(+-1/sqrt(3 * 3 * 8)), the kernel's fan in.
  mpx::conv2d<mpx::float32> conv({.filters = 64, .kernel_h = 3, .kernel_w = 3,
                                  .kernel_initializer = mpx::initializer::torch_linear,
                                  .bias_initializer = mpx::initializer::torch_linear});
  conv.build(exec, {6, 6, 8}, 12);
  double const conv_bound = 1 / std::sqrt(72.0);
  check_uniform(moments_of(mpx_test::download(exec, conv.template kernel<Space>())), conv_bound);
  auto const conv_bias = moments_of(mpx_test::download(exec, conv.template bias<Space>()));
  CHECK(conv_bias.largest <= conv_bound * (1 + 1e-6));
  CHECK(conv_bias.largest >= 0.6 * conv_bound);

  // GPT-2's attention: N(0, 0.02) for the query/key/value kernel, the residual scale for
  // the output projection, PyTorch's bound for both biases.
  std::int64_t const width = 64;
  mpx::causal_self_attention<mpx::float32> attention({.heads = 4,
                                                      .kernel_initializer = mpx::initializer::normal(0.02),
                                                      .output_kernel_initializer = mpx::initializer::gpt2_residual(4),
                                                      .bias_initializer = mpx::initializer::torch_linear});
  attention.build(exec, {16, width}, 13);
  check_normal(moments_of(mpx_test::download(exec, attention.query_key_value().template kernel<Space>())), 0.02);
  check_normal(moments_of(mpx_test::download(exec, attention.output().template kernel<Space>())), 0.02 / std::sqrt(8.0));
  auto const qkv_bias = moments_of(mpx_test::download(exec, attention.query_key_value().template bias<Space>()));
  CHECK(qkv_bias.largest <= 1 / std::sqrt(static_cast<double>(width)) * (1 + 1e-6));
  CHECK(qkv_bias.largest >= 0.8 / std::sqrt(static_cast<double>(width)));
  // Keras's defaults stay the defaults: glorot_uniform kernels, zero biases.
  mpx::causal_self_attention<mpx::float32> keras(4);
  keras.build(exec, {16, width}, 13);
  CHECK(mpx_test::download(exec, keras.output().template bias<Space>()) == std::vector<float>(width, 0.0f));
  check_uniform(moments_of(mpx_test::download(exec, keras.output().template kernel<Space>())),
                std::sqrt(6.0 / (2.0 * static_cast<double>(width))));
}
