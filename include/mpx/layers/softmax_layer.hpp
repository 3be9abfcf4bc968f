// mpx::softmax_layer<Policy>: softmax over the last axis, computed in float whatever the
// storage (keras.layers.Softmax). Keras's advice for mixed precision is to give the
// model's last softmax the float32 policy so the probabilities are not rounded to 16
// bits: `mpx::softmax_layer<mpx::float32>()`. Followed by sparse categorical
// cross-entropy in mpx::train_step, the loss is computed from the softmax's input (the
// logits) with log-softmax, which is what keeps it finite.
#pragma once

#include <mpx/kernels/softmax.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/stateless_layer.hpp>

namespace mpx {

struct softmax_layer_config {};

template <class Policy = model_policy>
class softmax_layer : public detail::stateless_layer<softmax_layer<Policy>, Policy, softmax_layer_config> {
 public:
  static constexpr std::string_view kind = "Softmax";
  //! Tells mpx::train_step that its input is a classifier's logits.
  static constexpr bool is_softmax = true;

  using softmax_layer::stateless_layer::stateless_layer;  // softmax_layer() and softmax_layer(softmax_layer_config)

  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    if (in.rank() < 1 || in[in.rank() - 1] < 1)
      detail::fail<shape_error>(this->name().empty() ? "mpx::softmax_layer" : this->name(),
                                "expects inputs of shape [..., classes], got " + in.to_string());
    return in;
  }

 private:
  friend detail::stateless_layer<softmax_layer, Policy, softmax_layer_config>;
  void run_forward(auto const& exec, auto x, auto y) { softmax<Policy>(exec, x, y); }
  //! The softmax's derivative needs only its output y.
  void run_backward(auto const& exec, auto /*x*/, auto y, auto dy, auto dx) {
    softmax_backward<Policy>(exec, y, dy, dx);
  }
};

}  // namespace mpx
