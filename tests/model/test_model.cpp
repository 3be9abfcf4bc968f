// mpx::sequential, classifier_trainer, fit/evaluate and model files, on each executor:
// names and shapes, the casts the model inserts between policies (checked against the
// same layers run by hand), backpropagation through the whole stack against finite
// differences of the model's own float32 forward, training that learns, per-step
// records, the CSV log, and save/load round trips and refusals.
#include "../support/testing.hpp"

#include <mpx/layers/attention.hpp>
#include <mpx/layers/conv2d.hpp>
#include <mpx/layers/dense.hpp>
#include <mpx/layers/dropout.hpp>
#include <mpx/layers/flatten.hpp>
#include <mpx/layers/lstm.hpp>
#include <mpx/layers/max_pool2d.hpp>
#include <mpx/layers/softmax_layer.hpp>
#include <mpx/data/tensor_batches.hpp>
#include <mpx/dist/communicator.hpp>
#include <mpx/model/fit.hpp>
#include <mpx/model/graph_capture_rules.hpp>
#include <mpx/model/model_file.hpp>
#include <mpx/model/sequential.hpp>
#include <mpx/optim/adam.hpp>
#include <mpx/optim/sgd.hpp>
#include <mpx/scaling/loss_scaler.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include <unistd.h>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

fs::path scratch_dir(std::string const& name) {
  fs::path const d = fs::temp_directory_path() / ("mpx_test_model_" + name + "_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return d;
}

// Samples and labels resident in the executor's memory.
template <class Exec, class T>
struct labelled_points {
  using space = mpx::memory_space_t<Exec>;
  mpx::tensor<T, space> images;
  mpx::tensor<std::int32_t, space> labels;
  mpx::tensor_batches<T, space> batches(std::size_t batch) const { return {images, labels, batch}; }
};

// Points in 2-D, the class the quadrant they fall in: a dense net separates them.
template <class Exec, class T>
labelled_points<Exec, T> quadrants(Exec const& exec, std::int64_t n, std::uint64_t stream) {
  auto xy = mpx_test::random_values<float>(static_cast<std::size_t>(2 * n), -1.0, 1.0, stream);
  std::vector<T> images(xy.size());
  std::vector<std::int32_t> labels(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    float const x = xy[2 * i], y = xy[2 * i + 1];
    labels[i] = (x > 0 ? 1 : 0) + (y > 0 ? 2 : 0);
    images[2 * i] = mpx::cast<T>(x);
    images[2 * i + 1] = mpx::cast<T>(y);
  }
  return {mpx_test::upload(exec, images, {n, 2}), mpx_test::upload(exec, labels, {n})};
}

template <class P>
auto quadrant_model() {
  return mpx::sequential<P>(mpx::dense<>(16, mpx::activation::tanh), mpx::dense<>(4),
                            mpx::softmax_layer<mpx::float32>());
}

}  // namespace

TEMPLATE_LIST_TEST_CASE("sequential names layers like Keras, computes shapes and prints a summary", "[model]",
                        mpx_test::executors) {
  TestType exec;
  auto model = mpx::sequential<mpx::mixed_float16>(
      mpx::conv2d<>(4, 3, mpx::activation::relu), mpx::max_pool2d<>(2), mpx::conv2d<>(5, 2), mpx::flatten<>(),
      mpx::dense<>(7, mpx::activation::relu), mpx::dense<>(3), mpx::softmax_layer<mpx::float32>());
  using model_type = decltype(model);
  static_assert(std::is_same_v<typename model_type::input_type, mpx::half>);
  static_assert(std::is_same_v<typename model_type::output_type, float>);
  static_assert(std::is_same_v<typename model_type::logits_type, float>);  // the softmax's input, after the cast
  static_assert(model_type::ends_in_softmax);
  model.build(exec, {9, 10, 2}, 5);
  CHECK(model.layer<0>().name() == "conv2d");
  CHECK(model.layer<2>().name() == "conv2d_1");
  CHECK(model.layer<1>().name() == "max_pool2d");
  CHECK(model.layer<5>().name() == "dense_1");
  CHECK(model.layer<6>().name() == "softmax");
  CHECK(model.layer<0>().output_shape() == mpx::shape{7, 8, 4});
  CHECK(model.layer<1>().output_shape() == mpx::shape{3, 4, 4});
  CHECK(model.layer<2>().output_shape() == mpx::shape{2, 3, 5});
  CHECK(model.layer<3>().output_shape() == mpx::shape{30});
  CHECK(model.output_shape() == mpx::shape{3});
  std::size_t const expected = (3 * 3 * 2 * 4 + 4) + (2 * 2 * 4 * 5 + 5) + (30 * 7 + 7) + (7 * 3 + 3);
  CHECK(model.parameter_count() == expected);
  auto params = model.parameters(exec);
  REQUIRE(params.size() == 8);
  CHECK(params[0].name == "conv2d/kernel");
  CHECK(params[7].name == "dense_1/bias");
  std::string const s = model.summary();
  INFO(s);
  CHECK(s.find("conv2d_1 (Conv2D)") != std::string::npos);
  CHECK(s.find("(None, 7, 8, 4)") != std::string::npos);
  CHECK(s.find("(cast to float32)") != std::string::npos);
  CHECK(s.find("mixed_float16") != std::string::npos);
  CHECK(s.find("Total params: " + std::to_string(expected)) != std::string::npos);
  // Only the softmax, whose policy differs, gets a cast.
  CHECK(s.find("(cast") == s.rfind("(cast"));
}

TEST_CASE("the summary notes an fp8 first layer and an fp8 logits layer, and nothing when they are kept out",
          "[model][fp8]") {
  mpx::host_executor exec;
  auto all_fp8 = mpx::sequential<mpx::mixed_fp8>(mpx::dense<>(32, mpx::activation::relu), mpx::dense<>(32),
                                                 mpx::dense<>(16), mpx::softmax_layer<mpx::float32>());
  all_fp8.build(exec, {16}, 1);
  std::string const s = all_fp8.summary();
  INFO(s);
  CHECK_THAT(s, Catch::Contains("Note: dense (the first layer, it reads the raw inputs) computes in fp8; keep it in "
                                "bfloat16 with mpx::without_fp8<mpx::mixed_fp8>"));
  CHECK_THAT(s, Catch::Contains("Note: dense_2 (it makes the logits) computes in fp8"));
  CHECK_THAT(s, !Catch::Contains("Note: dense_1"));

  using P = mpx::mixed_fp8;
  auto advised = mpx::sequential<P>(mpx::dense<mpx::without_fp8<P>>(32, mpx::activation::relu), mpx::dense<>(32),
                                    mpx::dense<mpx::without_fp8<P>>(16), mpx::softmax_layer<mpx::float32>());
  advised.build(exec, {16}, 1);
  INFO(advised.summary());
  CHECK_THAT(advised.summary(), !Catch::Contains("Note:"));
}

TEMPLATE_LIST_TEST_CASE("the cast sequential inserts gives what the layers give by hand", "[model]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  // bfloat16 dense layers, a float32 dense after them: the model casts bf16 -> float.
  auto model = mpx::sequential(mpx::dense<mpx::mixed_bfloat16>(6, mpx::activation::relu),
                               mpx::dense<mpx::float32>(3));
  model.build(exec, {5}, 11);
  std::int64_t const n = 7;
  auto const xs = mpx_test::random_values<float>(n * 5, -2, 2, 3);
  auto x = mpx_test::upload(exec, xs, {n, 5});  // float input: cast to bfloat16 for the first layer
  auto const y = mpx_test::download(exec, model.forward(exec, mpx::view(std::as_const(x)), false));
  auto const w0 = mpx_test::download(exec, model.layer<0>().template kernel<space>());
  auto const b0 = mpx_test::download(exec, model.layer<0>().template bias<space>());
  auto const w1 = mpx_test::download(exec, model.layer<1>().template kernel<space>());
  auto const b1 = mpx_test::download(exec, model.layer<1>().template bias<space>());
  for (std::int64_t i = 0; i < n; ++i) {
    std::vector<float> h(6);
    for (int j = 0; j < 6; ++j) {
      float acc = 0;
      for (int k = 0; k < 5; ++k)
        acc += mpx::cast<float>(mpx::cast<mpx::bfloat16>(xs[i * 5 + k])) * mpx::cast<float>(w0[k * 6 + j]);
      // the layer rounds x W to bfloat16, adds the bias in float, rounds the relu once
      float const z = mpx::cast<float>(mpx::cast<mpx::bfloat16>(acc)) + mpx::cast<float>(b0[j]);
      h[j] = mpx::cast<float>(mpx::cast<mpx::bfloat16>(z > 0 ? z : 0.0f));  // the inserted cast widens exactly
    }
    for (int j = 0; j < 3; ++j) {
      double acc = 0;
      for (int k = 0; k < 6; ++k) acc += static_cast<double>(h[k]) * w1[k * 3 + j];
      acc += b1[j];
      CHECK(std::fabs(y[i * 3 + j] - acc) <= 1e-5 * (1 + std::fabs(acc)));
    }
  }
}

