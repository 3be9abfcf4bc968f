// Per-tensor fp8 scaling as Transformer Engine does it: each tensor cast to fp8 keeps a
// scale, its inverse and a history of its absolute maxima where the executor computes,
// so a CUDA step casts, records and updates without waiting for the host. Two recipes:
// delayed scaling (cast with the scale of past steps, record this step's amax in the
// same pass) and current scaling (amax of this tensor first, then the cast).
// cast_to_fp8_transposed casts and transposes in one pass, for the K-contiguous operands
// that mpx::fp8_gemm needs on the GPU. The passes themselves are kernels/fp8_cast.hpp.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/checkpoint_file.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/resident.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/fp8_cast.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace mpx {

//! Transformer Engine's default recipe: a tensor is cast with the scale computed from
//! the amax history before this step, and its amax is recorded in the same pass; after
//! the step, update_fp8_scale sets scale = max(Format) / (max(history) * 2^margin).
struct delayed_scaling {
  std::uint32_t history_length = fp8_max_history;  //!< steps remembered, 1 to fp8_max_history
  int margin = 0;                                   //!< extra headroom, in powers of two (0 to 64)
};

//! Just-in-time scaling: cast_to_fp8 finds the tensor's amax first, sets the scale
//! from it, then casts (two passes over the input; no history).
struct current_scaling {
  int margin = 0;  //!< extra headroom, in powers of two (0 to 64)
};

//! The scaling state of one tensor cast to Format (float8_e4m3 or float8_e5m2), kept in
//! Exec's memory. Move-only (it owns its memory).
template <dtype8 Format, executor Exec>
class fp8_tensor_scale {
 public:
  using format_type = Format;
  using space = memory_space_t<Exec>;

  //! A state with `initial_scale` (positive, finite) and an empty history of
  //! recipe.history_length steps; throws mpx::invalid_argument otherwise.
  fp8_tensor_scale(Exec const& exec, delayed_scaling const& recipe = {}, float initial_scale = 1.0f)
      : values_(exec, initial_values(recipe.history_length, initial_scale)),
        history_length_(recipe.history_length) {}
  //! A state for current scaling (no history is kept; its length is 1).
  fp8_tensor_scale(Exec const& exec, current_scaling const&, float initial_scale = 1.0f)
      : values_(exec, initial_values(1, initial_scale)) {}

  //! Where kernels find the state; scale_data() and inverse_scale_data() for consumers
  //! that scale or dequantise on the device (dequantised value = fp8 value * inverse).
  [[nodiscard]] fp8_scale_values* data() const noexcept { return values_.get(); }
  [[nodiscard]] float const* scale_data() const noexcept { return &values_.get()->scale; }
  [[nodiscard]] float const* inverse_scale_data() const noexcept { return &values_.get()->inverse_scale; }
  //! Steps of amax history (fixed when the state is made; 1 for current scaling).
  [[nodiscard]] std::uint32_t history_length() const noexcept { return history_length_; }

  //! The whole state. Synchronises a cuda_executor.
  [[nodiscard]] fp8_scale_values values(Exec const& exec) const { return values_.read(exec); }
  //! Replaces the state, in stream order, after checking it (see impossible(); the
  //! history length must be this state's); throws mpx::invalid_argument.
  void set_values(Exec const& exec, fp8_scale_values const& v) {
    std::string why = impossible(v);
    if (why.empty() && v.history_length != history_length_)
      why = "its history length " + std::to_string(v.history_length) + " is not this state's " +
            std::to_string(history_length_);
    if (!why.empty()) detail::fail<invalid_argument>("fp8_tensor_scale", "refusing the state: " + why);
    values_.write(exec, v);
  }

