// Lanes: the threads that share one row of work (a warp of 32, or a block of 512 for
// long rows), and the reductions among them. On the GPU a lane is a thread; on the host
// the same lanes are emulated with one array slot each, and every reduction combines the
// slots in the order the GPU's shuffles and shared memory do. So a row body written once
// against these lanes does, on the host, the arithmetic the GPU does (the same partial
// sums in the same order); only the library's exp and log may differ in the last bit.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/math.hpp>

#include <cstddef>
#include <cstring>
#include <type_traits>

namespace mpx::detail {

//! max(a, b) that keeps a NaN from either side: fmaxf drops NaN and returns the other
//! operand, so a row holding a NaN would yield finite, wrong probabilities.
MPX_HD inline float max_keeping_nan(float a, float b) noexcept { return (a > b || a != a) ? a : b; }

//! The combining operations of the reductions below, with their neutral elements.
//! Sums add with mpx::add_rn: a term that is a product (x * x, dy * y) is rounded before
//! it is added, on the GPU too, where nvcc would otherwise fuse it into an FMA, so the
//! host's sums and the GPU's have the same bits.
struct sum_float {
  using value_type = float;
  MPX_HD static float identity() noexcept { return 0.0f; }
  MPX_HD float operator()(float a, float b) const noexcept { return add_rn(a, b); }
};
struct max_float {
  using value_type = float;
  MPX_HD static float identity() noexcept { return -__builtin_huge_valf(); }
  MPX_HD float operator()(float a, float b) const noexcept { return max_keeping_nan(a, b); }
};
struct min_u64 {
  using value_type = unsigned long long;
  MPX_HD static unsigned long long identity() noexcept { return ~0ull; }
  MPX_HD unsigned long long operator()(unsigned long long a, unsigned long long b) const noexcept {
    return a < b ? a : b;
  }
};

//! Two float sums carried together (one pass over a row gives both).
struct float_pair {
  float first, second;
};
struct sum_float_pair {
  using value_type = float_pair;
  MPX_HD static float_pair identity() noexcept { return {0.0f, 0.0f}; }
  MPX_HD float_pair operator()(float_pair a, float_pair b) const noexcept {
    return {add_rn(a.first, b.first), add_rn(a.second, b.second)};
  }
};

inline constexpr int warp_size = 32;

// ---- the host's emulation ---------------------------------------------------------

//! The butterfly a warp's shuffles perform, on 32 slots: at each step slot l becomes
//! op(v[l], v[l ^ offset]). Lane 0's result is returned, and only the 31 combinations
//! it depends on are made (at step `offset`, slots l < offset, whose partner l ^ offset
//! is l + offset), with the operands in the GPU's order.
template <class T, class Op>
MPX_HD T host_warp_all_reduce(T const* lanes, Op op) {
  T v[warp_size];
  for (int l = 0; l < warp_size; ++l) v[l] = lanes[l];
  for (int offset = warp_size / 2; offset > 0; offset >>= 1)
    for (int l = 0; l < offset; ++l) v[l] = op(v[l], v[l + offset]);
  return v[0];
}

//! block_all_reduce's order on Lanes slots (a multiple of 32, at most 1024): each warp's
//! butterfly, then a butterfly over the warps' results padded with the identity.
template <int Lanes, class T, class Op>
MPX_HD T host_block_all_reduce(T const* lanes, Op op) {
  static_assert(Lanes % warp_size == 0 && Lanes <= 1024, "lanes come in whole warps, at most 1024");
  if constexpr (Lanes == warp_size) {
    return host_warp_all_reduce(lanes, op);
  } else {
    T warps[warp_size];
    for (int w = 0; w < warp_size; ++w)
      warps[w] = w < Lanes / warp_size ? host_warp_all_reduce(lanes + w * warp_size, op) : Op::identity();
    return host_warp_all_reduce(warps, op);
  }
}

// ---- the GPU's ----------------------------------------------------------------------

#if MPX_HAS_CUDA
//! A warp shuffle (shuffle(x) for x of one of the types CUDA's shuffles take) applied
//! to any trivially copyable T of whole 32-bit words (a struct of sums), word by word.
template <class T, class Shuffle>
__device__ __forceinline__ T shuffle_words(T v, Shuffle const& shuffle) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, unsigned long long> || std::is_same_v<T, int>) {
    return shuffle(v);
  } else {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) % 4 == 0, "shuffled values are whole 32-bit words");
    unsigned words[sizeof(T) / 4];
    std::memcpy(words, &v, sizeof(T));
    MPX_UNROLL
    for (unsigned& w : words) w = shuffle(w);
    std::memcpy(&v, words, sizeof(T));
    return v;
  }
}
template <class T>
__device__ __forceinline__ T shuffle_xor(T v, int offset) {
  return shuffle_words(v, [offset](auto x) { return __shfl_xor_sync(0xffffffffu, x, offset); });
}

