// mpx::classifier_trainer: one loss-scaled training step of a classifier, wired from a
// sequential model, sparse categorical cross-entropy and a loss_scale_optimizer:
//
//   forward (training) -> cross-entropy from the logits, its gradient multiplied by the
//   loss scale in the same pass -> backward -> unscale, check, clip, step or skip,
//   update the scale -> record (loss, scale, skipped, correct predictions)
//
// On a cuda_executor all of it is enqueued without a host synchronisation: the loss,
// the scale and the verdict stay on the GPU in a per-step record that is read when you
// ask (history()), so the host runs ahead of the GPU.
#pragma once

#include <mpx/core/checkpoint_file.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/dist/replica_hooks.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/resident.hpp>
#include <mpx/exec/streams.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/cublaslt.hpp>
#include <mpx/kernels/fused_attention.hpp>
#include <mpx/kernels/step_record.hpp>
#include <mpx/layers/matrix_products.hpp>
#include <mpx/losses/cross_entropy.hpp>
#include <mpx/losses/loss_value.hpp>
#include <mpx/model/graph_capture_rules.hpp>
#include <mpx/model/precision_guard.hpp>
#include <mpx/model/sequential.hpp>
#include <mpx/model/shadow.hpp>
#include <mpx/optim/loss_scale_optimizer.hpp>

#include <algorithm>
#include <array>
#include <functional>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx {

namespace detail {

//! A value that tells a batch's element types apart (float images, half images, int32
//! token ids), for the graph mode's "is this the batch I captured" test.
template <class T>
inline constexpr char batch_type_tag = 0;
template <class T>
constexpr void const* batch_type_key() noexcept {
  return &batch_type_tag<T>;
}

#if MPX_HAS_CUDA
//! CUDA's graph calls for capture_graph (graph_capture_rules.hpp), on `stream`.
struct cuda_graph_backend {
  using graph = cudaGraph_t;
  using executable = cudaGraphExec_t;
  using status = cudaError_t;
  cudaStream_t stream = nullptr;

  void begin_capture() const { MPX_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal)); }
  status end_capture(graph& g) const { return cudaStreamEndCapture(stream, &g); }
  static status instantiate(executable& e, graph g) { return cudaGraphInstantiate(&e, g, 0); }
  static void destroy_graph(graph g) noexcept { report_if_failed(cudaGraphDestroy(g), "cudaGraphDestroy"); }
  static void clear_error() noexcept { static_cast<void>(cudaGetLastError()); }
  static bool ok(status s) noexcept { return s == cudaSuccess; }
  static void check(status s, char const* call) { check_cuda(s, call, __FILE__, __LINE__); }
};
#endif

}  // namespace detail

//! Adds to record->correct the rows of logits [rows, classes] whose arg-max is the label
//! (the first of tied maxima; a row holding a NaN logit never counts). Sequences: logits
//! [batch, tokens, classes] and labels [batch, tokens] count every token.
template <executor Exec, class T, class Space = memory_space_t<Exec>>
void count_correct(Exec const& exec, tensor_view<T const, Space> logits, tensor_view<std::int32_t const, Space> labels,
                   step_record* record) {
  auto const rows = static_cast<std::int64_t>(labels.size());
  bool matches = logits.shape().rank() == labels.shape().rank() + 1;
  for (std::size_t i = 0; matches && i < labels.shape().rank(); ++i) matches = labels.shape()[i] == logits.shape()[i];
  if (!matches)
    detail::fail<shape_error>("mpx::count_correct", "logits " + logits.shape().to_string() + " and labels " +
                                                        labels.shape().to_string() + " hold different batches");
  std::int64_t const cols = rows ? static_cast<std::int64_t>(logits.size()) / rows : 0;
  if (rows == 0) return;
  detail::count_correct_pass(exec, logits.data(), labels.data(), rows, cols, record);
}

