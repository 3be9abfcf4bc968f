// cuDNN's fused scaled-dot-product attention (flash attention: softmax statistics in
// float, causal mask, no [tokens, tokens] tensor in memory), forward and backward,
// through NVIDIA's header-only cudnn-frontend, as mpx's fused attention for the CUDA
// executor (<mpx/kernels/fused_attention.hpp> says how the layer uses it).
//
// Include this header in ONE host source file of a program (a .cpp compiled by the C++
// compiler: cudnn-frontend costs nvcc minutes) and link cuDNN 9 and NVRTC (-lcudnn
// -lnvrtc: cudnn-frontend's run-time compiled engines call it); it registers
// itself at start-up. Meson's mpx_cudnn_dep and CMake's mpx::cudnn carry the include
// folder and the library (docs/transformers.md).
//
// Plans (cuDNN graphs, forward and backward) are built once per shape and device, when the
// layer reserves its buffers (never inside a CUDA-graph capture), and kept until the program
// ends, with a workspace per stream (made when the layer reserves, or on a stream's first
// eager pass, as a CUDA-graph trainer's side stream has). A workspace only grows, and the
// blocks it outgrew stay until the stream is forgotten: a captured graph may still use them.
// As with cuBLASLt's workspaces, launch a graph on the stream it was captured on, while that
// stream lives: a destroyed stream's workspace passes to the next stream that gets its
// handle (after a wait for the device). The backward pass is cuDNN's deterministic one
// unless the layer says otherwise (causal_self_attention_config::deterministic): the same
// inputs give the same bits. On Hopper and earlier its workspace holds dP, 2 bytes for each
// [batch * heads, tokens, tokens] entry (rounded up to 64 tokens): the layer's own memory is
// linear in the tokens, this workspace is not.
#pragma once

#if !__has_include(<cudnn_frontend.h>)
#error "<mpx/kernels/cudnn_attention.hpp> needs NVIDIA's cudnn-frontend headers (pip install nvidia-cudnn-frontend; mpx's scripts/setup.sh installs them) and cuDNN 9"
#endif

#include <mpx/core/error.hpp>
#include <mpx/exec/stream_registry.hpp>
#include <mpx/kernels/fused_attention.hpp>

#include <cuda_runtime.h>
#include <cudnn_frontend.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mpx::detail {

class cudnn_attention final : public fused_attention_backend {
 public:
  cudnn_attention() = default;
  cudnn_attention(cudnn_attention const&) = delete;
  cudnn_attention& operator=(cudnn_attention const&) = delete;
  // Never destroyed (cudnn_attention_instance): freeing cuDNN's handles and workspaces
  // at exit would race the CUDA runtime's own teardown, as cuBLASLt's would.
  ~cudnn_attention() override = default;

  [[nodiscard]] char const* name() const noexcept override { return "cuDNN SDPA"; }

  [[nodiscard]] std::string prepare(fused_attention_shape const& s, void* stream) override {
    std::lock_guard lock(mutex_);
    int device = 0;
    if (cudaError_t const status = cudaGetDevice(&device); status != cudaSuccess) {
      (void)cudaGetLastError();
      return std::string("cudaGetDevice failed: ") + cudaGetErrorString(status);
    }
    auto const cuda_stream = static_cast<cudaStream_t>(stream);
    std::string const capture = not_capturing(cuda_stream);
    plan* p = find(device, s, false);
    if (!p) {
      if (std::string const* why = refused(device, s)) return *why;
      // Building a plan allocates and loads kernels: not inside a CUDA-graph capture.
      if (!capture.empty()) return "cannot build cuDNN's plans for a new shape: " + capture;
      std::string why = build_plan(device, s, cuda_stream);
      if (!why.empty()) {
        refused_.emplace_back(key{device, s, false}, why);  // not retried: each try costs a full build
        return why;
      }
      p = find(device, s, false);
    }
    workspace* unused = nullptr;
    return workspace_for(device, cuda_stream, capture, p->workspace_bytes, unused);
  }

  void forward(fused_attention_shape const& s, fused_attention_forward_args const& a, void* stream) override {
    std::unordered_map<std::int64_t, void*> pack = {
        {q_uid, const_cast<void*>(a.q)}, {k_uid, const_cast<void*>(a.k)}, {v_uid, const_cast<void*>(a.v)},
        {o_uid, a.o}, {stats_uid, a.stats}};
    add_dropout_key(s, a.dropout_key, pack, "forward");
    add_fp8_scalars(s, a.fp8_scalars, pack, true, "forward");
    run(s, stream, pack, true);
  }

