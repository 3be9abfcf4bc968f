// The matrix products of a layer, in its policy's compute type. For a 16- or 32-bit
// compute type that is mpx::gemm<Policy>, which rounds the operands as it reads them.
// For an fp8 compute type (mpx::mixed_fp8) the layer keeps three per-tensor scales, as
// Transformer Engine's linear layers do: its activations and weights are cast to
// e4m3, its output gradients to e5m2, each with a delayed scale (amax history), and the
// products run in mpx::fp8_gemm with float sums. Both operands are cast into the
// K-contiguous layout cuBLASLt's fp8 kernels need, K padded with zeros to a multiple of
// 16, and the rest of the GPU's rules (N a multiple of 16) checked on every executor:
// the host runs the same calls and refuses what the GPU would.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/checkpoint_file.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/fp8_block_gemm.hpp>
#include <mpx/kernels/fp8_block_quantize.hpp>
#include <mpx/kernels/dropout.hpp>
#include <mpx/kernels/fp8_gemm.hpp>
#include <mpx/kernels/gemm.hpp>
#include <mpx/kernels/nvfp4_quantize.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/scaling/fp8_block_scaling.hpp>
#include <mpx/scaling/fp8_scaling.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace mpx {

//! What an operand of a layer's product is, which decides its fp8 format and scale.
enum class operand_role { activation, weight, gradient };

//! The fp8 format of a role under the hybrid recipe: e4m3 forward, e5m2 gradients.
template <operand_role R>
using fp8_format_of = std::conditional_t<R == operand_role::gradient, float8_e5m2, float8_e4m3>;

//! The fp8 recipe of a policy's layers: per-tensor delayed scaling by default
//! (Transformer Engine's default: a 1024-step amax history, no margin), current_scaling
//! (per tensor, from the tensor itself) for mpx::mixed_fp8_current, block_scaling
//! for mpx::mixed_fp8_block, rowwise_scaling for mpx::mixed_fp8_rowwise, mxfp8_scaling
//! for mpx::mixed_mxfp8, nvfp4_scaling for mpx::mixed_nvfp4. Specialise it for a policy
//! of your own (any of the recipe types, with the options you choose).
template <class Policy>
inline constexpr auto fp8_recipe_for = delayed_scaling{};
template <>
inline constexpr auto fp8_recipe_for<mixed_fp8_block> = block_scaling{};
template <>
inline constexpr auto fp8_recipe_for<mixed_fp8_rowwise> = rowwise_scaling{};
template <>
inline constexpr auto fp8_recipe_for<mixed_mxfp8> = mxfp8_scaling{};
template <>
inline constexpr auto fp8_recipe_for<mixed_fp8_current> = current_scaling{};
template <>
inline constexpr auto fp8_recipe_for<mixed_nvfp4> = nvfp4_scaling{};

//! A layer's fp8 scales as save_training_state sees them: saved and loaded under a
//! prefix, and snapshot() returns what puts the current values back (a load that fails
//! later must leave the model as it was).
//! One delayed fp8 scale as the precision guard watches it: its state (where the
//! executor computes) and its format's largest finite value. A step saturated it when the
//! amax it recorded times the scale it was cast with passed that value.
struct fp8_watched_scale {
  fp8_scale_values const* state = nullptr;
  float format_max = 0;
};

template <executor Exec>
struct fp8_scales_entry {
  std::string name;
  std::function<void(Exec const&, detail::checkpoint_writer&, std::string const&)> save;
  std::function<void(Exec const&, detail::checkpoint_reader const&, std::string const&)> load;
  std::function<std::function<void()>(Exec const&)> snapshot;
  //! Installs (or, given an empty function, removes) the max-reduction of each amax over
  //! data-parallel replicas that end_step runs before the updates.
  std::function<void(std::function<void(float*)>)> set_amax_reduction;
  //! The delayed scales (current scaling, which cannot saturate, has none of its own).
  std::vector<fp8_watched_scale> watched{};
};