//! Trains a classifier (a sequential model whose output, or whose final softmax's input,
//! holds one logit per class) with a loss_scale_optimizer. Keeps a record per step on the
//! executor for up to `capacity` steps between calls to history().
//! On a cuda_executor, give every call the same stream: the model's and the trainer's
//! buffers are freed in order on the stream they were made on.
namespace detail {
template <class O>
concept loss_scaled_optimizer = requires(O& o) {
  o.optimizer();
  o.scaler();
};
}  // namespace detail
#define MPX_FIT_NEEDS_LOSS_SCALE_OPTIMIZER                                                                             \
  "mpx::fit and mpx::classifier_trainer take a loss_scale_optimizer, which checks each step's gradients: wrap the "   \
  "optimizer, e.g. mpx::loss_scale_optimizer(mpx::adam(exec, model.parameters(exec), 1e-3f), "                        \
  "mpx::loss_scaler_for<Policy>(exec)) (a static scale of 1 where the policy needs none)"

template <class Exec, class Model, class LossScaleOptimizer>
class classifier_trainer {
  static_assert(detail::loss_scaled_optimizer<LossScaleOptimizer>, MPX_FIT_NEEDS_LOSS_SCALE_OPTIMIZER);
  using Space = memory_space_t<Exec>;
  using logits_type = typename Model::logits_type;

 public:
  classifier_trainer(Exec const& exec, Model& model, LossScaleOptimizer& optimizer, std::size_t capacity = 4096)
      : model_(model), optimizer_(optimizer), loss_(exec), records_(exec, shape{static_cast<std::int64_t>(capacity * sizeof(step_record))}),
        capacity_(capacity) {
    if (capacity == 0)
      detail::fail<invalid_argument>("mpx::classifier_trainer", "the step log needs room for at least one step");
  }

  //! One step on images [batch, sample shape...] and labels [batch] (int32 in [0, classes)).
  template <class T>
  void step(Exec const& exec, tensor_view<T const, Space> images, tensor_view<std::int32_t const, Space> labels) {
    if (pending_ == capacity_)
      detail::fail<invalid_argument>("mpx::classifier_trainer::step",
                                     "the step log is full (" + std::to_string(capacity_) +
                                         " steps): read history() at least that often");
    // Every step, a graph's replay included: a replay runs no host code of the optimizer's.
    optimizer_.optimizer().require_current_parameters();
    if (replicas_.before_step) replicas_.before_step();
    bool const shadow = shadow_every_ && (steps_ + 1) % shadow_every_ == 0;
    ++steps_;
    if constexpr (!is_host_executor_v<Exec>) {
#if MPX_HAS_CUDA
      if (use_graph_) {
        graph_mode_step(exec, images, labels, shadow);
        if (replicas_.after_step) replicas_.after_step(step_executor(exec));
        review_guard(exec);
        return;
      }
#endif
    }
    step_body(exec, images, labels, record(pending_), shadow);
    ++pending_;
    if (replicas_.after_step) replicas_.after_step(step_executor(exec));
    review_guard(exec);
  }
  template <class T>
  void step(Exec const& exec, tensor_view<T, Space> images, tensor_view<std::int32_t, Space> labels) {
    step(exec, tensor_view<T const, Space>(images), tensor_view<std::int32_t const, Space>(labels));
  }

  //! On a cuda_executor: after one eager step, capture a step in a CUDA graph and replay
  //! it for every batch of that shape (others, such as a short last batch, run eagerly).
  //! The batch is first copied into buffers the graph reads. The steps run on the
  //! trainer's own stream (capture is illegal on the legacy default stream), ordered
  //! after the executor's stream and before its later work by events. The graph is
  //! captured again when the model's buffers moved (a larger batch reserved them again,
  //! by a step or an evaluate), the optimizer's rule changed (a new learning rate) or its
  //! stochastic-rounding seed did (a load), or run_as_replica was called again (see
  //! graph_state). As a replica, the collectives are captured with the step.
  //! Dropout layers keep their step count on the GPU, so each replay draws fresh masks.
  //! Ignored on the host executor.
  void use_cuda_graph(bool on) noexcept { use_graph_ = on; }
  //! How many times graph mode has captured the step: once, plus once after each change
  //! listed above (a capture costs about an eager step). 0 on the host executor.
  [[nodiscard]] std::size_t cuda_graph_captures() const noexcept { return graph_rules_.captures(); }

