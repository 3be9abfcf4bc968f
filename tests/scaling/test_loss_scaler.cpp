// Loss scalers: the scale trajectory of each preset against a literal transcription of
// the rule it reproduces (Keras's LossScaleOptimizer, PyTorch's GradScaler), hysteresis
// and bounds, the stuck-scale report, the static scaler, and refused options.
#include "support/testing.hpp"

#include <atomic>
#include <cmath>
#include <random>
#include <thread>

namespace {

// keras/mixed_precision/loss_scale_optimizer.py, _DynamicLossScaleState.update: the
// scale is a float32 variable; growth only to a finite value; backoff to at least 1.
struct keras_reference {
  float scale = 32768.0f;
  int counter = 0;
  void update(bool finite) {
    if (finite) {
      if (counter + 1 >= 2000) {
        float const grown = scale * 2.0f;
        if (std::isfinite(grown)) scale = grown;
        counter = 0;
      } else {
        counter += 1;
      }
    } else {
      scale = std::max(scale / 2.0f, 1.0f);
      counter = 0;
    }
  }
};

// aten/src/ATen/native/cuda/AmpKernels.cu, _amp_update_scale_ (GradScaler defaults).
struct pytorch_reference {
  float scale = 65536.0f;
  int growth_tracker = 0;
  void update(bool found_inf) {
    if (found_inf) {
      scale *= 0.5f;
      growth_tracker = 0;
    } else {
      int const successful = growth_tracker + 1;
      if (successful == 2000) {
        float const grown = scale * 2.0f;
        if (std::isfinite(grown)) scale = grown;
        growth_tracker = 0;
      } else {
        growth_tracker = successful;
      }
    }
  }
};

// A scripted run: long finite stretches (so the scale grows), isolated overflows, bursts
// of overflows, and one long burst that drives the scale to its floor.
std::vector<bool> scripted_overflows() {
  std::vector<bool> out;
  std::mt19937 gen(mpx_test::seed);
  auto finite = [&](int n) { out.insert(out.end(), static_cast<std::size_t>(n), false); };
  auto overflow = [&](int n) { out.insert(out.end(), static_cast<std::size_t>(n), true); };
  finite(4100);  // two growths
  overflow(1);
  finite(1999);
  overflow(3);
  finite(2001);
  for (int i = 0; i < 600; ++i) out.push_back(gen() % 7 == 0);
  overflow(25);  // 2^15 or 2^16 halved 25 times: Keras stops at 1
  finite(2000);
  overflow(1);
  return out;
}

// Drives a scaler through `overflows`: one float gradient, set to inf or to a finite
// value before each check; returns (scale after the step, skipped?) per step.
template <class Exec, class Scaler>
std::vector<std::pair<float, bool>> run_scaler(Exec const& exec, Scaler& scaler, std::vector<bool> const& overflows) {
  auto grad = mpx::make_tensor<float>(exec, {1});
  mpx::gradient_list<Exec> list(exec, {grad}, {"only/gradient"});
  std::vector<std::pair<float, bool>> out;
  for (bool bad : overflows) {
    mpx::fill(exec, grad, bad ? std::numeric_limits<float>::infinity() : 1.0f);
    scaler.unscale_and_check(exec, list);
    scaler.update(exec, list);
    auto const s = scaler.state(exec);
    out.emplace_back(s.scale, s.last_step_skipped != 0);
  }
  return out;
}

template <class Reference>
void check_trajectory(std::vector<std::pair<float, bool>> const& got, std::vector<bool> const& overflows,
                      Reference ref) {
  REQUIRE(got.size() == overflows.size());
  for (std::size_t i = 0; i < overflows.size(); ++i) {
    ref.update(i < overflows.size() && !overflows[i] ? true : false);
    // Keras's update takes "is finite", PyTorch's "found inf": Reference adapts below.
    INFO("step " << i);
    REQUIRE(got[i].second == overflows[i]);
    REQUIRE(got[i].first == ref.scale);
  }
}

struct keras_by_finite : keras_reference {};
struct pytorch_by_finite : pytorch_reference {
  void update(bool finite) { pytorch_reference::update(!finite); }
};

}  // namespace

