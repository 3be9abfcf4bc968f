// mpx::precision_guard through classifier_trainer::guard: the decisions on constructed
// failures. What must hold: a layer whose forward pass overflows again and again moves
// one tier up, and the model then trains; one transient overflow moves nothing, nor do
// the loss scaler's own overflows above its floor; a scale stuck at its floor moves the
// layer whose gradients were first non-finite; a shadow error above the bound moves the
// layer; with move_down_after a quiet layer moves back down, its wait doubling each time
// it fails there again; and a checkpoint keeps the tiers.
#include "../support/testing.hpp"

#include <mpx/data/tensor_batches.hpp>
#include <mpx/layers/attention.hpp>
#include <mpx/layers/dense.hpp>
#include <mpx/layers/embedding.hpp>
#include <mpx/layers/flatten.hpp>
#include <mpx/layers/layer_norm.hpp>
#include <mpx/model/fit.hpp>
#include <mpx/model/residual.hpp>
#include <mpx/model/sequential.hpp>
#include <mpx/model/tiered.hpp>
#include <mpx/model/train_step.hpp>
#include <mpx/model/training_state.hpp>
#include <mpx/optim/adam.hpp>
#include <mpx/optim/loss_scale_optimizer.hpp>
#include <mpx/scaling/loss_scaler.hpp>

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

namespace guard_tests {

using Catch::Matchers::Contains;

constexpr std::int64_t vocab = 24, tokens = 6, width = 16;

// embedding -> residual(layer_norm, attention without its 1/sqrt(head width), tiered
// float16 -> bfloat16) -> dense: the transformer failure in small.
inline auto attention_model() {
  return mpx::sequential<mpx::mixed_float16>(
      mpx::embedding<>(vocab, width, tokens),
      mpx::residual(mpx::layer_norm<>(),
                    mpx::tiered<mpx::causal_self_attention, mpx::model_policy, mpx::mixed_bfloat16>(2, false)),
      mpx::dense<>(vocab));
}

template <class Model>
auto& attention_of(Model& model) {
  return model.template layer<1>().branch().template layer<1>();
}

// Grows the attention's query/key/value weights (a power of two: exact in float16) until
// its float16 logits overflow.
template <class Exec, class Model>
void grow_attention(Exec const& exec, Model& model, float factor) {
  using space = mpx::memory_space_t<Exec>;
  mpx::scale(exec, attention_of(model).template tier<0>().query_key_value().template kernel<space>(), factor);
}

// Token windows and their next tokens: a cyclic sequence, easy to learn.
template <class Exec>
auto token_data(Exec const& exec, std::int64_t n) {
  std::vector<std::int32_t> x(static_cast<std::size_t>(n * tokens)), y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<std::int32_t>((i * 7 + i / tokens) % vocab);
    y[i] = static_cast<std::int32_t>((x[i] + 1) % vocab);
  }
  struct data {
    mpx::tensor<std::int32_t, mpx::memory_space_t<Exec>> inputs, targets;
  };
  return data{mpx_test::upload(exec, x, mpx::shape{n, tokens}), mpx_test::upload(exec, y, mpx::shape{n, tokens})};
}

// `steps` steps from step `from` on (the batches cycle through the data).
template <class Exec, class Trainer, class Data>
std::vector<mpx::step_record> train_steps(Exec const& exec, Trainer& trainer, Data const& data, std::size_t steps,
                                          std::int64_t batch = 4, std::size_t from = 0) {
  using space = mpx::memory_space_t<Exec>;
  std::int64_t const n = data.inputs.shape()[0];
  for (std::size_t s = from; s < from + steps; ++s) {
    std::int64_t const first = static_cast<std::int64_t>(s) * batch % n;
    mpx::tensor_view<std::int32_t const, space> const x(data.inputs.data() + first * tokens, mpx::shape{batch, tokens});
    mpx::tensor_view<std::int32_t const, space> const y(data.targets.data() + first * tokens, mpx::shape{batch, tokens});
    trainer.step(exec, x, y);
  }
  return trainer.history(exec);
}

