// Residual blocks (model/residual.hpp): y = x + branch(x) as a layer of a sequential
// model, forward and backward against a float64 reference, names, summary and training.
#include "support/reference/matmul.hpp"
#include "support/testing.hpp"

#include <cmath>
#include <string>
#include <vector>

namespace {

// The float64 reference of dense(d) -> residual(dense(h, tanh), dense(d)) on x [n, d]:
// z0 = x W0 + b0; a1 = tanh(z0 W1 + b1); y = z0 + a1 W2 + b2. Kernels are [in, out].
struct residual_reference {
  std::size_t n, d, h;
  std::vector<double> w0, b0, w1, b1, w2, b2;
  std::vector<double> y, dw0, db0, dw1, db1, dw2, db2;

  void run(std::vector<double> const& x, std::vector<double> const& dy) {
    using mpx_test::reference::column_sums;
    using mpx_test::reference::matmul;
    auto add_bias = [](std::vector<double>& a, std::vector<double> const& b) {
      for (std::size_t i = 0; i < a.size(); ++i) a[i] += b[i % b.size()];
    };
    auto z0 = matmul(x, w0, n, d, d);
    add_bias(z0, b0);
    auto a1 = matmul(z0, w1, n, d, h);
    add_bias(a1, b1);
    for (double& v : a1) v = std::tanh(v);
    y = matmul(a1, w2, n, h, d);
    add_bias(y, b2);
    for (std::size_t i = 0; i < y.size(); ++i) y[i] += z0[i];
    // backward
    dw2 = matmul(a1, dy, h, n, d, true);
    db2 = column_sums(dy, d);
    auto dz1 = matmul(dy, w2, n, d, h, false, true);
    for (std::size_t i = 0; i < dz1.size(); ++i) dz1[i] *= 1 - a1[i] * a1[i];
    dw1 = matmul(z0, dz1, d, n, h, true);
    db1 = column_sums(dz1, h);
    auto dz0 = matmul(dz1, w1, n, h, d, false, true);
    for (std::size_t i = 0; i < dz0.size(); ++i) dz0[i] += dy[i];  // the identity path
    dw0 = matmul(x, dz0, d, n, d, true);
    db0 = column_sums(dz0, d);
  }
};

template <class Exec, class T>
std::vector<double> values_of(Exec const& exec, mpx::tensor_ref<mpx::memory_space_t<Exec>> const& t) {
  return mpx_test::widen(mpx_test::download(exec, t.template as<T>()));
}

double worst_relative(std::vector<double> const& got, std::vector<double> const& want) {
  double scale = 0, worst = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  REQUIRE(scale > 0);  // the reference is not all zeros
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / scale);
  return worst;
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("a residual block adds its input to its branch, forward and backward, as float64 says",
                        "[model][residual]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  std::size_t const n = 7, d = 5, h = 11;
  auto model = mpx::sequential<mpx::float32>(
      mpx::dense<>(static_cast<std::int64_t>(d)),
      mpx::residual(mpx::dense<>(static_cast<std::int64_t>(h), mpx::activation::tanh), mpx::dense<>(static_cast<std::int64_t>(d))));
  model.build(exec, {static_cast<std::int64_t>(d)}, 3);
  auto params = model.parameters(exec);
  REQUIRE(params.size() == 6);
  CHECK(params[2].name == "residual/dense/kernel");
  CHECK(params[5].name == "residual/dense_1/bias");

  residual_reference ref{n, d, h, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  // Random biases too (the initialiser zeroes them): the reference must see them.
  for (std::size_t i : {std::size_t{1}, std::size_t{3}, std::size_t{5}}) {
    auto const b = mpx_test::random_values<float>(params[i].value.size(), -0.5, 0.5, 40 + i);
    mpx::copy(exec, mpx::tensor_view<float const, mpx::host_space>(b.data(), params[i].value.shape()),
              params[i].value.template as<float>());
  }
  ref.w0 = values_of<TestType, float>(exec, params[0].value);
  ref.b0 = values_of<TestType, float>(exec, params[1].value);
  ref.w1 = values_of<TestType, float>(exec, params[2].value);
  ref.b1 = values_of<TestType, float>(exec, params[3].value);
  ref.w2 = values_of<TestType, float>(exec, params[4].value);
  ref.b2 = values_of<TestType, float>(exec, params[5].value);

  auto const x = mpx_test::random_values<float>(n * d, -1, 1, 31);
  auto const dy = mpx_test::random_values<float>(n * d, -1, 1, 32);
  ref.run(mpx_test::widen(x), mpx_test::widen(dy));

  auto x_dev = mpx_test::upload(exec, x, {static_cast<std::int64_t>(n), static_cast<std::int64_t>(d)});
  auto dy_dev = mpx_test::upload(exec, dy, {static_cast<std::int64_t>(n), static_cast<std::int64_t>(d)});
  for (auto& p : params) mpx::fill(exec, p.gradient.template as<float>(), std::nanf(""));  // poisoned
  auto const y = model.forward(exec, mpx::tensor_view<float const, space>(mpx::view(x_dev)), true);
  CHECK(worst_relative(mpx_test::widen(mpx_test::download(exec, y)), ref.y) < 1e-5);
  model.backward(exec, mpx::tensor_view<float const, space>(mpx::view(dy_dev)));
  std::vector<std::vector<double> const*> const want = {&ref.dw0, &ref.db0, &ref.dw1, &ref.db1, &ref.dw2, &ref.db2};
  for (std::size_t i = 0; i < params.size(); ++i) {
    INFO(params[i].name);
    CHECK(worst_relative(values_of<TestType, float>(exec, params[i].gradient), *want[i]) < 1e-5);
  }

  // Without the identity path's gradient, the first layer's would differ: the check can fail.
  double identity_share = 0;
  for (std::size_t i = 0; i < ref.db0.size(); ++i) identity_share = std::max(identity_share, std::abs(ref.db0[i]));
  CHECK(identity_share > 0.1);
}

TEST_CASE("the summary keeps its columns in line for layers nested deep in residual blocks", "[model][residual]") {
  mpx::host_executor exec;
  auto model = mpx::sequential<mpx::mixed_float16>(
      mpx::dense<>(8),
      mpx::residual(mpx::residual(mpx::layer_norm<>(), mpx::dense<>(8)), mpx::layer_norm<>(), mpx::dense<>(8)),
      mpx::dense<>(3));
  model.build(exec, {4}, 1);
  std::string const summary = model.summary();
  INFO(summary);
  REQUIRE(summary.find("  |   | layer_normalization (LayerNormalization)") != std::string::npos);  // 45 characters
  // Every row's output shape, policy and count start where the header's do.
  std::vector<std::string> lines;
  for (std::size_t at = 0, end; (end = summary.find('\n', at)) != std::string::npos; at = end + 1)
    lines.push_back(summary.substr(at, end - at));
  std::size_t const shape_column = lines[0].find("Output shape"), policy_column = lines[0].find("Policy");
  std::size_t rows = 0;
  for (auto const& line : lines) {
    std::size_t const shape = line.find("(None, ");
    if (shape == std::string::npos) continue;
    ++rows;
    CHECK(shape == shape_column);
    CHECK(line.find("mixed_float16") == policy_column);
    CHECK(line.size() == lines[0].size());  // the counts end in the same column
  }
  CHECK(rows == 8);
}

TEST_CASE("residual blocks are named like Keras layers, shown with their branches, and refuse a shape change",
          "[model][residual]") {
  mpx::host_executor exec;
  auto model = mpx::sequential<mpx::mixed_float16>(
      mpx::dense<>(8), mpx::residual(mpx::layer_norm<>(), mpx::dense<>(16, mpx::activation::relu), mpx::dense<>(8)),
      mpx::residual(mpx::layer_norm<>(), mpx::dense<>(8)), mpx::dense<>(3), mpx::softmax_layer<mpx::float32>());
  model.build(exec, {4}, 1);
  auto const summary = model.summary();
  CHECK(summary.find("residual (Residual)") != std::string::npos);
  CHECK(summary.find("residual_1 (Residual)") != std::string::npos);
  CHECK(summary.find("  | layer_normalization (LayerNormalization)") != std::string::npos);
  CHECK(summary.find("  | dense_1 (Dense)") != std::string::npos);
  std::vector<std::string> names;
  for (auto const& p : model.parameters(exec)) names.push_back(p.name);
  std::sort(names.begin(), names.end());
  CHECK(std::adjacent_find(names.begin(), names.end()) == names.end());  // unique: checkpoints can tell them apart
  CHECK(std::count(names.begin(), names.end(), "residual_1/dense/kernel") == 1);

  auto widening = mpx::sequential<mpx::float32>(mpx::dense<>(4), mpx::residual(mpx::dense<>(5)));
  CHECK_THROWS_TYPE_WITH(widening.build(exec, {4}, 1), mpx::shape_error,
                         Catch::Contains("the branch must keep the shape"));
}

TEST_CASE("a residual block's training state is named under the block: dropout's counter and seed, fp8 scales",
          "[model][residual]") {
  mpx::host_executor exec;
  auto model = mpx::sequential<mpx::mixed_fp8>(
      mpx::dense<mpx::mixed_bfloat16>(16), mpx::residual(mpx::dense<>(16, mpx::activation::relu), mpx::dropout<>(0.1f)),
      mpx::dense<mpx::mixed_bfloat16>(3), mpx::softmax_layer<mpx::float32>());
  model.build(exec, {4}, 1);
  auto const counters = mpx::detail::model_counters<mpx::host_space>(model);
  auto const seeds = mpx::detail::model_seeds(model);
  auto const scales = mpx::detail::model_fp8_scales<mpx::host_executor>(model);
  REQUIRE(counters.size() == 1);
  REQUIRE(seeds.size() == 1);
  REQUIRE(scales.size() == 1);  // the branch's dense; the outer ones are not in fp8
  CHECK(counters[0].first == "residual/dropout/training_forwards");
  CHECK(seeds[0].first == "residual/dropout/seed");
  CHECK(scales[0].name == "residual/dense");  // branch layers are named within the branch
}

TEMPLATE_LIST_TEST_CASE("a pre-norm residual classifier trains under mixed_float16", "[model][residual]",
                        mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  std::int64_t const n = 256;
  auto xy = mpx_test::random_values<float>(static_cast<std::size_t>(2 * n), -1.0, 1.0, 51);
  std::vector<mpx::half> images(xy.size());
  std::vector<std::int32_t> labels(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    labels[static_cast<std::size_t>(i)] = (xy[2 * i] > 0 ? 1 : 0) + (xy[2 * i + 1] > 0 ? 2 : 0);
    images[2 * i] = mpx::cast<mpx::half>(xy[2 * i]);
    images[2 * i + 1] = mpx::cast<mpx::half>(xy[2 * i + 1]);
  }
  auto x = mpx_test::upload(exec, images, {n, 2});
  auto y = mpx_test::upload(exec, labels, {n});
  auto model = mpx::sequential<mpx::mixed_float16>(
      mpx::dense<>(16), mpx::residual(mpx::layer_norm<>(), mpx::dense<>(32, mpx::activation::relu), mpx::dense<>(16)),
      mpx::dense<>(4), mpx::softmax_layer<mpx::float32>());
  model.build(exec, {2}, 5);
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  for (int step = 0; step < 60; ++step)
    trainer.step(exec, mpx::tensor_view<mpx::half const, space>(mpx::view(x)),
                 mpx::tensor_view<std::int32_t const, space>(mpx::view(y)));
  auto const history = trainer.history(exec);
  CHECK(history.back().loss < 0.5f * history.front().loss);
  CHECK(static_cast<double>(history.back().correct) / static_cast<double>(n) > 0.9);
  for (auto const& r : history) CHECK(r.skipped == 0);
}

TEMPLATE_LIST_TEST_CASE("a small pre-norm transformer trains on token sequences through classifier_trainer",
                        "[model][residual][attention]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  // Tokens as one-hot rows [batch, tokens, vocab]; the target of each token is the next
  // symbol of the cycle (a per-token loss over every position, every token counted).
  std::int64_t const B = 8, T = 12, V = 7;
  std::vector<mpx::half> x(static_cast<std::size_t>(B * T * V), mpx::cast<mpx::half>(0.0f));
  std::vector<std::int32_t> y(static_cast<std::size_t>(B * T));
  auto const starts = mpx_test::random_values<float>(static_cast<std::size_t>(B), 0, static_cast<double>(V), 81);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t) {
      auto const token = (static_cast<std::int64_t>(starts[static_cast<std::size_t>(b)]) + 3 * t) % V;
      x[static_cast<std::size_t>((b * T + t) * V + token)] = mpx::cast<mpx::half>(1.0f);
      y[static_cast<std::size_t>(b * T + t)] = static_cast<std::int32_t>((token + 3) % V);
    }
  auto xd = mpx_test::upload(exec, x, {B, T, V});
  auto yd = mpx_test::upload(exec, y, {B, T});
  auto model = mpx::sequential<mpx::mixed_float16>(
      mpx::dense<>(16), mpx::residual(mpx::layer_norm<>(), mpx::causal_self_attention<>(2)),
      mpx::residual(mpx::layer_norm<>(), mpx::dense<>(32, mpx::activation::relu), mpx::dense<>(16)),
      mpx::layer_norm<>(), mpx::dense<>(V), mpx::softmax_layer<mpx::float32>());
  model.build(exec, {T, V}, 2);
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  for (int step = 0; step < 80; ++step)
    trainer.step(exec, mpx::tensor_view<mpx::half const, space>(mpx::view(xd)),
                 mpx::tensor_view<std::int32_t const, space>(mpx::view(yd)));
  auto const history = trainer.history(exec);
  CHECK(history.front().samples == static_cast<std::uint32_t>(B * T));  // every token counts
  CHECK(history.back().loss < 0.2f * history.front().loss);
  CHECK(history.back().correct == static_cast<std::uint32_t>(B * T));
  for (auto const& r : history) CHECK(r.skipped == 0);
}

TEMPLATE_LIST_TEST_CASE("find_nonfinite names the layer inside a residual block that overflowed",
                        "[model][residual][attention][diagnostics]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  std::int64_t const T = 8, D = 64;
  // Large activations and no 1/sqrt(d): the float16 attention logits overflow.
  auto x = mpx_test::upload(exec, mpx_test::random_values<mpx::half>(static_cast<std::size_t>(T * D), 200, 240, 3), {1, T, D});
  auto model = mpx::sequential<mpx::mixed_float16>(mpx::residual(mpx::causal_self_attention<>(1, false)),
                                                   mpx::dense<>(4));
  model.build(exec, {T, D}, 4);
  model.forward(exec, mpx::tensor_view<mpx::half const, space>(mpx::view(x)), false);
  auto const finding = mpx::find_nonfinite(exec, model);
  REQUIRE(finding);
  CHECK(finding->layer == "residual/multi_head_attention");
  CHECK(finding->pass == "forward");
  CHECK(finding->tensor == "output");
}
