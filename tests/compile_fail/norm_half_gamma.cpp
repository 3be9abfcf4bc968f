// expect: scale, shift, saved statistics, running statistics and their gradients are float32 tensors
// A layer norm given a half gamma: the parameters and statistics are float.
#include <mpx/mpx.hpp>
int main() {
  mpx::tensor<mpx::half> x(mpx::shape{2, 8}), gamma(mpx::shape{8});
  mpx::tensor<float> beta(mpx::shape{8}), mean(mpx::shape{2}), rstd(mpx::shape{2});
  mpx::layer_norm_forward(mpx::host_executor{}, x, gamma, beta, x, mean, rstd);
  return 0;
}
