// The seam between causal_self_attention and a fused attention: one kernel that computes
// softmax(Q Kᵀ · scale, causal) V without writing the [tokens, tokens] logits to memory,
// and its backward pass from the softmax statistics.
//
// mpx's fused attention for the CUDA executor is cuDNN's SDPA through NVIDIA's
// cudnn-frontend. Its header costs nvcc about two minutes per translation unit, so it is
// not included here: a program that wants it includes <mpx/kernels/cudnn_attention.hpp>
// in one host source file (compiled by the C++ compiler, linked with -lcudnn), which
// registers the implementation below at start-up. Without that file, or where the
// implementation refuses a shape, the layer runs its unfused path (two batched products
// around a softmax kernel), the one the host executor runs, and says why once on stderr.
//
// A program may register an implementation for host memory too
// (register_fused_attention<host_space>): then causal_self_attention on the host executor
// runs the fused path. mpx's tests register a float64 reference there, which runs the
// layer's fused path (every pointer, stride and dropout key it hands cuDNN) on the host.
//
// Dropout on the attention weights runs inside the fused kernel: the implementation draws
// the masks (cuDNN: Philox, keyed by a seed the layer derives from its own seed and its
// count of training forwards, in device memory so a captured step draws a fresh one each
// replay) and the backward pass redraws them from the same key. They are the
// implementation's draws, not the unfused path's: dropout_keeps below says which weights a
// forward dropped.
#pragma once

#include <mpx/core/splitmix64.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/memory_space.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>