  void backward(fused_attention_shape const& s, fused_attention_backward_args const& a, void* stream) override {
    std::unordered_map<std::int64_t, void*> pack = {
        {q_uid, const_cast<void*>(a.q)},   {k_uid, const_cast<void*>(a.k)},      {v_uid, const_cast<void*>(a.v)},
        {o_uid, const_cast<void*>(a.o)},   {d_o_uid, const_cast<void*>(a.d_o)}, {stats_uid, const_cast<float*>(a.stats)},
        {d_q_uid, a.d_q},                  {d_k_uid, a.d_k},                     {d_v_uid, a.d_v}};
    add_dropout_key(s, a.dropout_key, pack, "backward");
    add_fp8_scalars(s, a.fp8_scalars, pack, false, "backward");
    run(s, stream, pack, false);
  }

  // The forward pass again, into scratch O and statistics, with cuDNN's rng dump (the
  // Bernoulli keep draws the dropout multiplies by) written to `keeps`.
  void dropout_keeps(fused_attention_shape const& s, fused_attention_forward_args const& a, float* keeps,
                     void* stream) override {
    char const* const pass = "dropout_keeps";
    if (!(s.dropout > 0.0f))
      fail<invalid_argument>("causal_self_attention (cuDNN dropout_keeps)", "the shape has no dropout to show");
    auto const cuda_stream = static_cast<cudaStream_t>(stream);
    std::lock_guard lock(mutex_);
    int const device = current_device(pass);
    if (std::string why = not_capturing(cuda_stream); !why.empty()) fail_in(pass, why);
    if (!find(device, s, false))
      fail<invalid_argument>("causal_self_attention (cuDNN dropout_keeps)",
                             "no plan for this shape on this device: the layer was not reserved on this executor");
    plan* p = find(device, s, true);
    if (!p) {
      if (std::string why = build_plan(device, s, cuda_stream, true); !why.empty()) fail_in(pass, why);
      p = find(device, s, true);
    }
    std::unordered_map<std::int64_t, void*> pack = {
        {q_uid, const_cast<void*>(a.q)}, {k_uid, const_cast<void*>(a.k)}, {v_uid, const_cast<void*>(a.v)},
        {o_uid, nullptr},                {stats_uid, nullptr},            {keeps_uid, keeps}};
    add_dropout_key(s, a.dropout_key, pack, pass);
    add_fp8_scalars(s, a.fp8_scalars, pack, true, pass);
    // Scratch for what the caller keeps from its own forward: O, the statistics, a
    // workspace; freed, and the stream waited for, on every way out.
    struct scratch_blocks {
      cudaStream_t stream;
      void* block[3] = {nullptr, nullptr, nullptr};
      ~scratch_blocks() {
        for (void* b : block)
          if (b) (void)cudaFreeAsync(b, stream);
        (void)cudaStreamSynchronize(stream);
        (void)cudaGetLastError();
      }
    } scratch{cuda_stream};
    std::size_t const element = s.io == fused_attention_io::float8 ? 1 : 2;
    std::size_t const sizes[] = {static_cast<std::size_t>(s.batch * s.tokens * s.o_row_stride) * element,
                                 static_cast<std::size_t>(s.batch * s.heads * s.tokens) * sizeof(float),
                                 static_cast<std::size_t>(std::max<std::int64_t>(p->workspace_bytes, 1))};
    for (int i = 0; i < 3; ++i)
      if (cudaError_t const status = cudaMallocAsync(&scratch.block[i], sizes[i], cuda_stream); status != cudaSuccess)
        fail_in(pass, std::string("no memory for its scratch: ") + cudaGetErrorString(status));
    pack[o_uid] = scratch.block[0];
    pack[stats_uid] = scratch.block[1];
    auto const h = handles_.find(device);
    if (cudnnStatus_t const set = cudnnSetStream(h->second, cuda_stream); set != CUDNN_STATUS_SUCCESS)
      fail_in(pass, std::string("cudnnSetStream failed: ") + cudnnGetErrorString(set));
    check(p->forward->execute(h->second, pack, scratch.block[2]), pass);
    if (cudaError_t const done = cudaStreamSynchronize(cuda_stream); done != cudaSuccess)
      fail_in(pass, cudaGetErrorString(done));
  }