  //! Every n-th step (0: never), measures each layer against its float32 twin between the
  //! backward pass and the optimizer step (mpx::model_shadow), which does not change the
  //! training. Such a step synchronises and, in graph mode, runs eagerly on the buffers a
  //! replay reads. Read the reports with take_shadow_reports().
  void shadow_every(std::size_t n) noexcept { shadow_every_ = n; }
  //! The shadow reports since the last call, oldest first. A report's `skipped` (the
  //! step overflowed) is known once history() has read its step's record: call
  //! history() first.
  std::vector<shadow_report> take_shadow_reports() { return std::exchange(shadow_reports_, {}); }
  //! Guards the model's tiered layers (mpx::tiered, mpx::precision_guard): after each
  //! step the scaler skips, the layer that wrote the first NaN or inf is counted on the
  //! executor; every options.review_every steps the counts (and any shadow step's errors)
  //! are read and a failing layer moves one tier up from the next step on (and, with
  //! options.move_down_after, a quiet one back down). As a replica, each count is the
  //! maximum over the replicas, which move alike.
  void guard(guard_options options) {
    if (replicas_.count > 1 && !replicas_.max_values)
      detail::fail<invalid_argument>("classifier_trainer::guard", "as a replica the guard needs the hooks' "
                                                                  "max_values (mpx::data_parallel::hooks gives it)");
    guard_->emplace(options);
    ++guard_generation_;  // a graph captured with the previous guard (or none) is stale
  }
  //! The guard, or nullptr when there is none.
  [[nodiscard]] precision_guard<Space> const* guard() const noexcept { return active_guard(); }
  //! Steps taken since the trainer was made (a shadow report's step counts the same way),
  //! or since the run it resumed began (load_training_state(exec, trainer, directory)).
  [[nodiscard]] std::size_t steps_taken() const noexcept { return steps_; }
  //! The model and the optimizer it trains.
  [[nodiscard]] Model& model() const noexcept { return model_; }
  [[nodiscard]] LossScaleOptimizer& optimizer() const noexcept { return optimizer_; }

  //! The trainer's own part of a training state (save_training_state(exec, trainer,
  //! directory)): its step count, and its precision guard's state. Synchronises.
  void save_state(Exec const& exec, detail::checkpoint_writer& out) const {
    out.add_value("trainer/steps", static_cast<std::uint64_t>(steps_));
    out.add_value("trainer/guarded", static_cast<std::uint64_t>(active_guard() != nullptr));
    if (precision_guard<Space> const* guard = active_guard()) guard->save(exec, out, "guard/");
  }
  //! Reads that part (load_training_state(exec, trainer, directory)) and returns what
  //! keeps it. A save with a guard needs a trainer with one (given the same
  //! review_every); a save without one leaves this trainer's guard fresh.
  [[nodiscard]] std::function<void()> read_state(detail::checkpoint_reader const& in) {
    if (steps_ != 0 || pending_ != 0)
      detail::fail<invalid_argument>("mpx::load_training_state", "the trainer has run steps: load a training state "
                                                                 "into a new trainer");
    if (!in.contains("trainer/steps")) return {};  // saved from the model and optimizer alone
    auto const steps = in.value<std::uint64_t>("trainer/steps");
    std::function<void()> keep_guard;
    if (in.value<std::uint64_t>("trainer/guarded") != 0) {
      precision_guard<Space>* const guard = active_guard();
      if (!guard)
        in.refuse("it was saved by a trainer with a precision guard: give this trainer one (trainer.guard(options)) "
                  "before loading; nothing was loaded");
      keep_guard = guard->read(in, "guard/");
    }
    return [this, steps, keep_guard] {
      steps_ = static_cast<std::size_t>(steps);
      if (keep_guard) keep_guard();
    };
  }

