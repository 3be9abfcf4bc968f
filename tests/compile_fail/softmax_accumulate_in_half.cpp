// expect: accumulate the row sum of exp(x - max) in float32
// A softmax under a policy that accumulates in half.
#include <mpx/mpx.hpp>
using mixed_float16_acc16 = mpx::policy<mpx::half, mpx::half, mpx::half>;
int main() {
  mpx::tensor<mpx::half> x(mpx::shape{2, 8});
  mpx::softmax<mixed_float16_acc16>(mpx::host_executor{}, x, x);
  return 0;
}
