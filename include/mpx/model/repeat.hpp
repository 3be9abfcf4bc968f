// mpx::repeat: n copies of a block of layers as one layer of a sequential model, n chosen
// at run time. A GPT's stack of transformer blocks reads
//
//   mpx::sequential<P>(mpx::embedding<>({...}),
//                      mpx::repeat(layers, mpx::residual(mpx::layer_norm<>(), mpx::causal_self_attention<>({...})),
//                                          mpx::residual(mpx::layer_norm<>(), mpx::dense<>(4 * width, gelu),
//                                                        mpx::dense<>(width))),
//                      mpx::layer_norm<>(), mpx::dense<>(vocabulary));
//
// Each copy is a model of its own (its own parameters and buffers), built from the
// block's configurations; the copies run one after another, the output of one the input
// of the next, so the block must keep the sample's shape and dtype. Copy i's layers are
// named "<repeat>/<i>/<layer>" ("repeat/3/residual_1/dense/kernel") wherever the model
// names them (parameters, checkpoints, summaries, find_nonfinite, the precision guard).
// A repeat initialises, computes and trains bit for bit as its n copies written out one
// after another in the model would.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/model/composite.hpp>
#include <mpx/model/sequential.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx {

template <class Policy, class... Layers>
class repeated_block : public layer_base, public detail::composite_parts<repeated_block<Policy, Layers...>> {
 public:
  using policy = Policy;
  using block_type = sequential_model<Layers...>;
  using input_type = typename block_type::input_type;
  using output_type = typename block_type::output_type;
  static constexpr std::string_view kind = "Repeat";

  static_assert(std::is_same_v<input_type, output_type>,
                "mpx::repeat: the block must read and write one dtype: each copy reads what the previous one wrote. "
                "Give the block's first and last layers the same policy");
  static_assert(!std::is_integral_v<input_type>, "mpx::repeat: the block must read and write floating-point activations");

  //! `count` copies of `block` (count ≥ 1, else mpx::invalid_argument).
  repeated_block(std::int64_t count, block_type block) {
    if (count < 1)
      detail::fail<invalid_argument>("mpx::repeat", "the block must be repeated at least once; got " + std::to_string(count));
    copies_.reserve(static_cast<std::size_t>(count));
    for (std::int64_t i = 1; i < count; ++i) copies_.push_back(block.unbuilt_copy());
    copies_.push_back(std::move(block));
  }

  [[nodiscard]] std::size_t count() const noexcept { return copies_.size(); }
  //! Copy i of the block, to inspect or to reach its layers (`block(2).layer<0>().branch()`).
  [[nodiscard]] block_type& block(std::size_t i) { return copies_.at(i); }
  [[nodiscard]] block_type const& block(std::size_t i) const { return copies_.at(i); }

  [[nodiscard]] shape compute_output_shape(shape const& in) const { return in; }
  //! The copies take as many of the model's layer positions, for seeds, as they hold layers.
  [[nodiscard]] std::size_t seed_slots() const { return copies_.size() * copies_.front().seed_slots(); }

