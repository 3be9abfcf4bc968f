// mpx::activation_layer<Policy>: y = act(x) elementwise, like keras.layers.Activation
// (dense and conv2d fuse their activation; this is for one that stands alone).
#pragma once

#include <mpx/kernels/activation.hpp>
#include <mpx/layers/layer.hpp>

namespace mpx {

struct activation_layer_config {
  mpx::activation activation = mpx::activation::relu;
};

template <class Policy = model_policy>
class activation_layer : public layer_base {
 public:
  using policy = Policy;
  using config_type = activation_layer_config;
  using input_type = typename Policy::storage_type;
  using output_type = typename Policy::storage_type;
  static constexpr std::string_view kind = "Activation";

  explicit activation_layer(activation_layer_config config) : config_(config) {}
  explicit activation_layer(mpx::activation a) : config_{a} {}
  [[nodiscard]] activation_layer_config const& config() const noexcept { return config_; }

  [[nodiscard]] shape compute_output_shape(shape const& in) const { return in; }
  template <executor Exec>
  void build(Exec const&, shape const& in, std::uint64_t) {
    detail::require_layer_policy<Policy>();
    mark_built(in, in);
  }
  template <executor Exec>
  void reserve(Exec const&, std::int64_t batch) {
    reserved_batch_ = batch;
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type, Space> y, bool) {
    check_input(x.shape(), y.shape());
    with_activation(config_.activation, [&](auto a) { activation_forward(exec, a, x, y); });
  }
  //! The derivative is taken at the forward input x.
  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type const, Space> y,
                tensor_view<output_type const, Space> dy, tensor_view<input_type, Space> dx) {
    check_input(x.shape(), y.shape());
    if (dx.data() != nullptr)
      with_activation(config_.activation, [&](auto a) { activation_backward(exec, a, x, dy, dx); });
  }
  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>&) {}
  [[nodiscard]] std::size_t parameter_count() const noexcept { return 0; }

 private:
  activation_layer_config config_;
};

}  // namespace mpx
