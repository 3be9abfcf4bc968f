// Why does my float16 model not learn? A binary classifier trained twice under
// mixed_float16, once with Keras's dynamic loss scale and once without (a static scale
// of 1), from the same initial weights, in a training loop written with the model API:
//
//   model = Sequential([Dense(32, activation="relu"), Dense(1)])     # mixed_float16
//   loss  = BinaryCrossentropy(from_logits=True)
//   each step: forward -> loss, its gradient times the optimizer's scale -> backward
//              -> optimizer.step (unscale, check, Adam or skip, update the scale)
//
// The data: 100 samples of 10 features, labelled by the sign of a fixed random
// projection. A two-layer model with Keras's initialisation has gradients far above
// half's smallest subnormal (6e-8), so nothing underflows (try --init-scale 1). Here
// the weights start tiny instead (the Glorot draws times 1e-6, stored by half as
// subnormals), standing in for what a deep model does to its early layers: the
// backpropagated signal dL/dlogit * W is then below 6e-8 and is stored as 0 unless the
// loss is scaled. mpx::stats on every half gradient counts the zeros; the loss curve,
// the hidden units that never received a gradient and the accuracy show what they
// cost. Every number printed is measured, none is written in advance.
//
//   binary_classifier [--executor auto|host|cuda] [--steps N] [--init-scale X]
//                     [--learning-rate X] [--seed N]
#include <mpx/mpx.hpp>

#include "../common/command_line.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

using policy = mpx::mixed_float16;

struct settings {
  std::string executor = "auto";
  int steps = 300;
  float init_scale = 1e-6f;
  float learning_rate = 3e-3f;
  std::uint64_t seed = 7;
};

constexpr std::int64_t samples = 100;
constexpr std::int64_t features = 10;
constexpr std::int64_t hidden = 32;

//! Features ~ N(0, 1); label 1 where x . p > 0 for a fixed random projection p.
struct data_set {
  std::vector<float> x;  // [samples, features]
  std::vector<float> y;  // [samples, 1], 0 or 1
};

data_set make_data(std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> projection(features);
  for (auto& p : projection) p = normal(gen);
  data_set d{std::vector<float>(samples * features), std::vector<float>(samples)};
  for (std::int64_t i = 0; i < samples; ++i) {
    float dot = 0;
    for (std::int64_t j = 0; j < features; ++j) {
      float const v = normal(gen);
      d.x[static_cast<std::size_t>(i * features + j)] = v;
      dot += v * projection[static_cast<std::size_t>(j)];
    }
    d.y[static_cast<std::size_t>(i)] = dot > 0 ? 1.0f : 0.0f;
  }
  return d;
}

//! What one training run leaves to compare.
struct run_result {
  std::string name;
  std::vector<float> loss;             // per step
  std::vector<double> zero_share;      // per step: share of half gradient values that are exactly 0
  std::vector<double> first_layer_zero_share;  // the same, for dense/kernel alone
  std::size_t frozen_units = 0;        // hidden units whose whole gradient column was 0 at the last step
  std::size_t skipped = 0;
  float final_scale = 0;
  double accuracy = 0;
};

template <class Exec, class Space = mpx::memory_space_t<Exec>>
mpx::tensor<float, Space> upload(Exec const& exec, std::vector<float> const& host, mpx::shape s) {
  auto t = mpx::make_tensor<float>(exec, s);
  mpx::copy(exec, mpx::tensor_view<float const>(host.data(), s), t);
  return t;
}

//! Dense(32, relu) -> Dense(1) under mixed_float16, built from the seed, with small
//! initial weights: the Glorot draws scaled down (before an optimizer takes its float
//! master copies of them). The same seed gives every run the same weights.
template <class Exec>
auto make_model(Exec const& exec, settings const& s) {
  using Space = mpx::memory_space_t<Exec>;
  auto model = mpx::sequential<policy>(mpx::dense<>(hidden, mpx::activation::relu), mpx::dense<>(1));
  model.build(exec, {features}, s.seed);
  mpx::scale(exec, model.template layer<0>().template kernel<Space>(), s.init_scale);
  mpx::scale(exec, model.template layer<1>().template kernel<Space>(), s.init_scale);
  return model;
}

