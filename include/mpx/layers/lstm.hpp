// mpx::lstm<Policy>: a Keras LSTM layer (tanh, sigmoid gates, unit_forget_bias) over
// sequences [batch, steps, features], returning the last step's output [units] or, with
// return_sequences, every step's [steps, units]. The cell state and the gate arithmetic
// are float whatever the storage; one product per step (kernels/lstm.hpp). The kernel
// and recurrent kernel are stored in the policy's storage type; their gradients are
// summed in float by backpropagation through time and rounded once to that type for
// the optimizer. The bias is float.
#pragma once

#include <mpx/exec/copy.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/kernels/lstm.hpp>
#include <mpx/layers/initializers.hpp>
#include <mpx/layers/layer.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace mpx {

struct lstm_config {
  std::int64_t units = 0;
  bool return_sequences = false;
  initializer kernel_initializer = initializer::glorot_uniform;
  //! Keras uses an orthogonal recurrent initialiser; glorot_uniform of [U, 4U] has the
  //! same scale per column and needs no QR decomposition.
  initializer recurrent_initializer = initializer::glorot_uniform;
  bool unit_forget_bias = true;  //!< the forget gate's bias starts at 1, as Keras's
};

template <class Policy = model_policy>
class lstm : public layer_base, public detail::storage_dtype_layer<Policy, lstm_config> {
  using storage_type = typename Policy::storage_type;

 public:
  static constexpr std::string_view kind = "LSTM";

  explicit lstm(lstm_config config) : config_(config) { detail::require_positive_units("mpx::lstm", config_.units); }
  explicit lstm(std::int64_t units, bool return_sequences = false)
      : lstm(lstm_config{.units = units, .return_sequences = return_sequences}) {}
  [[nodiscard]] lstm_config const& config() const noexcept { return config_; }

  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    if (in.rank() != 2 || in[0] < 1 || in[1] < 1)
      detail::fail<shape_error>(name().empty() ? "mpx::lstm" : name(),
                                "expects sequences of shape [steps, features], got " + in.to_string());
    return config_.return_sequences ? shape{in[0], config_.units} : shape{config_.units};
  }

  template <executor Exec>
  void build(Exec const& exec, shape const& in, std::uint64_t seed) {
    detail::require_layer_policy<Policy>();
    detail::require_products_without_fp8<Policy>();
    shape const out = compute_output_shape(in);
    std::int64_t const f = in[1], u = config_.units;
    kernel_.allocate(exec, {f, 4 * u});
    recurrent_.allocate(exec, {u, 4 * u});
    bias_.allocate(exec, {4 * u});
    kernel_grad_f_.allocate(exec, {f, 4 * u});
    recurrent_grad_f_.allocate(exec, {u, 4 * u});
    using Space = memory_space_t<Exec>;
    initialize(exec, kernel_.template value<Space>(), config_.kernel_initializer, f, 4 * u, seed);
    initialize(exec, recurrent_.template value<Space>(), config_.recurrent_initializer, u, 4 * u, seed + 1);
    tensor<float, host_space> b(shape{4 * u});
    for (std::int64_t i = 0; i < 4 * u; ++i) b[static_cast<std::size_t>(i)] = config_.unit_forget_bias && i >= u && i < 2 * u ? 1.0f : 0.0f;
    copy(exec, b, bias_.template value<Space>());
    exec.synchronize();
    mark_built(in, out);
  }

  template <executor Exec>
  void reserve(Exec const& exec, std::int64_t batch) {
    require_built("reserve");
    std::int64_t const t = input_shape_[0], f = input_shape_[1], u = config_.units;
    workspace_.ensure(exec, shape{static_cast<std::int64_t>(lstm_workspace_elements<Policy>(batch, t, f, u))});
    sequence_.ensure(exec, {batch, t, u});
    sequence_grad_.ensure(exec, {batch, t, u});
    dx_scratch_.ensure(exec, {batch, t, f});
    reserved_batch_ = batch;
  }

  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type, Space> y, bool) {
    std::int64_t const n = check_input(x.shape(), y.shape());
    if (n > reserved_batch_) reserve(exec, n);
    std::int64_t const t = input_shape_[0], u = config_.units;
    auto const ws = workspace_.template view<Space>();
    if (config_.return_sequences) {
      lstm_forward<Policy>(exec, x, kernel_.template value<Space>(), recurrent_.template value<Space>(),
                           bias_.template value<Space>(), y, ws);
      return;
    }
    auto const h = sequence_.template view<Space>({n, t, u});
    lstm_forward<Policy>(exec, x, kernel_.template value<Space>(), recurrent_.template value<Space>(),
                         bias_.template value<Space>(), h, ws);
    detail::copy_strided_rows(exec, h.data() + (t - 1) * u, t * u, y.data(), u, n, u);  // the last step
  }

  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type const, Space> y,
                tensor_view<storage_type const, Space> dy, tensor_view<storage_type, Space> dx) {
    std::int64_t const n = check_input(x.shape(), y.shape());
    detail::require_batch_shape(name(), "output gradient", dy.shape(), output_shape_);
    std::int64_t const t = input_shape_[0], u = config_.units;
    tensor_view<storage_type const, Space> dh = dy;
    if (!config_.return_sequences) {  // only the last step's output reached the loss
      auto const full = sequence_grad_.template view<Space>({n, t, u});
      fill(exec, full, cast<storage_type>(0.0f));
      detail::copy_strided_rows(exec, dy.data(), u, full.data() + (t - 1) * u, t * u, n, u);
      dh = full;
    } else {
      dh = dy.reshape({n, t, u});
    }
    auto const dx_out = dx.data() ? dx : dx_scratch_.template view<Space>(x.shape());
    auto const dw = kernel_grad_f_.template view<Space>();
    auto const dr = recurrent_grad_f_.template view<Space>();
    lstm_backward<Policy>(exec, dh, kernel_.template value<Space>(), recurrent_.template value<Space>(), dx_out, dw, dr,
                          bias_.template gradient<Space>(), workspace_.template view<Space>());
    // The optimizer pairs each parameter with a gradient of its own dtype.
    cast(exec, dw, kernel_.template gradient<Space>());
    cast(exec, dr, recurrent_.template gradient<Space>());
  }

  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>& out) {
    require_built("parameters");
    kernel_.append_to(out, name(), "kernel");
    recurrent_.append_to(out, name(), "recurrent_kernel");
    bias_.append_to(out, name(), "bias");
  }
  [[nodiscard]] std::size_t parameter_count() const noexcept {
    return kernel_.size() + recurrent_.size() + bias_.size();
  }

 private:
  lstm_config config_;
  detail::trainable<storage_type> kernel_, recurrent_;
  detail::trainable<float> bias_;
  detail::layer_tensor<storage_type> sequence_, sequence_grad_, dx_scratch_;
  detail::layer_tensor<float> kernel_grad_f_, recurrent_grad_f_, workspace_;
};

}  // namespace mpx