// `model` built with a grown attention (float16's logits overflow at every step,
// bfloat16's do not), trained by `run(trainer, data, optimizer)` through a guarded classifier_trainer
// with Adam under Keras's dynamic loss scale.
template <class Exec, class Model, class Run>
void with_grown_attention(Exec const& exec, Model& model, mpx::guard_options const& options, Run&& run) {
  model.build(exec, {tokens}, 5);
  grow_attention(exec, model, 512.0f);
  auto const data = token_data(exec, 16);
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 3e-3f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  trainer.guard(options);
  run(trainer, data, optimizer);
}

TEMPLATE_LIST_TEST_CASE("a layer whose forward pass keeps overflowing moves one tier up, and the model trains",
                        "[model][guard]", mpx_test::executors) {
  TestType exec;
  auto model = attention_model();
  with_grown_attention(exec, model, {.forward_overflows = 3, .window = 50, .review_every = 5},
                       [&](auto& trainer, auto const& data, auto&) {
    auto const before = train_steps(exec, trainer, data, 5);
    for (auto const& r : before) CHECK(r.skipped == 1);  // every step's logits overflowed float16
    auto const* guard = trainer.guard();
    REQUIRE(guard != nullptr);
    REQUIRE(guard->moves().size() == 1);
    auto const& move = guard->moves()[0];
    CHECK(move.step == 5);
    CHECK(move.layer == "residual/multi_head_attention");
    CHECK(move.from == "mixed_float16");
    CHECK(move.to == "mixed_bfloat16");
    CHECK_THAT(move.text(), Contains("5 of its forward passes under mixed_float16") && Contains("now mixed_bfloat16"));
    CHECK(attention_of(model).active_tier() == 1);
    CHECK_THAT(guard->summary(), Contains("step 5: residual/multi_head_attention"));

    // In bfloat16 the logits fit: the steps are taken and the loss falls.
    auto const after = train_steps(exec, trainer, data, 40);
    std::size_t taken = 0;
    for (auto const& r : after) taken += r.skipped == 0;
    CHECK(taken >= 30);
    REQUIRE(after.back().skipped == 0);
    CHECK(std::isfinite(after.back().loss));
    float first_loss = 0;
    for (auto const& r : after)
      if (!r.skipped) {
        first_loss = r.loss;
        break;
      }
    CHECK(after.back().loss < first_loss);
    CHECK(guard->moves().size() == 1);  // the top tier: nowhere further to go
                       });
}

// The grown attention's moves: at `steps`, up from float16 and back down in turn.
void check_up_and_down(std::vector<mpx::guard_move> const& moves, std::vector<std::size_t> const& steps) {
  REQUIRE(moves.size() == steps.size());
  for (std::size_t i = 0; i < moves.size(); ++i) {
    INFO("move " << i << ": " << moves[i].text());
    CHECK(moves[i].step == steps[i]);
    CHECK(moves[i].layer == "residual/multi_head_attention");
    bool const down = i % 2 == 1;
    CHECK(moves[i].from == (down ? "mixed_bfloat16" : "mixed_float16"));
    CHECK(moves[i].to == (down ? "mixed_float16" : "mixed_bfloat16"));
  }
}

// guard_options::move_down_after on a grown attention (float16's logits overflow at every
// step, bfloat16's do not), in a model whose attention is `model`'s.
template <class Exec, class Model>
void check_moves_down(Exec const& exec, Model model) {
  std::vector<mpx::guard_move> moves;
  with_grown_attention(exec, model, {.forward_overflows = 3, .window = 50, .review_every = 5, .move_down_after = 10},
                       [&](auto& trainer, auto const& data, auto&) {
                         train_steps(exec, trainer, data, 50);
                         moves = trainer.guard()->moves();
                       });
  // Up at 5 (steps 1-5 overflowed); 10 quiet steps in bfloat16, down at 15; up again at 20,
  // and now a wait of 20: down at 40, up at 45 (a wait of 40 from there).
  check_up_and_down(moves, {5, 15, 20, 40, 45});
  CHECK_THAT(moves[1].text(), Contains("fp8 saturation or shadow strike in its last 10 steps under mixed_bfloat16") &&
                                  Contains("now mixed_float16"));
  CHECK_THAT(moves[3].text(), Contains("in its last 20 steps") && Contains("move_down_after 20"));
  CHECK(attention_of(model).active_tier() == 1);
  // Without the option (the default) a move is one-way: the first case's 45 steps make one.
}