  //! Builds copy i from seed + 1000 * (i * the block's layers), as the model would build
  //! the copies written out; mpx::shape_error when the block does not keep the shape.
  template <executor Exec>
  void build(Exec const& exec, shape const& in, std::uint64_t seed) {
    detail::require_layer_policy<Policy>();
    std::uint64_t const per_copy = 1000 * copies_.front().seed_slots();
    for (std::size_t i = 0; i < copies_.size(); ++i) {
      copies_[i].build(exec, in, seed + per_copy * i);
      if (!(copies_[i].output_shape() == in))
        detail::fail<shape_error>(name_, "the block turns a sample of shape " + in.to_string() + " into " +
                                             copies_[i].output_shape().to_string() +
                                             "; a repeated block feeds its output to the next copy, so it must "
                                             "keep the shape");
    }
    mark_built(in, in);
  }
  template <executor Exec>
  void reserve(Exec const& exec, std::int64_t batch) {
    for (auto& c : copies_) c.reserve(exec, batch);
    between_.resize(copies_.size() - 1);
    for (auto& g : between_) g.ensure(exec, detail::with_batch(batch, input_shape_));
    reserved_batch_ = batch;
  }

  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type, Space> y,
               bool training) {
    check_input_and_reserve(*this, exec, x.shape(), y.shape());
    tensor_view<input_type const, Space> h = x;
    for (auto& c : copies_) h = c.forward(exec, h, training);
    mpx::copy(exec, h, y);  // (the last copy's output stays its own: find_nonfinite shows it)
  }

  //! Copy i's input gradient is copy i-1's output gradient; copy 0's is dx (none when the
  //! repeat is the model's first layer: then only the parameter gradients).
  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<input_type const, Space>, tensor_view<output_type const, Space>,
                tensor_view<output_type const, Space> dy, tensor_view<input_type, Space> dx) {
    tensor_view<output_type const, Space> g = dy;
    for (std::size_t i = copies_.size() - 1; i > 0; --i) {
      auto const dh = between_[i - 1].template view<Space>(dy.shape());
      copies_[i].backward_to_input(exec, g, dh, input_gradient_use::kept);
      g = dh;
    }
    if (dx.size() == 0) copies_[0].backward(exec, g);
    else copies_[0].backward_to_input(exec, g, dx, input_gradient_use::kept);
  }

  //! Calls f(copy i, "<repeat>/<i>/") for each copy, in order (see model/composite.hpp).
  template <class F>
  void for_each_part(F&& f) {
    for (std::size_t i = 0; i < copies_.size(); ++i) f(copies_[i], name() + "/" + std::to_string(i) + "/");
  }
  template <class F>
  void for_each_part(F&& f) const {
    for (std::size_t i = 0; i < copies_.size(); ++i) f(copies_[i], name() + "/" + std::to_string(i) + "/");
  }

  //! f(copy i) for each copy, without making names.
  template <class F>
  void for_each_part_model(F&& f) {
    for (auto& c : copies_) f(c);
  }
  template <class F>
  void for_each_part_model(F&& f) const {
    for (auto const& c : copies_) f(c);
  }

  //! The same repeat, not built.
  [[nodiscard]] repeated_block unbuilt_copy() const {
    return repeated_block(static_cast<std::int64_t>(copies_.size()), copies_.front().unbuilt_copy());
  }

 private:
  std::vector<block_type> copies_;
  std::vector<detail::layer_tensor<input_type>> between_;  //!< dL/d(output of copy i), i < count - 1
};

//! What mpx::repeat(n, layers...) returns: the block's layers and the count, waiting for
//! the model to give them its policy.
template <class... Layers>
struct repeated_layers {
  std::int64_t count;
  std::tuple<Layers...> layers;

  //! The repeat under the model's policy P (each layer keeps its own policy, if it has one).
  template <class P>
  auto with_policy() && {
    return std::apply(
        [&](auto&&... l) {
          using block = sequential_model<typename detail::resolve_policy<Layers, P>::type...>;
          return repeated_block<P, typename detail::resolve_policy<Layers, P>::type...>(
              count, block(detail::with_model_policy<Layers, P>(std::move(l))...));
        },
        std::move(layers));
  }
};

//! `count` copies of the block of these layers, one after another, as one layer of
//! mpx::sequential<Policy> (count is read at run time: `--layers 12`).
template <class... Layers>
auto repeat(std::int64_t count, Layers&&... layers) {
  static_assert(sizeof...(Layers) > 0, "mpx::repeat needs at least one layer in its block");
  return repeated_layers<std::remove_cvref_t<Layers>...>{count, {std::forward<Layers>(layers)...}};
}

namespace detail {

template <class... Layers, class P>
struct resolve_policy<repeated_layers<Layers...>, P> {
  using type = repeated_block<P, typename resolve_policy<Layers, P>::type...>;
};

}  // namespace detail

}  // namespace mpx
