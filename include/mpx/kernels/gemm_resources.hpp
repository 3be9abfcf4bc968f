// What mpx::gemm keeps between products on the GPU: a cuBLASLt handle per device, a
// workspace per stream, a plan per problem, and the rules around them (nothing is made
// during a graph capture; a destroyed stream's workspace is waited for before it is
// reused or freed; release frees everything and says so through a generation). Plain
// C++ over a backend that makes and frees the things, so the host suite runs these rules
// against a backend of its own; cublaslt.hpp gives it cuBLASLt and CUDA.
//
// A Backend has: types handle_type, plan_type, stream_type (converts to void const*);
// create_handle(device), destroy_handle(h); stream_id(stream) (throws) and
// try_stream_id(stream, id&) (noexcept); workspace_bytes_for(device); allocate(bytes),
// free(data); wait_for_device() and wait_for_stream(stream) (throw); current_device(),
// set_device(device); make_plan(problem, handle, workspace bytes, a_scale, b_scale) (a
// std::unique_ptr<plan_type>, whose `mutable` mutex call_mutex is locked through a const
// plan); set_scale_pointers(plan, a_scale, b_scale); report(what, why) noexcept, for
// failures nothing can throw.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/exec/stream_registry.hpp>
#include <mpx/kernels/gemm_problem.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace mpx::detail {

//! A stream's workspace: device memory cuBLASLt may use while a product runs.
struct lt_workspace {
  void* data = nullptr;
  std::size_t bytes = 0;
};

//! Per device: one handle. Per (device, stream): one workspace, since two streams
//! running at once cannot share one. Per problem: one plan, never destroyed before
//! release() (destruction at exit would race the CUDA runtime's own teardown).
//!
//! Workspaces are keyed by the stream's driver id, never reused by another stream; a
//! capture, which cannot ask for the id, finds the workspace by the handle through
//! stream_registry. A destroyed stream's workspace is freed by forget_stream (mpx's own
//! streams call it), taken over by the next stream that gets its handle, or freed by
//! release.
template <class Backend>
class lt_resources {
 public:
  using handle_type = typename Backend::handle_type;
  using plan_type = typename Backend::plan_type;
  using stream_type = typename Backend::stream_type;

  explicit lt_resources(Backend backend = {}) : backend_(std::move(backend)) {}
  lt_resources(lt_resources const&) = delete;
  lt_resources& operator=(lt_resources const&) = delete;

  //! The handle of `device`, created on first use (never during a capture).
  handle_type handle(int device, bool capturing) {
    std::lock_guard lock(mutex_);
    auto const known = handles_.find(device);
    if (known != handles_.end()) return known->second;
    if (capturing) fail_cold_capture();
    handle_type const made = backend_.create_handle(device);
    try {
      handles_.emplace(device, made);
    } catch (...) {
      backend_.destroy_handle(made);
      throw;
    }
    return made;
  }

  //! The workspace of (device, stream), allocated on first eager use. Keyed by the
  //! stream's id, not its handle: the per-thread default stream (and the null handle
  //! under --default-stream per-thread) is one handle for a different stream in each
  //! thread, two products running at once must not share a workspace, and a destroyed
  //! stream's handle may come back for a new stream. A capture finds the workspace that
  //! the same handle's last eager product used (one must have run: it made it).
  lt_workspace workspace_for(int device, stream_type stream, bool capturing) {
    stream_handle_key const key = stream_handle_key_of(device, stream);
    if (capturing) {
      std::lock_guard lock(mutex_);
      if (lt_workspace const* ws = workspaces_.captured(key)) return *ws;
      fail_cold_capture();
    }
    std::uint64_t const id = backend_.stream_id(stream);
    std::lock_guard lock(mutex_);
    auto found = workspaces_.use(key, id);
    if (found.inherited || !found.retired.empty()) {
      // The handle's former stream is destroyed, and its last products may still be
      // running in the workspace: let them finish before it is reused or freed.
      backend_.wait_for_device();
      for (lt_workspace const& old : found.retired) backend_.free(old.data);
    }
    if (found.resource) return *found.resource;
    lt_workspace made;
    made.bytes = backend_.workspace_bytes_for(device);
    made.data = backend_.allocate(made.bytes);
    try {
      return workspaces_.put(device, id, made);
    } catch (...) {
      backend_.free(made.data);
      throw;
    }
  }