TEMPLATE_LIST_TEST_CASE("dynamic_loss_scaler reproduces Keras's LossScaleOptimizer step for step", "[scaling]",
                        mpx_test::executors) {
  TestType exec;
  auto const overflows = scripted_overflows();
  mpx::dynamic_loss_scaler scaler(exec, mpx::keras_loss_scale());
  std::vector<mpx::loss_scale_report> reports;
  scaler.on_stuck([&](mpx::loss_scale_report const& r) { reports.push_back(r); });
  auto const got = run_scaler(exec, scaler, overflows);
  check_trajectory(got, overflows, keras_by_finite{});
  // The long burst reaches the floor of 1 and keeps overflowing there: reported once.
  exec.synchronize();
  scaler.poll();
  REQUIRE(reports.size() == 1);
  CHECK(reports[0].scale == 1.0f);
  CHECK(reports[0].gradient == "only/gradient");
  CHECK_THAT(reports[0].message, Catch::Contains("minimum") && Catch::Contains("diverged"));
  auto const s = scaler.state(exec);
  std::size_t const skipped = static_cast<std::size_t>(std::count(overflows.begin(), overflows.end(), true));
  CHECK(s.skipped_steps == skipped);
  CHECK(s.applied_steps == overflows.size() - skipped);
}

TEMPLATE_LIST_TEST_CASE("dynamic_loss_scaler reproduces PyTorch's GradScaler step for step", "[scaling]",
                        mpx_test::executors) {
  TestType exec;
  auto const overflows = scripted_overflows();
  mpx::dynamic_loss_scaler scaler(exec, mpx::pytorch_grad_scaler());
  scaler.on_stuck([](mpx::loss_scale_report const&) { FAIL("PyTorch's preset has no floor in this range"); });
  check_trajectory(run_scaler(exec, scaler, overflows), overflows, pytorch_by_finite{});
}

TEMPLATE_LIST_TEST_CASE("hysteresis tolerates overflows before backing off; bounds hold", "[scaling]",
                        mpx_test::executors) {
  TestType exec;
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = 1024;
  rule.growth_interval = 3;
  rule.hysteresis = 3;
  rule.max_scale = 4096;
  rule.min_scale = 256;
  mpx::dynamic_loss_scaler scaler(exec, rule);
  scaler.on_stuck([](mpx::loss_scale_report const&) {});
  //                 overflow x2: kept; third: halved; fourth (allowance used up): halved again
  std::vector<bool> const overflows = {true, true, true, true, false, false, false,  // grows, allowance restored
                                       false, false, false, false, false, false,      // 2048 -> 4096 -> capped
                                       true, true, true, true, true, true, true};     // down to the floor 256
  std::vector<float> const expected = {1024, 1024, 512, 256, 256, 256, 512, 512, 512, 1024, 1024, 1024, 2048,
                                       2048, 2048, 1024, 512, 256, 256, 256};
  auto const got = run_scaler(exec, scaler, overflows);
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("step " << i);
    CHECK(got[i].first == expected[i]);
    CHECK(got[i].second == overflows[i]);
  }
  // Growth stops at max_scale.
  mpx::dynamic_scale_rule capped;
  capped.initial_scale = 2048;
  capped.growth_interval = 1;
  capped.max_scale = 3000;
  mpx::dynamic_loss_scaler top(exec, capped);
  auto const up = run_scaler(exec, top, std::vector<bool>(3, false));
  CHECK(up.back().first == 3000.0f);
}

TEMPLATE_LIST_TEST_CASE("a scale stuck at its minimum throws mpx::loss_scale_error by default", "[scaling]",
                        mpx_test::executors) {
  TestType exec;
  mpx::dynamic_scale_rule rule;
  rule.initial_scale = 2;
  rule.report_after = 3;
  mpx::dynamic_loss_scaler scaler(exec, rule);
  auto grad = mpx::make_tensor<float>(exec, {3});
  mpx::gradient_list<TestType> list(exec, {grad}, {"dense/kernel"});
  mpx::fill(exec, grad, std::numeric_limits<float>::quiet_NaN());
  auto overflowing_step = [&] {
    scaler.unscale_and_check(exec, list);
    scaler.update(exec, list);
    exec.synchronize();
    scaler.poll();
  };
  overflowing_step();  // 2 -> 1: not yet at the minimum when it overflowed
  overflowing_step();  // at the minimum once
  overflowing_step();  // twice
  try {
    overflowing_step();  // three times in a row: stuck
    FAIL("a scale stuck at its minimum was not reported");
  } catch (mpx::loss_scale_error const& e) {
    CHECK_THAT(e.what(), Catch::Contains("minimum (1)") && Catch::Contains("3 step(s) in a row") &&
                             Catch::Contains("'dense/kernel'"));
  }
  overflowing_step();  // the same run of overflows is reported once, not at every step
}

