// expect: this operation accumulates in float32
// A sum of squares (a gradient norm) under a policy that accumulates in half.
#include <mpx/mpx.hpp>
using mixed_float16_acc16 = mpx::policy<mpx::half, mpx::half, mpx::half>;
int main() {
  mpx::tensor<mpx::half> g(mpx::shape{8});
  return static_cast<int>(mpx::sum_of_squares<mixed_float16_acc16>(mpx::host_executor{}, g));
}
