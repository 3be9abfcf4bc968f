// What a custom training loop relies on. The order it must keep, enforced: a model's
// gradients are zeros from build on; a backward needs a forward since the previous
// backward; an optimizer's step needs a backward since its previous step; a model runs
// where it was built. Each refusal names what was missed and changes nothing; each has
// an explicit opt-out for code that means it. And what makes the loop light: the scaler
// a policy calls for, and a loss-gradient buffer sized to the batch.
#include "../support/testing.hpp"

#include <mpx/layers/dense.hpp>
#include <mpx/layers/softmax_layer.hpp>
#include <mpx/losses/cross_entropy.hpp>
#include <mpx/model/diagnostics.hpp>
#include <mpx/model/model_file.hpp>
#include <mpx/model/sequential.hpp>
#include <mpx/model/train_step.hpp>
#include <mpx/optim/adam.hpp>
#include <mpx/optim/loss_scale_optimizer.hpp>
#include <mpx/optim/sgd.hpp>
#include <mpx/scaling/loss_scaler.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

// Every test file of a folder shares one translation unit under nvcc: this file's
// helpers and cases live in a namespace of its own.
namespace custom_loop {

using Catch::Matchers::Contains;

template <class P>
auto small_model() {
  return mpx::sequential<P>(mpx::dense<>(7, mpx::activation::relu), mpx::dense<>(3));
}

constexpr std::int64_t batch = 5;

template <class Exec>
auto inputs(Exec const& exec) {
  return mpx_test::upload(exec, mpx_test::random_values<float>(batch * 4, -1.0, 1.0, 11), mpx::shape{batch, 4});
}
template <class Exec>
auto logit_gradient(Exec const& exec) {
  return mpx_test::upload(exec, mpx_test::random_values<float>(batch * 3, -1.0, 1.0, 12), mpx::shape{batch, 3});
}

// A tensor of any float dtype, read back as floats.
template <class Exec, class Ref>
std::vector<float> as_floats(Exec const& exec, Ref const& ref) {
  std::vector<float> out;
  mpx::visit_dtype(ref.dtype(), [&](auto t) {
    using T = decltype(t);
    for (T v : mpx_test::download(exec, ref.template as<T>())) out.push_back(static_cast<float>(v));
  });
  return out;
}

template <class Exec, class Model>
std::vector<std::vector<float>> parameter_values(Exec const& exec, Model& model) {
  std::vector<std::vector<float>> out;
  for (auto const& p : model.parameters(exec)) out.push_back(as_floats(exec, p.value));
  return out;
}


TEMPLATE_LIST_TEST_CASE("a model's gradients are zeros from build on, in every policy", "[model][custom_loop]",
                        mpx_test::executors) {
  TestType exec;
  mpx_test::for_each_dtype([&](auto t) {
    using P = mpx_test::preset_policy<decltype(t)>;
    {  // a model whose gradients hold NaN, freed: the next one's allocations may reuse its memory
      auto earlier = small_model<P>();
      earlier.build(exec, {4}, 3);
      for (auto const& p : earlier.parameters(exec))
        mpx::visit_dtype(p.gradient.dtype(), [&](auto u) {
          using U = decltype(u);
          mpx::fill(exec, p.gradient.template as<U>(), mpx_test::poison<U>());
        });
      exec.synchronize();
    }
    auto model = small_model<P>();
    model.build(exec, {4}, 3);
    for (auto const& p : model.parameters(exec)) {
      INFO(p.name);
      REQUIRE(p.gradient.size() > 0);
      for (float g : as_floats(exec, p.gradient)) CHECK(g == 0.0f);
    }
  });
}

TEMPLATE_LIST_TEST_CASE("a backward needs a forward since the previous backward", "[model][custom_loop]",
                        mpx_test::executors) {
  TestType exec;
  auto model = small_model<mpx::float32>();
  model.build(exec, {4}, 3);
  auto const x = inputs(exec);
  auto const dy = logit_gradient(exec);

  CHECK_THROWS_TYPE_WITH(model.backward_from_logits(exec, dy.view()), mpx::invalid_argument,
                         Contains("backward_from_logits: no forward has run yet"));
  CHECK_THROWS_TYPE_WITH(model.backward(exec, dy.view()), mpx::invalid_argument,
                         Contains("backward: no forward has run yet"));

  model.forward(exec, x.view(), true);
  model.backward_from_logits(exec, dy.view());
  auto const first = as_floats(exec, model.parameters(exec)[0].gradient);
  CHECK_THROWS_TYPE_WITH(model.backward_from_logits(exec, dy.view()), mpx::invalid_argument,
                         Contains("no forward since the previous backward"));

  // Opted out: the same batch again gives the same gradients.
  CHECK_FALSE(model.allow_backward_without_forward(true));
  model.backward_from_logits(exec, dy.view());
  auto const again = as_floats(exec, model.parameters(exec)[0].gradient);
  CHECK(mpx_test::first_mismatch(again, first).empty());
  CHECK(model.allow_backward_without_forward(false));

  // A forward re-arms backward.
  model.forward(exec, x.view(), true);
  CHECK_NOTHROW(model.backward(exec, dy.view()));
}

TEMPLATE_LIST_TEST_CASE("probe_loss_scales backpropagates one batch several times and leaves the guard as it was",
                        "[model][custom_loop]", mpx_test::executors) {
  TestType exec;
  auto model = small_model<mpx::mixed_float16>();
  model.build(exec, {4}, 3);
  auto const x = inputs(exec);
  auto const dy = logit_gradient(exec);
  model.forward(exec, x.view(), true);
  auto const probe = mpx::probe_loss_scales(exec, model, dy.view(), {1.0f, 256.0f, 65536.0f});
  CHECK(probe.scales.size() == 3);
  CHECK_THROWS_WITH(model.backward_from_logits(exec, dy.view()), Contains("no forward since the previous backward"));
}

TEMPLATE_LIST_TEST_CASE("forward and probe_loss_scales take tensors as well as views", "[model][custom_loop]",
                        mpx_test::executors) {
  TestType exec;
  auto model = small_model<mpx::mixed_float16>();
  model.build(exec, {4}, 3);
  auto const x = inputs(exec);  // a tensor of float
  auto const from_view = mpx_test::download(exec, model.forward(exec, x.view(), false));
  CHECK(mpx_test::download(exec, model.forward(exec, x, false)) == from_view);
  auto const labels = mpx_test::upload(exec, std::vector<std::int32_t>{0, 1, 2, 0, 1}, mpx::shape{batch});
  auto const with_tensors = mpx::probe_loss_scales(exec, model, x, labels, {1.0f, 256.0f});
  auto const with_views = mpx::probe_loss_scales(exec, model, x.view(), labels.view(), {1.0f, 256.0f});
  REQUIRE(with_tensors.rows.size() == with_views.rows.size());
  for (std::size_t i = 0; i < with_views.rows.size(); ++i) {
    CHECK(with_tensors.rows[i].zero_share == with_views.rows[i].zero_share);
    CHECK(with_tensors.rows[i].nonfinite == with_views.rows[i].nonfinite);
  }
  CHECK(with_tensors.recommended_scale == with_views.recommended_scale);
}

TEMPLATE_LIST_TEST_CASE("an optimizer's step needs a backward since its previous step, and a refused step changes "
                        "nothing",
                        "[model][custom_loop]", mpx_test::executors) {
  TestType exec;
  auto model = small_model<mpx::float32>();
  model.build(exec, {4}, 3);
  auto const x = inputs(exec);
  auto const dy = logit_gradient(exec);
  mpx::adam optimizer(exec, model.parameters(exec), 1e-2f);
  auto const built = parameter_values(exec, model);

  CHECK_THROWS_TYPE_WITH(optimizer.step(exec), mpx::invalid_argument,
                         Contains("adam: a step before any backward") && Contains("dense/kernel"));
  CHECK(optimizer.steps(exec) == 0);
  CHECK(parameter_values(exec, model) == built);

  model.forward(exec, x.view(), true);
  model.backward_from_logits(exec, dy.view());
  optimizer.step(exec);
  CHECK(optimizer.steps(exec) == 1);
  auto const stepped = parameter_values(exec, model);
  CHECK(stepped != built);

  CHECK_THROWS_TYPE_WITH(optimizer.step(exec), mpx::invalid_argument,
                         Contains("a second step with no backward since the last one"));
  CHECK(optimizer.steps(exec) == 1);
  CHECK(parameter_values(exec, model) == stepped);

  // Opted out (gradients written by hand): the step runs.
  CHECK_FALSE(optimizer.allow_step_without_backward(true));
  optimizer.step(exec);
  CHECK(optimizer.steps(exec) == 2);
}

TEMPLATE_LIST_TEST_CASE("loss_scale_optimizer refuses a step with no backward before touching weights, scale or "
                        "step count",
                        "[model][custom_loop]", mpx_test::executors) {
  TestType exec;
  auto model = small_model<mpx::mixed_float16>();
  model.build(exec, {4}, 3);
  auto optimizer = mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.1f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  float const scale = optimizer.scaler().scale(exec);
  CHECK_THROWS_TYPE_WITH(optimizer.step(exec), mpx::invalid_argument, Contains("sgd: a step before any backward"));
  CHECK(optimizer.optimizer().steps(exec) == 0);
  CHECK(optimizer.scaler().scale(exec) == scale);

  auto const x = inputs(exec);
  auto const dy = logit_gradient(exec);
  model.forward(exec, x.view(), true);
  model.backward_from_logits(exec, dy.view());
  optimizer.step(exec);
  CHECK(optimizer.optimizer().steps(exec) == 1);
}

TEMPLATE_LIST_TEST_CASE("an optimizer refuses parameters a new build of the model freed, and master weights older "
                        "than weights loaded since, before touching anything",
                        "[model][custom_loop]", mpx_test::executors) {
  TestType exec;
  auto const x = inputs(exec);
  auto const dy = logit_gradient(exec);
  auto model = small_model<mpx::mixed_float16>();
  model.build(exec, {4}, 3);
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  float const scale = optimizer.scaler().scale(exec);
  auto backprop = [&] {
    model.forward(exec, x.view(), true);
    model.backward_from_logits(exec, dy.view());
  };

  SECTION("built again: the optimizer's tensors are freed") {
    model.build(exec, {4}, 4);
    backprop();
    auto const rebuilt = parameter_values(exec, model);
    for (int plain = 0; plain < 2; ++plain)  // through the loss_scale_optimizer, and the optimizer's own step
      CHECK_THROWS_TYPE_WITH(plain ? optimizer.optimizer().step(exec) : optimizer.step(exec), mpx::invalid_argument,
                             Contains("adam: its parameters (e.g. 'dense/kernel') are no longer the model's") &&
                                 Contains("after the model's last build"));
    // Nothing else of the optimizer's reaches the freed tensors either.
    CHECK_THROWS_WITH(optimizer.optimizer().reload_master_weights(exec), Contains("no longer the model's"));
    mpx::detail::checkpoint_writer out("mpx::optimizer");
    CHECK_THROWS_WITH(optimizer.optimizer().save(exec, out), Contains("no longer the model's"));
    CHECK(optimizer.scaler().scale(exec) == scale);
    CHECK(optimizer.optimizer().steps(exec) == 0);
    CHECK(parameter_values(exec, model) == rebuilt);
    // An optimizer made after the last build steps.
    auto fresh = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f),
                                           mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
    fresh.step(exec);
    CHECK(fresh.optimizer().steps(exec) == 1);
    CHECK(parameter_values(exec, model) != rebuilt);
  }