//! Before training: which loss scale keeps these gradients? mpx::probe_loss_scales
//! backpropagates the same loss gradient times 2^0, 2^4, ... and counts, per parameter,
//! the half gradient values stored as 0 and any that overflowed.
template <class Exec>
void probe_before_training(Exec const& exec, settings const& s, data_set const& data) {
  using Space = mpx::memory_space_t<Exec>;
  auto model = make_model(exec, s);
  auto const x = upload(exec, data.x, {samples, features});
  auto const y = upload(exec, data.y, {samples, 1});
  model.forward(exec, x.view(), /*training=*/true);
  auto gradient = mpx::make_tensor<float>(exec, {samples, 1});  // unscaled, in float: nothing lost yet
  mpx::loss_value loss(exec);
  mpx::binary_cross_entropy<policy>(exec, model.template logits<Space>(), y, gradient, loss);
  auto const probe = mpx::probe_loss_scales(exec, model, mpx::view(std::as_const(gradient)),
                                            {1.0f, 16.0f, 256.0f, 4096.0f, 65536.0f, 1048576.0f, 16777216.0f,
                                             268435456.0f, 4294967296.0f});
  std::printf("Before training, the gradients of the same weights at each loss scale\n"
              "(mpx::probe_loss_scales; a bias gradient can be truly 0 where a ReLU is off for every sample):\n\n%s\n",
              probe.to_string().c_str());
}

//! Trains a fresh model (the same seed, so the same initial weights) with `scaler`.
template <class Exec, class Scaler>
run_result train(Exec const& exec, settings const& s, data_set const& data, char const* name, Scaler scaler) {
  using Space = mpx::memory_space_t<Exec>;
  auto model = make_model(exec, s);

  auto const x = upload(exec, data.x, {samples, features});
  auto const y = upload(exec, data.y, {samples, 1});
  auto d_logits = mpx::make_tensor<mpx::half>(exec, {samples, 1});
  mpx::loss_value loss(exec);

  auto params = model.parameters(exec);
  mpx::loss_scale_optimizer optimizer(mpx::adam(exec, params, s.learning_rate), std::move(scaler));

  run_result r;
  r.name = name;
  for (int step = 0; step < s.steps; ++step) {
    model.forward(exec, x.view(), /*training=*/true);
    // The loss in float from the half logits; its gradient is multiplied by the current
    // loss scale before it is rounded to half, so the scale protects it from the start.
    mpx::binary_cross_entropy<policy>(exec, model.template logits<Space>(), y, d_logits, loss,
                                      optimizer.scale_data());
    model.backward_from_logits(exec, mpx::view(std::as_const(d_logits)));

    // The half gradients backpropagation wrote, still multiplied by the loss scale: how
    // many are exactly zero? A zero is a value that underflowed in half, or one that is
    // truly zero (a hidden unit whose ReLU is off for every sample).
    std::size_t zeros = 0, total = 0;
    for (auto const& p : params) {
      mpx::numerics_stats const st = mpx::stats(exec, p.gradient.template as<mpx::half>());
      zeros += st.zero;
      total += st.size;
      if (p.name == "dense/kernel")
        r.first_layer_zero_share.push_back(static_cast<double>(st.zero) / static_cast<double>(st.size));
    }
    r.zero_share.push_back(static_cast<double>(zeros) / static_cast<double>(total));

    optimizer.step(exec);  // unscale + check, Adam unless a gradient was NaN/inf, update the scale
    r.loss.push_back(loss.read(exec));
    r.skipped += optimizer.last_check(exec).found_nonfinite;
  }
  r.final_scale = optimizer.scaler().scale(exec);

  // Hidden units that still get no gradient at all: their column of dense/kernel's
  // gradient [features, hidden] is all zeros.
  auto const dw = mpx::to_host(exec, model.template layer<0>().template kernel_gradient<Space>());
  for (std::int64_t unit = 0; unit < hidden; ++unit) {
    bool all_zero = true;
    for (std::int64_t f = 0; f < features; ++f)
      all_zero = all_zero && mpx::is_zero(dw[static_cast<std::size_t>(f * hidden + unit)]);
    r.frozen_units += all_zero;
  }

  // Accuracy on the training set: the sign of the logit against the label.
  model.forward(exec, x.view(), /*training=*/false);
  auto const logits = mpx::to_host(exec, model.template logits<Space>());
  std::size_t correct = 0;
  for (std::size_t i = 0; i < logits.size(); ++i)
    correct += (mpx::cast<float>(logits[i]) > 0) == (data.y[i] > 0.5f);
  r.accuracy = static_cast<double>(correct) / static_cast<double>(samples);
  return r;
}

