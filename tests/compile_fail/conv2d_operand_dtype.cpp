// expect: mpx::conv2d: x, w, y, dy, dx and the workspace must hold the policy's storage_type
// float tensors under mixed_float16, whose storage type is half.
#include <mpx/kernels/conv2d.hpp>
int main() {
  mpx::host_executor exec;
  mpx::tensor<float> x(mpx::shape{1, 5, 5, 2}), w(mpx::shape{3, 3, 2, 4}), y(mpx::shape{1, 3, 3, 4}),
      columns(mpx::shape{9, 18});
  mpx::conv2d_forward<mpx::mixed_float16>(exec, x, w, y, columns);
}