//! The butterfly over the 32 lanes of a warp (all lanes active): lane l combines v[l]
//! and v[l ^ o]. Lane 0's result is the host's; the other lanes combined the same values
//! with the operands swapped, which for a maximum can pick the other sign of a zero or
//! another NaN payload.
template <class T, class Op>
__device__ __forceinline__ T warp_butterfly(T v, Op op) {
  MPX_UNROLL
  for (int offset = warp_size / 2; offset > 0; offset >>= 1) v = op(v, shuffle_xor(v, offset));
  return v;
}

//! Combines v over the 32 lanes of a warp and gives every lane lane 0's result.
template <class T, class Op>
__device__ __forceinline__ T warp_all_reduce(T v, Op op) {
  return shuffle_words(warp_butterfly(v, op), [](auto x) { return __shfl_sync(0xffffffffu, x, 0); });
}

//! 32 elements of T in shared memory, one array per T in a kernel. Raw storage: a T with
//! default member initializers cannot be a __shared__ array.
template <class T>
__device__ __forceinline__ T* warp_results_scratch() {
  __shared__ alignas(T) unsigned char raw[warp_size * sizeof(T)];
  return reinterpret_cast<T*>(raw);
}

//! Combines v over the whole block and returns the result to every thread; every thread
//! must call it, and it may be called again. The block is one-dimensional: blockDim.x a
//! multiple of 32, at most 1024. `identity` is op's neutral element.
template <class T, class Op>
__device__ __forceinline__ T block_all_reduce(T v, Op op, T identity) {
  T* const scratch = warp_results_scratch<T>();
  v = warp_butterfly(v, op);  // lane 0 holds its warp's result
  unsigned const lane = threadIdx.x & 31u;
  unsigned const warp = threadIdx.x >> 5;
  __syncthreads();  // an earlier call may still be reading scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  // Every warp reduces the same values in the same order: no second broadcast needed.
  v = lane < (blockDim.x >> 5) ? scratch[lane] : identity;
  return warp_all_reduce(v, op);
}
template <class T, class Op>
__device__ __forceinline__ T block_all_reduce(T v, Op op) {
  return block_all_reduce(v, op, Op::identity());
}
#endif

// ---- lanes for row bodies -------------------------------------------------------------
//
// A row body is an MPX_HD callable `body(lanes, row)`. It reaches the row's columns only
// through its lanes:
//   lanes.reduce(n, op, f)  op over f(c) for c in [0, n): lane l folds c = l, l + L, ...
//                           in order, then the lanes are combined (warp or block order);
//                           every lane gets the result.
//   lanes.for_each(n, f)    f(c) for c in [0, n), lane l taking c = l, l + L, ...
//   lanes.once(f)           f() by one lane (a per-row output such as a mean).
// A lane only ever touches its own columns, so a body may write in place what it read.