namespace mpx {

//! The element type of Q, K, V, O and their gradients on the fused path. float8: Q, K,
//! V and O in e4m3, dO, dQ, dK and dV in e5m2, each with a per-tensor scale (the fp8
//! attention core of <mpx/kernels/fp8_attention.hpp>), the scales in fp8_scalars.
enum class fused_attention_io : std::uint8_t { half, bfloat16, float8 };

//! Where the fp8 path's scalars are: floats in device memory, slot k at fp8_scalars +
//! 4 * k (16 bytes apart, the alignment cuDNN asks of a tensor). The kernel reads the
//! scales (a tensor's fp8 value = value * scale) and inverses (descale) and writes the
//! amaxes of what it cast: P (the probabilities after dropout) and O forward; dS (dP
//! in cuDNN's names), dQ, dK and dV backward. Q, K and V share a scale, as do dQ, dK, dV.
enum class fused_fp8_slot : int {
  descale_qkv, descale_s, scale_s, scale_o, descale_o, descale_d_o, descale_dp, scale_dqkv, scale_dp,
  amax_s, amax_o, amax_dq, amax_dk, amax_dv, amax_dp, count
};
[[nodiscard]] MPX_HD constexpr int fused_fp8_offset(fused_fp8_slot slot) noexcept { return 4 * static_cast<int>(slot); }

//! One attention's shape: Q, K, V, O are [batch, heads, tokens, head_width] with the
//! strides of the layer's token-major buffers (a row of `row_stride` elements per
//! token; head h's values at h * head_width within it).
struct fused_attention_shape {
  std::int64_t batch = 0, heads = 0, tokens = 0, head_width = 0;
  std::int64_t qkv_row_stride = 0;  //!< elements from one token's Q (K, V) to the next's: 3 * heads * head_width
  std::int64_t o_row_stride = 0;    //!< elements from one token's O to the next's: heads * head_width
  fused_attention_io io = fused_attention_io::bfloat16;
  float scale = 1.0f;  //!< multiplies Q Kᵀ before the softmax
  float dropout = 0.0f;  //!< the probability of dropping a weight of softmax(Q Kᵀ · scale), in [0, 1)
  //! The backward pass sums dQ in a fixed order, so runs repeat bit for bit (cuDNN's
  //! deterministic algorithm: on Hopper a dP workspace written and read each pass).
  bool deterministic = true;
  friend bool operator==(fused_attention_shape const&, fused_attention_shape const&) = default;
};

//! Where a fused attention's tensor lies, as cuDNN is told: element [b, h, t, d] (d = 0
//! for the statistics) at dot(index, strides) elements from the tensor's pointer.
struct fused_tensor_layout {
  std::array<std::int64_t, 4> dims{}, strides{};
  [[nodiscard]] constexpr std::int64_t offset(std::int64_t b, std::int64_t h, std::int64_t t,
                                              std::int64_t d) const noexcept {
    return b * strides[0] + h * strides[1] + t * strides[2] + d * strides[3];
  }
};
//! Q, K, V and their gradients in the layer's token-major [batch * tokens, 3 * width]
//! buffer: a row of qkv_row_stride elements per token, head h's values at h * head_width
//! (K and V start width and 2 * width elements after Q).
[[nodiscard]] constexpr fused_tensor_layout fused_qkv_layout(fused_attention_shape const& s) noexcept {
  return {{s.batch, s.heads, s.tokens, s.head_width},
          {s.tokens * s.qkv_row_stride, s.head_width, s.qkv_row_stride, 1}};
}
//! O and dO, token-major [batch * tokens, width].
[[nodiscard]] constexpr fused_tensor_layout fused_o_layout(fused_attention_shape const& s) noexcept {
  return {{s.batch, s.heads, s.tokens, s.head_width}, {s.tokens * s.o_row_stride, s.head_width, s.o_row_stride, 1}};
}
//! The softmax statistics (float), [batch, heads, tokens] packed.
[[nodiscard]] constexpr fused_tensor_layout fused_stats_layout(fused_attention_shape const& s) noexcept {
  return {{s.batch, s.heads, s.tokens, 1}, {s.heads * s.tokens, s.tokens, 1, 1}};
}

//! The forward pass: O and the softmax statistics (log-sum-exp per row, float,
//! [batch, heads, tokens]) that the backward pass reads.
struct fused_attention_forward_args {
  void const* q = nullptr;
  void const* k = nullptr;
  void const* v = nullptr;
  void* o = nullptr;
  float* stats = nullptr;
  //! Where shape.dropout > 0: the {seed, offset} of this forward's draws (int64 each,
  //! where the executor computes; fused_dropout_key writes them).
  std::int64_t const* dropout_key = nullptr;
  float* fp8_scalars = nullptr;  //!< io float8 only: see fused_fp8_slot
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
  std::int64_t const* dropout_key = nullptr;  //!< the forward's, where shape.dropout > 0
  float* fp8_scalars = nullptr;               //!< io float8 only: see fused_fp8_slot
};

//! A fused attention implementation, for the memory it is registered for
//! (register_fused_attention). `prepare` runs where buffers are reserved (never inside a
//! CUDA-graph capture): it builds and caches what a shape needs and returns "" or why it
//! cannot run the shape. forward and backward then launch work on the stream (a
//! cudaStream_t; null on the host), for shapes prepare accepted; on a stream prepare did
//! not see they make its workspace first (outside a capture; inside one they refuse).
//! The pointers lie as fused_qkv_layout, fused_o_layout and fused_stats_layout say.
class fused_attention_backend {
 public:
  virtual ~fused_attention_backend() = default;
  [[nodiscard]] virtual char const* name() const noexcept = 0;
  [[nodiscard]] virtual std::string prepare(fused_attention_shape const& shape, void* stream) = 0;
  virtual void forward(fused_attention_shape const& shape, fused_attention_forward_args const& args, void* stream) = 0;
  virtual void backward(fused_attention_shape const& shape, fused_attention_backward_args const& args, void* stream) = 0;
  //! Which attention weights the forward with these arguments (shape.dropout > 0, Q, K,
  //! V and the dropout key as that forward had them) dropped: keeps (float, in the
  //! registered memory, [batch, heads, tokens, fused_dropout_keeps_row(tokens)]) holds 1 at
  //! [b, h, i, j] where weight (i, j) was kept, 0 where dropped. For tests and
  //! inspection: it reruns the forward pass with the masks written out (building that
  //! plan the first time), writes nothing else the caller sees (args.o and args.stats
  //! are ignored), waits for the stream, and holds the implementation's lock meanwhile.
  //! A step replaying on another stream may be rewriting the key: synchronise first.
  virtual void dropout_keeps(fused_attention_shape const& shape, fused_attention_forward_args const& args, float* keeps,
                             void* stream) = 0;
  //! Waits for `stream` and frees what the implementation keeps for it (a workspace),
  //! for a stream about to be destroyed. Never throws.
  virtual void forget_stream(void* /*stream*/) noexcept {}
};

//! The row of dropout_keeps's output: the tokens rounded up to 4 floats, 16 bytes, the
//! alignment cuDNN's Hopper kernels assume of a row.
[[nodiscard]] constexpr std::int64_t fused_dropout_keeps_row(std::int64_t tokens) noexcept { return (tokens + 3) / 4 * 4; }

namespace detail {
//! The implementation registered for Space's memory (nullptr: none), read by every
//! attention layer whose executor computes there. cuDNN's sets the device's at start-up.
template <memory_space Space = device_space>
inline fused_attention_backend*& fused_attention_slot() noexcept {
  static fused_attention_backend* backend = nullptr;
  return backend;
}

//! The Philox key of a fused attention's dropout for training forward number *count + 1:
//! counts it, then writes {seed, offset}. The seed is a hash of the layer's seed and the
//! count (offset 0), so forwards draw from unrelated streams whatever cuDNN's counter
//! layout is. A run_once body: it runs where the count lives.
struct fused_dropout_key {
  std::uint64_t layer_seed;
  std::uint64_t* count;
  std::uint64_t* key;  // two values below 2^63: cuDNN reads them as int64
  MPX_HD void operator()() const {
    std::uint64_t const n = ++*count;
    key[0] = splitmix64::mix(layer_seed ^ splitmix64::mix(n)) >> 1;
    key[1] = 0;
  }
};

//! Prints "mpx: causal_self_attention runs unfused: <why>" once per distinct reason.
inline void note_unfused_attention(std::string const& why) {
  static std::mutex m;
  static std::set<std::string> said;
  std::lock_guard lock(m);
  if (said.insert(why).second) std::fprintf(stderr, "mpx: causal_self_attention runs unfused: %s\n", why.c_str());
}
}  // namespace detail

//! The fused attention this program registered for Space's memory, or nullptr.
template <memory_space Space = device_space>
[[nodiscard]] inline fused_attention_backend* fused_attention() noexcept {
  return detail::fused_attention_slot<Space>();
}

//! Makes `backend` (nullptr: none) the fused attention of the layers whose executor
//! computes in Space's memory, from their next reserve on; returns the one it replaces.
//! Not thread-safe: register before layers are reserved, as cuDNN's registers at start-up.
template <memory_space Space>
inline fused_attention_backend* register_fused_attention(fused_attention_backend* backend) noexcept {
  fused_attention_backend* const previous = detail::fused_attention_slot<Space>();
  detail::fused_attention_slot<Space>() = backend;
  return previous;
}

}  // namespace mpx
