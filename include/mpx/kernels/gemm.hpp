// mpx::gemm: C = alpha * op(A) op(B) + beta * C on row-major tensors, one matrix or a
// strided batch, with A and B read in the policy's compute type and summed in its
// accumulate type. On a cuda_executor it is one cuBLASLt call (tensor cores for 16-bit
// operands, float accumulation); on the host oneDNN's matmul where the build found it
// (MPX_HAS_ONEDNN: float, and bfloat16 on the CPU's bfloat16 instructions), else a BLAS
// sgemm on float panels (MPX_HAS_CBLAS), else a blocked product of its own.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/convert_span.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/host_vector.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/host_scratch.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/cublaslt.hpp>
#include <mpx/kernels/gemm_problem.hpp>
#include <mpx/kernels/elementwise.hpp>
#if defined(MPX_HAS_ONEDNN) && MPX_HAS_ONEDNN
#include <mpx/kernels/onednn_gemm.hpp>
#endif

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

// MPX_HAS_CBLAS comes from the build (Meson sets it on mpx_dep where it found OpenBLAS),
// not from a header, so a project without a BLAS gets the blocked product.

namespace mpx {

//! How mpx::gemm combines its operands: C = alpha * op(A) op(B) + beta * C.
struct gemm_options {
  bool transpose_a = false;  //!< A is given as [K, M] (or [batch, K, M]) and its transpose is used.
  bool transpose_b = false;  //!< B is given as [N, K] (or [batch, N, K]), as a dense layer's weight often is.
  float alpha = 1.0f;        //!< Scales the product. With alpha == 0, A and B are not read.
  float beta = 0.0f;         //!< Scales the old C. With beta == 0, C is not read (NaN there is overwritten).
};

//! Opt-in for a policy that accumulates matrix products in half (CUBLAS_COMPUTE_16F on
//! the GPU, each partial sum rounded to half on the host). Sums in half lose every term
//! below 2^-11 of the running total and overflow at 65504, so mpx::gemm refuses such a
//! policy unless it is declared deliberate:
//! `template <> inline constexpr bool mpx::enable_half_accumulation<my_policy> = true;`
template <class Policy>
inline constexpr bool enable_half_accumulation = false;

//! Whether mpx::gemm on the host runs on a library (oneDNN or a BLAS the build found)
//! rather than mpx's own blocked product; gemm_host_library names it.
#if defined(MPX_HAS_ONEDNN) && MPX_HAS_ONEDNN
inline constexpr bool gemm_host_uses_blas = true;
inline constexpr char const* gemm_host_library = "oneDNN";
#elif defined(MPX_HAS_CBLAS) && MPX_HAS_CBLAS && defined(__GNUC__)
inline constexpr bool gemm_host_uses_blas = true;
inline constexpr char const* gemm_host_library = "OpenBLAS";
#else
inline constexpr bool gemm_host_uses_blas = false;
inline constexpr char const* gemm_host_library = "mpx's blocked product";
#endif

namespace detail {

//! The compile-time checks of mpx::gemm, each with the message a user needs.
template <class Policy, class TA, class TB, class TC>
constexpr void check_gemm_types() {
  static_assert(policy_type<Policy>,
                "mpx::gemm<Policy>: the first template argument must be a policy, as in "
                "mpx::gemm<mpx::mixed_float16>(exec, a, b, c)");
  if constexpr (policy_type<Policy>) {
    using S = typename Policy::storage_type;
    using Acc = typename Policy::accumulate_type;
    static_assert(std::is_same_v<TA, S> && std::is_same_v<TB, S>,
                  "mpx::gemm: A and B must hold the policy's storage_type (half for mpx::mixed_float16, bfloat16 "
                  "for mpx::mixed_bfloat16, float for mpx::float32); convert them with mpx::cast first");
    static_assert(std::is_same_v<TC, S> || std::is_same_v<TC, float>,
                  "mpx::gemm: C must hold the policy's storage_type or float");
    static_assert(!std::is_same_v<Acc, bfloat16>,
                  "mpx::gemm: this policy accumulates in bfloat16, which keeps 8 significant bits: a sum of a "
                  "few hundred products loses its small terms, and no GPU library offers it. Use a policy whose "
                  "accumulate_type is float, such as mpx::mixed_bfloat16");
    static_assert(!std::is_same_v<Acc, half> || enable_half_accumulation<Policy>,
                  "mpx::gemm: this policy accumulates matrix products in half (accumulate_type = float16): sums "
                  "lose every term below 2^-11 of the running total and overflow at 65504. Use a policy whose "
                  "accumulate_type is float, such as mpx::mixed_float16 (half operands, float sums on tensor "
                  "cores); if half sums are what you want, declare `template <> inline constexpr bool "
                  "mpx::enable_half_accumulation<YourPolicy> = true;`");
    static_assert(!std::is_same_v<Acc, half> || (std::is_same_v<S, half> && std::is_same_v<TC, half>),
                  "mpx::gemm: accumulation in half needs half operands and a half C (cuBLAS computes in half "
                  "only on half data)");
    static_assert(!dtype8<typename Policy::compute_type>,
                  "mpx::gemm: this policy computes its matrix products in fp8, which needs a per-tensor scale for "
                  "every operand. mpx::dense and mpx::conv2d keep those scales and run fp8 products "
                  "(mpx::fp8_gemm underneath), as do mpx::causal_self_attention's projections; give other layers "
                  "(LSTM) mpx::without_fp8<Policy>, and "
                  "call mpx::fp8_gemm yourself for products of your own");
    static_assert(!std::is_same_v<Acc, half> || std::is_same_v<typename Policy::compute_type, half>,
                  "mpx::gemm: accumulation in half needs half compute");
  }
}

//! Whether reading a T operand in Compute changes its value: not when they are one
//! type, and not when Compute is float (every dtype widens to float exactly, so a
//! 16-bit operand "computed in float" is what tensor cores with float sums already do).
template <class T, class Compute>
inline constexpr bool rounds_operand = !std::is_same_v<T, Compute> && !std::is_same_v<Compute, float>;

//! The sizes of one product: C[b] = op(A[b]) op(B[b]), op(A) M x K, op(B) K x N. A
//! stride (elements between batch entries) of 0 means the operand is shared by all.
struct gemm_dims {
  std::int64_t batch = 1, m = 0, n = 0, k = 0;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;
};

[[noreturn]] inline void gemm_shape_failure(shape const& a, shape const& b, shape const& c, gemm_options const& o,
                                            std::string const& why, mpx::source_location loc) {
  fail<shape_error>("gemm", "shapes do not agree: A " + a.to_string() + (o.transpose_a ? " transposed" : "") +
                                ", B " + b.to_string() + (o.transpose_b ? " transposed" : "") + ", C " +
                                c.to_string() + ": " + why,
                    loc);
}

//! Checks the shapes of A, B and C against each other and the transposes; throws
//! mpx::shape_error naming all three.
inline gemm_dims gemm_shapes(shape const& a, shape const& b, shape const& c, gemm_options const& o,
                             mpx::source_location loc = mpx::source_location::current()) {
  auto const rank_ok = [](shape const& s) { return s.rank() == 2 || s.rank() == 3; };
  if (!rank_ok(a) || !rank_ok(b) || !rank_ok(c))
    gemm_shape_failure(a, b, c, o, "each must be a matrix [rows, cols] or a batch of them [batch, rows, cols]", loc);
  bool const batched = a.rank() == 3 || b.rank() == 3;
  if (batched != (c.rank() == 3))
    gemm_shape_failure(a, b, c, o,
                       batched ? "C must be a batch [batch, M, N] when A or B is one"
                               : "C is a batch but neither A nor B is one",
                       loc);
  gemm_dims d;
  if (batched) {
    d.batch = c[0];
    if ((a.rank() == 3 && a[0] != d.batch) || (b.rank() == 3 && b[0] != d.batch))
      gemm_shape_failure(a, b, c, o, "the batch extents differ", loc);
  }
  std::size_t const ra = a.rank() - 2, rb = b.rank() - 2, rc = c.rank() - 2;
  d.m = o.transpose_a ? a[ra + 1] : a[ra];
  std::int64_t const ka = o.transpose_a ? a[ra] : a[ra + 1];
  std::int64_t const kb = o.transpose_b ? b[rb + 1] : b[rb];
  d.n = o.transpose_b ? b[rb] : b[rb + 1];
  if (ka != kb)
    gemm_shape_failure(a, b, c, o,
                       "the inner extents differ (" + std::to_string(ka) + " in A, " + std::to_string(kb) + " in B)",
                       loc);
  d.k = ka;
  if (c[rc] != d.m || c[rc + 1] != d.n)
    gemm_shape_failure(a, b, c, o,
                       "C must be " + std::to_string(d.m) + " x " + std::to_string(d.n) + " (M x N) per product", loc);
  d.stride_a = a.rank() == 3 ? d.m * d.k : 0;
  d.stride_b = b.rank() == 3 ? d.k * d.n : 0;
  d.stride_c = d.m * d.n;
  return d;
}

//! A batch whose B is shared and whose A is not transposed is one tall product:
//! [batch * M, K] x [K, N] (conv-as-gemm, a dense layer over a sequence).
//! Left as a batch where the tall M would pass cuBLASLt's 2^31 - 1 limit.
inline gemm_dims fold_batch(gemm_dims d, bool transpose_a) {
  if (d.batch > 1 && d.stride_b == 0 && d.stride_a != 0 && !transpose_a && d.m * d.batch <= 0x7FFF'FFFF) {
    d.m *= d.batch;
    d.batch = 1;
    d.stride_a = d.m * d.k;
    d.stride_c = d.m * d.n;
  }
  return d;
}

// ---- host -----------------------------------------------------------------------------

//! The host products' scratch (host_scratch_floats). The BLAS path and the blocked path
//! never run at once in a thread, so their buffers share slots: the BLAS path's widened
//! A and B and float C; the blocked path's float product and packed panels.
struct gemm_scratch {};
enum gemm_scratch_slot : std::size_t {
  gemm_a_floats = 0,
  gemm_b_floats = 1,
  gemm_c_floats = 2,
  gemm_product = 0,
  gemm_b_panels = 1,
  gemm_a_panel = 2,
};

//! T -> float, exact (mpx::cast<float>'s fast path; the BLAS path widens every operand).
template <class T>
float widen_to_float_fast(T x) noexcept {
  if constexpr (std::is_same_v<T, float>) return x;
  else return widen_to_float(x);
}

//! out = alpha * product + beta * out, rounded once to TC (out is not read when beta == 0).
//! The float product is scratch and is overwritten; the 16-bit reads and writes go
//! through the whole-array conversions in chunks that stay in L1.
template <class TC>
void host_gemm_epilogue(std::size_t n, float alpha, float* product, float beta, TC* out) {
  if constexpr (std::is_same_v<TC, float>) {
    if (beta == 0.0f) {
      for (std::size_t i = 0; i < n; ++i) out[i] = alpha * product[i];
    } else {
      for (std::size_t i = 0; i < n; ++i) out[i] = alpha * product[i] + beta * out[i];
    }
  } else {
    constexpr std::size_t chunk = 2048;
    float widened_out[chunk];
    for (std::size_t i0 = 0; i0 < n; i0 += chunk) {
      std::size_t const len = std::min(chunk, n - i0);
      float* p = product + i0;
      if (beta == 0.0f) {
        for (std::size_t i = 0; i < len; ++i) p[i] *= alpha;
      } else {
        widen_span(out + i0, widened_out, len);
        for (std::size_t i = 0; i < len; ++i) p[i] = alpha * p[i] + beta * widened_out[i];
      }
      round_span(p, out + i0, len);
    }
  }
}

// The blocked product (float sums): op(A) in MR-row panels and op(B) in NR-column
// panels, both widened to float and packed so the micro-kernel streams through them;
// KC-deep slices keep a panel pair in L1. Partial sums of each slice go to a float
// M x N buffer. The 4 x 8 micro-kernel is written in GCC/Clang vector types (SSE, the
// x86-64 baseline: about 20 GFLOP/s per core), plain loops for other compilers.
inline constexpr std::int64_t gemm_mr = 4;
inline constexpr std::int64_t gemm_nr = 8;
inline constexpr std::int64_t gemm_kc = 256;

//! Element (i, j) of op(X) is p[i * rs + j * cs].
template <class T>
struct strided_matrix {
  T const* p;
  std::int64_t rs, cs;
  [[nodiscard]] float at(std::int64_t i, std::int64_t j) const { return widen_to_float_fast(p[i * rs + j * cs]); }
};

//! acc[rows x cols] (+)= the MR x NR tile of ap (kc x MR) times bp (kc x NR).
inline void gemm_micro_kernel(std::int64_t kc, float const* __restrict ap, float const* __restrict bp,
                              float* __restrict acc, std::int64_t ld, std::int64_t rows, std::int64_t cols,
                              bool first) {
  float c[gemm_mr][gemm_nr];
#if defined(__GNUC__)
  // Eight accumulators named one by one: GCC at -O2 keeps an array indexed in a loop in
  // memory, and the kernel would load and store every partial sum at every step.
  static_assert(gemm_mr == 4 && gemm_nr == 8, "the vector micro-kernel is written out for a 4 x 8 tile");
  float4_vector c0l = {}, c0h = {}, c1l = {}, c1h = {}, c2l = {}, c2h = {}, c3l = {}, c3h = {};
  for (std::int64_t k = 0; k < kc; ++k) {
    float4_vector bl, bh;
    __builtin_memcpy(&bl, bp + k * gemm_nr, sizeof(bl));
    __builtin_memcpy(&bh, bp + k * gemm_nr + 4, sizeof(bh));
    float const* a = ap + k * gemm_mr;
    c0l += a[0] * bl;
    c0h += a[0] * bh;
    c1l += a[1] * bl;
    c1h += a[1] * bh;
    c2l += a[2] * bl;
    c2h += a[2] * bh;
    c3l += a[3] * bl;
    c3h += a[3] * bh;
  }
  float4_vector const* const parts[gemm_mr][2] = {{&c0l, &c0h}, {&c1l, &c1h}, {&c2l, &c2h}, {&c3l, &c3h}};
  for (std::int64_t r = 0; r < gemm_mr; ++r) {
    __builtin_memcpy(c[r], parts[r][0], sizeof(float4_vector));
    __builtin_memcpy(c[r] + 4, parts[r][1], sizeof(float4_vector));
  }
#else
  for (auto& row : c)
    for (float& x : row) x = 0.0f;
  for (std::int64_t k = 0; k < kc; ++k)
    for (std::int64_t r = 0; r < gemm_mr; ++r)
      for (std::int64_t j = 0; j < gemm_nr; ++j) c[r][j] += ap[k * gemm_mr + r] * bp[k * gemm_nr + j];
#endif
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < cols; ++j) acc[r * ld + j] = first ? c[r][j] : acc[r * ld + j] + c[r][j];
}

//! acc (M x N, float) = op(A) op(B) for one product.
template <class TA, class TB>
void host_blocked_product(std::int64_t m, std::int64_t n, std::int64_t k, strided_matrix<TA> a,
                          strided_matrix<TB> b, float* acc) {
  std::int64_t const n_panels = (n + gemm_nr - 1) / gemm_nr;
  auto const b_panels_size = static_cast<std::size_t>(n_panels * gemm_nr * std::min(k, gemm_kc));
  float* bp = host_scratch_floats<gemm_scratch, gemm_b_panels>(b_panels_size);
  float* ap = host_scratch_floats<gemm_scratch, gemm_a_panel>(static_cast<std::size_t>(gemm_mr * gemm_kc));
  for (std::int64_t k0 = 0; k0 < k; k0 += gemm_kc) {
    std::int64_t const kc = std::min(gemm_kc, k - k0);
    // op(B)[k0:k0+kc, :] in panels of NR columns, zero beyond N.
    for (std::int64_t p = 0; p < n_panels; ++p) {
      float* dst = bp + p * gemm_nr * kc;
      for (std::int64_t kk = 0; kk < kc; ++kk)
        for (std::int64_t j = 0; j < gemm_nr; ++j) {
          std::int64_t const col = p * gemm_nr + j;
          dst[kk * gemm_nr + j] = col < n ? b.at(k0 + kk, col) : 0.0f;
        }
    }
    for (std::int64_t i0 = 0; i0 < m; i0 += gemm_mr) {
      std::int64_t const rows = std::min(gemm_mr, m - i0);
      for (std::int64_t kk = 0; kk < kc; ++kk)
        for (std::int64_t r = 0; r < gemm_mr; ++r) ap[kk * gemm_mr + r] = r < rows ? a.at(i0 + r, k0 + kk) : 0.0f;
      for (std::int64_t p = 0; p < n_panels; ++p) {
        std::int64_t const j0 = p * gemm_nr;
        gemm_micro_kernel(kc, ap, bp + p * gemm_nr * kc, acc + i0 * n + j0, n, rows, std::min(gemm_nr, n - j0),
                          k0 == 0);
      }
    }
  }
}

//! The deliberate half accumulation (enable_half_accumulation): every partial sum is
//! rounded to half, as a half accumulator would hold it. Slow; a reference, not a path
//! for training.
template <class Acc, class TA, class TB>
void host_rounded_product(std::int64_t m, std::int64_t n, std::int64_t k, strided_matrix<TA> a,
                          strided_matrix<TB> b, float* out) {
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      Acc sum = mpx::cast<Acc>(0.0f);
      for (std::int64_t kk = 0; kk < k; ++kk)  // exact in double, then one rounding to Acc
        sum = mpx::cast<Acc>(mpx::cast<double>(sum) +
                             static_cast<double>(a.at(i, kk)) * static_cast<double>(b.at(kk, j)));
      out[i * n + j] = mpx::cast<float>(sum);
    }
}