// Backpropagates L = sum(out * r) for a fixed random r through a float32 model and
// checks every 7th-or-so element of each parameter's gradient against a central finite
// difference of the model's own forward; returns how many were checked.
template <class Exec, class Model>
int check_gradients_by_finite_differences(Exec const& exec, Model& model, mpx::tensor_view<float const, mpx::memory_space_t<Exec>> x,
                                          std::size_t expected_parameters) {
  using space = mpx::memory_space_t<Exec>;
  auto const out_shape = model.forward(exec, x, true).shape();
  auto const r = mpx_test::random_values<float>(out_shape.size(), -1, 1, 10);
  auto loss = [&] {
    auto const out = mpx_test::download(exec, model.forward(exec, x, true));
    double l = 0;
    for (std::size_t i = 0; i < out.size(); ++i) l += static_cast<double>(out[i]) * r[i];
    return l;
  };
  loss();
  auto dout = mpx_test::upload(exec, r, out_shape);
  model.backward(exec, mpx::tensor_view<float const, space>(mpx::view(dout)));
  auto params = model.parameters(exec);
  REQUIRE(params.size() == expected_parameters);
  int checked = 0;
  for (auto& p : params) {
    auto value = p.value.template as<float>();
    auto const grad = mpx_test::download(exec, p.gradient.template as<float>());
    auto host = mpx_test::download(exec, value);
    for (std::size_t i = 0; i < host.size(); i += 1 + host.size() / 7) {
      float const keep = host[i];
      float const h = 1e-3f;
      auto set = [&](float v) {
        host[i] = v;
        mpx::copy(exec, mpx::tensor_view<float const, mpx::host_space>(host.data(), value.shape()), value);
      };
      set(keep + h);
      double const up = loss();
      set(keep - h);
      double const down = loss();
      set(keep);
      double const fd = (up - down) / (2 * h);
      INFO(p.name << "[" << i << "]: backprop " << grad[i] << ", finite difference " << fd);
      CHECK(std::fabs(grad[i] - fd) <= 5e-3 * (1 + std::fabs(fd)));
      ++checked;
    }
  }
  return checked;
}

TEMPLATE_LIST_TEST_CASE("backpropagation through a conv net matches finite differences of its forward", "[model]",
                        mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  auto model = mpx::sequential<mpx::float32>(mpx::conv2d<>(3, 3, mpx::activation::tanh, mpx::padding::same),
                                             mpx::max_pool2d<>(2), mpx::flatten<>(), mpx::dense<>(4, mpx::activation::sigmoid),
                                             mpx::dense<>(2));
  model.build(exec, {6, 5, 2}, 3);
  std::int64_t const n = 3;
  auto x = mpx_test::upload(exec, mpx_test::random_values<float>(n * 60, -1, 1, 9), {n, 6, 5, 2});
  CHECK(check_gradients_by_finite_differences(exec, model, mpx::tensor_view<float const, space>(mpx::view(x)), 6) > 20);
}

TEMPLATE_LIST_TEST_CASE("backpropagation through LSTM layers matches finite differences of their forward", "[model]",
                        mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  std::int64_t const n = 3, steps = 4, features = 2;
  auto x = mpx_test::upload(exec, mpx_test::random_values<float>(n * steps * features, -1, 1, 12), {n, steps, features});
  auto const xc = mpx::tensor_view<float const, space>(mpx::view(x));
  // The last step only (Keras's default) ...
  auto last = mpx::sequential<mpx::float32>(mpx::lstm<>(5), mpx::dense<>(3));
  last.build(exec, {steps, features}, 4);
  CHECK(last.output_shape() == mpx::shape{3});
  CHECK(last.parameter_count() == (2 * 20 + 5 * 20 + 20) + (5 * 3 + 3));
  CHECK(check_gradients_by_finite_differences(exec, last, xc, 5) > 20);
  // ... and every step, into a second LSTM.
  auto stacked = mpx::sequential<mpx::float32>(mpx::lstm<>(4, true), mpx::lstm<>(3), mpx::dense<>(2));
  stacked.build(exec, {steps, features}, 5);
  CHECK(stacked.layer<0>().output_shape() == mpx::shape{steps, 4});
  CHECK(check_gradients_by_finite_differences(exec, stacked, xc, 8) > 30);
}

// backward reads only what forward saved: running it twice (for a second loss, or to
// inspect gradients) must give the same gradients, so no layer may consume its saved
// pre-activations or im2col columns.
TEMPLATE_LIST_TEST_CASE("a second backward after one forward gives the same gradients", "[model]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  auto model = mpx::sequential<mpx::float32>(mpx::conv2d<>(3, 3, mpx::activation::relu, mpx::padding::same),
                                             mpx::max_pool2d<>(2), mpx::conv2d<>(2, 2, mpx::activation::tanh),
                                             mpx::flatten<>(), mpx::dense<>(5, mpx::activation::gelu),
                                             mpx::dense<>(2, mpx::activation::sigmoid));
  model.build(exec, {6, 6, 2}, 21);
  std::int64_t const n = 3;
  auto x = mpx_test::upload(exec, mpx_test::random_values<float>(n * 72, -1, 1, 22), {n, 6, 6, 2});
  auto const out_shape = model.forward(exec, mpx::tensor_view<float const, space>(mpx::view(x)), true).shape();
  auto dout = mpx_test::upload(exec, mpx_test::random_values<float>(out_shape.size(), -1, 1, 23), out_shape);
  auto gradients = [&] {
    model.backward(exec, mpx::tensor_view<float const, space>(mpx::view(dout)));
    std::vector<std::vector<float>> g;
    for (auto& p : model.parameters(exec)) g.push_back(mpx_test::download(exec, p.gradient.template as<float>()));
    return g;
  };
  auto const first = gradients();
  model.allow_backward_without_forward(true);  // the same batch again, on purpose
  auto const second = gradients();
  REQUIRE(first.size() == 8);
  for (std::size_t i = 0; i < first.size(); ++i) {
    INFO("parameter " << i);
    CHECK(first[i] == second[i]);
    bool any_nonzero = false;
    for (float v : first[i]) any_nonzero = any_nonzero || v != 0;
    CHECK(any_nonzero);
  }
}

TEMPLATE_LIST_TEST_CASE("a mixed_float16 classifier learns, and every step is recorded", "[model]", mpx_test::executors) {
  TestType exec;
  auto const points = quadrants<TestType, mpx::half>(exec, 512, 21);
  auto data = points.batches(64);
  auto model = quadrant_model<mpx::mixed_float16>();
  model.build(exec, {2}, 1);
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 2e-2f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  auto const before = mpx::evaluate(exec, model, data);
  CHECK_THROWS_TYPE_WITH(mpx::classifier_trainer(exec, model, optimizer, 0), mpx::invalid_argument,
                         Catch::Contains("at least one step"));
  fs::path const dir = scratch_dir("fit");
  mpx::fit_options options;
  options.epochs = 6;
  options.quiet = true;
  options.csv_log = dir / "log.csv";
  auto const history = mpx::fit(exec, model, optimizer, data, options, &data);
  REQUIRE(history.size() == 6);
  CHECK(history[0].steps == 8);
  CHECK(history.back().skipped_steps == 0);
  CHECK(history.back().loss_scale == 32768.0f);
  CHECK(history.back().loss < history[0].loss);
  CHECK(history.back().validation.accuracy > 0.9);
  CHECK(before.accuracy < 0.6);
  CHECK(history.back().validation.samples == 512);
  std::ifstream csv(options.csv_log);
  std::string line;
  std::getline(csv, line);
  CHECK(line == "epoch,step,loss,loss_scale,skipped,gradient_norm,accuracy,seconds");
  int rows = 0;
  while (std::getline(csv, line)) ++rows;
  CHECK(rows == 48);
  // The op is named once: "mpx::fit: ...", not "mpx::mpx::fit: ...".
  options.csv_log = dir / "no such folder" / "log.csv";
  CHECK_THROWS_TYPE_WITH(mpx::fit(exec, model, optimizer, data, options), mpx::invalid_argument,
                         Catch::StartsWith("mpx::fit: cannot write the CSV log"));
  fs::remove_all(dir);
}

// A batch source that announces fewer batches than it yields.
template <class Inner>
struct under_announced {
  Inner inner;
  std::size_t batches_per_epoch() const { return 1; }
  void start_epoch(std::size_t e) { inner.start_epoch(e); }
  auto next() { return inner.next(); }
};

