// expect: the labels must be std::int32_t class indices
// Labels kept as floats, as a regression data set would have them.
#include <mpx/mpx.hpp>
int main() {
  mpx::host_executor exec;
  auto x = mpx::make_tensor<float>(exec, {16, 8});
  auto y = mpx::make_tensor<float>(exec, {16});
  mpx::tensor_batches data(x, y, 4);
}
