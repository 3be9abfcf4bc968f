// docs/numerics.md, "Letting a failing layer move": an fp8 layer made tiered (mixed_fp8,
// then mixed_bfloat16) under the precision guard. Its inputs carry an outlier that grows
// faster than the delayed scale's history follows: its casts saturate, and the guard
// moves it to bfloat16 at the next review, saying why.
#include <mpx/mpx.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

int main() {
  bool ok = true;
  mpx::host_executor exec;  // in a .cu file: mpx::cuda_executor exec{stream};
  constexpr long batch = 16, features = 32;

  auto model = mpx::sequential<mpx::mixed_fp8>(
      mpx::tiered<mpx::dense, mpx::model_policy, mpx::mixed_bfloat16>(16, mpx::activation::relu),
      mpx::dense<>(16));
  model.build(exec, {features}, 1);
  mpx::loss_scale_optimizer optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f),
                                      mpx::static_loss_scaler(exec, 1.0f));
  mpx::classifier_trainer trainer(exec, model, optimizer);
  trainer.guard({.review_every = 4});  // with mpx::fit: fit_options::guard = mpx::guard_options{...}

  std::mt19937 gen(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto x = mpx::make_tensor<float>(exec, {batch, features});
  auto labels = mpx::make_tensor<std::int32_t>(exec, {batch});
  for (long i = 0; i < batch; ++i) labels[i] = static_cast<std::int32_t>(i);
  for (int step = 0; step < 12; ++step) {
    for (long i = 0; i < batch * features; ++i) x[i] = normal(gen);
    if (step >= 8) x[5] = 1000.0f * std::pow(8.0f, static_cast<float>(step - 8));  // the outlier grows
    trainer.step(exec, mpx::view(std::as_const(x)), mpx::view(std::as_const(labels)));
  }
  trainer.history(exec);

  // "step 12: dense: its fp8 casts saturated (...) in 4 steps in the last 200 steps under
  // mixed_fp8; now mixed_bfloat16"
  std::printf("%s", trainer.guard()->summary().c_str());
  auto const& moves = trainer.guard()->moves();
  ok &= moves.size() == 1 && moves[0].layer == "dense" && moves[0].to == "mixed_bfloat16";
  ok &= model.layer<0>().active_policy() == "mixed_bfloat16";
  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