TEMPLATE_LIST_TEST_CASE("evaluate weighs each batch by its size and agrees with the model's own outputs", "[model]",
                        mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  auto const points = quadrants<TestType, mpx::half>(exec, 100, 25);
  auto model = quadrant_model<mpx::float32>();
  model.build(exec, {2}, 3);
  // The reference: the whole set in one forward, the softmax's probabilities in float64.
  auto const probabilities =
      mpx_test::download(exec, model.forward(exec, mpx::tensor_view<mpx::half const, space>(mpx::view(points.images)), false));
  auto const labels = mpx_test::download(exec, points.labels);
  double loss = 0;
  std::size_t correct = 0;
  for (std::size_t i = 0; i < labels.size(); ++i) {
    auto const row = probabilities.begin() + static_cast<std::ptrdiff_t>(4 * i);
    loss -= std::log(static_cast<double>(row[labels[i]]));
    correct += std::max_element(row, row + 4) - row == labels[i];
  }
  loss /= 100;
  auto check = [&](mpx::evaluation const& e) {
    CHECK(e.samples == 100);
    CHECK(std::fabs(e.loss - loss) <= 1e-5 * (1 + loss));
    CHECK(e.accuracy == static_cast<double>(correct) / 100);
  };
  auto batches = points.batches(32);  // 32, 32, 32 and 4: a mean of means would weigh the 4 as 32
  check(mpx::evaluate(exec, model, batches));
  under_announced<mpx::tensor_batches<mpx::half, space>> more{points.batches(7)};  // 15 batches, read in rounds
  check(mpx::evaluate(exec, model, more));
}

TEMPLATE_LIST_TEST_CASE("an overflowing step is skipped, recorded, and the scale backs off", "[model]",
                        mpx_test::executors) {
  TestType exec;
  auto const points = quadrants<TestType, mpx::half>(exec, 64, 22);
  auto data = points.batches(64);
  auto model = quadrant_model<mpx::mixed_float16>();
  model.build(exec, {2}, 1);
  // A scale of 2^24 makes the half gradients of the first layers overflow.
  mpx::dynamic_scale_rule rule = mpx::keras_loss_scale();
  rule.initial_scale = 16777216.0f;
  rule.max_scale = 16777216.0f;
  auto optimizer = mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.1f),
                                             mpx::dynamic_loss_scaler(exec, rule));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  auto const before = mpx_test::download(exec, model.template layer<0>().template kernel<mpx::memory_space_t<TestType>>());
  data.start_epoch(0);
  auto b = data.next();
  trainer.step(exec, b->images, b->labels);
  auto const records = trainer.history(exec);
  REQUIRE(records.size() == 1);
  CHECK(records[0].skipped == 1);
  CHECK(records[0].loss_scale == 16777216.0f);
  CHECK(std::isfinite(records[0].loss));
  CHECK(records[0].samples == 64);
  CHECK(optimizer.scaler().scale(exec) == 8388608.0f);
  auto const after = mpx_test::download(exec, model.template layer<0>().template kernel<mpx::memory_space_t<TestType>>());
  CHECK(mpx_test::first_mismatch(after, before).empty());  // the skipped step left the weights alone
}

TEMPLATE_LIST_TEST_CASE("a converting load takes a float16 model's file into bfloat16 layers, rounding each value "
                        "once, and refuses a value the new dtype cannot hold",
                        "[model]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  fs::path const dir = scratch_dir("converting");
  auto half_model = quadrant_model<mpx::mixed_float16>();
  half_model.build(exec, {2}, 1);
  mpx::save_model(exec, half_model, dir / "half.mpx");
  auto bf16_model = quadrant_model<mpx::mixed_bfloat16>();
  bf16_model.build(exec, {2}, 7);
  CHECK_THROWS_TYPE_WITH(mpx::load_model(exec, bf16_model, dir / "half.mpx"), mpx::checkpoint_error,
                         Catch::Contains("is float16 [2, 16] but this model's is bfloat16 [2, 16]") &&
                             Catch::Contains("mpx::model_load::converting"));
  mpx::load_model(exec, bf16_model, dir / "half.mpx", mpx::model_load::converting);
  auto const saved = mpx_test::download(exec, half_model.template layer<0>().template kernel<space>());
  auto const loaded = mpx_test::download(exec, bf16_model.template layer<0>().template kernel<space>());
  REQUIRE(saved.size() == loaded.size());
  std::size_t changed = 0;
  for (std::size_t i = 0; i < saved.size(); ++i) {
    float const want = mpx::cast<float>(mpx::cast<mpx::bfloat16>(mpx::cast<float>(saved[i])));
    CHECK(mpx::cast<float>(loaded[i]) == want);
    changed += want != mpx::cast<float>(saved[i]);
  }
  CHECK(changed > 0);  // bfloat16 keeps fewer bits than float16: the rounding happened

  // A float32 model with a weight past float16's range: refused, the model unchanged.
  auto wide = quadrant_model<mpx::float32>();
  wide.build(exec, {2}, 3);
  std::vector<float> big(32, 0.5f);
  big[17] = 1.0e6f;
  mpx::copy(exec, mpx::tensor_view<float const, mpx::host_space>(big.data(), {2, 16}),
            wide.template layer<0>().template kernel<space>());
  mpx::save_model(exec, wide, dir / "wide.mpx");
  auto narrow = quadrant_model<mpx::mixed_float16>();
  narrow.build(exec, {2}, 4);
  auto const before = mpx_test::download(exec, narrow.template layer<0>().template kernel<space>());
  CHECK_THROWS_TYPE_WITH(mpx::load_model(exec, narrow, dir / "wide.mpx", mpx::model_load::converting),
                         mpx::checkpoint_error,
                         Catch::Contains("'dense/kernel' holds 1e+06 (element 17), which float16 cannot hold"));
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, narrow.template layer<0>().template kernel<space>()), before)
            .empty());
  fs::remove_all(dir);
}

TEMPLATE_LIST_TEST_CASE("a saved model loads back bit for bit; a mismatched file is refused and changes nothing",
                        "[model]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  fs::path const dir = scratch_dir("file");
  auto a = quadrant_model<mpx::mixed_bfloat16>();
  a.build(exec, {2}, 1);
  mpx::save_model(exec, a, dir / "a.mpx");
  auto b = quadrant_model<mpx::mixed_bfloat16>();
  b.build(exec, {2}, 99);  // other weights
  auto const b_before = mpx_test::download(exec, b.template layer<0>().template kernel<space>());
  mpx::load_model(exec, b, dir / "a.mpx");
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, b.template layer<0>().template kernel<space>()),
                                 mpx_test::download(exec, a.template layer<0>().template kernel<space>()))
            .empty());
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, b.template layer<1>().template bias<space>()),
                                 mpx_test::download(exec, a.template layer<1>().template bias<space>()))
            .empty());

  // Another policy: the dtype differs.
  auto c = quadrant_model<mpx::mixed_float16>();
  c.build(exec, {2}, 5);
  auto const c_before = mpx_test::download(exec, c.template layer<0>().template kernel<space>());
  CHECK_THROWS_TYPE_WITH(mpx::load_model(exec, c, dir / "a.mpx"), mpx::checkpoint_error,
                         Catch::Contains("'dense/kernel' is bfloat16 [2, 16] but this model's is float16 [2, 16]") &&
                             Catch::Contains("nothing was loaded"));
  CHECK(mpx_test::first_mismatch(mpx_test::download(exec, c.template layer<0>().template kernel<space>()), c_before)
            .empty());
  // Another width.
  auto d = mpx::sequential<mpx::mixed_bfloat16>(mpx::dense<>(8, mpx::activation::tanh), mpx::dense<>(4));
  d.build(exec, {2}, 5);
  CHECK_THROWS_TYPE_WITH(mpx::load_model(exec, d, dir / "a.mpx"), mpx::checkpoint_error,
                         Catch::Contains("[2, 8]"));
  // A truncated file.
  {
    std::ifstream in(dir / "a.mpx", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream out(dir / "short.mpx", std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() / 2));
  }
  CHECK_THROWS_AS(mpx::load_model(exec, b, dir / "short.mpx"), mpx::checkpoint_error);
  CHECK_THROWS_AS(mpx::load_model(exec, b, dir / "missing.mpx"), mpx::checkpoint_error);
  (void)b_before;
  fs::remove_all(dir);
}

