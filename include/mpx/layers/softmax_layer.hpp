// mpx::softmax_layer<Policy>: softmax over the last axis, computed in float whatever the
// storage (keras.layers.Softmax). Keras's advice for mixed precision is to give the
// model's last softmax the float32 policy so the probabilities are not rounded to 16
// bits: `mpx::softmax_layer<mpx::float32>()`. Followed by sparse categorical
// cross-entropy in mpx::train_step, the loss is computed from the softmax's input (the
// logits) with log-softmax, which is what keeps it finite.
#pragma once

#include <mpx/kernels/softmax.hpp>
#include <mpx/layers/layer.hpp>

namespace mpx {

struct softmax_layer_config {};

template <class Policy = model_policy>
class softmax_layer : public layer_base {
 public:
  using policy = Policy;
  using config_type = softmax_layer_config;
  using input_type = typename Policy::storage_type;
  using output_type = typename Policy::storage_type;
  static constexpr std::string_view kind = "Softmax";
  //! Tells mpx::train_step that its input is a classifier's logits.
  static constexpr bool is_softmax = true;

  softmax_layer() = default;
  explicit softmax_layer(softmax_layer_config) {}
  [[nodiscard]] softmax_layer_config config() const noexcept { return {}; }

  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    if (in.rank() < 1 || in[in.rank() - 1] < 1)
      detail::fail<shape_error>(name().empty() ? "mpx::softmax_layer" : name(),
                                "expects inputs of shape [..., classes], got " + in.to_string());
    return in;
  }
  template <executor Exec>
  void build(Exec const&, shape const& in, std::uint64_t) {
    detail::require_layer_policy<Policy>();
    mark_built(in, compute_output_shape(in));
  }
  template <executor Exec>
  void reserve(Exec const&, std::int64_t batch) {
    reserved_batch_ = batch;
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type, Space> y, bool) {
    check_input(x.shape(), y.shape());
    softmax<Policy>(exec, x, y);
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type const, Space> y,
                tensor_view<output_type const, Space> dy, tensor_view<input_type, Space> dx) {
    check_input(x.shape(), y.shape());
    if (dx.data() != nullptr) softmax_backward<Policy>(exec, y, dy, dx);
  }
  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>&) {}
  [[nodiscard]] std::size_t parameter_count() const noexcept { return 0; }
};

}  // namespace mpx
