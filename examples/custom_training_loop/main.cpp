// Loss scaling by hand: the training loop that mpx::loss_scale_optimizer (and mpx::fit)
// run for you, written out step by step, as a user with a custom loop writes it
// (Keras's "training loop from scratch" with get_scaled_loss / get_unscaled_gradients):
//
//   forward -> loss and dL/dlogits (float, in a buffer the model sizes to the batch)
//   -> multiply dL/dlogits by the scale (on the executor)
//   -> backpropagate (the gradients are stored in half, scaled)
//   -> mpx::unscale_and_check over an mpx::gradient_list of every parameter's gradient
//   -> read the verdict: any NaN or inf? -> step the optimizer, or skip the step
//   -> let the scaler update the scale from the verdict
//
// The scaler is the one the policy calls for (mpx::loss_scaler_for<policy>): dynamic
// under mixed_float16, a fixed 1 under bfloat16 or float32, so the loop serves every
// policy unchanged. Here the scale starts deliberately high (2^24; Keras starts at 2^15)
// and grows after 10 finite steps in a row (Keras waits 2000), so a short run shows both
// halves of the rule: a step whose scaled gradients overflow half is skipped and the
// scale halves; after 10 finite steps in a row it doubles, and may overflow again.
// 150 samples in batches of 64: every third step is a short batch of 22.
//
//   custom_training_loop [--executor auto|host|cuda] [--steps N]
#include <mpx/mpx.hpp>

#include "../common/command_line.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

using policy = mpx::mixed_float16;
constexpr std::int64_t samples = 150, features = 2, classes = 3;
constexpr std::size_t batch_size = 64;

//! Three Gaussian blobs in the plane, 50 points each, labelled by blob.
void make_blobs(std::vector<float>& x, std::vector<std::int32_t>& labels) {
  std::mt19937_64 gen(2024);
  std::normal_distribution<float> noise(0.0f, 0.6f);
  float const centre[classes][features] = {{-2, 0}, {2, 0}, {0, 2.5f}};
  x.resize(samples * features);
  labels.resize(samples);
  for (std::int64_t i = 0; i < samples; ++i) {
    auto const c = static_cast<std::int32_t>(i % classes);
    labels[static_cast<std::size_t>(i)] = c;
    for (std::int64_t j = 0; j < features; ++j)
      x[static_cast<std::size_t>(i * features + j)] = centre[c][j] + noise(gen);
  }
}

