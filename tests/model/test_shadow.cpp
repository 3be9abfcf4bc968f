// mpx::model_shadow: each layer's error against its float32 twin. What must hold: the
// errors it reports are the ones a float64 computation of the same layer on the same
// inputs gives, to the digits it prints; a float32 model costs nothing (exactly zero);
// an overflow shows as inf, not as a small number; and shadowing does not change the
// training at all (the parameters bit for bit, the losses, the scale).
#include "../support/testing.hpp"

#include <mpx/data/tensor_batches.hpp>
#include <mpx/layers/batch_norm.hpp>
#include <mpx/layers/conv2d.hpp>
#include <mpx/layers/dense.hpp>
#include <mpx/layers/attention.hpp>
#include <mpx/layers/dropout.hpp>
#include <mpx/layers/embedding.hpp>
#include <mpx/layers/layer_norm.hpp>
#include <mpx/layers/flatten.hpp>
#include <mpx/layers/max_pool2d.hpp>
#include <mpx/layers/softmax_layer.hpp>
#include <mpx/model/fit.hpp>
#include <mpx/model/residual.hpp>
#include <mpx/model/sequential.hpp>
#include <mpx/model/shadow.hpp>
#include <mpx/optim/adam.hpp>
#include <mpx/optim/loss_scale_optimizer.hpp>
#include <mpx/scaling/loss_scaler.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

