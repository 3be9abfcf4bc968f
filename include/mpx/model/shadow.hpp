// mpx::model_shadow: which layer costs your model its precision. After a backward pass,
// each layer is run again, forward and backward, by a float32 twin: the same layer type
// with mpx::float32 as its policy, given the same input, the same weights (the layer's
// own, cast) and the same upstream gradient, in the same mode (training or not). The relative L2 error of the layer's
// output, input gradient and weight gradients against its twin's is that layer's error
// budget for the step:
//
//   error(a) = || a - a_float32 ||_2 / || a_float32 ||_2     (summed in float64)
//
// Each layer is measured on its own inputs, so an error is the layer's own, not the sum
// of what the layers before it did. The model is only read: a run that shadows gives the
// same parameters bit for bit as one that does not. A shadow step costs about one more
// training step (the twins' forward and backward) and synchronises a cuda_executor once.
//
//   mpx::model_shadow<Space> shadow;
//   ... model.forward(exec, x, true); loss; model.backward_from_logits(exec, dlogits);
//   reports.push_back(shadow.measure(exec, model, step));  // before the optimizer step
//   std::printf("%s", mpx::shadow_table(reports).c_str());
//
// mpx::fit does this every fit_options::shadow_every steps, writes the errors to its CSV
// log and prints the table at the end of the run (docs/numerics.md, "Finding the layer
// that costs you precision").
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/reduce_items.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/exec/tensor_ref.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/optim/parameter.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

namespace mpx {

template <template <class> class Layer, class... Policies>
class tiered;  // model/tiered.hpp

//! One layer's error budget at one shadow step: relative L2 errors against its float32
//! twin. An empty value was not measured (the layer writes no such tensor, or the step's
//! backward did not reach it); NaN or inf means the layer's own tensor was not finite.
struct layer_error {
  std::string layer;   //!< "dense_1", or "<block>/<layer>" inside a residual block
  std::string kind;    //!< "Dense"
  std::string policy;  //!< "mixed_fp8"
  std::optional<double> output;           //!< forward
  std::optional<double> input_gradient;   //!< dL/d(input); none for the first layer
  std::optional<double> weight_gradient;  //!< every parameter gradient of the layer together
  std::string skipped;  //!< why the layer has no twin ("draws random numbers"); empty when measured
  //! Its twin's results were not finite either: the layer read non-finite values (or
  //! holds non-finite weights), so its errors say nothing of its precision. find_nonfinite
  //! names the layer where the trouble began.
  bool read_nonfinite = false;

