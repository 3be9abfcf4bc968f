// What a training step records where the executor computes (mpx::step_record), and the
// kernels that fill it: the rows whose arg-max logit is the label, and the loss, scale
// and verdict of the step. model/train_step.hpp's trainer calls them as the last act of
// a step, so a CUDA step writes its record without a host synchronisation.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/kernels/unscale_and_check.hpp>

#include <cstddef>
#include <cstdint>

namespace mpx {

//! What one training step leaves behind, read with classifier_trainer::history().
struct step_record {
  float loss = 0;                 //!< mean cross-entropy of the batch (unscaled)
  float loss_scale = 0;           //!< the scale the step's gradients were computed with
  std::uint32_t skipped = 0;      //!< 1 when a gradient was NaN or inf and the update was skipped
  std::uint32_t correct = 0;      //!< samples whose arg-max logit was the label
  std::uint32_t samples = 0;      //!< batch size
  float gradient_norm = 0;        //!< global L2 norm of the unscaled gradients
};

namespace detail {

//! Index of the largest of n values, the first on ties (-inf included); -1, which no
//! label equals, when the row holds a NaN (a diverged model predicts nothing) or is empty.
template <class T>
MPX_HD std::int32_t argmax_row(T const* row, std::int64_t n) {
  if (n <= 0) return -1;
  std::int32_t best = 0;
  float bv = cast<float>(row[0]);
  if (bv != bv) return -1;
  for (std::int64_t j = 1; j < n; ++j) {
    float const v = cast<float>(row[j]);
    if (v != v) return -1;
    if (v > bv) {
      bv = v;
      best = static_cast<std::int32_t>(j);
    }
  }
  return best;
}

//! Whether a row of logits predicts `label` (never when argmax_row gives -1).
template <class T>
MPX_HD bool predicts(T const* row, std::int64_t n, std::int32_t label) {
  std::int32_t const best = argmax_row(row, n);
  return best >= 0 && best == label;
}

//! Fills a step's record from the loss, the scale, the check's verdict and the batch
//! size; `correct` (counted before) is kept. `scale` may point into *out.
template <class T>
MPX_HD void write_step_record(step_record* out, float const* loss, float const* scale, gradient_summary const* s,
                              std::uint32_t samples) {
  out->loss = *loss;
  out->loss_scale = *scale;
  out->skipped = s->found_nonfinite ? 1u : 0u;
  out->samples = samples;
  out->gradient_norm = s->norm;
}

//! One row of count_correct_pass: counts it when its arg-max is its label.
template <class T>
struct count_correct_row {
  T const* logits;
  std::int32_t const* labels;
  std::int64_t cols;
  step_record* out;
  MPX_HD void operator()(std::size_t r) const {
    auto const row = static_cast<std::int64_t>(r);
    if (predicts(logits + row * cols, cols, labels[row])) add_to_count(&out->correct, 1u);
  }
};

struct write_step_record_once {
  step_record* out;
  float const* loss;
  float const* scale;
  gradient_summary const* summary;
  std::uint32_t samples;
  MPX_HD void operator()() const { write_step_record<float>(out, loss, scale, summary, samples); }
};

//! Writes *out (in the executor's space) as the last act of a training step; see
//! write_step_record. Enqueued only on a cuda_executor. (A function of its own so that
//! the record's kernel can be tested without a trainer.)
template <executor Exec>
void record_step(Exec const& exec, step_record* out, float const* loss, float const* scale,
                 gradient_summary const* summary, std::uint32_t samples) {
  run_once(exec, write_step_record_once{out, loss, scale, summary, samples});
}

//! Adds to out->correct the rows of logits [rows, cols] whose arg-max is labels[r],
//! host or CUDA (one atomic add per correct row).
template <class Exec, class T>
void count_correct_pass(Exec const& exec, T const* logits, std::int32_t const* labels, std::int64_t rows,
                        std::int64_t cols, step_record* out) {
  if (rows <= 0) return;
  for_each_index(exec, static_cast<std::size_t>(rows), count_correct_row<T>{logits, labels, cols, out});
}

}  // namespace detail
}  // namespace mpx
