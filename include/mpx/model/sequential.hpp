// mpx::sequential: a stack of typed layers held in a boost::hana::tuple, each with its
// own policy, like keras.Sequential under a mixed-precision policy.
//
//   auto model = mpx::sequential<mpx::mixed_float16>(          // the model-wide policy
//       mpx::dense<>(128, mpx::activation::relu),              // takes it: mixed_float16
//       mpx::dense<>(10),
//       mpx::softmax_layer<mpx::float32>());                   // overrides it, as Keras advises
//   model.build(exec, {784}, /*seed=*/1);                      // per-sample input shape
//
// Where one layer writes a dtype its successor does not read (half logits into a
// float32 softmax), the model casts between them itself; the summary shows the cast.
// A layer that declares `accepts_cast = false` refuses that at compile time, naming
// both layer types. Activations and gradients live in buffers the model reserves for a
// batch size once, so a training step allocates nothing and (on CUDA) never waits for
// the host.
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/exec/tensor_ref.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/layers/layer.hpp>

#include <boost/hana/at.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/length.hpp>
#include <boost/hana/tuple.hpp>
#include <boost/hana/unpack.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx {

namespace detail {

//! L with model_policy replaced by P (L itself when it has a policy of its own).
template <class L, class P>
struct resolve_policy {
  using type = L;
};
template <template <class> class L, class P>
struct resolve_policy<L<model_policy>, P> {
  using type = L<P>;
};

template <class L, class P>
auto with_model_policy(L&& layer) {
  using R = typename resolve_policy<std::remove_cvref_t<L>, P>::type;
  if constexpr (requires { std::move(layer).template with_policy<P>(); })
    return std::move(layer).template with_policy<P>();  // a composite (mpx::residual) resolves its parts
  else if constexpr (std::is_same_v<R, std::remove_cvref_t<L>>) return R(std::forward<L>(layer));
  else return R(layer.config());
}

template <class L>
constexpr bool accepts_cast() {
  if constexpr (requires { L::accepts_cast; }) return L::accepts_cast;
  else return true;
}
template <class L>
constexpr bool is_softmax_layer() {
  if constexpr (requires { L::is_softmax; }) return L::is_softmax;
  else return false;
}

//! Instantiated for each pair of neighbours; a refusal's note names both layer types.
template <class Previous, class Next>
struct neighbouring_layers {
  static constexpr bool same_dtype = std::is_same_v<typename Previous::output_type, typename Next::input_type>;
  static_assert(same_dtype || accepts_cast<Next>(),
                "mpx::sequential: these neighbouring layers cannot work together: the second reads its input in "
                "a dtype the first does not write, and it declares accepts_cast = false, so the model may not "
                "insert a cast. Give both layers policies with the same storage type (the layer types, with "
                "their policies, are in the 'required from' note below)");
  static constexpr bool needs_cast = !same_dtype;
};

//! One layer and the buffers the model keeps around it.
template <class L>
struct model_node {
  using input_type = typename L::input_type;
  using output_type = typename L::output_type;
  L layer;
  bool casts_input = false;                 //!< the previous layer writes another dtype
  layer_tensor<input_type> input_cast;      //!< the previous output in this layer's dtype
  layer_tensor<output_type> output;         //!< y
  layer_tensor<output_type> output_grad;    //!< dL/dy, when the next layer's dx is another dtype
  layer_tensor<input_type> input_grad;      //!< dL/dx (not for the first layer)

  explicit model_node(L&& l) : layer(std::move(l)) {}
};

inline std::string lowercase_kind(std::string_view kind) {
  std::string out;
  for (std::size_t i = 0; i < kind.size(); ++i) {
    char const c = kind[i];
    bool const upper = c >= 'A' && c <= 'Z';
    // "MaxPool2D" -> "max_pool2d", "LayerNormalization" -> "layer_normalization"
    if (upper && i > 0 && !(kind[i - 1] >= 'A' && kind[i - 1] <= 'Z') && !(kind[i - 1] >= '0' && kind[i - 1] <= '9'))
      out += '_';
    out += upper ? static_cast<char>(c - 'A' + 'a') : c;
  }
  return out;
}

}  // namespace detail

//! What one layer read and wrote in the latest forward and backward, as untyped views
//! (see trace()). A gradient the latest backward did not write is empty (size 0).
template <memory_space Space>
struct layer_trace {
  std::string name, kind, policy;
  tensor_ref<Space> input, output;
  tensor_ref<Space> output_gradient;  //!< dL/d(output) the layer read; empty for the layer backward began at
  tensor_ref<Space> input_gradient;   //!< dL/d(input) it wrote; empty for the first layer
  std::vector<parameter<Space>> parameters;  //!< values, and gradients when in_backward
  bool in_backward = false;                  //!< the latest backward (since the forward) ran this layer
  bool composite = false;  //!< a residual block or a repeat: its parts' layers are listed before it
};

