// An LSTM(32) under mixed_float16, with gradient clipping: the third scenario of the
// seed articles. Random sequences of 10 steps with one feature; the label says whether
// the running sum ever rose above a threshold (a question only a recurrent state can
// answer). The cell state stays in float whatever the storage; gradients are clipped
// to a global norm of 1 in unscaled units, after the loss scale is taken off.
//
//   lstm_sequences [--executor auto|host|cuda] [--samples N] [--epochs N]
#include <mpx/mpx.hpp>

#include "../common/command_line.hpp"

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr std::int64_t steps = 10;

// Sequences in [-1, 1] and their labels: 1 if the running sum ever exceeds 1.5.
struct sequences {
  std::vector<float> x;
  std::vector<std::int32_t> y;
};

sequences make_sequences(std::int64_t n, std::uint64_t seed) {
  sequences s{std::vector<float>(static_cast<std::size_t>(n * steps)), std::vector<std::int32_t>(static_cast<std::size_t>(n))};
  for (std::int64_t i = 0; i < n; ++i) {
    float sum = 0;
    bool rose = false;
    for (std::int64_t t = 0; t < steps; ++t) {
      float const v = static_cast<float>(2 * mpx::detail::uniform_open01(seed, static_cast<std::uint64_t>(i * steps + t)) - 1);
      s.x[static_cast<std::size_t>(i * steps + t)] = v;
      sum += v;
      rose = rose || sum > 1.5f;
    }
    s.y[static_cast<std::size_t>(i)] = rose ? 1 : 0;
  }
  return s;
}

// The sequences as half tensors in the executor's memory, uploaded once; tensor_batches
// then hands fit() views of them, in order.
template <class Exec>
struct resident_sequences {
  mpx::tensor<mpx::half, mpx::memory_space_t<Exec>> x;
  mpx::tensor<std::int32_t, mpx::memory_space_t<Exec>> y;
};

template <class Exec>
resident_sequences<Exec> upload(Exec const& exec, sequences const& s) {
  auto const n = static_cast<std::int64_t>(s.y.size());
  mpx::tensor<mpx::half> xh(mpx::shape{n, steps, 1});
  for (std::size_t i = 0; i < s.x.size(); ++i) xh[i] = mpx::cast<mpx::half>(s.x[i]);
  mpx::tensor<std::int32_t> yh(mpx::shape{n});
  for (std::size_t i = 0; i < s.y.size(); ++i) yh[i] = s.y[i];
  resident_sequences<Exec> r{mpx::tensor<mpx::half, mpx::memory_space_t<Exec>>(exec, xh.shape()),
                             mpx::tensor<std::int32_t, mpx::memory_space_t<Exec>>(exec, yh.shape())};
  mpx::copy(exec, xh, r.x);
  mpx::copy(exec, yh, r.y);
  exec.synchronize();  // before xh and yh are freed
  return r;
}

template <class Exec>
void run(Exec const& exec, std::int64_t samples, std::size_t epochs) {
  auto const train_data = upload(exec, make_sequences(samples, 1));
  auto const test_data = upload(exec, make_sequences(samples / 4, 2));
  mpx::tensor_batches train(train_data.x, train_data.y, 32);
  mpx::tensor_batches test(test_data.x, test_data.y, 32);

  auto model = mpx::sequential<mpx::mixed_float16>(mpx::lstm<>(32), mpx::dense<>(2), mpx::softmax_layer<mpx::float32>());
  model.build(exec, {steps, 1}, 7);
  std::printf("%s", model.summary().c_str());

  // Keras: LossScaleOptimizer(Adam(clipnorm=...)); mpx clips the global norm of the
  // unscaled gradients in the same pass that checks them for inf/NaN.
  auto optimizer = mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f),
                                             mpx::dynamic_loss_scaler(exec, mpx::keras_loss_scale()),
                                             {.clip_global_norm = 1.0f});
  mpx::fit_options options;
  options.epochs = epochs;
  auto const history = mpx::fit(exec, model, optimizer, train, options, &test);
  auto const last = optimizer.last_check(exec);
  std::printf("\nlast step: gradient norm %.3f (clip factor %.3f: norms above 1 are scaled down to 1), skipped steps %zu, loss scale %g\n",
              static_cast<double>(last.norm), static_cast<double>(last.clip_coefficient), history.back().skipped_steps,
              static_cast<double>(history.back().loss_scale));
  std::printf("test accuracy %.1f%% (always guessing the commoner label: %.1f%%)\n",
              100 * history.back().validation.accuracy, 100 * [&] {
                auto const s = make_sequences(samples / 4, 2);
                std::size_t ones = 0;
                for (auto l : s.y) ones += static_cast<std::size_t>(l);
                double const p = static_cast<double>(ones) / static_cast<double>(s.y.size());
                return p > 0.5 ? p : 1 - p;
              }());
}

}  // namespace

int main(int argc, char** argv) try {
  std::string executor = "auto";
  std::int64_t samples = 2048;
  std::size_t epochs = 8;
  mpx_programs::command_line args(argc, argv, "[--executor auto|host|cuda] [--samples N] [--epochs N]");
  while (args.next()) {
    if (args.is("--executor")) executor = args.choice({"auto", "host", "cuda"});
    else if (args.is("--samples")) samples = args.whole<std::int64_t>(8, 1'000'000);
    else if (args.is("--epochs")) epochs = args.whole<std::size_t>(1, 1000);
    else args.unknown();
  }
  bool gpu = false;
#if MPX_HAS_CUDA
  int devices = 0;
  gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
#endif
  if (executor == "cuda" || (executor == "auto" && gpu)) {
#if MPX_HAS_CUDA
    if (!gpu) throw mpx::error("--executor cuda: no GPU is visible to this process");
    run(mpx::cuda_executor{}, samples, epochs);
#else
    throw mpx::error("--executor cuda: this binary was built without nvcc");
#endif
  } else if (executor == "host" || executor == "auto") {
    run(mpx::host_executor{}, samples, epochs);
  } else {
    std::fprintf(stderr, "unknown executor '%s': expected auto, host or cuda\n", executor.c_str());
    return 2;
  }
  return 0;
} catch (...) {
  return mpx_programs::report_failure("lstm_sequences");
}