  //! The largest of the three (NaN when one is NaN); none when nothing was measured.
  [[nodiscard]] std::optional<double> worst() const {
    std::optional<double> out;
    for (auto const& e : {output, input_gradient, weight_gradient}) {
      if (!e) continue;
      if (std::isnan(*e)) return *e;
      if (!out || *e > *out) out = *e;
    }
    return out;
  }
};

struct shadow_report {
  std::size_t step = 0;  //!< the training step it was taken at (from 1)
  //! The step's gradients overflowed and it was skipped (set by classifier_trainer::
  //! history() and by fit): its errors are the overflow's, left out of the means.
  bool skipped = false;
  std::vector<layer_error> layers;
};

namespace detail {

//! Two sums of one comparison, in float64: sum (a - r)^2 and sum r^2.
struct error_sums {
  double squared_difference;
  double squared_reference;
};
struct add_error_sums {
  using value_type = error_sums;
  MPX_HD static error_sums identity() noexcept { return {0.0, 0.0}; }
  MPX_HD error_sums operator()(error_sums a, error_sums b) const noexcept {
    // add_rn: the terms are products (d * d), which nvcc would otherwise fuse into the sum.
    return {add_rn(a.squared_difference, b.squared_difference), add_rn(a.squared_reference, b.squared_reference)};
  }
};
template <class T>
struct error_sums_element {
  T const* measured;
  float const* reference;
  MPX_HD error_sums operator()(std::size_t i) const noexcept {
    double const r = static_cast<double>(reference[i]);
    double const d = static_cast<double>(cast<float>(measured[i])) - r;
    return {d * d, r * r};
  }
};
struct store_error_sums {
  error_sums* out;
  MPX_HD void operator()(error_sums s) const noexcept { *out = s; }
};

//! ||a - r|| / ||r|| from the sums: 0 when both are zero, inf when only r is.
inline double relative_error(error_sums s) {
  if (std::isnan(s.squared_difference)) return NAN;
  if (s.squared_reference == 0.0) return s.squared_difference == 0.0 ? 0.0 : INFINITY;
  return std::sqrt(s.squared_difference / s.squared_reference);
}

//! L with its policy replaced by P, when L is a layer template of one policy (every
//! built-in layer); void otherwise.
template <class L, class P>
struct with_policy_of {
  using type = void;
};
template <template <class> class L, class Q, class P>
  requires policy_type<Q>
struct with_policy_of<L<Q>, P> {
  using type = L<P>;
};
//! A tiered layer's twin is its layer under P (it is measured in whichever tier runs).
template <template <class> class L, class... Qs, class P>
struct with_policy_of<tiered<L, Qs...>, P> {
  using type = L<P>;
};

//! Whether L can have a float32 twin: a layer template of one policy (every built-in
//! layer), made from its config(), and a layer in float32.
template <class L>
using float32_twin_t = typename with_policy_of<L, float32>::type;
template <class L>
concept has_shadow_twin = !std::is_void_v<float32_twin_t<L>> && requires(L const& l) {
  float32_twin_t<L>(l.config());
} && mpx::layer<float32_twin_t<L>> && requires(float32_twin_t<L>& t) {
  { t.built() } -> std::convertible_to<bool>;
  { t.input_shape() } -> std::convertible_to<shape>;
};

//! Why a layer has no float32 twin; empty when it has one.
template <class L>
std::string shadow_refusal(L const& layer) {
  if constexpr (std::is_void_v<typename with_policy_of<L, float32>::type>) {
    return "no float32 twin: not a layer template of one policy";
  } else if constexpr (!has_shadow_twin<L>) {
    return "no float32 twin: it cannot be made from its config(), or is not a layer in float32";
  } else {
    // A layer that draws random numbers in training (its own opt-out, for custom layers
    // too) would draw another mask in its twin.
    if constexpr (requires { layer.draws_random_numbers_in_training(); })
      if (layer.draws_random_numbers_in_training()) return "draws random numbers in training (dropout)";
    return {};
  }
}

struct shadow_twin_base {
  virtual ~shadow_twin_base() = default;
};

//! A layer's float32 twin and the buffers it writes.
template <class L>
struct shadow_twin final : shadow_twin_base {
  using twin_type = typename with_policy_of<L, float32>::type;
  explicit shadow_twin(L const& layer) : twin(layer.config()) {}
  twin_type twin;
  layer_tensor<typename twin_type::input_type> input, input_gradient;
  layer_tensor<typename twin_type::output_type> output, output_gradient;
  std::int64_t reserved = 0;
};

//! The names of a model's layers in visit_in_flight's order, a composite's parts' layers
//! ("<block>/<layer>", "<repeat>/<i>/<layer>") in place of the composite.
template <class Model>
void shadowed_layer_names(Model const& model, std::vector<std::string>& out, std::string const& prefix = {}) {
  model.for_each_layer([&](auto const& layer) {
    if constexpr (composite_layer<std::remove_cvref_t<decltype(layer)>>)
      layer.for_each_part([&](auto const& part, std::string const& part_prefix) {
        shadowed_layer_names(part, out, prefix + part_prefix);
      });
    else out.push_back(prefix + layer.name());
  });
}

}  // namespace detail

//! Runs a model's layers again in float32 and measures each layer's error (see the top of
//! this file). Holds the twins and their buffers between calls: one per model.
template <memory_space Space>
class model_shadow {
 public:
  //! Measures every layer of `model`'s latest forward and backward (call it after the
  //! backward, before the optimizer step changes the weights, while the gradient given to
  //! the backward is still alive). `compare_weight_gradients`
  //! false leaves weight_gradient empty: for gradients that are no longer this process's
  //! own (averaged over data-parallel replicas during the backward). Synchronises.
  template <executor Exec, class Model>
  shadow_report measure(Exec const& exec, Model& model, std::size_t step, bool compare_weight_gradients = true) {
    static_assert(std::is_same_v<memory_space_t<Exec>, Space>, "mpx::model_shadow: the executor's memory space is not the shadow's");
    if (model_ && model_ != &model)
      detail::fail<invalid_argument>("mpx::model_shadow::measure", "this shadow's twins belong to another model: "
                                                                   "make one model_shadow per model");
    model_ = &model;
    bool const training = model.in_flight_state().training;  // dropout's and batch norm's mode
    shadow_report report;
    report.step = step;
    std::vector<slot> slots;
    std::size_t index = 0;
    model.template visit_in_flight<Space>(
        [&](std::string const& name, auto& layer, auto x, auto y, auto dy, auto dx, bool /*in_backward*/,
            bool /*backward_began_here*/) {
          using L = std::remove_cvref_t<decltype(layer)>;
          if constexpr (composite_layer<L>) {
            return;  // a residual block, a repeat: their layers were measured one by one
          } else {
            layer_error e;
            e.layer = name;
            e.kind = std::string(L::kind);
            if constexpr (requires { layer.active_policy(); }) e.policy = std::string(layer.active_policy());
            else e.policy = std::string(L::policy::name);
            e.skipped = detail::shadow_refusal(layer);
            if constexpr (detail::has_shadow_twin<L>) {
              if (e.skipped.empty())
                measure_layer(exec, twin_at<L>(index, layer), layer, x, y, dy, dx, training, report.layers.size(),
                              slots, compare_weight_gradients);
            }
            report.layers.push_back(std::move(e));
            ++index;
          }
        });
    if (!slots.empty()) {
      auto const sums = to_host(exec, sums_.view().flat(0, slots.size()));
      std::vector<detail::error_sums> weight(report.layers.size(), detail::error_sums{0.0, 0.0});
      for (std::size_t i = 0; i < slots.size(); ++i) {
        auto& e = report.layers[slots[i].layer];
        detail::error_sums const s = sums.data()[i];
        if (!std::isfinite(s.squared_reference)) e.read_nonfinite = true;
        switch (slots[i].what) {
          case measured::output: e.output = detail::relative_error(s); break;
          case measured::input_gradient: e.input_gradient = detail::relative_error(s); break;
          case measured::weight_gradient:
            weight[slots[i].layer] = detail::add_error_sums{}(weight[slots[i].layer], s);
            e.weight_gradient = detail::relative_error(weight[slots[i].layer]);
            break;
        }
      }
    }
    return report;
  }

