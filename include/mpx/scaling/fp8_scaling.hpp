// Per-tensor fp8 scaling as Transformer Engine does it: each tensor cast to fp8 keeps a
// scale, its inverse and a history of its absolute maxima where the executor computes,
// so a CUDA step casts, records and updates without waiting for the host. Two recipes:
// delayed scaling (cast with the scale of past steps, record this step's amax in the
// same pass) and current scaling (amax of this tensor first, then the cast).
// cast_to_fp8_transposed casts and transposes in one pass, for the K-contiguous operands
// that mpx::fp8_gemm needs on the GPU.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/checkpoint_file.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/resident.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/row_reduce.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

namespace mpx {

//! The longest amax history a state holds (Transformer Engine's usual choice).
inline constexpr std::uint32_t fp8_max_history = 1024;

//! Transformer Engine's default recipe: a tensor is cast with the scale computed from
//! the amax history before this step, and its amax is recorded in the same pass; after
//! the step, update_fp8_scale sets scale = max(Format) / (max(history) * 2^margin).
struct delayed_scaling {
  std::uint32_t history_length = fp8_max_history;  //!< steps remembered, 1 to fp8_max_history
  int margin = 0;                                   //!< extra headroom, in powers of two (0 to 64)
};

//! Just-in-time scaling: cast_to_fp8 finds the tensor's amax first, sets the scale
//! from it, then casts (two passes over the input; no history).
struct current_scaling {
  int margin = 0;  //!< extra headroom, in powers of two (0 to 64)
};

//! What a tensor's scaling keeps where the executor computes. Every field is written
//! by mpx's kernels in stream order; read it with fp8_tensor_scale::values (synchronises).
struct fp8_scale_values {
  float scale = 1.0f;          //!< the factor the next cast multiplies by (positive, finite)
  float inverse_scale = 1.0f;  //!< 1 / scale, rounded: dequantised value = fp8 value * inverse_scale
  //! This step's amax so far, as the bits of a non-negative float: integers compare as
  //! the floats do, and every NaN pattern of |x| lies above +inf, so an integer atomic
  //! max keeps a NaN. Zero after every update.
  std::uint32_t step_amax_bits = 0;
  float last_amax = 0.0f;          //!< the amax of the latest finished step (NaN or inf when seen)
  std::uint32_t history_length = 1;  //!< slots of history in use
  std::uint32_t position = 0;        //!< the slot the next update writes
  std::uint64_t steps = 0;           //!< updates so far
  std::uint64_t nonfinite_steps = 0;  //!< updates whose amax was NaN or inf
  float history[fp8_max_history] = {};  //!< the amax of the latest history_length steps (0: none yet)
};

namespace detail {

//! |x| as the bits of a float: ordered like the magnitudes, NaNs above +inf.
MPX_HD inline std::uint32_t magnitude_bits(float x) noexcept { return bit_cast<std::uint32_t>(x) & 0x7FFF'FFFFu; }

struct max_magnitude_bits {
  MPX_HD static std::uint32_t identity() noexcept { return 0u; }
  MPX_HD std::uint32_t operator()(std::uint32_t a, std::uint32_t b) const noexcept { return a > b ? a : b; }
};

//! 2^-margin, the factor the recipes apply; refuses margins outside [0, 64].
inline float fp8_margin_factor(int margin) {
  if (margin < 0 || margin > 64)
    fail<invalid_argument>("fp8 scaling", "margin must be in [0, 64], got " + std::to_string(margin));
  return std::ldexp(1.0f, -margin);
}

//! The scale for an amax (Transformer Engine's compute_scale_from_amax): a NaN, inf or
//! zero amax keeps `previous`; a scale that overflows float becomes FLT_MAX; one that
//! underflows to zero keeps `previous` (a zero scale could not be inverted).
template <class Format>
MPX_HD inline float fp8_scale_from_amax(float amax, float margin_factor, float previous) noexcept {
  if (!(amax > 0.0f) || !is_finite(amax)) return previous;
  float const s = (cast<float>(dtype_traits<Format>::max()) / amax) * margin_factor;
  if (!is_finite(s)) return dtype_traits<float>::max();
  return s > 0.0f ? s : previous;
}

//! Ends a step's bookkeeping once the new scale is known: the inverse, the last amax,
//! the counters, and a zero step amax for the next step.
MPX_HD inline void fp8_finish_step(fp8_scale_values& s, float amax, float scale) noexcept {
  s.scale = scale;
  s.inverse_scale = 1.0f / scale;
  s.last_amax = is_nan(amax) ? dtype_traits<float>::quiet_nan() : amax;
  s.step_amax_bits = 0;
  ++s.steps;
  if (!is_finite(amax)) ++s.nonfinite_steps;
}

//! Delayed scaling's update, the part one lane of `lanes` does: the largest history
//! magnitude among its slots, this step's amax standing in for the slot it replaces.
MPX_HD inline std::uint32_t fp8_history_max_bits(fp8_scale_values const& s, std::uint32_t amax_bits,
                                                 std::uint32_t lane, std::uint32_t lanes) noexcept {
  std::uint32_t m = 0;
  for (std::uint32_t i = lane; i < s.history_length; i += lanes) {
    std::uint32_t const b = i == s.position ? amax_bits : magnitude_bits(s.history[i]);
    m = m > b ? m : b;
  }
  return m;
}

//! Delayed scaling's update once the history maximum is known (one thread).
template <class Format>
MPX_HD inline void fp8_delayed_update(fp8_scale_values& s, std::uint32_t history_max_bits,
                                      float margin_factor) noexcept {
  float const amax = bit_cast<float>(s.step_amax_bits);
  s.history[s.position] = is_nan(amax) ? dtype_traits<float>::quiet_nan() : amax;
  s.position = s.position + 1 == s.history_length ? 0u : s.position + 1;
  float const scale = fp8_scale_from_amax<Format>(bit_cast<float>(history_max_bits), margin_factor, s.scale);
  fp8_finish_step(s, amax, scale);
}

//! Current scaling's update: the scale from this step's amax alone.
template <class Format>
MPX_HD inline void fp8_current_update(fp8_scale_values& s, float margin_factor) noexcept {
  float const amax = bit_cast<float>(s.step_amax_bits);
  fp8_finish_step(s, amax, fp8_scale_from_amax<Format>(amax, margin_factor, s.scale));
}

//! One element: saturate_cast<Format>(x * scale), and |x|'s bits for the amax.
template <class Format, class In>
MPX_HD inline Format fp8_scaled_element(In x, float scale, std::uint32_t& amax_bits) noexcept {
  float const v = cast<float>(x);
  std::uint32_t const b = magnitude_bits(v);
  amax_bits = amax_bits > b ? amax_bits : b;
  return saturate_cast<Format>(v * scale);
}

#if MPX_HAS_CUDA
//! A grid-stride pass over x: writes out (when Write) and records the amax into the
//! state's step amax (when Record) with one atomic max per block.
template <bool Write, bool Record, class Format, class In>
__global__ void __launch_bounds__(block_size)
    fp8_cast_kernel(In const* x, Format* out, std::size_t n, fp8_scale_values* state) {
  float const scale = state->scale;
  std::uint32_t m = 0;
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    Format const y = fp8_scaled_element<Format>(x[i], scale, m);
    if constexpr (Write) out[i] = y;
  }
  if constexpr (Record) {
    __shared__ std::uint32_t scratch[32];
    m = block_all_reduce(m, max_magnitude_bits{}, scratch);
    if (threadIdx.x == 0 && m != 0) atomicMax(&state->step_amax_bits, m);
  }
}

//! Delayed scaling's update on one warp: the history maximum over 32 lanes.
template <class Format>
__global__ void fp8_delayed_update_kernel(fp8_scale_values* state, float margin_factor) {
  std::uint32_t m = fp8_history_max_bits(*state, state->step_amax_bits, threadIdx.x, 32u);
  m = warp_all_reduce(m, max_magnitude_bits{});
  if (threadIdx.x == 0) fp8_delayed_update<Format>(*state, m, margin_factor);
}

template <class Format>
__global__ void fp8_current_update_kernel(fp8_scale_values* state, float margin_factor) {
  fp8_current_update<Format>(*state, margin_factor);
}
#endif

//! The one host/CUDA choice of the fp8 passes (see fp8_cast_kernel).
template <bool Write, bool Record, class Exec, class Format, class In>
void fp8_pass([[maybe_unused]] Exec const& exec, In const* x, Format* out, std::size_t n, fp8_scale_values* state) {
  if constexpr (is_host_executor_v<Exec>) {
    float const scale = state->scale;
    std::uint32_t m = 0;
    for (std::size_t i = 0; i < n; ++i) {
      Format const y = fp8_scaled_element<Format>(x[i], scale, m);
      if constexpr (Write) out[i] = y;
    }
    if constexpr (Record) state->step_amax_bits = state->step_amax_bits > m ? state->step_amax_bits : m;
  } else {
#if MPX_HAS_CUDA
    if (n == 0) return;
    fp8_cast_kernel<Write, Record><<<grid_for(n), block_size, 0, exec.stream()>>>(x, out, n, state);
    MPX_CUDA_CHECK_LAUNCH("mpx::fp8_cast_kernel");
#else
    kernels_need_nvcc<Exec>();
#endif
  }
}

#if MPX_HAS_CUDA
//! fp8_cast_kernel over x [rows, cols] into out [rows, pitch] (pitch > cols): the
//! columns past cols become zeros, which add nothing to a product (K padded for
//! mpx::fp8_gemm).
template <class Format, class In>
__global__ void __launch_bounds__(block_size)
    fp8_cast_padded_kernel(In const* x, Format* out, std::size_t rows, std::size_t cols, std::size_t pitch,
                           fp8_scale_values* state) {
  float const scale = state->scale;
  Format const zero = from_bits<Format>(bits_t<Format>{0});
  std::uint32_t m = 0;
  std::size_t const n = rows * pitch;
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    std::size_t const r = i / pitch, c = i - r * pitch;
    out[i] = c < cols ? fp8_scaled_element<Format>(x[r * cols + c], scale, m) : zero;
  }
  __shared__ std::uint32_t scratch[32];
  m = block_all_reduce(m, max_magnitude_bits{}, scratch);
  if (threadIdx.x == 0 && m != 0) atomicMax(&state->step_amax_bits, m);
}
#endif

//! cast_to_fp8_padded's pass, host or CUDA: x [rows, cols] -> out [rows, pitch], zeros
//! past cols, recording the amax. pitch == cols is cast_to_fp8's pass.
template <class Exec, class Format, class In>
void fp8_padded_pass([[maybe_unused]] Exec const& exec, In const* x, Format* out, std::size_t rows, std::size_t cols,
                     std::size_t pitch, fp8_scale_values* state) {
  if (pitch == cols) return fp8_pass<true, true>(exec, x, out, rows * cols, state);
  if (rows == 0) return;
  if constexpr (is_host_executor_v<Exec>) {
    float const scale = state->scale;
    Format const zero = from_bits<Format>(bits_t<Format>{0});
    std::uint32_t m = 0;
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < pitch; ++c)
        out[r * pitch + c] = c < cols ? fp8_scaled_element<Format>(x[r * cols + c], scale, m) : zero;
    state->step_amax_bits = state->step_amax_bits > m ? state->step_amax_bits : m;
  } else {
#if MPX_HAS_CUDA
    fp8_cast_padded_kernel<<<grid_for(rows * pitch), block_size, 0, exec.stream()>>>(x, out, rows, cols, pitch, state);
    MPX_CUDA_CHECK_LAUNCH("mpx::fp8_cast_padded_kernel");
#else
    kernels_need_nvcc<Exec>();
#endif
  }
}

