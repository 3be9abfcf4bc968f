// docs/numerics.md, "In a model": find_nonfinite names the layer that made an inf, and
// probe_loss_scales shows which loss scales keep a mixed_float16 model's gradients.
#include <mpx/mpx.hpp>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

int main() {
  bool ok = true;
  mpx::host_executor exec;  // in a .cu file: mpx::cuda_executor exec{stream};
  using space = mpx::host_space;
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);

  auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(16, mpx::activation::relu), mpx::dense<>(4),
                                                   mpx::softmax_layer<mpx::float32>());
  model.build(exec, {8}, 42);
  constexpr long n = 32;
  auto x = mpx::make_tensor<float>(exec, {n, 8});
  auto labels = mpx::make_tensor<std::int32_t>(exec, {n});
  for (float& v : x) v = 1e-6f * unit(gen);  // tiny inputs: tiny first-layer gradients
  for (long i = 0; i < n; ++i) labels[i] = static_cast<std::int32_t>(gen() % 4);

  // Why is my gradient zero? The gradients of one batch at loss scales 2^0 ... 2^24.
  mpx::loss_scale_probe const probe = mpx::probe_loss_scales(exec, model, mpx::view(std::as_const(x)),
                                                             mpx::view(std::as_const(labels)));
  std::printf("%s", probe.to_string().c_str());
  ok &= probe.rows[0].parameter == "dense/kernel";
  ok &= probe.rows[0].zero_share.front() > probe.rows[0].zero_share[4];  // 2^0 loses what 2^16 keeps
  ok &= probe.recommended_scale >= 65536.0f;

  // Why is my model failing to train? Inputs of 1000 overflow the first layer in half.
  for (float& v : x) v = 1000.0f + 100.0f * unit(gen);
  auto const w = model.layer<0>().kernel<space>();
  for (auto& v : w) v = mpx::cast<mpx::half>(10.0f);  // weights that grew: 8 x 1000 x 10 > 65504
  model.forward(exec, mpx::view(std::as_const(x)), false);
  std::optional<mpx::nonfinite_finding> const found = mpx::find_nonfinite(exec, model);
  ok &= found && found->layer == "dense" && found->tensor == "output" && found->stats.inf > 0;
  if (found) std::printf("\n%s\n", found->explanation().c_str());

  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