 private:
  enum class measured { output, input_gradient, weight_gradient };
  struct slot {
    std::size_t layer;
    measured what;
  };

  template <class L>
  detail::shadow_twin<L>& twin_at(std::size_t index, L const& layer) {
    if (twins_.size() <= index) twins_.resize(index + 1);
    if (!twins_[index]) twins_[index] = std::make_unique<detail::shadow_twin<L>>(layer);
    auto* twin = dynamic_cast<detail::shadow_twin<L>*>(twins_[index].get());
    if (!twin) detail::fail<invalid_argument>("mpx::model_shadow::measure", "the model's layers changed between calls");
    return *twin;
  }

  //! Sums of one comparison into the next slot, on the executor.
  template <class Exec, class T>
  void compare(Exec const& exec, tensor_view<T const, Space> measured_values, tensor_view<float const, Space> reference,
               std::size_t layer, measured what, std::vector<slot>& slots) {
    detail::require_same_shape("mpx::model_shadow", "the layer's tensor", measured_values.shape(), "its twin's",
                               reference.shape());
    grow(exec, slots.size() + 1);
    detail::reduce_items<detail::item_kind::element>(
        exec, measured_values.size(), detail::add_error_sums{},
        detail::error_sums_element<T>{measured_values.data(), reference.data()},
        detail::store_error_sums{sums_.data() + slots.size()}, partials_.data());
    slots.push_back({layer, what});
  }

  template <class Exec>
  void grow(Exec const& exec, std::size_t n) {
    if (!partials_.size()) partials_ = tensor<detail::error_sums, Space>(exec, shape{static_cast<std::int64_t>(detail::max_item_blocks)});
    if (sums_.size() >= n) return;
    // The comparisons already enqueued wrote into the old buffer: keep them.
    tensor<detail::error_sums, Space> bigger(exec, shape{static_cast<std::int64_t>(std::max<std::size_t>(64, 2 * n))});
    if (sums_.size()) copy(exec, sums_.view(), bigger.view().flat(0, sums_.size()));
    sums_ = std::move(bigger);
  }

  //! The typed view of a tensor as the twin reads it: itself when the dtypes agree, else
  //! cast into the twin's buffer.
  template <class To, class Exec, class From>
  static tensor_view<To const, Space> as_twin_reads(Exec const& exec, tensor_view<From const, Space> const& v,
                                                    detail::layer_tensor<To>& buffer) {
    if constexpr (std::is_same_v<From, To>) {
      return v;
    } else {
      buffer.ensure(exec, v.shape());
      auto out = buffer.template view<Space>(v.shape());
      cast(exec, v, out);
      return out;
    }
  }

