// expect: mpx::gemm: this policy computes its matrix products in fp8
// A plain gemm under mixed_fp8: fp8 operands need per-tensor scales, which gemm does not
// keep; the message points to mpx::fp8_gemm and the layers that do.
#include <mpx/kernels/gemm.hpp>
int main() {
  mpx::host_executor exec;
  mpx::tensor<mpx::bfloat16> a(mpx::shape{4, 8}), b(mpx::shape{8, 2}), c(mpx::shape{4, 2});
  mpx::gemm<mpx::mixed_fp8>(exec, a, b, c);
}