//! How many lanes a row of `cols` columns gets: a warp up to 1024 columns (32 per lane),
//! a block of 512 beyond. The host asks the same, so it emulates the same lanes.
inline constexpr int block_row_lanes = 512;
inline constexpr std::size_t warp_row_max_cols = 1024;
//! The GPU's lanes count columns in 32 bits (cheaper than 64): the last step of a block's
//! lanes must stay below 2^31, so a row has at most this many columns.
inline constexpr std::size_t max_row_cols = 0x7FFF'FFFFu - 1024;
constexpr int lanes_for_row(std::size_t cols) noexcept {
  return cols <= warp_row_max_cols ? warp_size : block_row_lanes;
}

//! Lanes emulated on the host: slot l holds what lane l would.
template <int Lanes>
struct host_lanes {
  static constexpr int count = Lanes;
  // MPX_HD only so that a body's MPX_HD operator() may call it; it runs on the host.
  template <class Op, class F>
  MPX_HD typename Op::value_type reduce(std::size_t n, Op op, F&& f) const {
    using T = typename Op::value_type;
    T slot[Lanes];
    for (int l = 0; l < Lanes; ++l) slot[l] = Op::identity();
    // Whole rounds of Lanes columns first, each in two loops: the round's terms, which
    // the compiler can compute with vector instructions (f is where the work is: casts,
    // exponentials), then each slot folds its term in, as its lane does. The terms pass
    // through memory the compiler cannot see through, so each is rounded to T before it
    // is combined: no product in f is fused with the combining add (the GPU's order and
    // bits; add_rn alone would keep the loop scalar).
    T term[Lanes];
    std::size_t c = 0;
    for (; c + Lanes <= n; c += Lanes) {
      for (int l = 0; l < Lanes; ++l) term[l] = f(c + static_cast<std::size_t>(l));
      opaque(term);
      for (int l = 0; l < Lanes; ++l) slot[l] = op(slot[l], term[l]);
    }
    int const tail = static_cast<int>(n - c);  // the last, partial round
    for (int l = 0; l < tail; ++l) term[l] = f(c + static_cast<std::size_t>(l));
    opaque(term);
    for (int l = 0; l < tail; ++l) slot[l] = op(slot[l], term[l]);
    return host_block_all_reduce<Lanes>(slot, op);
  }
  template <class F>
  MPX_HD void for_each(std::size_t n, F&& f) const {
    for (std::size_t c = 0; c < n; ++c) f(c);
  }
  template <class F>
  MPX_HD void once(F&& f) const {
    f();
  }

 private:
  //! The compiler must assume `terms` was read and changed here: each term is stored,
  //! rounded, before it is combined.
  template <class T>
  MPX_HD static void opaque([[maybe_unused]] T* terms) {
#if !MPX_DEVICE_PASS && defined(__GNUC__)
    __asm__ volatile("" : : "r"(terms) : "memory");
#endif
  }
};

#if MPX_HAS_CUDA
//! A warp's lanes (warp_size threads sharing a row), or a whole block's (Lanes = its size).
template <int Lanes>
struct device_lanes {
  static constexpr int count = Lanes;
  int lane;  // this thread's lane in the row
  template <class Op, class F>
  __device__ typename Op::value_type reduce(std::size_t n, Op op, F&& f) const {
    using T = typename Op::value_type;
    T v = Op::identity();
    for (unsigned c = static_cast<unsigned>(lane); c < n; c += Lanes) v = op(v, f(c));
    if constexpr (Lanes == warp_size) {
      return warp_all_reduce(v, op);
    } else {
      return block_all_reduce(v, op);
    }
  }
  template <class F>
  __device__ void for_each(std::size_t n, F&& f) const {
    for (unsigned c = static_cast<unsigned>(lane); c < n; c += Lanes) f(c);
  }
  template <class F>
  __device__ void once(F&& f) const {
    if (lane == 0) f();
  }
};
#endif

}  // namespace mpx::detail
