// Model-level diagnostics: where a mixed-precision model's numbers go wrong, and why.
//
//   find_nonfinite(exec, model)   after a forward (and a backward): the first layer that
//                                 turned finite numbers into NaN or inf, the tensor,
//                                 what it read, and the likely cause. "Why is my
//                                 mixed-precision model failing to train?"
//   probe_loss_scales(exec, model, images, labels)
//                                 the gradients of one batch at several loss scales:
//                                 per parameter, the share stored as zero (underflow)
//                                 and whether any overflowed, and the scale to use.
//                                 "Why is my gradient zero?"
//
// Both read values back to the host, so on a cuda_executor they synchronise the stream
// (once per tensor): tools for a debugging session, not for every step.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/exec/tensor_ref.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/layers/matrix_products.hpp>
#include <mpx/losses/cross_entropy.hpp>
#include <mpx/losses/loss_value.hpp>
#include <mpx/numerics/stats.hpp>

#include <cmath>
#include <cstddef>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx {

namespace detail {
template <class Exec, class Space>
numerics_stats stats_of(Exec const& exec, tensor_ref<Space> const& t) {
  numerics_stats out;
  visit_dtype(t.dtype(), [&](auto tag) { out = stats(exec, t.template as<decltype(tag)>()); });
  return out;
}

//! "2^16" for a power of two, else the number.
inline std::string scale_label(float s) {
  int const e = static_cast<int>(std::lround(std::log2(s)));
  return std::ldexp(1.0f, e) == s ? "2^" + std::to_string(e) : to_text(s);
}

//! What the explanations say about a dtype's range, from its dtype_traits.
struct dtype_range {
  double max = 0;             //!< largest finite value
  bool has_infinity = true;   //!< false for float8_e4m3: an overflow is NaN (or ±max, saturated)
  //! A range narrower than float32's: values a model computes in float can overflow it.
  [[nodiscard]] bool narrow() const noexcept { return max < 1e38; }
};
inline dtype_range range_of(dtype_id d) {
  return visit_dtype(d, [](auto t) {
    using tr = dtype_traits<decltype(t)>;
    return dtype_range{to_double(tr::max()), tr::has_infinity};
  });
}

//! The largest finite value of a dtype, for the explanations: "65504", "448", "3.4e38".
inline std::string largest_finite_text(dtype_id d) {
  double const max = range_of(d).max;
  if (max < 1e6) return to_text(max);
  int const e = static_cast<int>(std::floor(std::log10(max)));
  char text[32];
  std::snprintf(text, sizeof text, "%.1fe%d", max / std::pow(10.0, e), e);
  return text;
}

//! Whether a tensor of dtype d with these statistics overflowed d's range: ±inf, or for
//! a format without infinity (float8_e4m3) NaN, which is what its cast makes of an overflow.
inline bool overflowed(dtype_id d, numerics_stats const& s) {
  return s.inf > 0 || (!range_of(d).has_infinity && s.nan > 0);
}

//! For a format without infinity: how its overflows show, and how many values sit at ±max.
inline std::string no_infinity_note(dtype_id d, numerics_stats const& s) {
  if (range_of(d).has_infinity) return "";
  return " (" + std::string(to_string(d)) + " has no infinity: a cast makes an overflow NaN, a saturate_cast ±" +
         largest_finite_text(d) + "; " + std::to_string(s.at_max) + " values sit at ±" + largest_finite_text(d) + ")";
}
}  // namespace detail

//! Where a NaN or inf first appeared.
struct nonfinite_finding {
  std::string layer;   //!< "dense_1", or "(model input)" when the data itself holds them
  std::string kind;    //!< "Dense"
  std::string policy;  //!< "mixed_float16"
  std::string pass;    //!< "forward" or "backward"
  std::string tensor;  //!< "output", "input gradient", a parameter ("dense_1/kernel value") or its gradient ("dense_1/kernel gradient")
  dtype_id dtype = dtype_id::float32;  //!< the dtype that tensor is stored in
  numerics_stats stats;                //!< of that tensor
  numerics_stats read_stats;           //!< of what the layer read: its input (forward) or dL/d(output) (backward)
  bool read_known = true;              //!< false when the layer began the backward pass (its dL/d(output) is the caller's)