TEMPLATE_LIST_TEST_CASE("training state round trip: model, optimizer and scaler resume where they were", "[model]",
                        mpx_test::executors) {
  TestType exec;
  fs::path const dir = scratch_dir("state");
  auto const points = quadrants<TestType, mpx::half>(exec, 128, 23);
  auto data = points.batches(32);
  auto run = [&](auto& model, auto& optimizer, std::size_t epochs) {
    mpx::fit_options o;
    o.epochs = epochs;
    o.quiet = true;
    return mpx::fit(exec, model, optimizer, data, o);
  };
  auto m1 = quadrant_model<mpx::mixed_float16>();
  m1.build(exec, {2}, 1);
  auto o1 = mpx::loss_scale_optimizer(mpx::adam(exec, m1.parameters(exec), 1e-2f),
                                      mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  run(m1, o1, 2);
  mpx::save_training_state(exec, m1, o1, dir);
  auto const continued = run(m1, o1, 1);

  auto m2 = quadrant_model<mpx::mixed_float16>();
  m2.build(exec, {2}, 7);
  auto o2 = mpx::loss_scale_optimizer(mpx::adam(exec, m2.parameters(exec), 1e-2f),
                                      mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::load_training_state(exec, m2, o2, dir);
  auto const resumed = run(m2, o2, 1);
  CHECK(resumed[0].loss == continued[0].loss);
  CHECK(resumed[0].accuracy == continued[0].accuracy);
  fs::remove_all(dir);
}

// Every parameter's values, bit patterns as floats.
template <class Exec, class Model>
std::vector<std::vector<float>> weights_of(Exec const& exec, Model& model) {
  std::vector<std::vector<float>> out;
  for (auto const& p : model.parameters(exec))
    mpx::visit_dtype(p.value.dtype(), [&](auto t) {
      using T = decltype(t);
      std::vector<float> w;
      for (T v : mpx_test::download(exec, p.value.template as<T>())) w.push_back(static_cast<float>(v));
      out.push_back(std::move(w));
    });
  return out;
}

TEMPLATE_LIST_TEST_CASE("fit resumes where load_training_state says: the uninterrupted run's epochs, batches and "
                        "weights",
                        "[model]", mpx_test::executors) {
  TestType exec;
  fs::path const dir = scratch_dir("fit_start");
  auto const points = quadrants<TestType, mpx::half>(exec, 128, 29);
  auto data = points.batches(32);  // 4 batches an epoch
  auto make = [&](std::uint64_t seed) {
    auto m = quadrant_model<mpx::mixed_float16>();
    m.build(exec, {2}, seed);
    return m;
  };
  auto optimizer_of = [&](auto& m) {
    return mpx::loss_scale_optimizer(mpx::adam(exec, m.parameters(exec), 1e-2f),
                                     mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  };
  auto m1 = make(1);
  auto o1 = optimizer_of(m1);
  mpx::fit_options options;
  options.epochs = 3;
  options.quiet = true;
  options.on_epoch_end = [&](mpx::epoch_summary const& s) {
    if (s.epoch == 1) mpx::save_training_state(exec, m1, o1, dir, {.epoch = 1, .batch = 0, .steps = s.steps});
  };
  auto const whole = mpx::fit(exec, m1, o1, data, options);
  REQUIRE(whole.size() == 3);
  options.on_epoch_end = nullptr;

  auto m2 = make(7);
  auto o2 = optimizer_of(m2);
  options.start = mpx::load_training_state(exec, m2, o2, dir);
  CHECK(options.start == mpx::training_position{1, 0, 4});
  auto const resumed = mpx::fit(exec, m2, o2, data, options);
  REQUIRE(resumed.size() == 2);
  CHECK(resumed[0].epoch == 2);
  CHECK(resumed[1].epoch == 3);
  for (std::size_t e = 0; e < 2; ++e) {
    CHECK(resumed[e].steps == 4);
    CHECK(resumed[e].loss == whole[e + 1].loss);
    CHECK(resumed[e].accuracy == whole[e + 1].accuracy);
  }
  CHECK(weights_of(exec, m2) == weights_of(exec, m1));

  // From a batch within an epoch: that epoch runs its remaining batches.
  auto m3 = make(8);
  auto o3 = optimizer_of(m3);
  mpx::load_training_state(exec, m3, o3, dir);
  options.start = {.epoch = 1, .batch = 3, .steps = 4};
  auto const late = mpx::fit(exec, m3, o3, data, options);
  REQUIRE(late.size() == 2);
  CHECK(late[0].epoch == 2);
  CHECK(late[0].steps == 1);
  CHECK(late[1].steps == 4);
  CHECK(weights_of(exec, m3) != weights_of(exec, m1));  // three of epoch 2's batches were never seen

  // A run already finished trains nothing; one past its end is refused.
  options.start = {.epoch = 3, .batch = 0, .steps = 12};
  CHECK(mpx::fit(exec, m3, o3, data, options).empty());
  options.start = {.epoch = 3, .batch = 1, .steps = 13};
  CHECK_THROWS_TYPE_WITH(mpx::fit(exec, m3, o3, data, options), mpx::invalid_argument,
                         Catch::Contains("the run starts at epoch 4, batch 1, after its last epoch") &&
                             Catch::Contains("fit_options::epochs is 3"));
  fs::remove_all(dir);
}

TEMPLATE_LIST_TEST_CASE("fit and evaluate refuse data with no samples", "[model]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  auto const points = quadrants<TestType, mpx::half>(exec, 8, 31);
  auto data = points.batches(4);
  auto model = quadrant_model<mpx::mixed_float16>();
  model.build(exec, {2}, 1);
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::tensor<mpx::half, space> no_images(exec, mpx::shape{0, 2});
  mpx::tensor<std::int32_t, space> no_labels(exec, mpx::shape{0});
  mpx::tensor_batches<mpx::half, space> empty(no_images, no_labels, 4);
  mpx::fit_options options;
  options.quiet = true;
  CHECK_THROWS_TYPE_WITH(mpx::fit(exec, model, optimizer, empty, options), mpx::invalid_argument,
                         Catch::Contains("mpx::fit: the training data has no batches"));
  CHECK_THROWS_TYPE_WITH(mpx::evaluate(exec, model, empty), mpx::invalid_argument,
                         Catch::Contains("mpx::evaluate: the data holds no samples"));
  CHECK_THROWS_WITH(mpx::fit(exec, model, optimizer, data, options, &empty),  // once: it trains first
                    Catch::Contains("mpx::fit: the validation data holds no samples"));
  CHECK(optimizer.optimizer().steps(exec) == 2);  // the epoch ran; its validation was refused
  CHECK(mpx::evaluate(exec, model, data).samples == 8);
}

TEMPLATE_LIST_TEST_CASE("model errors name the layer and the shapes", "[model]", mpx_test::executors) {
  TestType exec;
  auto model = quadrant_model<mpx::float32>();
  CHECK_THROWS_TYPE_WITH(model.summary(), mpx::invalid_argument, Catch::Contains("before build"));
  model.build(exec, {2}, 1);
  auto x = mpx_test::upload(exec, std::vector<float>(12, 0.5f), {4, 3});
  CHECK_THROWS_TYPE_WITH(model.forward(exec, mpx::view(std::as_const(x)), false), mpx::shape_error,
                         Catch::Contains("[4, 3]") && Catch::Contains("[batch, 2]"));
  CHECK_THROWS_WITH(model.forward(exec, mpx::view(std::as_const(x)), false), Catch::StartsWith("mpx::sequential: "));
  auto convs = mpx::sequential<mpx::float32>(mpx::conv2d<>(2, 5));
  CHECK_THROWS_TYPE_WITH(convs.build(exec, {3, 3, 1}, 1), mpx::shape_error, Catch::Contains("[1, 3, 3, 1]"));
  CHECK_THROWS_TYPE_WITH(convs.build(exec, {9, 1}, 1), mpx::shape_error,
                         Catch::Contains("conv2d") && Catch::Contains("[9, 1]"));
  CHECK_THROWS_TYPE_WITH(mpx::dense<mpx::float32>(0), mpx::invalid_argument, Catch::Contains("units"));
}

namespace test_model_replicas {

// A call of a replica hook: which ('f' gradients_final, 'b' after_backward, 's' after_step,
// 'm' max_in_place), the executor it was given, and whether that stream was being
// captured into a CUDA graph at the time.
struct hook_call {
  char hook;
  mpx::step_executor at;
  bool capturing;
};

inline bool stream_capturing([[maybe_unused]] mpx::step_executor at) {
#if MPX_HAS_CUDA
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MPX_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(at.stream()), &status));
  return status == cudaStreamCaptureStatusActive;
#else
  return false;
#endif
}

using pure_bfloat16 = mpx::policy<mpx::bfloat16, mpx::bfloat16, float, mpx::bfloat16>;

}  // namespace test_model_replicas

// A data-parallel job's collectives must run where the step does: in graph mode that is
// the trainer's own stream (and, at capture, they must be captured with the step), not
// the caller's. Recording hooks see what each was given; an fp8 layer calls max_in_place.
TEMPLATE_LIST_TEST_CASE("replica hooks are given the executor the step runs on, in graph mode too", "[model][dist]",
                        mpx_test::executors) {
  using test_model_replicas::hook_call;
  TestType exec;
  auto const points = quadrants<TestType, mpx::bfloat16>(exec, 96, 31);
  for (bool graph : {false, true}) {
    INFO((graph ? "graph mode" : "eager"));
    // fp8 in the middle layer only (on the GPU, fp8 products need K and N multiples of 16).
    auto model = mpx::sequential<mpx::mixed_bfloat16>(mpx::dense<>(16, mpx::activation::tanh),
                                                      mpx::dense<mpx::mixed_fp8>(16, mpx::activation::tanh),
                                                      mpx::dense<>(4), mpx::softmax_layer<mpx::float32>());
    model.build(exec, {2}, 1);
    auto optimizer = mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.1f),
                                               mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
    mpx::classifier_trainer trainer(exec, model, optimizer);
    trainer.use_cuda_graph(graph);
    std::vector<hook_call> calls;
    auto note = [&](char hook, mpx::step_executor at) {
      calls.push_back({hook, at, test_model_replicas::stream_capturing(at)});
    };
    mpx::replica_hooks hooks;
    int before = 0;
    hooks.before_step = [&] {
      CHECK((calls.empty() || calls.back().hook == 's'));  // the step before it is over
      ++before;
    };
    hooks.gradients_final = [&](mpx::step_executor at, std::size_t) { note('f', at); };
    hooks.after_backward = [&](mpx::step_executor at) { note('b', at); };
    hooks.after_step = [&](mpx::step_executor at) { note('s', at); };
    hooks.max_in_place = [&](mpx::step_executor at, float*) { note('m', at); };
    hooks.step_replayed = [&](mpx::step_executor at) { note('r', at); };
    trainer.run_as_replica(hooks);
    auto data = points.batches(32);  // three steps of one shape: eager, captured, replayed in graph mode
    data.start_epoch(0);
    while (auto b = data.next()) trainer.step(exec, b->images, b->labels);
    REQUIRE(trainer.history(exec).size() == 3);

    bool const replays = graph && !mpx::is_host_executor_v<TestType>;
    std::size_t const bodies = replays ? 2 : 3;  // a replay calls one hook (r), its work is in the graph
    mpx::step_executor const caller(exec);
    auto count = [&](char hook) { return std::count_if(calls.begin(), calls.end(), [&](auto const& c) { return c.hook == hook; }); };
    CHECK(count('s') == 3);
    CHECK(before == 3);  // every step, a replay too
    CHECK(count('b') == static_cast<std::ptrdiff_t>(bodies));
    CHECK(count('f') >= static_cast<std::ptrdiff_t>(bodies));
    CHECK(count('m') == static_cast<std::ptrdiff_t>(3 * bodies));  // three fp8 roles per step
    CHECK(count('r') == (replays ? 2 : 0));  // after each launch (the captured step's too), on its stream
    std::size_t body = 0;
    for (auto const& c : calls) {
      INFO("hook " << c.hook << " of step body " << body);
      if (c.hook == 's') {
        CHECK(c.at == caller);  // after the step, on the caller's executor
        CHECK_FALSE(c.capturing);
        continue;
      }
      if (replays) {
        CHECK(c.at != caller);  // the trainer's own stream...
        CHECK(c.at == calls.front().at);  // ... the same for every hook of every step
        CHECK(c.capturing == (body == 1));  // the second step is captured, hooks included
      } else {
        CHECK(c.at == caller);
        CHECK_FALSE(c.capturing);
      }
      if (c.hook == 'b') ++body;
    }
  }
}

