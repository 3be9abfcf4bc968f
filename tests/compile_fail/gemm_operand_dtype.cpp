// expect: mpx::gemm: A and B must hold the policy's storage_type
// float operands under mixed_float16, whose storage type is half.
#include <mpx/kernels/gemm.hpp>
int main() {
  mpx::host_executor exec;
  mpx::tensor<float> a(mpx::shape{4, 8}), b(mpx::shape{8, 2}), c(mpx::shape{4, 2});
  mpx::gemm<mpx::mixed_float16>(exec, a, b, c);
}
