// docs/optimizers.md: why 16-bit parameters need float master weights; a small training
// loop with mpx::loss_scale_optimizer over half parameters (the loss gradient scaled,
// an overflowing step skipped, the scale adjusted); saving and loading a checkpoint.
#include <mpx/mpx.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <vector>

using mpx::half;
using param = mpx::parameter<mpx::host_space>;

// A learning-rate schedule of your own: any MPX_HD functor from the number of applied
// steps to a rate. This one halves the rate every `every` steps.
struct halve_every {
  float rate;
  std::uint64_t every;
  MPX_HD float operator()(std::uint64_t applied_steps) const noexcept {
    std::uint64_t const halvings = applied_steps / every;
    return halvings < 64 ? rate / static_cast<float>(std::uint64_t{1} << halvings) : 0.0f;
  }
};

// A tiny model: two half parameters and the loss L = k/2 * sum((w - target)^2), with
// k = 1e-8. Starting from w = 0, every dL/dw = k * (w - target) is at most 1.5e-8 in
// magnitude, below 2^-25 ~ 2.98e-8: stored in half, it is 0.
struct model {
  mpx::host_executor exec;
  mpx::tensor<half> kernel = mpx::make_tensor<half>(exec, {2, 2}), bias = mpx::make_tensor<half>(exec, {2});
  mpx::tensor<half> d_kernel = mpx::make_tensor<half>(exec, {2, 2}), d_bias = mpx::make_tensor<half>(exec, {2});
  static constexpr float k = 1e-8f;
  static constexpr float target[6] = {0.5f, -0.25f, 1.5f, 0.75f, -1.0f, 0.125f};

  model() {
    mpx::fill(exec, kernel, half{});
    mpx::fill(exec, bias, half{});
  }
  std::vector<param> parameters() { return {{"dense/kernel", kernel, d_kernel}, {"dense/bias", bias, d_bias}}; }

  // Backpropagation from the loss gradient `seed` (1, times the loss scale): writes
  // seed * k * (w - target) into the half gradients.
  void backward(float seed) {
    for (std::size_t i = 0; i < 4; ++i)
      d_kernel[i] = mpx::cast<half>(seed * k * (mpx::cast<float>(kernel[i]) - target[i]));
    for (std::size_t i = 0; i < 2; ++i) d_bias[i] = mpx::cast<half>(seed * k * (mpx::cast<float>(bias[i]) - target[4 + i]));
  }
  float worst_error() const {
    float e = 0;
    for (std::size_t i = 0; i < 4; ++i) e = std::max(e, std::abs(mpx::cast<float>(kernel[i]) - target[i]));
    for (std::size_t i = 0; i < 2; ++i) e = std::max(e, std::abs(mpx::cast<float>(bias[i]) - target[4 + i]));
    return e;
  }
};

// Steps of training. The loss gradient dL/dL = 1 is scaled by the optimizer's current
// loss scale before backpropagation; step 7 overflows (a bad batch: inf in a gradient).
template <class LossScaleOptimizer>
void train(LossScaleOptimizer& lso, model& m, int steps, bool print) {
  mpx::host_executor exec;
  auto seed = mpx::make_tensor<float>(exec, {1});
  for (int step = 0; step < steps; ++step) {
    mpx::fill(exec, seed, 1.0f);
    lso.scale_loss_gradient(exec, seed);  // seed = 1 * scale
    m.backward(seed[0]);
    if (step == 7) m.d_bias[1] = mpx::cast<half>(std::numeric_limits<float>::infinity());
    lso.step(exec);  // unscale and check, update unless not finite, adjust the scale
    if (print && (step % 40 == 0 || step == 7 || step == 8 || step == steps - 1)) {
      mpx::loss_scale_state const s = lso.scaler().state(exec);
      std::printf("step %3d  scale %6g  skipped %llu  applied %llu  worst |w - target| %.4f\n", step, s.scale,
                  static_cast<unsigned long long>(s.skipped_steps), static_cast<unsigned long long>(s.applied_steps),
                  m.worst_error());
    }
  }
}

