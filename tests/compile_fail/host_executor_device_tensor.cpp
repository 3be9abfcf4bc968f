// expect: the executor cannot reach this tensor's memory
// A device tensor handed to the host executor is refused at compile time.
#include <mpx/mpx.hpp>
int main() {
  mpx::tensor_view<float, mpx::device_space> gradients;
  mpx::fill(mpx::host_executor{}, gradients, 0.0f);
}
