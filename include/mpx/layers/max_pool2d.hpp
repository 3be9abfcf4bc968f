// mpx::max_pool2d<Policy>: the maximum over each window of NHWC images, like
// keras.layers.MaxPool2D (pool 2x2, strides = pool, 'valid'); a NaN in a window is
// the window's maximum, so it propagates (kernels/max_pool.hpp).
#pragma once

#include <mpx/kernels/max_pool.hpp>
#include <mpx/layers/layer.hpp>

#include <vector>

namespace mpx {

struct max_pool2d_config {
  std::int64_t pool_h = 2, pool_w = 2;
  std::int64_t stride_h = 0, stride_w = 0;  //!< 0: the pool's extent
};

template <class Policy = model_policy>
class max_pool2d : public layer_base {
 public:
  using policy = Policy;
  using config_type = max_pool2d_config;
  using input_type = typename Policy::storage_type;
  using output_type = typename Policy::storage_type;
  static constexpr std::string_view kind = "MaxPool2D";

  explicit max_pool2d(max_pool2d_config config) : config_(config) {}
  explicit max_pool2d(std::int64_t pool = 2) : config_{pool, pool, 0, 0} {}
  [[nodiscard]] max_pool2d_config const& config() const noexcept { return config_; }

  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    if (in.rank() != 3)
      detail::fail<shape_error>(name().empty() ? "mpx::max_pool2d" : name(),
                                "expects images of shape [height, width, channels], got " + in.to_string());
    shape const out = max_pool2d_output_shape(shape{1, in[0], in[1], in[2]}, options());
    return shape{out[1], out[2], out[3]};
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
    max_pool2d_forward(exec, x, y, options());
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type const, Space> y,
                tensor_view<output_type const, Space> dy, tensor_view<input_type, Space> dx) {
    check_input(x.shape(), y.shape());
    if (dx.data() != nullptr) max_pool2d_backward(exec, x, y, dy, dx, options());
  }
  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>&) {}
  [[nodiscard]] std::size_t parameter_count() const noexcept { return 0; }

 private:
  pool_options options() const {
    return pool_options{.pool_h = config_.pool_h, .pool_w = config_.pool_w, .stride_h = config_.stride_h,
                        .stride_w = config_.stride_w};
  }
  max_pool2d_config config_;
};

}  // namespace mpx
