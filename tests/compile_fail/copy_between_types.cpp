// expect: convert with mpx::cast
#include <mpx/mpx.hpp>
int main() {
  mpx::tensor<float> a(mpx::shape{4});
  mpx::tensor<mpx::half> b(mpx::shape{4});
  mpx::copy(mpx::host_executor{}, a, b);
}