TEMPLATE_LIST_TEST_CASE("with move_down_after, a quiet layer moves back down, and waits twice as long each time it fails "
                        "there again",
                        "[model][guard]", mpx_test::executors) {
  TestType exec;
  SECTION("from its top tier") { check_moves_down(exec, attention_model()); }
  SECTION("from a middle tier (float32 above it, never needed)") {
    check_moves_down(exec, mpx::sequential<mpx::mixed_float16>(
                               mpx::embedding<>(vocab, width, tokens),
                               mpx::residual(mpx::layer_norm<>(),
                                             mpx::tiered<mpx::causal_self_attention, mpx::model_policy,
                                                         mpx::mixed_bfloat16, mpx::float32>(2, false)),
                               mpx::dense<>(vocab)));
  }
}

TEMPLATE_LIST_TEST_CASE("with move_down_after, a layer that held below longer than it had waited starts its wait "
                        "afresh when it fails again",
                        "[model][guard]", mpx_test::executors) {
  TestType exec;
  auto model = attention_model();
  std::vector<mpx::guard_move> moves;
  with_grown_attention(exec, model, {.forward_overflows = 3, .window = 50, .review_every = 5, .move_down_after = 10},
                       [&](auto& trainer, auto const& data, auto& optimizer) {
                         // The weights change under the optimizer: its float32 masters follow.
                         auto grow = [&](float factor) {
                           grow_attention(exec, model, factor);
                           optimizer.optimizer().reload_master_weights(exec);
                         };
                         train_steps(exec, trainer, data, 40);  // up at 5, down at 15, up at 20, down at 40
                         grow(1.0f / 512.0f);
                         train_steps(exec, trainer, data, 30);  // float16 holds: 30 quiet steps below
                         grow(512.0f);
                         train_steps(exec, trainer, data, 20);
                         moves = trainer.guard()->moves();
                       });
  // The wait doubled to 20 at step 20. Up at 75 after 35 steps below (more than that
  // wait): it starts again from 10, so down at 85 (not 95); float16 still fails it, so up
  // again at 90.
  check_up_and_down(moves, {5, 15, 20, 40, 75, 85, 90});
  CHECK_THAT(moves[3].text(), Contains("move_down_after 20"));
  CHECK_THAT(moves[5].text(), Contains("in its last 10 steps") && Contains("move_down_after 10"));
}

TEMPLATE_LIST_TEST_CASE("one transient overflow moves nothing, nor do the scaler's overflows above its floor",
                        "[model][guard]", mpx_test::executors) {
  TestType exec;
  auto model = attention_model();
  model.build(exec, {tokens}, 5);
  auto const data = token_data(exec, 16);
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = 0x1p20f;  // the first steps' weight gradients overflow float16; each halves the scale
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f),
                                             mpx::dynamic_loss_scaler(exec, rule));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  trainer.guard({.forward_overflows = 2, .stuck_overflows = 2, .window = 100, .review_every = 4});
  auto const first = train_steps(exec, trainer, data, 8);
  std::size_t skipped = 0;
  for (auto const& r : first) skipped += r.skipped;
  CHECK(skipped >= 2);  // backward overflows, the scaler's to handle
  // One step with a grown attention: its forward overflows once.
  grow_attention(exec, model, 512.0f);
  train_steps(exec, trainer, data, 1);
  grow_attention(exec, model, 1.0f / 512.0f);
  train_steps(exec, trainer, data, 11);
  auto const* guard = trainer.guard();
  CHECK(guard->moves().empty());
  CHECK(attention_of(model).active_tier() == 0);
  bool saw_forward = false, saw_backward = false;
  for (auto const& c : guard->counts()) {
    INFO(c.layer << " forward " << c.forward << " stuck " << c.stuck << " backward " << c.backward);
    if (c.layer == "residual/multi_head_attention") saw_forward = c.forward == 1;
    saw_backward = saw_backward || c.backward > 0;
    CHECK(c.stuck == 0);
  }
  CHECK(saw_forward);
  CHECK(saw_backward);
}