#if defined(MPX_HAS_CBLAS) && MPX_HAS_CBLAS && defined(__GNUC__)
// cblas_sgemm, declared under a name of mpx's own and bound to the library's symbol
// rather than through <cblas.h>: OpenBLAS's header puts `bfloat16` (an integer type),
// `blasint` and hundreds of other names in the global namespace, where `bfloat16`
// collides with a user's `using mpx::bfloat16;`. The enums are CBLAS's standard values.
void cblas_sgemm_symbol(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, float const* a,
                        int lda, float const* b, int ldb, float beta, float* c, int ldc) __asm__("cblas_sgemm");
inline constexpr int cblas_row_major = 101, cblas_no_trans = 111, cblas_trans = 112;

inline bool fits_blas_int(gemm_dims const& d) {
  return d.m <= INT_MAX && d.n <= INT_MAX && d.k <= INT_MAX;
}

//! One sgemm per batch entry on float (or float-widened) operands.
template <class TA, class TB, class TC>
void host_blas_gemm(gemm_dims const& d, bool ta, bool tb, float alpha, TA const* a, TB const* b, float beta, TC* c) {
  auto const size_of = [&](std::int64_t stride, std::int64_t one) {
    return static_cast<std::size_t>(stride ? stride * d.batch : one);
  };
  float const* af = host_floats_of<gemm_scratch, gemm_a_floats>(a, size_of(d.stride_a, d.m * d.k));
  float const* bf = host_floats_of<gemm_scratch, gemm_b_floats>(b, size_of(d.stride_b, d.k * d.n));
  constexpr bool c_is_float = std::is_same_v<TC, float>;
  float* cf = nullptr;
  if constexpr (c_is_float) cf = c;
  else cf = host_scratch_floats<gemm_scratch, gemm_c_floats>(static_cast<std::size_t>(d.stride_c * d.batch));
  auto const m = static_cast<int>(d.m), n = static_cast<int>(d.n), k = static_cast<int>(d.k);
  for (std::int64_t i = 0; i < d.batch; ++i) {
    // Row-major: lda is the stored row length of A ([M, K], or [K, M] transposed).
    cblas_sgemm_symbol(cblas_row_major, ta ? cblas_trans : cblas_no_trans, tb ? cblas_trans : cblas_no_trans, m, n,
                       k, c_is_float ? alpha : 1.0f, af + i * d.stride_a, ta ? m : k, bf + i * d.stride_b, tb ? k : n,
                       c_is_float ? beta : 0.0f, cf + i * d.stride_c, n);
  }
  if constexpr (!c_is_float) host_gemm_epilogue(static_cast<std::size_t>(d.stride_c * d.batch), alpha, cf, beta, c);
}
#endif

