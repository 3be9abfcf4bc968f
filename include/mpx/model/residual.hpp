// mpx::residual: a residual block, y = x + branch(x), usable as one layer of a
// sequential model. The branch is itself a sequential chain of layers, with the same
// compile-time checks and inserted casts; it takes the model's policy unless its layers
// name their own. A pre-norm transformer block's MLP half reads
//
//   mpx::residual(mpx::layer_norm<>(), mpx::dense<>(4 * width, mpx::activation::gelu), mpx::dense<>(width))
//
// The sum is computed in float and rounded once to the storage dtype; the backward pass
// adds the identity path's gradient to the branch's input gradient the same way.
#pragma once

#include <mpx/kernels/elementwise.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/matrix_products.hpp>
#include <mpx/model/composite.hpp>
#include <mpx/model/sequential.hpp>

#include <array>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx {

template <class Policy, class... Layers>
class residual_block : public layer_base, public detail::composite_parts<residual_block<Policy, Layers...>> {
 public:
  using policy = Policy;
  using input_type = typename Policy::storage_type;
  using output_type = input_type;
  using branch_type = sequential_model<Layers...>;
  static constexpr std::string_view kind = "Residual";

  static_assert(std::is_same_v<typename branch_type::input_type, input_type> &&
                    std::is_same_v<typename branch_type::output_type, input_type>,
                "mpx::residual: the branch must read and write the block's storage dtype (the model's policy's "
                "storage_type): a residual block adds its input to the branch's output. Give the branch's first "
                "and last layers the model's policy");

  explicit residual_block(Layers... layers) : branch_(std::move(layers)...) {}

  [[nodiscard]] shape compute_output_shape(shape const& in) const { return in; }

  //! Builds the branch from `seed`; mpx::shape_error when it does not keep the shape.
  template <executor Exec>
  void build(Exec const& exec, shape const& in, std::uint64_t seed) {
    detail::require_layer_policy<Policy>();
    branch_.build(exec, in, seed);
    if (!(branch_.output_shape() == in))
      detail::fail<shape_error>(name_, "the branch turns a sample of shape " + in.to_string() + " into " +
                                           branch_.output_shape().to_string() +
                                           "; a residual block adds its input to the branch's output, so the "
                                           "branch must keep the shape");
    mark_built(in, in);
  }
  template <executor Exec>
  void reserve(Exec const& exec, std::int64_t batch) {
    branch_.reserve(exec, batch);
    reserved_batch_ = batch;
  }

  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type, Space> y,
               bool training) {
    check_input(x.shape(), y.shape());
    auto const f = branch_.forward(exec, x, training);
    transform(exec, y, ops::axpy_with<output_type>{1.0f}, x, f);  // x + f(x), rounded once
  }

  //! dx = dy + (d branch / dx)ᵀ dy; the branch's parameter gradients are overwritten.
  //! With no dx (the model's first layer), only the parameter gradients.
  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<input_type const, Space>, tensor_view<output_type const, Space>,
                tensor_view<output_type const, Space> dy, tensor_view<input_type, Space> dx) {
    if (dx.size() == 0) {
      branch_.backward(exec, dy);
      return;
    }
    branch_.backward_to_input(exec, dy, dx);
    transform(exec, dx, ops::axpy_with<input_type>{1.0f}, tensor_view<output_type const, Space>(dy),
              tensor_view<input_type const, Space>(dx));
  }

  //! Calls f(branch, "<block>/"): the composite's one part (see model/composite.hpp).
  template <class F>
  void for_each_part(F&& f) {
    f(branch_, name() + "/");
  }
  template <class F>
  void for_each_part(F&& f) const {
    f(branch_, name() + "/");
  }

  //! f(branch), without making a name.
  template <class F>
  void for_each_part_model(F&& f) {
    f(branch_);
  }
  template <class F>
  void for_each_part_model(F&& f) const {
    f(branch_);
  }

  //! The same block, not built (mpx::repeat's copies).
  [[nodiscard]] residual_block unbuilt_copy() const { return residual_block(branch_.unbuilt_copy()); }

  [[nodiscard]] branch_type& branch() noexcept { return branch_; }
  [[nodiscard]] branch_type const& branch() const noexcept { return branch_; }

 private:
  explicit residual_block(branch_type&& branch) : branch_(std::move(branch)) {}

  branch_type branch_;
};

//! What mpx::residual(layers...) returns: the branch's layers, waiting for the model to
//! give them its policy (mpx::sequential<Policy>(..., mpx::residual(...), ...)).
template <class... Layers>
struct residual_branch {
  std::tuple<Layers...> layers;

  //! The block under the model's policy P (each layer keeps its own policy, if it has one).
  template <class P>
  auto with_policy() && {
    return std::apply(
        [](auto&&... l) {
          return residual_block<P, typename detail::resolve_policy<Layers, P>::type...>(
              detail::with_model_policy<Layers, P>(std::move(l))...);
        },
        std::move(layers));
  }
};

//! A residual block y = x + branch(x) of these layers, for mpx::sequential<Policy>.
template <class... Layers>
auto residual(Layers&&... layers) {
  static_assert(sizeof...(Layers) > 0, "mpx::residual needs at least one layer in its branch");
  return residual_branch<std::remove_cvref_t<Layers>...>{{std::forward<Layers>(layers)...}};
}

namespace detail {

template <class... Layers, class P>
struct resolve_policy<residual_branch<Layers...>, P> {
  using type = residual_block<P, typename resolve_policy<Layers, P>::type...>;
};

}  // namespace detail

}  // namespace mpx