TEMPLATE_LIST_TEST_CASE("a scale stuck at its floor moves the layer whose gradients overflowed first",
                        "[model][guard]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  auto model = mpx::sequential<mpx::mixed_float16>(
      mpx::flatten<>(), mpx::dense<>(8, mpx::activation::relu),
      mpx::tiered<mpx::dense, mpx::model_policy, mpx::mixed_bfloat16>(3));
  model.build(exec, {4, 4}, 3);
  std::vector<float> pixels(16 * 16);
  for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = 8.0f + static_cast<float>(i % 5);
  std::vector<std::int32_t> labels(16);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 3);
  auto const images = mpx_test::upload(exec, pixels, mpx::shape{16, 4, 4});
  auto const targets = mpx_test::upload(exec, labels, mpx::shape{16});
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = rule.min_scale = 0x1p16f;  // at the floor from the start
  mpx::dynamic_loss_scaler scaler(exec, rule);
  std::vector<std::string> stuck;
  scaler.on_stuck([&](mpx::loss_scale_report const& r) { stuck.push_back(r.message); });
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f), std::move(scaler));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  trainer.guard({.stuck_overflows = 3, .window = 50, .review_every = 4});
  for (int s = 0; s < 4; ++s)
    trainer.step(exec, mpx::tensor_view<float const, space>(images.view()), mpx::tensor_view<std::int32_t const, space>(targets.view()));
  auto const records = trainer.history(exec);
  for (auto const& r : records) CHECK(r.skipped == 1);
  auto const* guard = trainer.guard();
  REQUIRE(guard->moves().size() == 1);
  CHECK(guard->moves()[0].layer == "dense_1");
  CHECK_THAT(guard->moves()[0].evidence, Contains("gradients were the first NaN or inf of 4 steps with the loss "
                                                  "scale at its floor (65536)"));
}