#if defined(MPX_HAS_ONEDNN) && MPX_HAS_ONEDNN
//! The product through oneDNN (kernels/onednn_gemm.hpp): float and bfloat16 operands as
//! they are, others widened to float. oneDNN writes C itself when C is float (or
//! bfloat16 beside bfloat16 operands) and alpha is 1; otherwise it writes a float product
//! that the epilogue scales and rounds, as on the BLAS path. False when oneDNN declines.
template <class TA, class TB, class TC>
bool host_onednn_gemm(gemm_dims const& d, bool ta, bool tb, float alpha, TA const* a, TB const* b, float beta,
                      TC* c) {
  auto const run = [&](auto const* ap, auto const* bp) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(ap)>>;
    constexpr bool writes_c =
        std::is_same_v<TC, float> || (std::is_same_v<TC, bfloat16> && std::is_same_v<T, bfloat16>);
    if constexpr (writes_c) {
      if (alpha == 1.0f)
        return onednn_product(d.batch, d.m, d.n, d.k, d.stride_a, d.stride_b, d.stride_c, ta, tb, ap, bp, beta, c);
    }
    std::size_t const size = static_cast<std::size_t>(d.stride_c * d.batch);
    float* product = host_scratch_floats<gemm_scratch, gemm_c_floats>(size);
    if (!onednn_product(d.batch, d.m, d.n, d.k, d.stride_a, d.stride_b, d.stride_c, ta, tb, ap, bp, 0.0f, product))
      return false;
    host_gemm_epilogue(size, alpha, product, beta, c);
    return true;
  };
  if constexpr (std::is_same_v<TA, TB> && onednn_operand<TA>) {
    return run(a, b);
  } else {
    auto const size_of = [&](std::int64_t stride, std::int64_t one) {
      return static_cast<std::size_t>(stride ? stride * d.batch : one);
    };
    return run(host_floats_of<gemm_scratch, gemm_a_floats>(a, size_of(d.stride_a, d.m * d.k)),
               host_floats_of<gemm_scratch, gemm_b_floats>(b, size_of(d.stride_b, d.k * d.n)));
  }
}
#endif

