// What the layers that own no tensors share (activation_layer, flatten, max_pool2d,
// softmax_layer): their member types and configuration, build and reserve, the shape
// checks of forward and backward, and an empty parameter list. Such a layer says only
// what is its own: its output shape and the two passes.
#pragma once

#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/optim/parameter.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mpx::detail {

//! The base of a layer without parameters or workspace, `Layer` deriving from
//! `stateless_layer<Layer, Policy, Config>` (Config: what its constructor takes). Layer
//! provides `compute_output_shape(in)`, `run_forward(exec, x, y)` and
//! `run_backward(exec, x, y, dy, dx)`; the base checks the shapes first and calls
//! run_backward only when dx is wanted (not for a model's first layer).
template <class Layer, class Policy, class Config>
class stateless_layer : public layer_base, public storage_dtype_layer<Policy, Config> {
  using storage_type = typename Policy::storage_type;  // such a layer keeps its input's dtype

 public:
  explicit stateless_layer(Config config) : config_(config) {}
  [[nodiscard]] Config const& config() const noexcept { return config_; }

  template <executor Exec>
  void build(Exec const&, shape const& in, std::uint64_t /*seed*/) {
    require_layer_policy<Policy>();
    mark_built(in, self().compute_output_shape(in));
  }
  template <executor Exec>
  void reserve(Exec const&, std::int64_t batch) {
    reserved_batch_ = batch;
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type, Space> y,
               bool /*training*/) {
    check_input(x.shape(), y.shape());
    self().run_forward(exec, x, y);
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type const, Space> y,
                tensor_view<storage_type const, Space> dy, tensor_view<storage_type, Space> dx) {
    check_input(x.shape(), y.shape());
    if (dx.data() != nullptr) self().run_backward(exec, x, y, dy, dx);
  }
  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>&) {}
  [[nodiscard]] std::size_t parameter_count() const noexcept { return 0; }

 protected:
  //! Protected, so that a layer inheriting the constructors is default-constructible
  //! only where it says so (flatten() is, activation_layer() is not).
  stateless_layer() = default;

 private:
  Config config_{};

  [[nodiscard]] Layer& self() noexcept { return static_cast<Layer&>(*this); }
  [[nodiscard]] Layer const& self() const noexcept { return static_cast<Layer const&>(*this); }
};

}  // namespace mpx::detail
