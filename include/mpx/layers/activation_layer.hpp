// mpx::activation_layer<Policy>: y = act(x) elementwise, like keras.layers.Activation
// (dense and conv2d fuse their activation; this is for one that stands alone).
#pragma once

#include <mpx/kernels/activation.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/stateless_layer.hpp>

namespace mpx {

struct activation_layer_config {
  mpx::activation activation = mpx::activation::relu;
};

template <class Policy = model_policy>
class activation_layer : public detail::stateless_layer<activation_layer<Policy>, Policy, activation_layer_config> {
 public:
  static constexpr std::string_view kind = "Activation";

  using activation_layer::stateless_layer::stateless_layer;  // from an activation_layer_config
  explicit activation_layer(mpx::activation a) : activation_layer::stateless_layer(activation_layer_config{a}) {}

  [[nodiscard]] shape compute_output_shape(shape const& in) const { return in; }

 private:
  friend detail::stateless_layer<activation_layer, Policy, activation_layer_config>;
  void run_forward(auto const& exec, auto x, auto y) {
    with_activation(this->config().activation, [&](auto a) { activation_forward(exec, a, x, y); });
  }
  //! The derivative is taken at the forward input x.
  void run_backward(auto const& exec, auto x, auto /*y*/, auto dy, auto dx) {
    with_activation(this->config().activation, [&](auto a) { activation_backward(exec, a, x, dy, dx); });
  }
};

}  // namespace mpx