  //! Runs each step as one replica of a data-parallel job (mpx::data_parallel::hooks):
  //! the gradients are averaged over the replicas between the backward pass and the
  //! optimizer step, where every replica then reaches the same verdict.
  //! Every hook is given the executor the step runs on (in graph mode the trainer's own
  //! stream, not the caller's), so what it enqueues is ordered, and captured, in the step.
  void run_as_replica(replica_hooks hooks) {
    if (active_guard() && hooks.count > 1 && !hooks.max_values)
      detail::fail<invalid_argument>("classifier_trainer::run_as_replica", "the guard needs the hooks' max_values "
                                                                           "(mpx::data_parallel::hooks gives it)");
    unhook_model_.reset();  // the previous call's hooks go first, not after these are installed
    replicas_ = std::move(hooks);
    ++replica_generation_;  // a graph captured with the previous hooks is stale
    // The model and its fp8 layers call back without an executor: they reach the step's
    // through step_at_, which each step sets before it runs.
    auto const at = step_at_;
    // Early reductions index the optimizer's parameters by the model's order: only when
    // the optimizer holds exactly the model's parameters, in order (else all at the end).
    auto const ours = model_.template parameters<Space>();
    auto const& theirs = optimizer_.optimizer().parameters();
    bool const same = ours.size() == theirs.size() &&
                      std::equal(ours.begin(), ours.end(), theirs.begin(),
                                 [](auto const& a, auto const& b) { return a.gradient.data() == b.gradient.data(); });
    std::function<void(std::size_t)> final_from;
    // A guard first reads this replica's own gradients, before they are averaged. A
    // backward pass outside a step (probe_loss_scales) is this process's alone: it
    // starts no all-reduce (the other replicas are not in it) and is not the guard's.
    if (same && replicas_.gradients_final)
      final_from = [at, f = replicas_.gradients_final, guard = guard_, model = &model_](std::size_t first) {
        if (!at->running) return;
        if (*guard) (*guard)->scan_own_gradients(at->exec.template as<Exec>(), *model, first);
        f(at->exec, first);
      };
    gradients_reduced_in_backward_ = static_cast<bool>(final_from);
    model_.template on_gradients_final<Space>(std::move(final_from));
    // The hook may not outlive this trainer (nor the job it calls into).
    Model* const model = &model_;
    // fp8 layers max-reduce their amaxes over the replicas before each scale update;
    // only in a step (a probe's backward on one rank would start a collective alone).
    std::function<void(float*)> amax_reduction;
    if (replicas_.max_in_place)
      amax_reduction = [at, f = replicas_.max_in_place](float* x) {
        if (at->running) f(at->exec, x);
      };
    for (auto& entry : detail::model_fp8_scales<Exec>(model_)) entry.set_amax_reduction(amax_reduction);
    unhook_model_ = std::shared_ptr<void>(nullptr, [model](void*) {
      model->template on_gradients_final<Space>({});
      for (auto& entry : detail::model_fp8_scales<Exec>(*model)) entry.set_amax_reduction({});
    });
  }

  using rule_type = std::remove_cvref_t<decltype(std::declval<LossScaleOptimizer&>().optimizer().rule())>;
  static_assert(std::is_trivially_copyable_v<rule_type>, "an optimizer's rule is passed to kernels by value");

  //! What a step captured in a CUDA graph holds as it was at capture, besides the batch
  //! and cuBLASLt's workspaces: a replay first compares it with graph_state_now() and
  //! captures the step again on any difference. The host sees all of it (tests do).
  struct graph_state {
    std::uint64_t buffer_generation = 0;  //!< the model's buffers (a larger batch reserves them again)
    void const* d_logits = nullptr;       //!< the trainer's gradient of the logits
    std::array<std::byte, sizeof(rule_type)> rule{};  //!< the rule's values, kernel arguments (learning rate...)
    bool stochastic_rounding = false;     //!< the optimizer's rounding: a kernel argument, with
    std::uint64_t rounding_seed = 0;      //!< its seed (load() restores a saved one)
    std::uint64_t replica_generation = 0;  //!< run_as_replica's hooks: the collectives and amax reductions captured
    std::uint64_t guard_generation = 0;    //!< guard() calls: the guard whose scan the graph runs
    std::uint64_t tiers = 0;               //!< which tier each tiered layer runs (a digest)
    friend bool operator==(graph_state const&, graph_state const&) = default;
  };
  [[nodiscard]] graph_state graph_state_now() const {
    graph_state s;
    s.buffer_generation = model_.buffer_generation();
    s.d_logits = d_logits_.allocated() ? d_logits_.template view<Space>().data() : nullptr;
    std::memcpy(s.rule.data(), &optimizer_.optimizer().rule(), sizeof(rule_type));
    s.stochastic_rounding = optimizer_.optimizer().master_options().stochastic_rounding;
    s.rounding_seed = optimizer_.optimizer().master_options().seed;
    s.replica_generation = replica_generation_;
    s.guard_generation = guard_generation_;
    for (auto const& t : detail::model_tiers(model_)) s.tiers = s.tiers * 31 + *t.active + 1;
    return s;
  }

