// docs/loss_scaling.md: small gradients stored in float16 become zero, and a loss scale
// keeps them; a check of a gradient list that names the gradient that overflowed; a
// dynamic scaler that skips that step and backs off; the report of a stuck scale.
#include <mpx/mpx.hpp>

#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

using mpx::half;

int main() {
  bool ok = true;
  mpx::host_executor exec;

  // 1. The failure and the fix. Gradients as a float backward pass produces them, stored
  //    in half as they are, and stored after a loss scale of 2^15 (then divided in float).
  float const S = 32768.0f;
  std::vector<float> const true_grads = {1e-4f, 1e-6f, 6e-8f, 3e-8f, 1e-8f};
  std::printf("gradient  stored in half  scaled by 2^15, stored, unscaled\n");
  for (float g : true_grads) {
    float const plain = mpx::cast<float>(mpx::cast<half>(g));
    float const scaled = mpx::cast<float>(mpx::cast<half>(g * S)) / S;
    std::printf("%-8g  %-14g  %g\n", g, plain, scaled);
    ok &= std::abs(scaled - g) <= 1e-3f * g;  // within half's precision (2^-11 relative)
  }
  ok &= mpx::cast<float>(mpx::cast<half>(1e-8f)) == 0.0f;          // below 2^-25: zero
  ok &= mpx::cast<float>(mpx::cast<half>(3e-8f)) == 0x1p-24f;      // just above 2^-25: 2^-24, off by 99%

  // 2. Checking a step's gradients. The backward pass of (loss * 2^15) filled three
  //    gradients; one value of dense_2/kernel was 3.0 before scaling: 98304 > 65504.
  mpx::dynamic_loss_scaler scaler(exec);  // Keras's rule: 2^15, x2 after 2000 good steps, /2 on overflow
  auto k1 = mpx::make_tensor<half>(exec, {4});
  auto b1 = mpx::make_tensor<float>(exec, {2});
  auto k2 = mpx::make_tensor<half>(exec, {3});
  auto backward = [&](float scale) {  // stands in for backpropagating loss * scale
    float const g1[] = {1e-8f, -2e-8f, 4e-7f, 0.0f}, gb[] = {0.5f, -0.25f}, g2[] = {3.0f, 0.001f, -1.0f};
    for (std::size_t i = 0; i < 4; ++i) k1[i] = mpx::cast<half>(g1[i] * scale);
    for (std::size_t i = 0; i < 2; ++i) b1[i] = gb[i] * scale;
    for (std::size_t i = 0; i < 3; ++i) k2[i] = mpx::cast<half>(g2[i] * scale);
  };
  mpx::gradient_list<mpx::host_executor> grads(exec, {k1, b1, k2},
                                               {"dense_1/kernel", "dense_1/bias", "dense_2/kernel"});

  backward(scaler.scale(exec));
  scaler.unscale_and_check(exec, grads, /*max_norm=*/0, mpx::unscaling::deferred);
  mpx::gradient_summary const bad = grads.summary(exec);
  std::printf("step 1 at scale %g: found_nonfinite=%u first_nonfinite=%d (%s)\n", S, bad.found_nonfinite,
              bad.first_nonfinite, grads.name(static_cast<std::size_t>(bad.first_nonfinite)).c_str());
  ok &= bad.found_nonfinite == 1 && bad.first_nonfinite == 2;
  scaler.update(exec, grads);  // the step is skipped, the scale halved
  mpx::loss_scale_state st = scaler.state(exec);
  std::printf("  after update: scale=%g skipped_steps=%llu applied_steps=%llu\n", st.scale,
              static_cast<unsigned long long>(st.skipped_steps), static_cast<unsigned long long>(st.applied_steps));
  ok &= st.scale == 16384.0f && st.skipped_steps == 1 && st.last_step_skipped == 1;

  // The same step again at 2^14: 3.0 * 2^14 = 49152 fits. Clip the global norm to 1.
  backward(scaler.scale(exec));
  scaler.unscale_and_check(exec, grads, /*max_norm=*/1.0f, mpx::unscaling::deferred);
  mpx::gradient_summary const good = grads.summary(exec);
  std::vector<float> const norms = grads.norms(exec);
  std::printf("step 2 at scale %g: found_nonfinite=%u norm=%g clip_coefficient=%g gradient_factor=%g\n",
              st.scale, good.found_nonfinite, good.norm, good.clip_coefficient, good.gradient_factor);
  std::printf("  per-gradient norms: %g %g %g\n", norms[0], norms[1], norms[2]);
  ok &= good.found_nonfinite == 0 && good.first_nonfinite == -1;
  ok &= std::abs(good.norm - 3.21131f) < 1e-4f;  // sqrt(0.5^2 + 0.25^2 + 3^2 + 0.001^2 + 1^2), unscaled units
  ok &= good.clip_coefficient == 1.0f / (good.norm + 1e-6f);
  ok &= good.gradient_factor == good.clip_coefficient / 16384.0f;
  // Deferred: the half gradients still hold the scaled values; read them times the factor.
  float const smallest = mpx::cast<float>(k1[0]) / 16384.0f;
  ok &= std::abs(smallest - 1e-8f) < 1e-11f;
  scaler.update(exec, grads);
  st = scaler.state(exec);
  ok &= st.scale == 16384.0f && st.applied_steps == 1 && st.good_steps == 1;

  // In place, the half gradients are written back unscaled, and 1e-8 underflows again.
  scaler.unscale_and_check(exec, grads, 0, mpx::unscaling::in_place);
  std::printf("in place: dense_1/kernel[0] is now %g\n", mpx::cast<float>(k1[0]));
  ok &= mpx::cast<float>(k1[0]) == 0.0f && b1[0] == 0.5f;

  // 3. A scale stuck at its minimum: every gradient is NaN, whatever the scale.
  mpx::dynamic_scale_rule rule;  // Keras's defaults, but start low and report early
  rule.initial_scale = 4;
  rule.report_after = 3;
  mpx::dynamic_loss_scaler stuck(exec, rule);
  std::string message;
  stuck.on_stuck([&](mpx::loss_scale_report const& r) { message = r.message; });
  mpx::fill(exec, b1, std::numeric_limits<float>::quiet_NaN());
  int steps = 0;
  while (message.empty() && steps < 10) {
    stuck.unscale_and_check(exec, grads);
    stuck.update(exec, grads);
    ++steps;
  }
  std::printf("stuck after %d steps: %s\n", steps, message.c_str());
  ok &= steps == 5 && stuck.scale(exec) == 1.0f;  // 4 -> 2 -> 1, then 3 overflows at 1
  ok &= message.find("'dense_1/bias'") != std::string::npos;

  // Without a callback, the same report is an mpx::loss_scale_error.
  mpx::static_loss_scaler fixed(exec, 1.0f, /*report_after=*/2);
  try {
    for (int i = 0; i < 2; ++i) {
      fixed.unscale_and_check(exec, grads);
      fixed.update(exec, grads);
    }
    ok = false;
  } catch (mpx::loss_scale_error const& e) {
    ok &= std::string_view(e.what()).find("2 step(s) in a row") != std::string_view::npos;
  }
  return ok ? 0 : 1;
}
