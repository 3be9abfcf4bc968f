// mpx::flatten<Policy>: [batch, d1, d2, ...] -> [batch, d1 * d2 * ...], like
// keras.layers.Flatten. Row-major data need no reordering, so the forward and backward
// passes are copies (a model could alias them; a copy keeps every layer's output its own).
#pragma once

#include <mpx/exec/copy.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/stateless_layer.hpp>

namespace mpx {

struct flatten_config {};

template <class Policy = model_policy>
class flatten : public detail::stateless_layer<flatten<Policy>, Policy, flatten_config> {
 public:
  static constexpr std::string_view kind = "Flatten";

  using flatten::stateless_layer::stateless_layer;  // flatten() and flatten(flatten_config)

  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    return shape{static_cast<std::int64_t>(in.size())};
  }

 private:
  friend detail::stateless_layer<flatten, Policy, flatten_config>;
  void run_forward(auto const& exec, auto x, auto y) { copy(exec, x.reshape(y.shape()), y); }
  void run_backward(auto const& exec, auto /*x*/, auto /*y*/, auto dy, auto dx) {
    copy(exec, dy.reshape(dx.shape()), dx);
  }
};

}  // namespace mpx