 private:
  // What a captured graph holds as it was at capture: graph_state, and cuBLASLt's
  // workspaces (detail::lt_context's generation: release_gemm_resources frees them).
  using graph_capture_state = std::pair<graph_state, std::uint64_t>;
  using graph_rules = detail::graph_capture_rules<graph_capture_state>;

 public:
  //! The records of the steps since the last call (synchronises), oldest first.
  std::vector<step_record> history(Exec const& exec) {
    std::vector<step_record> out(pending_);
    if (pending_) {
      auto host = to_host(exec, records_.view().flat(0, pending_ * sizeof(step_record)));
      std::memcpy(out.data(), host.data(), pending_ * sizeof(step_record));
    }
    // The shadow reports of steps that overflowed: their errors are the overflow's.
    std::size_t const first_step = steps_ - pending_ + 1;
    for (auto& report : shadow_reports_)
      if (report.step >= first_step && report.step < first_step + pending_)
        report.skipped = out[report.step - first_step].skipped != 0;
    pending_ = 0;
    return out;
  }
  [[nodiscard]] std::size_t pending() const noexcept { return pending_; }
  [[nodiscard]] loss_value<Space>& loss() noexcept { return loss_; }

 private:
  step_record* record(std::size_t i) const { return reinterpret_cast<step_record*>(records_.data()) + i; }
  //! The guard, or nullptr (none set, or the trainer was moved from).
  precision_guard<Space>* active_guard() const noexcept { return guard_ && *guard_ ? &**guard_ : nullptr; }

  template <class T>
  void step_body(Exec const& exec, tensor_view<T const, Space> images, tensor_view<std::int32_t const, Space> labels,
                 step_record* rec, bool shadow = false) {
    step_at_->exec = step_executor(exec);  // where the model's replica hooks enqueue (see run_as_replica)
    step_at_->running = true;
    // On the way out; when an exception leaves the step, the all-reduces its backward
    // started are forgotten (a replica's next step starts its own).
    struct step_ends {
      step_in_flight& step;
      replica_hooks const& replicas;
      int exceptions = std::uncaught_exceptions();
      ~step_ends() {
        step.running = false;
        if (std::uncaught_exceptions() > exceptions && replicas.step_abandoned) replicas.step_abandoned(step.exec);
      }
    } const ends{*step_at_, replicas_};
    precision_guard<Space>* const guard = active_guard();
    if (guard && replicas_.active()) guard->begin_replica_step(exec);
    model_.forward(exec, images, true);
    auto const logits = model_.template logits<Space>();
    d_logits_.ensure(exec, logits.shape());  // grows only: a captured graph keeps its address
    auto const d_logits = d_logits_.template view<Space>(logits.shape());
    fill(exec, tensor_view<std::uint8_t, Space>(reinterpret_cast<std::uint8_t*>(rec), shape{sizeof(step_record)}),
         std::uint8_t{0});
    count_correct(exec, logits, labels, rec);
    float const* scale = optimizer_.scale_data();
    copy(exec, tensor_view<float const, Space>(scale, shape{1}),
         tensor_view<float, Space>(&rec->loss_scale, shape{1}));  // the scale this step used
    sparse_categorical_cross_entropy<float32>(exec, logits, labels, d_logits, loss_, scale);
    model_.backward_from_logits(exec, tensor_view<logits_type const, Space>(d_logits));
    // The weight gradients a replica averaged during the backward are no longer its own.
    if (shadow) {
      shadow_reports_.push_back(shadow_.measure(exec, model_, steps_, !gradients_reduced_in_backward_));
      if (guard) guard->add_shadow(shadow_reports_.back());
    }
    if (guard && replicas_.active()) guard->scan_own_gradients(exec, model_, 0);  // those not read yet
    if (replicas_.after_backward) replicas_.after_backward(step_executor(exec));
    optimizer_.step(exec);
    write_record(exec, rec, static_cast<std::uint32_t>(labels.size()));
    if (guard) guard->watch(exec, model_, images, rec, scale_floor(), replicas_.active());
  }

