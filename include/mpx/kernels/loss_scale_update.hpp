// The end of a loss-scaled step where the executor computes: the scaler's state, the
// rule's update applied to the gradient check's verdict, the optimizer's step count,
// and the signal a stuck scale leaves for the host (scaling/loss_scaler.hpp polls it;
// scaling/loss_scale_rules.hpp holds the rules). One call on the host, one thread on the GPU.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/kernels/unscale_and_check.hpp>

#include <cstdint>
#include <cstring>

namespace mpx {

//! A scaler's state, updated once per step on the executor.
struct loss_scale_state {
  float scale = 1;                     //!< the factor the loss (and so every gradient) is multiplied by
  std::int32_t good_steps = 0;         //!< finite steps since the scale last changed or overflowed
  std::int32_t overflows_left = 1;     //!< non-finite steps still tolerated before backing off (hysteresis)
  //! Always 0: the four bytes the alignment of applied_steps needs, named so that every
  //! byte of a saved state is defined (two saves of the same state are the same bytes).
  std::uint32_t unused = 0;
  std::uint64_t applied_steps = 0;     //!< steps whose update was applied
  std::uint64_t skipped_steps = 0;     //!< steps skipped because a gradient was NaN or ±inf
  std::uint32_t overflows_at_minimum = 0;  //!< consecutive non-finite steps taken at the minimum scale
  std::uint32_t last_step_skipped = 0;     //!< 1 when the latest step was skipped
};
static_assert(sizeof(loss_scale_state) == 40, "loss_scale_state has no padding: a checkpoint writes all of its bytes");

namespace detail {

//! What the host polls without waiting: the step at which the latest run of overflows
//! at the minimum reached report_after (consecutive == 0: no run has yet). Written by
//! the device as one 16-byte store, once per run, at that step and never after: however
//! late the host reads it, it reads that step's values, not a later step's.
struct alignas(16) stuck_signal {
  std::uint32_t consecutive;
  std::uint32_t streak;  //!< identifies the run of overflows (the skipped count when it began)
  //! The step's first and last non-finite gradient (gradient_summary), in 16 bits so
  //! the signal stays one 16-byte store; -1 when none, or past 32,767 (not reported).
  std::int16_t first_nonfinite;
  std::int16_t last_nonfinite;
  float scale;
};

static_assert(sizeof(stuck_signal) == 16, "the device writes a stuck_signal as one 16-byte store");

//! A gradient list index as stuck_signal holds it.
MPX_HD inline std::int16_t signal_index(std::int32_t i) noexcept {
  return i >= 0 && i <= 32767 ? static_cast<std::int16_t>(i) : std::int16_t{-1};
}

//! The end of a step: the rule's update, the optimizer's step count (advanced only when
//! the step was applied), and the signal the host polls (see stuck_signal).
template <class Rule>
MPX_HD inline void finish_step(Rule const& rule, loss_scale_state* state, gradient_summary const* summary,
                               std::uint64_t* optimizer_steps, stuck_signal* signal) {
  bool const found = summary->found_nonfinite != 0;
  float const scale_used = state->scale;
  rule.update(*state, found);
  if (!found && optimizer_steps) ++*optimizer_steps;
  std::uint32_t const consecutive = state->overflows_at_minimum;
  if (consecutive < rule.report_after) return;
  auto const streak = static_cast<std::uint32_t>(state->skipped_steps - state->overflows_at_minimum);
  std::uint32_t const signalled = signal->consecutive;  // only this function writes it, in stream order
  if (signalled != 0 && signal->streak == streak) return;  // this run is already signalled
  stuck_signal s;
  s.consecutive = consecutive;
  s.streak = streak;
  s.first_nonfinite = signal_index(summary->first_nonfinite);
  s.last_nonfinite = signal_index(summary->last_nonfinite);
  s.scale = scale_used;
  // As one 16-byte store: copied as a struct, nvcc writes the int16 pair and the scale
  // separately (three stores), and a host polling between them would read half a signal.
  aligned_vector<std::uint32_t, 4> words;
  std::memcpy(words.v, &s, sizeof words.v);
  *reinterpret_cast<aligned_vector<std::uint32_t, 4>*>(signal) = words;
}

template <class Rule>
struct finish_step_once {
  Rule rule;
  loss_scale_state* state;
  gradient_summary const* summary;
  std::uint64_t* optimizer_steps;
  stuck_signal* signal;
  MPX_HD void operator()() const { finish_step(rule, state, summary, optimizer_steps, signal); }
};

//! finish_step where the executor computes: a call on the host, one thread on the GPU.
template <class Exec, class Rule>
void finish_step_pass(Exec const& exec, Rule const& rule, loss_scale_state* state, gradient_summary const* summary,
                      std::uint64_t* optimizer_steps, stuck_signal* signal) {
  run_once(exec, finish_step_once<Rule>{rule, state, summary, optimizer_steps, signal});
}

}  // namespace detail
}  // namespace mpx