  //! A paragraph: where, what, and the likely cause with what to try.
  [[nodiscard]] std::string explanation() const {
    std::string const where = layer + (kind.empty() ? "" : " (" + kind + ", " + policy + ")");
    std::string out = where + ": its " + pass + " pass wrote " + std::to_string(stats.nan) + " NaN and " +
                      std::to_string(stats.inf) + " inf to its " + tensor + " (" + std::string(to_string(dtype)) +
                      ", " + std::to_string(stats.size) + " values; largest finite magnitude " +
                      detail::to_text(stats.absmax) + ")";
    if (layer == "(model input)")
      return out + ". The model's input, as its first layer reads it (cast to that layer's dtype), is not finite: "
                   "check the data set and its normalisation (values above 65504 become inf in float16).";
    if (layer.starts_with("(cast"))
      return out + " from finite values (largest magnitude " + detail::to_text(read_stats.absmax) +
             "): the cast the model inserted between two layers overflowed " + std::string(to_string(dtype)) +
             "'s range" + detail::no_infinity_note(dtype, stats) +
             ". Give the layer after it a policy with a wider storage type (bfloat16 or float32), or keep "
             "the values below " + detail::largest_finite_text(dtype) +
             " (normalise, or lower the loss scale for a gradient).";
    if (read_known)
      out += " from finite " + std::string(pass == "forward" ? "inputs" : "gradients") + " (largest magnitude " +
             detail::to_text(read_stats.absmax) + ")";
    out += ". ";
    if (tensor.ends_with(" value")) {
      out += "The parameter itself is not finite: an earlier update wrote NaN or inf into it, a step that should "
             "have been skipped (update through a loss_scale_optimizer, which checks the gradients first) or a "
             "learning rate so high that the weights overflowed.";
    } else if (pass == "forward") {
      if (detail::overflowed(dtype, stats) && detail::range_of(dtype).narrow())
        out += "The values passed " + std::string(to_string(dtype)) + "'s largest finite value (" +
               detail::largest_finite_text(dtype) + ")" + detail::no_infinity_note(dtype, stats) +
               ": an overflow. Keep this layer in float32 (give it the float32 policy) or in bfloat16 (float32's "
               "range), normalise what it reads, or look for weights that grew (a learning rate too high).";
      else if (stats.inf > 0)
        out += "The values passed " + std::string(to_string(dtype)) + "'s largest finite value (" +
               detail::largest_finite_text(dtype) + "), which is float32's range: the model diverged. Look for "
               "weights that grew (a learning rate too high) or inputs that are not normalised.";
      else if (kind == "MultiHeadAttention" && detail::range_of(dtype).narrow())
        out += "In an attention layer stored in " + std::string(to_string(dtype)) +
               ", NaN from finite inputs is its logits q·kᵀ overflowing " + std::string(to_string(dtype)) + " (" +
               detail::largest_finite_text(dtype) +
               ") inside the layer: the softmax of a row holding inf computes inf - inf. Keep the logits scaled by "
               "1/sqrt(head width) (causal_self_attention's scale_logits, on by default), store the layer in "
               "bfloat16 (mpx::mixed_bfloat16 has float32's range), or give the attention layer the float32 policy.";
      else
        out += "NaN from finite numbers is an invalid operation inside the layer: 0/0, inf - inf, 0 * inf, or the "
               "logarithm or square root of a negative number, often after an intermediate overflowed or "
               "underflowed to 0. Compute it in float (the policy's accumulate type), add an epsilon to "
               "divisors, or use mpx's stable forms (softmax, losses from logits).";
    } else {
      if (detail::overflowed(dtype, stats) && detail::range_of(dtype).narrow())
        out += "The gradients passed " + std::string(to_string(dtype)) + "'s range" +
               detail::no_infinity_note(dtype, stats) + ": the loss scale is too large for this layer. A dynamic "
               "loss scaler skips such a step and halves the scale; with a fixed scale, lower it "
               "(probe_loss_scales shows which scales keep every gradient finite).";
      else if (stats.inf > 0)
        out += "The gradients passed float32's range, which no sensible loss scale reaches: the model diverged "
               "(a learning rate too high, or a loss that grew without bound).";
      else
        out += "NaN in the backward pass from finite gradients is an invalid operation in this layer's "
               "derivative, often a division by a value that underflowed to 0, or inf times 0.";
    }
    return out;
  }
};

