// expect: mpx::lstm_forward and mpx::lstm_backward accumulate in float32
// An LSTM under a policy that accumulates in half: the cell state and the sums over
// time steps would lose their small terms.
#include <mpx/mpx.hpp>
using mixed_float16_acc16 = mpx::policy<mpx::half, mpx::half, mpx::half>;
int main() {
  mpx::host_executor exec;
  mpx::tensor<mpx::half> x(mpx::shape{2, 3, 4}), w(mpx::shape{4, 8}), r(mpx::shape{2, 8}), h(mpx::shape{2, 3, 2});
  mpx::tensor<float> b(mpx::shape{8}), workspace(mpx::shape{4096});
  mpx::lstm_forward<mixed_float16_acc16>(exec, x, w, r, b, h, workspace);
}
