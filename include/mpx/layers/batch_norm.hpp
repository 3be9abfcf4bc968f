// mpx::batch_norm<Policy>: batch normalisation over every axis but the last (the
// channels, NHWC), like keras.layers.BatchNormalization: in training, the batch's
// statistics, and running statistics updated with Keras's momentum; in inference, the
// running statistics. gamma, beta and the running statistics are float whatever the
// storage, and the statistics are computed in float (kernels/batch_norm.hpp).
#pragma once

#include <mpx/kernels/batch_norm.hpp>
#include <mpx/layers/initializers.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/norm_affine.hpp>

#include <string>
#include <utility>
#include <vector>

namespace mpx {

struct batch_norm_config {
  float momentum = 0.99f;  //!< Keras's default
  float eps = 1e-3f;       //!< Keras's default
};

template <class Policy = model_policy>
class batch_norm : public layer_base, public detail::storage_dtype_layer<Policy, batch_norm_config> {
  using storage_type = typename Policy::storage_type;

 public:
  static constexpr std::string_view kind = "BatchNormalization";

  batch_norm() = default;
  explicit batch_norm(batch_norm_config config) : config_(config) {}
  [[nodiscard]] batch_norm_config const& config() const noexcept { return config_; }

  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    detail::norm_channels(name(), "mpx::batch_norm", "channels", in);
    return in;
  }
  template <executor Exec>
  void build(Exec const& exec, shape const& in, std::uint64_t) {
    detail::require_layer_policy<Policy>();
    detail::require_float_norm<Policy>();
    std::int64_t const c = detail::norm_channels(name(), "mpx::batch_norm", "channels", in);
    using Space = memory_space_t<Exec>;
    affine_.build(exec, c);
    for (auto* t : {&running_mean_, &running_var_, &save_mean_, &save_invstd_}) t->allocate(exec, {c});
    initialize(exec, running_mean_.template view<Space>(), initializer::zeros, 1, 1, 0);
    initialize(exec, running_var_.template view<Space>(), initializer::ones, 1, 1, 0);
    mark_built(in, in);
  }
  template <executor Exec>
  void reserve(Exec const& exec, std::int64_t batch) {
    require_built("reserve");
    dx_scratch_.ensure(exec, detail::with_batch(batch, input_shape_));
    reserved_batch_ = batch;
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type, Space> y,
               bool training) {
    check_input_and_reserve(*this, exec, x.shape(), y.shape());
    auto v = [](auto const& t) { return t.template view<Space>(); };
    if (training)
      batch_norm_forward_training<Policy>(exec, x, affine_.gamma.value<Space>(), affine_.beta.value<Space>(), y,
                                          v(running_mean_), v(running_var_), v(save_mean_), v(save_invstd_),
                                          {config_.momentum, config_.eps});
    else
      batch_norm_forward_inference<Policy>(exec, x, affine_.gamma.value<Space>(), affine_.beta.value<Space>(),
                                           v(running_mean_), v(running_var_), y, config_.eps);
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type const, Space> y,
                tensor_view<storage_type const, Space> dy, tensor_view<storage_type, Space> dx) {
    check_input(x.shape(), y.shape());
    auto v = [](auto const& t) { return t.template view<Space>(); };
    auto const dx_out = dx.data() ? dx : dx_scratch_.template view<Space>(x.shape());
    batch_norm_backward<Policy>(exec, x, dy, affine_.gamma.value<Space>(), v(save_mean_), v(save_invstd_), dx_out,
                                affine_.gamma.gradient<Space>(), affine_.beta.gradient<Space>());
  }
  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>& out) {
    require_built("parameters");
    affine_.append_parameters(name(), out);
  }
  //! The running statistics: not trained, but saved with the model.
  template <memory_space Space>
  void append_state(std::vector<std::pair<std::string, tensor_ref<Space>>>& out) {
    out.emplace_back(name() + "/moving_mean", running_mean_.template view<Space>());
    out.emplace_back(name() + "/moving_variance", running_var_.template view<Space>());
  }
  [[nodiscard]] std::size_t parameter_count() const noexcept { return affine_.parameter_count(); }

 private:
  batch_norm_config config_;
  detail::norm_affine affine_;
  detail::layer_tensor<float> running_mean_, running_var_, save_mean_, save_invstd_;
  detail::layer_tensor<storage_type> dx_scratch_;
};

}  // namespace mpx
