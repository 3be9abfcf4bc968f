// mpx::max_pool2d<Policy>: the maximum over each window of NHWC images, like
// keras.layers.MaxPool2D (pool 2x2, strides = pool, 'valid'); a NaN in a window is
// the window's maximum, so it propagates (kernels/max_pool.hpp).
#pragma once

#include <mpx/kernels/max_pool.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/stateless_layer.hpp>

#include <vector>

namespace mpx {

struct max_pool2d_config {
  std::int64_t pool_h = 2, pool_w = 2;
  std::int64_t stride_h = 0, stride_w = 0;  //!< 0: the pool's extent
};

template <class Policy = model_policy>
class max_pool2d : public detail::stateless_layer<max_pool2d<Policy>, Policy, max_pool2d_config> {
 public:
  static constexpr std::string_view kind = "MaxPool2D";

  using max_pool2d::stateless_layer::stateless_layer;  // from a max_pool2d_config
  explicit max_pool2d(std::int64_t pool = 2) : max_pool2d::stateless_layer(max_pool2d_config{pool, pool, 0, 0}) {}

  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    if (in.rank() != 3)
      detail::fail<shape_error>(this->name().empty() ? "mpx::max_pool2d" : this->name(),
                                "expects images of shape [height, width, channels], got " + in.to_string());
    shape const out = max_pool2d_output_shape(shape{1, in[0], in[1], in[2]}, options());
    return shape{out[1], out[2], out[3]};
  }

 private:
  friend detail::stateless_layer<max_pool2d, Policy, max_pool2d_config>;
  void run_forward(auto const& exec, auto x, auto y) { max_pool2d_forward(exec, x, y, options()); }
  void run_backward(auto const& exec, auto x, auto y, auto dy, auto dx) {
    max_pool2d_backward(exec, x, y, dy, dx, options());
  }
  pool_options options() const {
    max_pool2d_config const& c = this->config();
    return pool_options{.pool_h = c.pool_h, .pool_w = c.pool_w, .stride_h = c.stride_h, .stride_w = c.stride_w};
  }
};

}  // namespace mpx