namespace shadow_tests {

using Catch::Matchers::Contains;

// The float64 truth of one relative error: sqrt(sum (a - r)^2 / sum r^2).
struct truth_sums {
  double difference = 0, reference = 0;
  void add(double a, double r) {
    difference += (a - r) * (a - r);
    reference += r * r;
  }
  [[nodiscard]] double error() const { return std::sqrt(difference / reference); }
};

// A tensor_ref read back in float64.
template <class Exec, class Ref>
std::vector<double> values_of(Exec const& exec, Ref const& ref) {
  std::vector<double> out;
  mpx::visit_dtype(ref.dtype(), [&](auto t) {
    using T = decltype(t);
    out = mpx_test::widen(mpx_test::download(exec, ref.template as<T>()));
  });
  return out;
}

// The shadow's figure and the truth agree to the table's digits and to 1e-3 of the value.
void check_agrees(std::optional<double> shadow, double truth) {
  REQUIRE(shadow.has_value());
  INFO("shadow " << *shadow << ", float64 " << truth);
  REQUIRE(std::isfinite(truth));
  CHECK(truth > 0);
  CHECK(std::abs(*shadow - truth) <= 1e-3 * truth);
  CHECK(mpx::detail::error_text(shadow) == mpx::detail::error_text(truth));
}

TEMPLATE_LIST_TEST_CASE("the shadow's errors are a float64 computation's, to the reported digits", "[model][shadow]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  constexpr std::int64_t batch = 9, features = 19, hidden = 13, classes = 5;
  auto model = mpx::sequential<mpx::mixed_bfloat16>(mpx::dense<>(hidden, mpx::activation::relu), mpx::dense<>(classes),
                                                     mpx::softmax_layer<mpx::float32>());
  model.build(exec, {features}, 4);
  auto const x = mpx_test::upload(exec, mpx_test::random_values<float>(batch * features, -2.0, 2.0, 31),
                                  mpx::shape{batch, features});
  model.forward(exec, x.view(), true);
  auto const d_logits = model.logits_gradient(exec);
  auto const g = mpx_test::random_values<float>(batch * classes, -1.0, 1.0, 32);
  mpx::copy(exec, mpx::tensor_view<float const, mpx::host_space>(g.data(), d_logits.shape()), d_logits);
  model.backward_from_logits(exec, d_logits);

  mpx::model_shadow<Space> shadow;
  auto const report = shadow.measure(exec, model, 1);
  REQUIRE(report.layers.size() == 3);
  CHECK(report.layers[0].layer == "dense");
  CHECK(report.layers[1].layer == "dense_1");
  CHECK(report.layers[2].layer == "softmax");
  CHECK(report.layers[0].policy == "mixed_bfloat16");

  // The truth, from what each dense layer read and wrote, in float64.
  auto const trace = model.trace<Space>();
  for (std::size_t l = 0; l < 2; ++l) {
    INFO("layer " << trace[l].name);
    auto const& t = trace[l];
    auto const in = values_of(exec, t.input), out = values_of(exec, t.output);
    // dense_1's dy is the caller's logits gradient, which the model cast to bfloat16 (a
    // trace leaves it out: the caller owns it).
    std::vector<double> dy = l == 0 ? values_of(exec, t.output_gradient) : std::vector<double>{};
    if (l == 1)
      for (float v : g) dy.push_back(mpx::detail::to_double(mpx::cast<mpx::bfloat16>(v)));
    auto const kernel = values_of(exec, t.parameters[0].value), bias = values_of(exec, t.parameters[1].value);
    auto const d_kernel = values_of(exec, t.parameters[0].gradient), d_bias = values_of(exec, t.parameters[1].gradient);
    std::int64_t const k = t.input.shape()[1], n = t.output.shape()[1];
    bool const relu = l == 0;
    truth_sums output, input_gradient, weights;
    std::vector<double> dz(static_cast<std::size_t>(batch * n));
    for (std::int64_t r = 0; r < batch; ++r)
      for (std::int64_t c = 0; c < n; ++c) {
        double z = bias[c];
        for (std::int64_t i = 0; i < k; ++i) z += in[r * k + i] * kernel[i * n + c];
        double const y = relu ? std::max(z, 0.0) : z;
        output.add(out[r * n + c], y);
        dz[r * n + c] = relu && z <= 0 ? 0.0 : dy[r * n + c];
      }
    for (std::int64_t i = 0; i < k; ++i)
      for (std::int64_t c = 0; c < n; ++c) {
        double w = 0;
        for (std::int64_t r = 0; r < batch; ++r) w += in[r * k + i] * dz[r * n + c];
        weights.add(d_kernel[i * n + c], w);
      }
    for (std::int64_t c = 0; c < n; ++c) {
      double b = 0;
      for (std::int64_t r = 0; r < batch; ++r) b += dz[r * n + c];
      weights.add(d_bias[c], b);
    }
    check_agrees(report.layers[l].output, output.error());
    check_agrees(report.layers[l].weight_gradient, weights.error());
    if (l == 0) {
      CHECK_FALSE(report.layers[l].input_gradient.has_value());  // the first layer writes no dx
    } else {
      auto const dx = values_of(exec, t.input_gradient);
      for (std::int64_t r = 0; r < batch; ++r)
        for (std::int64_t i = 0; i < k; ++i) {
          double v = 0;
          for (std::int64_t c = 0; c < n; ++c) v += dz[r * n + c] * kernel[i * n + c];
          input_gradient.add(dx[r * k + i], v);
        }
      check_agrees(report.layers[l].input_gradient, input_gradient.error());
    }
  }
  // The float32 softmax is its own twin; the backward began below it (at the logits).
  REQUIRE(report.layers[2].output.has_value());
  CHECK(*report.layers[2].output == 0.0);
  CHECK_FALSE(report.layers[2].input_gradient.has_value());
  CHECK_FALSE(report.layers[2].weight_gradient.has_value());

  // The table prints those digits, and names the costliest layer.
  auto const table = mpx::shadow_table(std::vector<mpx::shadow_report>{report});
  CHECK_THAT(table, Contains(mpx::detail::error_text(report.layers[0].output)));
  CHECK_THAT(table, Contains("Costliest: dense"));
  // A shadow belongs to one model.
  auto other = mpx::sequential<mpx::float32>(mpx::dense<>(3));
  other.build(exec, {2}, 1);
  auto const x2 = mpx_test::upload(exec, std::vector<float>(4, 1.0f), mpx::shape{2, 2});
  other.forward(exec, x2.view(), true);
  CHECK_THROWS_TYPE_WITH(shadow.measure(exec, other, 2), mpx::invalid_argument, Contains("one model_shadow per model"));
}

TEMPLATE_LIST_TEST_CASE("a transformer's layers are shadowed inside their residual blocks", "[model][shadow]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  constexpr std::int64_t batch = 3, tokens = 7, width = 16;
  auto model = mpx::sequential<mpx::mixed_bfloat16>(
      mpx::embedding<>(50, width, tokens), mpx::residual(mpx::layer_norm<>(), mpx::causal_self_attention<>(2)),
      mpx::residual(mpx::layer_norm<>(), mpx::dense<>(2 * width, mpx::activation::gelu), mpx::dense<>(width)),
      mpx::dense<>(50));
  model.build(exec, {tokens}, 6);
  std::vector<std::int32_t> ids(batch * tokens);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>((i * 17 + 3) % 50);
  auto const x = mpx_test::upload(exec, ids, mpx::shape{batch, tokens});
  model.forward(exec, x.view(), true);
  auto const d = model.logits_gradient(exec);
  auto const g = mpx_test::random_values<float>(d.size(), -1.0, 1.0, 51);
  mpx::copy(exec, mpx::tensor_view<float const, mpx::host_space>(g.data(), d.shape()), d);
  model.backward_from_logits(exec, d);
  mpx::model_shadow<Space> shadow;
  auto const report = shadow.measure(exec, model, 1);
  std::vector<std::string> names;
  for (auto const& e : report.layers) names.push_back(e.layer);
  CHECK(names == std::vector<std::string>{"embedding", "residual/layer_normalization",
                                          "residual/multi_head_attention", "residual_1/layer_normalization",
                                          "residual_1/dense", "residual_1/dense_1", "dense"});
  for (auto const& e : report.layers) {
    INFO(e.layer);
    CHECK(e.skipped.empty());
    CHECK_FALSE(e.read_nonfinite);
    REQUIRE(e.output.has_value());
    CHECK(*e.output > 0.0);  // bfloat16 outputs: about 2^-9 relative
    CHECK(*e.output < 1e-2);
    REQUIRE(e.weight_gradient.has_value());
    CHECK(*e.weight_gradient < 2e-2);
    // A branch's first layer writes its input gradient into the block's buffer, which the
    // block then adds the skip connection to: not the layer's own, not measured.
    bool const first_in_branch = e.layer.find("/layer_normalization") != std::string::npos;
    CHECK(e.input_gradient.has_value() == (e.layer != "embedding" && !first_in_branch));
    if (e.input_gradient) CHECK(*e.input_gradient < 2e-2);
  }
}

template <class P>
auto image_model() {
  return mpx::sequential<P>(mpx::conv2d<>(4, 3, mpx::activation::relu), mpx::batch_norm<>(), mpx::max_pool2d<>(2),
                            mpx::flatten<>(), mpx::dropout<>(0.25f), mpx::dense<>(3),
                            mpx::softmax_layer<mpx::float32>());
}

template <class Exec>
auto image_data(Exec const& exec, std::int64_t n) {
  using Space = mpx::memory_space_t<Exec>;
  auto const pixels = mpx_test::random_values<float>(static_cast<std::size_t>(n * 8 * 8), 0.0, 1.0, 41);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < labels.size(); ++i) {  // the class: which third of the image is brightest
    float sums[3] = {0, 0, 0};
    for (int p = 0; p < 64; ++p) sums[(p % 8) * 3 / 8] += pixels[i * 64 + p];
    labels[i] = sums[0] > sums[1] ? (sums[0] > sums[2] ? 0 : 2) : (sums[1] > sums[2] ? 1 : 2);
  }
  struct data {
    mpx::tensor<float, Space> images;
    mpx::tensor<std::int32_t, Space> labels;
  };
  return data{mpx_test::upload(exec, pixels, mpx::shape{n, 8, 8, 1}), mpx_test::upload(exec, labels, mpx::shape{n})};
}

