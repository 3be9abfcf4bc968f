// mpx::flatten<Policy>: [batch, d1, d2, ...] -> [batch, d1 * d2 * ...], like
// keras.layers.Flatten. Row-major data need no reordering, so the forward and backward
// passes are copies (a model could alias them; a copy keeps every layer's output its own).
#pragma once

#include <mpx/exec/copy.hpp>
#include <mpx/layers/layer.hpp>

namespace mpx {

struct flatten_config {};

template <class Policy = model_policy>
class flatten : public layer_base {
 public:
  using policy = Policy;
  using config_type = flatten_config;
  using input_type = typename Policy::storage_type;
  using output_type = typename Policy::storage_type;
  static constexpr std::string_view kind = "Flatten";

  flatten() = default;
  explicit flatten(flatten_config) {}
  [[nodiscard]] flatten_config config() const noexcept { return {}; }

  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    return shape{static_cast<std::int64_t>(in.size())};
  }
  template <executor Exec>
  void build(Exec const&, shape const& in, std::uint64_t) {
    detail::require_layer_policy<Policy>();
    mark_built(in, compute_output_shape(in));
  }
  template <executor Exec>
  void reserve(Exec const&, std::int64_t batch) {
    reserved_batch_ = batch;
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type, Space> y, bool) {
    check_input(x.shape(), y.shape());
    copy(exec, x.reshape(y.shape()), y);
  }
  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type const, Space> y,
                tensor_view<output_type const, Space> dy, tensor_view<input_type, Space> dx) {
    check_input(x.shape(), y.shape());
    if (dx.data() != nullptr) copy(exec, dy.reshape(dx.shape()), dx);
  }
  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>&) {}
  [[nodiscard]] std::size_t parameter_count() const noexcept { return 0; }
};

}  // namespace mpx
