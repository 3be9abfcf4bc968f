// mpx::causal_self_attention<Policy>: GPT-style multi-head self-attention over [batch,
// tokens, width], each token attending to itself and the tokens before it, like
// keras.layers.MultiHeadAttention(num_heads, key_dim = width / heads) called with
// use_causal_mask=True on (x, x).
//
//   q, k, v = split(x W_qkv + b_qkv)            one dense layer, [width -> 3 width]
//   s_h     = q_h k_hᵀ / sqrt(width / heads)    batched products under the policy; the
//                                               logits are stored in the storage dtype
//   p_h     = causal_softmax(s_h)               in float
//   p_h     = dropout(p_h)                      when training with dropout > 0 (Keras's
//                                               MultiHeadAttention(dropout=...))
//   y       = concat_h(p_h v_h) W_o + b_o        a second dense layer
//
// The logits live in the storage dtype, as under PyTorch's autocast and Keras's
// mixed_float16: scaled by 1/sqrt(head width) inside the product's float sums, they stay
// far from float16's 65504. Without that scaling (options.scale_logits = false) large
// activations overflow them to inf, and the softmax turns the row into NaN: the
// transformer failure docs/transformers.md shows and find_nonfinite names.
//
// Under an fp8 policy (mpx::mixed_fp8 and the other recipes) the two dense layers run
// their products in fp8 with the policy's recipe, and the three middle lines in the
// storage dtype (mpx::without_fp8<Policy>): Transformer Engine's default, which puts its
// attention's linear layers under fp8_autocast and keeps the dot-product attention in
// bfloat16. The projections' scales are the layer's training state. Under a per-tensor
// recipe (mixed_fp8, mixed_fp8_current), config.fp8_attention runs those three lines in
// fp8 too, as Transformer Engine's fp8 dot-product attention does
// (<mpx/kernels/fp8_attention.hpp> says where it quantizes): on the GPU cuDNN's fp8
// SDPA where it runs (Hopper and later), else mpx's fp8 core, the host's path.
//
// On the CUDA executor, with half or bfloat16 storage, scaled logits and config.fused
// left on, the three middle lines (dropout included) run as one fused kernel where the
// program has one (<mpx/kernels/fused_attention.hpp>: cuDNN's SDPA, statistics in float,
// no [tokens, tokens] tensor in memory); otherwise as written above. The host executor
// runs them as written, unless the program registered a fused attention for host memory
// (mpx::register_fused_attention<host_space>; mpx's tests do). fused() says which path
// the latest forward took.
#pragma once

#include <mpx/exec/step_executor.hpp>
#include <mpx/kernels/attention.hpp>
#include <mpx/kernels/dropout.hpp>
#include <mpx/kernels/fused_attention.hpp>
#include <mpx/kernels/gemm.hpp>
#include <mpx/layers/dense.hpp>
#include <mpx/layers/fp8_attention_core.hpp>
#include <mpx/layers/initializers.hpp>
#include <mpx/layers/layer.hpp>

#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace mpx {

struct causal_self_attention_config {
  std::int64_t heads = 1;
  //! Multiply the logits by 1/sqrt(head width) (the transformer's scaling). Only a
  //! demonstration of what goes wrong turns it off.
  bool scale_logits = true;
  //! The probability of dropping an attention weight while training, in [0, 1): the
  //! masks are Philox draws from the layer's seed and a count of training forwards,
  //! regenerated in the backward pass (nothing is stored). The unfused path draws the
  //! same masks on host and GPU (mpx::dropout_keeps); the fused one draws cuDNN's
  //! (latest_dropout_keeps says which weights either dropped).
  float dropout = 0.0f;
  //! How the query/key/value projection's kernel, the output projection's kernel, and
  //! both biases start: Keras's glorot_uniform and zeros by default; PyTorch's nn.Linear
  //! makes all of them initializer::torch_linear; GPT-2 starts the kernels at
  //! normal(0.02) and the output projection, which ends the residual branch, at
  //! initializer::gpt2_residual(layers), with zero biases.
  initializer kernel_initializer = initializer::glorot_uniform;
  initializer output_kernel_initializer = initializer::glorot_uniform;
  initializer bias_initializer = initializer::zeros;
  //! Run the fused attention where it can run (see above). false keeps the unfused path,
  //! as PyTorch's sdpa_kernel(SDPBackend.MATH) does: to compare the two, or to read
  //! probabilities(), which the fused path never stores.
  bool fused = true;
  //! Under a per-tensor fp8 recipe (mixed_fp8, mixed_fp8_current): run the attention
  //! between the projections in fp8 as well (Q K V and O in e4m3, their gradients in
  //! e5m2, six per-tensor scales kept as training state), as Transformer Engine's
  //! fp8_dpa. Off by default, as there: the core in bfloat16 is more accurate and costs
  //! little beside the projections at short sequences. Under a block recipe it is an
  //! mpx::invalid_argument, as are heads over 256 values; without fp8 it does nothing.
  bool fp8_attention = false;
  //! The fused path's backward pass in a fixed order, so a run repeats bit for bit, as
  //! every other path of mpx does (cuDNN's deterministic algorithm: on Hopper it writes
  //! and reads a dP workspace each pass, 2 bytes a [batch·heads, tokens, tokens] entry).
  //! false lets cuDNN sum dQ with atomics, as PyTorch's SDPA does by default: faster,
  //! and runs differ in the last bits. The unfused path is deterministic either way.
  bool deterministic = true;
};

