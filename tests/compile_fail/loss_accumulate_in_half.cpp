// expect: mpx losses are computed and summed in float32
// A loss under a policy that accumulates in bfloat16.
#include <mpx/mpx.hpp>
using mixed_bfloat16_acc16 = mpx::policy<mpx::bfloat16, mpx::bfloat16, mpx::bfloat16>;
int main() {
  mpx::host_executor exec;
  mpx::tensor<mpx::bfloat16> x(mpx::shape{2, 8});
  mpx::loss_value loss(exec);
  mpx::mean_squared_error<mixed_bfloat16_acc16>(exec, x, x, x, loss);
  return 0;
}