//! x[0, n) read in Compute, as floats: widened, rounded to Compute and widened again (in
//! chunks through a stack buffer), into the (Tag, Slot) scratch.
template <class Compute, class Tag, std::size_t Slot, class T>
float const* host_floats_through(T const* x, std::size_t n) {
  float* out = host_scratch_floats<Tag, Slot>(n);
  widen_span(x, out, n);
  constexpr std::size_t chunk = 2048;
  Compute rounded[chunk];
  for (std::size_t i0 = 0; i0 < n; i0 += chunk) {
    std::size_t const len = std::min(chunk, n - i0);
    round_span(out + i0, rounded, len);
    widen_span(rounded, out + i0, len);
  }
  return out;
}

struct gemm_compute_scratch {};

template <class Acc, class TA, class TB, class TC>
void host_gemm(gemm_dims d, bool ta, bool tb, float alpha, TA const* a, TB const* b, float beta, TC* c);

//! host_gemm with A and B read in Compute: operands Compute would round are rounded
//! into float copies first, so the products are those of the Compute values.
template <class Acc, class Compute, class TA, class TB, class TC>
void host_gemm_in(gemm_dims const& d, bool ta, bool tb, float alpha, TA const* a, TB const* b, float beta, TC* c) {
  auto const extent = [&](std::int64_t stride, std::int64_t one) {
    return static_cast<std::size_t>(stride ? stride * d.batch : one);
  };
  if constexpr (rounds_operand<TA, Compute> || rounds_operand<TB, Compute>) {
    float const* ac = host_floats_through<Compute, gemm_compute_scratch, 0>(a, extent(d.stride_a, d.m * d.k));
    float const* bc = host_floats_through<Compute, gemm_compute_scratch, 1>(b, extent(d.stride_b, d.k * d.n));
    host_gemm<Acc>(d, ta, tb, alpha, ac, bc, beta, c);
  } else {
    host_gemm<Acc>(d, ta, tb, alpha, a, b, beta, c);
  }
}