// A data-parallel replica whose transport failed (a collective its watchdog aborted)
// must not run another step, nor replay a captured one: before_step throws first.
TEMPLATE_LIST_TEST_CASE("a replica whose transport failed stops before its next step, a replay too", "[model][dist]",
                        mpx_test::executors) {
  TestType exec;
  auto const points = quadrants<TestType, mpx::bfloat16>(exec, 96, 31);
  for (bool graph : {false, true}) {
    INFO((graph ? "graph mode" : "eager"));
    auto model = mpx::sequential<mpx::mixed_bfloat16>(mpx::dense<>(16, mpx::activation::tanh), mpx::dense<>(4),
                                                      mpx::softmax_layer<mpx::float32>());
    model.build(exec, {2}, 1);
    auto optimizer = mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.1f),
                                               mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
    mpx::classifier_trainer trainer(exec, model, optimizer);
    trainer.use_cuda_graph(graph);
    int allowed = 2;  // the third step (a replay in graph mode) finds the transport broken
    mpx::replica_hooks hooks;
    hooks.before_step = [&] {
      if (allowed-- == 0) throw mpx::collective_error("the watchdog aborted all_reduce #5", {});
    };
    trainer.run_as_replica(hooks);
    auto data = points.batches(32);  // three steps of one shape
    data.start_epoch(0);
    int ran = 0;
    auto const train = [&] {
      while (auto b = data.next()) {
        trainer.step(exec, b->images, b->labels);
        ++ran;
      }
    };
    CHECK_THROWS_WITH(train(), Catch::Contains("all_reduce #5"));
    CHECK(ran == 2);
    CHECK(trainer.history(exec).size() == 2);
  }
}

// What a captured graph bakes in besides the buffers: the optimizer's rounding seed
// (restored by load) and the replica hooks (run_as_replica) must be seen as changes.
TEMPLATE_LIST_TEST_CASE("a trainer's graph state follows the rounding seed a load restores and run_as_replica",
                        "[model][dist]", mpx_test::executors) {
  using P = test_model_replicas::pure_bfloat16;
  TestType exec;
  fs::path const dir = scratch_dir("graph_state");
  auto make_optimizer = [&](auto& model, std::uint64_t seed) {
    return mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.1f, {}, mpx::master_weights_for<P>(true, seed)),
                                     mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  };
  auto other = quadrant_model<P>();
  other.build(exec, {2}, 2);
  auto other_optimizer = make_optimizer(other, 99);
  other_optimizer.optimizer().save(exec, dir / "seed_99.mpx");

  auto model = quadrant_model<P>();
  model.build(exec, {2}, 1);
  auto optimizer = make_optimizer(model, 5);
  mpx::classifier_trainer trainer(exec, model, optimizer);
  auto const initial = trainer.graph_state_now();
  CHECK(initial.stochastic_rounding);
  CHECK(trainer.graph_state_now() == initial);
  optimizer.optimizer().load(exec, dir / "seed_99.mpx");
  REQUIRE(optimizer.optimizer().master_options().seed == 99);
  auto const loaded = trainer.graph_state_now();
  CHECK_FALSE(loaded == initial);
  trainer.run_as_replica(mpx::replica_hooks{});
  auto const replica = trainer.graph_state_now();
  CHECK_FALSE(replica == loaded);
  trainer.run_as_replica(mpx::replica_hooks{});  // hooks installed again: what a graph captured is stale
  auto const again = trainer.graph_state_now();
  CHECK_FALSE(again == replica);
  optimizer.optimizer().rule().learning_rate.rate = 0.05f;  // as before the fix: the rule's values
  CHECK_FALSE(trainer.graph_state_now() == again);
  fs::remove_all(dir);
}

// The rules a graph-mode trainer follows (detail::graph_capture_rules: plain C++, so the
// host runs the decisions the GPU's trainer makes), through a whole run: eager, capture,
// replay, a short batch beside the graph, a changed state, a failed capture, a dtype.
TEST_CASE("a graph-mode trainer captures after an eager step in the same state and replays only that batch",
          "[model]") {
  using rules_type = mpx::detail::graph_capture_rules<int>;  // the state: any value with ==
  using mpx::detail::graph_step;
  int const as_float = 0, as_half = 0;  // two element types' keys (their addresses)
  rules_type::batch const full{mpx::shape{32, 4}, &as_float}, short_batch{mpx::shape{7, 4}, &as_float},
      full_half{mpx::shape{32, 4}, &as_half};
  rules_type rules;
  CHECK_FALSE(rules.has_graph());
  REQUIRE(rules.next(full, 1) == graph_step::eager);  // nothing ran yet: nothing made for a capture
  rules.ran_eagerly(full, 1);
  CHECK(rules.next(full_half, 1) == graph_step::eager);  // the same shape in another dtype: other bytes
  CHECK(rules.next(full, 2) == graph_step::eager);       // the state moved since the eager step
  rules.ran_eagerly(short_batch, 1);  // only the latest eager step counts
  CHECK(rules.next(full, 1) == graph_step::eager);
  rules.ran_eagerly(full, 1);
  REQUIRE(rules.next(full, 1) == graph_step::capture);
  rules.capture_failed();
  CHECK_FALSE(rules.has_graph());
  REQUIRE(rules.next(full, 1) == graph_step::eager);  // not retried before an eager step
  rules.ran_eagerly(full, 1);
  REQUIRE(rules.next(full, 1) == graph_step::capture);
  rules.captured(full, 1);
  CHECK(rules.has_graph());
  CHECK(rules.next(full, 1) == graph_step::replay);
  CHECK(rules.next(full, 1) == graph_step::replay);
  REQUIRE(rules.next(short_batch, 1) == graph_step::eager);  // the epoch's last batch, beside the graph
  rules.ran_eagerly(short_batch, 1);
  CHECK(rules.has_graph());
  CHECK(rules.next(full, 1) == graph_step::replay);
  CHECK(rules.next(full_half, 1) == graph_step::eager);
  // The state changes (a new learning rate, released workspaces): the graph is dropped,
  // and one eager step comes before the next capture, even on the batch last run eagerly.
  REQUIRE(rules.next(short_batch, 3) == graph_step::eager);
  CHECK_FALSE(rules.has_graph());
  CHECK(rules.next(full, 3) == graph_step::eager);
  rules.ran_eagerly(full, 3);
  REQUIRE(rules.next(full, 3) == graph_step::capture);
  rules.captured(full, 3);
  CHECK(rules.next(full, 3) == graph_step::replay);
  // An eager step that itself left the state changed (the trainer reserves a larger batch
  // before it asks, so that case drops the graph at once): the graph goes at the next
  // step, which runs eagerly before any capture, as after any change.
  rules_type::batch const larger{mpx::shape{64, 4}, &as_float};
  REQUIRE(rules.next(larger, 3) == graph_step::eager);
  rules.ran_eagerly(larger, 4);
  REQUIRE(rules.next(larger, 4) == graph_step::eager);
  CHECK_FALSE(rules.has_graph());
  rules.ran_eagerly(larger, 4);
  CHECK(rules.next(larger, 4) == graph_step::capture);
  CHECK(rules.captures() == 2);
}