namespace detail {

//! The largest matrix a role's operand will be, [rows, cols] as the layer holds it
//! (either orientation is cast from it).
struct operand_extent {
  std::int64_t rows = 0, cols = 0;
};

//! One role's scale state and cast buffer, in whichever space the layer was built for.
template <operand_role R>
class fp8_operand {
 public:
  using format = fp8_format_of<R>;

  template <executor Exec, class Recipe>
  void build(Exec const& exec, Recipe const& recipe) {
    auto made = std::make_unique<fp8_tensor_scale<format, Exec>>(exec, recipe);
    on_device_ = !is_host_executor_v<Exec>;
    state_ = std::unique_ptr<void, void (*)(void*)>(
        made.release(), [](void* p) { delete static_cast<fp8_tensor_scale<format, Exec>*>(p); });
  }
  [[nodiscard]] bool built() const noexcept { return state_ != nullptr; }

  template <executor Exec>
  [[nodiscard]] fp8_tensor_scale<format, Exec>& state() const {
    if (!state_)
      fail<invalid_argument>("mpx layer", "its fp8 scales are used before it was built (build the layer first)");
    if (on_device_ == is_host_executor_v<Exec>)
      fail<invalid_argument>("mpx layer", std::string("its fp8 scales were made for the ") +
                                              (on_device_ ? "cuda" : "host") + " executor and used with another");
    return *static_cast<fp8_tensor_scale<format, Exec>*>(state_.get());
  }

  //! Makes the cast buffer hold any operand up to `largest` (either orientation, K
  //! padded). Runs where the layer's reserve runs, on the caller's executor, never
  //! inside a step: the buffer then lives as long as the layer, and only reserve moves it
  //! (which the model's buffer_generation counts).
  template <executor Exec>
  void reserve(Exec const& exec, operand_extent largest) {
    std::int64_t const r = largest.rows, c = largest.cols;
    std::int64_t const n = std::max(r * fp8_gemm_padded_extent(c), c * fp8_gemm_padded_extent(r));
    buffer_.ensure(exec, shape{n > 0 ? n : 1});
  }

  //! x (a matrix) cast to the role's format as [rows, Kp] with K contiguous: x itself
  //! when k_contiguous, else its transpose, K padded with zeros to a multiple of 16.
  //! Delayed scaling: cast with the scale from the history, the amax entering this
  //! step's record. Current scaling: the scale from x's amax first (one more pass).
  //! Allocates nothing: a larger operand than reserve made room for is an
  //! mpx::shape_error.
  template <executor Exec, class T, class Space, class Recipe>
  tensor_view<format const, Space> cast(Exec const& exec, tensor_view<T const, Space> x, bool k_contiguous,
                                        Recipe const& recipe) {
    auto& s = state<Exec>();
    if constexpr (std::is_same_v<Recipe, current_scaling>) detail::fp8_current_scale_from(exec, x.data(), x.size(), s, recipe);
    std::int64_t const rows = x.shape()[0], cols = x.shape()[1];
    shape const out =
        k_contiguous ? shape{rows, fp8_gemm_padded_extent(cols)} : shape{cols, fp8_gemm_padded_extent(rows)};
    auto const o = buffer_.template view<Space>(out);
    if (k_contiguous) cast_to_fp8_padded(exec, x, s, o);
    else cast_to_fp8_transposed_padded(exec, x, s, o);
    return o;
  }

  //! Where the cast buffer is (nullptr before reserve), for tests.
  [[nodiscard]] void const* buffer_data() const noexcept { return buffer_.address(); }

