// mpx::embedding<Policy>: token ids (int32) -> vectors, like keras.layers.Embedding, with
// optional learned position embeddings (GPT's wpe) added: y[t] = table[id_t] + positions[t].
// The table is stored in the policy's storage type (an optimizer keeps its float master
// copy); the gradient is a deterministic scatter-add summed in float (kernels/embedding.hpp).
#pragma once

#include <mpx/kernels/elementwise.hpp>
#include <mpx/kernels/embedding.hpp>
#include <mpx/layers/initializers.hpp>
#include <mpx/layers/layer.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace mpx {

struct embedding_config {
  std::int64_t vocab_size = 0;  //!< rows of the table: ids lie in [0, vocab_size) (Keras's input_dim)
  std::int64_t width = 0;       //!< the vector per token (Keras's output_dim)
  std::int64_t context = 0;     //!< > 0: learned position embeddings for positions [0, context), added
  initializer embeddings_initializer = initializer::random_uniform;
  initializer positions_initializer = initializer::random_uniform;
};

template <class Policy = model_policy>
class embedding : public layer_base {
 public:
  using policy = Policy;
  using config_type = embedding_config;
  using input_type = std::int32_t;
  using output_type = typename Policy::storage_type;
  static constexpr std::string_view kind = "Embedding";

  explicit embedding(embedding_config config) : config_(config) {
    if (config_.vocab_size <= 0 || config_.width <= 0 || config_.context < 0)
      detail::fail<invalid_argument>("mpx::embedding", "vocab_size and width must be positive and context >= 0, got " +
                                                           std::to_string(config_.vocab_size) + ", " +
                                                           std::to_string(config_.width) + ", " +
                                                           std::to_string(config_.context));
  }
  //! Keras's Embedding(input_dim, output_dim), plus position embeddings when context > 0.
  embedding(std::int64_t vocab_size, std::int64_t width, std::int64_t context = 0)
      : embedding(embedding_config{.vocab_size = vocab_size, .width = width, .context = context}) {}

  [[nodiscard]] embedding_config const& config() const noexcept { return config_; }

  //! A sample is a sequence of ids, [L] (or any shape); the output appends the width.
  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    if (in.rank() < 1 || in.size() == 0)
      detail::fail<shape_error>(name_or_kind(), "expects samples of token ids of shape [sequence], got " +
                                                    in.to_string());
    if (config_.context && in[in.rank() - 1] > config_.context)
      detail::fail<shape_error>(name_or_kind(), "has position embeddings for " + std::to_string(config_.context) +
                                                    " positions but receives sequences of shape " + in.to_string());
    std::vector<std::int64_t> e(in.extents().begin(), in.extents().end());
    e.push_back(config_.width);
    return shape(std::span<std::int64_t const>(e.data(), e.size()));
  }

  template <executor Exec>
  void build(Exec const& exec, shape const& in, std::uint64_t seed) {
    detail::require_layer_policy<Policy>();
    shape const out = compute_output_shape(in);
    using Space = memory_space_t<Exec>;
    table_.allocate(exec, {config_.vocab_size, config_.width});
    initialize(exec, embeddings<Space>(), config_.embeddings_initializer, config_.vocab_size,
               config_.width, seed);
    if (config_.context) {
      positions_.allocate(exec, {config_.context, config_.width});
      initialize(exec, positions<Space>(), config_.positions_initializer, config_.context,
                 config_.width, seed + 1);
    }
    invalid_.allocate(exec, {1});
    fill(exec, invalid_.template view<Space>(), 0);
    mark_built(in, out);
  }

  template <executor Exec>
  void reserve(Exec const&, std::int64_t batch) {
    require_built("reserve");
    reserved_batch_ = batch;
  }

  //! y = table[x] (+ positions). On the host an id outside [0, vocab_size) throws
  //! mpx::invalid_argument; on the GPU it gives a zero row and sets a flag that
  //! ids_out_of_range reads (the step does not wait for the host).
  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type, Space> y,
               bool /*training*/) {
    check_input(x.shape(), y.shape());
    int* const flag = invalid_.template view<Space>().data();
    auto const table = embeddings<Space>();
    try {
      if (config_.context)
        embedding_forward(exec, x, table, positions<Space>(), y, flag);
      else
        embedding_forward(exec, x, table, y, flag);
    } catch (invalid_argument const& e) {
      detail::fail<invalid_argument>(name_or_kind(), e.what());
    }
  }

  //! Writes the parameter gradients (overwriting). Token ids have no gradient: dx is not
  //! written.
  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<input_type const, Space> x, tensor_view<output_type const, Space> y,
                tensor_view<output_type const, Space> dy, tensor_view<input_type, Space> /*dx*/) {
    check_input(x.shape(), y.shape());
    detail::require_batch_shape(name(), "output gradient", dy.shape(), output_shape_);
    embedding_backward(exec, x, dy, embeddings_gradient<Space>());
    if (config_.context) position_embedding_backward(exec, dy, positions_gradient<Space>());
  }

  //! Whether a forward pass since build (or the last reset) met an id outside the table
  //! (always false on the host, which throws instead). Synchronises a cuda_executor.
  template <executor Exec>
  [[nodiscard]] bool ids_out_of_range(Exec const& exec, bool reset = false) {
    using Space = memory_space_t<Exec>;
    require_built("ids_out_of_range");
    auto const flag = invalid_.template view<Space>();
    auto const host = to_host(exec, flag);
    if (reset) fill(exec, flag, 0);
    return host[0] != 0;
  }

  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>& out) {
    require_built("parameters");
    table_.append_to(out, name(), "embeddings");
    if (config_.context) positions_.append_to(out, name(), "positions");
  }
  [[nodiscard]] std::size_t parameter_count() const noexcept { return table_.size() + positions_.size(); }

  //! The trainable tensors, for inspection, tests and a user's own update rules.
  template <memory_space Space>
  [[nodiscard]] tensor_view<output_type, Space> embeddings() const { return table_.template value<Space>(); }
  template <memory_space Space>
  [[nodiscard]] tensor_view<output_type, Space> positions() const { return positions_.template value<Space>(); }
  template <memory_space Space>
  [[nodiscard]] tensor_view<output_type, Space> embeddings_gradient() const {
    return table_.template gradient<Space>();
  }
  template <memory_space Space>
  [[nodiscard]] tensor_view<output_type, Space> positions_gradient() const {
    return positions_.template gradient<Space>();
  }

 private:
  std::string name_or_kind() const { return name().empty() ? std::string("mpx::embedding") : name(); }

  embedding_config config_;
  detail::trainable<output_type> table_, positions_;
  detail::layer_tensor<int> invalid_;
};

}  // namespace mpx