//! What a model's latest forward and backward left behind for logits(), trace() and
//! backward (the batch, the input's address, where backpropagation began), and the same
//! of the models inside its composite layers (a residual's branch, a repeat's copies), in
//! order. A replayed CUDA graph reruns them without the host, so classifier_trainer puts
//! back the state its capture left after each replay.
struct model_in_flight {
  std::int64_t batch = 0;
  void const* input = nullptr;
  std::size_t backward_top = static_cast<std::size_t>(-1);
  void const* top_gradient = nullptr;
  void* input_gradient = nullptr;  //!< where the latest backward wrote dL/d(input), if the caller keeps it
  bool training = false;           //!< the latest forward's mode (dropout and batch norm)
  std::vector<model_in_flight> parts;
};

//! What backward_to_input's caller does with the input gradient it asked for: adds to it
//! (a residual block adds the skip path's gradient, so the buffer is not the branch's to
//! answer for) or keeps it as written (a repeat's copies pass it on to the previous copy,
//! and the model's walks show it as the first layer's input gradient).
enum class input_gradient_use { summed_by_caller, kept };

template <class... Layers>
class sequential_model {
  static_assert(sizeof...(Layers) > 0, "mpx::sequential needs at least one layer");
  static_assert((layer<Layers> && ...),
                "mpx::sequential: every argument must be an mpx layer (mpx::dense, mpx::conv2d, ...) or a type "
                "that models mpx::layer (policy, input_type, output_type, kind, build, reserve, forward, backward, "
                "append_parameters, parameter_count)");

  static constexpr std::size_t count = sizeof...(Layers);
  using nodes_type = boost::hana::tuple<detail::model_node<Layers>...>;
  template <std::size_t I>
  using layer_at = std::tuple_element_t<I, std::tuple<Layers...>>;

 public:
  using first_layer = layer_at<0>;
  using last_layer = layer_at<count - 1>;
  using input_type = typename first_layer::input_type;
  using output_type = typename last_layer::output_type;
  //! When the last layer is a softmax, the loss reads its input: the logits.
  static constexpr bool ends_in_softmax = detail::is_softmax_layer<last_layer>() && count > 1;
  using logits_type = std::conditional_t<ends_in_softmax, typename last_layer::input_type, output_type>;

  explicit sequential_model(Layers... layers) : nodes_(detail::model_node<Layers>(std::move(layers))...) {
    check_neighbours(std::make_index_sequence<count - 1>{});
  }

  static constexpr std::size_t size() noexcept { return count; }

  //! Layer I, to inspect or to call directly.
  template <std::size_t I>
  [[nodiscard]] auto& layer() noexcept {
    return boost::hana::at_c<I>(nodes_).layer;
  }

  //! Names the layers like Keras ("conv2d", "conv2d_1", "dense"), computes every shape
  //! from the per-sample input shape, and allocates and initialises the parameters where
  //! exec computes. Layer i is initialised from seed + 1000 * i (an mpx::repeat counts as
  //! the layers it repeats). A shape a layer cannot
  //! take throws mpx::shape_error naming the layer and the shape.
  template <executor Exec>
  void build(Exec const& exec, shape const& sample_input, std::uint64_t seed) {
    // Counted first: a layer that throws leaves the layers before it allocated anew.
    ++history_->builds;  // parameters handed out before are freed tensors now
    ++buffer_generation_;
    std::vector<std::string> used;
    shape in = sample_input;
    std::size_t i = 0;
    boost::hana::for_each(nodes_, [&](auto& node) {
      std::string const base = detail::lowercase_kind(std::remove_cvref_t<decltype(node.layer)>::kind);
      std::size_t same = 0;
      for (auto const& u : used) same += u == base;
      used.push_back(base);
      node.layer.set_name(same ? base + "_" + std::to_string(same) : base);
      node.layer.build(exec, in, seed + 1000 * i);
      in = node.layer.output_shape();
      i += detail::seed_slots(node.layer);
    });
    input_shape_ = sample_input;
    built_with_ = std::remove_cvref_t<Exec>::name;
    built_in_ = memory_space_t<Exec>::name;
    built_ = true;
    batch_ = 0;
  }

  //! Tells the optimizers made from this model's parameters that its weights were written
  //! from outside them (load_model calls it; call it after writing weights yourself): an
  //! optimizer that keeps float master copies then refuses its next step until its
  //! reload_master_weights(exec) copies the new weights.
  void weights_replaced() noexcept {
    ++history_->weight_loads;
    for_each_part_model([](auto& part) { part.weights_replaced(); });  // optimizers made from a part's parameters
  }

  //! Allocates activations, gradients and every layer's workspace for batches of up to
  //! `batch` samples. Called by forward when a larger batch arrives; call it yourself
  //! before capturing a CUDA graph.
  template <executor Exec>
  void reserve(Exec const& exec, std::int64_t batch) {
    require_built_for<Exec>("reserve");
    if (batch <= 0) detail::fail<invalid_argument>("sequential::reserve", "the batch must be positive");
    std::size_t i = 0;
    boost::hana::for_each(nodes_, [&](auto& node) {
      node.layer.reserve(exec, batch);
      node.output.ensure(exec, detail::with_batch(batch, node.layer.output_shape()));
      node.output_grad.ensure(exec, detail::with_batch(batch, node.layer.output_shape()));
      if (node.casts_input) node.input_cast.ensure(exec, detail::with_batch(batch, node.layer.input_shape()));
      if (i > 0) node.input_grad.ensure(exec, detail::with_batch(batch, node.layer.input_shape()));
      ++i;
    });
    batch_ = batch;
    ++buffer_generation_;
  }

