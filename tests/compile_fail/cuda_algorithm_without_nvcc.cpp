// expect: must be compiled by nvcc
// Holding device tensors works from any C++ file; launching kernels needs nvcc.
#include <mpx/mpx.hpp>
int main() {
  mpx::cuda_executor exec;
  mpx::tensor<float, mpx::device_space> t(exec, mpx::shape{4});
  mpx::fill(exec, t, 1.0f);
}