#if MPX_HAS_CUDA
//! The side of the square tiles cast_to_fp8_transposed moves through shared memory.
inline constexpr int fp8_transpose_tile = 32;

//! out[b][j][i] = the scaled cast of x[b][i][j] (x [batch, rows, cols], out [batch,
//! cols, pitch] with pitch >= rows, zeros in i >= rows), recording |x|'s amax with one
//! atomic max per block. A block of block_size threads takes 32 x 32
//! tiles: it reads a tile along x's rows and writes it along out's, both coalesced,
//! through shared memory that holds one fp8 value per 4-byte word in rows of 33 words,
//! so that a column of the tile spans all 32 banks.
template <class Format, class In>
__global__ void __launch_bounds__(block_size)
    fp8_cast_transposed_kernel(In const* x, Format* out, std::int64_t batch, std::int64_t rows, std::int64_t cols,
                               std::int64_t pitch, fp8_scale_values* state) {
  constexpr int tile = fp8_transpose_tile;
  constexpr int tile_rows = block_size / tile;  // rows of a tile one pass of the block covers
  __shared__ std::uint32_t cast_tile[tile][tile + 1];
  float const scale = state->scale;
  std::uint32_t m = 0;
  int const tx = static_cast<int>(threadIdx.x) % tile, ty = static_cast<int>(threadIdx.x) / tile;
  std::int64_t const row_tiles = (pitch + tile - 1) / tile, col_tiles = (cols + tile - 1) / tile;
  for (std::int64_t b = blockIdx.z; b < batch; b += gridDim.z)
    for (std::int64_t tr = blockIdx.y; tr < row_tiles; tr += gridDim.y)
      for (std::int64_t tc = blockIdx.x; tc < col_tiles; tc += gridDim.x) {
        In const* xb = x + b * rows * cols;
        Format* ob = out + b * pitch * cols;
        std::int64_t const i0 = tr * tile, j0 = tc * tile;
        for (int r = ty; r < tile; r += tile_rows) {
          std::int64_t const i = i0 + r, j = j0 + tx;
          if (i < rows && j < cols) cast_tile[r][tx] = bits(fp8_scaled_element<Format>(xb[i * cols + j], scale, m));
          else cast_tile[r][tx] = 0u;  // the padding's zeros
        }
        __syncthreads();
        for (int r = ty; r < tile; r += tile_rows) {
          std::int64_t const j = j0 + r, i = i0 + tx;
          if (i < pitch && j < cols)
            ob[j * pitch + i] = from_bits<Format>(static_cast<bits_t<Format>>(cast_tile[tx][r]));
        }
        __syncthreads();  // the tile is rewritten by the next iteration
      }
  __shared__ std::uint32_t scratch[32];
  m = block_all_reduce(m, max_magnitude_bits{}, scratch);
  if (threadIdx.x == 0 && m != 0) atomicMax(&state->step_amax_bits, m);
}
#endif

