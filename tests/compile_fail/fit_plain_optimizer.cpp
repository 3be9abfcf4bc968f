// expect: mpx::fit and mpx::classifier_trainer take a loss_scale_optimizer
// A Keras user's first try: fit with the optimizer alone (Keras wraps it itself).
#include <mpx/mpx.hpp>
int main() {
  mpx::host_executor exec;
  auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(4));
  model.build(exec, {8}, 1);
  auto x = mpx::make_tensor<float>(exec, {16, 8});
  auto y = mpx::make_tensor<std::int32_t>(exec, {16});
  mpx::tensor_batches data(x, y, 4);
  mpx::adam optimizer(exec, model.parameters(exec), 1e-3f);
  mpx::fit(exec, model, optimizer, data);
}