  //! What forward(x of dtype T, batch samples) would allocate, done now on exec's stream:
  //! reserve(exec, batch) if the buffers are smaller, and the buffer that casts such an
  //! input for the first layer when T is not its dtype. Call it before capturing a CUDA
  //! graph of steps on another stream (classifier_trainer does).
  template <class T, executor Exec>
  void reserve_for_input(Exec const& exec, std::int64_t batch) {
    if (batch > batch_) reserve(exec, batch);
    if constexpr (!std::is_same_v<T, input_type>) {
      auto& node = boost::hana::at_c<0>(nodes_);
      if (node.input_cast.ensure(exec, detail::with_batch(batch, node.layer.input_shape()))) ++buffer_generation_;
    }
  }

  //! What the latest forward and backward left behind (see mpx::model_in_flight), the
  //! composite layers' parts included.
  using in_flight = model_in_flight;
  [[nodiscard]] in_flight in_flight_state() const {
    in_flight s{batch_in_flight_, first_input_, backward_top_, top_gradient_, kept_input_gradient_, training_in_flight_, {}};
    for_each_part_model([&](auto const& part) { s.parts.push_back(part.in_flight_state()); });
    return s;
  }
  //! Puts back what in_flight_state() returned (after a CUDA graph's replay). Allocates nothing.
  void restore_in_flight_state(in_flight const& s) noexcept {
    batch_in_flight_ = s.batch;
    first_input_ = s.input;
    backward_top_ = s.backward_top;
    top_gradient_ = s.top_gradient;
    kept_input_gradient_ = s.input_gradient;
    training_in_flight_ = s.training;
    std::size_t i = 0;
    for_each_part_model([&](auto& part) {
      if (i < s.parts.size()) part.restore_in_flight_state(s.parts[i]);
      ++i;
    });
  }
  //! The latest forward's batch (0 before the first).
  [[nodiscard]] std::int64_t batch_in_flight() const noexcept { return batch_in_flight_; }

  //! The largest batch the buffers hold now (0 before the first reserve or forward).
  [[nodiscard]] std::int64_t reserved_batch() const noexcept { return batch_; }
  //! Changes whenever build or reserve may have moved a parameter, activation or
  //! workspace: a CUDA graph captured before holds stale addresses and must be captured
  //! again (classifier_trainer does).
  [[nodiscard]] std::uint64_t buffer_generation() const noexcept { return buffer_generation_; }

  //! Runs every layer on x ([batch, input shape...], any float dtype: cast when it is not
  //! the first layer's) and returns a view of the last layer's output, valid until the
  //! next forward. `training` selects dropout's and batch norm's training behaviour.
  template <executor Exec, class T, class Space = memory_space_t<Exec>>
  tensor_view<output_type const, Space> forward(Exec const& exec, tensor_view<T const, Space> x, bool training) {
    static_assert(std::is_same_v<T, input_type> || (dtype<T> && dtype<input_type>),
                  "mpx::sequential::forward: the input's element type is neither the first layer's input type nor "
                  "a float type the model can cast to it (float, half, bfloat16, fp8): cast integer data to float "
                  "first, scaled as the model expects (e.g. pixels / 255); an embedding takes std::int32_t ids");
    require_built_for<Exec>("forward");
    detail::require_batch_shape("sequential", "the model's input", x.shape(), input_shape_);
    std::int64_t const batch = x.shape()[0];
    if (batch > batch_) reserve(exec, batch);
    backward_top_ = no_backward;  // the gradients no longer belong to these activations
    kept_input_gradient_ = nullptr;
    training_in_flight_ = training;
    forward_from<0>(exec, x, batch, training);
    auto& last = boost::hana::at_c<count - 1>(nodes_);
    return last.output.template view<Space>(detail::with_batch(batch, last.layer.output_shape()));
  }
  template <executor Exec, class T, class Space>
    requires(!std::is_const_v<T>)
  tensor_view<output_type const, Space> forward(Exec const& exec, tensor_view<T, Space> x, bool training) {
    return forward(exec, tensor_view<T const, Space>(x), training);
  }
  template <executor Exec, class T, class Space>
  tensor_view<output_type const, Space> forward(Exec const& exec, tensor<T, Space> const& x, bool training) {
    return forward(exec, x.view(), training);
  }

  //! The logits of the latest forward: the softmax's input when the model ends in a
  //! softmax, else the model's output.
  template <memory_space Space>
  [[nodiscard]] tensor_view<logits_type const, Space> logits() const {
    if constexpr (ends_in_softmax) return input_of<count - 1, Space>(batch_in_flight_);
    else {
      auto const& last = boost::hana::at_c<count - 1>(nodes_);
      return last.output.template view<Space>(detail::with_batch(batch_in_flight_, last.layer.output_shape()));
    }
  }
  template <executor Exec>
  [[nodiscard]] tensor_view<logits_type const, memory_space_t<Exec>> logits(Exec const&) const {
    require_built_for<Exec>("logits");
    return logits<memory_space_t<Exec>>();
  }