//! After model.forward (and model.backward or backward_from_logits), the first place a
//! NaN or inf appears: the model's input; then each layer's parameters and output in
//! forward order; then, going backwards from where backpropagation began, each layer's parameter
//! gradients and input gradient (a composite's, a residual block's or a repeat's, after its
//! parts' layers). The first tensor that holds one names the layer that
//! made it from finite numbers. nullopt when everything is finite. Synchronises.
template <executor Exec, class Model>
std::optional<nonfinite_finding> find_nonfinite(Exec const& exec, Model& model) {
  using Space = memory_space_t<Exec>;
  auto const layers = model.template trace<Space>();
  auto found = [&](auto const& t, std::string pass, std::string tensor, tensor_ref<Space> const& where,
                   numerics_stats const& s, std::optional<numerics_stats> read) {
    nonfinite_finding f{t.name, t.kind, t.policy, std::move(pass), std::move(tensor), where.dtype(), s, {}, true};
    if (read) f.read_stats = *read;
    else f.read_known = false;
    return f;
  };
  numerics_stats const input = detail::stats_of(exec, layers.front().input);
  if (!input.all_finite()) {
    nonfinite_finding f{"(model input)", "", "", "forward", "values", layers.front().input.dtype(), input, {}, false};
    return f;
  }
  // A cast the model inserted between two layers can overflow too (float32 above 65504
  // into float16): such a finding names the cast, not the layer after it.
  auto cast_found = [&](auto const& t, std::string pass, std::string tensor, tensor_ref<Space> const& where,
                        numerics_stats const& s, numerics_stats const& read) {
    nonfinite_finding f{"(cast to " + std::string(to_string(where.dtype())) + " for " + t.name + ")",
                        "", "", std::move(pass), std::move(tensor), where.dtype(), s, read, true};
    return f;
  };
  numerics_stats read = input;
  void const* previous_output = nullptr;
  for (auto const& t : layers) {
    for (auto const& p : t.parameters) {  // weights an earlier update made non-finite
      numerics_stats const w = detail::stats_of(exec, p.value);
      if (!w.all_finite()) return found(t, "forward", p.name + " value", p.value, w, std::nullopt);
    }
    if (previous_output && t.input.data() != previous_output) {  // the model cast the previous output
      numerics_stats const cast_input = detail::stats_of(exec, t.input);
      if (!cast_input.all_finite()) return cast_found(t, "forward", "values", t.input, cast_input, read);
      read = cast_input;
    }
    numerics_stats const out = detail::stats_of(exec, t.output);
    if (!out.all_finite()) return found(t, "forward", "output", t.output, out, read);
    read = out;
    previous_output = t.output.data();
  }
  std::optional<numerics_stats> above;  // the input gradient of the layer above, checked finite
  // A layer's gradient of its output (dy is the layer above's input gradient, finite, or
  // it would have been found, or the model's cast of it to this layer's dtype).
  auto check_output_gradient = [&](auto const& t, std::optional<numerics_stats>& dy) -> std::optional<nonfinite_finding> {
    if (t.output_gradient.size() == 0) return std::nullopt;
    dy = detail::stats_of(exec, t.output_gradient);
    if (!dy->all_finite() && above) return cast_found(t, "backward", "output gradient", t.output_gradient, *dy, *above);
    return std::nullopt;
  };
  auto check_input_gradient = [&](auto const& t, std::optional<numerics_stats> const& dy) -> std::optional<nonfinite_finding> {
    if (t.input_gradient.size() == 0) return std::nullopt;
    numerics_stats const dx = detail::stats_of(exec, t.input_gradient);
    if (!dx.all_finite()) return found(t, "backward", "input gradient", t.input_gradient, dx, dy);
    above = dx;
    return std::nullopt;
  };
  // Backwards: the layers in reverse, a composite's (a residual block's, a repeat's) dy
  // before its parts' layers and its own input gradient (the skip path's sum, or copy
  // 0's) after them, which ran inside it.
  struct open_composite {
    std::size_t index;
    std::optional<numerics_stats> dy;
  };
  std::vector<open_composite> open;
  auto close_composites = [&](std::string const* next) -> std::optional<nonfinite_finding> {
    while (!open.empty() && (!next || !next->starts_with(layers[open.back().index].name + "/"))) {
      open_composite const c = open.back();
      open.pop_back();
      if (auto f = check_input_gradient(layers[c.index], c.dy)) return f;
    }
    return std::nullopt;
  };
  for (std::size_t i = layers.size(); i-- > 0;) {
    auto const& t = layers[i];
    if (!t.in_backward) continue;
    if (auto f = close_composites(&t.name)) return f;
    std::optional<numerics_stats> dy;
    if (auto f = check_output_gradient(t, dy)) return f;
    if (t.composite) {
      open.push_back({i, dy});
      continue;
    }
    for (auto const& p : t.parameters) {
      numerics_stats const g = detail::stats_of(exec, p.gradient);
      if (!g.all_finite()) return found(t, "backward", p.name + " gradient", p.gradient, g, dy);
    }
    if (auto f = check_input_gradient(t, dy)) return f;
  }
  if (auto f = close_composites(nullptr)) return f;
  return std::nullopt;
}

