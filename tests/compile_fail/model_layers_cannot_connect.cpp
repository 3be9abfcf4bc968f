// expect: these neighbouring layers cannot work together
// A user's layer that reads float and refuses casts, after a half layer: the model may
// not insert the cast, so it refuses to compile and names both layer types.
#include <mpx/layers/dense.hpp>
#include <mpx/model/sequential.hpp>

template <class Policy>
struct raw_float_layer : mpx::dense<Policy> {  // reads its input's bits as they are
  using mpx::dense<Policy>::dense;
  static constexpr bool accepts_cast = false;
};

int main() {
  auto model = mpx::sequential(mpx::dense<mpx::mixed_float16>(8), raw_float_layer<mpx::float32>(4));
  (void)model;
  return 0;
}
