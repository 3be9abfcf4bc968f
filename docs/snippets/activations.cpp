// docs/activations_softmax_losses.md: a dense layer's bias + gelu, forward and backward,
// in half storage with float arithmetic and a float bias gradient.
#include <mpx/mpx.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

using mpx::half;

int main() {
  bool ok = true;
  mpx::host_executor exec;  // or mpx::cuda_executor{stream}, in a .cu file

  // z = x W (from a matrix product), shape [batch, units] = [2, 3], stored in half.
  std::vector<half> const zv = {mpx::cast<half>(-1.0f), mpx::cast<half>(0.0f), mpx::cast<half>(2.0f),
                                mpx::cast<half>(0.5f), mpx::cast<half>(-3.0f), mpx::cast<half>(1.0f)};
  std::vector<float> const bv = {0.5f, 0.25f, -1.0f};  // the bias, float like its master weights
  auto z = mpx::make_tensor<half>(exec, {2, 3});
  auto bias = mpx::make_tensor<float>(exec, {3});
  mpx::copy(exec, mpx::tensor_view<half const>(zv.data(), z.shape()), z);
  mpx::copy(exec, mpx::tensor_view<float const>(bv.data(), bias.shape()), bias);

  // Forward: y = gelu(z + bias), one pass, computed in float, rounded once to half.
  auto y = mpx::make_tensor<half>(exec, z.shape());
  mpx::bias_activation_forward(exec, mpx::act::gelu{}, z, bias, y);
  double const expected = 0.5 * 1.0 * std::erfc(-1.0 / std::sqrt(2.0));  // gelu(2 - 1)
  ok &= std::fabs(mpx::cast<float>(y[2]) - expected) < 1e-3;             // half's rounding
  std::printf("gelu(2 - 1) = %.5f (float64: %.5f)\n", mpx::cast<float>(y[2]), expected);

  // Backward: dz = dy * gelu'(z + bias) from the pre-activation z (not from y), and the
  // bias gradient db[j] = sum over the batch of dz[:, j], summed in float.
  auto dy = mpx::make_tensor<half>(exec, z.shape());
  mpx::fill(exec, dy, mpx::cast<half>(1.0f));
  auto dz = mpx::make_tensor<half>(exec, z.shape());
  auto db = mpx::make_tensor<float>(exec, {3});
  mpx::bias_activation_backward(exec, mpx::act::gelu{}, z, bias, dy, dz, db);
  auto gelu_prime = [](double v) { return 0.5 * std::erfc(-v / std::sqrt(2.0)) + v * std::exp(-v * v / 2) / std::sqrt(2 * M_PI); };
  double const db0 = gelu_prime(-1.0 + 0.5) + gelu_prime(0.5 + 0.5);
  ok &= std::fabs(db[0] - db0) < 1e-6;
  std::printf("db[0] = %.7f (float64: %.7f)\n", db[0], db0);

  // A layer without activation needs only the bias gradient.
  mpx::bias_gradient(exec, dy, db);
  ok &= db[0] == 2.0f && db[1] == 2.0f && db[2] == 2.0f;

  // relu keeps NaN NaN, so a broken input is never hidden.
  mpx::activation_forward(exec, mpx::act::relu{}, z, y);
  ok &= mpx::cast<float>(y[0]) == 0.0f && mpx::cast<float>(y[2]) == 2.0f;

  std::printf("%s\n", ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
