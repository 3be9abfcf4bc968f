// expect: was given mpx::model_policy (or no policy) but is used outside a model that sets one
// mpx::dense<> takes its policy from the model; built alone it has none.
#include <mpx/layers/dense.hpp>

int main() {
  mpx::dense<> layer(4);
  layer.build(mpx::host_executor{}, {3}, 1);
  return 0;
}
