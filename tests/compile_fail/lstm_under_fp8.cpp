// expect: this layer (an LSTM) has no fp8 matrix products
// An LSTM inside a mixed_fp8 model: its gate products have no fp8 path, and the message
// says to keep it out of fp8 with mpx::without_fp8.
#include <mpx/mpx.hpp>
int main() {
  mpx::host_executor exec;
  auto model = mpx::sequential<mpx::mixed_fp8>(mpx::lstm<>(8), mpx::dense<>(4));
  model.build(exec, {5, 3}, 1);
}
