// The kernels of per-tensor fp8 scaling (scaling/fp8_scaling.hpp holds the recipes and
// the state that owns these values): the scaled, saturating cast that records |x|'s
// maximum, its padded and transposed forms, and the scale updates of both recipes. Each
// pass has one host loop, the reference, and one CUDA launch.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/lanes.hpp>
#include <mpx/exec/launch.hpp>

#include <cstddef>
#include <cstdint>

namespace mpx {

//! The longest amax history a state holds (Transformer Engine's usual choice).
inline constexpr std::uint32_t fp8_max_history = 1024;

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
  using value_type = std::uint32_t;
  MPX_HD static std::uint32_t identity() noexcept { return 0u; }
  MPX_HD std::uint32_t operator()(std::uint32_t a, std::uint32_t b) const noexcept { return a > b ? a : b; }
};

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

//! What one pass of the fp8 cast does with x.
enum class fp8_cast_pass {
  cast_and_record,  //!< writes the cast and folds |x|'s maximum into the step amax (delayed scaling)
  record_only,      //!< folds |x|'s maximum into the step amax, writes nothing (current scaling's first pass)
  cast_only,        //!< writes the cast, records nothing (current scaling's second pass, after its update)
};
MPX_HD constexpr bool fp8_pass_writes(fp8_cast_pass p) noexcept { return p != fp8_cast_pass::record_only; }
MPX_HD constexpr bool fp8_pass_records(fp8_cast_pass p) noexcept { return p != fp8_cast_pass::cast_only; }

//! One element of an fp8 pass: writes its cast (unless Pass is record_only) and returns
//! |x|'s bits for the amax (0 when Pass is cast_only). `pitch` > `cols` pads each row
//! of x [rows, cols] with zeros up to out [rows, pitch] (K padded for mpx::fp8_gemm).
template <fp8_cast_pass Pass, class Format, class In>
struct fp8_cast_element {
  In const* x;
  Format* out;
  fp8_scale_values const* state;  // its scale, read where the pass runs
  std::size_t cols, pitch;
  MPX_HD std::uint32_t operator()(std::size_t i) const {
    std::uint32_t m = 0;
    std::size_t const r = i / pitch, c = i - r * pitch;
    if (c < cols) {
      Format const y = fp8_scaled_element<Format>(x[r * cols + c], state->scale, m);
      if constexpr (fp8_pass_writes(Pass)) out[i] = y;
    } else if constexpr (fp8_pass_writes(Pass)) {
      out[i] = from_bits<Format>(bits_t<Format>{0});  // the padding's zeros
    }
    return fp8_pass_records(Pass) ? m : 0u;
  }
};

//! Folds a pass's amax into the state's step amax (an atomic max on the GPU).
struct record_step_amax {
  fp8_scale_values* state;
  MPX_HD void operator()(std::uint32_t m) const {
    if (m != 0) max_into(&state->step_amax_bits, m);
  }
};

//! One pass over x [rows, cols] into out [rows, pitch] (pitch >= cols, zeros past cols).
template <fp8_cast_pass Pass, class Exec, class Format, class In>
void fp8_rows_pass(Exec const& exec, In const* x, Format* out, std::size_t rows, std::size_t cols, std::size_t pitch,
                   fp8_scale_values* state) {
  for_each_index_into(exec, rows * pitch, max_magnitude_bits{},
                      fp8_cast_element<Pass, Format, In>{x, out, state, cols, pitch}, record_step_amax{state});
}

//! The pass of cast_to_fp8 and of current scaling's two passes, over n elements.
template <fp8_cast_pass Pass, class Exec, class Format, class In>
void fp8_pass(Exec const& exec, In const* x, Format* out, std::size_t n, fp8_scale_values* state) {
  fp8_rows_pass<Pass>(exec, x, out, 1, n, n, state);
}