  void forget_stream(void* stream) noexcept override {
    auto const cuda_stream = static_cast<cudaStream_t>(stream);
    unsigned long long id = 0;
    if (cudaStreamGetId(cuda_stream, &id) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    std::lock_guard lock(mutex_);
    auto const gone = workspaces_.forget(id);
    if (gone.empty()) return;
    cudaError_t status = cudaStreamSynchronize(cuda_stream);  // its last passes may still use them
    for (auto const& [device, w] : gone)
      if (status == cudaSuccess) status = free_blocks(w, cuda_stream);
    if (status == cudaSuccess) status = cudaStreamSynchronize(cuda_stream);
    report_if_failed(status, "freeing a stream's cuDNN workspace");
  }

 private:
  enum : std::int64_t { q_uid = 1, k_uid, v_uid, o_uid, stats_uid, d_o_uid, d_q_uid, d_k_uid, d_v_uid, seed_uid, offset_uid, keeps_uid };
  // The fp8 path's scalars: uid fp8_uid + slot (fused_fp8_slot), and Q's, K's and V's
  // descales, which share slot descale_qkv, under three uids of their own.
  enum : std::int64_t { fp8_uid = 100, descale_k_uid = 200, descale_v_uid, scale_dk_uid, scale_dv_uid };
  using graph = cudnn_frontend::graph::Graph;
  using attributes = cudnn_frontend::graph::Tensor_attributes;
  struct key {
    int device;
    fused_attention_shape shape;
    bool keeps = false;  // the forward with its dropout masks written out (dropout_keeps)
    [[nodiscard]] bool is(int d, fused_attention_shape const& s, bool k) const { return device == d && shape == s && keeps == k; }
  };
  struct plan {
    std::shared_ptr<graph> forward, backward;  // no backward in a keeps plan
    std::int64_t workspace_bytes = 0;
  };
  // A stream's workspace: streams that run at once cannot share one (as cuBLASLt's).
  // Kept in a stream_registry, as cuBLASLt's: by the stream's id, which, unlike its
  // handle, a later stream never reuses, and found by the handle during a capture.
  struct workspace {
    void* data = nullptr;
    std::int64_t bytes = 0;
    std::vector<void*> retired;  // blocks it outgrew: a captured graph may still use them
  };
  // Frees a workspace's blocks after the work on `stream` (the caller has waited for
  // any other stream that used them).
  static cudaError_t free_blocks(workspace const& w, cudaStream_t stream) {
    cudaError_t status = cudaSuccess;
    for (void* block : w.retired)
      if (status == cudaSuccess) status = cudaFreeAsync(block, stream);
    if (w.data && status == cudaSuccess) status = cudaFreeAsync(w.data, stream);
    return status;
  }

  // Builds a shape's plan: its forward and backward graphs, or (keeps) the forward alone
  // with cuDNN's rng dump, for dropout_keeps. "" or why not.
  std::string build_plan(int device, fused_attention_shape const& s, cudaStream_t stream, bool keeps = false) {
    cudnnHandle_t handle = nullptr;
    if (std::string why = handle_for(device, handle); !why.empty()) return why;
    if (cudnnStatus_t const status = cudnnSetStream(handle, stream); status != CUDNN_STATUS_SUCCESS)
      return std::string("cudnnSetStream failed: ") + cudnnGetErrorString(status);
    auto p = std::make_unique<plan>();
    std::vector<std::pair<graph*, char const*>> passes;
    try {  // cudnn-frontend also throws (no implementation for a shape, a missing library)
      p->forward = forward_graph(s, keeps);
      passes.emplace_back(p->forward.get(), keeps ? "the forward pass with its rng dump" : "the forward pass");
      if (!keeps) {
        p->backward = backward_graph(s);
        passes.emplace_back(p->backward.get(), "the backward pass");
      }
      // All validated before any is built: a shape only the backward refuses (one token)
      // costs no forward build.
      for (auto const& [g, what] : passes)
        if (auto status = g->validate(); !status.is_good()) return std::string("cuDNN refused ") + what + ": " + status.get_message();
      for (auto const& [g, what] : passes)
        if (std::string why = build(*g, handle); !why.empty()) return std::string("cuDNN refused ") + what + ": " + why;
    } catch (std::exception const& e) {
      return std::string("cuDNN: ") + e.what();
    }
    for (auto const& [g, what] : passes) {
      std::int64_t bytes = 0;
      if (!g->get_workspace_size(bytes).is_good()) return "cuDNN could not size its workspace";
      p->workspace_bytes = std::max(p->workspace_bytes, bytes);
    }
    plans_.emplace_back(key{device, s, keeps}, std::move(p));
    return "";
  }

  // The dropout's {seed, offset} in a pass's variant pack, where the shape has dropout.
  static void add_dropout_key(fused_attention_shape const& s, std::int64_t const* key,
                              std::unordered_map<std::int64_t, void*>& pack, char const* pass) {
    if (!(s.dropout > 0.0f)) return;
    if (!key)
      fail<invalid_argument>("causal_self_attention (cuDNN " + std::string(pass) + ")",
                             "the shape has dropout and the arguments no dropout key");
    pack[seed_uid] = const_cast<std::int64_t*>(key);
    pack[offset_uid] = const_cast<std::int64_t*>(key + 1);
  }

  // The fp8 path's scales and amaxes in a pass's variant pack, where the shape is fp8:
  // each slot the pass's graph has (forward and backward read different ones).
  static void add_fp8_scalars(fused_attention_shape const& s, float* scalars, std::unordered_map<std::int64_t, void*>& pack,
                              bool forward, char const* pass) {
    if (s.io != fused_attention_io::float8) return;
    if (!scalars)
      fail<invalid_argument>("causal_self_attention (cuDNN " + std::string(pass) + ")",
                             "the shape is fp8 and the arguments hold no fp8 scalars");
    for (fused_fp8_slot const slot : forward ? fp8_forward_slots() : fp8_backward_slots())
      pack[fp8_uid + static_cast<int>(slot)] = scalars + fused_fp8_offset(slot);
    pack[descale_k_uid] = pack[descale_v_uid] = scalars + fused_fp8_offset(fused_fp8_slot::descale_qkv);
    if (!forward) pack[scale_dk_uid] = pack[scale_dv_uid] = scalars + fused_fp8_offset(fused_fp8_slot::scale_dqkv);
  }
  static std::vector<fused_fp8_slot> fp8_forward_slots() {
    using f = fused_fp8_slot;
    return {f::descale_qkv, f::descale_s, f::scale_s, f::scale_o, f::amax_s, f::amax_o};
  }
  static std::vector<fused_fp8_slot> fp8_backward_slots() {
    using f = fused_fp8_slot;
    return {f::descale_qkv, f::descale_s, f::scale_s,   f::descale_o, f::descale_d_o, f::descale_dp, f::scale_dqkv,
            f::scale_dp,    f::amax_dq,   f::amax_dk,   f::amax_dv,   f::amax_dp};
  }
  // A float scalar of the fp8 path, [1, 1, 1, 1]: an input (a scale) or an output (an
  // amax the kernel writes).
  static std::shared_ptr<attributes> fp8_scalar(graph& g, fused_fp8_slot slot, std::int64_t uid = 0) {
    return g.tensor(attributes()
                        .set_name("fp8_scalar_" + std::to_string(static_cast<int>(slot)))
                        .set_uid(uid ? uid : fp8_uid + static_cast<int>(slot))
                        .set_dim({1, 1, 1, 1})
                        .set_stride({1, 1, 1, 1})
                        .set_data_type(cudnn_frontend::DataType_t::FLOAT));
  }
  static void fp8_amax_output(std::shared_ptr<attributes> const& t, fused_fp8_slot slot) {
    t->set_output(true).set_uid(fp8_uid + static_cast<int>(slot)).set_dim({1, 1, 1, 1}).set_stride({1, 1, 1, 1})
        .set_data_type(cudnn_frontend::DataType_t::FLOAT);
  }

  // The stream's workspace in `w`, of at least `bytes`: "" or why not. Outside a capture
  // it is found by the stream's driver id (remembered under the handle for the captures
  // that follow) and grown where it is smaller; a block it outgrows is kept (see
  // retired). A capturing stream, whose id cannot be asked for (cudaStreamGetId refuses
  // it), gets the one the same handle's last eager pass used, which must be large enough.
  // `capture`: not_capturing(stream), which the caller has asked already.
  std::string workspace_for(int device, cudaStream_t stream, std::string const& capture, std::int64_t bytes,
                            workspace*& w) {
    stream_handle_key const key = stream_handle_key_of(device, stream);
    if (!capture.empty()) {
      w = workspaces_.captured(key);
      return w && w->bytes >= bytes ? "" : "no cuDNN workspace for this stream yet, and " + capture;
    }
    unsigned long long id = 0;
    if (cudaError_t const status = cudaStreamGetId(stream, &id); status != cudaSuccess) {
      (void)cudaGetLastError();
      return std::string("cudaStreamGetId failed: ") + cudaGetErrorString(status);
    }
    auto found = workspaces_.use(key, id);
    if (found.inherited || !found.retired.empty()) {
      // The handle's former stream is destroyed, and its last passes may still be
      // running in the workspace: let them finish before it is reused or freed.
      cudaError_t status = cudaDeviceSynchronize();
      for (workspace const& old : found.retired)
        if (status == cudaSuccess) status = free_blocks(old, stream);
      if (status != cudaSuccess) {
        (void)cudaGetLastError();
        return std::string("freeing a destroyed stream's cuDNN workspace failed: ") + cudaGetErrorString(status);
      }
    }
    w = found.resource ? found.resource : &workspaces_.put(device, id, workspace{});
    if (w->bytes >= bytes) return "";
    w->retired.reserve(w->retired.size() + 1);  // (nothing after the allocation throws)
    void* grown = nullptr;
    if (cudaMallocAsync(&grown, static_cast<std::size_t>(bytes), stream) != cudaSuccess) {
      (void)cudaGetLastError();
      if (!w->data && w->retired.empty()) workspaces_.drop(device, id);  // made just now, empty
      return "no memory for cuDNN's workspace (" + std::to_string(bytes) + " bytes)";
    }
    if (w->data) w->retired.push_back(w->data);
    w->data = grown;
    w->bytes = bytes;
    return "";
  }
  // "" where the stream is not capturing a CUDA graph, else why work that allocates
  // cannot run on it now.
  static std::string not_capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capturing) != cudaSuccess) {
      (void)cudaGetLastError();
      return "the stream's capture status is unknown (another thread capturing in global mode?)";
    }
    if (capturing != cudaStreamCaptureStatusNone)
      return "the stream is capturing a CUDA graph (reserve the layer, or run one eager step on the stream, before "
             "capturing)";
    return "";
  }

  // Enqueues one pass: under the lock from setting the handle's stream to the launch,
  // so no other thread redirects it (execute only enqueues work).
  void run(fused_attention_shape const& s, void* stream, std::unordered_map<std::int64_t, void*>& pack, bool forward) {
    char const* const pass = forward ? "forward" : "backward";
    std::lock_guard lock(mutex_);
    int const device = current_device(pass);
    auto const cuda_stream = static_cast<cudaStream_t>(stream);
    plan* const p = find(device, s, false);
    auto const h = handles_.find(device);
    if (!p || h == handles_.end())
      fail<invalid_argument>("causal_self_attention (cuDNN " + std::string(pass) + ")",
                             "no plan for this shape on this device: the layer was not reserved on this executor");
    // A stream the layer was not reserved on gets its workspace here, outside a capture.
    workspace* w = nullptr;
    std::string const capture = not_capturing(cuda_stream);
    if (std::string why = workspace_for(device, cuda_stream, capture, p->workspace_bytes, w); !why.empty()) {
      if (!capture.empty())  // the user's order of calls, not the device's failure
        fail<invalid_argument>("causal_self_attention (cuDNN " + std::string(pass) + ")", why);
      fail_in(pass, why);
    }
    if (cudnnStatus_t const status = cudnnSetStream(h->second, cuda_stream); status != CUDNN_STATUS_SUCCESS)
      fail_in(pass, std::string("cudnnSetStream failed: ") + cudnnGetErrorString(status));
    check((forward ? p->forward : p->backward)->execute(h->second, pack, w->data), pass);
  }

  // [batch, heads, tokens, head_width] in the layer's token-major buffers
  // (fused_attention.hpp's layouts, which the host suite's reference reads too).
  static std::vector<std::int64_t> as_vector(std::array<std::int64_t, 4> const& a) { return {a.begin(), a.end()}; }
  static std::vector<std::int64_t> dims(fused_attention_shape const& s) { return as_vector(fused_qkv_layout(s).dims); }
  static std::vector<std::int64_t> qkv_strides(fused_attention_shape const& s) {
    return as_vector(fused_qkv_layout(s).strides);
  }
  static std::vector<std::int64_t> o_strides(fused_attention_shape const& s) { return as_vector(fused_o_layout(s).strides); }
  static std::vector<std::int64_t> stats_dims(fused_attention_shape const& s) { return as_vector(fused_stats_layout(s).dims); }
  static std::vector<std::int64_t> stats_strides(fused_attention_shape const& s) {
    return as_vector(fused_stats_layout(s).strides);
  }

  static std::shared_ptr<graph> new_graph(fused_attention_shape const& s) {
    namespace fe = cudnn_frontend;
    auto g = std::make_shared<graph>();
    g->set_io_data_type(s.io == fused_attention_io::half       ? fe::DataType_t::HALF
                        : s.io == fused_attention_io::bfloat16 ? fe::DataType_t::BFLOAT16
                                                               : fe::DataType_t::FP8_E4M3)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    return g;
  }
  static std::shared_ptr<attributes> input(graph& g, char const* name, std::int64_t uid, std::vector<std::int64_t> dim,
                                           std::vector<std::int64_t> stride) {
    return g.tensor(attributes().set_name(name).set_uid(uid).set_dim(std::move(dim)).set_stride(std::move(stride)));
  }

  // The dropout's {seed, offset}: int64 scalars in device memory (a captured step reads
  // the key its replay wrote).
  static std::pair<std::shared_ptr<attributes>, std::shared_ptr<attributes>> dropout_key(graph& g) {
    namespace fe = cudnn_frontend;
    auto scalar = [&](char const* name, std::int64_t uid) {
      return g.tensor(attributes().set_name(name).set_uid(uid).set_dim({1, 1, 1, 1}).set_stride({1, 1, 1, 1})
                          .set_data_type(fe::DataType_t::INT64));
    };
    return {scalar("dropout_seed", seed_uid), scalar("dropout_offset", offset_uid)};
  }

  static std::shared_ptr<graph> forward_graph(fused_attention_shape const& s, bool write_keeps = false) {
    namespace fe = cudnn_frontend;
    auto g = new_graph(s);
    auto const qkv = qkv_strides(s);
    auto q = input(*g, "Q", q_uid, dims(s), qkv), k = input(*g, "K", k_uid, dims(s), qkv),
         v = input(*g, "V", v_uid, dims(s), qkv);
    auto options =
        fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true).set_attn_scale(s.scale).set_causal_mask(true);
    if (s.dropout > 0.0f) {
      auto [seed, offset] = dropout_key(*g);
      options.set_dropout(s.dropout, seed, offset);
      if (write_keeps) {  // [batch, heads, tokens, tokens] float, 1 kept, 0 dropped; rows of 16 bytes
        std::int64_t const row = fused_dropout_keeps_row(s.tokens);
        options.set_rng_dump(g->tensor(attributes().set_name("keeps").set_uid(keeps_uid)
                                           .set_dim({s.batch, s.heads, s.tokens, s.tokens})
                                           .set_stride({s.heads * s.tokens * row, s.tokens * row, row, 1})
                                           .set_data_type(fe::DataType_t::FLOAT)));
      }
    }
    std::shared_ptr<attributes> o, stats;
    if (s.io == fused_attention_io::float8) {  // Transformer Engine's fp8_dpa: per-tensor scales, O in e4m3
      using f = fused_fp8_slot;
      auto outputs = g->sdpa_fp8(q, k, v, fp8_scalar(*g, f::descale_qkv), fp8_scalar(*g, f::descale_qkv, descale_k_uid),
                                 fp8_scalar(*g, f::descale_qkv, descale_v_uid), fp8_scalar(*g, f::descale_s),
                                 fp8_scalar(*g, f::scale_s), fp8_scalar(*g, f::scale_o), options);
      o = outputs[0];
      stats = outputs[1];
      fp8_amax_output(outputs[2], f::amax_s);
      fp8_amax_output(outputs[3], f::amax_o);
      o->set_data_type(fe::DataType_t::FP8_E4M3);
    } else {
      auto const outputs = g->sdpa(q, k, v, options);
      o = outputs[0];
      stats = outputs[1];
    }
    o->set_output(true).set_uid(o_uid).set_dim(dims(s)).set_stride(o_strides(s));
    stats->set_output(true).set_uid(stats_uid).set_data_type(fe::DataType_t::FLOAT).set_dim(stats_dims(s)).set_stride(stats_strides(s));
    return g;
  }

  static std::shared_ptr<graph> backward_graph(fused_attention_shape const& s) {
    if (s.io == fused_attention_io::float8) return fp8_backward_graph(s);
    namespace fe = cudnn_frontend;
    auto g = new_graph(s);
    auto const qkv = qkv_strides(s), o_stride = o_strides(s);
    auto q = input(*g, "Q", q_uid, dims(s), qkv), k = input(*g, "K", k_uid, dims(s), qkv),
         v = input(*g, "V", v_uid, dims(s), qkv), o = input(*g, "O", o_uid, dims(s), o_stride),
         d_o = input(*g, "dO", d_o_uid, dims(s), o_stride);
    auto stats = g->tensor(attributes().set_name("stats").set_uid(stats_uid).set_dim(stats_dims(s)).set_stride(stats_strides(s))
                               .set_data_type(fe::DataType_t::FLOAT));
    // Deterministic by default: dQ summed in a fixed order, not with atomics (mpx's runs
    // repeat bit for bit); a cuDNN that cannot do it on this GPU refuses, and the layer
    // runs unfused.
    auto options = fe::graph::SDPA_backward_attributes()
                       .set_name("attention_backward")
                       .set_attn_scale(s.scale)
                       .set_causal_mask(true)
                       .set_deterministic_algorithm(s.deterministic);
    if (s.dropout > 0.0f) {  // the forward's masks, redrawn from its key
      auto [seed, offset] = dropout_key(*g);
      options.set_dropout(s.dropout, seed, offset);
    }
    auto [d_q, d_k, d_v] = g->sdpa_backward(q, k, v, o, d_o, stats, options);
    d_q->set_output(true).set_uid(d_q_uid).set_dim(dims(s)).set_stride(qkv);
    d_k->set_output(true).set_uid(d_k_uid).set_dim(dims(s)).set_stride(qkv);
    d_v->set_output(true).set_uid(d_v_uid).set_dim(dims(s)).set_stride(qkv);
    return g;
  }

  // The fp8 backward pass (Transformer Engine's fp8_dpa): Q K V and O in e4m3, dO and
  // dQ dK dV in e5m2, dS cast to e5m2 inside, every scale per tensor.
  static std::shared_ptr<graph> fp8_backward_graph(fused_attention_shape const& s) {
    namespace fe = cudnn_frontend;
    using f = fused_fp8_slot;
    auto g = new_graph(s);
    auto const qkv = qkv_strides(s), o_stride = o_strides(s);
    auto q = input(*g, "Q", q_uid, dims(s), qkv), k = input(*g, "K", k_uid, dims(s), qkv),
         v = input(*g, "V", v_uid, dims(s), qkv), o = input(*g, "O", o_uid, dims(s), o_stride),
         d_o = input(*g, "dO", d_o_uid, dims(s), o_stride);
    d_o->set_data_type(fe::DataType_t::FP8_E5M2);
    auto stats = g->tensor(attributes().set_name("stats").set_uid(stats_uid).set_dim(stats_dims(s)).set_stride(stats_strides(s))
                               .set_data_type(fe::DataType_t::FLOAT));
    auto options = fe::graph::SDPA_fp8_backward_attributes()
                       .set_name("attention_backward_fp8")
                       .set_attn_scale(s.scale)
                       .set_causal_mask(true)
                       .set_deterministic_algorithm(s.deterministic);
    if (s.dropout > 0.0f) {
      auto [seed, offset] = dropout_key(*g);
      options.set_dropout(s.dropout, seed, offset);
    }
    auto out = g->sdpa_fp8_backward(
        q, k, v, o, d_o, stats, fp8_scalar(*g, f::descale_qkv), fp8_scalar(*g, f::descale_qkv, descale_k_uid),
        fp8_scalar(*g, f::descale_qkv, descale_v_uid), fp8_scalar(*g, f::descale_o), fp8_scalar(*g, f::descale_d_o),
        fp8_scalar(*g, f::descale_s), fp8_scalar(*g, f::descale_dp), fp8_scalar(*g, f::scale_s),
        fp8_scalar(*g, f::scale_dqkv), fp8_scalar(*g, f::scale_dqkv, scale_dk_uid),
        fp8_scalar(*g, f::scale_dqkv, scale_dv_uid), fp8_scalar(*g, f::scale_dp), options);
    std::int64_t const uids[] = {d_q_uid, d_k_uid, d_v_uid};
    for (int i = 0; i < 3; ++i)
      out[i]->set_output(true).set_uid(uids[i]).set_dim(dims(s)).set_stride(qkv).set_data_type(fe::DataType_t::FP8_E5M2);
    fp8_amax_output(out[3], f::amax_dq);
    fp8_amax_output(out[4], f::amax_dk);
    fp8_amax_output(out[5], f::amax_dv);
    fp8_amax_output(out[6], f::amax_dp);
    return g;
  }

  // For a validated graph: cuDNN's heuristics, the support check and the plan build: ""
  // or cuDNN's message.
  static std::string build(graph& g, cudnnHandle_t handle) {
    namespace fe = cudnn_frontend;
    for (auto const& step : {std::function<fe::error_t()>([&] { return g.build_operation_graph(handle); }),
                             std::function<fe::error_t()>([&] { return g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}); }),
                             std::function<fe::error_t()>([&] { return g.check_support(handle); }),
                             std::function<fe::error_t()>([&] { return g.build_plans(handle); })}) {
      fe::error_t status = step();
      if (!status.is_good()) return status.get_message();
    }
    return "";
  }

  std::string handle_for(int device, cudnnHandle_t& handle) {
    if (auto it = handles_.find(device); it != handles_.end()) {
      handle = it->second;
      return "";
    }
    cudnnStatus_t const status = cudnnCreate(&handle);
    if (status != CUDNN_STATUS_SUCCESS) return std::string("cudnnCreate failed: ") + cudnnGetErrorString(status);
    handles_.emplace(device, handle);
    return "";
  }

  plan* find(int device, fused_attention_shape const& s, bool keeps) {
    for (auto& [k, p] : plans_)
      if (k.is(device, s, keeps)) return p.get();
    return nullptr;
  }
  std::string const* refused(int device, fused_attention_shape const& s) const {
    for (auto const& [k, why] : refused_)
      if (k.is(device, s, false)) return &why;
    return nullptr;
  }

  static int current_device(char const* pass) {
    int device = 0;
    if (cudaError_t const status = cudaGetDevice(&device); status != cudaSuccess) {
      (void)cudaGetLastError();
      fail_in(pass, std::string("cudaGetDevice failed: ") + cudaGetErrorString(status));
    }
    return device;
  }
  static void check(cudnn_frontend::error_t status, char const* pass) {
    if (!status.is_good()) fail_in(pass, status.get_message());
  }
  // A cuDNN failure as mpx::cuda_error (its code() is cudaErrorUnknown: cuDNN's own
  // status is in the message).
  [[noreturn]] static void fail_in(char const* pass, std::string const& message) {
    throw cuda_error("mpx::causal_self_attention (cuDNN " + std::string(pass) + "): " + message,
                     static_cast<int>(cudaErrorUnknown));
  }

  std::mutex mutex_;
  std::vector<std::pair<key, std::unique_ptr<plan>>> plans_;  // a handful of shapes: a list is enough
  std::vector<std::pair<key, std::string>> refused_;          // shapes cuDNN refused, and why
  stream_registry<workspace> workspaces_;                      // one per (device, stream)
  std::map<int, cudnnHandle_t> handles_;                       // one per device
};

inline cudnn_attention& cudnn_attention_instance() {
  static cudnn_attention* const instance = new cudnn_attention;  // never destroyed: see ~cudnn_attention
  return *instance;
}

// Registers cuDNN's SDPA as the fused attention when the program starts (an inline
// variable: once per program, however many files include this header).
inline bool const cudnn_attention_registered = [] {
  fused_attention_slot<device_space>() = &cudnn_attention_instance();
  return true;
}();

}  // namespace mpx::detail