  //! The plan of `p`, made on first use. a_scale and b_scale: the first call's scale
  //! pointers, which a block scale mode needs already when the algorithm is chosen
  //! (cuBLASLt refuses the query without them); every call sets its own before it runs.
  plan_type const& plan(lt_problem const& p, handle_type handle, std::size_t workspace_bytes,
                        void const* a_scale = nullptr, void const* b_scale = nullptr) {
    std::lock_guard lock(mutex_);
    auto const it = plans_.find(p);
    if (it != plans_.end()) return *it->second;
    auto made = backend_.make_plan(p, handle, workspace_bytes, a_scale, b_scale);
    return *plans_.emplace(p, std::move(made)).first->second;
  }

  //! One product of `p` on `stream`: its workspace (asked first: a capture may create
  //! nothing, so a stream that never ran a product eagerly is refused before a handle
  //! would be made), its handle and its plan, then `launch(handle, plan, workspace)`. With
  //! scales, the call's scale pointers are set on the plan first, and both happen under
  //! the plan's lock: the pointers are attributes of the cached descriptor, which other
  //! threads' products of the same problem share (cuBLASLt reads them when it enqueues the
  //! kernel, not when the kernel runs).
  template <class Launch>
  void run(lt_problem const& p, stream_type stream, bool capturing, lt_operand_scales const& scales, Launch&& launch) {
    lt_workspace const ws = workspace_for(p.device, stream, capturing);
    handle_type const h = handle(p.device, capturing);
    plan_type const& made = plan(p, h, ws.bytes, scales.a, scales.b);
    if (!scales.a && !scales.b) return launch(h, made, ws);
    std::lock_guard lock(made.call_mutex);
    backend_.set_scale_pointers(made, scales.a, scales.b);
    launch(h, made, ws);
  }

  //! Frees every workspace and plan and destroys the handles, after waiting for the
  //! devices that used them.
  void release() {
    std::lock_guard lock(mutex_);
    device_restorer const restore(backend_);
    // A new generation first: should a wait or a free fail, graphs captured before still
    // know that their workspaces may be gone.
    ++generation_;
    plans_.clear();
    for (auto const& [device, ws] : workspaces_.clear()) {
      backend_.set_device(device);
      backend_.wait_for_device();
      backend_.free(ws.data);
    }
    while (!handles_.empty()) {
      handle_type const h = handles_.begin()->second;
      handles_.erase(handles_.begin());
      backend_.destroy_handle(h);
    }
  }

  //! Waits for `stream` and frees the workspace it was given, for a live stream about to
  //! be destroyed (its id is never reused, so its workspace would never be used again).
  //! Never throws: it runs in destructors, and reports what failed.
  void forget_stream(stream_type stream) noexcept {
    std::uint64_t id = 0;
    if (!backend_.try_stream_id(stream, id)) return;
    std::lock_guard lock(mutex_);
    auto const freed = workspaces_.forget(id);
    if (freed.empty()) return;
    report_failure_of(backend_, "freeing a stream's cuBLASLt workspace", [&] {
      device_restorer const restore(backend_);
      backend_.wait_for_stream(stream);
      for (auto const& [device, ws] : freed) {
        backend_.set_device(device);
        backend_.free(ws.data);
      }
    });
  }

  //! The bytes of every workspace held now.
  std::size_t workspace_bytes() {
    std::lock_guard lock(mutex_);
    std::size_t total = 0;
    workspaces_.for_each([&](lt_workspace const& ws) { total += ws.bytes; });
    return total;
  }

  //! Changes with every release(): a graph captured under an older value holds freed
  //! workspaces.
  std::uint64_t generation() {
    std::lock_guard lock(mutex_);
    return generation_;
  }

  Backend& backend() noexcept { return backend_; }

 private:
  // Puts the caller's current device back on every way out.
  struct device_restorer {
    Backend& backend;
    int device;
    explicit device_restorer(Backend& b) : backend(b), device(b.current_device()) {}
    device_restorer(device_restorer const&) = delete;
    device_restorer& operator=(device_restorer const&) = delete;
    ~device_restorer() {
      report_failure_of(backend, "restoring the current device", [&] { backend.set_device(device); });
    }
  };

  // Making a handle or a workspace would invalidate the capture with an unhelpful error:
  // say what to do instead.
  [[noreturn]] static void fail_cold_capture() {
    fail<invalid_argument>("mpx::gemm",
                           "the first gemm on a stream creates its cuBLASLt handle and workspace, which a CUDA "
                           "graph capture cannot record: run one gemm (or one eager step) on this stream before "
                           "capturing");
  }

  Backend backend_;
  std::mutex mutex_;
  std::map<int, handle_type> handles_;
  stream_registry<lt_workspace> workspaces_;  // by (device, stream id), and by handle for captures
  std::map<lt_problem, std::unique_ptr<plan_type>> plans_;
  std::uint64_t generation_ = 0;
};

}  // namespace mpx::detail
