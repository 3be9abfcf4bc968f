// mpx::dense<Policy>: y = act(x W + b) over the last axis, like keras.layers.Dense.
// W [in, units] and b [units] are stored in the policy's storage type (an optimizer
// keeps their master copies in the policy's param type); the products read their
// operands in the policy's compute type (fp8 with per-tensor scales under
// mpx::mixed_fp8: layers/matrix_products.hpp) and accumulate in its accumulate type;
// the bias add and activation run in float in one pass.
#pragma once

#include <mpx/kernels/activation.hpp>
#include <mpx/kernels/gemm.hpp>
#include <mpx/layers/initializers.hpp>
#include <mpx/layers/kernel_bias_layer.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/matrix_products.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace mpx {

struct dense_config {
  std::int64_t units = 0;
  mpx::activation activation = mpx::activation::linear;
  initializer kernel_initializer = initializer::glorot_uniform;
  initializer bias_initializer = initializer::zeros;
  std::int64_t in_features = 0;  //!< 0: taken from the input shape at build
};

template <class Policy = model_policy>
class dense : public layer_base, public detail::kernel_bias_layer<dense<Policy>, Policy, dense_config> {
  using storage_type = typename Policy::storage_type;

 public:
  static constexpr std::string_view kind = "Dense";

  explicit dense(dense_config config) : config_(config) { detail::require_positive_units("mpx::dense", config_.units); }
  //! Keras's Dense(units, activation): the input width is taken at build.
  explicit dense(std::int64_t units, mpx::activation act = mpx::activation::linear)
      : dense(dense_config{.units = units, .activation = act}) {}
  //! With the input width stated, checked at build.
  dense(std::int64_t in_features, std::int64_t units, mpx::activation act)
      : dense(dense_config{.units = units, .activation = act, .in_features = in_features}) {}

  [[nodiscard]] dense_config const& config() const noexcept { return config_; }

  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    if (in.rank() < 1 || in[in.rank() - 1] <= 0)
      detail::fail<shape_error>(name_or_kind(), "expects inputs of shape [..., features], got " + in.to_string());
    if (config_.in_features && in[in.rank() - 1] != config_.in_features)
      detail::fail<shape_error>(name_or_kind(), "was declared with " + std::to_string(config_.in_features) +
                                                    " input features but receives shape " + in.to_string());
    std::vector<std::int64_t> e(in.extents().begin(), in.extents().end());
    e.back() = config_.units;
    return shape(std::span<std::int64_t const>(e.data(), e.size()));
  }

  template <executor Exec>
  void build(Exec const& exec, shape const& in, std::uint64_t seed) {
    detail::require_layer_policy<Policy>();
    shape const out = compute_output_shape(in);
    this->products_.require_fp8_width(name_or_kind(), "unit count", config_.units);
    std::int64_t const fan_in = in[in.rank() - 1];
    this->allocate_kernel_and_bias(exec, {fan_in, config_.units}, config_.units);
    using Space = memory_space_t<Exec>;
    initialize(exec, this->template kernel<Space>(), config_.kernel_initializer, fan_in, config_.units, seed);
    initialize(exec, this->template bias<Space>(), config_.bias_initializer, fan_in, config_.units, seed + 1);
    this->products_.build(exec, seed + 2);
    mark_built(in, out);
  }

  template <executor Exec>
  void reserve(Exec const& exec, std::int64_t batch) {
    require_built("reserve");
    std::int64_t const rows = batch * static_cast<std::int64_t>(output_shape_.size() / config_.units);
    pre_activation_.ensure(exec, {rows, config_.units});       // x W, kept for the activation's derivative
    pre_activation_grad_.ensure(exec, {rows, config_.units});  // its own buffer: backward may run again
    std::int64_t const in = input_shape_[input_shape_.rank() - 1];
    this->products_.reserve(exec, {rows, in}, {in, config_.units}, {rows, config_.units});  // x, W, dz (fp8 casts)
    reserved_batch_ = batch;
  }

  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type, Space> y,
               bool /*training*/) {
    std::int64_t const batch = check_input_and_reserve(*this, exec, x.shape(), y.shape());
    auto const [rows, in] = matrix_of(batch);
    auto const xm = x.reshape({rows, in});
    auto const ym = y.reshape({rows, config_.units});
    auto const w = this->template kernel<Space>();
    auto const b = this->template bias<Space>();
    if (config_.activation == activation::linear) {
      this->products_.template run<operand_role::activation, operand_role::weight>(exec, xm, w, ym);
      bias_activation_forward(exec, act::identity{}, ym, b, ym);
      return;
    }
    auto const z = pre_activation_.template view<Space>({rows, config_.units});
    this->products_.template run<operand_role::activation, operand_role::weight>(exec, xm, w, z);
    with_activation(config_.activation, [&](auto a) { bias_activation_forward(exec, a, z, b, ym); });
  }

  //! Writes the parameter gradients (overwriting) and, unless dx is empty, dx.
  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type const, Space> y,
                tensor_view<storage_type const, Space> dy, tensor_view<storage_type, Space> dx) {
    std::int64_t const batch = check_input(x.shape(), y.shape());
    detail::require_batch_shape(name(), "output gradient", dy.shape(), output_shape_);
    auto const [rows, in] = matrix_of(batch);
    if (dx.data() != nullptr)  // before anything runs (a model's first layer computes no dx)
      this->products_.require_fp8_width(name_or_kind(), "input width, in its input gradient's product", in);
    auto const xm = x.reshape({rows, in});
    auto const dym = dy.reshape({rows, config_.units});
    auto const w = this->template kernel<Space>();
    auto const b = this->template bias<Space>();
    auto const dw = this->template kernel_gradient<Space>();
    auto const db = this->template bias_gradient<Space>();
    tensor_view<storage_type const, Space> dz = dym;
    if (config_.activation == activation::linear) {
      mpx::bias_gradient(exec, dym, db);
    } else {
      auto const z = pre_activation_.template view<Space>({rows, config_.units});
      auto const dz_out = pre_activation_grad_.template view<Space>({rows, config_.units});
      with_activation(config_.activation, [&](auto a) { bias_activation_backward(exec, a, z, b, dym, dz_out, db); });
      dz = dz_out;
    }
    this->products_.template run<operand_role::activation, operand_role::gradient>(exec, xm, dz, dw,
                                                                             {.transpose_a = true});
    if (dx.data() != nullptr) {
      detail::require_batch_shape(name(), "input gradient", dx.shape(), input_shape_);
      this->products_.template run<operand_role::gradient, operand_role::weight>(exec, dz, w, dx.reshape({rows, in}),
                                                                           {.transpose_b = true});
    }
    this->products_.end_step(exec);
  }

 private:
  friend detail::kernel_bias_layer<dense, Policy, dense_config>;  // its parameter list checks that the layer is built
  std::string name_or_kind() const { return name().empty() ? std::string("mpx::dense") : name(); }
  struct rows_in {
    std::int64_t rows, in;
  };
  rows_in matrix_of(std::int64_t batch) const {
    std::int64_t const in = input_shape_[input_shape_.rank() - 1];
    return {batch * static_cast<std::int64_t>(input_shape_.size()) / in, in};
  }

  dense_config config_;
  detail::layer_tensor<storage_type> pre_activation_, pre_activation_grad_;
};

}  // namespace mpx
