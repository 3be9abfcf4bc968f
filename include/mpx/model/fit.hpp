// mpx::fit and mpx::evaluate: epochs of mini-batches through a classifier_trainer, with
// validation, a progress display and a CSV log, like Keras's model.fit.
//
// A batch source is anything with `start_epoch(std::size_t epoch)` and `next()`
// returning a pointer-like (std::optional, pointer) to a batch, and `batches_per_epoch()`, with `images` and
// `labels` tensor views in the executor's memory (mpx::batch_loader is one), or `inputs`
// and `targets` (mpx::text_batches: token ids and the next token of each).
//
// Progress: on a terminal a Keras-style bar redrawn in place (ETA, steps/s, loss,
// accuracy, loss scale, skipped steps; progress.hpp), then one summary line per epoch;
// otherwise plain lines, a few per epoch, without `\r` or escape codes, that a log keeps.
// The CSV log has one row per step: epoch, step, loss, loss_scale, skipped,
// gradient_norm, accuracy, seconds since the start.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/dist/replica_hooks.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/losses/cross_entropy.hpp>
#include <mpx/losses/loss_value.hpp>
#include <mpx/model/progress.hpp>
#include <mpx/model/shadow.hpp>
#include <mpx/model/train_step.hpp>
#include <mpx/model/training_state.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <unistd.h>

