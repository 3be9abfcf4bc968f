// mpx::dropout<Policy>: in training, zeroes each element with probability `rate` and
// scales the rest by 1 / (1 - rate) (keras.layers.Dropout); in inference, the identity.
// The mask comes from Philox4x32-10 keyed by the layer's seed, with a fresh counter
// offset per training forward, so a run is reproducible from its seeds on either
// executor. The offset is a count kept where the executor computes and advanced there,
// so a CUDA graph that replays the step also draws a fresh mask each time.
#pragma once

#include <mpx/exec/copy.hpp>
#include <mpx/kernels/dropout.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/layers/layer.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mpx {

struct dropout_config {
  float rate = 0.5f;
};

template <class Policy = model_policy>
class dropout : public layer_base, public detail::storage_dtype_layer<Policy, dropout_config> {
  using storage_type = typename Policy::storage_type;

 public:
  static constexpr std::string_view kind = "Dropout";

  explicit dropout(dropout_config config) : config_(config) {
    detail::require_dropout_rate("mpx::dropout", config_.rate);
  }
  explicit dropout(float rate) : dropout(dropout_config{rate}) {}
  [[nodiscard]] dropout_config const& config() const noexcept { return config_; }
  //! A training forward draws a mask (mpx::model_shadow cannot rerun it with the same one).
  [[nodiscard]] bool draws_random_numbers_in_training() const noexcept { return config_.rate > 0.0f; }

  [[nodiscard]] shape compute_output_shape(shape const& in) const { return in; }
  template <executor Exec>
  void build(Exec const& exec, shape const& in, std::uint64_t seed) {
    detail::require_layer_policy<Policy>();
    seed_ = seed;
    step_.allocate(exec, shape{1});
    fill(exec, step_.template view<memory_space_t<Exec>>(), std::uint64_t{0});
    mark_built(in, in);
  }
  template <executor Exec>
  void reserve(Exec const& exec, std::int64_t batch) {
    require_built("reserve");
    mask_.ensure(exec, detail::with_batch(batch, input_shape_));
    reserved_batch_ = batch;
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type, Space> y,
               bool training) {
    check_input_and_reserve(*this, exec, x.shape(), y.shape());
    if (!training || config_.rate == 0.0f) {
      copy(exec, x, y);
      last_forward_trained_ = false;
      return;
    }
    auto const step = step_.template view<Space>();
    advance_dropout_step(exec, step);
    options_ = dropout_options{config_.rate, seed_, 0, step.data()};
    dropout_forward(exec, options_, x, y, mask_.template view<Space>(x.shape()));
    last_forward_trained_ = true;
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type const, Space> y,
                tensor_view<storage_type const, Space> dy, tensor_view<storage_type, Space> dx) {
    check_input(x.shape(), y.shape());
    if (dx.data() == nullptr) return;
    if (!last_forward_trained_) copy(exec, dy, dx);
    else dropout_backward(exec, options_, dy, dx, mask_.template view<Space>(x.shape()));
  }
  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>&) {}
  //! The count of training forwards, which decides the next mask: training state, saved
  //! and restored by save_training_state / load_training_state so a resumed run draws
  //! the masks an uninterrupted one would.
  template <memory_space Space>
  void append_counters(std::vector<std::pair<std::string, tensor_view<std::uint64_t, Space>>>& out) {
    out.emplace_back(name() + "/training_forwards", step_.template view<Space>());
  }
  //! The seed the masks are drawn with (from the model's build seed): training state too,
  //! so a run resumed into a model built with another seed draws the same masks.
  void append_seeds(std::vector<std::pair<std::string, std::uint64_t*>>& out) {
    out.emplace_back(name() + "/seed", &seed_);
  }
  [[nodiscard]] std::size_t parameter_count() const noexcept { return 0; }

 private:
  dropout_config config_;
  std::uint64_t seed_ = 0;
  detail::layer_tensor<std::uint64_t> step_;  // training forwards so far, where the executor computes
  dropout_options options_{};
  bool last_forward_trained_ = false;
  detail::layer_tensor<std::uint8_t> mask_;
};

}  // namespace mpx
