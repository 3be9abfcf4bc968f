// What dense and conv2d share: a kernel and a bias in the policy's storage type, with
// their gradients; the matrix products that read them (layers/matrix_products.hpp); and
// the accessors, parameter list and fp8 scales built from these.
#pragma once

#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/matrix_products.hpp>
#include <mpx/optim/parameter.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mpx::detail {

//! The base of a layer computing act(x W + b), `Layer` deriving from it and from
//! mpx::layer_base; `Config` is what Layer's constructor takes (its member types come
//! from here). Layer befriends it: the parameter list checks that Layer is built.
template <class Layer, class Policy, class Config>
class kernel_bias_layer : public with_matrix_products<Policy>, public storage_dtype_layer<Policy, Config> {
  using storage_type = typename Policy::storage_type;

 public:
  //! The trainable tensors, for inspection, tests and a user's own update rules.
  template <memory_space Space>
  [[nodiscard]] tensor_view<storage_type, Space> kernel() const { return kernel_.template value<Space>(); }
  template <memory_space Space>
  [[nodiscard]] tensor_view<storage_type, Space> bias() const { return bias_.template value<Space>(); }
  template <memory_space Space>
  [[nodiscard]] tensor_view<storage_type, Space> kernel_gradient() const { return kernel_.template gradient<Space>(); }
  template <memory_space Space>
  [[nodiscard]] tensor_view<storage_type, Space> bias_gradient() const { return bias_.template gradient<Space>(); }

  //! "<layer>/kernel" and "<layer>/bias", with their gradients, for the optimizer.
  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>& out) {
    self().require_built("parameters");
    kernel_.append_to(out, self().name(), "kernel");
    bias_.append_to(out, self().name(), "bias");
  }
  [[nodiscard]] std::size_t parameter_count() const noexcept { return kernel_.size() + bias_.size(); }

  //! The fp8 scales, for save_training_state (nothing outside fp8).
  template <executor Exec>
  void append_fp8_scales(std::vector<fp8_scales_entry<Exec>>& out) {
    this->products_.append_to(out, self().name());
  }
  //! NVFP4's stochastic-rounding draw count and seed, for save_training_state (nothing
  //! under other policies).
  template <memory_space Space>
  void append_counters(std::vector<std::pair<std::string, tensor_view<std::uint64_t, Space>>>& out) {
    this->products_.template append_counters<Space>(out, self().name());
  }
  void append_seeds(std::vector<std::pair<std::string, std::uint64_t*>>& out) {
    this->products_.append_seeds(out, self().name());
  }

 protected:
  //! Allocates the kernel [kernel_shape] and the bias [units] with their gradients.
  template <executor Exec>
  void allocate_kernel_and_bias(Exec const& exec, shape const& kernel_shape, std::int64_t units) {
    kernel_.allocate(exec, kernel_shape);
    bias_.allocate(exec, {units});
  }

  trainable<storage_type> kernel_, bias_;

 private:
  [[nodiscard]] Layer& self() noexcept { return static_cast<Layer&>(*this); }
  [[nodiscard]] Layer const& self() const noexcept { return static_cast<Layer const&>(*this); }
};

}  // namespace mpx::detail