  //! A float buffer shaped like logits() for the latest forward's batch (a short last
  //! batch included), for a loss to write dL/d(logits) into and backward_from_logits to
  //! read: kept in float so a loss scale multiplies it before any rounding. The model
  //! owns it (allocated at the first call, grown with the batch); valid until the next
  //! call, its contents are whatever was written last.
  template <executor Exec>
  [[nodiscard]] tensor_view<float, memory_space_t<Exec>> logits_gradient(Exec const& exec) {
    require_built_for<Exec>("logits_gradient");
    if (batch_in_flight_ == 0)
      detail::fail<invalid_argument>("sequential::logits_gradient", "no forward has run yet: its shape is the "
                                                                    "latest forward's logits'");
    shape const per_sample = boost::hana::at_c<count - 1>(nodes_).layer.output_shape();  // (a softmax keeps the shape)
    if (logits_gradient_.ensure(exec, detail::with_batch(std::max(batch_, batch_in_flight_), per_sample)))
      ++buffer_generation_;
    return logits_gradient_.template view<memory_space_t<Exec>>(detail::with_batch(batch_in_flight_, per_sample));
  }

  //! Backpropagates dL/d(output) (any float dtype, the output's shape) through every
  //! layer after forward(..., training = true): each layer's parameter gradients are
  //! overwritten.
  //! A backward with no forward since the previous backward is refused (it would
  //! backpropagate the previous batch again); see allow_backward_without_forward.
  template <executor Exec, class G, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<G const, Space> d_output) {
    require_built_for<Exec>("backward");
    begin_backward("backward", count - 1);
    kept_input_gradient_ = nullptr;
    backward_into<count - 1>(exec, d_output);
  }
  //! Backpropagates dL/d(logits) (see logits()): a model ending in a softmax skips its
  //! backward pass, as the loss was computed from the logits.
  template <executor Exec, class G, class Space = memory_space_t<Exec>>
  void backward_from_logits(Exec const& exec, tensor_view<G const, Space> d_logits) {
    require_built_for<Exec>("backward_from_logits");
    begin_backward("backward_from_logits", ends_in_softmax ? count - 2 : count - 1);
    kept_input_gradient_ = nullptr;
    if constexpr (ends_in_softmax) backward_into<count - 2>(exec, d_logits);
    else backward_into<count - 1>(exec, d_logits);
  }
  //! Lets a backward follow a backward with no forward between them, for code that
  //! backpropagates one batch several times on purpose (probe_loss_scales does, one
  //! loss scale after another). Returns the previous setting.
  bool allow_backward_without_forward(bool allow) noexcept {
    for_each_part_model([&](auto& part) { part.allow_backward_without_forward(allow); });  // (they run inside ours)
    return std::exchange(repeat_backward_allowed_, allow);
  }
  template <executor Exec, class G, class Space>
    requires(!std::is_const_v<G>)
  void backward(Exec const& exec, tensor_view<G, Space> d_output) {
    backward(exec, tensor_view<G const, Space>(d_output));
  }
  template <executor Exec, class G, class Space>
    requires(!std::is_const_v<G>)
  void backward_from_logits(Exec const& exec, tensor_view<G, Space> d_logits) {
    backward_from_logits(exec, tensor_view<G const, Space>(d_logits));
  }

  //! backward, also writing dL/d(input) into dx (the first layer's input dtype, the
  //! input's shape): what a residual block needs of its branch, and a repeat of each copy.
  //! With input_gradient_use::kept, visit_in_flight and trace show dx as the first
  //! layer's input gradient until the next forward.
  template <executor Exec, class G, class Space>
  void backward_to_input(Exec const& exec, tensor_view<G const, Space> d_output, tensor_view<input_type, Space> dx,
                         input_gradient_use use = input_gradient_use::summed_by_caller) {
    input_gradient_ = dx.data();
    try {
      backward(exec, d_output);
    } catch (...) {
      input_gradient_ = nullptr;
      throw;
    }
    kept_input_gradient_ = use == input_gradient_use::kept ? input_gradient_ : nullptr;
    input_gradient_ = nullptr;
  }

  //! Every trainable tensor and its gradient, named "<layer>/<tensor>", for an optimizer.
  template <memory_space Space>
  [[nodiscard]] std::vector<parameter<Space>> parameters() {
    require_built_in<Space>("parameters");
    std::vector<parameter<Space>> out;
    boost::hana::for_each(nodes_, [&](auto& node) { node.layer.template append_parameters<Space>(out); });
    for (auto& p : out) {  // an optimizer's step checks a backward ran, and these are still the model's
      p.written_by = history_;
      p.build = history_->builds;
    }
    return out;
  }
  template <executor Exec>
  [[nodiscard]] std::vector<parameter<memory_space_t<Exec>>> parameters(Exec const&) {
    return parameters<memory_space_t<Exec>>();
  }

  //! Calls `f(first)` after each layer's backward (and inside a composite layer, after
  //! each of its parts' layers), where `first` is that layer's first
  //! parameter in parameters() order: from it on, every gradient is final for this
  //! backward pass (a data-parallel job starts averaging them while the earlier layers
  //! still run backward). An empty function removes it. Space: the model's memory.
  template <memory_space Space>
  void on_gradients_final(std::function<void(std::size_t)> f) {
    require_built("on_gradients_final");
    layer_first_parameter_.clear();
    std::size_t n = 0;
    boost::hana::for_each(nodes_, [&](auto& node) {
      layer_first_parameter_.push_back(n);
      // A composite's parts say so after each of their layers, not only after the whole.
      if constexpr (composite_layer<std::remove_cvref_t<decltype(node.layer)>>) {
        std::function<void(std::size_t)> from_part;
        if (f) from_part = [f, n](std::size_t first) { f(n + first); };
        node.layer.template on_part_gradients_final<Space>(std::move(from_part));
      }
      std::vector<parameter<Space>> counted;  // only counted
      node.layer.template append_parameters<Space>(counted);
      n += counted.size();
    });
    gradients_final_ = std::move(f);
  }

  [[nodiscard]] std::size_t parameter_count() const {
    std::size_t n = 0;
    boost::hana::for_each(nodes_, [&](auto const& node) { n += node.layer.parameter_count(); });
    return n;
  }

  [[nodiscard]] shape const& input_shape() const noexcept { return input_shape_; }
  [[nodiscard]] shape output_shape() const { return boost::hana::at_c<count - 1>(nodes_).layer.output_shape(); }

  //! A table like Keras's model.summary(): layer, output shape, policy, parameters, and
  //! the casts the model inserted.
  [[nodiscard]] std::string summary() const {
    summary_row const header{"Layer (type)", "Output shape", "Policy", "Param #"};
    std::vector<summary_row> const rows = summary_rows();
    // Keras's widths, widened to the longest entry (a layer deep in a residual block)
    // so every column stays in line.
    std::array<std::size_t, 4> width{40, 20, 22, 10};
    for (auto const& r : rows)
      for (std::size_t c = 0; c < 4; ++c) width[c] = std::max(width[c], r[c].size());
    std::string out;
    auto row = [&](summary_row const& r) {
      for (std::size_t c = 0; c < 4; ++c) {
        std::string const pad(width[c] - std::min(width[c], r[c].size()), ' ');
        out += c == 3 ? pad + r[c] : r[c] + pad + " ";  // the count right-aligned
      }
      out += "\n";
    };
    std::string const rule(width[0] + width[1] + width[2] + width[3] + 3, '-');
    row(header);
    out += rule + "\n";
    for (auto const& r : rows) row(r);
    out += rule + "\n";
    out += "Total params: " + std::to_string(parameter_count()) + "\n";
    out += fp8_placement_notes();
    return out;
  }

  //! summary()'s rows (layer, output shape, policy, parameters), casts and the layers of
  //! a composite's parts (a residual block's branch, a repeat's copies) included (indented).
  using summary_row = std::array<std::string, 4>;
  [[nodiscard]] std::vector<summary_row> summary_rows() const {
    require_built("summary");
    std::vector<summary_row> rows;
    boost::hana::for_each(nodes_, [&](auto const& node) {
      using L = std::remove_cvref_t<decltype(node.layer)>;
      if constexpr (dtype<typename L::input_type>)  // (token ids are never cast)
        if (node.casts_input)
          rows.push_back({"  (cast to " + std::string(dtype_name<typename L::input_type>) + ")", "", "inserted by the model", "0"});
      std::string shp = node.layer.output_shape().to_string();
      shp = "(None, " + shp.substr(1, shp.size() - 2) + ")";
      rows.push_back({node.layer.name() + " (" + std::string(L::kind) + ")", shp, std::string(L::policy::name),
                      std::to_string(node.layer.parameter_count())});
      if constexpr (composite_layer<L>)
        for (auto const& r : node.layer.part_summary_rows()) rows.push_back(r);
    });
    return rows;
  }

  //! What one layer read and wrote in the latest forward and backward (see mpx::layer_trace).
  template <memory_space Space>
  using layer_trace = mpx::layer_trace<Space>;

  //! Every layer's trace, in order, for diagnostics (find_nonfinite). Valid after a
  //! forward; the gradients after a backward, until the next forward.
  template <memory_space Space>
  [[nodiscard]] std::vector<layer_trace<Space>> trace() {
    require_built("trace");
    if (batch_in_flight_ == 0)
      detail::fail<invalid_argument>("sequential::trace", "no forward has run yet");
    std::vector<layer_trace<Space>> out;
    visit_in_flight<Space>([&](std::string const& name, auto& layer, auto x, auto y, auto dy, auto dx, bool ran_backward,
                               bool began_here) {
      using L = std::remove_cvref_t<decltype(layer)>;
      layer_trace<Space> t;
      t.name = name;
      t.kind = std::string(L::kind);
      t.policy = std::string(L::policy::name);
      using In = typename L::input_type;
      using Out = typename L::output_type;
      if constexpr (dtype<In>) {  // (token ids, an embedding's input, are not a float tensor: not traced)
        t.input = tensor_view<In, Space>(const_cast<In*>(x.data()), x.shape());  // read only
        if (dx.data()) t.input_gradient = tensor_view<In, Space>(const_cast<In*>(dx.data()), dx.shape());
      }
      t.output = tensor_view<Out, Space>(const_cast<Out*>(y.data()), y.shape());
      if (dy.data() && !began_here) t.output_gradient = tensor_view<Out, Space>(const_cast<Out*>(dy.data()), dy.shape());
      t.in_backward = ran_backward;
      // A composite's parameters are its parts' layers', listed with them.
      if constexpr (!composite_layer<L>) layer.template append_parameters<Space>(t.parameters);
      t.composite = composite_layer<L>;
      out.push_back(std::move(t));
    });
    return out;
  }

  //! Calls f(name, layer, x, y, dy, dx, in_backward, backward_began_here) for every
  //! layer of the latest forward, in order, with typed views: x what the layer read and
  //! y what it wrote; dy the gradient of y it read and dx the gradient of x it wrote in
  //! the latest backward (empty where it did not: the first layer writes no dx of its own;
  //! a residual block's branch writes it into the block's buffer, which then adds the
  //! skip connection's; a repeat's copies keep theirs, and show it). Where
  //! the backward began, dy is the caller's gradient (or the model's cast of it): valid
  //! only while the caller's buffer is. A composite's parts' layers come before it: a
  //! residual block's named "<block>/<layer>", a repeat's "<repeat>/<copy>/<layer>". Otherwise the views are valid as trace()'s are.
  //! model_shadow uses it.
  template <memory_space Space, class F>
  void visit_in_flight(F&& f, std::string const& prefix = {}) {
    require_built("visit_in_flight");
    if (batch_in_flight_ == 0)
      detail::fail<invalid_argument>("sequential::visit_in_flight", "no forward has run yet");
    visit_from<0, Space>(f, prefix);
  }

  //! How many layer positions this model's layers take when seeds are handed out
  //! (detail::seed_slots): a residual branch or a repeat's block counts its own.
  [[nodiscard]] std::size_t seed_slots() const {
    std::size_t n = 0;
    boost::hana::for_each(nodes_, [&](auto const& node) { n += detail::seed_slots(node.layer); });
    return n;
  }

  //! The same model, not built (its layers made again from their configurations): what
  //! mpx::repeat makes its copies of a block with.
  [[nodiscard]] sequential_model unbuilt_copy() const {
    return boost::hana::unpack(nodes_, [](auto const&... node) { return sequential_model(detail::unbuilt_copy(node.layer)...); });
  }

  //! Visits every layer in order (for save/load, diagnostics, a user's own walk).
  template <class F>
  void for_each_layer(F&& f) {
    boost::hana::for_each(nodes_, [&](auto& node) { f(node.layer); });
  }
  template <class F>
  void for_each_layer(F&& f) const {
    boost::hana::for_each(nodes_, [&](auto const& node) { f(node.layer); });
  }

 private:
  //! f(part) for each model inside the composite layers, in order (no names made: a
  //! CUDA graph's replay restores the parts' state through it).
  template <class F>
  void for_each_part_model(F&& f) const {
    for_each_layer([&](auto const& layer) {
      if constexpr (composite_layer<std::remove_cvref_t<decltype(layer)>>) layer.for_each_part_model(f);
    });
  }
  template <class F>
  void for_each_part_model(F&& f) {
    for_each_layer([&](auto& layer) {
      if constexpr (composite_layer<std::remove_cvref_t<decltype(layer)>>) layer.for_each_part_model(f);
    });
  }

  template <std::size_t... I>
  void check_neighbours(std::index_sequence<I...>) {
    ((boost::hana::at_c<I + 1>(nodes_).casts_input = detail::neighbouring_layers<layer_at<I>, layer_at<I + 1>>::needs_cast),
     ...);
  }

  void require_built(std::string_view what) const {
    if (!built_)
      detail::fail<invalid_argument>("sequential", std::string(what) +
                                                            " before build(exec, input_shape, seed)");
  }

  //! A model lives where the executor it was built with keeps memory: running it with
  //! another executor, or asking for its parameters in another space, is refused at the
  //! first call, naming both.
  template <class Exec>
  void require_built_for(std::string_view what) const {
    require_built(what);
    if (built_with_ != std::remove_cvref_t<Exec>::name)
      refuse_elsewhere(what, "is run with mpx::" + std::string(std::remove_cvref_t<Exec>::name) +
                                 "_executor: build it with the executor that runs it");
  }
  template <class Space>
  void require_built_in(std::string_view what) const {
    require_built(what);
    if (built_in_ != Space::name) refuse_elsewhere(what, "its parameters were asked for in " + std::string(Space::name));
  }
  [[noreturn]] void refuse_elsewhere(std::string_view what, std::string const& but) const {
    detail::fail<invalid_argument>("sequential::" + std::string(what),
                                   "the model was built with mpx::" + std::string(built_with_) +
                                       "_executor (its parameters are in " + std::string(built_in_) + ") but " + but);
  }

  //! The summary's note on fp8 where it hurts most: the first layer reads the raw
  //! inputs, the logits layer makes the model's output (docs/fp8_training.md).
  [[nodiscard]] std::string fp8_placement_notes() const {
    constexpr std::size_t logits_layer = ends_in_softmax && count > 1 ? count - 2 : count - 1;
    std::string out;
    auto note = [&](auto const& layer, std::string_view role) {
      using P = typename std::remove_cvref_t<decltype(layer)>::policy;
      if constexpr (policy_type<P>)
        if constexpr (computes_in_fp8<P>)
          out += "Note: " + layer.name() + " (" + std::string(role) +
                 ") computes in fp8; keep it in bfloat16 with mpx::without_fp8<mpx::" + std::string(P::name) +
                 "> as Transformer Engine advises (docs/fp8_training.md)\n";
    };
    note(boost::hana::at_c<0>(nodes_).layer, "the first layer, it reads the raw inputs");
    if constexpr (logits_layer > 0) note(boost::hana::at_c<logits_layer>(nodes_).layer, "it makes the logits");
    return out;
  }

  void begin_backward(std::string_view what, std::size_t top) {
    std::string const op = "sequential::" + std::string(what);
    if (batch_in_flight_ == 0)
      detail::fail<invalid_argument>(op, "no forward has run yet: call forward(exec, x, /*training=*/true), "
                                         "then backpropagate the loss's gradient");
    if (backward_top_ != no_backward && !repeat_backward_allowed_)
      detail::fail<invalid_argument>(
          op, "no forward since the previous backward: this would backpropagate the previous batch's activations "
              "again. Call forward(exec, x, true) on the next batch first, or allow_backward_without_forward(true) "
              "if backpropagating the same batch again is what you mean");
    backward_top_ = top;
    ++history_->passes;
  }

  //! The input layer I read in the latest forward (a view of the cast buffer when it
  //! casts, else of layer I-1's output).
  template <std::size_t I, class Space>
  auto input_of(std::int64_t batch) const {
    auto const& node = boost::hana::at_c<I>(nodes_);
    using In = typename layer_at<I>::input_type;
    shape const s = detail::with_batch(batch, node.layer.input_shape());
    if constexpr (I == 0) {
      return tensor_view<In const, Space>(static_cast<In const*>(first_input_), s);
    } else {
      if (node.casts_input) return tensor_view<In const, Space>(node.input_cast.template view<Space>(s));
      if constexpr (std::is_same_v<typename layer_at<I - 1>::output_type, In>)
        return tensor_view<In const, Space>(boost::hana::at_c<I - 1>(nodes_).output.template view<Space>(s));
      else return tensor_view<In const, Space>{};  // unreachable: a dtype change always casts
    }
  }

  template <std::size_t I, class Exec, class T, class Space>
  void forward_from(Exec const& exec, tensor_view<T const, Space> x, std::int64_t batch, bool training) {
    auto& node = boost::hana::at_c<I>(nodes_);
    using In = typename layer_at<I>::input_type;
    shape const in_shape = detail::with_batch(batch, node.layer.input_shape());
    tensor_view<In const, Space> in;
    if constexpr (std::is_same_v<T, In>) {
      in = x.reshape(in_shape);
    } else {
      if constexpr (I == 0)  // the caller's dtype is known only now
        if (node.input_cast.ensure(exec, in_shape)) ++buffer_generation_;
      auto cast_buffer = node.input_cast.template view<Space>(in_shape);
      cast(exec, x.reshape(in_shape), cast_buffer);
      in = cast_buffer;
    }
    if constexpr (I == 0) {
      first_input_ = in.data();
      batch_in_flight_ = batch;
    }
    auto out = node.output.template view<Space>(detail::with_batch(batch, node.layer.output_shape()));
    node.layer.forward(exec, in, out, training);
    if constexpr (I + 1 < count) forward_from<I + 1>(exec, tensor_view<typename layer_at<I>::output_type const, Space>(out), batch, training);
  }

  //! Runs layer I's backward from dy (any dtype: cast to the layer's output type if it
  //! differs), then continues with layer I-1.
  template <std::size_t I, class Exec, class G, class Space>
  void backward_into(Exec const& exec, tensor_view<G const, Space> dy) {
    auto& node = boost::hana::at_c<I>(nodes_);
    using L = layer_at<I>;
    using Out = typename L::output_type;
    using In = typename L::input_type;
    std::int64_t const batch = batch_in_flight_;
    shape const out_shape = detail::with_batch(batch, node.layer.output_shape());
    tensor_view<Out const, Space> dy_typed;
    if constexpr (std::is_same_v<G, Out>) {
      dy_typed = dy.reshape(out_shape);
    } else {
      auto buf = node.output_grad.template view<Space>(out_shape);
      cast(exec, dy.reshape(out_shape), buf);
      dy_typed = buf;
    }
    if (I == backward_top_) top_gradient_ = dy_typed.data();
    auto const x = input_of<I, Space>(batch);
    auto const y = tensor_view<Out const, Space>(node.output.template view<Space>(out_shape));
    tensor_view<In, Space> dx;
    if constexpr (I > 0) dx = node.input_grad.template view<Space>(detail::with_batch(batch, node.layer.input_shape()));
    else if (input_gradient_)
      dx = tensor_view<In, Space>(static_cast<In*>(input_gradient_), detail::with_batch(batch, node.layer.input_shape()));
    node.layer.backward(exec, x, y, dy_typed, dx);
    if (gradients_final_) gradients_final_(layer_first_parameter_[I]);
    if constexpr (I > 0) backward_into<I - 1>(exec, tensor_view<In const, Space>(dx));
  }

  template <std::size_t I, class Space, class F>
  void visit_from(F& f, std::string const& prefix) {
    auto& node = boost::hana::at_c<I>(nodes_);
    using L = layer_at<I>;
    using In = typename L::input_type;
    using Out = typename L::output_type;
    std::int64_t const batch = batch_in_flight_;
    shape const in_shape = detail::with_batch(batch, node.layer.input_shape());
    shape const out_shape = detail::with_batch(batch, node.layer.output_shape());
    std::string const name = prefix + node.layer.name();
    tensor_view<Out const, Space> dy;
    tensor_view<In const, Space> dx;
    bool ran_backward = backward_top_ != no_backward;  // (a backward reaches layer 0 always)
    if constexpr (I > 0) ran_backward = ran_backward && I <= backward_top_;
    bool const began_here = ran_backward && I == backward_top_;
    if (began_here) {  // the caller's gradient, or its cast into output_grad
      dy = tensor_view<Out const, Space>(static_cast<Out const*>(top_gradient_), out_shape);
    } else if (ran_backward && I < backward_top_) {  // dy is layer I+1's dx, or its cast into output_grad
      if constexpr (I + 1 < count) {
        using NextIn = typename layer_at<I + 1>::input_type;
        if constexpr (std::is_same_v<NextIn, Out>)
          dy = boost::hana::at_c<I + 1>(nodes_).input_grad.template view<Space>(out_shape);
        else dy = node.output_grad.template view<Space>(out_shape);
      }
    }
    if (ran_backward && I > 0) dx = node.input_grad.template view<Space>(in_shape);
    if constexpr (I == 0)  // the caller's buffer, when it keeps what the first layer wrote there
      if (ran_backward && kept_input_gradient_) dx = tensor_view<In const, Space>(static_cast<In const*>(kept_input_gradient_), in_shape);
    // A composite (a residual block, a repeat): its parts' layers first (they ran inside it).
    if constexpr (composite_layer<L>)
      node.layer.for_each_part([&](auto& part, std::string const& part_prefix) {
        part.template visit_in_flight<Space>(f, prefix + part_prefix);
      });
    f(name, node.layer, input_of<I, Space>(batch),
      tensor_view<Out const, Space>(node.output.template view<Space>(out_shape)), dy, dx, ran_backward, began_here);
    if constexpr (I + 1 < count) visit_from<I + 1, Space>(f, prefix);
  }

  static constexpr std::size_t no_backward = static_cast<std::size_t>(-1);

  nodes_type nodes_;
  shape input_shape_{0};
  std::int64_t batch_ = 0;
  std::int64_t batch_in_flight_ = 0;
  std::uint64_t buffer_generation_ = 0;
  void const* first_input_ = nullptr;
  std::size_t backward_top_ = no_backward;  // the layer the latest backward began at
  void const* top_gradient_ = nullptr;      // the dy it began with (the caller's, or its cast)
  bool training_in_flight_ = false;         // the latest forward's mode
  std::function<void(std::size_t)> gradients_final_;  // see on_gradients_final
  void* input_gradient_ = nullptr;                     // where backward_to_input wants dL/d(input)
  void* kept_input_gradient_ = nullptr;                // where the latest backward_to_input wrote it, if kept
  std::vector<std::size_t> layer_first_parameter_;
  detail::layer_tensor<float> logits_gradient_;  // see logits_gradient
  std::shared_ptr<model_history> history_ = std::make_shared<model_history>();  // see parameter::written_by
  bool repeat_backward_allowed_ = false;
  std::string_view built_with_, built_in_;  // the executor build was given and its memory space
  bool built_ = false;
};


//! A model of the given layers, each with its own policy; the layers are moved in.
template <class Policy = model_policy, class... Layers>
auto sequential(Layers&&... layers) {
  if constexpr (std::is_same_v<Policy, model_policy>) {
    return sequential_model<std::remove_cvref_t<Layers>...>(std::forward<Layers>(layers)...);
  } else {
    static_assert(policy_type<Policy>, "mpx::sequential<Policy>: Policy must be an mpx policy such as "
                                       "mpx::mixed_float16");
    return sequential_model<typename detail::resolve_policy<std::remove_cvref_t<Layers>, Policy>::type...>(
        detail::with_model_policy<Layers, Policy>(std::forward<Layers>(layers))...);
  }
}

}  // namespace mpx
