// Loss scaling by hand: the training loop that mpx::loss_scale_optimizer (and mpx::fit)
// run for you, written out step by step, as a user with a custom loop writes it
// (Keras's "training loop from scratch" with get_scaled_loss / get_unscaled_gradients):
//
//   forward -> loss and dL/dlogits (float) -> multiply dL/dlogits by the scale
//   -> backpropagate (the gradients are stored in half, scaled)
//   -> mpx::unscale_and_check over an mpx::gradient_list of every parameter's gradient
//   -> read the verdict: any NaN or inf? -> step the optimizer, or skip the step
//   -> let the scaler update the scale from the verdict
//
// The scale starts deliberately high (2^24; Keras starts at 2^15) and grows after 10
// finite steps in a row (Keras waits 2000), so a short run shows both halves of the
// rule: a step whose scaled gradients overflow half is skipped and the scale halves;
// after 10 finite steps in a row it doubles, and may overflow again.
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
  using Space = mpx::memory_space_t<Exec>;

  std::vector<float> host_x;
  std::vector<std::int32_t> host_labels;
  make_blobs(host_x, host_labels);
  auto x = mpx::make_tensor<float>(exec, {samples, features});
  mpx::copy(exec, mpx::tensor_view<float const>(host_x.data(), x.shape()), x);
  auto labels = mpx::make_tensor<std::int32_t>(exec, {samples});
  mpx::copy(exec, mpx::tensor_view<std::int32_t const>(host_labels.data(), labels.shape()), labels);

  auto model = mpx::sequential<policy>(mpx::dense<>(16, mpx::activation::relu), mpx::dense<>(classes));
  model.build(exec, {features}, /*seed=*/1);
  std::printf("%s", model.summary().c_str());

  // The pieces loss_scale_optimizer would hold: the parameters' gradients as one list
  // (planned once for the multi-tensor check), a scaler, an optimizer.
  auto params = model.parameters(exec);
  std::vector<mpx::tensor_ref<Space>> gradient_refs;
  std::vector<std::string> names;
  for (auto const& p : params) {
    gradient_refs.push_back(p.gradient);
    names.push_back(p.name);
  }
  mpx::gradient_list<Exec> gradients(exec, gradient_refs, names);

  mpx::dynamic_scale_rule rule;  // Keras's rule, with a higher start and a shorter growth interval
  rule.initial_scale = 1u << 24;
  rule.growth_interval = 10;
  mpx::dynamic_loss_scaler scaler(exec, rule);
  mpx::adam optimizer(exec, params, 1e-2f);

  auto d_logits = mpx::make_tensor<float>(exec, {samples, classes});  // float: scaled before any rounding to half
  mpx::loss_value loss(exec);

  std::printf("\n%5s %10s %14s %8s  %s\n", "step", "loss", "scale", "skipped", "first non-finite gradient / norm");
  std::size_t skipped = 0;
  float previous_scale = 0;
  for (int step = 1; step <= steps; ++step) {
    model.forward(exec, x.view(), /*training=*/true);

    // 1. The loss and its unscaled gradient, in float.
    mpx::sparse_categorical_cross_entropy<policy>(exec, model.template logits<Space>(), labels, d_logits, loss);

    // 2. Scale the loss gradient. (Reading the scale on the host synchronises a GPU
    //    stream; loss_scale_optimizer instead hands the loss the scale's device address.)
    float const scale = scaler.scale(exec);
    mpx::scale(exec, d_logits, scale);

    // 3. Backpropagate: the model rounds the scaled dL/dlogits to half and every
    //    parameter's gradient is written, in half, still multiplied by the scale.
    model.backward_from_logits(exec, mpx::view(std::as_const(d_logits)));

    // 4. Unscale and check every gradient in one pass. Deferred: the gradients stay
    //    scaled in memory (unscaled in half they could underflow again) and the verdict
    //    carries the factor, 1 / scale, that the optimizer multiplies them by as it reads.
    mpx::unscale_and_check(exec, gradients, scaler.scale_data(), /*max_norm=*/0.0f, mpx::unscaling::deferred);

    // 5. Read the verdict and decide.
    mpx::gradient_summary const verdict = gradients.summary(exec);
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
    if (skip)
      std::snprintf(detail, sizeof detail, "%s",
                    gradients.name(static_cast<std::size_t>(verdict.first_nonfinite)).c_str());
    else std::snprintf(detail, sizeof detail, "norm %.4g", static_cast<double>(verdict.norm));
    std::printf("%5d %10.4f %14.0f %8s  %s\n", step, static_cast<double>(loss.read(exec)),
                static_cast<double>(scale), skip ? "yes" : "no", detail);
  }

  model.forward(exec, x.view(), /*training=*/false);
  auto const logits = mpx::to_host(exec, model.template logits<Space>());
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
  std::printf("\n%d steps: %zu skipped, %llu applied (Adam's step count: %llu), final scale %.0f, "
              "training accuracy %.1f%%\n",
              steps, skipped, static_cast<unsigned long long>(state.applied_steps),
              static_cast<unsigned long long>(optimizer.steps(exec)), static_cast<double>(state.scale),
              100.0 * static_cast<double>(correct) / static_cast<double>(samples));
  std::printf("The same loop in one call per step: mpx::loss_scale_optimizer(adam, scaler).step(exec), which\n"
              "also leaves the verdict on the device instead of reading it, so a GPU never waits.\n");
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
