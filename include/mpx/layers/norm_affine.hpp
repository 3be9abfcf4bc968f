// What batch_norm and layer_norm share: the per-channel scale and offset they learn
// (gamma and beta, float whatever the layer's storage, as Keras keeps them), with their
// gradients, and the check of the input shape they normalise over.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/layers/initializers.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/optim/parameter.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mpx::detail {

//! Returns the size of the last axis of a normalisation layer's input, [..., channels],
//! or throws shape_error naming the layer (`fallback` until it has a name) and the axis.
inline std::int64_t norm_channels(std::string const& name, std::string_view fallback, std::string_view axis,
                                  shape const& in) {
  if (in.rank() < 1 || in[in.rank() - 1] < 1)
    fail<shape_error>(name.empty() ? std::string(fallback) : name,
                      "expects inputs of shape [..., " + std::string(axis) + "], got " + in.to_string());
  return in[in.rank() - 1];
}

//! gamma (initialised to ones) and beta (zeros), one per channel, and their gradients.
class norm_affine {
 public:
  template <executor Exec>
  void build(Exec const& exec, std::int64_t channels) {
    using Space = memory_space_t<Exec>;
    for (auto* t : {&gamma_, &beta_, &dgamma_, &dbeta_}) t->allocate(exec, {channels});
    initialize(exec, gamma_.template view<Space>(), initializer::ones, 1, 1, 0);
    initialize(exec, beta_.template view<Space>(), initializer::zeros, 1, 1, 0);
  }

  template <memory_space Space>
  [[nodiscard]] tensor_view<float, Space> gamma() const { return gamma_.template view<Space>(); }
  template <memory_space Space>
  [[nodiscard]] tensor_view<float, Space> beta() const { return beta_.template view<Space>(); }
  template <memory_space Space>
  [[nodiscard]] tensor_view<float, Space> dgamma() const { return dgamma_.template view<Space>(); }
  template <memory_space Space>
  [[nodiscard]] tensor_view<float, Space> dbeta() const { return dbeta_.template view<Space>(); }

  //! "<layer>/gamma" and "<layer>/beta", with their gradients, for the optimizer.
  template <memory_space Space>
  void append_parameters(std::string const& layer_name, std::vector<parameter<Space>>& out) const {
    out.push_back({layer_name + "/gamma", gamma<Space>(), dgamma<Space>()});
    out.push_back({layer_name + "/beta", beta<Space>(), dbeta<Space>()});
  }
  [[nodiscard]] std::size_t parameter_count() const noexcept { return 2 * gamma_.size(); }

 private:
  layer_tensor<float> gamma_, beta_, dgamma_, dbeta_;
};

}  // namespace mpx::detail