 private:
  std::unique_ptr<void, void (*)(void*)> state_{nullptr, [](void*) {}};
  layer_tensor<format> buffer_;
  bool on_device_ = false;
};

//! One role's block-quantized operand under block recipe Recipe: its values and its
//! blocks' inverse scales, in buffers reserve() sizes for either orientation of the
//! largest operand. Nothing is kept from step to step: each block's scale comes from the
//! block.
template <operand_role R, class Recipe>
class fp8_block_role {
 public:
  static constexpr fp8_block_kind kind = [] {
    if constexpr (std::is_same_v<Recipe, rowwise_scaling>) return fp8_block_kind::row;
    else if constexpr (std::is_same_v<Recipe, mxfp8_scaling>) return fp8_block_kind::vec32;
    else return R == operand_role::weight ? fp8_block_kind::tile128 : fp8_block_kind::vec128;
  }();
  using scale_type = std::conditional_t<kind == fp8_block_kind::vec32, float8_e8m0, float>;

  template <executor Exec>
  void reserve(Exec const& exec, operand_extent largest) {
    fp8_block_scale_layout const as_is{kind, largest.rows, largest.cols}, turned{kind, largest.cols, largest.rows};
    std::int64_t const n = std::max(as_is.outer * as_is.padded_k(), turned.outer * turned.padded_k());
    std::int64_t const scales = std::max(as_is.count(), turned.count());
    values_.ensure(exec, shape{n > 0 ? n : 1});
    scales_.ensure(exec, shape{scales > 0 ? scales : 1});
  }

  //! x (a matrix) quantized as the operand [outer, K] (x itself when k_contiguous, else
  //! its transpose). Allocates nothing: an operand larger than reserve made room for is
  //! an mpx::shape_error. (Whether the product is a weight gradient matters to NVFP4 only.)
  template <executor Exec, class T, class Space>
  fp8_block_operand<float8_e4m3, Space, scale_type> quantize(Exec const& exec, tensor_view<T const, Space> x,
                                                             bool k_contiguous, Recipe const& recipe,
                                                             bool /*weight_gradient*/) {
    std::int64_t const rows = x.shape()[0], cols = x.shape()[1];
    fp8_block_scale_layout const layout{kind, k_contiguous ? rows : cols, k_contiguous ? cols : rows};
    auto const v = values_.template view<Space>(shape{layout.outer, layout.padded_k()});
    auto const sc = scales_.template view<Space>(shape{layout.count()});
    quantize_fp8_blocks<float8_e4m3>(exec, x, k_contiguous, kind, recipe.power_of_two_scales, v, sc);
    return {v, sc, layout};
  }

  [[nodiscard]] void const* buffer_data() const noexcept { return values_.address(); }

 private:
  layer_tensor<float8_e4m3> values_;
  layer_tensor<scale_type> scales_;
};

//! One role's NVFP4 operand: its e2m1 pairs, block scales and tensor scale, in buffers
//! reserve() sizes; for the gradient role under stochastic rounding, the count of draws
//! so far (training state, where the executor computes) and the seed they are keyed by.
template <operand_role R>
class fp8_block_role<R, nvfp4_scaling> {
 public:
  static constexpr fp8_block_kind kind = fp8_block_kind::vec16;

  //! Makes the draw count (0) and keeps the seed: from the layer's build.
  template <executor Exec>
  void build(Exec const& exec, std::uint64_t seed) {
    if constexpr (R == operand_role::gradient) {
      seed_ = seed;
      draws_.allocate(exec, shape{1});
      fill(exec, draws_.template view<memory_space_t<Exec>>(), std::uint64_t{0});
    }
  }

  template <executor Exec>
  void reserve(Exec const& exec, operand_extent largest) {
    fp8_block_scale_layout const as_is{kind, largest.rows, largest.cols}, turned{kind, largest.cols, largest.rows};
    std::int64_t const n = std::max(as_is.outer * as_is.padded_k(), turned.outer * turned.padded_k()) / 2;
    std::int64_t const scales = std::max(as_is.count(), turned.count());
    values_.ensure(exec, shape{n > 0 ? n : 1});
    scales_.ensure(exec, shape{scales > 0 ? scales : 1});
    tensor_scale_.ensure(exec, shape{nvfp4_tensor_scale_slots});
  }