  //! The loss scale at or below which a backward overflow is the model's, not the
  //! scale's: the dynamic rule's min_scale; any scale for a fixed one.
  [[nodiscard]] float scale_floor() const {
    if constexpr (requires { optimizer_.scaler().rule().min_scale; }) return optimizer_.scaler().rule().min_scale;
    else return std::numeric_limits<float>::infinity();
  }

  template <class E>
  void review_guard(E const& exec) {
    precision_guard<Space>* const guard = active_guard();
    if (guard && steps_ % guard->options().review_every == 0)
      guard->review(exec, model_, steps_, replicas_.max_values, scale_floor());
  }

#if MPX_HAS_CUDA
  graph_capture_state capture_state_now() const {
    return {graph_state_now(), detail::lt_cache().generation()};
  }

  // Graph mode: every step (eager or replayed) runs on the side stream, so the eager steps
  // also warm what capture may not create (cuBLASLt's workspace for that stream). The
  // buffers are made beforehand on the caller's stream, which outlives the trainer's.
  template <class T>
  void graph_mode_step(Exec const& exec, tensor_view<T const, Space> images,
                       tensor_view<std::int32_t const, Space> labels, bool shadow) {
    if (!graph_streams_) {
      // When the last trainer sharing it goes (after its graph), the stream's cuBLASLt
      // and fused-attention workspaces go too: every trainer makes a stream of its own.
      graph_streams_ = std::shared_ptr<detail::side_stream>(new detail::side_stream, [](detail::side_stream* s) {
        detail::lt_cache().forget_stream(s->stream);
        if (fused_attention_backend* const attention = fused_attention()) attention->forget_stream(s->stream);
        delete s;
      });
    }
    std::int64_t const batch = images.shape()[0];
    model_.template reserve_for_input<T>(exec, batch);
    d_logits_.ensure(exec, detail::with_batch(batch, model_.output_shape()));  // the logits' shape (a softmax keeps it)
    // detail::graph_capture_rules say what this step does; the state a graph holds
    // includes cuBLASLt's workspaces (after release_gemm_resources, a capture would find
    // none for the stream: only an eager product makes one).
    typename graph_rules::batch const batch_kind{images.shape(), detail::batch_type_key<T>()};
    detail::graph_step const next = graph_rules_.next(batch_kind, capture_state_now());
    if (!graph_rules_.has_graph()) graph_exec_.reset();  // captured in another state
    bool const replay = next != detail::graph_step::eager;
    if (next == detail::graph_step::capture) {  // the buffers the graph reads its batch from, made outside the capture
      graph_images_ = tensor<std::uint8_t, Space>(exec, shape{static_cast<std::int64_t>(images.size_bytes())});
      graph_labels_ = tensor<std::int32_t, Space>(exec, labels.shape());
      graph_record_ = tensor<step_record, Space>(exec, shape{1});
    }
    Exec const on = exec.on(graph_streams_->stream);
    graph_streams_->follow(exec.stream());
    try {
      if (replay && shadow) {
        // Eagerly, on the buffers and the stream a replay uses, so the step computes
        // what the replay would have (cuBLASLt chooses its algorithm by alignment too).
        tensor_view<T, Space> const in(reinterpret_cast<T*>(graph_images_.data()), images.shape());
        copy(on, images, in);
        copy(on, labels, graph_labels_);
        step_body(on, tensor_view<T const, Space>(in), tensor_view<std::int32_t const, Space>(graph_labels_),
                  record(pending_), true);
        ++pending_;
      } else if (replay) {
        graph_step(on, images, labels, batch_kind);
      } else {
        step_body(on, images, labels, record(pending_), shadow);
        ++pending_;
        graph_rules_.ran_eagerly(batch_kind, capture_state_now());
      }
    } catch (...) {
      // What was enqueued (a copy of the caller's batch, say) still runs on the side
      // stream: order the caller's later work after it before reporting the failure.
      try {
        graph_streams_->precede(exec.stream());
      } catch (...) {
      }
      throw;
    }
    graph_streams_->precede(exec.stream());
    // A replay skips loss_scaler::update's host side: look for a stuck scale here (it
    // reads mapped memory, never waits).
    optimizer_.scaler().poll();
  }