TEMPLATE_LIST_TEST_CASE("a float32 model costs no precision: every error is exactly 0", "[model][shadow]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  auto const data = image_data(exec, 6);
  auto model = mpx::sequential<mpx::float32>(mpx::conv2d<>(4, 3, mpx::activation::relu), mpx::batch_norm<>(),
                                             mpx::flatten<>(), mpx::dense<>(3));
  model.build(exec, {8, 8, 1}, 2);
  model.forward(exec, data.images.view(), true);
  auto const d = model.logits_gradient(exec);
  mpx::fill(exec, d, 0.25f);
  model.backward_from_logits(exec, d);
  mpx::model_shadow<Space> shadow;
  auto const report = shadow.measure(exec, model, 1);
  REQUIRE(report.layers.size() == 4);
  // After an inference forward the twins run in inference too (batch norm on its moving
  // statistics): still exactly 0.
  model.forward(exec, data.images.view(), false);
  for (auto const& e : shadow.measure(exec, model, 2).layers) {
    INFO(e.layer << " after an inference forward");
    REQUIRE(e.output.has_value());
    CHECK(*e.output == 0.0);
    CHECK_FALSE(e.weight_gradient.has_value());  // no backward since that forward
  }
  for (auto const& e : report.layers) {
    INFO(e.layer);
    CHECK(e.skipped.empty());
    REQUIRE(e.output.has_value());
    CHECK(*e.output == 0.0);
    if (e.layer != "conv2d") {
      REQUIRE(e.input_gradient.has_value());
      CHECK(*e.input_gradient == 0.0);
    }
    if (e.layer != "flatten") {
      REQUIRE(e.weight_gradient.has_value());
      CHECK(*e.weight_gradient == 0.0);
    }
  }
}