  //! x quantized to NVFP4 as the operand [outer, K]: weights in 16x16 blocks, gradients
  //! rounded stochastically (one draw of the count each), a weight gradient's inputs
  //! transformed, as the recipe asks.
  template <executor Exec, class T, class Space>
  nvfp4_operand<Space> quantize(Exec const& exec, tensor_view<T const, Space> x, bool k_contiguous,
                                nvfp4_scaling const& recipe, bool weight_gradient) {
    std::int64_t const rows = x.shape()[0], cols = x.shape()[1];
    fp8_block_scale_layout const layout{kind, k_contiguous ? rows : cols, k_contiguous ? cols : rows};
    auto const v = values_.template view<Space>(shape{layout.outer, layout.padded_k() / 2});
    auto const sc = scales_.template view<Space>(shape{layout.count()});
    auto const ts = tensor_scale_.template view<Space>(shape{nvfp4_tensor_scale_slots});
    nvfp4_quantize_options o;
    o.square_blocks = R == operand_role::weight && recipe.square_weight_blocks;
    o.hadamard = weight_gradient && recipe.hadamard_weight_gradients;
    if (R == operand_role::gradient && recipe.stochastic_gradients) {
      o.draw = draws_.template view<Space>().data();
      o.seed = seed_;
    }
    quantize_nvfp4(exec, x, k_contiguous, o, v, sc, ts);
    if (o.draw != nullptr) run_once(exec, increment_count{draws_.template view<Space>().data()});
    return {v, sc, layout, ts};
  }

  [[nodiscard]] void const* buffer_data() const noexcept { return values_.address(); }

  //! The draw count and seed of stochastic rounding, as training state.
  template <memory_space Space>
  void append_counters(std::vector<std::pair<std::string, tensor_view<std::uint64_t, Space>>>& out,
                       std::string const& name) {
    if (draws_.allocated()) out.emplace_back(name + "/nvfp4_gradient_draws", draws_.template view<Space>());
  }
  void append_seeds(std::vector<std::pair<std::string, std::uint64_t*>>& out, std::string const& name) {
    if (draws_.allocated()) out.emplace_back(name + "/nvfp4_gradient_seed", &seed_);
  }

 private:
  layer_tensor<float4_e2m1x2> values_;
  layer_tensor<float8_e4m3> scales_;
  layer_tensor<float> tensor_scale_;
  layer_tensor<std::uint64_t> draws_;
  std::uint64_t seed_ = 0;
};

//! Every fp8 scale a model's layers keep (dense, conv2d, attention's projections), by name.
template <class Exec, class Model>
std::vector<fp8_scales_entry<Exec>> model_fp8_scales(Model& model) {
  std::vector<fp8_scales_entry<Exec>> out;
  model.for_each_layer([&](auto& layer) {
    if constexpr (requires { layer.template append_fp8_scales<Exec>(out); }) layer.template append_fp8_scales<Exec>(out);
  });
  return out;
}

}  // namespace detail

//! A layer's matrix products under Policy (see the top of this file). Under an fp8
//! policy, build() makes the scales, reserve() the cast buffers (from the layer's own
//! reserve: run() allocates nothing), and end_step() (at the end of the layer's
//! backward pass) moves each scale to its amax history; otherwise all do nothing.
template <class Policy>
class matrix_products {
 public:
  static constexpr bool fp8 = computes_in_fp8<Policy>;
  using recipe_type = std::remove_cvref_t<decltype(fp8_recipe_for<Policy>)>;
  //! Under a block recipe each product quantizes its operands block by block and keeps
  //! no scale state; under per-tensor scaling each role keeps a delayed scale.
  static constexpr bool block_scaled = fp8 && is_block_recipe_v<recipe_type>;
  static constexpr bool tensorwise = fp8 && !block_scaled;
  //! NVFP4: block-scaled, and the gradient role keeps a draw count for stochastic rounding.
  static constexpr bool nvfp4 = block_scaled && std::is_same_v<recipe_type, nvfp4_scaling>;
  //! Per-tensor scales kept as an amax history and moved at the end of each step.
  static constexpr bool delayed = tensorwise && std::is_same_v<recipe_type, delayed_scaling>;