  template <class T>
  void graph_step(Exec const& on, tensor_view<T const, Space> images, tensor_view<std::int32_t const, Space> labels,
                  typename graph_rules::batch const& batch_kind) {
    cudaStream_t const stream = on.stream();
    tensor_view<T, Space> const in(reinterpret_cast<T*>(graph_images_.data()), images.shape());
    copy(on, images, in);
    copy(on, labels, graph_labels_);
    if (!graph_exec_) {
      detail::cuda_graph_backend backend{stream};
      cudaGraphExec_t const instance = detail::capture_graph(
          backend,
          [&] {
            step_body(on, tensor_view<T const, Space>(in), tensor_view<std::int32_t const, Space>(graph_labels_),
                      graph_record_.data());
          },
          [&] { graph_rules_.capture_failed(); });
      graph_exec_ = std::shared_ptr<CUgraphExec_st>(instance, [](cudaGraphExec_t g) {
        detail::report_if_failed(cudaGraphExecDestroy(g), "cudaGraphExecDestroy");
      });
      graph_rules_.captured(batch_kind, capture_state_now());
      captured_in_flight_ = model_.in_flight_state();
    }
    MPX_CUDA_CHECK(cudaGraphLaunch(graph_exec_.get(), stream));
    model_.restore_in_flight_state(captured_in_flight_);  // logits() and trace() see the replayed batch
    copy(on, tensor_view<step_record const, Space>(graph_record_.data(), shape{1}),
         tensor_view<step_record, Space>(record(pending_), shape{1}));
    ++pending_;
    // Last: the step is recorded whatever it throws (an aborted communicator's reason).
    if (replicas_.step_replayed) replicas_.step_replayed(step_executor(on));  // its collectives timed
  }

#endif

#if MPX_HAS_CUDA_RUNTIME
  // The graph mode's state. Declared wherever the CUDA runtime's header is found, under
  // g++ as under nvcc, so a trainer has one layout in every file of a program.
  std::shared_ptr<detail::side_stream> graph_streams_;
  std::shared_ptr<CUgraphExec_st> graph_exec_;
  tensor<std::uint8_t, Space> graph_images_;
  tensor<std::int32_t, Space> graph_labels_;
  tensor<step_record, Space> graph_record_;
  typename Model::in_flight captured_in_flight_{};
#endif
  graph_rules graph_rules_;  // plain C++, declared in every build

  void write_record(Exec const& exec, step_record* rec, std::uint32_t samples) {
    // loss_scale was captured before the step; keep it, the scaler may have moved on.
    detail::record_step(exec, rec, loss_.data(), &rec->loss_scale, optimizer_.optimizer().gradients().summary_data(),
                        samples);
  }

  Model& model_;
  LossScaleOptimizer& optimizer_;
  loss_value<Space> loss_;
  tensor<std::uint8_t, Space> records_;
  detail::layer_tensor<logits_type> d_logits_;
  std::size_t capacity_;
  std::size_t pending_ = 0;
  bool use_graph_ = false;
  replica_hooks replicas_;
  std::uint64_t replica_generation_ = 0;  // run_as_replica calls, for graph_state
  //! The executor of the step that runs, and whether one does (a backward pass outside a
  //! step calls the model's hooks too).
  struct step_in_flight {
    step_executor exec;
    bool running = false;
  };
  std::shared_ptr<step_in_flight> step_at_ = std::make_shared<step_in_flight>();
  std::shared_ptr<void> unhook_model_;  // removes the model's gradients_final hook when the trainer goes
  bool gradients_reduced_in_backward_ = false;  // a replica's early reductions average them in place
  std::size_t steps_ = 0;
  std::size_t shadow_every_ = 0;
  model_shadow<Space> shadow_;
  std::vector<shadow_report> shadow_reports_;
  // Shared with the model's gradients_final hook, which outlives a move of the trainer
  // (as step_at_) and sees a guard set after run_as_replica.
  std::shared_ptr<std::optional<precision_guard<Space>>> guard_ = std::make_shared<std::optional<precision_guard<Space>>>();
  std::uint64_t guard_generation_ = 0;  // guard() calls, for graph_state
};

template <class Exec, class Model, class Opt>
classifier_trainer(Exec const&, Model&, Opt&, std::size_t = 4096) -> classifier_trainer<Exec, Model, Opt>;

}  // namespace mpx