  SECTION("weights loaded: the master weights hold the old ones until reloaded") {
    mpx_test::scratch_dir const dir("reload_masters");
    auto other = small_model<mpx::mixed_float16>();
    other.build(exec, {4}, 9);
    mpx::save_model(exec, other, dir / "other.mpx");
    mpx::load_model(exec, model, dir / "other.mpx");
    auto const loaded = parameter_values(exec, model);
    CHECK(loaded == parameter_values(exec, other));
    backprop();
    CHECK_THROWS_TYPE_WITH(optimizer.step(exec), mpx::invalid_argument,
                           Contains("adam: the model's weights were replaced (load_model)") &&
                               Contains("'dense/kernel'") && Contains("reload_master_weights(exec)"));
    CHECK(optimizer.optimizer().steps(exec) == 0);
    CHECK(parameter_values(exec, model) == loaded);
    {  // a trainer checks before its step, which in graph mode runs no host code of the optimizer's
      mpx::classifier_trainer trainer(exec, model, optimizer);
      auto const labels = mpx_test::upload(exec, std::vector<std::int32_t>{0, 1, 2, 0, 1}, mpx::shape{batch});
      CHECK_THROWS_WITH(trainer.step(exec, x.view(), labels.view()), Contains("weights were replaced"));
      CHECK(trainer.steps_taken() == 0);
    }
    // Reloaded, the step starts from the loaded weights: Adam moves each by about its
    // learning rate (the old masters are 0.1 to 1 away from them).
    optimizer.optimizer().reload_master_weights(exec);
    optimizer.step(exec);
    CHECK(optimizer.optimizer().steps(exec) == 1);
    auto const stepped = parameter_values(exec, model);
    REQUIRE(stepped.size() == loaded.size());
    for (std::size_t i = 0; i < loaded.size(); ++i)
      for (std::size_t j = 0; j < loaded[i].size(); ++j) CHECK(std::abs(stepped[i][j] - loaded[i][j]) < 0.02f);
  }

