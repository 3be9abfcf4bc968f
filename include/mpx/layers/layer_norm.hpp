// mpx::layer_norm<Policy>: normalisation over the last axis of each sample, like
// keras.layers.LayerNormalization (axis -1). gamma and beta are float whatever the
// storage, and the mean and variance are computed in float (kernels/layer_norm.hpp).
#pragma once

#include <mpx/kernels/layer_norm.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/norm_affine.hpp>

#include <vector>

namespace mpx {

struct layer_norm_config {
  float eps = 1e-3f;  //!< Keras's default
};

template <class Policy = model_policy>
class layer_norm : public layer_base, public detail::storage_dtype_layer<Policy, layer_norm_config> {
  using storage_type = typename Policy::storage_type;

 public:
  static constexpr std::string_view kind = "LayerNormalization";

  layer_norm() = default;
  explicit layer_norm(layer_norm_config config) : config_(config) {}
  [[nodiscard]] layer_norm_config const& config() const noexcept { return config_; }

  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    detail::norm_channels(name(), "mpx::layer_norm", "features", in);
    return in;
  }
  template <executor Exec>
  void build(Exec const& exec, shape const& in, std::uint64_t) {
    detail::require_layer_policy<Policy>();
    detail::require_float_norm<Policy>();
    affine_.build(exec, detail::norm_channels(name(), "mpx::layer_norm", "features", in));
    mark_built(in, in);
  }
  template <executor Exec>
  void reserve(Exec const& exec, std::int64_t batch) {
    require_built("reserve");
    std::int64_t const rows = batch * static_cast<std::int64_t>(input_shape_.size()) / input_shape_[input_shape_.rank() - 1];
    mean_.ensure(exec, {rows});
    rstd_.ensure(exec, {rows});
    dx_scratch_.ensure(exec, detail::with_batch(batch, input_shape_));
    reserved_batch_ = batch;
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type, Space> y, bool) {
    check_input_and_reserve(*this, exec, x.shape(), y.shape());
    std::int64_t const rows = rows_of(x.shape());
    layer_norm_forward<Policy>(exec, x, affine_.gamma.value<Space>(), affine_.beta.value<Space>(), y,
                               mean_.template view<Space>({rows}), rstd_.template view<Space>({rows}), config_.eps);
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type const, Space> y,
                tensor_view<storage_type const, Space> dy, tensor_view<storage_type, Space> dx) {
    check_input(x.shape(), y.shape());
    std::int64_t const rows = rows_of(x.shape());
    auto const dx_out = dx.data() ? dx : dx_scratch_.template view<Space>(x.shape());
    layer_norm_backward<Policy>(exec, x, dy, affine_.gamma.value<Space>(), mean_.template view<Space>({rows}),
                                rstd_.template view<Space>({rows}), dx_out, affine_.gamma.gradient<Space>(),
                                affine_.beta.gradient<Space>());
  }
  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>& out) {
    require_built("parameters");
    affine_.append_parameters(name(), out);
  }
  [[nodiscard]] std::size_t parameter_count() const noexcept { return affine_.parameter_count(); }

 private:
  std::int64_t rows_of(shape const& x) const {
    return static_cast<std::int64_t>(x.size()) / input_shape_[input_shape_.rank() - 1];
  }
  layer_norm_config config_;
  detail::norm_affine affine_;
  detail::layer_tensor<float> mean_, rstd_;
  detail::layer_tensor<storage_type> dx_scratch_;
};

}  // namespace mpx
