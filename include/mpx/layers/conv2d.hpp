// mpx::conv2d<Policy>: a 2-D convolution over NHWC images with a bias and a fused
// activation, like keras.layers.Conv2D (kernel [KH, KW, Cin, Cout], 'valid' or 'same'
// padding, strides, dilation). im2col into a workspace the layer reserves once, one
// matrix product in the policy's compute type (fp8 with per-tensor scales under
// mpx::mixed_fp8: layers/matrix_products.hpp), and the bias add with the activation in
// one float pass (kernels/conv2d.hpp, kernels/activation.hpp). The backward pass reuses
// the forward pass's columns for the weight gradient.
#pragma once

#include <mpx/kernels/activation.hpp>
#include <mpx/kernels/conv2d.hpp>
#include <mpx/layers/initializers.hpp>
#include <mpx/layers/kernel_bias_layer.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/matrix_products.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace mpx {

enum class padding { valid, same };

struct conv2d_config {
  std::int64_t filters = 0;
  std::int64_t kernel_h = 3, kernel_w = 3;
  mpx::activation activation = mpx::activation::linear;
  mpx::padding padding = mpx::padding::valid;
  std::int64_t stride_h = 1, stride_w = 1;
  std::int64_t dilation_h = 1, dilation_w = 1;
  initializer kernel_initializer = initializer::glorot_uniform;
  initializer bias_initializer = initializer::zeros;
};

template <class Policy = model_policy>
class conv2d : public layer_base, public detail::kernel_bias_layer<conv2d<Policy>, Policy, conv2d_config> {
  using storage_type = typename Policy::storage_type;

 public:
  static constexpr std::string_view kind = "Conv2D";