  //! Adds this state to a checkpoint as sections "<name>/format" and "<name>/state"
  //! (save it with the optimizer's state). Synchronises.
  void save(Exec const& exec, detail::checkpoint_writer& out, std::string const& name) const {
    out.add(name + "/format", detail::text_bytes(dtype_traits<Format>::name));
    out.add_value(name + "/state", values(exec));
  }
  //! Restores a state saved by save() under `name`. Refuses, with mpx::checkpoint_error
  //! and before changing anything, another format, another history length, and a state
  //! no update could have made (see impossible()).
  void load(Exec const& exec, detail::checkpoint_reader const& in, std::string const& name) {
    std::string const saved = in.text(name + "/format");
    if (saved != dtype_traits<Format>::name)
      in.refuse("its fp8 scale '" + name + "' is for " + saved + ", this one for " +
                std::string(dtype_traits<Format>::name) + "; nothing was loaded");
    auto const v = in.value<fp8_scale_values>(name + "/state");
    std::uint32_t const length = history_length_;
    if (v.history_length != length)
      in.refuse("its fp8 scale '" + name + "' has a history of " + std::to_string(v.history_length) +
                " steps, this one of " + std::to_string(length) + "; nothing was loaded");
    if (std::string const why = impossible(v); !why.empty())
      in.refuse("its fp8 scale '" + name + "' is impossible: " + why + "; the file is corrupt, nothing was loaded");
    values_.write(exec, v);
  }

  //! Empty when v is a state mpx's updates can produce, else why not.
  [[nodiscard]] static std::string impossible(fp8_scale_values const& v) {
    if (!(v.scale > 0.0f) || !is_finite(v.scale))
      return "the scale " + detail::to_text(v.scale) + " is not positive and finite";
    if (detail::bit_cast<std::uint32_t>(v.inverse_scale) != detail::bit_cast<std::uint32_t>(1.0f / v.scale))
      return "the inverse scale " + detail::to_text(v.inverse_scale) + " is not 1 / " + detail::to_text(v.scale);
    if (v.history_length < 1 || v.history_length > fp8_max_history)
      return "the history length " + std::to_string(v.history_length) + " is not in [1, " +
             std::to_string(fp8_max_history) + "]";
    if (v.position >= v.history_length)
      return "the history position " + std::to_string(v.position) + " is past its length " +
             std::to_string(v.history_length);
    if (v.nonfinite_steps > v.steps) return "more non-finite steps than steps";
    for (std::uint32_t i = 0; i < fp8_max_history; ++i) {
      float const h = v.history[i];
      if (i >= v.history_length ? h != 0.0f || detail::sign_bit(h) : h < 0.0f || detail::sign_bit(h))
        return "history slot " + std::to_string(i) + " holds " + detail::to_text(h);
    }
    float const step_amax = detail::bit_cast<float>(v.step_amax_bits);
    if (detail::sign_bit(step_amax) || detail::sign_bit(v.last_amax) || v.last_amax < 0.0f)
      return "an amax is negative";
    return {};
  }

 private:
  static fp8_scale_values initial_values(std::uint32_t history_length, float initial_scale) {
    if (history_length < 1 || history_length > fp8_max_history)
      detail::fail<invalid_argument>("fp8_tensor_scale", "history_length must be in [1, " +
                                                             std::to_string(fp8_max_history) + "], got " +
                                                             std::to_string(history_length));
    if (!(initial_scale > 0.0f) || !is_finite(initial_scale))
      detail::fail<invalid_argument>("fp8_tensor_scale", "the initial scale must be positive and finite, got " +
                                                             detail::to_text(initial_scale));
    fp8_scale_values v;
    v.scale = initial_scale;
    v.inverse_scale = 1.0f / initial_scale;
    v.history_length = history_length;
    return v;
  }

  resident<fp8_scale_values, space> values_;
  std::uint32_t history_length_ = 1;
};