  template <class Exec, class L, class X, class Y, class DY, class DX>
  void measure_layer(Exec const& exec, detail::shadow_twin<L>& t, L& layer, X x, Y y, DY dy, DX dx, bool training,
                     std::size_t layer_index, std::vector<slot>& slots, bool compare_weight_gradients) {
    using Twin = typename detail::shadow_twin<L>::twin_type;
    using TwinIn = typename Twin::input_type;
    using TwinOut = typename Twin::output_type;
    static_assert(std::is_same_v<TwinOut, float>, "mpx::model_shadow: a float32 twin writes float");
    std::int64_t const batch = y.shape()[0];
    if (t.twin.built() && !(t.twin.input_shape() == layer.input_shape())) {  // the model was built again
      t.twin = Twin(layer.config());
      t.reserved = 0;
    }
    if (!t.twin.built()) {
      t.twin.set_name(layer.name());
      t.twin.build(exec, layer.input_shape(), 0);  // its weights are the layer's, copied below
    }
    if (batch > t.reserved) {
      t.twin.reserve(exec, batch);
      t.reserved = batch;
    }
    // The layer's weights, cast to the twin's dtype.
    std::vector<parameter<Space>> mine, twins;
    layer.template append_parameters<Space>(mine);
    t.twin.template append_parameters<Space>(twins);
    if (mine.size() != twins.size())
      detail::fail<invalid_argument>("mpx::model_shadow", layer.name() + ": its float32 twin has " +
                                                              std::to_string(twins.size()) + " parameters, it has " +
                                                              std::to_string(mine.size()));
    for (std::size_t i = 0; i < mine.size(); ++i) {
      auto const to = twins[i].value.template as<float>();
      visit_dtype(mine[i].value.dtype(), [&](auto tag) {
        using T = decltype(tag);
        cast(exec, tensor_view<T const, Space>(mine[i].value.template as<T>()), to);
      });
    }
    auto const xt = as_twin_reads<TwinIn>(exec, x, t.input);
    t.output.ensure(exec, y.shape());
    auto const yt = t.output.template view<Space>(y.shape());
    t.twin.forward(exec, xt, yt, training);
    compare(exec, y, tensor_view<float const, Space>(yt), layer_index, measured::output, slots);
    if (!dy.data()) return;  // the backward did not read this layer's output gradient
    auto const dyt = as_twin_reads<TwinOut>(exec, dy, t.output_gradient);
    tensor_view<TwinIn, Space> dxt;
    if (dx.data()) {
      t.input_gradient.ensure(exec, dx.shape());
      dxt = t.input_gradient.template view<Space>(dx.shape());
    }
    t.twin.backward(exec, xt, tensor_view<float const, Space>(yt), dyt, dxt);
    if constexpr (dtype<TwinIn>)
      if (dx.data()) compare(exec, dx, tensor_view<float const, Space>(dxt), layer_index, measured::input_gradient, slots);
    if (!compare_weight_gradients) return;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      auto const reference = tensor_view<float const, Space>(twins[i].gradient.template as<float>());
      visit_dtype(mine[i].gradient.dtype(), [&](auto tag) {
        using T = decltype(tag);
        compare(exec, tensor_view<T const, Space>(mine[i].gradient.template as<T>()), reference, layer_index,
                measured::weight_gradient, slots);
      });
    }
  }

  void const* model_ = nullptr;
  std::vector<std::unique_ptr<detail::shadow_twin_base>> twins_;
  tensor<detail::error_sums, Space> sums_;
  tensor<detail::error_sums, Space> partials_;
};

namespace detail {
//! "3.1e-02", "0", "nan", "inf", or "-" for a value not measured.
inline std::string error_text(std::optional<double> e) {
  if (!e) return "-";
  if (std::isnan(*e)) return "nan";
  if (*e == 0.0) return "0";  // exact: the layer computes as its twin does
  char text[32];
  std::snprintf(text, sizeof text, "%.1e", *e);
  return text;
}
}  // namespace detail