template <class Exec>
void train(Exec const& exec, int steps) {
  std::vector<float> host_x;
  std::vector<std::int32_t> host_labels;
  make_blobs(host_x, host_labels);
  auto x = mpx::make_tensor<float>(exec, {samples, features});
  mpx::copy(exec, mpx::tensor_view<float const>(host_x.data(), x.shape()), x);
  auto labels = mpx::make_tensor<std::int32_t>(exec, {samples});
  mpx::copy(exec, mpx::tensor_view<std::int32_t const>(host_labels.data(), labels.shape()), labels);
  mpx::tensor_batches batches(x, labels, batch_size);

  auto model = mpx::sequential<policy>(mpx::dense<>(16, mpx::activation::relu), mpx::dense<>(classes));
  model.build(exec, {features}, /*seed=*/1);
  std::printf("%s", model.summary().c_str());

  // The pieces loss_scale_optimizer would hold: the parameters' gradients as one list
  // (planned once for the multi-tensor check), a scaler, an optimizer.
  auto params = model.parameters(exec);
  std::vector<mpx::tensor_ref<mpx::memory_space_t<Exec>>> gradient_refs;
  std::vector<std::string> names;
  for (auto const& p : params) {
    gradient_refs.push_back(p.gradient);
    names.push_back(p.name);
  }
  mpx::gradient_list<Exec> gradients(exec, gradient_refs, names);

  mpx::dynamic_scale_rule rule;  // Keras's rule, with a higher start and a shorter growth interval
  rule.initial_scale = 1u << 24;
  rule.growth_interval = 10;
  auto scaler = mpx::loss_scaler_for<policy>(exec, rule);
  mpx::adam optimizer(exec, params, 1e-2f);
  mpx::loss_value loss(exec);

  std::printf("\n%5s %6s %10s %14s %8s  %s\n", "step", "batch", "loss", "scale", "skipped",
              "non-finite gradient nearest the cause / norm");
  std::size_t skipped = 0;
  float previous_scale = 0;
  for (int step = 1; step <= steps; ++step) {
    auto batch = batches.next();
    if (!batch) {  // the epoch is over: start the next one
      batches.start_epoch(0);
      batch = batches.next();
    }
    model.forward(exec, batch->images, /*training=*/true);

    // 1. The loss and its unscaled gradient, in float, into the model's buffer for
    //    dL/dlogits, which has this batch's shape (22 rows for the short last batch).
    auto const d_logits = model.logits_gradient(exec);
    mpx::sparse_categorical_cross_entropy<policy>(exec, model.logits(exec), batch->labels, d_logits, loss);

    // 2. Scale the loss gradient, reading the scale where the executor computes.
    scaler.scale_loss_gradient(exec, d_logits);

    // 3. Backpropagate: the model rounds the scaled dL/dlogits to half and every
    //    parameter's gradient is written, in half, still multiplied by the scale.
    model.backward_from_logits(exec, d_logits);

    // 4. Unscale and check every gradient in one pass. Deferred: the gradients stay
    //    scaled in memory (unscaled in half they could underflow again) and the verdict
    //    carries the factor, 1 / scale, that the optimizer multiplies them by as it reads.
    scaler.unscale_and_check(exec, gradients, /*max_norm=*/0.0f, mpx::unscaling::deferred);

    // 5. Read the verdict and decide. (Reading it, and the scale for the table, waits for
    //    a GPU; loss_scale_optimizer leaves both on the device, and a skip is decided there.)
    mpx::gradient_summary const verdict = gradients.summary(exec);
    float const scale = scaler.scale(exec);
    bool const skip = verdict.found_nonfinite != 0;
    if (!skip) optimizer.apply(exec, gradients.summary_data());  // Adam on the float master weights

    // 6. Update the scale from the verdict (halve on overflow, double after 10 finite
    //    steps); on an applied step this also advances Adam's step count.
    scaler.update(exec, gradients, optimizer.steps_data());

    skipped += skip;
    // Every step is checked; the table shows the first ten, every skipped one, every
    // change of scale and every tenth.
    bool const show = step <= 10 || skip || scale != previous_scale || step % 10 == 0 || step == steps;
    previous_scale = scale;
    if (!show) continue;
    char detail[96];
    if (skip)  // the last in list order: the first the backward pass wrote non-finite
      std::snprintf(detail, sizeof detail, "%s", gradients.name(static_cast<std::size_t>(verdict.last_nonfinite)).c_str());
    else std::snprintf(detail, sizeof detail, "norm %.4g", static_cast<double>(verdict.norm));
    std::printf("%5d %6zu %10.4f %14.0f %8s  %s\n", step, batch->size, static_cast<double>(loss.read(exec)),
                static_cast<double>(scale), skip ? "yes" : "no", detail);
  }

  model.forward(exec, x.view(), /*training=*/false);
  auto const logits = mpx::to_host(exec, model.logits(exec));
  std::size_t correct = 0;
  for (std::int64_t i = 0; i < samples; ++i) {
    std::int64_t best = 0;
    for (std::int64_t c = 1; c < classes; ++c)
      if (mpx::cast<float>(logits[static_cast<std::size_t>(i * classes + c)]) >
          mpx::cast<float>(logits[static_cast<std::size_t>(i * classes + best)]))
        best = c;
    correct += best == host_labels[static_cast<std::size_t>(i)];
  }
  mpx::loss_scale_state const state = scaler.state(exec);
  double const accuracy = static_cast<double>(correct) / static_cast<double>(samples);
  std::printf("\n%d steps: %zu skipped, %llu applied (Adam's step count: %llu), final scale %.0f, "
              "training accuracy %.1f%%\n",
              steps, skipped, static_cast<unsigned long long>(state.applied_steps),
              static_cast<unsigned long long>(optimizer.steps(exec)), static_cast<double>(state.scale),
              100.0 * accuracy);
  std::printf("The same loop in one call per step: mpx::loss_scale_optimizer(adam, scaler).step(exec), which\n"
              "also leaves the verdict on the device instead of reading it, so a GPU never waits.\n");
  if (steps >= 100 && accuracy < 0.9)
    throw mpx::error("custom_training_loop: the blobs are separable, yet training accuracy is only " +
                     std::to_string(100.0 * accuracy) + "% after " + std::to_string(steps) + " steps");
}

bool gpu_available() {
#if MPX_HAS_CUDA
  int devices = 0;
  return cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#else
  return false;
#endif
}

}  // namespace

int main(int argc, char** argv) try {
  std::string executor = "auto";
  int steps = 100;
  mpx_programs::command_line args(argc, argv, "[--executor auto|host|cuda] [--steps N]");
  while (args.next()) {
    if (args.is("--executor")) executor = args.choice({"auto", "host", "cuda"});
    else if (args.is("--steps")) steps = args.whole<int>(1, 1'000'000);
    else args.unknown();
  }
  bool const gpu = gpu_available();
  if (executor == "cuda" || (executor == "auto" && gpu)) {
#if MPX_HAS_CUDA
    if (!gpu) throw mpx::error("--executor cuda: no GPU is visible to this process");
    train(mpx::cuda_executor{}, steps);
#else
    throw mpx::error("--executor cuda: this binary was built without nvcc; rebuild with -Dcuda=enabled");
#endif
  } else {
    train(mpx::host_executor{}, steps);
  }
  return 0;
} catch (...) {
  return mpx_programs::report_failure("custom_training_loop");
}