TEMPLATE_LIST_TEST_CASE("an overflow shows as an infinite error, and leads the table", "[model][shadow]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(6), mpx::dense<>(4));
  model.build(exec, {5}, 3);
  // The first layer's weights blown up: its float16 output passes 65504, its twin's does not.
  auto params = model.parameters(exec);
  mpx::visit_dtype(params[0].value.dtype(), [&](auto t) {
    using T = decltype(t);
    mpx::fill(exec, params[0].value.template as<T>(), mpx::cast<T>(3000.0f));
  });
  auto const x = mpx_test::upload(exec, std::vector<float>(15, 10.0f), mpx::shape{3, 5});
  model.forward(exec, x.view(), true);
  auto const d = model.logits_gradient(exec);
  mpx::fill(exec, d, 1.0f);
  model.backward_from_logits(exec, d);
  mpx::model_shadow<Space> shadow;
  auto const report = shadow.measure(exec, model, 7);
  CHECK(report.step == 7);
  REQUIRE(report.layers[0].output.has_value());
  CHECK(std::isinf(*report.layers[0].output));
  auto const table = mpx::shadow_table(std::vector<mpx::shadow_report>{report});
  // dense_1 read the infinities: its twin's results are not finite either, and it is not blamed.
  CHECK(report.layers[1].read_nonfinite);
  CHECK_FALSE(report.layers[0].read_nonfinite);
  CHECK_THAT(table, Contains("Costliest: dense (output inf)\n"));
  CHECK_THAT(table, Contains("(it read non-finite values)"));
}

TEMPLATE_LIST_TEST_CASE("a model built again for another input shape gets new twins", "[model][shadow]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  auto model = mpx::sequential<mpx::float32>(mpx::dense<>(5), mpx::dense<>(3));
  mpx::model_shadow<Space> shadow;
  for (std::int64_t features : {4, 6}) {
    INFO(features << " features");
    model.build(exec, {features}, 2);
    auto const x = mpx_test::upload(exec, std::vector<float>(static_cast<std::size_t>(2 * features), 0.5f),
                                    mpx::shape{2, features});
    model.forward(exec, x.view(), true);
    auto const report = shadow.measure(exec, model, 1);
    REQUIRE(report.layers[0].output.has_value());
    CHECK(*report.layers[0].output == 0.0);
  }
}