TEMPLATE_LIST_TEST_CASE("as a replica, the guard names the layer by its own gradients, read before the average",
                        "[model][guard]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  // The first dense layer's ("dense") kernel [2048, 3] holds 6,144 gradients: the overflow below lies in the
  // scan's second chunk of 4,096.
  auto model = mpx::sequential<mpx::mixed_float16>(
      mpx::flatten<>(), mpx::tiered<mpx::dense, mpx::model_policy, mpx::mixed_bfloat16>(3), mpx::dense<>(3));
  model.build(exec, {32, 64}, 3);
  // Feature 1666 is huge and its row of that kernel is 0: the forward pass stays
  // finite, while that row's weight gradients (elements 4998..5000) overflow float16.
  constexpr std::size_t hot = 1666;
  mpx::scale(exec, model.template layer<1>().template tier<0>().template kernel<space>().flat(hot * 3, 3), 0.0f);
  std::vector<float> pixels(4 * 2048, 0.01f);
  for (std::size_t b = 0; b < 4; ++b) pixels[b * 2048 + hot] = 30000.0f;
  std::vector<std::int32_t> labels = {0, 1, 2, 0};
  auto const images = mpx_test::upload(exec, pixels, mpx::shape{4, 32, 64});
  auto const targets = mpx_test::upload(exec, labels, mpx::shape{4});
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = rule.min_scale = 1024.0f;  // at the floor from the start
  mpx::dynamic_loss_scaler scaler(exec, rule);
  scaler.on_stuck([](mpx::loss_scale_report const&) {});
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f), std::move(scaler));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  // One replica whose "average" brings NaN into dense_1's kernel gradient, as another
  // replica's overflow there would: the averaged gradients would name dense_1 (it comes
  // first in the backward pass), this replica's own name "dense".
  auto const params = model.parameters(exec);
  REQUIRE(params[2].gradient.dtype() == mpx::dtype_id::float16);
  auto const averaged_in = params[2].gradient.template as<mpx::half>();
  mpx::replica_hooks hooks;
  std::size_t finals = 0;
  hooks.gradients_final = [&](mpx::step_executor, std::size_t) { ++finals; };
  hooks.after_backward = [&](mpx::step_executor at) {
    mpx::scale(at.as<TestType>(), averaged_in, std::numeric_limits<float>::quiet_NaN());
  };
  trainer.run_as_replica(hooks);
  trainer.guard({.stuck_overflows = 3, .window = 50, .review_every = 4});
  for (int s = 0; s < 4; ++s)
    trainer.step(exec, mpx::tensor_view<float const, space>(images.view()), mpx::tensor_view<std::int32_t const, space>(targets.view()));
  CHECK(finals == 4 * 3);  // after each layer's backward, every step
  for (auto const& r : trainer.history(exec)) CHECK(r.skipped == 1);
  auto const* guard = trainer.guard();
  REQUIRE(guard->moves().size() == 1);
  CHECK(guard->moves()[0].layer == "dense");
  CHECK_THAT(guard->moves()[0].evidence, Contains("gradients were the first NaN or inf of 4 steps"));
}

TEMPLATE_LIST_TEST_CASE("a shadow error above the guard's bound moves the layer", "[model][guard]",
                        mpx_test::executors) {
  TestType exec;
  auto model = attention_model();
  model.build(exec, {tokens}, 5);
  auto const data = token_data(exec, 16);
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  trainer.shadow_every(2);
  // float16's error is about 1e-3: a bound of 1e-5 condemns the attention (and would every
  // float16 layer, were they tiered).
  trainer.guard({.shadow_error = 1e-5, .shadow_strikes = 2, .review_every = 3});
  train_steps(exec, trainer, data, 3);  // one shadow step (2): one strike
  CHECK(trainer.guard()->moves().empty());
  train_steps(exec, trainer, data, 3);  // the second (4): moved at the review of step 6
  REQUIRE(trainer.guard()->moves().size() == 1);
  CHECK(trainer.guard()->moves()[0].step == 6);
  CHECK_THAT(trainer.guard()->moves()[0].evidence, Contains("float32 twin passed 1e-05 on 3 shadow steps"));
  // Measured in its new tier from then on.
  train_steps(exec, trainer, data, 2);
  auto const reports = trainer.take_shadow_reports();
  REQUIRE(reports.size() == 4);
  for (auto const& e : reports.back().layers)
    if (e.layer == "residual/multi_head_attention") CHECK(e.policy == "mixed_bfloat16");
}