namespace test_model_graph {

//! CUDA's graph calls as a log: a graph is a number (0: none), a status 0 is success, and
//! what fails is chosen per test.
struct fake_graph_backend {
  using graph = int;
  using executable = int;
  using status = int;
  std::vector<std::string> log;
  bool fail_begin = false;
  status end_status = 0, instantiate_status = 0;
  graph end_graph = 7;  // what cudaStreamEndCapture gives back: none (0) from an invalidated capture

  void begin_capture() {
    if (fail_begin) throw mpx::cuda_error("cudaStreamBeginCapture failed", 900);
    log.push_back("begin");
  }
  status end_capture(graph& g) {
    log.push_back("end");
    g = end_graph;
    return end_status;
  }
  status instantiate(executable& e, graph g) {
    log.push_back("instantiate " + std::to_string(g));
    if (instantiate_status == 0) e = 70 + g;
    return instantiate_status;
  }
  void destroy_graph(graph g) noexcept { log.push_back("destroy " + std::to_string(g)); }
  void clear_error() noexcept { log.push_back("clear"); }
  static bool ok(status s) noexcept { return s == 0; }
  void check(status s, char const* call) {
    if (s != 0) throw mpx::cuda_error(std::string(call) + " failed", s);
  }
};

}  // namespace test_model_graph

// How the graph-mode trainer captures (detail::capture_graph: plain C++, run here with a
// fake of CUDA's calls): a capture that fails in any of its three places leaves the stream
// out of capture mode, destroys what was captured, clears the error, makes the rules run
// the next step eagerly, and throws the failure.
TEST_CASE("a graph capture that fails is undone, and the next step runs eagerly", "[model]") {
  using test_model_graph::fake_graph_backend;
  using rules_type = mpx::detail::graph_capture_rules<int>;
  using log_type = std::vector<std::string>;
  int const as_float = 0;
  rules_type::batch const full{mpx::shape{32, 4}, &as_float};
  auto ready_rules = [&] {
    rules_type rules;
    rules.ran_eagerly(full, 1);
    REQUIRE(rules.next(full, 1) == mpx::detail::graph_step::capture);
    return rules;
  };

  {  // the capture succeeds
    fake_graph_backend b;
    bool ran = false, failed = false;
    int const made = mpx::detail::capture_graph(b, [&] { ran = true; }, [&] { failed = true; });
    CHECK(made == 77);
    CHECK(ran);
    CHECK_FALSE(failed);
    CHECK(b.log == log_type{"begin", "end", "instantiate 7", "destroy 7"});
  }
  {  // the step throws during the capture (an operation that may not be captured)
    fake_graph_backend b;
    auto rules = ready_rules();
    CHECK_THROWS_WITH(mpx::detail::capture_graph(b, [] { throw mpx::invalid_argument("mpx::gemm: cold stream"); },
                                                 [&] { rules.capture_failed(); }),
                      "mpx::gemm: cold stream");  // the step's own error, not the capture's
    CHECK(b.log == log_type{"begin", "end", "destroy 7", "clear"});
    CHECK(rules.next(full, 1) == mpx::detail::graph_step::eager);
  }
  {  // the step throws, and the capture it broke ends without a graph: nothing to destroy
    fake_graph_backend b;
    b.end_status = 901;
    b.end_graph = 0;
    auto rules = ready_rules();
    CHECK_THROWS_WITH(mpx::detail::capture_graph(b, [] { throw mpx::invalid_argument("a host wait in a capture"); },
                                                 [&] { rules.capture_failed(); }),
                      "a host wait in a capture");
    CHECK(b.log == log_type{"begin", "end", "clear"});
    CHECK(rules.next(full, 1) == mpx::detail::graph_step::eager);
  }
  {  // the capture cannot end (invalidated): no graph, nothing instantiated
    fake_graph_backend b;
    b.end_status = 901;
    b.end_graph = 0;
    auto rules = ready_rules();
    CHECK_THROWS_WITH(mpx::detail::capture_graph(b, [] {}, [&] { rules.capture_failed(); }),
                      "cudaStreamEndCapture failed");
    CHECK(b.log == log_type{"begin", "end", "clear"});
    CHECK(rules.next(full, 1) == mpx::detail::graph_step::eager);
  }
  {  // an end that fails yet gives a graph back: destroyed all the same
    fake_graph_backend b;
    b.end_status = 901;
    CHECK_THROWS_WITH(mpx::detail::capture_graph(b, [] {}, [] {}), "cudaStreamEndCapture failed");
    CHECK(b.log == log_type{"begin", "end", "destroy 7", "clear"});
  }
  {  // the graph cannot be instantiated
    fake_graph_backend b;
    b.instantiate_status = 902;
    auto rules = ready_rules();
    CHECK_THROWS_WITH(mpx::detail::capture_graph(b, [] {}, [&] { rules.capture_failed(); }),
                      "cudaGraphInstantiate failed");
    CHECK(b.log == log_type{"begin", "end", "instantiate 7", "destroy 7", "clear"});
    CHECK(rules.next(full, 1) == mpx::detail::graph_step::eager);
  }
  {  // the capture cannot begin: the step is not run, and the rules are not told
    fake_graph_backend b;
    b.fail_begin = true;
    bool ran = false, failed = false;
    CHECK_THROWS_AS(mpx::detail::capture_graph(b, [&] { ran = true; }, [&] { failed = true; }), mpx::cuda_error);
    CHECK_FALSE(ran);
    CHECK_FALSE(failed);
    CHECK(b.log.empty());
  }
}

#if MPX_HAS_CUDA
// On the legacy default stream (a default cuda_executor), through a dropout layer, with
// the model's buffers moved by a larger evaluate batch, and the learning rate changed and
// the cuBLASLt workspaces released between epochs (memcheck sees a stale graph's use).
TEST_CASE("a training step replayed from a CUDA graph matches eager steps bit for bit", "[model][cuda]") {
  mpx::cuda_executor exec;
  using space = mpx::device_space;
  // Half data, and float data that the model casts for its first layer (into a buffer
  // the graph reads, reserved on the caller's stream before the side stream uses it).
  auto train = [&](bool graph, auto data_type) {
    auto const points = quadrants<mpx::cuda_executor, decltype(data_type)>(exec, 200, 24);
    auto data = points.batches(64);  // the last batch (8) runs eagerly
    // A dropout layer: each replay must draw a fresh mask, as each eager step does.
    auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(16, mpx::activation::tanh), mpx::dropout<>(0.25f),
                                                     mpx::dense<>(4), mpx::softmax_layer<mpx::float32>());
    model.build(exec, {2}, 1);
    mpx::dynamic_scale_rule rule = mpx::keras_loss_scale();
    rule.growth_interval = 3;  // the scale moves during the replays
    auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f),
                                               mpx::dynamic_loss_scaler(exec, rule));
    mpx::classifier_trainer trainer(exec, model, optimizer);
    trainer.use_cuda_graph(graph);
    CHECK(trainer.cuda_graph_captures() == 0);
    for (std::size_t epoch = 0; epoch < 3; ++epoch) {
      data.start_epoch(epoch);
      while (auto b = data.next()) trainer.step(exec, b->images, b->labels);
      if (epoch == 0) {  // one batch of 200: the model reserves larger buffers, the graph must follow
        auto whole = points.batches(200);
        static_cast<void>(mpx::evaluate(exec, model, whole));
      }
      if (epoch == 1) {
        optimizer.optimizer().rule().learning_rate.rate = 5e-3f;  // replays must use it
        mpx::release_gemm_resources();  // the graph's cuBLASLt workspace is freed: it must capture again
      }
    }
    // Each epoch: an eager step, a capture, a replay, the short batch eagerly. The moved
    // buffers and the new rate and workspaces each cost a capture; nothing else does.
    CHECK(trainer.cuda_graph_captures() == (graph ? 3u : 0u));
    auto records = trainer.history(exec);
    auto weights = mpx_test::download(exec, model.template layer<0>().template kernel<space>());
    return std::pair(records, weights);
  };
  auto compare = [&](auto data_type) {
    INFO("data in " << mpx::dtype_name<decltype(data_type)>);
    auto const [eager_records, eager_weights] = train(false, data_type);
    auto const [graph_records, graph_weights] = train(true, data_type);
    REQUIRE(eager_records.size() == 12);
    REQUIRE(graph_records.size() == 12);
    for (std::size_t i = 0; i < 12; ++i) {
      INFO("step " << i);
      CHECK(graph_records[i].loss == eager_records[i].loss);
      CHECK(graph_records[i].loss_scale == eager_records[i].loss_scale);
      CHECK(graph_records[i].correct == eager_records[i].correct);
      CHECK(graph_records[i].samples == eager_records[i].samples);
    }
    CHECK(eager_records[11].loss_scale > eager_records[0].loss_scale);
    CHECK(mpx_test::first_mismatch(graph_weights, eager_weights).empty());
  };
  compare(mpx::half{});
  compare(float{});
}