//! cast_to_fp8_padded's pass: x [rows, cols] -> out [rows, pitch], zeros past cols,
//! recording the amax. pitch == cols is cast_to_fp8's pass.
template <class Exec, class Format, class In>
void fp8_padded_pass(Exec const& exec, In const* x, Format* out, std::size_t rows, std::size_t cols, std::size_t pitch,
                     fp8_scale_values* state) {
  fp8_rows_pass<fp8_cast_pass::cast_and_record>(exec, x, out, rows, cols, pitch, state);
}

//! The side of the square tiles cast_to_fp8_transposed moves through shared memory.
inline constexpr int fp8_transpose_tile = 32;

//! The grid of fp8_cast_transposed_kernel: a block per 32 x 32 tile of out's [cols,
//! pitch] and one per batch entry, each capped at CUDA's 65,535 blocks a dimension (the
//! kernel's loops reach the tiles beyond).
struct fp8_transposed_grid {
  unsigned x, y, z;
};
constexpr fp8_transposed_grid fp8_transposed_grid_of(std::int64_t batch, std::int64_t cols, std::int64_t pitch) {
  auto const capped = [](std::int64_t blocks) { return static_cast<unsigned>(blocks < 65535 ? blocks : 65535); };
  auto const tiles = [](std::int64_t extent) { return (extent + fp8_transpose_tile - 1) / fp8_transpose_tile; };
  return {capped(tiles(cols)), capped(tiles(pitch)), capped(batch)};
}

#if MPX_HAS_CUDA
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
  m = block_all_reduce(m, max_magnitude_bits{});
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
    fp8_transposed_grid const g = fp8_transposed_grid_of(batch, cols, pitch);
    fp8_cast_transposed_kernel<<<dim3(g.x, g.y, g.z), block_size, 0, exec.stream()>>>(x, out, batch, rows, cols, pitch,
                                                                                   state);
    MPX_CUDA_CHECK_LAUNCH("mpx::fp8_cast_transposed_kernel");
#else
    kernels_need_nvcc<Exec>();
#endif
  }
}

//! Delayed scaling's update as one row of lanes: the history's maximum over the lanes
//! (this step's amax standing in for the slot it replaces), then the update by one lane.
template <class Format>
struct fp8_delayed_update_row {
  fp8_scale_values* state;
  float margin_factor;
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t) const {
    fp8_scale_values& s = *state;
    std::uint32_t const amax_bits = s.step_amax_bits;
    std::uint32_t const m = lanes.reduce(s.history_length, max_magnitude_bits{}, [&](std::size_t i) {
      return i == s.position ? amax_bits : magnitude_bits(s.history[i]);
    });
    lanes.once([&] { fp8_delayed_update<Format>(s, m, margin_factor); });
  }
};

//! Delayed scaling's update of *state: this step's amax enters the history and the scale
//! follows the history's maximum (fp8_delayed_update). A warp on the GPU.
template <class Format, class Exec>
void fp8_delayed_update_pass(Exec const& exec, fp8_scale_values* state, float margin_factor) {
  for_each_row(exec, 1, fp8_max_history, fp8_delayed_update_row<Format>{state, margin_factor});
}

template <class Format>
struct fp8_current_update_once {
  fp8_scale_values* state;
  float margin_factor;
  MPX_HD void operator()() const { fp8_current_update<Format>(*state, margin_factor); }
};

//! Forgets the step amax recorded so far (current scaling's start: the scale is to come
//! from the next tensor alone).
struct fp8_clear_step_amax_once {
  fp8_scale_values* state;
  MPX_HD void operator()() const { state->step_amax_bits = 0; }
};

//! Current scaling's update of *state from the step amax recorded so far (fp8_current_update).
template <class Format, class Exec>
void fp8_current_update_pass(Exec const& exec, fp8_scale_values* state, float margin_factor) {
  run_once(exec, fp8_current_update_once<Format>{state, margin_factor});
}

}  // namespace detail
}  // namespace mpx