namespace detail {
//! 2^-margin, the factor the recipes apply; refuses margins outside [0, 64].
inline float fp8_margin_factor(int margin) {
  if (margin < 0 || margin > 64)
    fail<invalid_argument>("fp8 scaling", "margin must be in [0, 64], got " + std::to_string(margin));
  return std::ldexp(1.0f, -margin);
}

//! The compile-time checks of cast_to_fp8 and cast_to_fp8_transposed.
template <class Exec, class X, class Out, class Format>
constexpr void check_fp8_cast_types() {
  using In = typename X::value_type;
  static_assert(std::is_same_v<In, half> || std::is_same_v<In, bfloat16> || std::is_same_v<In, float>,
                "mpx::cast_to_fp8 reads half, bfloat16 or float tensors");
  static_assert(std::is_same_v<typename Out::value_type, Format>,
                "mpx::cast_to_fp8 writes the fp8 format of its scale (an fp8_tensor_scale<float8_e4m3, ...> "
                "scales a float8_e4m3 tensor)");
  require_access<Exec, typename X::space_type, typename Out::space_type>();
}

//! The checks cast_to_fp8 shares between its recipes.
template <class Exec, class X, class Out, class Format>
void check_fp8_cast(X const& x, Out const& out) {
  check_fp8_cast_types<Exec, X, Out, Format>();
  if (x.shape() != out.shape())
    fail<shape_error>("mpx::cast_to_fp8",
                      "x has shape " + x.shape().to_string() + ", out has shape " + out.shape().to_string());
  require_disjoint("mpx::cast_to_fp8", "x", x, "out", out);
}

//! Current scaling's update from the step amax recorded so far.
template <class Exec, class Format>
void fp8_current_update_on(Exec const& exec, fp8_tensor_scale<Format, Exec>& state, float factor) {
  fp8_current_update_pass<Format>(exec, state.data(), factor);
}

//! Current scaling's first half for a tensor of n elements at x: the state's scale from
//! x's amax alone (whatever an earlier cast recorded is forgotten first), for a cast
//! that follows (any layout: padded, transposed). A zero or non-finite amax keeps the
//! previous scale, as cast_to_fp8 with current_scaling does.
template <class Exec, class In, class Format>
void fp8_current_scale_from(Exec const& exec, In const* x, std::size_t n, fp8_tensor_scale<Format, Exec>& state,
                            current_scaling const& recipe) {
  run_once(exec, fp8_clear_step_amax_once{state.data()});
  fp8_pass<fp8_cast_pass::record_only>(exec, x, static_cast<Format*>(nullptr), n, state.data());
  fp8_current_update_on(exec, state, fp8_margin_factor(recipe.margin));
}
}  // namespace detail

//! out = saturate_cast<Format>(float(x) * scale) for every element, and |x|'s maximum
//! folded into this step's amax, in one pass (delayed scaling; several casts in a step
//! fold into one amax). Saturating as Transformer Engine does: a value beyond the
//! format, inf included, becomes ±max; NaN stays NaN, and a NaN or inf in x makes the
//! step's amax non-finite, so the update keeps the previous scale and counts the step
//! in nonfinite_steps. x is half, bfloat16 or float; out has x's shape (else
//! mpx::shape_error) and must not overlap it; both live where the executor computes.
//! Asynchronous on a cuda_executor.
template <executor Exec, tensor_like X, tensor_like Out, dtype8 Format>
void cast_to_fp8(Exec const& exec, X&& x, fp8_tensor_scale<Format, Exec>& state, Out&& out,
                 delayed_scaling const& = {}) {
  auto const xv = mpx::view(x);
  auto const ov = mpx::view(out);
  detail::check_fp8_cast<Exec, decltype(xv), decltype(ov), Format>(xv, ov);
  detail::fp8_pass<detail::fp8_cast_pass::cast_and_record>(exec, xv.data(), ov.data(), xv.size(), state.data());
}

