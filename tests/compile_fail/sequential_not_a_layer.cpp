// expect: every argument must be an mpx layer
// Something that is not a layer handed to mpx::sequential.
#include <mpx/layers/dense.hpp>
#include <mpx/model/sequential.hpp>

int main() {
  auto model = mpx::sequential(mpx::dense<mpx::float32>(3), 42);
  (void)model;
  return 0;
}
