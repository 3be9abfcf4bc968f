// expect: mpx::gemm: this policy accumulates matrix products in half
// A matrix product under a policy that sums in half, not declared deliberate.
#include <mpx/kernels/gemm.hpp>
using mixed_float16_acc16 = mpx::policy<mpx::half, mpx::half, mpx::half>;
int main() {
  mpx::host_executor exec;
  mpx::tensor<mpx::half> a(mpx::shape{4, 8}), b(mpx::shape{8, 2}), c(mpx::shape{4, 2});
  mpx::gemm<mixed_float16_acc16>(exec, a, b, c);
}
