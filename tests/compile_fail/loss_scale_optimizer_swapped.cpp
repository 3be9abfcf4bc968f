// expect: the first argument must be an mpx optimizer
// The scaler and the optimizer passed in the wrong order.
#include <mpx/mpx.hpp>
int main() {
  mpx::host_executor exec;
  auto w = mpx::make_tensor<float>(exec, {4});
  auto g = mpx::make_tensor<float>(exec, {4});
  std::vector<mpx::parameter<mpx::host_space>> params = {{"w", w, g}};
  auto opt = mpx::loss_scale_optimizer(mpx::dynamic_loss_scaler(exec), mpx::sgd(exec, params, 0.1f));
  opt.step(exec);
}
