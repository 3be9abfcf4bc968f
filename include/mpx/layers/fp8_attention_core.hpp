// What causal_self_attention keeps to run its core (softmax(Q Kᵀ) V and its gradients)
// in fp8 (causal_self_attention_config::fp8_attention): six per-tensor scales, as
// Transformer Engine's fp8 dot-product attention keeps them (Q K V, the probabilities,
// O; dO, dS, dQ dK dV), the fp8 buffers between the projections and the core, and the
// step's end. The core itself is cuDNN's fp8 SDPA where the layer found one
// (<mpx/kernels/fused_attention.hpp>), else <mpx/kernels/fp8_attention.hpp>.
//
// The scales of Q K V and dO follow the policy's recipe (delayed, or current: from the
// tensor just before its cast). The other four are the kernel's own outputs, cast
// inside it, so their scales must be known before it runs: they are delayed under
// either recipe, from the amaxes the kernel records.
#pragma once

#include <mpx/core/checkpoint_file.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/attention.hpp>
#include <mpx/kernels/fp8_attention.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/matrix_products.hpp>
#include <mpx/scaling/fp8_scaling.hpp>

#include <array>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

namespace mpx::detail {

template <class Recipe>
class fp8_attention_core {
  static_assert(std::is_same_v<Recipe, delayed_scaling> || std::is_same_v<Recipe, current_scaling>,
                "the fp8 attention core scales per tensor (delayed or current scaling)");
  static constexpr bool current = std::is_same_v<Recipe, current_scaling>;

 public:
  //! The recipe of the four scales the kernel casts with: the policy's if delayed, else
  //! delayed with the policy's margin.
  static constexpr delayed_scaling kernel_recipe(Recipe const& r) {
    if constexpr (current) return delayed_scaling{fp8_max_history, r.margin};
    else return r;
  }

  template <executor Exec>
  void build(Exec const& exec, Recipe const& recipe) {
    recipe_ = recipe;
    qkv_.build(exec, recipe);
    d_o_.build(exec, recipe);
    s_.build(exec, kernel_recipe(recipe));
    o_.build(exec, kernel_recipe(recipe));
    dp_.build(exec, kernel_recipe(recipe));
    dqkv_.build(exec, kernel_recipe(recipe));
  }

  //! The fp8 buffers for a batch of these dimensions (from the layer's reserve).
  template <executor Exec>
  void reserve(Exec const& exec, attention_dims const& d) {
    std::int64_t const rows = d.rows(), w = d.width(), bh = d.batch * d.heads;
    qkv8_.ensure(exec, shape{rows, 3 * w});
    o8_.ensure(exec, shape{rows, w});
    d_o8_.ensure(exec, shape{rows, w});
    dqkv8_.ensure(exec, shape{rows, 3 * w});
    stats_.ensure(exec, shape{bh, d.tokens});
    delta_.ensure(exec, shape{bh, d.tokens});
    scalars_.ensure(exec, shape{fused_fp8_offset(fused_fp8_slot::count)});
  }

  //! Q K V cast to e4m3 (their amax recorded; under current scaling the scale set from
  //! it first): the core's input.
  template <executor Exec, class T, class Space>
  void cast_qkv(Exec const& exec, tensor_view<T const, Space> qkv) {
    cast_to_fp8(exec, qkv, qkv_.template state<Exec>(), qkv8_.template view<Space>(qkv.shape()), recipe_);
  }
  //! dO cast to e5m2, likewise.
  template <executor Exec, class T, class Space>
  void cast_d_o(Exec const& exec, tensor_view<T const, Space> d_o) {
    cast_to_fp8(exec, d_o, d_o_.template state<Exec>(), d_o8_.template view<Space>(d_o.shape()), recipe_);
  }

  //! The problem the core's kernels solve for these dimensions.
  template <executor Exec>
  [[nodiscard]] fp8_attention_problem problem(attention_dims const& d, float logit_scale,
                                              dropout_options const& dropout) const {
    using Space = memory_space_t<Exec>;
    return {d, qkv8_.template view<Space>().data(), stats_.template view<Space>().data(), scales<Exec>(), logit_scale,
            dropout};
  }
  template <executor Exec>
  [[nodiscard]] fp8_attention_scales scales() const {
    return {qkv_.template state<Exec>().data(), s_.template state<Exec>().data(), o_.template state<Exec>().data(),
            d_o_.template state<Exec>().data(), dp_.template state<Exec>().data(), dqkv_.template state<Exec>().data()};
  }

  //! The buffers, where the executor computes.
  template <class Space>
  [[nodiscard]] float8_e4m3* qkv8() const { return qkv8_.template view<Space>().data(); }
  template <class Space>
  [[nodiscard]] float8_e4m3* o8() const { return o8_.template view<Space>().data(); }
  template <class Space>
  [[nodiscard]] float8_e5m2* d_o8() const { return d_o8_.template view<Space>().data(); }
  template <class Space>
  [[nodiscard]] float8_e5m2* dqkv8() const { return dqkv8_.template view<Space>().data(); }
  template <class Space>
  [[nodiscard]] float* delta() const { return delta_.template view<Space>().data(); }
  template <class Space>
  [[nodiscard]] float* stats() const { return stats_.template view<Space>().data(); }
  [[nodiscard]] void const* gradient_buffer() const noexcept { return dqkv8_.address(); }