template <class Acc, class TA, class TB, class TC>
void host_gemm(gemm_dims d, bool ta, bool tb, float alpha, TA const* a, TB const* b, float beta, TC* c) {
  d = fold_batch(d, ta);
#if defined(MPX_HAS_ONEDNN) && MPX_HAS_ONEDNN
  if constexpr (std::is_same_v<Acc, float>) {
    if (host_onednn_gemm(d, ta, tb, alpha, a, b, beta, c)) return;
  }
#endif
#if defined(MPX_HAS_CBLAS) && MPX_HAS_CBLAS && defined(__GNUC__)
  if constexpr (std::is_same_v<Acc, float>) {
    if (fits_blas_int(d)) return host_blas_gemm(d, ta, tb, alpha, a, b, beta, c);
  }
#endif
  float* acc = host_scratch_floats<gemm_scratch, gemm_product>(static_cast<std::size_t>(d.stride_c));
  for (std::int64_t i = 0; i < d.batch; ++i) {
    strided_matrix<TA> const am{a + i * d.stride_a, ta ? 1 : d.k, ta ? d.m : 1};
    strided_matrix<TB> const bm{b + i * d.stride_b, tb ? 1 : d.n, tb ? d.k : 1};
    if constexpr (std::is_same_v<Acc, float>) host_blocked_product(d.m, d.n, d.k, am, bm, acc);
    else host_rounded_product<Acc>(d.m, d.n, d.k, am, bm, acc);
    host_gemm_epilogue(static_cast<std::size_t>(d.stride_c), alpha, acc, beta, c + i * d.stride_c);
  }
}