namespace mpx {

struct fit_options {
  //! The run's epochs in all, those done before `start` included (Keras's `epochs`).
  std::size_t epochs = 1;
  //! Where the run starts (Keras's `initial_epoch`, and a batch within it): what
  //! load_training_state returned. `start.epoch` epochs are done, and the first batch is
  //! the source's `start.batch` of the next (start_epoch(start.epoch, start.batch)); the
  //! epochs are numbered on from there, as the uninterrupted run numbered them. The
  //! trainer fit makes counts its own steps from 0, so shadow steps and the guard's
  //! reviews keep their cadence from the resume, not from the run's start.
  training_position start{};
  //! 1: redraw one progress line in place; 0: print plain lines (four per epoch);
  //! -1: redraw when stdout is a terminal, else plain lines. For no output, set `quiet`.
  int progress = -1;
  bool quiet = false;
  std::filesystem::path csv_log;  //!< empty: no log
  //! Host seconds between progress updates. Each update reads the step records, which
  //! on a GPU waits for the queued steps; the default keeps that rare.
  double progress_interval_s = 0.25;
  //! On a cuda_executor, replay each full-size step from a CUDA graph captured once
  //! (classifier_trainer::use_cuda_graph): fewer launches for the CPU to issue.
  bool cuda_graph = false;
  //! Every n-th step (0: never), measure each layer against its float32 twin
  //! (mpx::model_shadow): the CSV log gets three columns per layer (the relative error
  //! of its output, input gradient and weight gradients, filled on those steps), each
  //! epoch's summary holds the reports, and the end of the run prints the table of the
  //! layers that cost the most precision. The training is unchanged; each shadow step
  //! costs about one more step.
  std::size_t shadow_every = 0;
  //! Guards the model's tiered layers (mpx::tiered): a layer whose policy fails it
  //! (its forward pass overflows again and again, its gradients overflow with the loss
  //! scale at its floor, or, with shadow_every, its shadow error passes a bound) moves one
  //! tier up (mpx::precision_guard). Each move is printed with its evidence when it is
  //! made, kept in the epoch's summary, and listed at the end of the run.
  std::optional<guard_options> guard;
  //! Called after every epoch with its summary (e.g. to save a checkpoint).
  std::function<void(struct epoch_summary const&)> on_epoch_end;
  //! Set by a data-parallel job (mpx::data_parallel::hooks): each step averages the
  //! gradients over the replicas; the progress line, the summaries and the validation
  //! hold every replica's samples; only rank 0 prints and writes the CSV log. Every
  //! replica's sources must give the same number of batches per epoch.
  replica_hooks replicas;
};

struct evaluation {
  double loss = 0;       //!< mean cross-entropy over the samples
  double accuracy = 0;   //!< share of samples whose arg-max was the label
  std::size_t samples = 0;
};

struct epoch_summary {
  std::size_t epoch = 0;  //!< from 1
  std::size_t steps = 0;
  std::size_t skipped_steps = 0;
  double loss = 0;       //!< mean training loss over the epoch's finite steps
  double accuracy = 0;   //!< training accuracy (with dropout etc. active)
  float loss_scale = 0;  //!< at the end of the epoch
  double seconds = 0;
  bool validated = false;
  evaluation validation;
  std::vector<shadow_report> shadow;  //!< the epoch's shadow steps (fit_options::shadow_every)
  std::vector<guard_move> tier_moves;  //!< the precision guard's moves in the epoch (fit_options::guard)
};

namespace detail {

//! A batch's model input and its targets, whichever names its source gives them.
template <class B>
auto const& batch_inputs(B const& b) {
  if constexpr (requires { b.images; }) return b.images;
  else return b.inputs;
}
template <class B>
auto const& batch_targets(B const& b) {
  if constexpr (requires { b.labels; }) return b.labels;
  else return b.targets;
}

inline bool stdout_is_terminal() { return ::isatty(STDOUT_FILENO) == 1; }

struct epoch_meter {
  std::size_t steps = 0, skipped = 0, samples = 0, correct = 0, finite = 0;
  double loss_sum = 0;
  float scale = 0;
  //! The meter over every replica's samples (steps, skips and scale are the same on all).
  [[nodiscard]] epoch_meter over(replica_hooks const& replicas) const {
    if (!replicas.sum_values) return *this;
    double v[4] = {static_cast<double>(samples), static_cast<double>(correct), loss_sum, static_cast<double>(finite)};
    replicas.sum_values(v);
    epoch_meter out = *this;
    out.samples = static_cast<std::size_t>(v[0]);
    out.correct = static_cast<std::size_t>(v[1]);
    out.loss_sum = v[2];
    out.finite = static_cast<std::size_t>(v[3]);
    return out;
  }
  void add(step_record const& r) {
    ++steps;
    skipped += r.skipped;
    samples += r.samples;
    correct += r.correct;
    if (std::isfinite(r.loss)) {
      loss_sum += r.loss;
      ++finite;
    }
    scale = r.loss_scale;
  }
  [[nodiscard]] double loss() const { return finite ? loss_sum / static_cast<double>(finite) : NAN; }
  [[nodiscard]] double accuracy() const { return samples ? static_cast<double>(correct) / static_cast<double>(samples) : 0; }
};

// The progress fields of the epoch so far.
inline progress_fields progress_of(epoch_meter const& m, std::size_t epoch, std::size_t epochs, std::size_t step,
                                   std::size_t steps, double seconds, bool finished) {
  return {.epoch = epoch, .epochs = epochs, .step = step, .steps = steps, .seconds = seconds, .loss = m.loss(),
          .accuracy = m.accuracy(), .loss_scale = m.scale, .skipped = m.skipped, .finished = finished};
}

}  // namespace detail

namespace detail {
//! evaluate over this process's batches, which may be none (a replica's share of the
//! validation data).
template <executor Exec, class Model, class Source>
evaluation evaluate_share(Exec const& exec, Model& model, Source& data) {
  using Space = memory_space_t<Exec>;
  using logits_type = typename Model::logits_type;
  loss_value<Space> loss(exec);
  layer_tensor<logits_type> grad;  // the loss writes its gradient; unused here
  std::size_t const capacity = std::max<std::size_t>(1, data.batches_per_epoch());
  tensor<step_record, Space> records(exec, shape{static_cast<std::int64_t>(capacity)});
  evaluation out;
  double loss_sum = 0;
  std::size_t correct = 0, pending = 0;
  std::vector<std::size_t> sizes(capacity);  // samples per pending batch
  auto read_records = [&] {  // synchronises
    if (pending == 0) return;
    auto const host = to_host(exec, records.view().flat(0, pending));
    for (std::size_t i = 0; i < pending; ++i) {
      loss_sum += static_cast<double>(host[i].loss) * static_cast<double>(sizes[i]);
      correct += host[i].correct;
      out.samples += sizes[i];
    }
    pending = 0;
  };
  data.start_epoch(0);
  while (auto batch = data.next()) {
    if (pending == capacity) read_records();  // a source with more batches than it announced
    model.forward(exec, batch_inputs(*batch), false);
    auto const logits = model.template logits<Space>();
    grad.ensure(exec, logits.shape());
    sparse_categorical_cross_entropy<float32>(exec, logits, batch_targets(*batch),
                                              grad.template view<Space>(logits.shape()), loss);
    step_record* rec = records.data() + pending;
    fill(exec, tensor_view<std::uint8_t, Space>(reinterpret_cast<std::uint8_t*>(rec), shape{sizeof(step_record)}),
         std::uint8_t{0});
    count_correct(exec, logits, tensor_view<std::int32_t const, Space>(batch_targets(*batch)), rec);
    copy(exec, tensor_view<float const, Space>(loss.data(), shape{1}), tensor_view<float, Space>(&rec->loss, shape{1}));
    sizes[pending++] = batch_targets(*batch).size();  // samples, or tokens of sequences
  }
  read_records();
  if (out.samples) {
    out.loss = loss_sum / static_cast<double>(out.samples);
    out.accuracy = static_cast<double>(correct) / static_cast<double>(out.samples);
  }
  return out;
}
}  // namespace detail

//! Loss and accuracy of a classifier over every batch of `data` (inference mode:
//! dropout off, batch norm on its running statistics). Each batch's loss and count of
//! correct predictions stay where the executor computes until the end: one
//! synchronisation per evaluation, not per batch.
//! Data with no samples is refused (mpx::invalid_argument): a loss of 0 would look perfect.
template <executor Exec, class Model, class Source>
evaluation evaluate(Exec const& exec, Model& model, Source& data) {
  evaluation const out = detail::evaluate_share(exec, model, data);
  if (out.samples == 0)
    detail::fail<invalid_argument>("evaluate", "the data holds no samples: an evaluation of nothing has no loss or "
                                               "accuracy (an empty data set, or a batch source that yields no batch)");
  return out;
}

//! Trains for options.epochs epochs over `train`, evaluating on `validation` (when not
//! null) after each; returns one summary per epoch.
template <executor Exec, class Model, class Optimizer, class Source, class ValidationSource = Source>
std::vector<epoch_summary> fit(Exec const& exec, Model& model, Optimizer& optimizer, Source& train,
                               fit_options const& options = {}, ValidationSource* validation = nullptr) {
  using clock = std::chrono::steady_clock;
  static_assert(detail::loss_scaled_optimizer<Optimizer>, MPX_FIT_NEEDS_LOSS_SCALE_OPTIMIZER);
  training_position const& resume_at = options.start;
  if (resume_at.epoch > options.epochs || (resume_at.epoch == options.epochs && resume_at.batch != 0))
    detail::fail<invalid_argument>(
        "fit", "the run starts at epoch " + std::to_string(resume_at.epoch + 1) + ", batch " +
                   std::to_string(resume_at.batch) +
                   ", after its last epoch: fit_options::epochs is " + std::to_string(options.epochs) +
                   ", and it counts every epoch of the run, those done before fit_options::start included");
  if constexpr (!requires { train.start_epoch(std::size_t{}, std::size_t{}); })
    if (resume_at.batch != 0)
      detail::fail<invalid_argument>("fit", "the run starts at batch " + std::to_string(resume_at.batch) +
                                                " of an epoch, and this batch source's start_epoch(epoch) cannot "
                                                "start an epoch anywhere but at its first batch");
  if (train.batches_per_epoch() == 0)
    detail::fail<invalid_argument>("fit", "the training data has no batches (an empty data set, or fewer samples "
                                          "than a batch where a short last batch is dropped): nothing to train on");
  classifier_trainer trainer(exec, model, optimizer);
  trainer.use_cuda_graph(options.cuda_graph);
  replica_hooks const& replicas = options.replicas;
  bool const distributed = replicas.active();
  if (distributed) trainer.run_as_replica(replicas);
  bool const quiet = options.quiet || !replicas.prints();
  bool const redraw = !quiet && (options.progress > 0 || (options.progress == -1 && detail::stdout_is_terminal()));
  bool const plain = !quiet && !redraw;
  std::vector<std::string> shadow_layers;
  if (options.shadow_every) detail::shadowed_layer_names(model, shadow_layers);
  std::ofstream csv;
  if (!options.csv_log.empty() && replicas.prints()) {
    csv.open(options.csv_log);
    if (!csv) detail::fail<invalid_argument>("fit", "cannot write the CSV log " + options.csv_log.string());
    csv << "epoch,step,loss,loss_scale,skipped,gradient_norm,accuracy,seconds";
    if (options.shadow_every) {
      for (auto const& n : shadow_layers) csv << ",error/" << n << "/output,error/" << n << "/input_gradient,error/" << n << "/weight_gradient";
    }
    csv << '\n';
  }
  trainer.shadow_every(options.shadow_every);
  if (options.guard) trainer.guard(*options.guard);
  std::size_t moves_shown = 0;  // the guard's moves printed so far
  std::vector<shadow_report> shadows;  // every shadow step of the run, for the final table
  std::size_t logged = 0;              // steps written to the log (a shadow report's step counts the same)
  auto const start = clock::now();
  std::vector<epoch_summary> history;
  for (std::size_t epoch = options.start.epoch + 1; epoch <= options.epochs; ++epoch) {
    // The first epoch of a resumed run starts at the batch it stopped before.
    std::size_t const first_batch = epoch == options.start.epoch + 1 ? options.start.batch : 0;
    auto const epoch_start = clock::now();
    auto last_shown = epoch_start;
    detail::epoch_meter meter;
    std::size_t const steps = train.batches_per_epoch();
    std::size_t step = first_batch, next_plain = std::max<std::size_t>(1, steps / 4);
    while (next_plain <= first_batch) next_plain += std::max<std::size_t>(1, steps / 4);
    // Replicas update the progress together, every `shared_every` steps: the metrics
    // are summed over them, a collective every replica must call at the same step.
    std::size_t const shared_every = std::max<std::size_t>(1, steps / 50);
    std::vector<shadow_report> epoch_shadows;
    auto drain = [&] {
      double const now = std::chrono::duration<double>(clock::now() - start).count();
      auto const records = trainer.history(exec);  // first: it marks the reports of skipped steps
      std::size_t next_shadow = epoch_shadows.size();
      for (auto& r : trainer.take_shadow_reports()) epoch_shadows.push_back(std::move(r));
      for (auto const& r : records) {
        meter.add(r);
        ++logged;
        if (csv) {
          csv << epoch << ',' << meter.steps << ',' << r.loss << ',' << r.loss_scale << ',' << r.skipped << ','
              << r.gradient_norm << ',' << (r.samples ? static_cast<double>(r.correct) / r.samples : 0.0) << ','
              << now;
          if (options.shadow_every) {
            bool const shadowed = next_shadow < epoch_shadows.size() && epoch_shadows[next_shadow].step == logged;
            if (shadowed) {
              for (auto const& e : epoch_shadows[next_shadow].layers)
                for (auto const& v : {e.output, e.input_gradient, e.weight_gradient}) {
                  csv << ',';
                  if (v) csv << *v;
                }
              ++next_shadow;
            } else {
              csv << std::string(3 * shadow_layers.size(), ',');
            }
          }
          csv << '\n';
        }
      }
    };
    if constexpr (requires { train.start_epoch(epoch - 1, first_batch); }) train.start_epoch(epoch - 1, first_batch);
    else train.start_epoch(epoch - 1);  // first_batch is 0 (refused above otherwise)
    std::size_t const steps_before_epoch = trainer.steps_taken();
    while (auto batch = train.next()) {
      trainer.step(exec, detail::batch_inputs(*batch), detail::batch_targets(*batch));
      ++step;
      if (auto const* guard = trainer.guard(); guard && guard->moves().size() > moves_shown) {
        for (; moves_shown < guard->moves().size(); ++moves_shown)
          if (!quiet)
            std::printf("%sprecision guard, step %zu: %s\n", redraw ? "\r\033[K" : "", guard->moves()[moves_shown].step,
                        guard->moves()[moves_shown].text().c_str());
        std::fflush(stdout);
      }
      auto const now = clock::now();
      bool const shared = distributed && step % shared_every == 0;
      bool const show_redraw = redraw && std::chrono::duration<double>(now - last_shown).count() >= options.progress_interval_s &&
                               (!distributed || shared);
      bool const show_plain = plain && step >= next_plain && step < steps && (!distributed || shared);
      if (shared || show_redraw || show_plain || trainer.pending() >= 1024) {
        drain();
        double const s = std::chrono::duration<double>(now - epoch_start).count();
        auto const shown = shared ? meter.over(replicas) : meter;
        auto const fields = detail::progress_of(shown, epoch, options.epochs, step, steps, s, false);
        if (show_redraw) {  // back to the line's start, the new line, then clear what the old one left
          std::printf("\r%s\033[K", progress_line(fields, terminal_columns()).c_str());
          std::fflush(stdout);
          last_shown = now;
        } else if (show_plain) {
          std::printf("%s\n", progress_line(fields, 0).c_str());
          std::fflush(stdout);  // a log being followed (tail -f) sees it now
          next_plain += std::max<std::size_t>(1, steps / 4);
        }
      }
    }
    drain();
    meter = meter.over(replicas);
    epoch_summary summary;
    summary.epoch = epoch;
    summary.steps = meter.steps;
    summary.skipped_steps = meter.skipped;
    summary.loss = meter.loss();
    summary.accuracy = meter.accuracy();
    summary.loss_scale = optimizer.scaler().scale(exec);
    summary.seconds = std::chrono::duration<double>(clock::now() - epoch_start).count();
    if (!quiet) {  // the epoch's summary replaces the redrawn line and stays
      auto const fields = detail::progress_of(meter, epoch, options.epochs, meter.steps, steps, summary.seconds, true);
      std::printf("%s%s", redraw ? "\r\033[K" : "", progress_line(fields, redraw ? terminal_columns() : 0).c_str());
    }
    if (validation) {
      summary.validated = true;
      summary.validation = detail::evaluate_share(exec, model, *validation);
      if (replicas.sum_values) {  // each replica evaluated its own share of the batches
        auto& v = summary.validation;
        double sums[3] = {v.loss * static_cast<double>(v.samples), v.accuracy * static_cast<double>(v.samples),
                          static_cast<double>(v.samples)};
        replicas.sum_values(sums);
        v.samples = static_cast<std::size_t>(sums[2]);
        v.loss = v.samples ? sums[0] / sums[2] : 0;
        v.accuracy = v.samples ? sums[1] / sums[2] : 0;
      }
      if (summary.validation.samples == 0)
        detail::fail<invalid_argument>("fit", "the validation data holds no samples: its loss and accuracy would "
                                              "be meaningless (pass no validation source to skip validation)");
      if (!quiet)
        std::printf("  val_loss %.4f  val_acc %.4f", summary.validation.loss, summary.validation.accuracy);
    }
    if (!quiet) {
      std::printf("\n");
      std::fflush(stdout);
    }
    if (csv) csv.flush();
    shadows.insert(shadows.end(), epoch_shadows.begin(), epoch_shadows.end());
    summary.shadow = std::move(epoch_shadows);
    if (auto const* guard = trainer.guard())
      for (auto const& m : guard->moves())
        if (m.step > steps_before_epoch)
          summary.tier_moves.push_back(m);
    history.push_back(std::move(summary));
    if (options.on_epoch_end) options.on_epoch_end(history.back());
  }
  if (options.shadow_every && !quiet) {
    std::printf("\n%s", shadow_table(shadows).c_str());
    std::fflush(stdout);
  }
  if (auto const* guard = trainer.guard(); guard && !quiet) {
    std::printf("\nPrecision guard: %s", guard->moves().empty() ? "no layer was moved\n"
                                                                 : ("\n" + guard->summary()).c_str());
    std::fflush(stdout);
  }
  return history;
}

}  // namespace mpx