// Pure bfloat16 with stochastic rounding: the rounding's seed is a kernel argument of the
// captured optimizer step. A load between epochs restores another seed: the replays
// after it must draw with that seed, as eager steps do.
TEST_CASE("a graph-mode step rounds with the seed a load restored, as eager steps do", "[model][cuda]") {
  using P = test_model_replicas::pure_bfloat16;
  mpx::cuda_executor exec;
  using space = mpx::device_space;
  fs::path const dir = scratch_dir("graph_seed");
  auto make_optimizer = [&](auto& model, std::uint64_t seed) {
    return mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.1f, {}, mpx::master_weights_for<P>(true, seed)),
                                     mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  };
  {
    auto other = quadrant_model<P>();
    other.build(exec, {2}, 2);
    auto other_optimizer = make_optimizer(other, 99);
    other_optimizer.optimizer().save(exec, dir / "seed_99.mpx");
  }
  auto const points = quadrants<mpx::cuda_executor, mpx::bfloat16>(exec, 256, 25);
  auto train = [&](bool graph) {
    auto data = points.batches(64);
    auto model = quadrant_model<P>();
    model.build(exec, {2}, 1);
    auto optimizer = make_optimizer(model, 5);
    mpx::classifier_trainer trainer(exec, model, optimizer);
    trainer.use_cuda_graph(graph);
    for (std::size_t epoch = 0; epoch < 2; ++epoch) {
      data.start_epoch(epoch);
      while (auto b = data.next()) trainer.step(exec, b->images, b->labels);
      if (epoch == 0) optimizer.optimizer().load(exec, dir / "seed_99.mpx");
    }
    return std::pair(trainer.history(exec), mpx_test::download(exec, model.template layer<0>().template kernel<space>()));
  };
  auto const [eager_records, eager_weights] = train(false);
  auto const [graph_records, graph_weights] = train(true);
  REQUIRE(eager_records.size() == 8);
  REQUIRE(graph_records.size() == 8);
  for (std::size_t i = 0; i < 8; ++i) {
    INFO("step " << i);
    CHECK(graph_records[i].loss == eager_records[i].loss);
    CHECK(graph_records[i].correct == eager_records[i].correct);
  }
  CHECK(mpx_test::first_mismatch(graph_weights, eager_weights).empty());
  fs::remove_all(dir);
}
#endif

namespace test_model {

//! The float64 reference of count_correct's arg-max: the first of the largest logits;
//! -1 (no prediction) for a row holding a NaN.
template <class T>
std::int32_t reference_prediction(std::vector<T> const& logits, std::size_t row, std::size_t cols) {
  std::int32_t best = -1;
  double best_value = 0;
  for (std::size_t c = 0; c < cols; ++c) {
    double const v = mpx::detail::to_double(logits[row * cols + c]);
    if (std::isnan(v)) return -1;
    if (best < 0 || v > best_value) {
      best = static_cast<std::int32_t>(c);
      best_value = v;
    }
  }
  return best;
}

//! The arg-max a NaN-skipping count would take (the largest number in the row): a row
//! holding a NaN gets this label, so counting it would be seen.
template <class T>
std::int32_t prediction_ignoring_nan(std::vector<T> const& logits, std::size_t row, std::size_t cols) {
  std::int32_t best = 0;
  double best_value = -INFINITY;
  for (std::size_t c = 0; c < cols; ++c) {
    double const v = mpx::detail::to_double(logits[row * cols + c]);
    if (v > best_value) {
      best = static_cast<std::int32_t>(c);
      best_value = v;
    }
  }
  return best;
}

//! A record whose every byte is 0xA5 (its floats NaN-free garbage), but for `correct`.
inline mpx::step_record poisoned_record(std::uint32_t correct) {
  mpx::step_record r;
  std::memset(static_cast<void*>(&r), 0xA5, sizeof r);  // trivially copyable: bytes are its value
  r.correct = correct;
  return r;
}

inline bool same_bytes(mpx::step_record const& a, mpx::step_record const& b) {
  return std::memcmp(static_cast<void const*>(&a), static_cast<void const*>(&b), sizeof a) == 0;
}

}  // namespace test_model

// The accuracy count of classifier_trainer and evaluate, called directly: logits drawn
// from a few values (ties everywhere), -inf and +inf entries, rows holding a NaN (never
// correct, even where the largest number is the label), labels outside [0, classes);
// sizes around a block of 256 rows. It adds to `correct` and touches nothing else.
TEMPLATE_LIST_TEST_CASE("count_correct: first of tied maxima, never a row with NaN, awkward sizes", "[model]",
                        mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  auto for_type = [&](auto tag) {
    using T = decltype(tag);
    for (std::size_t rows : {1, 2, 255, 256, 257, 1000})
      for (std::size_t cols : {1, 2, 3, 10, 33, 129}) {
        std::mt19937_64 gen(mpx_test::seed + rows * 1000 + cols);
        float const levels[] = {-2.0f, -1.0f, 0.0f, 0.5f, 1.0f, 3.0f, -INFINITY, INFINITY};
        std::vector<T> logits(rows * cols);
        for (auto& x : logits) x = mpx::cast<T>(levels[gen() % (gen() % 16 == 0 ? 8 : 6)]);
        std::vector<std::int32_t> labels(rows);
        std::size_t nan_rows = 0, ties = 0, expected = 0;
        for (std::size_t r = 0; r < rows; ++r) {
          if (r % 7 == 3) {  // a NaN somewhere, its label the largest number's column
            logits[r * cols + gen() % cols] = mpx::cast<T>(NAN);
            labels[r] = test_model::prediction_ignoring_nan(logits, r, cols);
            ++nan_rows;
          } else if (r % 5 == 1) {
            labels[r] = r % 2 ? -1 : static_cast<std::int32_t>(cols);  // outside the classes
          } else if (r % 2) {
            labels[r] = test_model::reference_prediction(logits, r, cols);  // correct
          } else {
            labels[r] = static_cast<std::int32_t>(gen() % cols);  // correct by chance, or a later tie
          }
          std::int32_t const p = test_model::reference_prediction(logits, r, cols);
          expected += p >= 0 && p == labels[r];
          if (p >= 0) {
            double const top = mpx::detail::to_double(logits[r * cols + static_cast<std::size_t>(p)]);
            for (std::size_t c = static_cast<std::size_t>(p) + 1; c < cols; ++c)
              ties += mpx::detail::to_double(logits[r * cols + c]) == top;
          }
        }
        if (rows >= 255 && cols >= 10) {
          REQUIRE(nan_rows > 0);
          REQUIRE(ties > 0);  // the first-of-ties rule is exercised
          REQUIRE(expected > 0);
        }
        auto const logits_d = mpx_test::upload(exec, logits, {static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)});
        auto const labels_d = mpx_test::upload(exec, labels);
        auto const start = test_model::poisoned_record(5);
        auto record = mpx_test::upload(exec, std::vector<mpx::step_record>{start});
        mpx::tensor_view<T const, space> const lv(mpx::view(logits_d));
        mpx::tensor_view<std::int32_t const, space> const yv(mpx::view(labels_d));
        mpx::count_correct(exec, lv, yv, record.data());
        mpx::count_correct(exec, lv, yv, record.data());  // adds again
        auto got = mpx_test::download(exec, record)[0];
        INFO(mpx::dtype_name<T> << " rows=" << rows << " cols=" << cols);
        CHECK(got.correct == 5 + 2 * expected);
        got.correct = start.correct;
        CHECK(test_model::same_bytes(got, start));
      }
    // Labels for another batch are refused; an empty batch counts nothing.
    auto const l = mpx_test::upload(exec, std::vector<T>(6, mpx::cast<T>(1.0f)), {2, 3});
    auto const y = mpx_test::upload(exec, std::vector<std::int32_t>{0, 1, 2});
    auto record = mpx_test::upload(exec, std::vector<mpx::step_record>{test_model::poisoned_record(0)});
    CHECK_THROWS_TYPE_WITH(mpx::count_correct(exec, mpx::tensor_view<T const, space>(mpx::view(l)),
                                              mpx::tensor_view<std::int32_t const, space>(mpx::view(y)), record.data()),
                           mpx::shape_error, Catch::Contains("[2, 3]") && Catch::Contains("[3]"));
    auto const none = mpx::make_tensor<T>(exec, {0, 3});
    auto const no_labels = mpx::make_tensor<std::int32_t>(exec, {0});
    mpx::count_correct(exec, mpx::tensor_view<T const, space>(mpx::view(none)),
                       mpx::tensor_view<std::int32_t const, space>(mpx::view(no_labels)), record.data());
    CHECK(mpx_test::download(exec, record)[0].correct == 0);
  };
  mpx_test::for_each_dtype(for_type);
}