  //! Under fp8, N (a product's output columns) must be a multiple of 16 in every product,
  //! the GPU's rule (check_fp8_gemm_layout) held on every executor. A layer checks its
  //! own N where it knows them, naming itself: its units or filters when it is built,
  //! its input width before an input gradient's product. `what` says what N is.
  static void require_fp8_width(std::string_view layer, std::string_view what, std::int64_t n) {
    if constexpr (fp8) {
      if (n % fp8_gemm_multiple != 0)
        detail::fail<invalid_argument>(
            layer, "under " + std::string(Policy::name) +
                       " N must be a multiple of 16 in every fp8 product (cuBLASLt's fp8 kernels tile N by 16, as "
                       "PyTorch's _scaled_mm requires); N is this layer's " + std::string(what) + ", got N = " +
                       std::to_string(n) + ". Make it a multiple of 16, or give this layer mpx::without_fp8<Policy>");
    }
  }

  template <executor Exec>
  void build([[maybe_unused]] Exec const& exec, [[maybe_unused]] std::uint64_t seed = 0) {
    if constexpr (nvfp4) gradient_.build(exec, seed);
    if constexpr (tensorwise) {
      constexpr recipe_type recipe = fp8_recipe_for<Policy>;
      activation_.build(exec, recipe);
      weight_.build(exec, recipe);
      gradient_.build(exec, recipe);
    }
  }

  //! Makes room for the fp8 casts of operands up to these extents (the layer's reserve
  //! calls it with its batch's; nothing outside fp8). The casts in run() allocate
  //! nothing, so a step that follows a reserve moves no buffer.
  template <executor Exec>
  void reserve([[maybe_unused]] Exec const& exec, [[maybe_unused]] detail::operand_extent activation,
               [[maybe_unused]] detail::operand_extent weight, [[maybe_unused]] detail::operand_extent gradient) {
    if constexpr (block_scaled) {
      activation_.reserve(exec, activation);
      weight_.reserve(exec, weight);
      gradient_.reserve(exec, gradient);
    } else if constexpr (fp8) {
      activation_.reserve(exec, activation);
      weight_.reserve(exec, weight);
      gradient_.reserve(exec, gradient);
    }
  }

