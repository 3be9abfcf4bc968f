// mpx::replica_hooks: what a training loop (classifier_trainer, fit) calls when it runs
// as one replica of a data-parallel job. mpx::data_parallel::hooks() makes them; an empty
// set (the default) is a single process. Type-erased, so the loop stays independent of
// the transport (MPI, NCCL) and of its headers.
//
// Every hook that enqueues work is given the executor of the step that calls it (a
// mpx::step_executor): a step does not always run where the caller's executor does (a
// graph-mode step runs on the trainer's own stream, and is captured there), and the
// gradients' packing, all-reduce and averaging must be ordered inside that step.
#pragma once

#include <mpx/exec/executor.hpp>
#include <mpx/exec/step_executor.hpp>

#include <cstddef>
#include <functional>
#include <span>
#include <utility>

namespace mpx {

struct replica_hooks {
  int rank = 0;            //!< this replica's rank; rank 0 prints and writes files
  std::size_t count = 1;   //!< replicas in the job
  //! Before each step, a graph-mode replay included: throws if the transport failed since
  //! the last one (a collective its watchdog aborted), so that no later step, and no
  //! replay of captured collectives, runs on a broken communicator. (The step already
  //! enqueued when the abort came may have applied partly reduced gradients: after such
  //! an error the model's state is undefined; do not save it.)
  std::function<void()> before_step;
  //! During the backward pass, after each layer's: the gradients of parameters `first`
  //! and later (in the model's parameters() order) are final; their buckets may start
  //! their all-reduce while the earlier layers run backward (on a GPU, concurrently).
  std::function<void(step_executor, std::size_t first)> gradients_final;
  //! After the backward pass, before the optimizer step: finish averaging the gradients.
  std::function<void(step_executor)> after_backward;
  //! When a step throws after its backward pass began (a user's hook, a bad batch): wait
  //! for the all-reduces it started and forget them, so the next step starts its own
  //! rather than averaging what this one left on the wire. Must not throw.
  std::function<void(step_executor)> step_abandoned;
  //! After a graph-mode replay was enqueued, on the step's executor (the stream it runs
  //! on): the collectives it holds are timed with it as a whole, as eager ones are one by
  //! one (a captured collective's own completion cannot be asked for).
  std::function<void(step_executor)> step_replayed;
  //! After the optimizer step, on the caller's executor: in debug builds, check that
  //! every replica skipped alike and holds the same loss scale.
  std::function<void(step_executor)> after_step;
  //! Sums a few host values over the replicas, in place (metrics for the progress line).
  std::function<void(std::span<double>)> sum_values;
  //! Replaces a few host values by their maximum over the replicas, in place (evidence
  //! every replica must act on alike: the precision guard's).
  std::function<void(std::span<double>)> max_values;
  //! Replaces one float in the executor's memory by its maximum over the replicas (NaN
  //! kept), in the step's stream order: each fp8 scale's amax before its update, so that
  //! every replica keeps the scales one process with the global batch would.
  std::function<void(step_executor, float*)> max_in_place;

  [[nodiscard]] bool active() const noexcept { return count > 1 || static_cast<bool>(after_backward); }
  [[nodiscard]] bool prints() const noexcept { return rank == 0; }
};

}  // namespace mpx