TEMPLATE_LIST_TEST_CASE("static_loss_scaler keeps its scale, skips overflows, reports a run of them", "[scaling]",
                        mpx_test::executors) {
  TestType exec;
  mpx::static_loss_scaler scaler(exec, 128.0f, 4);
  int reports = 0;
  scaler.on_stuck([&](mpx::loss_scale_report const& r) {
    ++reports;
    // Exact on every executor: the report describes the step that reached report_after,
    // however many later steps the GPU had run when it was read.
    CHECK(r.consecutive == 4);
    CHECK(r.scale == 128.0f);
    CHECK(r.first_nonfinite == 0);
  });
  std::vector<bool> const overflows = {false, true, true, true, false, true, true, true, true, true, false};
  auto const got = run_scaler(exec, scaler, overflows);
  exec.synchronize();
  scaler.poll();
  for (std::size_t i = 0; i < got.size(); ++i) {
    CHECK(got[i].first == 128.0f);
    CHECK(got[i].second == overflows[i]);
  }
  CHECK(reports == 1);
  CHECK(scaler.state(exec).skipped_steps == 8);
}

TEMPLATE_LIST_TEST_CASE("loss scalers refuse meaningless options", "[scaling]", mpx_test::executors) {
  TestType exec;
  mpx::dynamic_scale_rule r;
  r.growth_factor = 0.5f;
  CHECK_THROWS_TYPE_WITH(mpx::dynamic_loss_scaler(exec, r), mpx::invalid_argument, Catch::Contains("growth_factor"));
  r = {};
  r.backoff_factor = 2;
  CHECK_THROWS_TYPE_WITH(mpx::dynamic_loss_scaler(exec, r), mpx::invalid_argument, Catch::Contains("backoff_factor"));
  r = {};
  r.min_scale = 1e6f;
  CHECK_THROWS_TYPE_WITH(mpx::dynamic_loss_scaler(exec, r), mpx::invalid_argument, Catch::Contains("min_scale"));
  CHECK_THROWS_TYPE_WITH(mpx::static_loss_scaler(exec, 0.0f), mpx::invalid_argument, Catch::Contains("positive"));
  CHECK_THROWS_TYPE_WITH(mpx::static_loss_scaler(exec, std::numeric_limits<float>::infinity()), mpx::invalid_argument,
                         Catch::Contains("finite"));
}


// The signal the host reads is written once per run of overflows, at the step that
// reaches report_after; later steps of the same run leave it alone, so a late read (the
// GPU's case) sees the same values as a read at that step. Driven on the host directly.
TEST_CASE("the stuck signal holds the step that reached report_after, not a later one", "[scaling]") {
  mpx::static_scale_rule const rule{8.0f, 3};
  mpx::loss_scale_state state = rule.initial_state();
  mpx::detail::stuck_signal signal{};
  std::uint64_t optimizer_steps = 0;
  auto step = [&](bool overflow, std::int32_t first) {
    mpx::gradient_summary summary;
    summary.found_nonfinite = overflow ? 1u : 0u;
    summary.first_nonfinite = overflow ? first : -1;
    mpx::detail::finish_step(rule, &state, &summary, &optimizer_steps, &signal);
  };
  step(false, -1);
  step(true, 4);
  step(true, 5);
  CHECK(signal.consecutive == 0);  // two in a row: not yet
  step(true, 2);                   // the third: signalled, with this step's gradient
  CHECK(signal.consecutive == 3);
  CHECK(signal.first_nonfinite == 2);
  CHECK(signal.scale == 8.0f);
  std::uint32_t const first_run = signal.streak;
  for (std::int32_t later : {7, 1, 6}) {
    step(true, later);  // the same run goes on: the signal does not move
    CHECK(signal.consecutive == 3);
    CHECK(signal.first_nonfinite == 2);
    CHECK(signal.streak == first_run);
  }
  step(false, -1);  // ends the run
  step(true, 9);
  step(true, 9);
  CHECK(signal.streak == first_run);  // a new run, not yet at report_after
  step(true, 0);
  CHECK(signal.consecutive == 3);
  CHECK(signal.first_nonfinite == 0);
  CHECK(signal.streak != first_run);
  CHECK(optimizer_steps == 2);
  CHECK(state.skipped_steps == 9);
}

