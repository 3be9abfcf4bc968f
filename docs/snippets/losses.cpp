// docs/activations_softmax_losses.md: the three losses, their mean and gradient, a loss
// scale read from the executor's memory, and a bad label reported by name.
#include <mpx/mpx.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

using mpx::half;

int main() {
  bool ok = true;
  mpx::host_executor exec;  // on a cuda_executor the same calls only enqueue
  mpx::loss_value loss(exec);  // the mean loss, kept where the executor computes

  // Sparse categorical cross-entropy from half logits [batch 2, classes 3].
  std::vector<float> const lv = {2.0f, 1.0f, 0.1f, 0.5f, 2.5f, -1.0f};
  auto logits = mpx::make_tensor<half>(exec, {2, 3});
  for (std::size_t i = 0; i < lv.size(); ++i) logits[i] = mpx::cast<half>(lv[i]);
  auto labels = mpx::make_tensor<std::int32_t>(exec, {2});
  labels[0] = 0;
  labels[1] = 1;
  auto dlogits = mpx::make_tensor<half>(exec, logits.shape());

  // The gradient comes out multiplied by the loss scale, read from the executor's memory
  // (here a resident float; in training, loss_scale_optimizer::scale_data()).
  mpx::resident<float, mpx::host_space> scale(exec, 1024.0f);
  mpx::sparse_categorical_cross_entropy<mpx::mixed_float16>(exec, logits, labels, dlogits, loss, scale.get());
  float const ce = loss.read(exec);  // explicit; on a GPU this is the one synchronisation
  auto nll = [&](int r, int label) {
    double s = 0;
    for (int c = 0; c < 3; ++c) s += std::exp(mpx::cast<double>(logits[static_cast<std::size_t>(3 * r + c)]));
    return std::log(s) - mpx::cast<double>(logits[static_cast<std::size_t>(3 * r + label)]);
  };
  double const expected = (nll(0, 0) + nll(1, 1)) / 2;
  ok &= std::fabs(ce - expected) < 1e-6;
  // d(mean)/d(logit) = (softmax - onehot) / batch, times the scale of 1024.
  double const p00 = std::exp(-nll(0, 0));
  ok &= std::fabs(mpx::cast<double>(dlogits[0]) - (p00 - 1) / 2 * 1024) < 0.5;
  std::printf("cross-entropy %.6f (float64 %.6f), dlogits[0] %.2f\n", ce, expected, mpx::cast<float>(dlogits[0]));

  // A label outside [0, classes) names the sample and the label.
  labels[1] = 3;
  try {
    mpx::sparse_categorical_cross_entropy(exec, logits, labels, dlogits, loss);
    ok = false;
  } catch (mpx::invalid_argument const& e) {
    std::printf("refused: %s\n", e.what());
    ok &= std::string(e.what()).find("sample 1 has label 3, outside [0, 3)") != std::string::npos;
  }

  // Binary cross-entropy from logits, stable at any logit, and mean squared error.
  auto x = mpx::make_tensor<float>(exec, {4});
  auto z = mpx::make_tensor<float>(exec, {4});
  auto g = mpx::make_tensor<float>(exec, {4});
  std::vector<float> const xs = {0.0f, 100.0f, -100.0f, 2.0f}, zs = {1.0f, 1.0f, 1.0f, 0.0f};
  for (std::size_t i = 0; i < 4; ++i) x[i] = xs[i], z[i] = zs[i];
  mpx::binary_cross_entropy(exec, x, z, g, loss);
  double const bce = (std::log(2.0) + std::log1p(std::exp(-100.0)) + 100.0 + 2.0 + std::log1p(std::exp(-2.0))) / 4;
  ok &= std::fabs(loss.read(exec) - bce) < 1e-5;
  ok &= g[2] == -0.25f;  // (sigmoid(-100) - 1) / 4

  mpx::mean_squared_error(exec, x, z, g, loss);
  ok &= std::fabs(loss.read(exec) - (1.0 + 99.0 * 99.0 + 101.0 * 101.0 + 4.0) / 4) < 1e-2;
  ok &= g[3] == 1.0f;  // 2 (2 - 0) / 4

  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