// ---- CUDA -----------------------------------------------------------------------------

//! One stored matrix as cuBLASLt sees it: column-major `rows` x `cols` with leading
//! dimension `ld`, batch entries `batch_stride` elements apart (0: one matrix shared by
//! every product), read transposed or not.
struct column_major_matrix {
  std::int64_t rows = 0, cols = 0, ld = 0, batch_stride = 0;
  bool transposed = false;
};

//! A product in cuBLASLt's column-major terms, D = op(first) op(second) per batch entry.
//! cuBLASLt is column-major, and a row-major X [r, c] is a column-major Xᵀ [c, r] with
//! ld = c. So row-major C = op(A) op(B) is computed as column-major
//! Cᵀ (N x M) = op(B)ᵀ (N x K) op(A)ᵀ (K x M): cuBLASLt's first operand is our B, its
//! second our A, each with our transpose flag, its layout the stored matrix read as
//! column-major (rows = the stored row length). Plain integers, so the host suite can
//! check the translation (tests/kernels/test_gemm.cpp) that only a GPU runs.
struct column_major_product {
  column_major_matrix first;   //!< our B
  column_major_matrix second;  //!< our A
  column_major_matrix c;       //!< our C: N x M, never transposed
  std::int64_t batch = 1;
};

//! The terms of the (already folded: fold_batch) row-major product d.
inline column_major_product column_major_terms(gemm_dims const& d, bool ta, bool tb) {
  bool const batched = d.batch > 1;
  column_major_product t;
  t.first = {tb ? d.k : d.n, tb ? d.n : d.k, tb ? d.k : d.n, batched ? d.stride_b : 0, tb};  // B [K, N] or [N, K]
  t.second = {ta ? d.m : d.k, ta ? d.k : d.m, ta ? d.m : d.k, batched ? d.stride_a : 0, ta};  // A [M, K] or [K, M]
  t.c = {d.n, d.m, d.n, batched ? d.stride_c : 0, false};
  t.batch = d.batch;
  return t;
}

//! The alignment cuBLASLt may assume for a matrix at p whose batch entries are
//! stride_bytes apart: the largest power of two dividing both, at most 256.
inline std::uint32_t gemm_alignment(void const* p, std::int64_t stride_bytes) {
  std::uint64_t const v = reinterpret_cast<std::uintptr_t>(p) | static_cast<std::uint64_t>(stride_bytes) | 256u;
  return static_cast<std::uint32_t>(v & (~v + 1));
}