TEMPLATE_LIST_TEST_CASE("the trainer marks the shadow reports of steps it skipped", "[model][shadow]",
                        mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  auto const data = image_data(exec, 24);
  auto model = mpx::sequential<mpx::mixed_float16>(mpx::flatten<>(), mpx::dense<>(8, mpx::activation::relu),
                                                   mpx::dense<>(3));
  model.build(exec, {8, 8, 1}, 3);
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = 0x1p60f;  // the first steps' float16 gradients overflow; each halves the scale
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f),
                                             mpx::dynamic_loss_scaler(exec, rule));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  trainer.shadow_every(1);
  mpx::tensor_batches<float, Space> batches{data.images, data.labels, 8};
  batches.start_epoch(0);
  while (auto b = batches.next()) trainer.step(exec, b->images, b->labels);
  auto const records = trainer.history(exec);
  auto const reports = trainer.take_shadow_reports();
  REQUIRE(records.size() == 3);
  REQUIRE(reports.size() == 3);
  CHECK(records[0].skipped == 1);
  for (std::size_t i = 0; i < 3; ++i) {
    INFO("step " << i + 1);
    CHECK(reports[i].step == i + 1);
    CHECK(reports[i].skipped == (records[i].skipped != 0));
  }
  CHECK_THAT(mpx::shadow_table(reports), Contains("overflowed and were skipped"));
}

TEST_CASE("steps that overflowed are left out of the means, and said so", "[model][shadow]") {
  auto report = [](std::size_t step, double output, bool skipped) {
    mpx::shadow_report r;
    r.step = step;
    r.skipped = skipped;
    mpx::layer_error e;
    e.layer = "dense";
    e.kind = "Dense";
    e.policy = "mixed_float16";
    e.output = output;
    r.layers.push_back(e);
    return r;
  };
  std::vector<mpx::shadow_report> const reports{report(10, 1e-3, false), report(20, INFINITY, true),
                                                 report(30, 3e-3, false)};
  auto const mean = mpx::mean_layer_errors(reports);
  REQUIRE(mean[0].output.has_value());
  CHECK(*mean[0].output == Approx(2e-3));
  auto const table = mpx::shadow_table(reports);
  CHECK_THAT(table, Contains("mean of 2 shadow steps"));
  CHECK_THAT(table, Contains("1 more shadow step overflowed"));
  CHECK_THAT(table, Contains("Costliest: dense (output 2.0e-03)"));
}