// The last act of a training step, called directly: every field from its source, the
// count made before kept, NaN carried (a non-finite step's norm), and the scale read
// from the record itself (as the trainer does) left as it was.
TEMPLATE_LIST_TEST_CASE("the step record kernel writes every field from its source", "[model]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  auto record = mpx_test::upload(exec, std::vector<mpx::step_record>{test_model::poisoned_record(17)});
  auto const loss = mpx_test::upload(exec, std::vector<float>{2.5f});
  auto const scale = mpx_test::upload(exec, std::vector<float>{1024.0f});
  mpx::gradient_summary skipped;
  skipped.found_nonfinite = 1;
  skipped.first_nonfinite = 3;
  skipped.norm = std::numeric_limits<float>::quiet_NaN();
  mpx::resident<mpx::gradient_summary, space> verdict(exec, skipped);
  mpx::detail::record_step(exec, record.data(), loss.data(), scale.data(), verdict.get(), 96);
  auto r = mpx_test::download(exec, record)[0];
  CHECK(r.loss == 2.5f);
  CHECK(r.loss_scale == 1024.0f);
  CHECK(r.skipped == 1);
  CHECK(r.correct == 17);
  CHECK(r.samples == 96);
  CHECK(std::isnan(r.gradient_norm));

  mpx::gradient_summary applied;
  applied.norm = 3.75f;
  verdict.write(exec, applied);
  // The scale the step ran with, already in the record: read from there, kept.
  mpx::copy(exec, mpx::tensor_view<float const, space>(scale.data(), mpx::shape{1}),
            mpx::tensor_view<float, space>(&record.data()->loss_scale, mpx::shape{1}));
  auto const other_scale = mpx_test::upload(exec, std::vector<float>{-1.0f});
  mpx::detail::record_step(exec, record.data(), other_scale.data(), &record.data()->loss_scale, verdict.get(), 1);
  r = mpx_test::download(exec, record)[0];
  CHECK(r.loss == -1.0f);
  CHECK(r.loss_scale == 1024.0f);
  CHECK(r.skipped == 0);
  CHECK(r.correct == 17);
  CHECK(r.samples == 1);
  CHECK(r.gradient_norm == 3.75f);
}

// A CUDA graph holds the addresses of every buffer a step uses, and is captured again
// only when the model's buffer_generation changes. So no buffer a step uses may move
// without it: the fp8 layers' cast buffers and attention's gradient buffers are made in
// reserve (on the caller's executor), never inside a step. The sequence that moved them
// unseen: a step at a small batch, an evaluate at a large one (reserves, forward only),
// then a step at a middle batch (its backward grew the gradients' buffers).
namespace fp8_buffers {

//! An fp8 dense layer and an attention layer with fp8 projections (samples [4 tokens,
//! 16]), then a classifier.
inline auto make_model() {
  using P = mpx::mixed_fp8;
  return mpx::sequential<P>(mpx::dense<>(32, mpx::activation::relu), mpx::causal_self_attention<>(2),
                            mpx::flatten<>(), mpx::dense<mpx::without_fp8<P>>(3), mpx::softmax_layer<mpx::float32>());
}

//! n samples for it and their labels, in the executor's memory.
template <class Exec>
auto batch(Exec const& exec, std::int64_t n) {
  auto const x = mpx_test::random_values<mpx::bfloat16>(static_cast<std::size_t>(n * 64), -1, 1, 70 + static_cast<std::uint64_t>(n));
  std::vector<std::int32_t> labels(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 3);
  return std::pair(mpx_test::upload(exec, x, {n, 4, 16}), mpx_test::upload(exec, labels, {n}));
}

}  // namespace fp8_buffers

TEMPLATE_LIST_TEST_CASE("no step moves an fp8 or attention buffer without the model's buffer generation changing",
                        "[model][fp8]", mpx_test::executors) {
  using space = mpx::memory_space_t<TestType>;
  TestType exec;
  auto model = fp8_buffers::make_model();
  model.build(exec, {4, 16}, 1);
  auto optimizer = mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.01f),
                                             mpx::static_loss_scaler(exec, 1.0f));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  auto batch = [&](std::int64_t n) { return fp8_buffers::batch(exec, n); };
  auto buffers = [&] {
    auto const attention = model.template layer<1>().gradient_buffers();
    std::vector<void const*> out{attention[0], attention[1]};
    auto const add_casts = [&](auto const& products) {
      out.push_back(products.template cast_buffer<mpx::operand_role::activation>());
      out.push_back(products.template cast_buffer<mpx::operand_role::weight>());
      out.push_back(products.template cast_buffer<mpx::operand_role::gradient>());
    };
    add_casts(model.template layer<0>().products());
    add_casts(model.template layer<1>().query_key_value().products());  // the attention's projections
    add_casts(model.template layer<1>().output().products());
    return out;
  };
  auto step = [&](std::int64_t n) {
    auto const [x, y] = batch(n);
    trainer.step(exec, mpx::tensor_view<mpx::bfloat16 const, space>(mpx::view(x)),
                 mpx::tensor_view<std::int32_t const, space>(mpx::view(y)));
  };
  step(2);
  for (void const* b : buffers()) CHECK(b != nullptr);  // all made by the first step's reserve
  auto generation = model.buffer_generation();
  auto seen = buffers();
  auto check_unmoved_or_counted = [&](char const* what) {
    INFO(what);
    auto const now = buffers();
    if (now != seen) CHECK(model.buffer_generation() != generation);
    generation = model.buffer_generation();
    seen = now;
  };
  {
    auto const [x, y] = batch(8);
    static_cast<void>(model.forward(exec, mpx::tensor_view<mpx::bfloat16 const, space>(mpx::view(x)), false));
  }
  check_unmoved_or_counted("evaluate at batch 8");
  step(5);
  check_unmoved_or_counted("a step at batch 5, after the evaluate");
  CHECK(model.buffer_generation() == generation);  // a step below the reserved batch reserves nothing
  step(8);
  check_unmoved_or_counted("a step at batch 8");
  auto const records = trainer.history(exec);
  REQUIRE(records.size() == 3);
  for (auto const& r : records) CHECK(std::isfinite(r.loss));
}

#if MPX_HAS_CUDA
// Graph mode runs each step on the trainer's own stream, which goes with the trainer; the
// model lives on. A buffer first made inside such a step (an fp8 cast buffer, attention's
// gradients) would be freed later, when a larger batch reserves again, on that destroyed
// stream. They are made in reserve, on the caller's stream. (Run under compute-sanitizer
// by the GPU kit: a free on a destroyed stream is an error there.)
TEST_CASE("an fp8 and attention model outlives its graph-mode trainer and grows its buffers after it",
          "[model][cuda][fp8]") {
  mpx::cuda_executor exec;
  int device = 0, major = 0, minor = 0;
  MPX_CUDA_CHECK(cudaGetDevice(&device));
  MPX_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MPX_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major * 10 + minor < 89) {
    WARN("this GPU has no fp8 tensor cores: skipped");
    return;
  }
  using space = mpx::device_space;
  auto model = fp8_buffers::make_model();
  model.build(exec, {4, 16}, 1);
  auto optimizer = mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.01f),
                                             mpx::static_loss_scaler(exec, 1.0f));
  {
    mpx::classifier_trainer trainer(exec, model, optimizer);
    trainer.use_cuda_graph(true);
    auto const [x, y] = fp8_buffers::batch(exec, 13);  // ragged: the weight gradient's K (52 rows) is padded
    for (int i = 0; i < 4; ++i)  // eager, capture, replays
      trainer.step(exec, mpx::tensor_view<mpx::bfloat16 const, space>(mpx::view(x)),
                   mpx::tensor_view<std::int32_t const, space>(mpx::view(y)));
    auto const records = trainer.history(exec);
    REQUIRE(records.size() == 4);
    for (auto const& r : records) CHECK(std::isfinite(r.loss));
  }
  // The trainer and its stream are gone: a larger batch reserves again and frees the old
  // buffers, on the stream they were made on.
  auto const [x, y] = fp8_buffers::batch(exec, 40);
  auto const out = mpx_test::download(
      exec, model.forward(exec, mpx::tensor_view<mpx::bfloat16 const, space>(mpx::view(x)), false));
  for (float p : out) CHECK(std::isfinite(p));
  MPX_CUDA_CHECK(cudaDeviceSynchronize());
}
#endif
