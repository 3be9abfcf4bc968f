// expect: mpx::fp8_gemm: e5m2 x e5m2 is not offered
// Two e5m2 operands: no tensor-core kernel multiplies them; one must be e4m3.
#include <mpx/kernels/fp8_gemm.hpp>
int main() {
  mpx::host_executor exec;
  mpx::tensor<mpx::float8_e5m2> a(mpx::shape{4, 16}), b(mpx::shape{8, 16});
  mpx::tensor<float> c(mpx::shape{4, 8});
  float const one = 1.0f;
  mpx::fp8_gemm(exec, a, &one, b, &one, c, {.transpose_b = true});
}
