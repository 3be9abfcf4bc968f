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

struct model_history;  // below: what the model a parameter belongs to tells its optimizers

template <memory_space Space>
struct parameter {
  std::string name;           //!< how reports and checkpoints refer to it ("dense_1/kernel")
  tensor_ref<Space> value;    //!< the trainable values, in the storage dtype
  tensor_ref<Space> gradient; //!< d loss / d value, same dtype and shape
  //! The history of the model the parameter belongs to; empty for a tensor that no model
  //! owns (an optimizer then cannot tell whether a backward ran, and does not ask).
  std::shared_ptr<model_history const> written_by{};
  //! The model's `builds` when it handed this parameter out.
  std::uint64_t build = 0;
};

//! What a model tells the optimizers made from its parameters (it hands this out with
//! them). Each count is one reason an optimizer refuses a step, before changing anything.
struct model_history {
  //! Backward passes: with none since the optimizer's last step, the step would apply the
  //! previous step's gradients again (or, before any backward, the zeros of the build).
  std::uint64_t passes = 0;
  //! Builds: one after the optimizer was made allocated new tensors and freed its ones.
  std::uint64_t builds = 0;
  //! Weights written from outside the optimizers (load_model, weights_replaced): a step
  //! would write the float master copies of the old weights back over them.
  std::uint64_t weight_loads = 0;
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