//! cast_to_fp8_transposed's pass, host or CUDA: x [batch, rows, cols] -> out [batch,
//! cols, pitch] (pitch >= rows; zeros past rows), recording the amax.
template <class Exec, class Format, class In>
void fp8_transposed_pass([[maybe_unused]] Exec const& exec, In const* x, Format* out, std::int64_t batch,
                         std::int64_t rows, std::int64_t cols, std::int64_t pitch, fp8_scale_values* state) {
  if (batch == 0 || pitch == 0 || cols == 0) return;
  if constexpr (is_host_executor_v<Exec>) {
    float const scale = state->scale;
    Format const zero = from_bits<Format>(bits_t<Format>{0});
    std::uint32_t m = 0;
    for (std::int64_t b = 0; b < batch; ++b) {
      In const* xb = x + b * rows * cols;
      Format* ob = out + b * pitch * cols;
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < cols; ++j)
          ob[j * pitch + i] = fp8_scaled_element<Format>(xb[i * cols + j], scale, m);
      for (std::int64_t j = 0; j < cols; ++j)
        for (std::int64_t i = rows; i < pitch; ++i) ob[j * pitch + i] = zero;
    }
    state->step_amax_bits = state->step_amax_bits > m ? state->step_amax_bits : m;
  } else {
#if MPX_HAS_CUDA
    // Tiles beyond the grid's limits are reached by the kernel's loops.
    auto const blocks = [](std::int64_t extent, std::int64_t limit) {
      std::int64_t const tiles = (extent + fp8_transpose_tile - 1) / fp8_transpose_tile;
      return static_cast<unsigned>(tiles < limit ? tiles : limit);
    };
    dim3 const grid(blocks(cols, 65535), blocks(pitch, 65535), static_cast<unsigned>(batch < 65535 ? batch : 65535));
    fp8_cast_transposed_kernel<<<grid, block_size, 0, exec.stream()>>>(x, out, batch, rows, cols, pitch, state);
    MPX_CUDA_CHECK_LAUNCH("mpx::fp8_cast_transposed_kernel");
#else
    kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace detail

//! The scaling state of one tensor cast to Format (float8_e4m3 or float8_e5m2), kept in
//! Exec's memory. Move-only (it owns its memory).
template <dtype8 Format, executor Exec>
class fp8_tensor_scale {
 public:
  using format_type = Format;
  using space = memory_space_t<Exec>;

  //! A state with `initial_scale` (positive, finite) and an empty history of
  //! recipe.history_length steps; throws mpx::invalid_argument otherwise.
  fp8_tensor_scale(Exec const& exec, delayed_scaling const& recipe = {}, float initial_scale = 1.0f)
      : values_(exec, initial_values(recipe.history_length, initial_scale)),
        history_length_(recipe.history_length) {}
  //! A state for current scaling (no history is kept; its length is 1).
  fp8_tensor_scale(Exec const& exec, current_scaling const&, float initial_scale = 1.0f)
      : values_(exec, initial_values(1, initial_scale)) {}

  //! Where kernels find the state; scale_data() and inverse_scale_data() for consumers
  //! that scale or dequantise on the device (dequantised value = fp8 value * inverse).
  [[nodiscard]] fp8_scale_values* data() const noexcept { return values_.get(); }
  [[nodiscard]] float const* scale_data() const noexcept { return &values_.get()->scale; }
  [[nodiscard]] float const* inverse_scale_data() const noexcept { return &values_.get()->inverse_scale; }
  //! Steps of amax history (fixed when the state is made; 1 for current scaling).
  [[nodiscard]] std::uint32_t history_length() const noexcept { return history_length_; }

  //! The whole state. Synchronises a cuda_executor.
  [[nodiscard]] fp8_scale_values values(Exec const& exec) const { return values_.read(exec); }
  //! Replaces the state, in stream order, after checking it (see impossible(); the
  //! history length must be this state's); throws mpx::invalid_argument.
  void set_values(Exec const& exec, fp8_scale_values const& v) {
    std::string why = impossible(v);
    if (why.empty() && v.history_length != history_length_)
      why = "its history length " + std::to_string(v.history_length) + " is not this state's " +
            std::to_string(history_length_);
    if (!why.empty()) detail::fail<invalid_argument>("fp8_tensor_scale", "refusing the state: " + why);
    values_.write(exec, v);
  }

  //! Adds this state to a checkpoint as sections "<name>/format" and "<name>/state"
  //! (save it with the optimizer's state). Synchronises.
  void save(Exec const& exec, detail::checkpoint_writer& out, std::string const& name) const {
    out.add(name + "/format", detail::text_bytes(dtype_traits<Format>::name));
    out.add_value(name + "/state", values(exec));
  }
  //! Restores a state saved by save() under `name`. Refuses, with mpx::checkpoint_error
  //! and before changing anything, another format, another history length, and a state
  //! no update could have made (see impossible()).
  void load(Exec const& exec, detail::checkpoint_reader const& in, std::string const& name) {
    std::string const saved = in.text(name + "/format");
    if (saved != dtype_traits<Format>::name)
      in.refuse("its fp8 scale '" + name + "' is for " + saved + ", this one for " +
                std::string(dtype_traits<Format>::name) + "; nothing was loaded");
    auto const v = in.value<fp8_scale_values>(name + "/state");
    std::uint32_t const length = history_length_;
    if (v.history_length != length)
      in.refuse("its fp8 scale '" + name + "' has a history of " + std::to_string(v.history_length) +
                " steps, this one of " + std::to_string(length) + "; nothing was loaded");
    if (std::string const why = impossible(v); !why.empty())
      in.refuse("its fp8 scale '" + name + "' is impossible: " + why + "; the file is corrupt, nothing was loaded");
    values_.write(exec, v);
  }

  //! Empty when v is a state mpx's updates can produce, else why not.
  [[nodiscard]] static std::string impossible(fp8_scale_values const& v) {
    if (!(v.scale > 0.0f) || !is_finite(v.scale))
      return "the scale " + detail::to_text(v.scale) + " is not positive and finite";
    if (detail::bit_cast<std::uint32_t>(v.inverse_scale) != detail::bit_cast<std::uint32_t>(1.0f / v.scale))
      return "the inverse scale " + detail::to_text(v.inverse_scale) + " is not 1 / " + detail::to_text(v.scale);
    if (v.history_length < 1 || v.history_length > fp8_max_history)
      return "the history length " + std::to_string(v.history_length) + " is not in [1, " +
             std::to_string(fp8_max_history) + "]";
    if (v.position >= v.history_length)
      return "the history position " + std::to_string(v.position) + " is past its length " +
             std::to_string(v.history_length);
    if (v.nonfinite_steps > v.steps) return "more non-finite steps than steps";
    for (std::uint32_t i = 0; i < fp8_max_history; ++i) {
      float const h = v.history[i];
      if (i >= v.history_length ? h != 0.0f || detail::sign_bit(h) : h < 0.0f || detail::sign_bit(h))
        return "history slot " + std::to_string(i) + " holds " + detail::to_text(h);
    }
    float const step_amax = detail::bit_cast<float>(v.step_amax_bits);
    if (detail::sign_bit(step_amax) || detail::sign_bit(v.last_amax) || v.last_amax < 0.0f)
      return "an amax is negative";
    return {};
  }

 private:
  static fp8_scale_values initial_values(std::uint32_t history_length, float initial_scale) {
    if (history_length < 1 || history_length > fp8_max_history)
      detail::fail<invalid_argument>("fp8_tensor_scale", "history_length must be in [1, " +
                                                             std::to_string(fp8_max_history) + "], got " +
                                                             std::to_string(history_length));
    if (!(initial_scale > 0.0f) || !is_finite(initial_scale))
      detail::fail<invalid_argument>("fp8_tensor_scale", "the initial scale must be positive and finite, got " +
                                                             detail::to_text(initial_scale));
    fp8_scale_values v;
    v.scale = initial_scale;
    v.inverse_scale = 1.0f / initial_scale;
    v.history_length = history_length;
    return v;
  }

  resident<fp8_scale_values, space> values_;
  std::uint32_t history_length_ = 1;
};

namespace detail {
//! The compile-time checks of cast_to_fp8 and cast_to_fp8_transposed.
template <class Exec, class X, class Out, class Format>
constexpr void check_fp8_cast_types() {
  using In = typename X::value_type;
  static_assert(std::is_same_v<In, half> || std::is_same_v<In, bfloat16> || std::is_same_v<In, float>,
                "mpx::cast_to_fp8 reads half, bfloat16 or float tensors");
  static_assert(std::is_same_v<typename Out::value_type, Format>,
                "mpx::cast_to_fp8 writes the fp8 format of its scale (an fp8_tensor_scale<float8_e4m3, ...> "
                "scales a float8_e4m3 tensor)");
  require_access<Exec, typename X::space_type, typename Out::space_type>();
}

//! The checks cast_to_fp8 shares between its recipes.
template <class Exec, class X, class Out, class Format>
void check_fp8_cast(X const& x, Out const& out) {
  check_fp8_cast_types<Exec, X, Out, Format>();
  if (x.shape() != out.shape())
    fail<shape_error>("mpx::cast_to_fp8",
                      "x has shape " + x.shape().to_string() + ", out has shape " + out.shape().to_string());
  require_disjoint("mpx::cast_to_fp8", "x", x, "out", out);
}

//! Current scaling's update from the step amax recorded so far.
template <class Exec, class Format>
void fp8_current_update_on([[maybe_unused]] Exec const& exec, fp8_tensor_scale<Format, Exec>& state, float factor) {
  if constexpr (is_host_executor_v<Exec>) {
    fp8_current_update<Format>(*state.data(), factor);
  } else {
#if MPX_HAS_CUDA
    fp8_current_update_kernel<Format><<<1, 1, 0, exec.stream()>>>(state.data(), factor);
    MPX_CUDA_CHECK_LAUNCH("mpx::fp8_current_update_kernel");
#else
    kernels_need_nvcc<Exec>();
#endif
  }
}
}  // namespace detail

//! out = saturate_cast<Format>(float(x) * scale) for every element, and |x|'s maximum
//! folded into this step's amax, in one pass (delayed scaling; several casts in a step
//! fold into one amax). Saturating as Transformer Engine does: a value beyond the
//! format, inf included, becomes ±max; NaN stays NaN, and a NaN or inf in x makes the
//! step's amax non-finite, so the update keeps the previous scale and counts the step
//! in nonfinite_steps. x is half, bfloat16 or float; out has x's shape (else
//! mpx::shape_error) and must not overlap it; both live where the executor computes.
//! Asynchronous on a cuda_executor.
template <executor Exec, tensor_like X, tensor_like Out, dtype8 Format>
void cast_to_fp8(Exec const& exec, X&& x, fp8_tensor_scale<Format, Exec>& state, Out&& out,
                 delayed_scaling const& = {}) {
  auto const xv = mpx::view(x);
  auto const ov = mpx::view(out);
  detail::check_fp8_cast<Exec, decltype(xv), decltype(ov), Format>(xv, ov);
  detail::fp8_pass<true, true>(exec, xv.data(), ov.data(), xv.size(), state.data());
}

namespace detail {
// The checks and the pass behind cast_to_fp8_transposed and its padded form: out is x
// with the last two extents swapped, its last (x's rows, K) exactly as long or, padded,
// as long or longer; the pass writes zeros past x's rows.
template <class Exec, class XV, class OV, class Format>
void cast_to_fp8_transposed_checked(char const* op, bool padded, Exec const& exec, XV const& xv,
                                    fp8_tensor_scale<Format, Exec>& state, OV const& ov) {
  check_fp8_cast_types<Exec, XV, OV, Format>();
  mpx::shape const& xs = xv.shape();
  mpx::shape const& os = ov.shape();
  std::size_t const r = xs.rank();
  std::string const shapes = "x has shape " + xs.to_string() + ", out has shape " + os.to_string();
  if (r != 2 && r != 3)
    fail<shape_error>(op, "x must be a matrix [rows, cols] or a batch of them [batch, rows, cols]; " + shapes);
  bool const rows_fit = padded ? os[r - 1] >= xs[r - 2] : os[r - 1] == xs[r - 2];
  if (!(os.rank() == r && os[r - 2] == xs[r - 1] && rows_fit && (r == 2 || os[0] == xs[0])))
    fail<shape_error>(op, std::string(padded ? "out must have x's shape with the last two extents swapped, its last "
                                               "as long as x's rows or longer; "
                                             : "out must have x's shape with the last two extents swapped; ") +
                              shapes);
  require_disjoint(op, "x", xv, "out", ov);
  fp8_transposed_pass(exec, xv.data(), ov.data(), r == 3 ? xs[0] : 1, xs[r - 2], xs[r - 1], os[r - 1], state.data());
}
}  // namespace detail

//! cast_to_fp8 (delayed scaling) and a transpose in one pass: x [R, C] gives out [C, R]
//! with out[j][i] = saturate_cast<Format>(float(x[i][j]) * scale), |x|'s maximum folded
//! into this step's amax as cast_to_fp8 does (NaN and inf alike); a batch [B, R, C] gives
//! [B, C, R]. For mpx::fp8_gemm on the GPU, which needs both operands K-contiguous: an
//! activation gradient dY [N, M] becomes the [M, N] operand of the weight gradient
//! dY^T X. Another shape of out (or a rank other than 2 or 3) is an mpx::shape_error
//! naming both; out must not overlap x; both live where the executor computes.
//! Asynchronous on a cuda_executor (32 x 32 tiles through shared memory).
template <executor Exec, tensor_like X, tensor_like Out, dtype8 Format>
void cast_to_fp8_transposed(Exec const& exec, X&& x, fp8_tensor_scale<Format, Exec>& state, Out&& out,
                            delayed_scaling const& = {}) {
  detail::cast_to_fp8_transposed_checked("cast_to_fp8_transposed", false, exec, mpx::view(x), state, mpx::view(out));
}

//! cast_to_fp8 (delayed scaling) into rows padded with zeros: x [..., K] gives out
//! [..., Kp] with Kp >= K, the first K columns of each row cast as cast_to_fp8 casts
//! them and the others +0, which add nothing to a product. Pads K to what mpx::fp8_gemm
//! needs on the GPU (fp8_gemm_padded_extent(K)). The amax is recorded as by cast_to_fp8.
//! Other extents than the last must agree, and Kp >= K (else mpx::shape_error naming
//! both shapes); out must not overlap x. Asynchronous on a cuda_executor.
template <executor Exec, tensor_like X, tensor_like Out, dtype8 Format>
void cast_to_fp8_padded(Exec const& exec, X&& x, fp8_tensor_scale<Format, Exec>& state, Out&& out,
                        delayed_scaling const& = {}) {
  auto const xv = mpx::view(x);
  auto const ov = mpx::view(out);
  detail::check_fp8_cast_types<Exec, decltype(xv), decltype(ov), Format>();
  mpx::shape const& xs = xv.shape();
  mpx::shape const& os = ov.shape();
  std::size_t const r = xs.rank();
  bool ok = r >= 1 && os.rank() == r && os[r - 1] >= xs[r - 1];
  for (std::size_t i = 0; ok && i + 1 < r; ++i) ok = os[i] == xs[i];
  if (!ok)
    detail::fail<shape_error>("cast_to_fp8_padded", "out must have x's shape with the last extent as long or "
                                                    "longer; x has shape " + xs.to_string() + ", out has shape " +
                                                        os.to_string());
  detail::require_disjoint("cast_to_fp8_padded", "x", xv, "out", ov);
  auto const cols = static_cast<std::size_t>(xs[r - 1]);
  auto const pitch = static_cast<std::size_t>(os[r - 1]);
  detail::fp8_padded_pass(exec, xv.data(), ov.data(), pitch ? ov.size() / pitch : 0, cols, pitch, state.data());
}

//! cast_to_fp8_transposed into rows padded with zeros: x [R, C] gives out [C, Rp] with
//! Rp >= R (a batch [B, R, C] gives [B, C, Rp]), out[j][i] the cast of x[i][j] for i < R
//! and +0 beyond: the K-contiguous operand of mpx::fp8_gemm with K = R padded
//! (fp8_gemm_padded_extent(R)). The amax is recorded as by cast_to_fp8. Other shapes are
//! an mpx::shape_error naming both; out must not overlap x. Asynchronous on a
//! cuda_executor.
template <executor Exec, tensor_like X, tensor_like Out, dtype8 Format>
void cast_to_fp8_transposed_padded(Exec const& exec, X&& x, fp8_tensor_scale<Format, Exec>& state, Out&& out,
                                   delayed_scaling const& = {}) {
  detail::cast_to_fp8_transposed_checked("cast_to_fp8_transposed_padded", true, exec, mpx::view(x), state,
                                         mpx::view(out));
}

//! Current scaling: the amax of x first (one pass), the scale from it
//! (max(Format) / (amax * 2^margin); a zero or non-finite amax keeps the previous
//! scale), then the cast as above (a second pass, which records nothing). The step is
//! finished here: no update_fp8_scale follows. Asynchronous on a cuda_executor.
template <executor Exec, tensor_like X, tensor_like Out, dtype8 Format>
void cast_to_fp8(Exec const& exec, X&& x, fp8_tensor_scale<Format, Exec>& state, Out&& out,
                 current_scaling const& recipe) {
  auto const xv = mpx::view(x);
  auto const ov = mpx::view(out);
  detail::check_fp8_cast<Exec, decltype(xv), decltype(ov), Format>(xv, ov);
  float const factor = detail::fp8_margin_factor(recipe.margin);
  detail::fp8_pass<false, true>(exec, xv.data(), static_cast<Format*>(nullptr), xv.size(), state.data());
  detail::fp8_current_update_on(exec, state, factor);
  detail::fp8_pass<true, false>(exec, xv.data(), ov.data(), xv.size(), state.data());
}

//! Ends a step of delayed scaling: this step's amax enters the history, and scale =
//! max(Format) / (max(history) * 2^margin) unless that maximum is zero, NaN or inf
//! (then the scale stays; a NaN or inf stays in the history, and so keeps the scale,
//! for history_length steps, as in Transformer Engine). recipe.history_length must be
//! the state's (fixed when the state is made; else mpx::invalid_argument).
//! Asynchronous on a cuda_executor (one warp).
template <executor Exec, dtype8 Format>
void update_fp8_scale([[maybe_unused]] Exec const& exec, fp8_tensor_scale<Format, Exec>& state,
                      delayed_scaling const& recipe) {
  float const factor = detail::fp8_margin_factor(recipe.margin);
  if (recipe.history_length != state.history_length())
    detail::fail<invalid_argument>("mpx::update_fp8_scale", "the recipe's history_length " +
                                                                std::to_string(recipe.history_length) +
                                                                " differs from the state's " +
                                                                std::to_string(state.history_length()));
  if constexpr (is_host_executor_v<Exec>) {
    fp8_scale_values& s = *state.data();
    detail::fp8_delayed_update<Format>(s, detail::fp8_history_max_bits(s, s.step_amax_bits, 0, 1), factor);
  } else {
#if MPX_HAS_CUDA
    detail::fp8_delayed_update_kernel<Format><<<1, 32, 0, exec.stream()>>>(state.data(), factor);
    MPX_CUDA_CHECK_LAUNCH("mpx::fp8_delayed_update_kernel");
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

//! Current scaling's update from the step amax recorded so far: what cast_to_fp8 with
//! current_scaling does between its passes, for an amax gathered over several tensors
//! with cast_to_fp8 (delayed) calls whose outputs are then discarded.
template <executor Exec, dtype8 Format>
void update_fp8_scale(Exec const& exec, fp8_tensor_scale<Format, Exec>& state, current_scaling const& recipe) {
  detail::fp8_current_update_on(exec, state, detail::fp8_margin_factor(recipe.margin));
}

}  // namespace mpx
