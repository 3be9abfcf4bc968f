// expect: mpx::layer_norm and mpx::batch_norm accumulate means and variances in float32
// A layer norm under a policy that accumulates in half.
#include <mpx/mpx.hpp>
using mixed_float16_acc16 = mpx::policy<mpx::half, mpx::half, mpx::half>;
int main() {
  mpx::tensor<mpx::half> x(mpx::shape{2, 8});
  mpx::tensor<float> gamma(mpx::shape{8}), beta(mpx::shape{8}), mean(mpx::shape{2}), rstd(mpx::shape{2});
  mpx::layer_norm_forward<mixed_float16_acc16>(mpx::host_executor{}, x, gamma, beta, x, mean, rstd);
  return 0;
}