TEMPLATE_LIST_TEST_CASE("a guarded run saved through its trainer resumes with the guard's evidence, waits and moves",
                        "[model][guard]", mpx_test::executors) {
  TestType exec;
  mpx_test::scratch_dir const scratch("guard_resume");
  mpx::guard_options const options{.forward_overflows = 3, .window = 50, .review_every = 5, .move_down_after = 10};
  std::vector<mpx::guard_move> whole;  // the uninterrupted run: moves at 5, 15, 20, 40, 45
  {
    auto model = attention_model();
    with_grown_attention(exec, model, options, [&](auto& trainer, auto const& data, auto&) {
      train_steps(exec, trainer, data, 50);
      whole = trainer.guard()->moves();
    });
  }
  REQUIRE(whole.size() == 5);
  // Saved after step 18, in the cheaper tier with three overflowed steps flagged since the
  // review at 15, and after step 23, in the higher tier with a doubled wait running.
  mpx_test::scratch_dir const at_18("guard_resume_18");
  {
    auto model = attention_model();
    with_grown_attention(exec, model, options, [&](auto& trainer, auto const& data, auto&) {
      train_steps(exec, trainer, data, 18);
      mpx::save_training_state(exec, trainer, at_18.path);
      train_steps(exec, trainer, data, 5, 4, 18);
      mpx::save_training_state(exec, trainer, scratch.path);
    });
  }
  auto const data = token_data(exec, 16);
  for (std::size_t const saved : {18, 23}) {
    INFO("resumed after step " << saved);
    auto model = attention_model();
    model.build(exec, {tokens}, 9);
    auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 3e-3f),
                                               mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
    mpx::classifier_trainer trainer(exec, model, optimizer);
    trainer.guard(options);
    mpx::load_training_state(exec, trainer, saved == 18 ? at_18.path : scratch.path);
    CHECK(trainer.steps_taken() == saved);
    CHECK(attention_of(model).active_tier() == (saved == 18 ? 0u : 1u));
    train_steps(exec, trainer, data, 50 - saved, 4, saved);
    auto const& moves = trainer.guard()->moves();
    REQUIRE(moves.size() == whole.size());
    for (std::size_t i = 0; i < moves.size(); ++i) {
      INFO("move " << i << ": " << moves[i].text() << " / " << whole[i].text());
      CHECK(moves[i].step == whole[i].step);
      CHECK(moves[i].text() == whole[i].text());
    }
  }

  // A trainer without a guard cannot take a guarded save; nothing is loaded.
  auto other = attention_model();
  other.build(exec, {tokens}, 9);
  auto other_optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, other.parameters(exec), 3e-3f),
                                                   mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::classifier_trainer unguarded(exec, other, other_optimizer);
  CHECK_THROWS_TYPE_WITH(mpx::load_training_state(exec, unguarded, scratch.path), mpx::checkpoint_error,
                         Contains("saved by a trainer with a precision guard"));
  CHECK(attention_of(other).active_tier() == 0);
  // Loaded without the trainer, the guard's part is passed over.
  mpx::load_training_state(exec, other, other_optimizer, scratch.path);
  CHECK(attention_of(other).active_tier() == 1);
}

TEMPLATE_LIST_TEST_CASE("a checkpoint keeps the tiers", "[model][guard]", mpx_test::executors) {
  TestType exec;
  mpx_test::scratch_dir const scratch("guard_tiers");
  auto const& dir = scratch.path;
  auto model = attention_model();
  model.build(exec, {tokens}, 5);
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  attention_of(model).set_active_tier(1);
  mpx::save_training_state(exec, model, optimizer, dir);

  auto resumed = attention_model();
  resumed.build(exec, {tokens}, 9);
  auto resumed_optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, resumed.parameters(exec), 1e-3f),
                                                     mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  CHECK(attention_of(resumed).active_tier() == 0);
  mpx::load_training_state(exec, resumed, resumed_optimizer, dir);
  CHECK(attention_of(resumed).active_tier() == 1);

  // A model without that tiered layer refuses the save (here for the tier's own counters).
  auto other = mpx::sequential<mpx::mixed_float16>(
      mpx::embedding<>(vocab, width, tokens), mpx::residual(mpx::layer_norm<>(), mpx::causal_self_attention<>(2, false)),
      mpx::dense<>(vocab));
  other.build(exec, {tokens}, 5);
  auto other_optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, other.parameters(exec), 1e-3f),
                                                   mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  CHECK_THROWS_TYPE_WITH(mpx::load_training_state(exec, other, other_optimizer, dir), mpx::checkpoint_error,
                         Contains("nothing was loaded"));
}

