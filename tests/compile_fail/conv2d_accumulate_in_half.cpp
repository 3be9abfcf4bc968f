// expect: mpx::conv2d accumulates in float32
// A convolution under a policy that accumulates in half.
#include <mpx/kernels/conv2d.hpp>
using mixed_float16_acc16 = mpx::policy<mpx::half, mpx::half, mpx::half>;
int main() {
  mpx::host_executor exec;
  mpx::tensor<mpx::half> x(mpx::shape{1, 5, 5, 2}), w(mpx::shape{3, 3, 2, 4}), y(mpx::shape{1, 3, 3, 4}),
      columns(mpx::shape{9, 18});
  mpx::conv2d_forward<mixed_float16_acc16>(exec, x, w, y, columns);
}