int main() {
  bool ok = true;
  mpx::host_executor exec;

  // 1. Why float master weights. lr * g = 1e-4 on a weight of 1: just below 1, half's
  //    spacing is 2^-11, so a change under 2^-12 ~ 2.4e-4 rounds back to 1.
  auto w = mpx::make_tensor<half>(exec, {1}), g = mpx::make_tensor<half>(exec, {1});
  mpx::fill(exec, w, mpx::cast<half>(1.0f));
  mpx::fill(exec, g, mpx::cast<half>(1.0f));
  for (int i = 0; i < 100; ++i) mpx::axpy(exec, -1e-4f, g, w);  // w -= 1e-4 * g, in half
  std::printf("100 updates of -1e-4 applied to a half weight: %g\n", mpx::cast<float>(w[0]));
  ok &= mpx::cast<float>(w[0]) == 1.0f;
  mpx::fill(exec, w, mpx::cast<half>(1.0f));
  mpx::sgd plain(exec, std::vector<param>{{"w", w, g}}, 1e-4f);  // keeps a float master copy of w
  for (int i = 0; i < 100; ++i) plain.step(exec);
  std::printf("the same through mpx::sgd (float master weight): %g\n", mpx::cast<float>(w[0]));
  ok &= mpx::cast<float>(w[0]) == mpx::cast<float>(mpx::cast<half>(0.99f)) && plain.steps(exec) == 100;

  // 2. Training without a loss scale: every gradient is 0 in half, nothing moves.
  model unscaled;
  mpx::loss_scale_optimizer no_scale(mpx::adam(exec, unscaled.parameters(), 0.05f), mpx::static_loss_scaler(exec, 1.0f));
  train(no_scale, unscaled, 20, false);
  std::printf("without loss scaling, after 20 steps: worst |w - target| %.4f, gradient norm %g\n",
              unscaled.worst_error(), no_scale.last_check(exec).norm);
  ok &= unscaled.worst_error() == 1.5f && no_scale.last_check(exec).norm == 0.0f;
  ok &= no_scale.optimizer().steps(exec) == 19;  // step 7's inf is still skipped

  // 3. With a dynamic loss scale (Keras's rule, but growing every 40 good steps rather
  //    than 2000, to show it) and the schedule above.
  model m;
  mpx::dynamic_scale_rule rule;
  rule.growth_interval = 40;
  halve_every const schedule{0.05f, 100};
  mpx::loss_scale_optimizer lso(mpx::adam(exec, m.parameters(), schedule), mpx::dynamic_loss_scaler(exec, rule),
                                {.clip_global_norm = 1.0f});
  train(lso, m, 200, true);
  mpx::gradient_summary const last = lso.last_check(exec);
  std::printf("last step: norm %.3g (unscaled), optimizer steps %llu\n", last.norm,
              static_cast<unsigned long long>(lso.optimizer().steps(exec)));
  ok &= m.worst_error() < 0.01f;
  ok &= lso.optimizer().steps(exec) == 199 && lso.scaler().state(exec).skipped_steps == 1;
  ok &= lso.scaler().scale(exec) == 262144.0f;  // 2^15, 2^14 at step 7, then x2 at steps 47, 87, 127, 167

  // 4. Save, and load into a fresh model and optimizer.
  auto const path = std::filesystem::temp_directory_path() /
                    ("mpx_doc_optimizers_" + std::to_string(std::random_device{}()) + ".mpxckpt");
  lso.save(exec, path);
  model copy;
  mpx::loss_scale_optimizer restored(mpx::adam(exec, copy.parameters(), schedule), mpx::dynamic_loss_scaler(exec, rule),
                                     {.clip_global_norm = 1.0f});
  restored.load(exec, path);
  ok &= restored.optimizer().steps(exec) == 199 && restored.scaler().scale(exec) == 262144.0f;
  ok &= restored.scaler().state(exec).skipped_steps == 1;
  // The copy continues exactly as the original: master weights and moments came along.
  train(lso, m, 10, false);
  train(restored, copy, 10, false);
  for (std::size_t i = 0; i < 4; ++i) ok &= mpx::bits(copy.kernel[i]) == mpx::bits(m.kernel[i]);
  for (std::size_t i = 0; i < 2; ++i) ok &= mpx::bits(copy.bias[i]) == mpx::bits(m.bias[i]);

  // A checkpoint of another optimizer (SGD) is refused, and nothing is changed.
  model other;
  mpx::loss_scale_optimizer wrong(mpx::sgd(exec, other.parameters(), 0.05f), mpx::dynamic_loss_scaler(exec, rule));
  try {
    wrong.load(exec, path);
    ok = false;
  } catch (mpx::checkpoint_error const& e) {
    std::printf("%s\n", e.what());
    ok &= std::string_view(e.what()).find("optimizer differs") != std::string_view::npos;
  }
  ok &= other.worst_error() == 1.5f && wrong.optimizer().steps(exec) == 0 && wrong.scaler().scale(exec) == 32768.0f;
  std::filesystem::remove(path);

  // 5. The built-in schedules, at a given number of applied steps.
  mpx::exponential_decay const exponential{.initial_rate = 1e-3f, .decay_steps = 1000, .decay_rate = 0.96f};
  ok &= exponential(0) == 1e-3f && std::abs(exponential(2000) - 1e-3f * 0.96f * 0.96f) < 1e-9f;
  mpx::cosine_decay const cosine{.peak_rate = 0.1f, .decay_steps = 100, .alpha = 0.0f, .warmup_steps = 10};
  ok &= cosine(0) == 0.01f && cosine(9) == 0.1f && cosine(60) == 0.05f && cosine(110) == 0.0f;
  ok &= schedule(99) == 0.05f && schedule(100) == 0.025f;
  return ok ? 0 : 1;
}