TEMPLATE_LIST_TEST_CASE("an fp8 layer fed growing outliers saturates and moves; steady inputs move nothing",
                        "[model][guard][fp8]", mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  constexpr std::int64_t batch = 16, features = 32;
  auto model = mpx::sequential<mpx::mixed_fp8>(
      mpx::tiered<mpx::dense, mpx::model_policy, mpx::mixed_bfloat16>(16, mpx::activation::relu), mpx::dense<>(16));
  model.build(exec, {features}, 3);
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f),
                                             mpx::static_loss_scaler(exec, 1.0f));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  trainer.guard({.fp8_saturations = 3, .window = 50, .review_every = 4});
  auto pixels = mpx_test::random_values<float>(batch * features, -2.0, 2.0, 8);
  std::vector<std::int32_t> labels(batch);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 16);
  auto const y = mpx_test::upload(exec, labels, mpx::shape{batch});
  auto step = [&](float outlier) {
    auto x = pixels;
    if (outlier != 0) x[5] = outlier;
    auto const xd = mpx_test::upload(exec, x, mpx::shape{batch, features});
    trainer.step(exec, mpx::tensor_view<float const, space>(xd.view()), mpx::tensor_view<std::int32_t const, space>(y.view()));
  };
  for (int s = 0; s < 8; ++s) step(0);  // steady: the delayed scales settle, nothing saturates
  auto const* guard = trainer.guard();
  CHECK(guard->moves().empty());
  for (auto const& c : guard->counts()) CHECK(c.saturated == 0);
  // An outlier that grows 8-fold every step: the history never covers it.
  for (int s = 0; s < 4; ++s) step(1000.0f * std::pow(8.0f, static_cast<float>(s)));
  REQUIRE(guard->moves().size() == 1);
  CHECK(guard->moves()[0].layer == "dense");
  CHECK(guard->moves()[0].step == 12);
  CHECK_THAT(guard->moves()[0].text(), Contains("fp8 casts saturated") && Contains("in 4 steps") &&
                                           Contains("now mixed_bfloat16"));
  trainer.history(exec);
}

TEMPLATE_LIST_TEST_CASE("a batch float16 cannot hold is nobody's: no layer is counted or moved", "[model][guard]",
                        mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  auto model = mpx::sequential<mpx::mixed_float16>(
      mpx::residual(mpx::dense<>(16, mpx::activation::relu)),  // re-reads the model's input for its sum
      mpx::tiered<mpx::dense, mpx::model_policy, mpx::mixed_bfloat16>(8, mpx::activation::relu), mpx::dense<>(3));
  model.build(exec, {16}, 3);
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  trainer.guard({.forward_overflows = 2, .window = 50, .review_every = 4});
  std::vector<std::int32_t> labels(4, 1);
  auto const y = mpx_test::upload(exec, labels, mpx::shape{4});
  for (int s = 0; s < 8; ++s) {
    auto x = mpx_test::random_values<float>(4 * 16, -1.0, 1.0, 20 + static_cast<std::uint64_t>(s));
    // From step 3 a value float16 cannot hold: inf in the model's cast of its input, which
    // every layer then reads. A new buffer each step, as a loader's.
    if (s >= 2) x[static_cast<std::size_t>(s)] = 1e5f;
    auto const xd = mpx_test::upload(exec, x, mpx::shape{4, 16});
    trainer.step(exec, mpx::tensor_view<float const, space>(xd.view()), mpx::tensor_view<std::int32_t const, space>(y.view()));
  }
  auto const records = trainer.history(exec);
  CHECK(records[1].skipped == 0);
  for (std::size_t i = 2; i < records.size(); ++i) CHECK(records[i].skipped == 1);
  CHECK(trainer.guard()->moves().empty());
  for (auto const& c : trainer.guard()->counts()) {
    INFO(c.layer);
    CHECK(c.forward == 0);
    CHECK(c.backward == 0);
  }
}

