// docs/numerics.md, "Finding the layer that costs you precision": mpx::fit measures every
// layer against its float32 twin every few steps (fit_options::shadow_every) and prints
// which layers cost the most; model_shadow does the same in a loop of your own.
#include <mpx/mpx.hpp>

#include <cstdio>
#include <random>
#include <vector>

int main() {
  bool ok = true;
  mpx::host_executor exec;  // in a .cu file: mpx::cuda_executor exec{stream};
  using space = mpx::host_space;

  // 1,024 points in 16 dimensions; the class is the quadrant of the first two.
  constexpr long n = 1024, features = 16;
  std::mt19937 gen(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto x = mpx::make_tensor<float>(exec, {n, features});
  auto labels = mpx::make_tensor<std::int32_t>(exec, {n});
  for (long i = 0; i < n; ++i) {
    for (long f = 0; f < features; ++f) x[i * features + f] = normal(gen);
    labels[i] = (x[i * features] > 0 ? 1 : 0) + (x[i * features + 1] > 0 ? 2 : 0);
  }

  // The same layer twice, once in bfloat16 and once in fp8.
  auto model = mpx::sequential<mpx::mixed_bfloat16>(
      mpx::dense<>(64, mpx::activation::relu),                // bfloat16
      mpx::dense<mpx::mixed_fp8>(64, mpx::activation::relu),  // e4m3 forward, e5m2 gradients
      mpx::dense<>(4), mpx::softmax_layer<mpx::float32>());
  model.build(exec, {features}, 1);
  mpx::loss_scale_optimizer optimizer(mpx::adam(exec, model.parameters(exec), 1e-2f),
                                      mpx::static_loss_scaler(exec, 1.0f));
  mpx::tensor_batches<float, space> batches(mpx::view(std::as_const(x)), mpx::view(std::as_const(labels)), 64);

  mpx::fit_options options;
  options.epochs = 2;
  options.progress = 0;
  options.shadow_every = 4;  // every 4th step: 8 of the 32
  auto const history = mpx::fit(exec, model, optimizer, batches, options);

  // The reports behind the table, per epoch: the fp8 layer costs the most.
  auto const mean = mpx::mean_layer_errors(history[1].shadow);
  ok &= history[0].shadow.size() == 4 && history[1].shadow.size() == 4;
  ok &= mean.size() == 4 && mean[1].layer == "dense_1" && mean[1].policy == "mixed_fp8";
  ok &= *mean[1].output > 4 * *mean[0].output;                    // fp8's output against bfloat16's
  ok &= *mean[1].weight_gradient > 4 * *mean[0].weight_gradient;  // and its weight gradients
  ok &= *mean[3].output == 0.0;                                   // the float32 softmax costs nothing
  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