template <class Exec>
void compare(Exec const& exec, settings const& s) {
  data_set const data = make_data(s.seed);
  std::size_t positives = 0;
  for (float v : data.y) positives += v > 0.5f;
  std::printf("%lld samples of %lld features, %zu labelled 1; Dense(32, relu) -> Dense(1) under %s,\n"
              "weights = Glorot draws x %g, Adam(%g), %d full-batch steps, %s executor\n\n",
              static_cast<long long>(samples), static_cast<long long>(features), positives,
              std::string(policy::name).c_str(), static_cast<double>(s.init_scale),
              static_cast<double>(s.learning_rate), s.steps, std::string(Exec::name).c_str());

  probe_before_training(exec, s, data);
  run_result const scaled =
      train(exec, s, data, "dynamic loss scale", mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()));
  run_result const unscaled = train(exec, s, data, "no loss scaling", mpx::static_loss_scaler(exec, 1.0f));

  std::printf("Share of the half gradient values that are exactly 0 (zero: all parameters; dense/k: the\n"
              "first layer's kernel, dense/kernel) and the loss, by step:\n");
  std::printf("  %6s   %-34s   %-34s\n", "step", scaled.name.c_str(), unscaled.name.c_str());
  std::printf("  %6s   %10s %10s %10s   %10s %10s %10s\n", "", "zero", "dense/k", "loss", "zero", "dense/k", "loss");
  for (int step = 0; step < s.steps; ++step) {
    if (step % (s.steps / 10 > 0 ? s.steps / 10 : 1) != 0 && step != s.steps - 1) continue;
    auto const i = static_cast<std::size_t>(step);
    std::printf("  %6d   %9.1f%% %9.1f%% %10.4f   %9.1f%% %9.1f%% %10.4f\n", step + 1, 100 * scaled.zero_share[i],
                100 * scaled.first_layer_zero_share[i], static_cast<double>(scaled.loss[i]),
                100 * unscaled.zero_share[i], 100 * unscaled.first_layer_zero_share[i],
                static_cast<double>(unscaled.loss[i]));
  }
  std::printf("\n  %-20s %12s %10s %16s %9s %12s\n", "", "final loss", "accuracy", "units w/o grad", "skipped",
              "final scale");
  for (run_result const* r : {&scaled, &unscaled})
    std::printf("  %-20s %12.4f %9.0f%% %13zu/%lld %9zu %12g\n", r->name.c_str(),
                static_cast<double>(r->loss.back()), 100 * r->accuracy, r->frozen_units,
                static_cast<long long>(hidden), r->skipped, static_cast<double>(r->final_scale));
  std::printf("\nBoth runs start from the same weights, so at step 1 they compute the same gradients (one\n"
              "run's times the scale): a value that is 0 without scaling but not with it underflowed in half.\n"
              "Adam does not move a weight whose gradient has always been 0; a hidden unit whose incoming and\n"
              "outgoing gradients both underflow never leaves its start. Try --init-scale 1 (Keras's\n"
              "initialisation): then neither run loses a gradient and the two agree.\n");
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
  settings s;
  mpx_programs::command_line args(
      argc, argv, "[--executor auto|host|cuda] [--steps N] [--init-scale X] [--learning-rate X] [--seed N]");
  while (args.next()) {
    if (args.is("--executor")) s.executor = args.choice({"auto", "host", "cuda"});
    else if (args.is("--steps")) s.steps = args.whole<int>(1, 1'000'000);
    else if (args.is("--init-scale")) s.init_scale = static_cast<float>(args.real(0, 100, true));
    else if (args.is("--learning-rate")) s.learning_rate = static_cast<float>(args.real(0, 1, true));
    else if (args.is("--seed")) s.seed = args.whole<std::uint64_t>(0, std::numeric_limits<std::uint64_t>::max());
    else args.unknown();
  }

  bool const gpu = gpu_available();
  if (s.executor == "cuda" || (s.executor == "auto" && gpu)) {
#if MPX_HAS_CUDA
    if (!gpu) throw mpx::error("--executor cuda: no GPU is visible to this process");
    compare(mpx::cuda_executor{}, s);
#else
    throw mpx::error("--executor cuda: this binary was built without nvcc; rebuild with -Dcuda=enabled");
#endif
  } else {
    compare(mpx::host_executor{}, s);
  }
  return 0;
} catch (...) {
  return mpx_programs::report_failure("binary_classifier");
}