  SECTION("a build that fails partway counts: its first layers were allocated anew") {
    CHECK_THROWS_AS(model.build(exec, mpx::shape{}, 4), mpx::error);
    model.build(exec, {4}, 3);
    backprop();
    CHECK_THROWS_WITH(optimizer.step(exec), Contains("no longer the model's"));
  }

  SECTION("an optimizer without master copies has nothing to reload") {
    auto floats = small_model<mpx::float32>();
    floats.build(exec, {4}, 3);
    mpx::sgd plain(exec, floats.parameters(exec), 0.1f);
    mpx_test::scratch_dir const dir("reload_none");
    mpx::save_model(exec, floats, dir / "floats.mpx");
    mpx::load_model(exec, floats, dir / "floats.mpx");
    floats.forward(exec, x.view(), true);
    floats.backward_from_logits(exec, dy.view());
    plain.step(exec);
    CHECK(plain.steps(exec) == 1);
  }
}

TEST_CASE("a model is used where it was built: another memory space or executor is refused, naming both",
          "[model][custom_loop]") {
  mpx::host_executor host;
  auto model = small_model<mpx::float32>();
  model.build(host, {4}, 3);
  CHECK_THROWS_TYPE_WITH(model.template parameters<mpx::device_space>(), mpx::invalid_argument,
                         Contains("built with mpx::host_executor (its parameters are in host_space)") &&
                             Contains("asked for in device_space"));
#if MPX_HAS_CUDA
  mpx::cuda_executor cuda;
  auto const x = inputs(cuda);
  CHECK_THROWS_TYPE_WITH(model.forward(cuda, x.view(), true), mpx::invalid_argument,
                         Contains("sequential::forward: the model was built with mpx::host_executor") &&
                             Contains("run with mpx::cuda_executor"));
#endif
}

