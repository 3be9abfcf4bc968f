// expect: deleted
// Tensors are move-only: a copy is an explicit mpx::copy.
#include <mpx/mpx.hpp>
int main() {
  mpx::tensor<float> a(mpx::shape{4});
  mpx::tensor<float> b = a;
  return b.empty();
}