  //! c = alpha * op(a) op(b) + beta * c, a of role RA and b of role RB, matrices only.
  //! Under fp8 the GPU's rules hold on every executor: K is padded with zeros, and N (c's
  //! columns) must be a multiple of 16, else mpx::invalid_argument before anything runs.
  template <operand_role RA, operand_role RB, executor Exec, tensor_like A, tensor_like B, tensor_like C>
  void run(Exec const& exec, A&& a_in, B&& b_in, C&& c, gemm_options const& o = {},
           mpx::source_location loc = mpx::source_location::current()) {
    if constexpr (!fp8) {
      gemm<Policy>(exec, a_in, b_in, c, o, loc);
    } else {
      static_assert(RA != RB, "an fp8 product reads two different roles");
      tensor_view<value_t<A> const, space_t<A>> const a = mpx::view(a_in);
      tensor_view<value_t<B> const, space_t<B>> const b = mpx::view(b_in);
      if (a.shape().rank() != 2 || b.shape().rank() != 2)
        detail::fail<shape_error>("fp8 layer product", "expects matrices, got " + a.shape().to_string() + " and " +
                                                           b.shape().to_string(),
                                  loc);
      // The fp8 products' layout: A as [M, K] and B as [N, K], both K-contiguous, K
      // padded. The GPU's rules are checked here on every executor, before any cast
      // records an amax or quantizes: a host run refuses the shapes a GPU would.
      detail::gemm_dims d = detail::gemm_shapes(a.shape(), b.shape(), mpx::view(c).shape(), o, loc);
      d.k = fp8_gemm_padded_extent(d.k);
      detail::check_fp8_gemm_layout(d, gemm_options{.transpose_a = false, .transpose_b = true}, loc);
      if constexpr (block_scaled) {
        constexpr recipe_type recipe = fp8_recipe_for<Policy>;
        // The weight gradient's product reads the activations and the gradients.
        constexpr bool weight_gradient = RA != operand_role::weight && RB != operand_role::weight;
        auto const a8 = operand<RA>().quantize(exec, a, !o.transpose_a, recipe, weight_gradient);
        auto const b8 = operand<RB>().quantize(exec, b, o.transpose_b, recipe, weight_gradient);
        fp8_block_gemm(exec, a8, b8, c, o.alpha, o.beta, loc);
      } else {
        constexpr recipe_type recipe = fp8_recipe_for<Policy>;
        auto const a8 = operand<RA>().cast(exec, a, !o.transpose_a, recipe);
        auto const b8 = operand<RB>().cast(exec, b, o.transpose_b, recipe);
        fp8_gemm(exec, a8, operand<RA>().template state<Exec>().inverse_scale_data(), b8,
                 operand<RB>().template state<Exec>().inverse_scale_data(), c,
                 gemm_options{.transpose_a = false, .transpose_b = true, .alpha = o.alpha, .beta = o.beta}, loc);
      }
    }
  }

  //! Ends the step's fp8 bookkeeping: under delayed scaling every scale takes this
  //! step's amax into its history and is recomputed from it (asynchronous, no host
  //! sync); current scaling set each scale as it cast.
  template <executor Exec>
  void end_step([[maybe_unused]] Exec const& exec) {
    if constexpr (delayed) {
      if (amax_reduction_) {  // data-parallel: every replica updates from the global amax
        // The step amax is a float's bit pattern (see fp8_scale_values): a float max,
        // NaN kept, is the same order.
        amax_reduction_(reinterpret_cast<float*>(&activation_.template state<Exec>().data()->step_amax_bits));
        amax_reduction_(reinterpret_cast<float*>(&weight_.template state<Exec>().data()->step_amax_bits));
        amax_reduction_(reinterpret_cast<float*>(&gradient_.template state<Exec>().data()->step_amax_bits));
      }
      constexpr delayed_scaling recipe = fp8_recipe_for<Policy>;
      update_fp8_scale(exec, activation_.template state<Exec>(), recipe);
      update_fp8_scale(exec, weight_.template state<Exec>(), recipe);
      update_fp8_scale(exec, gradient_.template state<Exec>(), recipe);
    }
  }

  //! The scale states as checkpoint sections "<prefix>/activation", ".../weight",
  //! ".../gradient" (nothing outside fp8). Synchronises.
  template <executor Exec>
  void save([[maybe_unused]] Exec const& exec, [[maybe_unused]] detail::checkpoint_writer& out,
            [[maybe_unused]] std::string const& prefix) const {
    if constexpr (tensorwise) {
      activation_.template state<Exec>().save(exec, out, prefix + "/activation");
      weight_.template state<Exec>().save(exec, out, prefix + "/weight");
      gradient_.template state<Exec>().save(exec, out, prefix + "/gradient");
    }
  }
  template <executor Exec>
  void load([[maybe_unused]] Exec const& exec, [[maybe_unused]] detail::checkpoint_reader const& in,
            [[maybe_unused]] std::string const& prefix) {
    if constexpr (tensorwise) {
      activation_.template state<Exec>().load(exec, in, prefix + "/activation");
      weight_.template state<Exec>().load(exec, in, prefix + "/weight");
      gradient_.template state<Exec>().load(exec, in, prefix + "/gradient");
    }
  }

