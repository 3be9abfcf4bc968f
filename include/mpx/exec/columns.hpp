// The executor's dispatch for column reductions over a row-major [rows, cols] operand:
// for every column j, N sums over the rows, in the accumulate type, handed to a finish.
// Deterministic, with no atomics: the rows are cut into chunks fixed by the shape, and
// the host adds in the order the GPU does, so a sum has the same bits everywhere. The
// one engine behind the bias gradients, layer and batch norm's parameter gradients and
// statistics, the position-embedding gradient and mpx::column_sum.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/math.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/host_scratch.hpp>
#include <mpx/exec/host_threads.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/memory_space.hpp>

#include <algorithm>
#include <cstddef>
#include <type_traits>

// Why deterministic: a model trained twice from the same seed must give the same bits.
// A float sum of n rows carries the rounding of about n / (8 chunks) + 8 + (at most 256)
// chunks additions.

namespace mpx::detail {

//! A column reduction's terms: `Terms(r, j, Acc (&t)[N])` sets the N terms of element
//! (r, j) (an MPX_HD call operator; it may also write a side output, such as dx). A host
//! fast path may add `row(r, Acc* out)`, writing the N rows of terms at out[k * cols + j].
//! `Finish(j, Acc const (&s)[N])` receives column j's sums.
template <class Terms, class Acc>
concept column_row_terms = requires(Terms const& t, std::size_t r, Acc* out) { t.row(r, out); };

inline constexpr int column_tile = 32;        // columns per GPU block: a warp reads 32 neighbours of a row
inline constexpr int column_tile_rows = 8;    // row-threads per column: row r of a chunk goes to (r - r0) % 8
inline constexpr std::size_t column_max_chunks = 256;
inline constexpr std::size_t column_target_blocks = 1024;  // about 8 blocks per SM of a large GPU

//! How the rows are cut: fixed by the shape alone (not by the device), so the order of
//! every addition, and with it the bits of every sum, is the same on every GPU and the
//! host. Enough (32-column x chunk) blocks to fill a large GPU, at least 8 rows a chunk,
//! at most 256 chunks (the finish adds them one after another).
struct column_chunks {
  std::size_t count = 1, rows_per_chunk = 1;
};
constexpr column_chunks column_chunking(std::size_t rows, std::size_t cols) noexcept {
  std::size_t const tiles = (cols + column_tile - 1) / column_tile;
  std::size_t chunks = std::max<std::size_t>(1, (column_target_blocks + tiles - 1) / tiles);
  chunks = std::min({chunks, (rows + column_tile_rows - 1) / column_tile_rows, column_max_chunks});
  chunks = std::max<std::size_t>(chunks, 1);
  std::size_t const per_chunk = std::max<std::size_t>(1, (rows + chunks - 1) / chunks);
  return {std::max<std::size_t>(1, (rows + per_chunk - 1) / per_chunk), per_chunk};
}

//! a + b for the column sums: mpx::add_rn for float (a term that is a product is rounded
//! before it is added, on the GPU too, so the host and the GPU agree bit for bit).
template <class Acc>
MPX_HD inline Acc column_add(Acc a, Acc b) noexcept {
  if constexpr (std::is_same_v<Acc, float>) return add_rn(a, b);
  else return a + b;
}

//! The host column reduction's scratch (host_scratch), slot by slot.
struct column_scratch {};
enum column_scratch_slot : std::size_t { column_chunk_slot, column_lanes_slot, column_row_slot };

// The GPU's order on the host: in each chunk, row-thread y of column j sums rows
// r0 + y, r0 + y + 8, ...; the 8 row-threads' sums are added in order y = 0..7; the
// chunks' sums are added in chunk order. The chunks are shared among the host's
// threads (each with its own lanes), and their sums added in chunk order afterwards.
template <int N, class Acc, class Terms, class Finish>
void host_column_reduce(Terms const& terms, Finish const& finish, std::size_t rows, std::size_t cols) {
  std::size_t const width = N * cols;
  column_chunks const cut = column_chunking(rows, cols);
  Acc* chunk_sums = host_scratch<Acc, column_scratch, column_chunk_slot>(cut.count * width);  // [chunk][k][j]
  host_parallel_ranges(cut.count, rows * width, [&](std::size_t c0, std::size_t c1) {
    Acc* lanes = host_scratch<Acc, column_scratch, column_lanes_slot>(column_tile_rows * width);  // [y][k][j]
    [[maybe_unused]] Acc* row = host_scratch<Acc, column_scratch, column_row_slot>(width);
    for (std::size_t c = c0; c < c1; ++c) {
      std::fill(lanes, lanes + column_tile_rows * width, Acc{});
      std::size_t const r0 = c * cut.rows_per_chunk;
      std::size_t const r1 = std::min(rows, r0 + cut.rows_per_chunk);
      for (std::size_t r = r0; r < r1; ++r) {
        Acc* lane = lanes + ((r - r0) % column_tile_rows) * width;
        if constexpr (column_row_terms<Terms, Acc>) {
          terms.row(r, row);
          for (std::size_t i = 0; i < width; ++i) lane[i] = column_add(lane[i], row[i]);
        } else {
          for (std::size_t j = 0; j < cols; ++j) {
            Acc t[N] = {};
            terms(r, j, t);
            for (int k = 0; k < N; ++k) lane[k * cols + j] = column_add(lane[k * cols + j], t[k]);
          }
        }
      }
      Acc* chunk = chunk_sums + c * width;
      for (std::size_t i = 0; i < width; ++i) {
        Acc sum = Acc{};
        for (int y = 0; y < column_tile_rows; ++y) sum = column_add(sum, lanes[y * width + i]);
        chunk[i] = sum;
      }
    }
  });
  for (std::size_t j = 0; j < cols; ++j) {
    Acc s[N];
    for (int k = 0; k < N; ++k) {
      Acc total = Acc{};
      for (std::size_t c = 0; c < cut.count; ++c) total = column_add(total, chunk_sums[c * width + k * cols + j]);
      s[k] = total;
    }
    finish(j, s);
  }
}

#if MPX_HAS_CUDA

// First level: block (32, 8) owns 32 columns of a chunk of rows. Thread (x, y) sums rows
// y, y + 8, ... of its column; the 8 row-threads' sums are then added in order y = 0..7
// into partials[k][chunk][j]. Which thread runs first changes nothing.
template <int N, class Acc, class Terms>
__global__ void __launch_bounds__(column_tile * column_tile_rows)
    column_partials_kernel(Terms terms, std::size_t rows, std::size_t cols, std::size_t rows_per_chunk,
                           std::size_t chunks, Acc* __restrict__ partials) {
  __shared__ Acc sums[N][column_tile_rows][column_tile + 1];
  std::size_t const j = static_cast<std::size_t>(blockIdx.x) * column_tile + threadIdx.x;
  std::size_t const r0 = static_cast<std::size_t>(blockIdx.y) * rows_per_chunk;
  std::size_t const r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  Acc acc[N];
  MPX_UNROLL
  for (int k = 0; k < N; ++k) acc[k] = Acc{};
  if (j < cols) {
    for (std::size_t r = r0 + threadIdx.y; r < r1; r += column_tile_rows) {
      Acc t[N];
      MPX_UNROLL
      for (int k = 0; k < N; ++k) t[k] = Acc{};
      terms(r, j, t);
      MPX_UNROLL
      for (int k = 0; k < N; ++k) acc[k] = column_add(acc[k], t[k]);
    }
  }
  MPX_UNROLL
  for (int k = 0; k < N; ++k) sums[k][threadIdx.y][threadIdx.x] = acc[k];
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    MPX_UNROLL
    for (int k = 0; k < N; ++k) {
      Acc t = Acc{};
      MPX_UNROLL
      for (int y = 0; y < column_tile_rows; ++y) t = column_add(t, sums[k][y][threadIdx.x]);
      partials[(static_cast<std::size_t>(k) * chunks + blockIdx.y) * cols + j] = t;
    }
  }
}