// The same through the scaler, with every step enqueued before the first can run on a
// GPU: the report, read only at the end, is the one of the step that reached
// report_after (gradient 'layer/a'), not of the last step (where only 'layer/b' overflows).
TEMPLATE_LIST_TEST_CASE("a stuck report names the gradient the backward pass wrote non-finite first, and how to "
                        "find the layer",
                        "[scaling]", mpx_test::executors) {
  TestType exec;
  mpx::static_loss_scaler scaler(exec, 64.0f, 2);
  // Listed in layer order, as a model's parameters are: backpropagation writes 'dense_1'
  // first, and its NaN spreads to 'dense' below it.
  auto a = mpx::make_tensor<float>(exec, {5});
  auto b = mpx::make_tensor<float>(exec, {3});
  auto c = mpx::make_tensor<float>(exec, {4});
  mpx::gradient_list<TestType> list(exec, {a, b, c}, {"dense/kernel", "dense_1/kernel", "dense_2/kernel"});
  std::vector<mpx::loss_scale_report> reports;
  scaler.on_stuck([&](mpx::loss_scale_report const& r) { reports.push_back(r); });
  mpx::fill(exec, a, std::numeric_limits<float>::quiet_NaN());
  mpx::fill(exec, b, std::numeric_limits<float>::quiet_NaN());
  mpx::fill(exec, c, 1.0f);
  for (int step = 0; step < 2; ++step) {
    scaler.unscale_and_check(exec, list);
    scaler.update(exec, list);
  }
  exec.synchronize();
  scaler.poll();
  REQUIRE(reports.size() == 1);
  CHECK(reports[0].first_nonfinite == 0);
  CHECK(reports[0].last_nonfinite == 1);
  CHECK(reports[0].gradient == "dense_1/kernel");
  CHECK_THAT(reports[0].message, Catch::Contains("the first the backward pass wrote: 'dense_1/kernel'") &&
                                     Catch::Contains("mpx::find_nonfinite(exec, model)"));
  auto const summary = list.summary(exec);
  CHECK(summary.first_nonfinite == 0);
  CHECK(summary.last_nonfinite == 1);
}

TEMPLATE_LIST_TEST_CASE("a late stuck report describes the step that reached report_after", "[scaling]",
                        mpx_test::executors) {
  TestType exec;
  mpx::static_loss_scaler scaler(exec, 64.0f, 3);
  auto a = mpx::make_tensor<float>(exec, {5});
  auto b = mpx::make_tensor<float>(exec, {7});
  mpx::gradient_list<TestType> list(exec, {a, b}, {"layer/a", "layer/b"});
  std::vector<mpx::loss_scale_report> reports;
  scaler.on_stuck([&](mpx::loss_scale_report const& r) { reports.push_back(r); });
  float const inf = std::numeric_limits<float>::infinity();
  exec.synchronize();
  {
    mpx_test::stream_hold<TestType> hold(exec);
    for (int step = 0; step < 7; ++step) {
      mpx::fill(exec, a, step < 3 ? inf : 1.0f);
      mpx::fill(exec, b, step < 3 ? 1.0f : -inf);
      scaler.unscale_and_check(exec, list);
      scaler.update(exec, list);
    }
    if (hold.held()) CHECK(reports.empty());  // nothing has run yet
    hold.release();
    exec.synchronize();
  }
  scaler.poll();
  REQUIRE(reports.size() == 1);
  CHECK(reports[0].consecutive == 3);
  CHECK(reports[0].first_nonfinite == 0);
  CHECK(reports[0].gradient == "layer/a");
  CHECK(reports[0].scale == 64.0f);
  CHECK_THAT(reports[0].message, Catch::Contains("3 step(s) in a row") && Catch::Contains("'layer/a'"));
  CHECK(scaler.state(exec).skipped_steps == 7);
  scaler.poll();  // the same run, read again: not reported twice
  CHECK(reports.size() == 1);
}
