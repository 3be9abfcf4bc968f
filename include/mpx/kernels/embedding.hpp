// Embedding lookups on any executor: token ids (int32) -> rows of a [vocab, width] table,
// optionally plus learned position rows, and the backward pass, a deterministic
// scatter-add of the output gradient into the table's rows, summed in float.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/host_scratch.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/column_reduce.hpp>
#include <mpx/kernels/elementwise.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

// Why the backward pass is deterministic: several tokens share an id, so their gradient
// rows meet in one table row. With atomics the float additions would happen in whatever
// order the threads run, and the bits would change from run to run. Here each element
// d_table[v, d] is summed by exactly one thread (on the host, one loop), which walks the
// tokens in order n = 0, 1, ..., N-1 and adds dy[n, d] where ids[n] == v, starting from
// 0.0f. The order of the additions is the token order, whatever the thread scheduling,
// so host and GPU give the same bits. The cost is reading all N ids once per table row
// (from shared memory, in tiles), O(vocab x N) comparisons: nothing for byte- and
// character-level vocabularies; a vocabulary of tens of thousands wants a sorted
// (segmented) pass instead.

namespace mpx {

namespace detail {

//! The host backward pass's float sums (host_scratch_floats).
struct embedding_scratch {};

//! The layout an embedding call works on: N tokens (every axis of ids), L tokens per
//! sequence (ids' last axis), rows V and width D of the table.
struct embedding_layout {
  std::size_t tokens = 0, sequence = 0, vocab = 0, width = 0;
};

inline embedding_layout embedding_shapes(std::string_view op, shape const& ids, shape const& table,
                                         shape const& y) {
  if (ids.rank() < 1)
    fail<shape_error>(op, "ids must have rank 1 or more ([tokens] or [batch, sequence]), got " + ids.to_string());
  if (table.rank() != 2)
    fail<shape_error>(op, "the table must be [vocab, width], got " + table.to_string());
  bool ok = y.rank() == ids.rank() + 1 && y[y.rank() - 1] == table[1];
  for (std::size_t i = 0; ok && i < ids.rank(); ++i) ok = y[i] == ids[i];
  if (!ok)
    fail<shape_error>(op, "the output of shape " + y.to_string() + " is not ids' shape " + ids.to_string() +
                              " followed by the table's width (table " + table.to_string() + ")");
  return {ids.size(), static_cast<std::size_t>(ids[ids.rank() - 1]), static_cast<std::size_t>(table[0]),
          static_cast<std::size_t>(table[1])};
}

inline void embedding_positions_shape(std::string_view op, shape const& positions, embedding_layout const& l) {
  if (positions.rank() != 2 || static_cast<std::size_t>(positions[1]) != l.width ||
      static_cast<std::size_t>(positions[0]) < l.sequence)
    fail<shape_error>(op, "positions of shape " + positions.to_string() + " must be [context, " +
                              std::to_string(l.width) + "] with context >= the sequence length " +
                              std::to_string(l.sequence));
}

//! Throws mpx::invalid_argument naming the first id outside [0, vocab).
template <class I>
void require_ids_in_range(std::string_view op, I const* ids, std::size_t n, std::size_t vocab) {
  for (std::size_t i = 0; i < n; ++i)
    if (ids[i] < 0 || static_cast<std::size_t>(ids[i]) >= vocab)
      fail<invalid_argument>(op, "token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                                     " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

//! y[n, d] = table[ids[n], d] (+ positions[n % L, d]) in float, rounded once to Y. An id
//! outside the table gives a zero row and sets *invalid (when given) to 1.
template <class I, class W, class P, class Y>
struct embedding_gather {
  I const* ids;
  W const* table;
  P const* positions;  // null: no position embedding
  Y* y;
  std::size_t sequence, vocab, width;
  int* invalid;  // may be null
  MPX_HD void operator()(std::size_t i) const {
    std::size_t const n = i / width;
    std::size_t const d = i - n * width;
    auto const id = ids[n];
    float v = 0.0f;
    if (id >= 0 && static_cast<std::size_t>(id) < vocab) {
      v = cast<float>(table[static_cast<std::size_t>(id) * width + d]);
    } else if (invalid) {
      *invalid = 1;  // every writer stores the same value: no atomic needed
    }
    if (positions) v += cast<float>(positions[(n % sequence) * width + d]);
    y[i] = cast<Y>(v);
  }
};

#if MPX_HAS_CUDA
inline constexpr int embedding_columns_per_block = 128;
inline constexpr int embedding_id_tile = 1024;

// Block (v, column tile): thread d sums dy[n, d] over the tokens n with ids[n] == v, in
// token order; the ids pass through shared memory a tile at a time.
template <class I, class DY, class DW>
__global__ void __launch_bounds__(embedding_columns_per_block)
    embedding_backward_kernel(I const* __restrict__ ids, DY const* __restrict__ dy, DW* __restrict__ dw,
                              std::size_t tokens, std::size_t width) {
  __shared__ I tile[embedding_id_tile];
  auto const v = static_cast<I>(blockIdx.x);
  std::size_t const d = static_cast<std::size_t>(blockIdx.y) * embedding_columns_per_block + threadIdx.x;
  float acc = 0.0f;
  for (std::size_t n0 = 0; n0 < tokens; n0 += embedding_id_tile) {
    std::size_t const count = tokens - n0 < embedding_id_tile ? tokens - n0 : embedding_id_tile;
    __syncthreads();  // the previous tile is no longer read
    for (std::size_t k = threadIdx.x; k < count; k += embedding_columns_per_block) tile[k] = ids[n0 + k];
    __syncthreads();
    if (d < width)
      for (std::size_t k = 0; k < count; ++k)
        if (tile[k] == v) acc += cast<float>(dy[(n0 + k) * width + d]);
  }
  if (d < width) dw[static_cast<std::size_t>(v) * width + d] = cast<DW>(acc);
}
#endif

template <class Exec, class I, class W, class P, class Y>
void embedding_forward_impl(Exec const& exec, embedding_gather<I, W, P, Y> const& f,
                            std::size_t tokens) {
  if (tokens * f.width == 0) return;
  check_on_host(exec, [&] { require_ids_in_range("embedding_forward", f.ids, tokens, f.vocab); });
  for_each_index(exec, tokens * f.width, f);
}

}  // namespace detail

//! y[..., d] = table[ids[...], d]: ids int32 of any shape (rank >= 1), table [vocab,
//! width], y of ids' shape + [width]; the row is rounded once to y's dtype. On the host an
//! id outside [0, vocab) throws mpx::invalid_argument naming it, before anything is
//! written; on a cuda_executor its row is written as zeros and, when `invalid` (a device
//! int) is given, 1 is stored there for the caller to check. Asynchronous on a
//! cuda_executor.
template <executor Exec, tensor_like I, tensor_like W, tensor_like Y>
void embedding_forward(Exec const& exec, I&& ids, W&& table, Y&& y, int* invalid = nullptr) {
  auto [iv, wv, yv] = detail::views_for<Exec>(ids, table, y);
  static_assert(std::is_same_v<value_t<I>, std::int32_t>, "mpx::embedding_forward: token ids are int32");
  static_assert(!std::is_const_v<typename decltype(yv)::element_type>, "mpx::embedding_forward: y is an output");
  auto const l = detail::embedding_shapes("embedding_forward", iv.shape(), wv.shape(), yv.shape());
  using w_t = value_t<W>;
  detail::embedding_gather<std::int32_t, w_t, w_t, value_t<Y>> const f{
      iv.data(), wv.data(), nullptr, yv.data(), l.sequence, l.vocab, l.width, invalid};
  detail::embedding_forward_impl(exec, f, l.tokens);
}

//! As above, plus learned position embeddings: y[..., t, d] = table[ids[..., t], d] +
//! positions[t, d], t the position along ids' last axis (the sequence), positions
//! [context, width] with context >= the sequence length. The sum is taken in float and
//! rounded once.
template <executor Exec, tensor_like I, tensor_like W, tensor_like P, tensor_like Y>
void embedding_forward(Exec const& exec, I&& ids, W&& table, P&& positions, Y&& y, int* invalid = nullptr) {
  auto [iv, wv, pv, yv] = detail::views_for<Exec>(ids, table, positions, y);
  static_assert(std::is_same_v<value_t<I>, std::int32_t>, "mpx::embedding_forward: token ids are int32");
  static_assert(!std::is_const_v<typename decltype(yv)::element_type>, "mpx::embedding_forward: y is an output");
  auto const l = detail::embedding_shapes("embedding_forward", iv.shape(), wv.shape(), yv.shape());
  detail::embedding_positions_shape("embedding_forward", pv.shape(), l);
  detail::embedding_gather<std::int32_t, value_t<W>, value_t<P>, value_t<Y>> const f{
      iv.data(), wv.data(), pv.data(), yv.data(), l.sequence, l.vocab, l.width, invalid};
  detail::embedding_forward_impl(exec, f, l.tokens);
}

//! The table's gradient: d_table[v, d] = sum over the tokens n with ids[n] == v of
//! dy[n, d], summed in float in token order and rounded once to d_table's dtype; rows no
//! token names are zero (every element is written). Deterministic, with the same bits
//! on the host and the GPU (see the note at the top of this header). ids as in the
//! forward pass, dy of ids' shape + [width], d_table [vocab, width]. On the host an id
//! out of range throws mpx::invalid_argument; on the GPU it adds to no row (the forward
//! pass flagged it). Asynchronous on a cuda_executor.
template <executor Exec, tensor_like I, tensor_like DY, tensor_like DW>
void embedding_backward([[maybe_unused]] Exec const& exec, I&& ids, DY&& dy, DW&& d_table) {
  auto [iv, dyv, dwv] = detail::views_for<Exec>(ids, dy, d_table);
  static_assert(std::is_same_v<value_t<I>, std::int32_t>, "mpx::embedding_backward: token ids are int32");
  static_assert(!std::is_const_v<typename decltype(dwv)::element_type>,
                "mpx::embedding_backward: d_table is an output");
  constexpr std::string_view op = "embedding_backward";
  auto const l = detail::embedding_shapes(op, iv.shape(), dwv.shape(), dyv.shape());
  if (l.vocab * l.width == 0) return;
  // Two algorithms, one order of additions: the host scatters each token's row into the
  // table (O(tokens x width)); the GPU gives each table element to one thread, which
  // gathers the matching tokens (O(vocab x tokens x width) comparisons, in parallel and
  // without atomics). Either way each sum runs in token order, so the bits agree; one
  // body for both would cost the host the GPU's comparisons.
  if constexpr (is_host_executor_v<Exec>) {
    detail::require_ids_in_range(op, iv.data(), l.tokens, l.vocab);
    float* acc = detail::host_scratch_floats<detail::embedding_scratch, 0>(l.vocab * l.width);
    std::fill(acc, acc + l.vocab * l.width, 0.0f);
    for (std::size_t n = 0; n < l.tokens; ++n) {
      float* row = acc + static_cast<std::size_t>(iv.data()[n]) * l.width;
      auto const* g = dyv.data() + n * l.width;
      for (std::size_t d = 0; d < l.width; ++d) row[d] += cast<float>(g[d]);
    }
    detail::round_span(acc, dwv.data(), l.vocab * l.width);
  } else {
#if MPX_HAS_CUDA
    std::size_t const tiles = (l.width + detail::embedding_columns_per_block - 1) / detail::embedding_columns_per_block;
    if (l.vocab > 0x7FFF'FFFFu || tiles > 65535)
      detail::fail<invalid_argument>(op, "a table of " + std::to_string(l.vocab) + " x " + std::to_string(l.width) +
                                             " is too large for one launch");
    dim3 const grid(static_cast<unsigned>(l.vocab), static_cast<unsigned>(tiles));
    detail::embedding_backward_kernel<<<grid, detail::embedding_columns_per_block, 0, exec.stream()>>>(
        iv.data(), dyv.data(), dwv.data(), l.tokens, l.width);
    MPX_CUDA_CHECK_LAUNCH("mpx::embedding_backward_kernel");
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

//! The position embeddings' gradient: d_positions[t, d] = sum over the sequences of
//! dy[..., t, d] for t below the sequence length L, 0 for the rows t >= L; dy of shape
//! [..., L, width], d_positions [context, width], context >= L. A deterministic column
//! reduction in float (exec/columns.hpp), rounded once. Asynchronous on a
//! cuda_executor.
template <executor Exec, tensor_like DY, tensor_like DP>
void position_embedding_backward(Exec const& exec, DY&& dy, DP&& d_positions) {
  auto [dyv, dpv] = detail::views_for<Exec>(dy, d_positions);
  constexpr std::string_view op = "position_embedding_backward";
  shape const& s = dyv.shape();
  if (s.rank() < 2 || dpv.shape().rank() != 2 || dpv.shape()[1] != s[s.rank() - 1] || dpv.shape()[0] < s[s.rank() - 2])
    detail::fail<shape_error>(op, "d_positions of shape " + dpv.shape().to_string() +
                                      " must be [context, width] for dy of shape " + s.to_string() +
                                      " ([..., sequence, width], context >= sequence)");
  std::int64_t const per_sequence = s[s.rank() - 2] * s[s.rank() - 1];
  std::int64_t const sequences = per_sequence ? static_cast<std::int64_t>(s.size()) / per_sequence : 0;
  using dp_t = value_t<DP>;
  tensor_view<dp_t, space_t<DP>> const used(dpv.data(), shape{per_sequence});
  column_sum(exec, dyv.reshape({sequences, per_sequence}), used);
  std::size_t const rest = dpv.size() - static_cast<std::size_t>(per_sequence);
  if (rest)
    transform(exec, tensor_view<dp_t, space_t<DP>>(dpv.data() + per_sequence, shape{static_cast<std::int64_t>(rest)}),
              ops::fill_with<dp_t>{cast<dp_t>(0.0f)});
}

}  // namespace mpx