namespace detail {
// The checks and the pass behind cast_to_fp8_transposed and its padded form: out is x
// with the last two extents swapped, its last (x's rows, K) exactly as long or, padded,
// as long or longer; the pass writes zeros past x's rows.
template <class Exec, class XV, class OV, class Format>
void cast_to_fp8_transposed_checked(char const* op, bool padded, Exec const& exec, XV const& xv,
                                    fp8_tensor_scale<Format, Exec>& state, OV const& ov) {
  check_fp8_cast_types<Exec, XV, OV, Format>();
  mpx::shape const& xs = xv.shape();
  mpx::shape const& os = ov.shape();
  std::size_t const r = xs.rank();
  std::string const shapes = "x has shape " + xs.to_string() + ", out has shape " + os.to_string();
  if (r != 2 && r != 3)
    fail<shape_error>(op, "x must be a matrix [rows, cols] or a batch of them [batch, rows, cols]; " + shapes);
  bool const rows_fit = padded ? os[r - 1] >= xs[r - 2] : os[r - 1] == xs[r - 2];
  if (!(os.rank() == r && os[r - 2] == xs[r - 1] && rows_fit && (r == 2 || os[0] == xs[0])))
    fail<shape_error>(op, std::string(padded ? "out must have x's shape with the last two extents swapped, its last "
                                               "as long as x's rows or longer; "
                                             : "out must have x's shape with the last two extents swapped; ") +
                              shapes);
  require_disjoint(op, "x", xv, "out", ov);
  fp8_transposed_pass(exec, xv.data(), ov.data(), r == 3 ? xs[0] : 1, xs[r - 2], xs[r - 1], os[r - 1], state.data());
}
}  // namespace detail

//! cast_to_fp8 (delayed scaling) and a transpose in one pass: x [R, C] gives out [C, R]
//! with out[j][i] = saturate_cast<Format>(float(x[i][j]) * scale), |x|'s maximum folded
//! into this step's amax as cast_to_fp8 does (NaN and inf alike); a batch [B, R, C] gives
//! [B, C, R]. For mpx::fp8_gemm on the GPU, which needs both operands K-contiguous: an
//! activation gradient dY [N, M] becomes the [M, N] operand of the weight gradient
//! dY^T X. Another shape of out (or a rank other than 2 or 3) is an mpx::shape_error
//! naming both; out must not overlap x; both live where the executor computes.
//! Asynchronous on a cuda_executor (32 x 32 tiles through shared memory).
template <executor Exec, tensor_like X, tensor_like Out, dtype8 Format>
void cast_to_fp8_transposed(Exec const& exec, X&& x, fp8_tensor_scale<Format, Exec>& state, Out&& out,
                            delayed_scaling const& = {}) {
  detail::cast_to_fp8_transposed_checked("cast_to_fp8_transposed", false, exec, mpx::view(x), state, mpx::view(out));
}

//! cast_to_fp8 (delayed scaling) into rows padded with zeros: x [..., K] gives out
//! [..., Kp] with Kp >= K, the first K columns of each row cast as cast_to_fp8 casts
//! them and the others +0, which add nothing to a product. Pads K to what mpx::fp8_gemm
//! needs on the GPU (fp8_gemm_padded_extent(K)). The amax is recorded as by cast_to_fp8.
//! Other extents than the last must agree, and Kp >= K (else mpx::shape_error naming
//! both shapes); out must not overlap x. Asynchronous on a cuda_executor.
template <executor Exec, tensor_like X, tensor_like Out, dtype8 Format>
void cast_to_fp8_padded(Exec const& exec, X&& x, fp8_tensor_scale<Format, Exec>& state, Out&& out,
                        delayed_scaling const& = {}) {
  auto const xv = mpx::view(x);
  auto const ov = mpx::view(out);
  detail::check_fp8_cast_types<Exec, decltype(xv), decltype(ov), Format>();
  mpx::shape const& xs = xv.shape();
  mpx::shape const& os = ov.shape();
  std::size_t const r = xs.rank();
  bool ok = r >= 1 && os.rank() == r && os[r - 1] >= xs[r - 1];
  for (std::size_t i = 0; ok && i + 1 < r; ++i) ok = os[i] == xs[i];
  if (!ok)
    detail::fail<shape_error>("cast_to_fp8_padded", "out must have x's shape with the last extent as long or "
                                                    "longer; x has shape " + xs.to_string() + ", out has shape " +
                                                        os.to_string());
  detail::require_disjoint("cast_to_fp8_padded", "x", xv, "out", ov);
  auto const cols = static_cast<std::size_t>(xs[r - 1]);
  auto const pitch = static_cast<std::size_t>(os[r - 1]);
  detail::fp8_padded_pass(exec, xv.data(), ov.data(), pitch ? ov.size() / pitch : 0, cols, pitch, state.data());
}