TEMPLATE_LIST_TEST_CASE("fit guards a run: the move is in its epoch's summary", "[model][guard]",
                        mpx_test::executors) {
  TestType exec;
  using space = mpx::memory_space_t<TestType>;
  auto model = mpx::sequential<mpx::mixed_float16>(
      mpx::flatten<>(), mpx::dense<>(8, mpx::activation::relu),
      mpx::tiered<mpx::dense, mpx::model_policy, mpx::mixed_bfloat16>(3));
  model.build(exec, {4, 4}, 3);
  std::vector<float> pixels(16 * 16);
  for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = 8.0f + static_cast<float>(i % 5);
  std::vector<std::int32_t> labels(16);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 3);
  auto const images = mpx_test::upload(exec, pixels, mpx::shape{16, 4, 4});
  auto const targets = mpx_test::upload(exec, labels, mpx::shape{16});
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = rule.min_scale = 0x1p16f;  // at the floor: the last layer's gradients overflow
  mpx::dynamic_loss_scaler scaler(exec, rule);
  scaler.on_stuck([](mpx::loss_scale_report const&) {});
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f), std::move(scaler));
  mpx::tensor_batches<float, space> batches{images, targets, 4};  // 4 steps an epoch
  mpx::fit_options options;
  options.epochs = 2;
  options.quiet = true;
  options.guard = mpx::guard_options{.stuck_overflows = 3, .window = 50, .review_every = 4};
  auto const history = mpx::fit(exec, model, optimizer, batches, options);
  REQUIRE(history.size() == 2);
  REQUIRE(history[0].tier_moves.size() == 1);
  CHECK(history[0].tier_moves[0].layer == "dense_1");
  CHECK(history[0].tier_moves[0].step == 4);
  CHECK(history[1].tier_moves.empty());
  CHECK(model.template layer<2>().active_tier() == 1);
}

#if MPX_HAS_CUDA
TEST_CASE("in CUDA-graph mode the guard counts what replays compute; a new guard and a move capture again",
          "[model][guard][cuda_graph]") {
  mpx::cuda_executor exec;
  auto model = attention_model();
  model.build(exec, {tokens}, 5);
  auto const data = token_data(exec, 16);
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 3e-3f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  trainer.use_cuda_graph(true);
  train_steps(exec, trainer, data, 2);  // eager, then captured
  // A guard after the capture: the next step runs eagerly with it, the one after is
  // captured with its scan, and the replays count.
  trainer.guard({.forward_overflows = 3, .window = 50, .review_every = 5});
  grow_attention(exec, model, 512.0f);
  auto const before = train_steps(exec, trainer, data, 3);  // steps 3 (eager), 4 (captured), 5 (replayed)
  for (auto const& r : before) CHECK(r.skipped == 1);
  REQUIRE(trainer.guard()->moves().size() == 1);
  CHECK(trainer.guard()->moves()[0].step == 5);
  CHECK_THAT(trainer.guard()->moves()[0].evidence, Contains("3 of its forward passes"));
  // The move changes which tier runs: captured again, in bfloat16, and the model trains.
  auto const after = train_steps(exec, trainer, data, 20);
  std::size_t taken = 0;
  for (auto const& r : after) taken += r.skipped == 0;
  CHECK(taken >= 15);
  CHECK(after.back().skipped == 0);
}
#endif

TEST_CASE("the guard refuses options it cannot act on", "[model][guard]") {
  CHECK_THROWS_AS(mpx::precision_guard<mpx::host_space>({.forward_overflows = 0}), mpx::invalid_argument);
  CHECK_THROWS_AS(mpx::precision_guard<mpx::host_space>({.review_every = 0}), mpx::invalid_argument);
  CHECK_THROWS_AS(mpx::precision_guard<mpx::host_space>({.fp8_saturations = 0}), mpx::invalid_argument);
  CHECK_THROWS_AS(mpx::precision_guard<mpx::host_space>({.shadow_error = -1}), mpx::invalid_argument);
  CHECK_THROWS_AS(mpx::precision_guard<mpx::host_space>({.shadow_error = NAN}), mpx::invalid_argument);
}

}  // namespace guard_tests