  template <class State>
  static fp8_watched_scale watched_scale(State const& state) {
    return {state.data(), cast<float>(dtype_traits<typename State::format_type>::max())};
  }

  //! Adds this layer's scales, named `name`, to what save_training_state keeps (fp8
  //! policies only; nothing otherwise).
  template <executor Exec>
  void append_to([[maybe_unused]] std::vector<fp8_scales_entry<Exec>>& out, [[maybe_unused]] std::string const& name) {
    if constexpr (tensorwise) {
      out.push_back({name, [this](Exec const& e, detail::checkpoint_writer& w, std::string const& p) { save(e, w, p); },
                     [this](Exec const& e, detail::checkpoint_reader const& r, std::string const& p) { load(e, r, p); },
                     [this](Exec const& e) -> std::function<void()> {
                       auto* a = &activation_.template state<Exec>();
                       auto* w = &weight_.template state<Exec>();
                       auto* g = &gradient_.template state<Exec>();
                       return [&e, a, w, g, va = a->values(e), vw = w->values(e), vg = g->values(e)] {
                         a->set_values(e, va);
                         w->set_values(e, vw);
                         g->set_values(e, vg);
                       };
                     },
                     [this](std::function<void(float*)> reduce) { amax_reduction_ = std::move(reduce); }});
      if constexpr (delayed)
        out.back().watched = {watched_scale(activation_.template state<Exec>()),
                              watched_scale(weight_.template state<Exec>()),
                              watched_scale(gradient_.template state<Exec>())};
    }
  }

  //! NVFP4's stochastic-rounding draw count and seed, named under the layer's name, as
  //! training state (nothing under other policies).
  template <memory_space Space>
  void append_counters([[maybe_unused]] std::vector<std::pair<std::string, tensor_view<std::uint64_t, Space>>>& out,
                       [[maybe_unused]] std::string const& name) {
    if constexpr (nvfp4) gradient_.template append_counters<Space>(out, name);
  }
  void append_seeds([[maybe_unused]] std::vector<std::pair<std::string, std::uint64_t*>>& out,
                    [[maybe_unused]] std::string const& name) {
    if constexpr (nvfp4) gradient_.append_seeds(out, name);
  }

  //! Where a role's cast buffer is (nullptr before reserve), for tests that no step
  //! moves it (fp8 policies only).
  template <operand_role R>
  [[nodiscard]] void const* cast_buffer() const
    requires fp8
  {
    return const_cast<matrix_products*>(this)->template operand<R>().buffer_data();
  }

  //! The scale state of a role, for inspection and tests (fp8 policies only).
  template <operand_role R, executor Exec>
  [[nodiscard]] auto& scale(Exec const&) const
    requires tensorwise
  {
    return const_cast<matrix_products*>(this)->template operand<R>().template state<Exec>();
  }

 private:
  struct none {};
  template <operand_role R>
  using role_state = std::conditional_t<block_scaled, detail::fp8_block_role<R, recipe_type>,
                                        std::conditional_t<fp8, detail::fp8_operand<R>, none>>;
  template <operand_role R>
  role_state<R>& operand() {
    if constexpr (R == operand_role::activation) return activation_;
    else if constexpr (R == operand_role::weight) return weight_;
    else return gradient_;
  }

  std::function<void(float*)> amax_reduction_;  // set while a data-parallel trainer runs
  [[no_unique_address]] role_state<operand_role::activation> activation_;
  [[no_unique_address]] role_state<operand_role::weight> weight_;
  [[no_unique_address]] role_state<operand_role::gradient> gradient_;
};

//! What a layer with matrix products exposes: its products (their fp8 scales, for
//! inspection and tests). dense and conv2d derive from it.
template <class Policy>
class with_matrix_products {
 public:
  [[nodiscard]] matrix_products<Policy>& products() noexcept { return products_; }
  [[nodiscard]] matrix_products<Policy> const& products() const noexcept { return products_; }

 protected:
  matrix_products<Policy> products_;
};

}  // namespace mpx
