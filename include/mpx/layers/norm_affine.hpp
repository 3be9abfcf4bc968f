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

//! gamma (initialised to ones) and beta (zeros), one per channel, with their gradients.
struct norm_affine {
  trainable<float> gamma, beta;

  template <executor Exec>
  void build(Exec const& exec, std::int64_t channels) {
    using Space = memory_space_t<Exec>;
    gamma.allocate(exec, {channels});
    beta.allocate(exec, {channels});
    initialize(exec, gamma.value<Space>(), initializer::ones, 1, 1, 0);
    initialize(exec, beta.value<Space>(), initializer::zeros, 1, 1, 0);
  }

  //! "<layer>/gamma" and "<layer>/beta", with their gradients, for the optimizer.
  template <memory_space Space>
  void append_parameters(std::string const& layer_name, std::vector<parameter<Space>>& out) const {
    gamma.append_to(out, layer_name, "gamma");
    beta.append_to(out, layer_name, "beta");
  }
  [[nodiscard]] std::size_t parameter_count() const noexcept { return gamma.size() + beta.size(); }
};

}  // namespace mpx::detail