  explicit conv2d(conv2d_config config) : config_(config) {
    if (config_.filters <= 0 || config_.kernel_h <= 0 || config_.kernel_w <= 0)
      detail::fail<invalid_argument>("mpx::conv2d", "filters and kernel extents must be positive, got " +
                                                        std::to_string(config_.filters) + " filters of " +
                                                        std::to_string(config_.kernel_h) + "x" +
                                                        std::to_string(config_.kernel_w));
  }
  //! Keras's Conv2D(filters, kernel_size, activation=..., padding=...).
  conv2d(std::int64_t filters, std::int64_t kernel_size, mpx::activation act = mpx::activation::linear,
         mpx::padding pad = mpx::padding::valid)
      : conv2d(conv2d_config{.filters = filters, .kernel_h = kernel_size, .kernel_w = kernel_size, .activation = act,
                             .padding = pad}) {}
  [[nodiscard]] conv2d_config const& config() const noexcept { return config_; }

  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    if (in.rank() != 3)
      detail::fail<shape_error>(display_name(), "expects images of shape [height, width, channels], got " + in.to_string());
    shape const out = conv2d_output_shape(shape{1, in[0], in[1], in[2]}, kernel_shape(in[2]), options_for(in));
    return shape{out[1], out[2], out[3]};
  }

  template <executor Exec>
  void build(Exec const& exec, shape const& in, std::uint64_t seed) {
    detail::require_layer_policy<Policy>();
    shape const out = compute_output_shape(in);
    this->products_.require_fp8_width(display_name(), "filter count", config_.filters);
    options_ = options_for(in);
    shape const k = kernel_shape(in[2]);
    this->allocate_kernel_and_bias(exec, k, config_.filters);
    using Space = memory_space_t<Exec>;
    std::int64_t const taps = config_.kernel_h * config_.kernel_w;
    initialize(exec, this->template kernel<Space>(), config_.kernel_initializer, taps * in[2], taps * config_.filters,
               seed);
    initialize(exec, this->template bias<Space>(), config_.bias_initializer, taps * in[2], taps * config_.filters,
               seed + 1);
    this->products_.build(exec, seed + 2);
    mark_built(in, out);
  }

  template <executor Exec>
  void reserve(Exec const& exec, std::int64_t batch) {
    require_built("reserve");
    columns_.ensure(exec, conv2d_workspace_shape(batched(batch, input_shape_), this->kernel_.shape(), options_));
    pre_activation_.ensure(exec, batched(batch, output_shape_));
    pre_activation_grad_.ensure(exec, batched(batch, output_shape_));  // its own buffer: backward may run again
    // The products' operands (fp8 casts): im2col columns [pixels, taps x channels], the
    // kernel as a matrix, the output gradient [pixels, filters].
    std::int64_t const pixels = batch * output_shape_[0] * output_shape_[1];
    std::int64_t const patch = config_.kernel_h * config_.kernel_w * input_shape_[2];
    this->products_.reserve(exec, {pixels, patch}, {patch, config_.filters}, {pixels, config_.filters});
    columns_hold_forward_ = false;
    reserved_batch_ = batch;
  }

  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type, Space> y, bool) {
    check_input_and_reserve(*this, exec, x.shape(), y.shape());
    auto const w = this->template kernel<Space>();
    auto const b = this->template bias<Space>();
    auto const cols = columns_.template view<Space>();
    auto const rows = shape{static_cast<std::int64_t>(y.size()) / config_.filters, config_.filters};
    if (config_.activation == activation::linear) {
      conv2d_forward<Policy>(exec, x, w, y, cols, options_, here(), forward_product());
      columns_hold_forward_ = true;
      bias_activation_forward(exec, act::identity{}, y.reshape(rows), b, y.reshape(rows));
      return;
    }
    auto const z = pre_activation_.template view<Space>(y.shape());
    conv2d_forward<Policy>(exec, x, w, z, cols, options_, here(), forward_product());
    columns_hold_forward_ = true;
    with_activation(config_.activation, [&](auto a) { bias_activation_forward(exec, a, z.reshape(rows), b, y.reshape(rows)); });
  }

  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type const, Space> y,
                tensor_view<storage_type const, Space> dy, tensor_view<storage_type, Space> dx) {
    check_input(x.shape(), y.shape());
    detail::require_batch_shape(name(), "output gradient", dy.shape(), output_shape_);
    if (dx.data() != nullptr)  // before anything runs (a model's first layer computes no dx)
      this->products_.require_fp8_width(display_name(), "kernel taps x input channels, in its input gradient's product",
                                        config_.kernel_h * config_.kernel_w * input_shape_[2]);
    auto const rows = shape{static_cast<std::int64_t>(y.size()) / config_.filters, config_.filters};
    auto const w = this->template kernel<Space>();
    auto const b = this->template bias<Space>();
    auto const dw = this->template kernel_gradient<Space>();
    auto const db = this->template bias_gradient<Space>();
    auto const cols = columns_.template view<Space>();
    tensor_view<storage_type const, Space> dz = dy;
    if (config_.activation == activation::linear) {
      mpx::bias_gradient(exec, dy.reshape(rows), db);
    } else {
      auto const z = pre_activation_.template view<Space>(y.shape());
      auto const dz_out = pre_activation_grad_.template view<Space>(y.shape());
      with_activation(config_.activation, [&](auto a) {
        bias_activation_backward(exec, a, z.reshape(rows), b, dy.reshape(rows), dz_out.reshape(rows), db);
      });
      dz = dz_out;
    }
    // Right after forward the columns hold its im2col of x and the weight gradient reuses
    // them; the data gradient then overwrites them, so a second backward recomputes.
    conv2d_backward_weights<Policy>(exec, x, dz, dw, cols, options_,
                                    columns_hold_forward_ ? conv2d_columns::reuse_forward : conv2d_columns::recompute,
                                    here(), product<operand_role::activation, operand_role::gradient>());
    if (dx.data() != nullptr) {
      conv2d_backward_data<Policy>(exec, dz, w, dx, cols, options_, here(),
                                   product<operand_role::gradient, operand_role::weight>());
      columns_hold_forward_ = false;
    }
    this->products_.end_step(exec);
  }

 private:
  friend detail::kernel_bias_layer<conv2d, Policy, conv2d_config>;  // its parameter list checks that the layer is built
  std::string display_name() const { return name().empty() ? std::string("mpx::conv2d") : name(); }
  shape kernel_shape(std::int64_t channels) const {
    return shape{config_.kernel_h, config_.kernel_w, channels, config_.filters};
  }
  conv2d_options options_for(shape const& in) const {
    conv2d_options o{.stride_h = config_.stride_h, .stride_w = config_.stride_w, .dilation_h = config_.dilation_h,
                     .dilation_w = config_.dilation_w};
    if (config_.padding == padding::same) o = conv2d_padding_same(shape{1, in[0], in[1], in[2]}, kernel_shape(in[2]), o);
    return o;
  }
  static shape batched(std::int64_t batch, shape const& s) { return detail::with_batch(batch, s); }
  static mpx::source_location here(mpx::source_location loc = mpx::source_location::current()) { return loc; }
  //! The convolution's product through this layer's matrix_products, operands of roles
  //! RA and RB.
  template <operand_role RA, operand_role RB>
  auto product() {
    return [this](auto const& exec, auto const& a, auto const& b, auto const& c, gemm_options const& o,
                  mpx::source_location loc) { this->products_.template run<RA, RB>(exec, a, b, c, o, loc); };
  }
  auto forward_product() { return product<operand_role::activation, operand_role::weight>(); }

  conv2d_config config_;
  conv2d_options options_{};
  detail::layer_tensor<storage_type> columns_, pre_activation_, pre_activation_grad_;
  bool columns_hold_forward_ = false;  // whether columns_ still holds the last forward's im2col
};

}  // namespace mpx