// From the dtype's traits: a type without them (not in mpx::dtype_list) does not compile,
// unless specialised (NVFP4's packed e2m1 pairs, in fp8_block_gemm.hpp).
template <class T>
inline constexpr cudaDataType_t cuda_data_type = dtype_traits<T>::cuda_data_type;

//! The cuBLASLt problem of the row-major product d on `device`, A, B and C at a, b, c:
//! cuBLASLt's first operand is our B, its second our A (column_major_terms); `scales` in
//! its terms too. Refuses extents past cuBLASLt's 2^31 - 1.
template <class Acc, class TA, class TB, class TC>
lt_problem lt_problem_of(int device, gemm_dims d, bool ta, bool tb, TA const* a, TB const* b, TC const* c,
                         lt_operand_scales const& scales = {}) {
  d = fold_batch(d, ta);
  if (d.m > INT_MAX || d.n > INT_MAX || d.k > INT_MAX || d.batch > INT_MAX)
    fail<invalid_argument>("gemm", "cuBLASLt takes extents up to 2^31 - 1; got M = " + std::to_string(d.m) +
                                       ", N = " + std::to_string(d.n) + ", K = " + std::to_string(d.k) +
                                       ", batch = " + std::to_string(d.batch));
  column_major_product const t = column_major_terms(d, ta, tb);
  lt_problem p;
  p.device = device;
  p.a_type = cuda_data_type<TB>;
  p.b_type = cuda_data_type<TA>;
  p.c_type = cuda_data_type<TC>;
  p.half_sums = std::is_same_v<Acc, half>;
  p.transpose_a = t.first.transposed;
  p.transpose_b = t.second.transposed;
  p.a_rows = static_cast<std::uint64_t>(t.first.rows);
  p.a_cols = static_cast<std::uint64_t>(t.first.cols);
  p.lda = t.first.ld;
  p.b_rows = static_cast<std::uint64_t>(t.second.rows);
  p.b_cols = static_cast<std::uint64_t>(t.second.cols);
  p.ldb = t.second.ld;
  p.c_rows = static_cast<std::uint64_t>(t.c.rows);
  p.c_cols = static_cast<std::uint64_t>(t.c.cols);
  p.ldc = t.c.ld;
  p.batch = static_cast<std::int32_t>(t.batch);
  p.stride_a = t.first.batch_stride;
  p.stride_b = t.second.batch_stride;
  p.stride_c = t.c.batch_stride;
  p.align_a = gemm_alignment(b, p.stride_a * static_cast<std::int64_t>(sizeof(TB)));
  p.align_b = gemm_alignment(a, p.stride_b * static_cast<std::int64_t>(sizeof(TA)));
  p.align_c = gemm_alignment(c, p.stride_c * static_cast<std::int64_t>(sizeof(TC)));
  p.a_scaling = scales.a_scaling;
  p.b_scaling = scales.b_scaling;
  p.alpha_beta_on_device = scales.device_alpha_beta != nullptr;
  p.a_scaled = scales.a != nullptr;
  p.b_scaled = scales.b != nullptr;
  return p;
}

//! A product read in Compute by a library that takes only Compute operands (cuBLASLt):
//! operands Compute would round are cast into temporaries on the executor first, and
//! `product(a, b, c)` runs on them. The library takes a C of Compute or float; any other
//! C gets a float temporary (holding C when beta reads it), converted back once at the
//! end. Plain C++, so the host suite runs it with a product of its own.
template <class Compute, class Exec, class TA, class TB, class TC, class Product>
void with_compute_operands(Exec const& exec, shape const& sa, shape const& sb, shape const& sc, TA const* a,
                           TB const* b, float beta, TC* c, Product&& product) {
  using Space = memory_space_t<Exec>;
  if constexpr (!rounds_operand<TA, Compute> && !rounds_operand<TB, Compute>) {
    product(a, b, c);
  } else {
    tensor<Compute, Space> ac(exec, sa), bc(exec, sb);
    mpx::cast(exec, tensor_view<TA const, Space>(a, sa), ac);
    mpx::cast(exec, tensor_view<TB const, Space>(b, sb), bc);
    if constexpr (std::is_same_v<TC, float> || std::is_same_v<TC, Compute>) {
      product(ac.data(), bc.data(), c);
    } else {
      tensor<float, Space> cf(exec, sc);
      tensor_view<TC, Space> const cv(c, sc);
      if (beta != 0.0f) mpx::cast(exec, cv, cf);
      product(ac.data(), bc.data(), cf.data());
      mpx::cast(exec, cf, cv);
    }
  }
}