//! One parameter's gradients at each probed loss scale.
struct loss_scale_probe_row {
  std::string parameter;                 //!< "dense/kernel"
  dtype_id dtype = dtype_id::float32;    //!< the dtype its gradient is stored in
  std::size_t size = 0;
  std::vector<double> zero_share;        //!< per scale: the share of the stored gradient that is 0
  std::vector<std::size_t> nonfinite;    //!< per scale: NaN and inf in it
};

//! What probe_loss_scales found.
struct loss_scale_probe {
  std::vector<float> scales;
  std::vector<loss_scale_probe_row> rows;
  //! The largest probed scale at which every gradient is finite; 0 if none is.
  float recommended_scale = 0;

  //! A table: one row per parameter, the share of zeros at each scale, "inf" where a
  //! gradient overflowed; then the recommendation.
  [[nodiscard]] std::string to_string() const {
    std::string out;
    char cell[64];
    std::snprintf(cell, sizeof cell, "%-28s %-9s", "zero share at loss scale", "dtype");
    out += cell;
    for (float s : scales) {
      std::snprintf(cell, sizeof cell, " %8s", detail::scale_label(s).c_str());
      out += cell;
    }
    out += "\n";
    for (auto const& r : rows) {
      std::snprintf(cell, sizeof cell, "%-28s %-9s", r.parameter.c_str(), std::string(mpx::to_string(r.dtype)).c_str());
      out += cell;
      for (std::size_t i = 0; i < scales.size(); ++i) {
        if (r.nonfinite[i]) std::snprintf(cell, sizeof cell, " %8s", "inf");
        else std::snprintf(cell, sizeof cell, " %7.1f%%", 100 * r.zero_share[i]);
        out += cell;
      }
      out += "\n";
    }
    // Does a scale recover anything? Compare the zero shares at 1 and at the safe scale.
    bool recovers = false;
    for (std::size_t i = 0; i < scales.size() && recommended_scale > 0; ++i) {
      if (scales[i] != recommended_scale) continue;
      for (auto const& r : rows) recovers = recovers || r.zero_share.front() > r.zero_share[i];
    }
    if (recommended_scale > scales.front() && !recovers && scales.front() <= 1.0f)
      out += "no gradient is lost at scale 1: this model needs no loss scale (bfloat16 and float32 rarely do)\n";
    if (recommended_scale > 0)
      out += "largest scale with every gradient finite: " + detail::scale_label(recommended_scale) + " = " +
             (recommended_scale < 1e15f ? std::to_string(std::llround(recommended_scale))
                                        : detail::to_text(recommended_scale)) +
             " (a dynamic loss scaler settles near it)\n";
    else
      out += "no probed scale keeps every gradient finite: the gradients overflow even unscaled, so the model "
             "itself diverges (find_nonfinite names the layer)\n";
    return out;
  }
};

inline std::vector<float> default_probe_scales() {
  return {1.0f, 16.0f, 256.0f, 4096.0f, 65536.0f, 1048576.0f, 16777216.0f};
}

namespace detail {
//! Puts every fp8 scale of a model back as it was when this was made (its delayed
//! scaling's amax history included): a probe is not a training step.
template <executor Exec>
class fp8_scales_kept {
 public:
  template <class Model>
  fp8_scales_kept(Exec const& exec, Model& model) {
    if constexpr (requires { model.for_each_layer([](auto&) {}); })
      for (auto const& entry : model_fp8_scales<Exec>(model)) restore_.push_back(entry.snapshot(exec));
  }
  fp8_scales_kept(fp8_scales_kept const&) = delete;
  fp8_scales_kept& operator=(fp8_scales_kept const&) = delete;
  ~fp8_scales_kept() {
    try {
      for (auto const& r : restore_) r();
    } catch (...) {  // an executor's error is sticky: its next call reports it
    }
  }