TEMPLATE_LIST_TEST_CASE("loss_scaler_for picks the scaler a policy needs, and it scales a loss gradient on the executor",
                        "[model][custom_loop]", mpx_test::executors) {
  TestType exec;
  auto half_scaler = mpx::loss_scaler_for<mpx::mixed_float16>(exec);
  auto bf16_scaler = mpx::loss_scaler_for<mpx::mixed_bfloat16>(exec);
  auto float_scaler = mpx::loss_scaler_for<mpx::float32>(exec);
  STATIC_REQUIRE(std::is_same_v<decltype(half_scaler), mpx::dynamic_loss_scaler<TestType>>);
  STATIC_REQUIRE(std::is_same_v<decltype(bf16_scaler), mpx::static_loss_scaler<TestType>>);
  STATIC_REQUIRE(std::is_same_v<decltype(float_scaler), mpx::static_loss_scaler<TestType>>);
  CHECK(half_scaler.scale(exec) == 32768.0f);  // Keras's initial scale
  CHECK(bf16_scaler.scale(exec) == 1.0f);
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = 1024.0f;
  CHECK(mpx::loss_scaler_for<mpx::mixed_float16>(exec, rule).scale(exec) == 1024.0f);

  auto g = mpx_test::upload(exec, std::vector<float>{0.5f, -2.0f, 3.0e-8f}, mpx::shape{3});
  half_scaler.scale_loss_gradient(exec, g);
  CHECK(mpx_test::download(exec, g) == std::vector<float>{16384.0f, -65536.0f, 3.0e-8f * 32768.0f});
}

TEMPLATE_LIST_TEST_CASE("logits_gradient has the latest forward's batch, a short last batch included",
                        "[model][custom_loop]", mpx_test::executors) {
  TestType exec;
  auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(7, mpx::activation::relu), mpx::dense<>(3),
                                                   mpx::softmax_layer<mpx::float32>());
  model.build(exec, {4}, 3);
  CHECK_THROWS_TYPE_WITH(model.logits_gradient(exec), mpx::invalid_argument, Contains("no forward has run yet"));
  auto const x = mpx_test::upload(exec, mpx_test::random_values<float>(8 * 4, -1.0, 1.0, 5), mpx::shape{8, 4});
  model.forward(exec, x.view(), true);
  auto const full = model.logits_gradient(exec);
  CHECK(full.shape() == mpx::shape{8, 3});
  CHECK(model.logits(exec).shape() == mpx::shape{8, 3});
  auto const short_x = mpx_test::upload(exec, mpx_test::random_values<float>(3 * 4, -1.0, 1.0, 6), mpx::shape{3, 4});
  model.forward(exec, short_x.view(), true);
  auto const d_logits = model.logits_gradient(exec);
  CHECK(d_logits.shape() == mpx::shape{3, 3});
  CHECK(d_logits.data() == full.data());  // the batch shrank: the same buffer
  // A loss writes it and backpropagation reads it, at the short batch's size.
  mpx::loss_value loss(exec);
  auto const labels = mpx_test::upload(exec, std::vector<std::int32_t>{0, 2, 1}, mpx::shape{3});
  mpx::sparse_categorical_cross_entropy<mpx::mixed_float16>(exec, model.logits(exec), labels.view(), d_logits, loss);
  CHECK(std::isfinite(loss.read(exec)));
  CHECK_NOTHROW(model.backward_from_logits(exec, d_logits));
}

}  // namespace custom_loop
