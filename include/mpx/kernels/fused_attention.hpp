// The seam between causal_self_attention and a fused attention for the CUDA executor:
// one kernel that computes softmax(Q Kᵀ · scale, causal) V without writing the
// [tokens, tokens] logits to memory, and its backward pass from the softmax statistics.
//
// mpx's fused attention is cuDNN's SDPA through NVIDIA's cudnn-frontend. Its header costs
// nvcc about two minutes per translation unit, so it is not included here: a program
// that wants it includes <mpx/kernels/cudnn_attention.hpp> in one host source file
// (compiled by the C++ compiler, linked with -lcudnn), which registers the
// implementation below at start-up. Without that file, or where the implementation
// refuses a shape, the layer runs its unfused path (two batched products around a
// softmax kernel), the one the host executor runs, and says why once on stderr.
#pragma once

#include <cstdint>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>

namespace mpx {

//! The element type of Q, K, V, O and their gradients on the fused path.
enum class fused_attention_io : std::uint8_t { half, bfloat16 };

//! One attention's shape: Q, K, V, O are [batch, heads, tokens, head_width] with the
//! strides of the layer's token-major buffers (a row of `row_stride` elements per
//! token; head h's values at h * head_width within it).
struct fused_attention_shape {
  std::int64_t batch = 0, heads = 0, tokens = 0, head_width = 0;
  std::int64_t qkv_row_stride = 0;  //!< elements from one token's Q (K, V) to the next's: 3 * heads * head_width
  std::int64_t o_row_stride = 0;    //!< elements from one token's O to the next's: heads * head_width
  fused_attention_io io = fused_attention_io::bfloat16;
  float scale = 1.0f;  //!< multiplies Q Kᵀ before the softmax
  friend bool operator==(fused_attention_shape const&, fused_attention_shape const&) = default;
};

//! The forward pass: O and the softmax statistics (log-sum-exp per row, float,
//! [batch, heads, tokens]) that the backward pass reads.
struct fused_attention_forward_args {
  void const* q = nullptr;
  void const* k = nullptr;
  void const* v = nullptr;
  void* o = nullptr;
  float* stats = nullptr;
};

//! The backward pass: dQ, dK, dV (in the layout of Q, K, V) from dO (in O's layout).
struct fused_attention_backward_args {
  void const* q = nullptr;
  void const* k = nullptr;
  void const* v = nullptr;
  void const* o = nullptr;
  void const* d_o = nullptr;
  float const* stats = nullptr;
  void* d_q = nullptr;
  void* d_k = nullptr;
  void* d_v = nullptr;
};

//! A fused attention implementation. `prepare` runs where buffers are reserved (never
//! inside a CUDA-graph capture): it builds and caches what a shape needs and returns ""
//! or why it cannot run the shape. forward and backward then launch work on the stream
//! (a cudaStream_t), for shapes prepare accepted; on a stream prepare did not see they
//! make its workspace first (outside a capture; inside one they refuse).
class fused_attention_backend {
 public:
  virtual ~fused_attention_backend() = default;
  [[nodiscard]] virtual char const* name() const noexcept = 0;
  [[nodiscard]] virtual std::string prepare(fused_attention_shape const& shape, void* stream) = 0;
  virtual void forward(fused_attention_shape const& shape, fused_attention_forward_args const& args, void* stream) = 0;
  virtual void backward(fused_attention_shape const& shape, fused_attention_backward_args const& args, void* stream) = 0;
  //! Waits for `stream` and frees what the implementation keeps for it (a workspace),
  //! for a stream about to be destroyed. Never throws.
  virtual void forget_stream(void* /*stream*/) noexcept {}
};

namespace detail {
//! The registered implementation (nullptr: none). Set once at start-up by the file that
//! defines one; read by every attention layer.
inline fused_attention_backend*& fused_attention_slot() noexcept {
  static fused_attention_backend* backend = nullptr;
  return backend;
}

//! Prints "mpx: causal_self_attention runs unfused: <why>" once per distinct reason.
inline void note_unfused_attention(std::string const& why) {
  static std::mutex m;
  static std::set<std::string> said;
  std::lock_guard lock(m);
  if (said.insert(why).second) std::fprintf(stderr, "mpx: causal_self_attention runs unfused: %s\n", why.c_str());
}
}  // namespace detail

//! The fused attention this program registered, or nullptr.
[[nodiscard]] inline fused_attention_backend* fused_attention() noexcept { return detail::fused_attention_slot(); }

}  // namespace mpx