#if MPX_HAS_CUDA
//! `scales`, in cuBLASLt's terms (its A is our B), are the fp8 operands' inverse scales
//! on the device (mpx::fp8_gemm); none for other products.
template <class Acc, class TA, class TB, class TC>
void cuda_gemm(cudaStream_t stream, gemm_dims const& d, bool ta, bool tb, float alpha, TA const* a, TB const* b,
               float beta, TC* c, lt_operand_scales const& scales = {}) {
  int device = 0;
  MPX_CUDA_CHECK(cudaGetDevice(&device));
  lt_problem const p = lt_problem_of<Acc>(device, d, ta, tb, a, b, c, scales);
  if (p.alpha_beta_on_device)
    return lt_matmul(p, stream, scales.device_alpha_beta, b, a, scales.device_alpha_beta + 1, c, scales);
  if constexpr (std::is_same_v<Acc, half>) {
    half const alpha_h = mpx::cast<half>(alpha), beta_h = mpx::cast<half>(beta);
    lt_matmul(p, stream, &alpha_h, b, a, &beta_h, c);
  } else {
    lt_matmul(p, stream, &alpha, b, a, &beta, c, scales);
  }
}

#endif

//! C = beta * C when the product has no terms (K = 0 or alpha = 0), leaving A and B
//! unread: true when that was the whole product, false when there are terms to sum.
template <executor Exec, class CView>
bool gemm_without_products(Exec const& exec, CView const& c, gemm_dims const& d, gemm_options const& o) {
  if (d.k != 0 && o.alpha != 0.0f) return false;
  using TC = std::remove_const_t<typename CView::element_type>;
  if (o.beta == 0.0f) fill(exec, c, mpx::cast<TC>(0.0f));
  else if (o.beta != 1.0f) scale(exec, c, o.beta);
  return true;
}

}  // namespace detail

//! C = alpha * op(A) op(B) + beta * C, A and B read in Policy::compute_type, summed in
//! Policy::accumulate_type.
//!
//! Shapes (row-major): A [M, K] ([K, M] with transpose_a), B [K, N] ([N, K] with
//! transpose_b), C [M, N]; or batches [batch, ., .], where a matrix beside batches is
//! shared by every product. A and B hold Policy::storage_type, C the storage type or
//! float. A compute type other than the storage type is applied on the fly: each
//! operand is rounded to it as it is read (float storage with bfloat16 compute gives
//! bfloat16 tensor-core products over float activations); a float compute type over
//! 16-bit storage changes nothing, since every 16-bit value is a float. An fp8 compute
//! type is refused here: its products need scales (mpx::fp8_gemm). Shapes that do not agree throw mpx::shape_error naming all three and the
//! caller's file:line; tensors the executor cannot reach, wrong dtypes and a policy that
//! sums in 16 bits are compile errors. C must not overlap A or B (mpx::invalid_argument). Asynchronous on a
//! cuda_executor (one cuBLASLt call on its stream; cuBLAS failures throw
//! mpx::cublas_error). Error bounds: docs/gemm.md.
template <class Policy, executor Exec, tensor_like A, tensor_like B, tensor_like C>
void gemm([[maybe_unused]] Exec const& exec, A&& a, B&& b, C&& c, gemm_options const& options = {},
          mpx::source_location loc = mpx::source_location::current()) {
  detail::check_gemm_types<Policy, value_t<A>, value_t<B>, value_t<C>>();
  auto const [av, bv, cv] = detail::views_for<Exec>(a, b, c);
  static_assert(!std::is_const_v<typename decltype(cv)::element_type>, "mpx::gemm: C is const");
  detail::gemm_dims const d = detail::gemm_shapes(av.shape(), bv.shape(), cv.shape(), options, loc);
  // C is written while A and B are still being read (panel by panel, or by cuBLASLt):
  // an overlap would give garbage, so it is refused rather than left to the precondition.
  detail::require_disjoint("gemm", "C", cv, "A", av);
  detail::require_disjoint("gemm", "C", cv, "B", bv);
  if (cv.empty() || detail::gemm_without_products(exec, cv, d, options)) return;
  using Acc = typename Policy::accumulate_type;
  using Compute = typename Policy::compute_type;
  // Not one of exec/'s shapes: each executor calls the best product it has (cuBLASLt on
  // the GPU; BLAS or the blocked product on the host), and docs/gemm.md bounds both.
  if constexpr (is_host_executor_v<Exec>) {
    detail::host_gemm_in<Acc, Compute>(d, options.transpose_a, options.transpose_b, options.alpha, av.data(),
                                       bv.data(), options.beta, cv.data());
  } else {
#if MPX_HAS_CUDA
    detail::with_compute_operands<Compute>(exec, av.shape(), bv.shape(), cv.shape(), av.data(), bv.data(), options.beta,
                                           cv.data(), [&](auto const* a_in, auto const* b_in, auto* c_out) {
                                             detail::cuda_gemm<Acc>(exec.stream(), d, options.transpose_a,
                                                                    options.transpose_b, options.alpha, a_in, b_in,
                                                                    options.beta, c_out);
                                           });
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
}

}  // namespace mpx