template <class Policy = model_policy>
class causal_self_attention : public layer_base,
                              public detail::storage_dtype_layer<Policy, causal_self_attention_config> {
  using storage_type = typename Policy::storage_type;

 public:
  static constexpr std::string_view kind = "MultiHeadAttention";

  explicit causal_self_attention(std::int64_t heads, bool scale_logits = true, float dropout = 0.0f)
      : causal_self_attention(causal_self_attention_config{heads, scale_logits, dropout}) {}
  explicit causal_self_attention(causal_self_attention_config c) : config_(c) {
    if (c.heads <= 0) detail::fail<invalid_argument>("causal_self_attention", "heads must be positive");
    detail::require_dropout_rate("causal_self_attention (dropout)", c.dropout);
    if constexpr (!std::is_same_v<Policy, model_policy>) require_fp8_core_policy();  // (else: when the model gives one)
  }
  [[nodiscard]] causal_self_attention_config config() const noexcept { return config_; }
  //! A training forward draws a dropout mask (mpx::model_shadow cannot rerun it with the same one).
  [[nodiscard]] bool draws_random_numbers_in_training() const noexcept { return config_.dropout > 0.0f; }

  //! [tokens, width] -> [tokens, width].
  [[nodiscard]] shape compute_output_shape(shape const& in) const {
    if (in.rank() != 2 || in[0] < 1 || in[1] % config_.heads != 0 || in[1] == 0)  // no tokens: nothing to attend to, and the projections refuse an empty batch
      detail::fail<shape_error>(name_.empty() ? "causal_self_attention" : name_,
                                "expects samples of shape [tokens, width] with width a multiple of the " +
                                    std::to_string(config_.heads) + " heads, got " + in.to_string());
    return in;
  }

  template <executor Exec>
  void build(Exec const& exec, shape const& in, std::uint64_t seed) {
    detail::require_layer_policy<Policy>();
    require_fp8_core_policy();
    width_ = compute_output_shape(in)[1];
    matrix_products<Policy>::require_fp8_width(name_.empty() ? "causal_self_attention" : name_,
                                               "width (its projections have 3 x width and width units)", width_);
    qkv_ = dense<Policy>({.units = 3 * width_, .kernel_initializer = config_.kernel_initializer,
                          .bias_initializer = config_.bias_initializer, .in_features = width_});
    out_ = dense<Policy>({.units = width_, .kernel_initializer = config_.output_kernel_initializer,
                          .bias_initializer = config_.bias_initializer, .in_features = width_});
    qkv_.set_name(name_ + "/query_key_value");
    out_.set_name(name_ + "/output");
    qkv_.build(exec, shape{width_}, seed);
    out_.build(exec, shape{width_}, seed + 1);
    if (fp8_core()) {
      if (width_ / config_.heads > fp8_attention_max_head_width)
        detail::fail<invalid_argument>(name_.empty() ? "causal_self_attention" : name_,
                                       "fp8_attention takes heads of up to " + std::to_string(fp8_attention_max_head_width) +
                                           " values; these have " + std::to_string(width_ / config_.heads));
      fp8_core_.build(exec, core_recipe());
    }
    // Not seed + 2 or + 3: under NVFP4 the projections' stochastic rounding draws from
    // those keys, with counters that would repeat the dropout's.
    dropout_seed_ = seed + 4;
    dropout_step_.allocate(exec, shape{1});
    fill(exec, dropout_step_.template view<memory_space_t<Exec>>(), std::uint64_t{0});
    if (config_.dropout > 0.0f) fused_dropout_key_.allocate(exec, shape{2});
    mark_built(in, in);
  }

  template <executor Exec>
  void reserve(Exec const& exec, std::int64_t batch) {
    require_built("reserve");
    attention_dims const d = dims(batch);
    qkv_.reserve(exec, d.rows());
    out_.reserve(exec, d.rows());
    std::int64_t const bh = d.batch * d.heads;
    qkv_tokens_.ensure(exec, shape{d.rows(), 3 * width_});
    o_tokens_.ensure(exec, shape{d.rows(), width_});
    // The backward pass's own buffers, made here with the others (on the caller's
    // executor, counted by the model's buffer_generation), never inside a step.
    d_tokens_.ensure(exec, shape{d.rows(), 3 * width_});
    // The path is chosen here, once per reserve, never inside a step: a fused layer runs
    // the plan for this batch (a smaller batch's rows past its own are computed and
    // ignored, since each sequence attends only to itself), so no plan is built and no
    // [tokens, tokens] buffer made inside a step or a CUDA-graph capture.
    fused_batch_ = 0;
    if (fp8_core()) {  // its own buffers, all linear in the tokens
      fp8_core_.reserve(exec, d);
      if (fusable(exec, d)) fused_batch_ = batch;
    } else if (fusable(exec, d)) {
      o_heads_.ensure(exec, shape{bh, d.tokens, d.head_width});  // dO
      statistics_.ensure(exec, shape{bh, d.tokens});  // the layer's memory linear in the tokens (cuDNN's workspace: see cudnn_attention.hpp)
      fused_batch_ = batch;
    } else {
      reserve_unfused(exec, d);
    }
    reserved_batch_ = batch;
  }

  template <executor Exec, class Space = memory_space_t<Exec>>
  void forward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type, Space> y,
               bool training) {
    std::int64_t const batch = check_input_and_reserve(*this, exec, x.shape(), y.shape());
    attention_dims const d = dims(batch);
    auto const qkv = qkv_tokens_.template view<Space>(shape{d.rows(), 3 * width_});
    qkv_.forward(exec, x.reshape(shape{d.rows(), width_}), qkv, training);
    auto const merged = o_tokens_.template view<Space>(shape{d.rows(), width_});
    latest_batch_ = batch;
    latest_plan_batch_ = fused_batch_;
    if (fp8_core()) {
      if constexpr (fp8_core_possible)
        attend_fp8(exec, tensor_view<storage_type const, Space>(qkv), merged, d, training);
    } else if (fused()) {  // Q, K, V read in place; O straight into merged
      attention_dims const planned = dims(latest_plan_batch_);
      storage_type const* const q = qkv_tokens_.template view<Space>(shape{planned.rows(), 3 * width_}).data();
      dropped_ = training && config_.dropout > 0.0f;
      if (dropped_)  // this forward's Philox key, where the count lives (a captured step draws anew each replay)
        detail::run_once(exec, detail::fused_dropout_key{dropout_seed_, dropout_step_.template view<Space>().data(),
                                                         fused_dropout_key_.template view<Space>().data()});
      fused_attention<Space>()->forward(fused_shape(planned, dropped_),
                                 {q, q + width_, q + 2 * width_, merged.data(), statistics<Space>(planned).data(),
                                  fused_key<Space>()},
                                 step_executor(exec).stream());
    } else {
      attend_unfused(exec, qkv, merged, d, training);
    }
    out_.forward(exec, tensor_view<storage_type const, Space>(merged), y.reshape(shape{d.rows(), width_}), training);
  }

  template <executor Exec, class Space = memory_space_t<Exec>>
  void backward(Exec const& exec, tensor_view<storage_type const, Space> x, tensor_view<storage_type const, Space> y,
                tensor_view<storage_type const, Space> dy, tensor_view<storage_type, Space> dx) {
    std::int64_t const batch = check_input(x.shape(), dy.shape());
    attention_dims const d = dims(batch);
    shape const tokens{d.rows(), width_};
    auto const merged = o_tokens_.template view<Space>(tokens);
    auto const qkv = qkv_tokens_.template view<Space>(shape{d.rows(), 3 * width_});
    auto const d_qkv = d_tokens_.template view<Space>(shape{d.rows(), 3 * width_});
    if (fp8_core()) {
      auto const d_merged = d_qkv.flat(0, tokens.size()).reshape(tokens);
      out_.backward(exec, tensor_view<storage_type const, Space>(merged), y.reshape(tokens), dy.reshape(tokens),
                    d_merged);
      if constexpr (fp8_core_possible) backward_fp8(exec, tensor_view<storage_type const, Space>(d_merged), d_qkv, d);
    } else if (fused()) {  // dO in o_heads_; dQ, dK, dV straight into d(QKV)'s token rows
      attention_dims const planned = dims(latest_plan_batch_);  // the forward's plan
      auto const d_o = o_heads_.template view<Space>(shape{planned.rows(), width_});
      out_.backward(exec, tensor_view<storage_type const, Space>(merged), y.reshape(tokens), dy.reshape(tokens),
                    d_o.flat(0, tokens.size()).reshape(tokens));
      storage_type const* const q = qkv_tokens_.template view<Space>(shape{planned.rows(), 3 * width_}).data();
      storage_type* const dq = d_tokens_.template view<Space>(shape{planned.rows(), 3 * width_}).data();
      fused_attention<Space>()->backward(fused_shape(planned, dropped_),
                                  {q, q + width_, q + 2 * width_, merged.data(), d_o.data(),
                                   statistics<Space>(planned).data(), dq, dq + width_, dq + 2 * width_,
                                   fused_key<Space>()},
                                  step_executor(exec).stream());
    } else {
      backward_unfused(exec, merged, y.reshape(tokens), dy.reshape(tokens), d_qkv, d);
    }
    qkv_.backward(exec, x.reshape(tokens), tensor_view<storage_type const, Space>(qkv),
                  tensor_view<storage_type const, Space>(d_qkv),
                  dx.size() ? dx.reshape(tokens) : tensor_view<storage_type, Space>{});
  }

  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>& out) {
    require_built("parameters");
    qkv_.template append_parameters<Space>(out);
    out_.template append_parameters<Space>(out);
  }
  [[nodiscard]] std::size_t parameter_count() const noexcept {
    return built_ ? qkv_.parameter_count() + out_.parameter_count() : 0;
  }

  //! The count of training forwards that draws the dropout masks, and the seed: training
  //! state, saved by save_training_state so a resumed run draws the same masks; under
  //! NVFP4 the projections' draw counts and seeds too (their fp8 scales: below).
  template <memory_space Space>
  void append_counters(std::vector<std::pair<std::string, tensor_view<std::uint64_t, Space>>>& out) {
    out.emplace_back(name() + "/dropout_forwards", dropout_step_.template view<Space>());
    qkv_.template append_counters<Space>(out);
    out_.template append_counters<Space>(out);
  }
  void append_seeds(std::vector<std::pair<std::string, std::uint64_t*>>& out) {
    out.emplace_back(name() + "/dropout_seed", &dropout_seed_);
    qkv_.append_seeds(out);
    out_.append_seeds(out);
  }
  //! The projections' fp8 scales under a per-tensor recipe (nothing otherwise).
  template <executor Exec>
  void append_fp8_scales(std::vector<fp8_scales_entry<Exec>>& out) {
    qkv_.template append_fp8_scales<Exec>(out);
    out_.template append_fp8_scales<Exec>(out);
    if (fp8_core()) fp8_core_.append_to(out, name() + "/attention_core");
  }
  //! The fp8 attention core's six scale states (fp8_attention on; else mpx::invalid_argument),
  //! where the executor computes: for inspection and tests.
  template <executor Exec>
  [[nodiscard]] fp8_attention_scales attention_core_scales() const {
    if (!fp8_core()) detail::fail<invalid_argument>(name(), "attention_core_scales: the core does not run in fp8");
    require_built("attention_core_scales");
    return fp8_core_.template scales<Exec>();
  }
  //! The dropout of the latest training forward on the unfused path, its count folded in
  //! (for mpx::dropout_keeps). Synchronises a cuda_executor. After a fused forward it
  //! throws: cuDNN draws the fused path's masks (latest_dropout_keeps shows them).
  template <executor Exec>
  [[nodiscard]] dropout_options latest_dropout(Exec const& exec) const {
    if (fused())
      detail::fail<invalid_argument>(name(), "latest_dropout: the latest forward ran fused, where cuDNN draws the "
                                             "masks (latest_dropout_keeps says which weights a training forward dropped)");
    auto const step = to_host(exec, dropout_step_.template view<memory_space_t<Exec>>());
    return dropout_options{config_.dropout, dropout_seed_, step[0], nullptr};
  }
  //! Which attention weights the latest training forward dropped, on either path:
  //! [batch * heads, tokens, tokens], 1 kept, 0 dropped (the backward pass uses the same);
  //! entries above the diagonal, weights the causal mask zeroes, are 0.
  //! For tests and inspection: it synchronises, and on the fused path reruns the forward
  //! with cuDNN writing its masks out (a plan built the first time, B·H·T² floats of
  //! scratch). Throws when the latest forward dropped nothing. Where steps run on a
  //! stream of their own (a CUDA-graph trainer's), synchronise it first.
  template <executor Exec>
  [[nodiscard]] std::vector<std::uint8_t> latest_dropout_keeps(Exec const& exec) const {
    if (!dropped_)
      detail::fail<invalid_argument>(name(), "latest_dropout_keeps: the latest forward dropped no weights (not a "
                                             "training forward, or dropout 0)");
    attention_dims const d = dims(latest_batch_);
    std::vector<std::uint8_t> keeps(static_cast<std::size_t>(d.batch * d.heads * d.tokens * d.tokens));
    auto const tokens = static_cast<std::size_t>(d.tokens);
    auto const above_diagonal = [&](std::size_t i) { return i % tokens > i / tokens % tokens; };
    if (!fused()) {  // mpx's Philox draws, as dropout_forward made them
      dropout_options const options = latest_dropout(exec);
      for (std::size_t i = 0; i < keeps.size(); ++i) keeps[i] = !above_diagonal(i) && dropout_keeps(options, i) ? 1 : 0;
    } else {
      using Space = memory_space_t<Exec>;
      attention_dims const planned = dims(latest_plan_batch_);  // the plan that forward ran (a later reserve may differ)
      std::int64_t const row = fused_dropout_keeps_row(planned.tokens);
      tensor<float, Space> drawn(exec, shape{planned.batch * planned.heads, planned.tokens, row});
      fill(exec, drawn, std::numeric_limits<float>::quiet_NaN());  // what the implementation leaves unwritten stays NaN
      bool const fp8 = fp8_core();
      char const* const q = fp8 ? reinterpret_cast<char const*>(fp8_core_.template qkv8<Space>())
                                : reinterpret_cast<char const*>(qkv_tokens_.template view<Space>().data());
      std::int64_t const part =
          width_ * (fp8 ? 1 : static_cast<std::int64_t>(sizeof(storage_type)));  // bytes from Q to K
      if (fp8) fp8_core_.gather_scalars(exec);
      fused_attention<Space>()->dropout_keeps(fused_shape(planned, true),
                                              {q, q + part, q + 2 * part, nullptr, nullptr, fused_key<Space>(),
                                               fp8 ? fp8_core_.template scalars<Space>() : nullptr},
                                              drawn.data(), step_executor(exec).stream());
      auto const host = to_host(exec, view(drawn));
      for (std::size_t i = 0; i < keeps.size(); ++i) {  // the planned batch's first rows
        if (above_diagonal(i)) continue;  // (cuDNN may skip those tiles)
        float const drawn_keep = host[i / tokens * static_cast<std::size_t>(row) + i % tokens];
        if (drawn_keep != 0.0f && drawn_keep != 1.0f)
          detail::fail<error>(name(), "latest_dropout_keeps: the fused attention's mask holds " + std::to_string(drawn_keep) +
                                          " at entry " + std::to_string(i) + ", not 0 or 1");
        keeps[i] = drawn_keep != 0.0f ? 1 : 0;
      }
    }
    return keeps;
  }

  //! The projections, for inspection and tests.
  [[nodiscard]] dense<Policy>& query_key_value() noexcept { return qkv_; }
  [[nodiscard]] dense<Policy>& output() noexcept { return out_; }
  //! Where the backward pass's buffers are (dO / d(QKV), the per-head gradients;
  //! nullptr before reserve), for tests that no step moves them.
  [[nodiscard]] std::array<void const*, 2> gradient_buffers() const noexcept {
    if (fp8_core()) return {d_tokens_.address(), fp8_core_.gradient_buffer()};
    return {d_tokens_.address(), fused_batch_ > 0 ? statistics_.address() : d_heads_.address()};
  }
  //! The latest forward's attention probabilities [batch * heads, tokens, tokens] (float).
  //! The unfused path only: the fused one keeps none (fused()).
  template <memory_space Space>
  [[nodiscard]] tensor_view<float const, Space> probabilities(std::int64_t batch) const {
    if (fp8_core())
      detail::fail<invalid_argument>(name(), "probabilities: the attention runs in fp8 (fp8_attention), which keeps no "
                                             "[tokens, tokens] probabilities");
    if (fused())
      detail::fail<invalid_argument>(name(), "probabilities: the latest forward ran fused, which keeps no "
                                             "[tokens, tokens] probabilities");
    attention_dims const d = dims(batch);
    return p_.template view<Space>(shape{d.batch * d.heads, d.tokens, d.tokens});
  }

  //! Whether the latest forward ran the fused attention (CUDA executor only).
  [[nodiscard]] bool fused() const noexcept { return latest_plan_batch_ > 0; }
  //! Whether the core runs in fp8: fp8_attention under a per-tensor fp8 policy. (Under a
  //! policy without fp8 the option has nothing to act on, as with a dense layer's fp8:
  //! model_shadow's float32 twin, a tier that leaves fp8.)
  [[nodiscard]] bool fp8_core() const noexcept { return fp8_core_possible && config_.fp8_attention; }

 private:
  // The products between the projections: never fp8 (see the top of this file).
  using core_policy = without_fp8<Policy>;
  void require_fp8_core_policy() const {
    if (config_.fp8_attention && computes_in_fp8<Policy> && !fp8_core_possible)
      detail::fail<invalid_argument>(name_.empty() ? "causal_self_attention" : name_,
                                     "fp8_attention needs a policy that scales fp8 per tensor (mixed_fp8, "
                                     "mixed_fp8_current); this one is block-scaled, and its attention core runs in "
                                     "the storage dtype");
  }
  // Whether fp8_attention can run: a per-tensor recipe; and the recipe its core takes.
  static constexpr bool fp8_core_possible = matrix_products<Policy>::tensorwise;
  using core_recipe_type =
      std::conditional_t<fp8_core_possible, typename matrix_products<Policy>::recipe_type, delayed_scaling>;
  static constexpr core_recipe_type core_recipe() {
    if constexpr (fp8_core_possible) return fp8_recipe_for<Policy>;
    else return {};
  }

  // The core in fp8: Q K V cast, the fused kernel or mpx's fp8 core, O back to the
  // storage type for the output projection.
  template <executor Exec, class Space>
  void attend_fp8(Exec const& exec, tensor_view<storage_type const, Space> qkv, tensor_view<storage_type, Space> merged,
                  attention_dims const& d, bool training) {
    fp8_core_.cast_qkv(exec, qkv);
    dropped_ = training && config_.dropout > 0.0f;
    if (fused()) {
      attention_dims const planned = dims(latest_plan_batch_);
      zero_unbatched_rows(exec, fp8_core_.template qkv8<Space>(), d, planned, 3);
      if (dropped_)
        detail::run_once(exec, detail::fused_dropout_key{dropout_seed_, dropout_step_.template view<Space>().data(),
                                                         fused_dropout_key_.template view<Space>().data()});
      float8_e4m3 const* const q = fp8_core_.template qkv8<Space>();
      fp8_core_.gather_scalars(exec);
      fused_attention<Space>()->forward(fused_shape(planned, dropped_),
                                 {q, q + width_, q + 2 * width_, fp8_core_.template o8<Space>(),
                                  fp8_core_.template stats<Space>(), fused_key<Space>(), fp8_core_.template scalars<Space>()},
                                 step_executor(exec).stream());
      fp8_core_.fold_amaxes(exec);
    } else {
      if (dropped_) {
        auto const step = dropout_step_.template view<Space>();
        advance_dropout_step(exec, step);
        dropout_options_ = dropout_options{config_.dropout, dropout_seed_, 0, step.data()};
      }
      fp8_attention_forward(exec, fp8_core_.template problem<Exec>(d, logit_scale(d), core_dropout()),
                            fp8_core_.template o8<Space>());
    }
    fp8_dequantize(exec, fp8_core_.template o8<Space>(), fp8_core_.template scales<Exec>().o, merged.data(), merged.size());
  }

  // dO cast, dQ dK dV from the fused kernel or mpx's fp8 core, back to the storage type
  // in d_qkv; then the six scales' step ends.
  template <executor Exec, class Space>
  void backward_fp8(Exec const& exec, tensor_view<storage_type const, Space> d_merged,
                    tensor_view<storage_type, Space> d_qkv, attention_dims const& d) {
    fp8_core_.cast_d_o(exec, d_merged);
    if (fused()) {
      attention_dims const planned = dims(latest_plan_batch_);
      zero_unbatched_rows(exec, fp8_core_.template d_o8<Space>(), d, planned, 1);
      float8_e4m3 const* const q = fp8_core_.template qkv8<Space>();
      float8_e5m2* const dq = fp8_core_.template dqkv8<Space>();
      fp8_core_.gather_scalars(exec);
      fused_attention<Space>()->backward(fused_shape(planned, dropped_),
                                  {q, q + width_, q + 2 * width_, fp8_core_.template o8<Space>(),
                                   fp8_core_.template d_o8<Space>(), fp8_core_.template stats<Space>(), dq, dq + width_,
                                   dq + 2 * width_, fused_key<Space>(), fp8_core_.template scalars<Space>()},
                                  step_executor(exec).stream());
      fp8_core_.fold_amaxes(exec);
    } else {
      fp8_attention_backward(exec, fp8_core_.template problem<Exec>(d, logit_scale(d), core_dropout()),
                             fp8_core_.template o8<Space>(), fp8_core_.template d_o8<Space>(),
                             fp8_core_.template delta<Space>(), fp8_core_.template dqkv8<Space>());
    }
    fp8_dequantize(exec, fp8_core_.template dqkv8<Space>(), fp8_core_.template scales<Exec>().dqkv, d_qkv.data(),
                   d_qkv.size());
    fp8_core_.end_step(exec);
  }
  // The latest training forward's dropout for mpx's fp8 core (rate 0: none).
  [[nodiscard]] dropout_options core_dropout() const { return dropped_ ? dropout_options_ : dropout_options{0.0f}; }
  // Zeros in the rows of an fp8 buffer that a plan for a larger batch reads past this
  // batch's: they would enter the amaxes the kernel records.
  template <executor Exec, class T>
  void zero_unbatched_rows(Exec const& exec, T* data, attention_dims const& d, attention_dims const& planned,
                           std::int64_t parts) const {
    if (planned.batch <= d.batch) return;
    std::int64_t const row = parts * width_;
    fill(exec, tensor_view<T, memory_space_t<Exec>>(data + d.rows() * row, shape{(planned.rows() - d.rows()) * row}),
         detail::from_bits<T>(detail::bits_t<T>{0}));
  }

  template <executor Exec, class Space>
  void attend_unfused(Exec const& exec, tensor_view<storage_type, Space> qkv, tensor_view<storage_type, Space> merged,
                      attention_dims const& d, bool training) {
    std::int64_t const bh = d.batch * d.heads;
    auto const heads = qkv_heads_.template view<Space>(shape{3 * bh, d.tokens, d.head_width});
    permute_heads(exec, qkv, heads, d, 3, true);
    auto const [q, k, v] = split_qkv(heads, d);
    auto const s = logits_.template view<Space>(shape{bh, d.tokens, d.tokens});
    gemm<core_policy>(exec, q, k, s, {.transpose_b = true, .alpha = logit_scale(d)});
    auto const p = p_.template view<Space>(s.shape());
    auto const ps = p_store_.template view<Space>(s.shape());
    causal_softmax(exec, tensor_view<storage_type const, Space>(s), p, ps, d);
    dropped_ = training && config_.dropout > 0.0f;
    if (dropped_) {  // on the weights P V reads; p keeps the softmax for its backward pass
      auto const step = dropout_step_.template view<Space>();
      advance_dropout_step(exec, step);
      dropout_options_ = dropout_options{config_.dropout, dropout_seed_, 0, step.data()};
      dropout_forward(exec, dropout_options_, ps, ps);
    }
    auto const o = o_heads_.template view<Space>(shape{bh, d.tokens, d.head_width});
    gemm<core_policy>(exec, ps, v, o);
    permute_heads(exec, merged, o, d, 1, false);
  }

  template <executor Exec, class Space>
  void backward_unfused(Exec const& exec, tensor_view<storage_type, Space> merged,
                        tensor_view<storage_type const, Space> y, tensor_view<storage_type const, Space> dy,
                        tensor_view<storage_type, Space> d_qkv, attention_dims const& d) {
    std::int64_t const bh = d.batch * d.heads;
    shape const tokens{d.rows(), width_};
    // Buffers are reused once read: d_tokens_ holds dO, then d(QKV); o_heads_ holds dO
    // per head; logits_ holds d(logits).
    auto const d_merged = d_qkv.flat(0, tokens.size()).reshape(tokens);
    out_.backward(exec, tensor_view<storage_type const, Space>(merged), y, dy, d_merged);
    auto const heads = qkv_heads_.template view<Space>(shape{3 * bh, d.tokens, d.head_width});
    auto const [q, k, v] = split_qkv(heads, d);
    auto const d_o = o_heads_.template view<Space>(shape{bh, d.tokens, d.head_width});
    permute_heads(exec, d_merged, d_o, d, 1, true);
    auto const d_heads = d_heads_.template view<Space>(shape{3 * bh, d.tokens, d.head_width});
    auto const [dq, dk, dv] = split_qkv(d_heads, d);
    auto const ps = p_store_.template view<Space>(shape{bh, d.tokens, d.tokens});
    gemm<core_policy>(exec, ps, d_o, dv, {.transpose_a = true});  // dV = Pᵀ dO
    auto const dp = dp_.template view<Space>(ps.shape());
    gemm<core_policy>(exec, d_o, v, dp, {.transpose_b = true});  // dP = dO Vᵀ, in float
    if (dropped_) dropout_backward(exec, dropout_options_, dp, dp);  // through the same mask
    auto const ds = logits_.template view<Space>(ps.shape());  // the logits are no longer needed
    causal_softmax_backward(exec, tensor_view<float const, Space>(p_.template view<Space>(ps.shape())),
                            tensor_view<float const, Space>(dp), ds, d, logit_scale(d));
    gemm<core_policy>(exec, ds, k, dq);                         // dQ = dS K
    gemm<core_policy>(exec, ds, q, dk, {.transpose_a = true});  // dK = dSᵀ Q
    permute_heads(exec, d_qkv, d_heads, d, 3, false);           // dO is spent
  }

  // The fused path, where it can run this attention (else the reason, on stderr once).
  // On the host only where the program registered a fused attention for host memory:
  // without one the host's own path runs, with nothing to note.
  template <executor Exec>
  [[nodiscard]] bool fusable(Exec const& exec, attention_dims const& d) const {
    fused_attention_backend* const backend = fused_attention<memory_space_t<Exec>>();
    if (!config_.fused || (is_host_executor_v<Exec> && backend == nullptr)) return false;  // nothing to note
    std::string why;
    constexpr bool sixteen_bit = std::is_same_v<storage_type, half> || std::is_same_v<storage_type, bfloat16>;
    if (!sixteen_bit && !fp8_core())  // (in fp8, Q K V are cast whatever the storage type)
      why = std::string("storage ") + std::string(dtype_traits<storage_type>::name) +
            " (the fused attention takes half and bfloat16)";
    else if (!config_.scale_logits)  // the float16 overflow it exists to show needs stored logits
      why = "unscaled logits (scale_logits = false keeps the logits in the storage dtype, as the unfused path stores them)";
    else if (fp8_core() && config_.dropout > 0.0f)  // (docs/transformers.md, "The attention in fp8 too")
      why = "dropout in fp8: cuDNN's fp8 backward graph, as cudnn-frontend writes it, puts no dropout mask on dP";
    else if (backend == nullptr)
      why = "this program has no fused attention (include <mpx/kernels/cudnn_attention.hpp> in one C++ source file "
            "and link cuDNN: docs/transformers.md)";
    else {  // a training forward's plan with dropout, and one without for the others
      void* const stream = step_executor(exec).stream();
      if (config_.dropout > 0.0f) why = backend->prepare(fused_shape(d, true), stream);
      if (why.empty()) why = backend->prepare(fused_shape(d, false), stream);
    }
    if (why.empty()) return true;
    detail::note_unfused_attention(fp8_core() ? why + " (its fp8 core runs mpx's kernels: right, and slow)" : why);
    return false;
  }
  [[nodiscard]] fused_attention_shape fused_shape(attention_dims const& d, bool dropping) const {
    fused_attention_io const io = fp8_core()                           ? fused_attention_io::float8
                                  : std::is_same_v<storage_type, half> ? fused_attention_io::half
                                                                       : fused_attention_io::bfloat16;
    return {d.batch, d.heads, d.tokens, d.head_width, 3 * width_, width_, io, logit_scale(d),
            dropping ? config_.dropout : 0.0f, config_.deterministic};
  }
  // The latest training forward's {seed, offset} for cuDNN (nullptr without dropout).
  template <class Space>
  [[nodiscard]] std::int64_t const* fused_key() const {
    if (!dropped_) return nullptr;
    return reinterpret_cast<std::int64_t const*>(fused_dropout_key_.template view<Space>().data());
  }
  template <class Space>
  [[nodiscard]] tensor_view<float, Space> statistics(attention_dims const& d) const {
    return statistics_.template view<Space>(shape{d.batch * d.heads, d.tokens});
  }
  // What the unfused path adds: the head-major copies and the [tokens, tokens] tensors.
  template <executor Exec>
  void reserve_unfused(Exec const& exec, attention_dims const& d) {
    std::int64_t const bh = d.batch * d.heads;
    qkv_heads_.ensure(exec, shape{3 * bh, d.tokens, d.head_width});
    o_heads_.ensure(exec, shape{bh, d.tokens, d.head_width});  // O per head, then dO
    logits_.ensure(exec, shape{bh, d.tokens, d.tokens});
    p_.ensure(exec, shape{bh, d.tokens, d.tokens});
    p_store_.ensure(exec, shape{bh, d.tokens, d.tokens});
    dp_.ensure(exec, shape{bh, d.tokens, d.tokens});
    d_heads_.ensure(exec, shape{3 * bh, d.tokens, d.head_width});
  }

  [[nodiscard]] attention_dims dims(std::int64_t batch) const {
    return {batch, input_shape_[0], config_.heads, width_ / config_.heads};
  }
  [[nodiscard]] float logit_scale(attention_dims const& d) const {
    return config_.scale_logits ? 1.0f / std::sqrt(static_cast<float>(d.head_width)) : 1.0f;
  }
  // The view by reference: GCC 12 at -O1 and above can lose writes made through views
  // that a function took by value and returned (mpx::view's note, exec/tensor.hpp).
  template <class T, class Space>
  static auto split_qkv(tensor_view<T, Space> const& heads, attention_dims const& d) {
    std::int64_t const bh = d.batch * d.heads;
    std::size_t const n = static_cast<std::size_t>(bh * d.tokens * d.head_width);
    shape const s{bh, d.tokens, d.head_width};
    struct three {
      tensor_view<T, Space> a, b, c;
    };
    return three{heads.flat(0, n).reshape(s), heads.flat(n, n).reshape(s), heads.flat(2 * n, n).reshape(s)};
  }

  causal_self_attention_config config_;
  std::int64_t width_ = 0;
  dense<Policy> qkv_{1};
  dense<Policy> out_{1};
  detail::layer_tensor<storage_type> qkv_tokens_, qkv_heads_, logits_, p_store_, o_heads_, o_tokens_;
  detail::layer_tensor<float> p_, dp_;
  detail::layer_tensor<float> statistics_;  // fused: each row's log-sum-exp, [batch * heads, tokens]
  detail::layer_tensor<storage_type> d_tokens_, d_heads_;  // dO, then d(QKV); the per-head gradients
  std::uint64_t dropout_seed_ = 0;
  detail::layer_tensor<std::uint64_t> dropout_step_;  // training forwards with dropout, where the executor computes
  detail::layer_tensor<std::uint64_t> fused_dropout_key_;  // the fused path's {seed, offset} (detail::fused_dropout_key)
  dropout_options dropout_options_{};
  bool dropped_ = false;  // the latest forward dropped weights
  std::int64_t latest_batch_ = 0;       // the latest forward's batch
  std::int64_t latest_plan_batch_ = 0;  // the batch of the fused plan it ran (0: it ran unfused)
  std::int64_t fused_batch_ = 0;  // the batch the fused attention's plan is for (0: unfused)
  detail::fp8_attention_core<core_recipe_type> fp8_core_;  // fp8_attention only
};

}  // namespace mpx