 private:
  std::vector<std::function<void()>> restore_;
};

inline void check_probe_scales(std::vector<float> const& scales) {
  if (scales.empty()) fail<invalid_argument>("mpx::probe_loss_scales", "give at least one loss scale");
  for (float s : scales)
    if (!(s > 0) || !std::isfinite(s))
      fail<invalid_argument>("mpx::probe_loss_scales", "every scale must be finite and > 0; got " + to_text(s));
}

//! probe_loss_scales' backward passes and measurements (the caller checked the scales
//! and keeps the fp8 scales).
template <executor Exec, class Model, class Space>
loss_scale_probe probe_at_scales(Exec const& exec, Model& model, tensor_view<float const, Space> loss_gradient,
                                 std::vector<float> scales) {
  loss_scale_probe out;
  out.scales = scales;
  tensor<float, Space> scaled(exec, loss_gradient.shape());
  auto const params = model.template parameters<Space>();
  for (auto const& p : params) out.rows.push_back({p.name, p.gradient.dtype(), p.gradient.size(), {}, {}});
  // One forward, one backward per scale: the batch is backpropagated again on purpose.
  bool const allowed_before = model.allow_backward_without_forward(true);
  struct restore_setting {
    Model& m;
    bool allowed;
    ~restore_setting() { m.allow_backward_without_forward(allowed); }
  } const restore{model, allowed_before};
  for (float s : scales) {
    transform(exec, scaled, ops::scale_by<float>{s}, loss_gradient);  // scaled = s * gradient, one pass
    model.backward_from_logits(exec, tensor_view<float const, Space>(scaled));
    bool all_finite = true;
    for (std::size_t i = 0; i < params.size(); ++i) {
      numerics_stats const g = detail::stats_of(exec, params[i].gradient);
      out.rows[i].zero_share.push_back(g.size ? static_cast<double>(g.zero) / static_cast<double>(g.size) : 0.0);
      out.rows[i].nonfinite.push_back(g.nonfinite());
      all_finite = all_finite && g.all_finite();
    }
    if (all_finite && s > out.recommended_scale) out.recommended_scale = s;
  }
  return out;
}
}  // namespace detail

//! For any loss: after model.forward(exec, x, true), give the loss's unscaled gradient
//! with respect to the logits (see model.logits()), in float. For each loss scale, the
//! gradient times the scale (in float) is backpropagated and every parameter's stored
//! gradient is measured: the share of zeros (values that underflowed, beside true zeros
//! such as a ReLU's) and NaN or inf (overflow). The model's gradients are left as at the
//! last scale. Synchronises. The default scales: 2^0, 2^4, ..., 2^24.
template <executor Exec, class Model, class Space = memory_space_t<Exec>>
loss_scale_probe probe_loss_scales(Exec const& exec, Model& model, tensor_view<float const, Space> loss_gradient,
                                   std::vector<float> scales = default_probe_scales()) {
  detail::check_probe_scales(scales);
  detail::fp8_scales_kept<Exec> const kept(exec, model);  // each backward ends an fp8 "step"
  return detail::probe_at_scales(exec, model, loss_gradient, std::move(scales));
}

//! For a classifier trained with sparse categorical cross-entropy: runs the forward pass
//! (training mode) on a batch, takes the cross-entropy's gradient, and probes as above.
//! Images and labels are tensors or views.
template <executor Exec, class Model, tensor_like Images, tensor_like Labels, class Space = memory_space_t<Exec>>
  requires std::is_same_v<std::remove_const_t<typename view_t<Labels const>::value_type>, std::int32_t>
loss_scale_probe probe_loss_scales(Exec const& exec, Model& model, Images const& images, Labels const& labels,
                                   std::vector<float> scales = default_probe_scales()) {
  detail::check_probe_scales(scales);
  detail::fp8_scales_kept<Exec> const kept(exec, model);  // the forward records amaxes
  model.forward(exec, mpx::view(images), true);
  auto const logits = model.template logits<Space>();
  tensor<float, Space> gradient(exec, logits.shape());
  loss_value<Space> loss(exec);
  sparse_categorical_cross_entropy<float32>(exec, logits, tensor_view<std::int32_t const, Space>(mpx::view(labels)),
                                            gradient, loss);
  static_cast<void>(loss.read(exec));  // a label outside [0, classes) throws here, naming it
  return detail::probe_at_scales(exec, model, tensor_view<float const, Space>(gradient), std::move(scales));
}

}  // namespace mpx