  //! The fused kernel's scalars (fused_fp8_slot), gathered from the states before each
  //! of its passes (gather_scalars) and its amaxes folded into them after (fold_amaxes).
  template <class Space>
  [[nodiscard]] float* scalars() const { return scalars_.template view<Space>().data(); }
  template <executor Exec>
  void gather_scalars(Exec const& exec) const {
    run_once(exec, gather_fused_fp8_scalars{scales<Exec>(), scalars<memory_space_t<Exec>>()});
  }
  template <executor Exec>
  void fold_amaxes(Exec const& exec) const {
    run_once(exec, fold_fused_fp8_amaxes{scales<Exec>(), scalars<memory_space_t<Exec>>()});
  }

  //! The step's end: each delayed scale takes this step's amax into its history (after
  //! the data-parallel max, where a trainer installed one).
  template <executor Exec>
  void end_step(Exec const& exec) {
    for_each_delayed<Exec>([&](auto& state, auto const& recipe) {
      if (amax_reduction_) amax_reduction_(reinterpret_cast<float*>(&state.data()->step_amax_bits));
      update_fp8_scale(exec, state, recipe);
    });
  }

  //! The six scales as one entry of the layer's fp8 scales, named `name`: saved and
  //! loaded as "<prefix>/qkv", "/probabilities", "/o", "/d_o", "/d_probabilities",
  //! "/d_qkv"; the delayed ones watched by the precision guard.
  template <executor Exec>
  void append_to(std::vector<fp8_scales_entry<Exec>>& out, std::string const& name) {
    out.push_back({name,
                   [this](Exec const& e, checkpoint_writer& w, std::string const& p) {
                     for_each_state<Exec>([&](auto& s, char const* n) { s.save(e, w, p + "/" + n); });
                   },
                   [this](Exec const& e, checkpoint_reader const& r, std::string const& p) {
                     for_each_state<Exec>([&](auto& s, char const* n) { s.load(e, r, p + "/" + n); });
                   },
                   [this](Exec const& e) -> std::function<void()> {
                     std::vector<std::function<void()>> restore;
                     for_each_state<Exec>([&](auto& s, char const*) {
                       restore.push_back([&e, state = &s, v = s.values(e)] { state->set_values(e, v); });
                     });
                     return [restore] {
                       for (auto const& r : restore) r();
                     };
                   },
                   [this](std::function<void(float*)> reduce) { amax_reduction_ = std::move(reduce); }});
    for_each_delayed<Exec>([&](auto& state, auto const&) {
      out.back().watched.push_back(
          {state.data(), cast<float>(dtype_traits<typename std::remove_cvref_t<decltype(state)>::format_type>::max())});
    });
  }

  //! The scale state of Q K V (e4m3) and of dQ dK dV (e5m2), for inspection and tests;
  //! the others through scales().
  template <executor Exec>
  [[nodiscard]] fp8_tensor_scale<float8_e4m3, Exec>& qkv_scale() const { return qkv_.template state<Exec>(); }
  template <executor Exec>
  [[nodiscard]] fp8_tensor_scale<float8_e5m2, Exec>& dqkv_scale() const { return dqkv_.template state<Exec>(); }

 private:
  template <executor Exec, class F>
  void for_each_state(F&& f) {
    f(qkv_.template state<Exec>(), "qkv");
    f(s_.template state<Exec>(), "probabilities");
    f(o_.template state<Exec>(), "o");
    f(d_o_.template state<Exec>(), "d_o");
    f(dp_.template state<Exec>(), "d_probabilities");
    f(dqkv_.template state<Exec>(), "d_qkv");
  }
  // Each delayed state with its recipe: all six under delayed scaling, the kernel's four
  // under current scaling (Q K V and dO set theirs as they cast).
  template <executor Exec, class F>
  void for_each_delayed(F&& f) {
    delayed_scaling const k = kernel_recipe(recipe_);
    if constexpr (!current) {
      f(qkv_.template state<Exec>(), k);
      f(d_o_.template state<Exec>(), k);
    }
    f(s_.template state<Exec>(), k);
    f(o_.template state<Exec>(), k);
    f(dp_.template state<Exec>(), k);
    f(dqkv_.template state<Exec>(), k);
  }

  Recipe recipe_{};
  fp8_operand<operand_role::activation> qkv_, s_, o_;    // e4m3 states (their cast buffers unused)
  fp8_operand<operand_role::gradient> d_o_, dp_, dqkv_;  // e5m2 states
  layer_tensor<float8_e4m3> qkv8_, o8_;
  layer_tensor<float8_e5m2> d_o8_, dqkv8_;
  layer_tensor<float> stats_, delta_, scalars_;
  std::function<void(float*)> amax_reduction_;  // set while a data-parallel trainer runs
};

}  // namespace mpx::detail