//! cast_to_fp8_transposed into rows padded with zeros: x [R, C] gives out [C, Rp] with
//! Rp >= R (a batch [B, R, C] gives [B, C, Rp]), out[j][i] the cast of x[i][j] for i < R
//! and +0 beyond: the K-contiguous operand of mpx::fp8_gemm with K = R padded
//! (fp8_gemm_padded_extent(R)). The amax is recorded as by cast_to_fp8. Other shapes are
//! an mpx::shape_error naming both; out must not overlap x. Asynchronous on a
//! cuda_executor.
template <executor Exec, tensor_like X, tensor_like Out, dtype8 Format>
void cast_to_fp8_transposed_padded(Exec const& exec, X&& x, fp8_tensor_scale<Format, Exec>& state, Out&& out,
                                   delayed_scaling const& = {}) {
  detail::cast_to_fp8_transposed_checked("cast_to_fp8_transposed_padded", true, exec, mpx::view(x), state,
                                         mpx::view(out));
}

//! Current scaling: the amax of x first (one pass), the scale from it
//! (max(Format) / (amax * 2^margin); a zero or non-finite amax keeps the previous
//! scale), then the cast as above (a second pass, which records nothing). The step is
//! finished here: no update_fp8_scale follows. Asynchronous on a cuda_executor.
template <executor Exec, tensor_like X, tensor_like Out, dtype8 Format>
void cast_to_fp8(Exec const& exec, X&& x, fp8_tensor_scale<Format, Exec>& state, Out&& out,
                 current_scaling const& recipe) {
  auto const xv = mpx::view(x);
  auto const ov = mpx::view(out);
  detail::check_fp8_cast<Exec, decltype(xv), decltype(ov), Format>(xv, ov);
  float const factor = detail::fp8_margin_factor(recipe.margin);
  detail::fp8_pass<detail::fp8_cast_pass::record_only>(exec, xv.data(), static_cast<Format*>(nullptr), xv.size(), state.data());
  detail::fp8_current_update_on(exec, state, factor);
  detail::fp8_pass<detail::fp8_cast_pass::cast_only>(exec, xv.data(), ov.data(), xv.size(), state.data());
}

//! Ends a step of delayed scaling: this step's amax enters the history, and scale =
//! max(Format) / (max(history) * 2^margin) unless that maximum is zero, NaN or inf
//! (then the scale stays; a NaN or inf stays in the history, and so keeps the scale,
//! for history_length steps, as in Transformer Engine). recipe.history_length must be
//! the state's (fixed when the state is made; else mpx::invalid_argument).
//! Asynchronous on a cuda_executor (one warp).
template <executor Exec, dtype8 Format>
void update_fp8_scale(Exec const& exec, fp8_tensor_scale<Format, Exec>& state,
                      delayed_scaling const& recipe) {
  float const factor = detail::fp8_margin_factor(recipe.margin);
  if (recipe.history_length != state.history_length())
    detail::fail<invalid_argument>("mpx::update_fp8_scale", "the recipe's history_length " +
                                                                std::to_string(recipe.history_length) +
                                                                " differs from the state's " +
                                                                std::to_string(state.history_length()));
  detail::fp8_delayed_update_pass<Format>(exec, state.data(), factor);
}

//! Current scaling's update from the step amax recorded so far: what cast_to_fp8 with
//! current_scaling does between its passes, for an amax gathered over several tensors
//! with cast_to_fp8 (delayed) calls whose outputs are then discarded.
template <executor Exec, dtype8 Format>
void update_fp8_scale(Exec const& exec, fp8_tensor_scale<Format, Exec>& state, current_scaling const& recipe) {
  detail::fp8_current_update_on(exec, state, detail::fp8_margin_factor(recipe.margin));
}

}  // namespace mpx