// Second level: one thread per column adds its chunks' partials in chunk order.
template <int N, class Acc, class Finish>
__global__ void __launch_bounds__(block_size)
    column_finish_kernel(Finish finish, Acc const* __restrict__ partials, std::size_t chunks, std::size_t cols) {
  std::size_t const stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t j = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < cols; j += stride) {
    Acc s[N];
    MPX_UNROLL
    for (int k = 0; k < N; ++k) {
      Acc t = Acc{};
      for (std::size_t c = 0; c < chunks; ++c)
        t = column_add(t, partials[(static_cast<std::size_t>(k) * chunks + c) * cols + j]);
      s[k] = t;
    }
    finish(j, s);
  }
}

template <int N, class Acc, class Terms, class Finish>
void cuda_column_reduce(cudaStream_t stream, Terms const& terms, Finish const& finish, std::size_t rows,
                        std::size_t cols) {
  std::size_t const tiles = (cols + column_tile - 1) / column_tile;
  if (tiles > 0x7FFF'FFFFu) fail<invalid_argument>("column reduction", "too many columns for one launch");
  column_chunks const cut = column_chunking(rows, cols);
  std::size_t const chunks = cut.count, rows_per_chunk = cut.rows_per_chunk;
  buffer<Acc, device_space> partials(static_cast<std::size_t>(N) * chunks * cols, stream);
  dim3 const grid(static_cast<unsigned>(tiles), static_cast<unsigned>(chunks));
  dim3 const block(column_tile, column_tile_rows);
  column_partials_kernel<N, Acc><<<grid, block, 0, stream>>>(terms, rows, cols, rows_per_chunk, chunks,
                                                             partials.data());
  check_dispatch_launch<Terms>("mpx::column_partials_kernel", __FILE__, __LINE__);
  column_finish_kernel<N, Acc><<<grid_for(cols), block_size, 0, stream>>>(finish, partials.data(), chunks, cols);
  check_dispatch_launch<Finish>("mpx::column_finish_kernel", __FILE__, __LINE__);
}
#endif

//! For every column j of [rows, cols]: s[k] = sum over r of the terms t[k] of (r, j), in
//! Acc, in an order fixed by the shape alone (the same on the host and every GPU); then
//! finish(j, s). rows may be
//! 0 (every sum is 0). Asynchronous on a cuda_executor (its partial sums, N x cols x at
//! most 256 values, are allocated on the stream).
template <int N, class Acc = float, class Exec, class Terms, class Finish>
void column_reduce([[maybe_unused]] Exec const& exec, Terms const& terms, Finish const& finish, std::size_t rows,
                   std::size_t cols) {
  static_assert(N >= 1, "mpx::detail::column_reduce: at least one sum per column");
  if (cols == 0) return;
  if constexpr (is_host_executor_v<Exec>) {
    host_column_reduce<N, Acc>(terms, finish, rows, cols);
  } else {
#if MPX_HAS_CUDA
    cuda_column_reduce<N, Acc>(exec.stream(), terms, finish, rows, cols);
#else
    kernels_need_nvcc<Exec>();
#endif
  }
}

// ---- Two float sums per column, terms(r, j, a, b) and finish(j, sa, sb) (the norms) ----

template <class Terms>
struct two_sum_terms {
  Terms terms;
  MPX_HD void operator()(std::size_t r, std::size_t j, float (&t)[2]) const { terms(r, j, t[0], t[1]); }
};
template <class Finish>
struct two_sum_finish {
  Finish finish;
  MPX_HD void operator()(std::size_t j, float const (&s)[2]) const { finish(j, s[0], s[1]); }
};

//! For every column j, (sum_r a(r, j), sum_r b(r, j)) in float, then finish(j, sa, sb):
//! column_reduce with two sums, for terms written as Terms(r, j, a, b).
template <class Exec, class Terms, class Finish>
void column_sums(Exec const& exec, Terms const& terms, Finish const& finish, std::size_t rows, std::size_t cols) {
  column_reduce<2, float>(exec, two_sum_terms<Terms>{terms}, two_sum_finish<Finish>{finish}, rows, cols);
}

//! Writes two columns' sums.
struct store_two_sums {
  float* a;
  float* b;
  MPX_HD void operator()(std::size_t j, float sa, float sb) const {
    a[j] = sa;
    b[j] = sb;
  }
};

//! The terms of a plain column sum: x[r, j] in Acc.
template <class Acc, class X>
struct column_values_of {
  X const* x;
  std::size_t cols;
  MPX_HD void operator()(std::size_t r, std::size_t j, Acc (&t)[1]) const { t[0] = cast<Acc>(x[r * cols + j]); }
};

//! Writes a sum rounded once to Y.
template <class Acc, class Y>
struct store_sum_as {
  Y* y;
  MPX_HD void operator()(std::size_t j, Acc const (&s)[1]) const { y[j] = cast<Y>(s[0]); }
};

}  // namespace mpx::detail
