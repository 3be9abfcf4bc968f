// When a CUDA-graph trainer (classifier_trainer::use_cuda_graph) runs a step eagerly,
// captures one, or replays its graph, and how a capture that fails is undone. Plain C++:
// the CUDA calls stay in train_step.hpp, and the host suite runs the rules the GPU follows.
#pragma once

#include <mpx/core/shape.hpp>

#include <cstddef>
#include <optional>
#include <utility>

namespace mpx::detail {

//! What a graph-mode step does.
enum class graph_step {
  eager,    //!< runs as written (and makes whatever a capture needs: workspaces, plans)
  capture,  //!< captures the step into a graph, then replays it
  replay,   //!< replays the graph captured before
};

//! The rules, for batches (their shape and element type) and the `State` a captured
//! graph holds as it was at capture (compared with ==: buffers, kernel arguments, hooks).
//! - A capture follows an eager step on the same batch in the same state: that step made
//!   whatever the captured one needs, which a capture cannot create.
//! - A graph serves the batch it was captured on; other batches (a short last batch) run
//!   eagerly beside it.
//! - A graph captured in another state is dropped, and one eager step comes first.
//! - A failed capture makes the next step eager.
template <class State>
class graph_capture_rules {
 public:
  struct batch {
    shape dims{0};
    void const* dtype = nullptr;  //!< one address per element type (detail::batch_type_key)
    friend bool operator==(batch const&, batch const&) = default;
  };

  //! What the step on `b` in state `now` does. A graph captured in another state is
  //! dropped first: has_graph() turns false, and its owner frees it.
  [[nodiscard]] graph_step next(batch const& b, State const& now) {
    if (graph_ && !(graph_->second == now)) {
      graph_.reset();
      eager_.reset();
    }
    if (graph_) return graph_->first == b ? graph_step::replay : graph_step::eager;
    bool const ready = eager_ && eager_->first == b && eager_->second == now;
    return ready ? graph_step::capture : graph_step::eager;
  }

  //! An eager step ran on `b`, leaving the state `now`.
  void ran_eagerly(batch const& b, State const& now) { eager_.emplace(b, now); }
  //! A graph was captured on `b` in state `now`.
  void captured(batch const& b, State const& now) {
    graph_.emplace(b, now);
    ++captures_;
  }
  //! A capture failed: the next step runs eagerly (and may make what the capture lacked).
  void capture_failed() noexcept { eager_.reset(); }

  [[nodiscard]] bool has_graph() const noexcept { return graph_.has_value(); }
  //! The graphs captured so far.
  [[nodiscard]] std::size_t captures() const noexcept { return captures_; }

 private:
  std::optional<std::pair<batch, State>> eager_;  // the latest eager step's batch and the state it left
  std::optional<std::pair<batch, State>> graph_;  // the graph's batch and the state at its capture
  std::size_t captures_ = 0;
};

//! Captures what `body` enqueues on the backend's stream into a graph and returns it
//! instantiated. A Backend (CUDA's calls in train_step.hpp; a test's own on the host) has
//! types graph, executable and status; begin_capture() (throws); end_capture(graph&) and
//! instantiate(executable&, graph), which return a status; destroy_graph(graph) and
//! clear_error() (never throw); a static ok(status), and check(status, call) (throws when
//! not ok).
//!
//! However the capture fails (the body throws, as an operation that may not be captured
//! does; the capture cannot end, invalidated by such an operation; the graph cannot be
//! instantiated), the stream leaves capture mode, a partial graph is destroyed, the
//! thread's error is cleared (no later launch check may take it for its own),
//! `failed()` is called (the rules: the next step runs eagerly), and the error is thrown.
//! A capture that cannot begin runs nothing and throws; the rules are not told (the next
//! step tries the capture again).
template <class Backend, class Body, class Failed>
typename Backend::executable capture_graph(Backend& backend, Body&& body, Failed&& failed) {
  typename Backend::graph graph{};
  backend.begin_capture();
  try {
    body();
  } catch (...) {
    static_cast<void>(backend.end_capture(graph));  // invalidated, most likely: the error is not the news
    if (graph) backend.destroy_graph(graph);
    backend.clear_error();
    failed();
    throw;
  }
  typename Backend::executable made{};
  auto const ended = backend.end_capture(graph);
  auto const instantiated = Backend::ok(ended) ? backend.instantiate(made, graph) : ended;
  if (graph) backend.destroy_graph(graph);  // the executable keeps what it needs
  if (!Backend::ok(ended) || !Backend::ok(instantiated)) {
    backend.clear_error();
    failed();
  }
  backend.check(ended, "cudaStreamEndCapture");
  backend.check(instantiated, "cudaGraphInstantiate");
  return made;
}

}  // namespace mpx::detail
