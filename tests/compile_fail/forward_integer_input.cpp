// expect: the input's element type is neither the first layer's input type nor a float type
// Raw integer pixels into a float16 model: they would be cast to half as they are
// (100000 becomes inf), not scaled.
#include <mpx/mpx.hpp>
int main() {
  mpx::host_executor exec;
  auto model = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(4));
  model.build(exec, {8}, 1);
  auto pixels = mpx::make_tensor<std::int32_t>(exec, {2, 8});
  model.forward(exec, pixels, false);
}