TEMPLATE_LIST_TEST_CASE("shadowing does not change the training, bit for bit; fit logs and prints it",
                        "[model][shadow]", mpx_test::executors) {
  TestType exec;
  using Space = mpx::memory_space_t<TestType>;
  auto const data = image_data(exec, 40);
  auto train = [&](std::size_t shadow_every, std::filesystem::path const& csv, bool cuda_graph = false) {
    auto model = image_model<mpx::mixed_float16>();
    model.build(exec, {8, 8, 1}, 5);
    auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f),
                                               mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
    mpx::tensor_batches<float, Space> batches{data.images, data.labels, 8};
    mpx::fit_options options;
    options.epochs = 2;
    options.quiet = true;
    options.shadow_every = shadow_every;
    options.csv_log = csv;
    options.cuda_graph = cuda_graph;  // (the host executor ignores it)
    auto history = mpx::fit(exec, model, optimizer, batches, options);
    std::vector<std::vector<double>> values;
    for (auto const& p : model.parameters(exec)) values.push_back(values_of(exec, p.value));
    return std::make_pair(std::move(history), std::move(values));
  };
  mpx_test::scratch_dir dir("shadow_fit");
  auto const [plain, plain_values] = train(0, dir.path / "plain.csv");
  auto const [shadowed, shadowed_values] = train(3, dir.path / "shadowed.csv");
  REQUIRE(plain_values.size() == shadowed_values.size());
  for (std::size_t i = 0; i < plain_values.size(); ++i)
    CHECK(mpx_test::first_mismatch(shadowed_values[i], plain_values[i]).empty());
  {  // Steps replayed from a CUDA graph, a shadow step every other step: eager, on the replay's buffers.
    auto const [graph_plain, graph_plain_values] = train(0, dir.path / "graph_plain.csv", true);
    auto const [graph_shadowed, graph_shadowed_values] = train(2, dir.path / "graph_shadowed.csv", true);
    REQUIRE(graph_plain_values.size() == graph_shadowed_values.size());
    for (std::size_t i = 0; i < graph_plain_values.size(); ++i)
      CHECK(mpx_test::first_mismatch(graph_shadowed_values[i], graph_plain_values[i]).empty());
    CHECK(graph_shadowed[1].loss == graph_plain[1].loss);
    CHECK(graph_shadowed[0].shadow.size() + graph_shadowed[1].shadow.size() == 5);
  }
  REQUIRE(shadowed.size() == 2);
  for (std::size_t e = 0; e < 2; ++e) {
    CHECK(shadowed[e].loss == plain[e].loss);
    CHECK(shadowed[e].loss_scale == plain[e].loss_scale);
    CHECK(plain[e].shadow.empty());
  }
  // 5 steps an epoch: steps 3, 6 and 9 were shadowed (step 6 in the second epoch).
  REQUIRE(shadowed[0].shadow.size() == 1);
  REQUIRE(shadowed[1].shadow.size() == 2);
  CHECK(shadowed[1].shadow[0].step == 6);
  auto const& layers = shadowed[0].shadow[0].layers;
  REQUIRE(layers.size() == 7);
  CHECK(layers[4].layer == "dropout");
  CHECK_THAT(layers[4].skipped, Contains("random"));
  CHECK_FALSE(layers[4].output.has_value());
  for (std::size_t i : {0, 1, 5}) {  // conv2d, batch norm and dense cost something in float16
    INFO(layers[i].layer);
    REQUIRE(layers[i].output.has_value());
    CHECK(*layers[i].output > 0.0);
    CHECK(*layers[i].output < 1e-2);
    REQUIRE(layers[i].weight_gradient.has_value());
    CHECK(*layers[i].weight_gradient >= 0.0);  // batch norm's: float arithmetic on the same values, so 0
    CHECK(*layers[i].weight_gradient < 5e-2);
    if (i != 1) CHECK(*layers[i].weight_gradient > 0.0);
  }
  // The CSV: three columns per layer, filled on the shadowed steps only.
  std::ifstream csv(dir.path / "shadowed.csv");
  std::string header, line;
  std::getline(csv, header);
  CHECK_THAT(header, Contains(",error/conv2d/output,error/conv2d/input_gradient,error/conv2d/weight_gradient"));
  CHECK_THAT(header, Contains("error/softmax/weight_gradient"));
  std::vector<std::string> rows;
  while (std::getline(csv, line)) rows.push_back(line);
  REQUIRE(rows.size() == 10);
  auto const commas = [](std::string const& s) { return std::count(s.begin(), s.end(), ','); };
  for (auto const& r : rows) CHECK(commas(r) == commas(header));
  CHECK_THAT(rows[1], Contains(",,,,"));  // step 2: the shadow's cells are empty
  CHECK_THAT(rows[2], !Contains(",,,,,,"));  // step 3: measured (dropout's cells alone are empty)
  auto const table = mpx::shadow_table(shadowed[1].shadow);
  CHECK_THAT(table, Contains("mean of 2 shadow steps"));
  CHECK_THAT(table, Contains("dropout (Dropout)"));
  CHECK_THAT(table, Contains("not measured: draws random numbers"));
}

}  // namespace shadow_tests