//! Every layer's mean error over the reports of steps that were not skipped (a NaN in
//! any of them makes its mean NaN), in the order of the model.
inline std::vector<layer_error> mean_layer_errors(std::vector<shadow_report> const& reports) {
  std::vector<layer_error> out;
  if (reports.empty()) return out;
  out = reports.front().layers;
  for (auto& e : out) {
    e.output = e.input_gradient = e.weight_gradient = std::nullopt;
    e.read_nonfinite = false;
  }
  std::vector<std::array<std::size_t, 3>> counts(out.size(), {0, 0, 0});
  auto add = [](std::optional<double>& total, std::size_t& n, std::optional<double> e) {
    if (!e) return;
    total = total.value_or(0.0) + *e;
    ++n;
  };
  for (auto const& r : reports) {
    if (r.skipped) continue;
    for (std::size_t i = 0; i < out.size() && i < r.layers.size(); ++i) {
      out[i].read_nonfinite = out[i].read_nonfinite || r.layers[i].read_nonfinite;
      add(out[i].output, counts[i][0], r.layers[i].output);
      add(out[i].input_gradient, counts[i][1], r.layers[i].input_gradient);
      add(out[i].weight_gradient, counts[i][2], r.layers[i].weight_gradient);
    }
  }
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (out[i].output) *out[i].output /= static_cast<double>(counts[i][0]);
    if (out[i].input_gradient) *out[i].input_gradient /= static_cast<double>(counts[i][1]);
    if (out[i].weight_gradient) *out[i].weight_gradient /= static_cast<double>(counts[i][2]);
  }
  return out;
}

//! The end-of-run table: each layer's mean error over the reports, and the layers that
//! cost the most precision named below it.
inline std::string shadow_table(std::vector<shadow_report> const& reports) {
  if (reports.empty()) return "Precision budget: no shadow step ran\n";
  auto const mean = mean_layer_errors(reports);
  std::size_t skipped = 0;
  for (auto const& r : reports) skipped += r.skipped;
  std::size_t name_width = 5, policy_width = 6;
  for (auto const& e : mean) {
    name_width = std::max(name_width, e.layer.size() + e.kind.size() + 3);
    policy_width = std::max(policy_width, e.policy.size());
  }
  std::size_t const counted = reports.size() - skipped;
  std::string out = "Precision budget: each layer against its float32 twin, relative L2 error, mean of " +
                    std::to_string(counted) + " shadow step" + (counted == 1 ? "" : "s") + "\n";
  if (skipped)
    out += "(" + std::to_string(skipped) + " more shadow step" + (skipped == 1 ? "" : "s") +
           " overflowed and were skipped: left out; find_nonfinite names where an overflow begins)\n";
  char line[512];
  std::snprintf(line, sizeof line, "%-*s %-*s %10s %11s %12s\n", static_cast<int>(name_width), "Layer (type)",
                static_cast<int>(policy_width), "Policy", "output", "input grad", "weight grad");
  out += line;
  out += std::string(name_width + policy_width + 37, '-') + "\n";
  for (auto const& e : mean) {
    std::string const who = e.layer + " (" + e.kind + ")";
    if (!e.skipped.empty()) {
      std::snprintf(line, sizeof line, "%-*s %-*s  not measured: %s\n", static_cast<int>(name_width), who.c_str(),
                    static_cast<int>(policy_width), e.policy.c_str(), e.skipped.c_str());
    } else {
      std::snprintf(line, sizeof line, "%-*s %-*s %10s %11s %12s%s\n", static_cast<int>(name_width), who.c_str(),
                    static_cast<int>(policy_width), e.policy.c_str(), detail::error_text(e.output).c_str(),
                    detail::error_text(e.input_gradient).c_str(), detail::error_text(e.weight_gradient).c_str(),
                    e.read_nonfinite ? "  (it read non-finite values)" : "");
    }
    out += line;
  }
  // The costliest: up to three layers by their worst error, NaN first; not those that
  // only passed on the non-finite values they read.
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < mean.size(); ++i)
    if (mean[i].worst() && *mean[i].worst() != 0.0 && !mean[i].read_nonfinite) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {  // ties: the model's order
    double const x = *mean[a].worst(), y = *mean[b].worst();
    if (std::isnan(x) != std::isnan(y)) return std::isnan(x);
    if (std::isnan(x) || x == y) return a < b;
    return x > y;
  });
  if (order.size() > 3) order.resize(3);
  if (!order.empty()) {
    out += "Costliest:";
    for (std::size_t k = 0; k < order.size(); ++k) {
      auto const& e = mean[order[k]];
      char const* what = "weight gradients";
      auto const is_worst = [&](std::optional<double> v) {
        return v && (std::isnan(*e.worst()) ? std::isnan(*v) : *v == *e.worst());
      };
      if (is_worst(e.output)) what = "output";
      else if (is_worst(e.input_gradient)) what = "input gradient";
      out += std::string(k ? "," : "") + " " + e.layer + " (" + what + " " + detail::error_text(e.worst()) + ")";
    }
    out += "\n";
  }
  return out;
}

}  // namespace mpx
