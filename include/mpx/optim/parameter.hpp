// mpx::parameter: what an optimizer updates: a named tensor of trainable values and the
// tensor its gradient is written to, of the same dtype and shape (half, bfloat16 or
// float). Layers hand out lists of these; optimizers group them by dtype.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/exec/tensor_ref.hpp>

#include <cstdint>
#include <memory>
#include <string>

namespace mpx {

//! How many backward passes have written a model's gradients. A model hands its count
//! out with its parameters; an optimizer remembers the count at each step and refuses a
//! step when no backward ran since its last one, which would apply the previous step's
//! gradients a second time (or, before any backward, the zeros the model was built with).
struct backward_count {
  std::uint64_t passes = 0;
};

template <memory_space Space>
struct parameter {
  std::string name;           //!< how reports and checkpoints refer to it ("dense_1/kernel")
  tensor_ref<Space> value;    //!< the trainable values, in the storage dtype
  tensor_ref<Space> gradient; //!< d loss / d value, same dtype and shape
  //! The backward passes of the model the gradient belongs to; empty for a tensor that
  //! no model owns (an optimizer then cannot tell whether a backward ran, and does not ask).
  std::shared_ptr<backward_count const> written_by{};
};

namespace detail {
//! Throws mpx::shape_error naming the parameter when its gradient does not match it.
template <class Space>
void require_matching_gradient(std::string_view op, parameter<Space> const& p) {
  if (p.value.dtype() != p.gradient.dtype())
    fail<shape_error>(op, "parameter '" + p.name + "' is " + std::string(to_string(p.value.dtype())) +
                              " but its gradient is " + std::string(to_string(p.gradient.dtype())));
  if (!(p.value.shape() == p.gradient.shape()))
    fail<shape_error>(op, "parameter '" + p.name + "' has shape " + p.value.shape().to_string() +
                              " but its gradient has shape " + p.gradient.shape().to_string());
}
}  // namespace detail

}  // namespace mpx
