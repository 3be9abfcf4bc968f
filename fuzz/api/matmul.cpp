// The API fuzzer's matmul group: mpx::gemm (transposes, alpha/beta, batches with a
// shared operand, the three standard policies and a float C), mpx::fp8_gemm (e4m3/e5m2
// operands, their inverse scales, half/bfloat16/float C), the three conv2d passes
// (strides, padding with Keras's extra row, dilation, chunked and oversized workspaces,
// reused forward columns, a float dw), max_pool2d forward and backward, and the
// block-scaled fp8 recipe (quantize_fp8_blocks on both operands, fp8_block_gemm). Each case
// draws a valid call, checked against float64 within the bound docs/gemm.md and
// docs/conv_and_pooling.md state, or one made invalid on purpose (inner extents that
// differ, an output of the wrong shape, bad geometry, an output overlapping an input,
// a null scale), which must be refused naming what is wrong.

#include "groups.hpp"

#include <mpx/core/policy.hpp>
#include <mpx/kernels/conv2d.hpp>
#include <mpx/kernels/fp8_block_gemm.hpp>
#include <mpx/kernels/fp8_block_quantize.hpp>
#include <mpx/kernels/fp8_gemm.hpp>
#include <mpx/kernels/nvfp4_quantize.hpp>
#include <mpx/kernels/gemm.hpp>
#include <mpx/kernels/max_pool.hpp>

#include "../../tests/support/reference/conv2d.hpp"
#include "../../tests/support/reference/fp8_blocks.hpp"
#include "../../tests/support/reference/matmul.hpp"
#include "../../tests/support/reference/nvfp4.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace mpx_fuzz::api {

namespace matmul_detail {

using mpx::bfloat16;
using mpx::half;

//! Whether an output element was written at all: it no longer holds the poison bits.
template <class T>
void require_written(call_name const& call, std::string_view what, std::size_t i, T got) {
  if (mpx::bits(got) == mpx::bits(poison<T>()))
    fail(call.str() + ": " + std::string(what) + "[" + std::to_string(i) + "] was never written");
}

//! One output element against its float64 reference `exact` (NaN or ±inf where the
//! inputs make it so), `tolerance` the documented bound, `finite_magnitude` the sum of
//! |terms| over the finite terms, `intermediate_max` the largest magnitude an
//! intermediate rounding can hold without overflowing (FLT_MAX for float sums, T's max
//! where a pass rounds partial results to storage). Where overflow is possible the
//! result may be ±inf or NaN for a finite exact value, so only "written" is checked;
//! where the exact value lies beyond T's range by more than the bound (and the only
//! rounding into T is the last one, `last_rounding_only`), ±inf is due.
template <class T>
void check_element(call_name const& call, std::string_view what, std::size_t i, T got, double exact, double tolerance,
                   double finite_magnitude, double intermediate_max, bool last_rounding_only) {
  double const g = mpx::detail::to_double(got);
  double const top = mpx::detail::to_double(mpx::dtype_traits<T>::max());
  if (!(finite_magnitude < intermediate_max / 8)) return require_written(call, what, i, got);
  if (std::isnan(exact) || std::isinf(exact) || std::fabs(exact) + tolerance < top)
    return require_near(call, what, i, g, exact, tolerance);
  if (last_rounding_only && std::fabs(exact) - tolerance > top * (1 + unit_roundoff<T>()))
    return require_near(call, what, i, g, std::copysign(HUGE_VAL, exact), 0);
  require_written(call, what, i, got);
}

constexpr double float_max = std::numeric_limits<float>::max();
//! Half the smallest float subnormal: the most one float product or sum that underflows
//! loses. Not in docs/gemm.md's "+ min_subnormal(C)", which covers one such loss; a sum
//! of K products each below float's subnormal range (bfloat16 subnormals multiplied
//! together, say) can lose K of them, so the bounds below add K of these (negligible
//! beside every other term for moderate values).
constexpr double float_underflow = 0x1p-150;

template <class T>
double min_subnormal() {
  return mpx::detail::to_double(mpx::dtype_traits<T>::min_subnormal());
}

//! u_acc of docs/gemm.md: float sums, 2^-24 for float operands, 2^-23 for 16-bit ones
//! (room for tensor cores' truncating adds).
template <class S>
double accumulate_roundoff() {
  return std::is_same_v<S, float> ? 0x1p-24 : 0x1p-23;
}

//! Shrinks the largest of the extents until their product is at most `limit`.
inline void fit(std::vector<std::int64_t*> const& extents, std::int64_t limit) {
  auto const product = [&] {
    std::int64_t p = 1;
    for (auto* e : extents) p *= std::max<std::int64_t>(*e, 1);
    return p;
  };
  while (product() > limit) {
    auto* largest = *std::max_element(extents.begin(), extents.end(), [](auto* a, auto* b) { return *a < *b; });
    *largest = std::max<std::int64_t>(*largest / 2, 1);
  }
}

inline std::string dims_text(std::vector<std::int64_t> const& e) {
  std::string s = "[";
  for (std::size_t i = 0; i < e.size(); ++i) s += (i ? "," : "") + std::to_string(e[i]);
  return s + "]";
}

//! docs/conv_and_pooling.md's "plus a few of the type's smallest subnormals for
//! underflow": four of U's, and float_underflow per float product or addition that can
//! underflow (K products and R sums per element at most).
template <class U>
double conv_underflow(std::int64_t k, std::int64_t rows) {
  return 4 * min_subnormal<U>() + static_cast<double>(k + rows + 4) * float_underflow;
}

template <class T>
std::vector<double> widen(std::vector<T> const& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = mpx::detail::to_double(v[i]);
  return out;
}

//! v with every non-finite value made 0: its products' magnitudes are the finite terms'.
inline std::vector<double> finite_part(std::vector<double> v) {
  for (auto& x : v)
    if (!std::isfinite(x)) x = 0;
  return v;
}

// ---- gemm and fp8_gemm ---------------------------------------------------------------

//! The drawn sizes of a product: batch (1 and unbatched, or a batch with A or B shared),
//! M, N, K, transposes.
struct product_shape {
  bool batched = false, a_batched = false, b_batched = false;
  std::int64_t batch = 1, m = 0, n = 0, k = 0;
  bool ta = false, tb = false;

  std::vector<std::int64_t> a_extents() const { return with_batch(a_batched, ta ? k : m, ta ? m : k); }
  std::vector<std::int64_t> b_extents() const { return with_batch(b_batched, tb ? n : k, tb ? k : n); }
  std::vector<std::int64_t> c_extents() const { return with_batch(batched, m, n); }
  std::vector<std::int64_t> with_batch(bool b, std::int64_t r, std::int64_t c) const {
    return b ? std::vector<std::int64_t>{batch, r, c} : std::vector<std::int64_t>{r, c};
  }
};

inline product_shape draw_product_shape(draw& d, std::int64_t max_k) {
  product_shape s;
  s.batched = d.byte() % 4 == 0;
  if (s.batched) {
    s.batch = std::min<std::int64_t>(d.extent(6), 6);
    switch (d.byte() % 3) {
      case 0: s.a_batched = s.b_batched = true; break;
      case 1: s.a_batched = true; break;
      default: s.b_batched = true; break;
    }
  }
  s.m = d.extent(64);
  s.n = d.extent(64);
  s.k = d.extent(max_k);
  s.ta = d.coin();
  s.tb = d.coin();
  // Each tensor within max_elements (batch included): shrink the largest extent.
  fit({&s.batch, &s.m, &s.k}, max_elements);
  fit({&s.batch, &s.k, &s.n}, max_elements);
  fit({&s.batch, &s.m, &s.n}, max_elements);
  fit({&s.m, &s.n, &s.k}, 1 << 15);  // the reference's work per call
  return s;
}

inline void describe(call_name& c, product_shape const& s) {
  c << " M=" << s.m << " N=" << s.n << " K=" << s.k << (s.batched ? " batch=" + std::to_string(s.batch) : "")
    << (s.batched && !s.a_batched ? " (A shared)" : "") << (s.batched && !s.b_batched ? " (B shared)" : "")
    << (s.ta ? " transpose_a" : "") << (s.tb ? " transpose_b" : "");
}

inline float draw_alpha(draw& d) { return d.pick<float>({1.0f, 1.0f, -1.0f, 0.5f, 3.0f, 0.0f, 0.1f, -2.5f}); }
inline float draw_beta(draw& d) { return d.pick<float>({0.0f, 0.0f, 0.0f, 1.0f, -0.5f, 2.0f}); }

//! Checks C = alpha * scale * op(A) op(B) + beta * C_old against float64, element by
//! element, with docs/gemm.md's bound (u_out + (K + 4) u_acc) S + min_subnormal(C)
//! (plus float_underflow per term), S = |alpha scale| sum |a b| + |beta C_old|.
template <class TA, class TB, class TC>
void check_product(call_name const& call, product_shape const& s, std::vector<TA> const& a, std::vector<TB> const& b,
                   std::vector<TC> const& c_old, guarded<TC> const& c, double alpha, double beta, double u_acc) {
  std::int64_t const a_stride = s.a_batched ? s.m * s.k : 0, b_stride = s.b_batched ? s.k * s.n : 0;
  double const u_out = unit_roundoff<TC>();
  for (std::int64_t e = 0; e < s.batch; ++e) {
    mpx_test::reference::matrix<TA> const am{a.data() + e * a_stride, s.m, s.k, s.ta};
    mpx_test::reference::matrix<TB> const bm{b.data() + e * b_stride, s.k, s.n, s.tb};
    for (std::int64_t i = 0; i < s.m; ++i)
      for (std::int64_t j = 0; j < s.n; ++j) {
        auto const at = static_cast<std::size_t>((e * s.m + i) * s.n + j);
        double exact = 0, finite = 0;
        if (alpha != 0 && s.k != 0) {  // alpha == 0 or K == 0: A and B are not read
          double raw = 0;
          for (std::int64_t kk = 0; kk < s.k; ++kk) {
            double const t = am(i, kk) * bm(kk, j);
            exact += t;
            if (std::isfinite(t)) raw += std::fabs(t);
          }
          exact *= alpha;
          // The float sums before alpha must not overflow either.
          finite = std::max(raw, std::fabs(alpha) * raw);
        }
        if (beta != 0) {  // beta == 0: C_old is not read (the poison there is overwritten)
          double const old = mpx::detail::to_double(c_old[at]);
          exact += beta * old;
          if (std::isfinite(old)) finite += std::fabs(beta * old);
        }
        // A product that underflows float loses up to float_underflow, and alpha, applied
        // after the sum, scales that loss too.
        double const tolerance = (u_out + static_cast<double>(s.k + 4) * u_acc) * finite + min_subnormal<TC>() +
                                 static_cast<double>(s.k) * float_underflow * std::max(1.0, std::fabs(alpha));
        check_element(call, "C", at, c.data()[at], exact, tolerance, finite, float_max, true);
      }
  }
}

//! The invalid variants of a product's call, and what the refusal must name.
enum class product_fault { none, inner, c_shape, c_rank, batch, alias };

inline product_fault draw_product_fault(draw& d, bool alias_possible) {
  std::uint8_t const b = d.byte();
  if (b < 176) return product_fault::none;
  switch (b % 5) {
    case 0: return product_fault::inner;
    case 1: return product_fault::c_shape;
    case 2: return product_fault::c_rank;
    case 3: return product_fault::batch;
    default: return alias_possible ? product_fault::alias : product_fault::inner;
  }
}

//! The shapes of an invalid product (A's K off by one, C's M or N, C's rank, the batch
//! of A), and the words its refusal must hold.
struct bad_shapes {
  std::vector<std::int64_t> a, b, c;
  std::vector<std::string_view> names;
};

inline bad_shapes break_shapes(draw& d, product_shape const& s, product_fault f) {
  bad_shapes r{s.a_extents(), s.b_extents(), s.c_extents(), {}};
  std::size_t const ra = r.a.size() - 2, rc = r.c.size() - 2;
  switch (f) {
    case product_fault::inner:
      r.a[s.ta ? ra : ra + 1] += 1 + d.byte() % 3;
      r.names = {"inner extents differ", "A ", "B "};
      break;
    case product_fault::c_shape:
      r.c[rc + d.byte() % 2] += 1 + d.byte() % 2;
      r.names = {"C must be", "C "};
      break;
    case product_fault::c_rank:
      if (s.batched) r.c.erase(r.c.begin());
      else r.c.insert(r.c.begin(), 1 + d.byte() % 3);
      r.names = {"C "};
      break;
    default:  // batch: a batched A (or B) whose batch differs from C's
      if (s.a_batched) r.a[0] += 1;
      else if (s.b_batched) r.b[0] += 1;
      else r.a.insert(r.a.begin(), 2);  // unbatched: a batched A beside a matrix C
      r.names = {"C "};
      if (s.batched) r.names = {"batch extents differ"};
      break;
  }
  return r;
}

template <class Policy, class TC>
void gemm_case(draw& d) {
  using S = typename Policy::storage_type;
  mpx::host_executor exec;
  product_shape const s = draw_product_shape(d, 200);
  float const alpha = draw_alpha(d), beta = draw_beta(d);
  bool const hostile = d.byte() % 4 == 0;
  product_fault const fault = draw_product_fault(d, std::is_same_v<S, TC>);
  using Compute = typename Policy::compute_type;
  call_name call(std::string("gemm<") + std::string(Policy::name) + "> C " + std::string(mpx::dtype_name<TC>));
  describe(call, s);
  call << " alpha=" << alpha << " beta=" << beta << (hostile ? " hostile" : "");
  mpx::gemm_options const o{.transpose_a = s.ta, .transpose_b = s.tb, .alpha = alpha, .beta = beta};

  if (fault == product_fault::alias) {
    // C over A's memory, at a drawn shift (0: from A's first element; any overlap is refused).
    std::int64_t a_size = 1;  // A's own elements: one matrix where the batch shares it
    for (auto e : s.a_extents()) a_size *= e;
    std::int64_t const c_size = s.batch * s.m * s.n;
    if (a_size == 0 || c_size == 0) return;
    std::int64_t const shift = static_cast<std::int64_t>(d.below(static_cast<std::size_t>(a_size)));
    call << " C overlapping A at +" << shift;
    std::vector<S> memory(static_cast<std::size_t>(shift + c_size + a_size), mpx::cast<S>(1.0));
    mpx::tensor_view<S const> const av(memory.data(), mpx::shape(s.a_extents()));
    auto const b = d.values<S>(static_cast<std::size_t>(s.batch * s.k * s.n), false);
    mpx::tensor_view<S const> const bv(b.data(), mpx::shape(s.b_extents()));
    mpx::tensor_view<S> const cv(memory.data() + shift, mpx::shape(s.c_extents()));
    return require_refusal(call, {"overlap", "C", "A"}, [&] { mpx::gemm<Policy>(exec, av, bv, cv, o); });
  }
  if (fault != product_fault::none) {
    auto const bad = break_shapes(d, s, fault);
    call << " invalid: A " << shape_text<S>(bad.a) << " B " << shape_text<S>(bad.b) << " C " << shape_text<TC>(bad.c);
    guarded<S> a(exec, bad.a, d), b(exec, bad.b, d);
    guarded<TC> c(exec, bad.c, d);
    auto const refuse = [&](auto... n) {
      require_refusal(call, {n...}, [&] { mpx::gemm<Policy>(exec, a.cview(), b.cview(), c.view(), o); });
    };
    if (bad.names.size() == 3) refuse(bad.names[0], bad.names[1], bad.names[2]);
    else if (bad.names.size() == 2) refuse(bad.names[0], bad.names[1]);
    else refuse(bad.names[0]);
    c.require_guards_intact(call, "C");
    return;
  }

  guarded<S> a(exec, s.a_extents(), d), b(exec, s.b_extents(), d);
  guarded<TC> c(exec, s.c_extents(), d);
  a.assign(d.values<S>(a.size(), hostile));
  b.assign(d.values<S>(b.size(), hostile));
  if (beta != 0) c.assign(d.values<TC>(c.size(), hostile));
  auto const c_old = c.values();
  call << " offsets " << a.offset() << "," << b.offset() << "," << c.offset();
  require_accepted(call, [&] { mpx::gemm<Policy>(exec, a.cview(), b.cview(), c.view(), o); });
  // The operands as the policy's compute type reads them (docs/gemm.md: "The bounds below
  // hold with the operands as rounded"); u_acc 2^-23 unless both are float.
  auto const through = [](std::vector<S> const& v) {
    std::vector<Compute> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = mpx::cast<Compute>(mpx::cast<float>(v[i]));
    return out;
  };
  double const u_acc = std::is_same_v<S, float> && std::is_same_v<Compute, float> ? 0x1p-24 : 0x1p-23;
  check_product(call, s, through(a.values()), through(b.values()), c_old, c, alpha, beta, u_acc);
  c.require_guards_intact(call, "C");
}

template <class TA, class TB, class TC>
void fp8_gemm_case(draw& d) {
  mpx::host_executor exec;
  product_shape const s = draw_product_shape(d, 200);
  float const alpha = draw_alpha(d), beta = draw_beta(d);
  bool const hostile = d.byte() % 4 == 0;
  // Inverse scales as fp8_tensor_scale keeps them: powers of two and others, within the
  // range where alpha * s_a * s_b neither underflows nor overflows.
  float const sa = d.pick<float>({1.0f, 0.5f, 0x1p-7f, 3.0f, 0x1p8f, 0.3f});
  float const sb = d.pick<float>({1.0f, 2.0f, 0x1p-5f, 0.75f, 0x1p6f});
  std::uint8_t const f = d.byte();
  bool const null_scale = f >= 240;
  product_fault const fault = null_scale ? product_fault::none : draw_product_fault(d, false);
  call_name call(std::string("fp8_gemm A ") + std::string(mpx::dtype_name<TA>) + " B " +
                 std::string(mpx::dtype_name<TB>) + " C " + std::string(mpx::dtype_name<TC>));
  describe(call, s);
  call << " alpha=" << alpha << " beta=" << beta << " scales " << sa << "," << sb << (hostile ? " hostile" : "");
  mpx::gemm_options const o{.transpose_a = s.ta, .transpose_b = s.tb, .alpha = alpha, .beta = beta};
  float const scale_a = sa, scale_b = sb;

  if (null_scale || fault != product_fault::none) {
    auto const bad = null_scale ? bad_shapes{s.a_extents(), s.b_extents(), s.c_extents(), {"inverse scale is null"}}
                                : break_shapes(d, s, fault);
    bool const null_a = f % 2 == 0;
    call << " invalid: A " << shape_text<TA>(bad.a) << " B " << shape_text<TB>(bad.b) << " C "
         << shape_text<TC>(bad.c) << (null_scale ? (null_a ? " a_inverse_scale null" : " b_inverse_scale null") : "");
    guarded<TA> a(exec, bad.a, d);
    guarded<TB> b(exec, bad.b, d);
    guarded<TC> c(exec, bad.c, d);
    float const* pa = null_scale && null_a ? nullptr : &scale_a;
    float const* pb = null_scale && !null_a ? nullptr : &scale_b;
    auto const refuse = [&](auto... n) {
      require_refusal(call, {n...}, [&] { mpx::fp8_gemm(exec, a.cview(), pa, b.cview(), pb, c.view(), o); });
    };
    if (bad.names.size() == 3) refuse(bad.names[0], bad.names[1], bad.names[2]);
    else if (bad.names.size() == 2) refuse(bad.names[0], bad.names[1]);
    else refuse(bad.names[0]);
    c.require_guards_intact(call, "C");
    return;
  }

  guarded<TA> a(exec, s.a_extents(), d);
  guarded<TB> b(exec, s.b_extents(), d);
  guarded<TC> c(exec, s.c_extents(), d);
  a.assign(d.values<TA>(a.size(), hostile));
  b.assign(d.values<TB>(b.size(), hostile));
  if (beta != 0) c.assign(d.values<TC>(c.size(), hostile));
  auto const c_old = c.values();
  call << " offsets " << a.offset() << "," << b.offset() << "," << c.offset();
  require_accepted(call, [&] { mpx::fp8_gemm(exec, a.cview(), &scale_a, b.cview(), &scale_b, c.view(), o); });
  // fp8_gemm's documented host bound: (K + 4) 2^-24 (|alpha s_a s_b| sum |a b| + |beta
  // C0|) plus C's final rounding; the products of fp8 values are exact in float.
  check_product(call, s, a.values(), b.values(), c_old, c, static_cast<double>(alpha) * sa * sb, beta, 0x1p-24);
  c.require_guards_intact(call, "C");
}

// ---- quantize_fp8_blocks and fp8_block_gemm ------------------------------------------

//! The block-scaled recipe end to end: A from x [M, K] and B from a weight-like w [K, N]
//! (or the other orientation), each quantized in drawn blocks, then multiplied. Every
//! quantized value and inverse scale must be what the definition gives
//! (tests/support/reference/fp8_blocks.hpp) bit for bit, the scales positive and
//! finite whatever the values, and C the float64 product of the dequantised operands
//! within the float-sum bound, NaN exactly where a row of A or of B holds one. Invalid
//! variants: a pair of kinds cuBLASLt has no product for, K that differs, N not a
//! multiple of 16, values or scales of the wrong size, C of the wrong shape or
//! overlapping A's values. MXFP8's 1x32 blocks (S = float8_e8m0 scales) alike.
template <class TX, class TC, class S>
void fp8_block_case_with(draw& d, mpx::fp8_block_kind a_kind, mpx::fp8_block_kind b_kind, std::int64_t m,
                         std::int64_t k, std::int64_t n) {
  using F = mpx::float8_e4m3;
  using kind = mpx::fp8_block_kind;
  constexpr bool mx = std::is_same_v<S, mpx::float8_e8m0>;
  mpx::host_executor exec;
  bool const pow2 = d.coin(), hostile = d.byte() % 3 == 0;
  bool const a_k_contiguous = d.coin(), b_k_contiguous = d.coin();
  float const alpha = draw_alpha(d), beta = draw_beta(d);
  std::uint8_t const fault = d.byte();
  bool const invalid = fault >= 200;
  if (invalid && fault % 6 == 2) n += 1 + fault % 15;  // N not a multiple of 16
  if (m * k > max_elements || n * k > max_elements || m * n * (k + 128) > (1 << 17)) return;
  call_name call("fp8_block_gemm");
  call << " A " << mpx::dtype_name<TX> << "[" << m << "," << k << "] " << mpx::detail::block_kind_name(a_kind)
       << (a_k_contiguous ? "" : " (from its transpose)") << ", B [" << n << "," << k << "] "
       << mpx::detail::block_kind_name(b_kind) << (b_k_contiguous ? "" : " (from its transpose)") << " -> C "
       << mpx::dtype_name<TC> << (pow2 ? " pow2" : "") << (hostile ? " hostile" : "") << " alpha=" << alpha
       << " beta=" << beta;

  // The operands as the caller holds them: x [M, K] or [K, M], w [N, K] or [K, N].
  std::vector<std::int64_t> const xa = a_k_contiguous ? std::vector<std::int64_t>{m, k} : std::vector<std::int64_t>{k, m};
  std::vector<std::int64_t> const xb = b_k_contiguous ? std::vector<std::int64_t>{n, k} : std::vector<std::int64_t>{k, n};
  guarded<TX> x(exec, xa, d), w(exec, xb, d);
  x.assign(d.values<TX>(x.size(), hostile));
  w.assign(d.values<TX>(w.size(), hostile));
  mpx::fp8_block_scale_layout const la{a_kind, m, k}, lb{b_kind, n, k};
  guarded<F> aq(exec, {m, la.padded_k()}, d), bq(exec, {n, lb.padded_k()}, d);
  guarded<S> as(exec, {la.count()}, d), bs(exec, {lb.count()}, d);

  if (invalid && fault % 6 == 0) {  // values of the wrong size, or too few scales
    bool const values = d.coin();
    guarded<F> wrong_values(exec, {m, la.padded_k() + 1}, d);
    guarded<S> wrong_scales(exec, {la.count() + 1}, d);
    call << (values ? " invalid: values one too long" : " invalid: one scale too many");
    if (values)
      require_refusal(call, {"values has shape"}, [&] {
        mpx::quantize_fp8_blocks<F>(exec, x.cview(), a_k_contiguous, a_kind, pow2, wrong_values.view(), as.view());
      });
    else
      require_refusal(call, {"inverse_scales has shape"}, [&] {
        mpx::quantize_fp8_blocks<F>(exec, x.cview(), a_k_contiguous, a_kind, pow2, aq.view(), wrong_scales.view());
      });
    return;
  }
  std::vector<float> widened(x.size()), widened_w(w.size());
  for (std::size_t i = 0; i < x.size(); ++i) widened[i] = mpx::cast<float>(x.data()[i]);
  for (std::size_t i = 0; i < w.size(); ++i) widened_w[i] = mpx::cast<float>(w.data()[i]);
  auto const want_a = mpx_test::reference::reference_quantize(widened, xa[0], xa[1], a_k_contiguous, a_kind, pow2);
  auto const want_b = mpx_test::reference::reference_quantize(widened_w, xb[0], xb[1], b_k_contiguous, b_kind, pow2);
  require_accepted(call, [&] {
    mpx::quantize_fp8_blocks<F>(exec, x.cview(), a_k_contiguous, a_kind, pow2, aq.view(), as.view());
    mpx::quantize_fp8_blocks<F>(exec, w.cview(), b_k_contiguous, b_kind, pow2, bq.view(), bs.view());
  });
  for (auto const* g : {&aq, &bq}) g->require_guards_intact(call, "values");
  for (auto const* g : {&as, &bs}) g->require_guards_intact(call, "inverse scales");
  require_same<F>(call, "A's values", aq.values(), want_a.values);
  require_same<F>(call, "B's values", bq.values(), want_b.values);
  // Each slot's factor as a float (E8M0 decoded), and for MXFP8 its byte too.
  auto const factors = [](std::vector<S> const& v) {
    std::vector<float> out;
    for (S const s : v) out.push_back(mpx::detail::dequantisation_factor(s));
    return out;
  };
  if constexpr (mx) {
    auto const bytes = [](std::vector<S> const& v) {
      std::vector<std::uint8_t> out;
      for (S const s : v) out.push_back(mpx::e8m0_bits(s));
      return out;
    };
    if (bytes(as.values()) != want_a.e8m0) fail(call.str() + ": A's E8M0 scales differ from the definition's");
    if (bytes(bs.values()) != want_b.e8m0) fail(call.str() + ": B's E8M0 scales differ from the definition's");
  }
  require_same<float>(call, "A's inverse scales", factors(as.values()), want_a.inverse_scales);
  require_same<float>(call, "B's inverse scales", factors(bs.values()), want_b.inverse_scales);
  for (float v : factors(as.values()))
    if (!(v > 0.0f) || !std::isfinite(v)) fail(call.str() + ": an inverse scale of A is " + std::to_string(v));

  using op = mpx::fp8_block_operand<F, mpx::host_space, S>;
  op const a_op{aq.cview(), as.cview(), la}, b_op{bq.cview(), bs.cview(), lb};
  if (invalid) {
    switch (fault % 6) {
      case 1: {  // two 128x128 operands, or rowwise or 1x32 with another kind
        if constexpr (mx) {
          mpx::fp8_block_scale_layout const lb2{kind::vec128, n, k};
          guarded<float> sb2(exec, {lb2.count()}, d);
          guarded<F> vb2(exec, {n, lb2.padded_k()}, d);
          guarded<TC> c(exec, {m, n}, d);
          call << " invalid: 1x32 with 1x128";
          require_refusal(call, {"1x32 (MXFP8) blocks multiply only 1x32 (MXFP8) blocks"}, [&] {
            mpx::fp8_block_gemm(exec, a_op, mpx::fp8_block_operand<F, mpx::host_space>{vb2.cview(), sb2.cview(), lb2},
                                c.view(), alpha, beta);
          });
          return;
        }
        bool const tiles = d.coin();
        mpx::fp8_block_scale_layout const l2{tiles ? kind::tile128 : kind::row, m, k};
        guarded<S> s2(exec, {l2.count()}, d);
        guarded<F> v2(exec, {m, l2.padded_k()}, d);
        op const a2{v2.cview(), s2.cview(), l2};
        mpx::fp8_block_scale_layout const lb2{tiles ? kind::tile128 : kind::vec128, n, k};
        guarded<S> sb2(exec, {lb2.count()}, d);
        guarded<F> vb2(exec, {n, lb2.padded_k()}, d);
        op const b2{vb2.cview(), sb2.cview(), lb2};
        guarded<TC> c(exec, {m, n}, d);
        call << (tiles ? " invalid: 128x128 with 128x128" : " invalid: rowwise with 1x128");
        require_refusal(call, {tiles ? "both in 128x128 blocks" : "rowwise blocks multiply only rowwise"},
                        [&] { mpx::fp8_block_gemm(exec, a2, b2, c.view(), alpha, beta); });
        return;
      }
      case 2: {
        guarded<TC> c(exec, {m, n}, d);
        call << " invalid: N = " << n;
        require_refusal(call, {"N (B's rows) must be a multiple of 16"},
                        [&] { mpx::fp8_block_gemm(exec, a_op, b_op, c.view(), alpha, beta); });
        return;
      }
      case 3: {  // B with another K
        mpx::fp8_block_scale_layout const lk{b_kind, n, k + 1};
        guarded<S> sk(exec, {lk.count()}, d);
        guarded<F> vk(exec, {n, lk.padded_k()}, d);
        guarded<TC> c(exec, {m, n}, d);
        call << " invalid: B's K = " << k + 1;
        require_refusal(call, {"A has K", "but B has K"}, [&] {
          mpx::fp8_block_gemm(exec, a_op, op{vk.cview(), sk.cview(), lk}, c.view(), alpha, beta);
        });
        return;
      }
      case 4: {
        guarded<TC> c(exec, {m, n + 16}, d);
        call << " invalid: C [" << m << "," << n + 16 << "]";
        require_refusal(call, {"C has shape", "A B^T is"},
                        [&] { mpx::fp8_block_gemm(exec, a_op, b_op, c.view(), alpha, beta); });
        return;
      }
      default: {  // C over A's values
        if (m == 0 || n == 0 || k == 0) return;
        auto* over = reinterpret_cast<TC*>(aq.data());
        if (static_cast<std::size_t>(m * n) * sizeof(TC) > aq.size()) return;  // C must fit inside A's buffer
        call << " invalid: C overlapping A";
        require_refusal(call, {"C and A overlap"}, [&] {
          mpx::fp8_block_gemm(exec, a_op, b_op, mpx::tensor_view<TC>(over, mpx::shape{m, n}), alpha, beta);
        });
        return;
      }
    }
  }
  guarded<TC> c(exec, {m, n}, d);
  if (beta != 0) c.assign(d.values<TC>(c.size(), hostile));
  auto const c_old = c.values();
  require_accepted(call, [&] { mpx::fp8_block_gemm(exec, a_op, b_op, c.view(), alpha, beta); });
  c.require_guards_intact(call, "C");
  auto const ad = mpx_test::reference::dequantised_blocks(want_a, la);
  auto const bd = mpx_test::reference::dequantised_blocks(want_b, lb);
  std::int64_t const kp = la.padded_k();
  double const u_out = unit_roundoff<TC>();
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      auto const at = static_cast<std::size_t>(i * n + j);
      double exact = 0, finite = 0, operands = 0;
      if (alpha != 0 && kp != 0) {
        double raw = 0;
        for (std::int64_t kk = 0; kk < kp; ++kk) {
          double const x = ad[static_cast<std::size_t>(i * kp + kk)], y = bd[static_cast<std::size_t>(j * kp + kk)];
          double const t = x * y;
          exact += t;
          if (std::isfinite(t)) raw += std::fabs(t);
          if (std::isfinite(x) && std::isfinite(y)) operands += std::fabs(x) + std::fabs(y);
        }
        exact *= alpha;
        finite = std::max(raw, std::fabs(alpha) * raw);
      }
      // What underflow loses in float, alpha times: half a subnormal step per product or
      // sum, and per dequantised operand that lands in float's subnormal range, times the
      // other operand (bounded by the sum of both operands' magnitudes).
      double const underflow =
          std::max(1.0, std::fabs(static_cast<double>(alpha))) * (static_cast<double>(kp) + operands) * float_underflow;
      if (beta != 0) {
        double const old = mpx::detail::to_double(c_old[at]);
        exact += beta * old;
        if (std::isfinite(old)) finite += std::fabs(beta * old);
      }
      // Dequantised values are exact with power-of-two scales, one float rounding
      // (2^-24) each otherwise.
      double const dequant = pow2 || mx ? 0.0 : 0x1p-23;
      double const tolerance =
          (u_out + static_cast<double>(kp + 4) * 0x1p-24 + dequant) * finite + min_subnormal<TC>() + underflow;
      check_element(call, "C", at, c.data()[at], exact, tolerance, finite, float_max, true);
    }
}

//! NVFP4: x [M, K] and w [N, K] (or their transposes) through quantize_nvfp4 with drawn
//! options (16x16 blocks, the transform; stochastic rounding, whose draws the reference
//! does not follow, only when nothing but acceptance and finiteness is checked), every
//! code, block scale and tensor scale against the definition, and the product against
//! the float64 product of the dequantised operands. Invalid variants: values or the
//! tensor scale of the wrong size, N not a multiple of 16, an NVFP4 operand whose layout
//! is not 1x16.
template <class TX, class TC>
void nvfp4_case(draw& d, std::int64_t m, std::int64_t k, std::int64_t n) {
  using P = mpx::float4_e2m1x2;
  using E = mpx::float8_e4m3;
  mpx::host_executor exec;
  bool const hostile = d.byte() % 3 == 0, a_k_contiguous = d.coin(), b_k_contiguous = d.coin();
  mpx::nvfp4_quantize_options options;
  options.square_blocks = d.coin();
  options.hadamard = d.coin();
  bool const stochastic = d.byte() % 4 == 0;
  float const alpha = draw_alpha(d), beta = draw_beta(d);
  std::uint8_t const fault = d.byte();
  bool const invalid = fault >= 200;
  if (invalid && fault % 4 == 2) n += 1 + fault % 15;
  if (m * k > max_elements || n * k > max_elements || m * n * (k + 128) > (1 << 17)) return;
  call_name call("fp8_block_gemm");
  call << " NVFP4 A " << mpx::dtype_name<TX> << "[" << m << "," << k << "]" << (a_k_contiguous ? "" : " (from its transpose)")
       << ", B [" << n << "," << k << "]" << (b_k_contiguous ? "" : " (from its transpose)") << " -> C "
       << mpx::dtype_name<TC> << (options.square_blocks ? " 16x16" : "") << (options.hadamard ? " hadamard" : "")
       << (stochastic ? " stochastic" : "") << (hostile ? " hostile" : "") << " alpha=" << alpha << " beta=" << beta;
  std::vector<std::int64_t> const xa = a_k_contiguous ? std::vector<std::int64_t>{m, k} : std::vector<std::int64_t>{k, m};
  std::vector<std::int64_t> const xb = b_k_contiguous ? std::vector<std::int64_t>{n, k} : std::vector<std::int64_t>{k, n};
  guarded<TX> x(exec, xa, d), w(exec, xb, d);
  x.assign(d.values<TX>(x.size(), hostile));
  w.assign(d.values<TX>(w.size(), hostile));
  mpx::fp8_block_scale_layout const la{mpx::fp8_block_kind::vec16, m, k}, lb{mpx::fp8_block_kind::vec16, n, k};
  guarded<P> aq(exec, {m, la.padded_k() / 2}, d), bq(exec, {n, lb.padded_k() / 2}, d);
  guarded<E> as(exec, {la.count()}, d), bs(exec, {lb.count()}, d);
  guarded<float> at(exec, {2}, d), bt(exec, {2}, d);
  if (invalid && fault % 4 == 0) {
    bool const values = d.coin();
    guarded<P> wrong_values(exec, {m, la.padded_k() / 2 + 1}, d);
    guarded<float> wrong_tensor(exec, {3}, d);
    call << (values ? " invalid: values one pair too long" : " invalid: three tensor-scale slots");
    require_refusal(call, {values ? "values has shape" : "tensor_scale has shape"}, [&] {
      mpx::quantize_nvfp4(exec, x.cview(), a_k_contiguous, options, values ? wrong_values.view() : aq.view(), as.view(),
                          values ? at.view() : wrong_tensor.view());
    });
    return;
  }
  mpx::tensor<std::uint64_t> draw_count = mpx::make_tensor<std::uint64_t>(exec, mpx::shape{1});
  draw_count.data()[0] = d.byte();
  mpx::nvfp4_quantize_options a_options = options, b_options = options;
  if (stochastic) b_options.draw = draw_count.data();  // B rounds stochastically, A to nearest
  require_accepted(call, [&] {
    mpx::quantize_nvfp4(exec, x.cview(), a_k_contiguous, a_options, aq.view(), as.view(), at.view());
    mpx::quantize_nvfp4(exec, w.cview(), b_k_contiguous, b_options, bq.view(), bs.view(), bt.view());
  });
  for (auto const* g : {&aq, &bq}) g->require_guards_intact(call, "values");
  for (auto const* g : {&as, &bs}) g->require_guards_intact(call, "block scales");
  for (auto const* g : {&at, &bt}) g->require_guards_intact(call, "tensor scale");
  std::vector<float> widened(x.size()), widened_w(w.size());
  for (std::size_t i = 0; i < x.size(); ++i) widened[i] = mpx::cast<float>(x.data()[i]);
  for (std::size_t i = 0; i < w.size(); ++i) widened_w[i] = mpx::cast<float>(w.data()[i]);
  std::uint32_t const signs = mpx::detail::nvfp4_hadamard_signs(options.hadamard_seed);
  auto const want_a = mpx_test::reference::reference_nvfp4(widened, xa[0], xa[1], a_k_contiguous, options.square_blocks,
                                                           options.hadamard, signs);
  auto const want_b = mpx_test::reference::reference_nvfp4(widened_w, xb[0], xb[1], b_k_contiguous,
                                                           options.square_blocks, options.hadamard, signs, stochastic);
  auto const bytes = [](std::vector<E> const& v) {
    std::vector<std::uint8_t> out;
    for (E s : v) out.push_back(mpx::bits(s));
    return out;
  };
  auto const codes_a = mpx_test::reference::unpacked_codes(aq.values());
  auto const codes_b = mpx_test::reference::unpacked_codes(bq.values());
  if (codes_a != want_a.codes) fail(call.str() + ": A's e2m1 codes differ from the definition's");
  if (bytes(as.values()) != want_a.scales) fail(call.str() + ": A's block scales differ from the definition's");
  if (bytes(bs.values()) != want_b.scales) fail(call.str() + ": B's block scales differ from the definition's");
  if (!stochastic && codes_b != want_b.codes) fail(call.str() + ": B's e2m1 codes differ from the definition's");
  for (auto const* t : {&at, &bt})
    if (!(t->data()[1] > 0.0f) || !std::isfinite(t->data()[1]))
      fail(call.str() + ": a decode factor is " + std::to_string(t->data()[1]));
  using op = mpx::nvfp4_operand<mpx::host_space>;
  op const a_op{aq.cview(), as.cview(), la, at.cview()}, b_op{bq.cview(), bs.cview(), lb, bt.cview()};
  if (invalid) {
    guarded<TC> c(exec, {m, n}, d);
    if (fault % 4 == 2) {
      call << " invalid: N = " << n;
      require_refusal(call, {"N (B's rows) must be a multiple of 16"},
                      [&] { mpx::fp8_block_gemm(exec, a_op, b_op, c.view(), alpha, beta); });
    } else {
      mpx::fp8_block_scale_layout const mx{mpx::fp8_block_kind::vec32, n, k};
      call << " invalid: B's layout 1x32";
      require_refusal(call, {"B's layout says 1x32 (MXFP8)"}, [&] {
        mpx::fp8_block_gemm(exec, a_op, op{bq.cview(), bs.cview(), mx, bt.cview()}, c.view(), alpha, beta);
      });
    }
    return;
  }
  guarded<TC> c(exec, {m, n}, d);
  if (beta != 0) c.assign(d.values<TC>(c.size(), hostile));
  auto const c_old = c.values();
  require_accepted(call, [&] { mpx::fp8_block_gemm(exec, a_op, b_op, c.view(), alpha, beta); });
  c.require_guards_intact(call, "C");
  if (stochastic) return;  // the reference does not follow the draws
  auto const ad = mpx_test::reference::dequantised_nvfp4(want_a.codes, want_a.scales, want_a.decode, la);
  auto const bd = mpx_test::reference::dequantised_nvfp4(want_b.codes, want_b.scales, want_b.decode, lb);
  std::int64_t const kp = la.padded_k();
  double const u_out = unit_roundoff<TC>();
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      auto const idx = static_cast<std::size_t>(i * n + j);
      double exact = 0, finite = 0, operands = 0;
      if (alpha != 0 && kp != 0) {
        double raw = 0;
        for (std::int64_t kk = 0; kk < kp; ++kk) {
          double const x = ad[static_cast<std::size_t>(i * kp + kk)], y = bd[static_cast<std::size_t>(j * kp + kk)];
          double const t = x * y;
          exact += t;
          if (std::isfinite(t)) raw += std::fabs(t);
          if (std::isfinite(x) && std::isfinite(y)) operands += std::fabs(x) + std::fabs(y);
        }
        exact *= alpha;
        finite = std::max(raw, std::fabs(alpha) * raw);
      }
      // What underflow loses in float, alpha times: half a subnormal step per product or
      // sum, and per dequantised operand that lands in float's subnormal range, times the
      // other operand (bounded by the sum of both operands' magnitudes).
      double const underflow =
          std::max(1.0, std::fabs(static_cast<double>(alpha))) * (static_cast<double>(kp) + operands) * float_underflow;
      if (beta != 0) {
        double const old = mpx::detail::to_double(c_old[idx]);
        exact += beta * old;
        if (std::isfinite(old)) finite += std::fabs(beta * old);
      }
      // Each dequantised value: the block scale times the decode factor, one more 2^-24.
      double const tolerance =
          (u_out + static_cast<double>(kp + 6) * 0x1p-24) * finite + min_subnormal<TC>() + underflow;
      check_element(call, "C", idx, c.data()[idx], exact, tolerance, finite, float_max, true);
    }
}

//! Draws the shape and the pair of block kinds (row x row, 1x128 x 1x128, 1x128 x
//! 128x128, 128x128 x 1x128, MXFP8's 1x32 x 1x32, NVFP4), then runs the case with the
//! kinds' scale format.
template <class TX, class TC>
void fp8_block_case(draw& d) {
  using kind = mpx::fp8_block_kind;
  std::int64_t const m = d.extent(40), k = d.extent(300);
  std::int64_t const n = 16 * (1 + static_cast<std::int64_t>(d.byte() % 3));
  std::uint8_t const pair = d.byte() % 6;
  if (pair == 5) return nvfp4_case<TX, TC>(d, m, k, n);
  if (pair == 4) return fp8_block_case_with<TX, TC, mpx::float8_e8m0>(d, kind::vec32, kind::vec32, m, k, n);
  kind const a_kind = pair == 0 ? kind::row : pair == 3 ? kind::tile128 : kind::vec128;
  kind const b_kind = pair == 0 ? kind::row : pair == 2 ? kind::tile128 : kind::vec128;
  fp8_block_case_with<TX, TC, float>(d, a_kind, b_kind, m, k, n);
}

// ---- conv2d -------------------------------------------------------------------------

struct conv_case {
  mpx_test::reference::conv2d_geometry g{};
  std::int64_t oh = 0, ow = 0;
  std::vector<std::int64_t> x() const { return {g.n, g.h, g.w, g.cin}; }
  std::vector<std::int64_t> w() const { return {g.kh, g.kw, g.cin, g.cout}; }
  std::vector<std::int64_t> y() const { return {g.n, oh, ow, g.cout}; }
  std::int64_t patch() const { return g.kh * g.kw * g.cin; }
  std::int64_t rows() const { return g.n * oh * ow; }
};

inline bool conv_fits(conv_case& c) {
  auto const& o = c.g.o;
  std::int64_t const span_h = (c.g.kh - 1) * o.dilation_h + 1, span_w = (c.g.kw - 1) * o.dilation_w + 1;
  if (span_h > c.g.h + 2 * o.pad_h + o.extra_pad_h || span_w > c.g.w + 2 * o.pad_w + o.extra_pad_w) return false;
  auto const e = mpx_test::reference::conv2d_output_extent(c.g);
  c.oh = e.oh;
  c.ow = e.ow;
  return true;
}

inline conv_case draw_conv(draw& d) {
  conv_case c;
  auto& g = c.g;
  g.n = 1 + d.byte() % 3;
  g.h = 1 + d.byte() % 12;
  g.w = 1 + d.byte() % 12;
  g.cin = 1 + d.byte() % 5;
  g.kh = 1 + d.byte() % 4;
  g.kw = 1 + d.byte() % 4;
  g.cout = 1 + d.byte() % 6;
  std::uint8_t const geo = d.byte();
  g.o.stride_h = 1 + geo % 3;
  g.o.stride_w = 1 + geo / 3 % 3;
  g.o.dilation_h = 1 + geo / 9 % 2;
  g.o.dilation_w = 1 + geo / 18 % 2;
  std::uint8_t const pads = d.byte();
  g.o.pad_h = pads % 3;
  g.o.pad_w = pads / 3 % 3;
  g.o.extra_pad_h = pads / 9 % 2;
  g.o.extra_pad_w = pads / 18 % 2;
  // A kernel wider than the padded input: shrink it (the invalid variant makes its own).
  while (!conv_fits(c)) {
    if (g.kh > 1 && (g.kh - 1) * g.o.dilation_h + 1 > g.h + 2 * g.o.pad_h + g.o.extra_pad_h) --g.kh;
    else if (g.kw > 1) --g.kw;
    else --g.kh;
  }
  // The workspace within twice max_elements, the reference's work within reason.
  while (c.rows() * c.patch() > 2 * max_elements || c.rows() * c.patch() * g.cout > 1 << 15) {
    if (g.n > 1) --g.n;
    else if (g.cin > 1) --g.cin;
    else if (g.cout > 1) --g.cout;
    else if (g.h > g.kh) --g.h;
    else --g.w;
    conv_fits(c);
  }
  return c;
}

inline void describe(call_name& call, conv_case const& c) {
  auto const& o = c.g.o;
  call << " x" << dims_text(c.x()) << " w" << dims_text(c.w()) << " stride "
       << o.stride_h << "," << o.stride_w << " pad " << o.pad_h << "," << o.pad_w << " extra " << o.extra_pad_h << ","
       << o.extra_pad_w << " dilation " << o.dilation_h << "," << o.dilation_w;
}

//! The reference skips the taps that land in the padding; the contract's "zero outside
//! x" makes them products of a zero, which IEEE arithmetic (and im2col, on both
//! executors) turns into NaN when the other factor is ±inf or NaN: a y whose padded taps
//! meet a non-finite weight, a dw whose padded taps meet a non-finite dy. The input
//! gradient drops the padding's column gradients, so dx has no such terms.
inline void padding_products(conv_case const& c, std::vector<double> const& w, std::vector<double> const& dy,
                             mpx_test::reference::conv2d_result& r) {
  auto const& g = c.g;
  auto const& o = g.o;
  for (std::int64_t n = 0; n < g.n; ++n)
    for (std::int64_t oh = 0; oh < c.oh; ++oh)
      for (std::int64_t ow = 0; ow < c.ow; ++ow)
        for (std::int64_t kh = 0; kh < g.kh; ++kh)
          for (std::int64_t kw = 0; kw < g.kw; ++kw) {
            std::int64_t const ih = oh * o.stride_h - o.pad_h + kh * o.dilation_h;
            std::int64_t const iw = ow * o.stride_w - o.pad_w + kw * o.dilation_w;
            if (ih >= 0 && ih < g.h && iw >= 0 && iw < g.w) continue;
            for (std::int64_t ci = 0; ci < g.cin; ++ci)
              for (std::int64_t co = 0; co < g.cout; ++co) {
                auto const wi = static_cast<std::size_t>(((kh * g.kw + kw) * g.cin + ci) * g.cout + co);
                auto const yi = static_cast<std::size_t>(((n * c.oh + oh) * c.ow + ow) * g.cout + co);
                if (!std::isfinite(w[wi])) r.y[yi] = std::numeric_limits<double>::quiet_NaN();
                if (!std::isfinite(dy[yi])) r.dw[wi] = std::numeric_limits<double>::quiet_NaN();
              }
          }
}

enum class conv_op { forward, backward_data, backward_weights, reuse_forward };

//! The invalid variants of a convolution: a zero stride or dilation, a negative padding,
//! channels that differ, a kernel wider than the padded input, the output (y, dx or dw)
//! of the wrong shape, a workspace under one image or of the wrong width, an output
//! overlapping an input, reuse_forward with a chunked workspace.
enum class conv_fault { none, stride, dilation, padding, channels, kernel, output, workspace, alias, reuse_chunked };

template <class Policy, class DW>
void conv_case_run(draw& d, conv_op op) {
  using T = typename Policy::storage_type;
  mpx::host_executor exec;
  conv_case c = draw_conv(d);
  bool const hostile = d.byte() % 4 == 0;
  std::uint8_t const fb = d.byte();
  conv_fault fault = fb < 160 ? conv_fault::none : static_cast<conv_fault>(1 + fb % 9);
  if (fault == conv_fault::reuse_chunked && (op != conv_op::reuse_forward || c.g.n == 1)) fault = conv_fault::output;
  // Workspace rows: the whole batch, a chunk of images, or more than the batch.
  std::int64_t const pixels = c.oh * c.ow;
  std::uint8_t const wb = d.byte();
  std::int64_t ws_rows = c.rows();
  if (op != conv_op::reuse_forward || fault == conv_fault::reuse_chunked) {
    if (wb % 4 == 1) ws_rows = pixels * (1 + static_cast<std::int64_t>(d.byte()) % c.g.n);
    else if (wb % 4 == 2) ws_rows = c.rows() + 1 + d.byte() % 7;
    else if (wb % 4 == 3 && c.g.n > 1) ws_rows = pixels * (1 + static_cast<std::int64_t>(d.byte()) % (c.g.n - 1));
  }
  if (fault == conv_fault::reuse_chunked) ws_rows = pixels * (1 + static_cast<std::int64_t>(d.byte()) % (c.g.n - 1));
  std::int64_t const chunk = std::min(c.g.n, ws_rows / std::max<std::int64_t>(pixels, 1));
  static constexpr char const* op_names[] = {"conv2d_forward", "conv2d_backward_data", "conv2d_backward_weights",
                                             "conv2d_backward_weights(reuse_forward)"};
  call_name call(std::string(op_names[static_cast<int>(op)]) + "<" + std::string(mpx::dtype_name<T>) + ">");
  if (op == conv_op::backward_weights || op == conv_op::reuse_forward) call << " dw " << mpx::dtype_name<DW>;
  describe(call, c);
  call << " workspace rows " << ws_rows << (hostile ? " hostile" : "");

  std::vector<std::int64_t> xs = c.x(), ws = c.w(), ys = c.y(), cols = {ws_rows, c.patch()};
  mpx::conv2d_options o = c.g.o;
  std::vector<std::string_view> names;
  switch (fault) {
    case conv_fault::none: break;
    case conv_fault::stride:
      (d.coin() ? o.stride_h : o.stride_w) = -static_cast<std::int64_t>(d.byte() % 2);
      names = {"strides", "must be >= 1"};
      break;
    case conv_fault::dilation:
      (d.coin() ? o.dilation_h : o.dilation_w) = 0;
      names = {"dilations", "must be >= 1"};
      break;
    case conv_fault::padding:
      *d.pick<std::int64_t*>({&o.pad_h, &o.pad_w, &o.extra_pad_h, &o.extra_pad_w}) = -1 - d.byte() % 2;
      names = {"paddings", ">= 0"};
      break;
    case conv_fault::channels:
      ws[2] += 1;
      names = {"input channels"};
      break;
    case conv_fault::kernel: {
      std::int64_t const padded_h = c.g.h + 2 * o.pad_h + o.extra_pad_h;
      ws[0] = (padded_h - 1) / o.dilation_h + 2 + d.byte() % 2;  // (KH - 1) dilation + 1 > padded_h
      names = {"the kernel spans", "padded input"};
      break;
    }
    case conv_fault::output:
      // y (forward), dy (backward_data: checked against dx's geometry), or dw's Cout
      // (backward_weights: dy then disagrees with it).
      if (op == conv_op::forward || op == conv_op::backward_data) ys[1 + d.byte() % 3] += 1;
      else ws[3] += 1;
      names = {op == conv_op::forward ? "y has shape" : "dy has shape"};
      break;
    case conv_fault::workspace:
      if (d.coin()) cols[1] += 1;
      else cols[0] = pixels - 1;
      names = {"the workspace has shape"};
      break;
    case conv_fault::alias: names = {"overlap"}; break;
    case conv_fault::reuse_chunked: names = {"reuse_forward", "whole batch"}; break;
  }
  if (fault != conv_fault::none && fault != conv_fault::reuse_chunked) {
    call << " invalid:";
    for (auto n : names) call << " '" << n << "'";
    if (fault == conv_fault::alias) {
      // The written output over an input's memory, partially (a shift) or exactly.
      std::vector<std::int64_t> const& in_shape = op == conv_op::backward_weights || op == conv_op::reuse_forward
                                                      ? (d.coin() ? xs : ys)
                                                      : (op == conv_op::forward ? xs : ys);
      std::vector<std::int64_t> const& out_shape =
          op == conv_op::forward ? ys : (op == conv_op::backward_data ? xs : ws);
      std::int64_t in_n = 1, out_n = 1;
      for (auto e : in_shape) in_n *= e;
      for (auto e : out_shape) out_n *= e;
      auto const shift = static_cast<std::int64_t>(d.below(static_cast<std::size_t>(in_n)));
      call << " output over input at +" << shift;
      std::vector<T> memory(static_cast<std::size_t>(in_n + shift + out_n), mpx::cast<T>(0.5));
      mpx::tensor_view<T> const in(memory.data(), mpx::shape(in_shape)), out(memory.data() + shift, mpx::shape(out_shape));
      guarded<T> other(exec, op == conv_op::forward || op == conv_op::backward_data ? ws : (&in_shape == &xs ? ys : xs), 0);
      other.assign(std::vector<T>(other.size(), mpx::cast<T>(0.25)));
      guarded<T> workspace(exec, cols, 0);
      auto const go = [&] {
        if (op == conv_op::forward) mpx::conv2d_forward<Policy>(exec, in, other.cview(), out, workspace.view(), o);
        else if (op == conv_op::backward_data)
          mpx::conv2d_backward_data<Policy>(exec, in, other.cview(), out, workspace.view(), o);
        else if (&in_shape == &xs)
          mpx::conv2d_backward_weights<Policy>(exec, in, other.cview(), out, workspace.view(), o);
        else mpx::conv2d_backward_weights<Policy>(exec, other.cview(), in, out, workspace.view(), o);
      };
      std::string_view const out_name = op == conv_op::forward ? "y" : (op == conv_op::backward_data ? "dx" : "dw");
      return require_refusal(call, {"overlap", out_name}, go);
    }
    guarded<T> x(exec, xs, d), w(exec, ws, d), y(exec, ys, d), workspace(exec, cols, d);
    guarded<DW> dw(exec, ws, d);
    x.assign(std::vector<T>(x.size(), mpx::cast<T>(1.0)));
    w.assign(std::vector<T>(w.size(), mpx::cast<T>(1.0)));
    y.assign(std::vector<T>(y.size(), mpx::cast<T>(1.0)));
    auto const go = [&] {
      if (op == conv_op::forward) mpx::conv2d_forward<Policy>(exec, x.cview(), w.cview(), y.view(), workspace.view(), o);
      else if (op == conv_op::backward_data)
        mpx::conv2d_backward_data<Policy>(exec, y.cview(), w.cview(), x.view(), workspace.view(), o);
      else mpx::conv2d_backward_weights<Policy>(exec, x.cview(), y.cview(), dw.view(), workspace.view(), o);
    };
    if (names.size() == 2) require_refusal(call, {names[0], names[1]}, go);
    else require_refusal(call, {names[0]}, go);
    x.require_guards_intact(call, "x");
    dw.require_guards_intact(call, "dw");
    workspace.require_guards_intact(call, "the workspace");
    return;
  }

  guarded<T> x(exec, c.x(), d), w(exec, c.w(), d), dy(exec, c.y(), d), workspace(exec, cols, d);
  x.assign(d.values<T>(x.size(), hostile));
  w.assign(d.values<T>(w.size(), hostile));
  dy.assign(d.values<T>(dy.size(), hostile));
  call << " offsets " << x.offset() << "," << w.offset() << "," << dy.offset() << "," << workspace.offset();
  auto const xd = widen(x.values()), wd = widen(w.values()), dyd = widen(dy.values());
  auto exact = mpx_test::reference::conv2d(c.g, xd, wd, dyd);
  padding_products(c, wd, dyd, exact);
  auto const finite = mpx_test::reference::conv2d(c.g, finite_part(xd), finite_part(wd), finite_part(dyd));
  double const u_t = unit_roundoff<T>(), u_acc = accumulate_roundoff<T>();
  std::int64_t const taps = c.g.kh * c.g.kw, k = c.patch();

  if (op == conv_op::forward) {
    guarded<T> y(exec, c.y(), d);
    call << "," << y.offset();
    require_accepted(call, [&] { mpx::conv2d_forward<Policy>(exec, x.cview(), w.cview(), y.view(), workspace.view(), o); });
    // y: u_T |exact| + (K + 5) u_acc S, K = KH*KW*Cin.
    for (std::size_t i = 0; i < y.size(); ++i) {
      double const s = finite.y_abs[i];
      double const tol = u_t * std::fabs(exact.y[i]) + static_cast<double>(k + 5) * u_acc * s + conv_underflow<T>(k, c.rows());
      check_element(call, "y", i, y.data()[i], exact.y[i], tol, s, float_max, true);
    }
    y.require_guards_intact(call, "y");
  } else if (op == conv_op::backward_data) {
    guarded<T> dx(exec, c.x(), d);
    call << "," << dx.offset();
    require_accepted(call, [&] {
      mpx::conv2d_backward_data<Policy>(exec, dy.cview(), w.cview(), dx.view(), workspace.view(), o);
    });
    // dx: u_T |exact| + (u_T + (Cout + KH*KW + 6) u_acc)(1 + u_T) S; the column gradients
    // are rounded to T, so an intermediate overflows past T's max.
    for (std::size_t i = 0; i < dx.size(); ++i) {
      double const s = finite.dx_abs[i];
      double const tol = u_t * std::fabs(exact.dx[i]) +
                         (u_t + static_cast<double>(c.g.cout + taps + 6) * u_acc) * (1 + u_t) * s +
                         static_cast<double>(taps) * min_subnormal<T>() + conv_underflow<T>(k, c.rows());
      check_element(call, "dx", i, dx.data()[i], exact.dx[i], tol, s, mpx::detail::to_double(mpx::dtype_traits<T>::max()), false);
    }
    dx.require_guards_intact(call, "dx");
  } else {
    guarded<DW> dw(exec, c.w(), d);
    call << "," << dw.offset();
    mpx::conv2d_columns const columns =
        op == conv_op::reuse_forward ? mpx::conv2d_columns::reuse_forward : mpx::conv2d_columns::recompute;
    if (fault == conv_fault::reuse_chunked) {
      call << " invalid: reuse_forward with " << chunk << " of " << c.g.n << " images per chunk";
      return require_refusal(call, {"reuse_forward", "whole batch"}, [&] {
        mpx::conv2d_backward_weights<Policy>(exec, x.cview(), dy.cview(), dw.view(), workspace.view(), o, columns);
      });
    }
    if (op == conv_op::reuse_forward) {
      guarded<T> y(exec, c.y(), 0);
      require_accepted(call, [&] {
        mpx::conv2d_forward<Policy>(exec, x.cview(), w.cview(), y.view(), workspace.view(), o);
      });
    }
    require_accepted(call, [&] {
      mpx::conv2d_backward_weights<Policy>(exec, x.cview(), dy.cview(), dw.view(), workspace.view(), o, columns);
    });
    // dw (type D): u_D |exact| + ((c - 1) u_D + (R + 4 + c) u_acc) S, R rows per chunk,
    // c chunks.
    std::int64_t const chunks = (c.g.n + chunk - 1) / chunk, r = chunk * pixels;
    double const u_d = unit_roundoff<DW>();
    for (std::size_t i = 0; i < dw.size(); ++i) {
      double const s = finite.dw_abs[i];
      double const tol = u_d * std::fabs(exact.dw[i]) +
                         (static_cast<double>(chunks - 1) * u_d + static_cast<double>(r + 4 + chunks) * u_acc) * s +
                         static_cast<double>(chunks) * min_subnormal<DW>() + conv_underflow<DW>(k, c.rows());
      check_element(call, "dw", i, dw.data()[i], exact.dw[i], tol, s,
                    chunks > 1 ? mpx::detail::to_double(mpx::dtype_traits<DW>::max()) : float_max, chunks == 1);
    }
    dw.require_guards_intact(call, "dw");
  }
  workspace.require_guards_intact(call, "the workspace");
}

// ---- max_pool2d ---------------------------------------------------------------------

struct pool_case {
  std::int64_t n = 1, h = 1, w = 1, c = 1, oh = 0, ow = 0;
  mpx::pool_options o;
  std::int64_t sh() const { return o.stride_h == 0 ? o.pool_h : o.stride_h; }
  std::int64_t sw() const { return o.stride_w == 0 ? o.pool_w : o.stride_w; }
  std::vector<std::int64_t> x() const { return {n, h, w, c}; }
  std::vector<std::int64_t> y() const { return {n, oh, ow, c}; }
};

//! The index into x of the element window (b, i, j, ch) selects, by the contract: the
//! first maximum in scan order, or the first NaN; padding never.
template <class T>
std::int64_t pool_selected(pool_case const& p, T const* x, std::int64_t b, std::int64_t i, std::int64_t j,
                           std::int64_t ch) {
  std::int64_t best = -1;
  double best_v = 0;
  for (std::int64_t r = 0; r < p.o.pool_h; ++r)
    for (std::int64_t q = 0; q < p.o.pool_w; ++q) {
      std::int64_t const ih = i * p.sh() - p.o.pad_h + r, iw = j * p.sw() - p.o.pad_w + q;
      if (ih < 0 || ih >= p.h || iw < 0 || iw >= p.w) continue;
      std::int64_t const at = ((b * p.h + ih) * p.w + iw) * p.c + ch;
      double const v = mpx::detail::to_double(x[at]);
      if (best < 0 || (!std::isnan(best_v) && (v > best_v || std::isnan(v)))) best = at, best_v = v;
    }
  return best;
}

template <class TX, class TD>
void pool_case_run(draw& d, bool backward) {
  mpx::host_executor exec;
  pool_case p;
  p.n = 1 + d.byte() % 3;
  p.h = 1 + d.byte() % 14;
  p.w = 1 + d.byte() % 14;
  p.c = d.pick<std::int64_t>({1, 3, 4, 5, 8, 9, 16, 17});
  p.o.pool_h = 1 + d.byte() % 4;
  p.o.pool_w = 1 + d.byte() % 4;
  p.o.stride_h = d.byte() % 4;
  p.o.stride_w = d.byte() % 4;
  p.o.pad_h = d.byte() % p.o.pool_h;
  p.o.pad_w = d.byte() % p.o.pool_w;
  p.h = std::max(p.h, p.o.pool_h - 2 * p.o.pad_h);
  p.w = std::max(p.w, p.o.pool_w - 2 * p.o.pad_w);
  p.oh = (p.h + 2 * p.o.pad_h - p.o.pool_h) / p.sh() + 1;
  p.ow = (p.w + 2 * p.o.pad_w - p.o.pool_w) / p.sw() + 1;
  std::uint8_t const mode = d.byte();  // values: moderate, hostile, or ties (integers in [-2, 2])
  bool const hostile = mode % 4 == 0, ties = mode % 4 == 1;
  std::uint8_t const fb = d.byte();
  int const fault = fb < 170 ? 0 : 1 + fb % 7;
  call_name call(std::string(backward ? "max_pool2d_backward x " : "max_pool2d_forward x ") +
                 shape_text<TX>(p.x()));
  if (backward) call << " dy " << mpx::dtype_name<TD>;
  call << " pool " << p.o.pool_h << "x" << p.o.pool_w << " stride " << p.o.stride_h << "," << p.o.stride_w << " pad "
       << p.o.pad_h << "," << p.o.pad_w << (hostile ? " hostile" : "") << (ties ? " ties" : "");

  if (fault != 0) {
    auto xs = p.x(), ys = p.y(), dxs = p.x();
    mpx::pool_options o = p.o;
    std::vector<std::string_view> names;
    switch (fault) {
      case 1: (d.coin() ? o.pool_h : o.pool_w) = 0; names = {"pool (", "must be >= 1"}; break;
      case 2: (d.coin() ? o.stride_h : o.stride_w) = -1 - d.byte() % 2; names = {"strides (", "must be >= 1"}; break;
      case 3:
        if (d.coin()) o.pad_h = o.pool_h + d.byte() % 2;
        else o.pad_w = -1;
        names = {"padding (", "smaller than the pool"};
        break;
      case 4: ys[1 + d.byte() % 3] += 1; names = {"y has shape"}; break;
      case 5:
        xs[1] = 1, o.pool_h = 2 + d.byte() % 2, o.pad_h = 0;  // x smaller than the window
        dxs = xs;
        names = {"smaller than the", "window"};
        break;
      case 6: xs[d.byte() % 4] = 0, dxs = xs; names = {"empty extent"}; break;
      default:
        if (backward) dxs[1 + d.byte() % 3] += 1, names = {"dx has shape"};
        else ys[3] += 1, names = {"y has shape"};
        break;
    }
    call << " invalid: x " << shape_text<TX>(xs) << " y " << shape_text<TX>(ys) << " pool " << o.pool_h << "x"
         << o.pool_w << " stride " << o.stride_h << "," << o.stride_w << " pad " << o.pad_h << "," << o.pad_w;
    guarded<TX> x(exec, xs, d), y(exec, ys, d);
    guarded<TD> dy(exec, ys, d), dx(exec, dxs, d);
    x.assign(std::vector<TX>(x.size(), mpx::cast<TX>(1.0)));
    auto const go = [&] {
      if (backward) mpx::max_pool2d_backward(exec, x.cview(), y.cview(), dy.cview(), dx.view(), o);
      else mpx::max_pool2d_forward(exec, x.cview(), y.view(), o);
    };
    require_refusal(call, {names[0], names.size() > 1 ? names[1] : names[0]}, go);
    y.require_guards_intact(call, "y");
    dx.require_guards_intact(call, "dx");
    return;
  }

  guarded<TX> x(exec, p.x(), d), y(exec, p.y(), d);
  if (ties) {
    std::vector<TX> v(x.size());
    for (auto& e : v) e = mpx::cast<TX>(static_cast<double>(d.byte() % 5) - 2.0);
    x.assign(v);
  } else {
    x.assign(d.values<TX>(x.size(), hostile));
  }
  call << " offsets " << x.offset() << "," << y.offset();
  require_accepted(call, [&] { mpx::max_pool2d_forward(exec, x.cview(), y.view(), p.o); });
  // The forward pass is exact: y is a copy of the selected element.
  std::vector<TX> expected(y.size());
  for (std::int64_t b = 0; b < p.n; ++b)
    for (std::int64_t i = 0; i < p.oh; ++i)
      for (std::int64_t j = 0; j < p.ow; ++j)
        for (std::int64_t ch = 0; ch < p.c; ++ch)
          expected[static_cast<std::size_t>(((b * p.oh + i) * p.ow + j) * p.c + ch)] =
              x.data()[pool_selected(p, x.data(), b, i, j, ch)];
  auto const got = y.values();
  require_same<TX>(call, "y", got, expected);
  y.require_guards_intact(call, "y");
  if (!backward) return;

  guarded<TD> dy(exec, p.y(), d), dx(exec, p.x(), d);
  dy.assign(d.values<TD>(dy.size(), hostile));
  call << " dy/dx offsets " << dy.offset() << "," << dx.offset();
  require_accepted(call, [&] { mpx::max_pool2d_backward(exec, x.cview(), y.cview(), dy.cview(), dx.view(), p.o); });
  // dx[i]: the float sum of dy over the windows that selected i, in window order, rounded
  // once to dx's type; 0 where nothing selected it. Exact by the contract.
  std::vector<float> sum(dx.size(), 0.0f);
  for (std::int64_t b = 0; b < p.n; ++b)
    for (std::int64_t i = 0; i < p.oh; ++i)
      for (std::int64_t j = 0; j < p.ow; ++j)
        for (std::int64_t ch = 0; ch < p.c; ++ch)
          sum[static_cast<std::size_t>(pool_selected(p, x.data(), b, i, j, ch))] +=
              mpx::cast<float>(dy.data()[((b * p.oh + i) * p.ow + j) * p.c + ch]);
  std::vector<TD> dx_expected(dx.size());
  for (std::size_t i = 0; i < sum.size(); ++i) dx_expected[i] = mpx::cast<TD>(sum[i]);
  auto const dx_got = dx.values();
  require_same<TD>(call, "dx", dx_got, dx_expected);
  dx.require_guards_intact(call, "dx");
}

//! Pooling with y (or dx) over x's memory: refused, naming the overlap.
template <class T>
void pool_alias_case(draw& d, bool backward) {
  mpx::host_executor exec;
  std::int64_t const n = 1 + d.byte() % 2, h = 2 + d.byte() % 6, w = 2 + d.byte() % 6, c = 1 + d.byte() % 4;
  mpx::pool_options const o{};
  std::vector<std::int64_t> const xs{n, h, w, c}, ys{n, (h - 2) / 2 + 1, (w - 2) / 2 + 1, c};
  std::int64_t const xn = n * h * w * c, yn = ys[0] * ys[1] * ys[2] * ys[3];
  auto const shift = static_cast<std::int64_t>(d.below(static_cast<std::size_t>(xn)));
  call_name call(std::string(backward ? "max_pool2d_backward" : "max_pool2d_forward") + " x " + shape_text<T>(xs));
  call << (backward ? " dx" : " y") << " over x at +" << shift;
  std::vector<T> memory(static_cast<std::size_t>(2 * xn + shift + yn), mpx::cast<T>(1.0));
  mpx::tensor_view<T const> const xv(memory.data(), mpx::shape(xs));
  if (!backward) {
    mpx::tensor_view<T> const yv(memory.data() + shift, mpx::shape(ys));
    return require_refusal(call, {"overlap", "x", "y"}, [&] { mpx::max_pool2d_forward(exec, xv, yv, o); });
  }
  guarded<T> y(exec, ys, 0), dy(exec, ys, 0);
  y.assign(std::vector<T>(y.size(), mpx::cast<T>(1.0)));
  dy.assign(std::vector<T>(dy.size(), mpx::cast<T>(1.0)));
  mpx::tensor_view<T> const dxv(memory.data() + shift, mpx::shape(xs));
  require_refusal(call, {"overlap", "dx", "x"},
                  [&] { mpx::max_pool2d_backward(exec, xv, y.cview(), dy.cview(), dxv, o); });
}

template <class F>
void by_storage(draw& d, F&& f) {
  switch (d.byte() % 3) {
    case 0: return f(mpx::float32{}, float{});
    case 1: return f(mpx::mixed_float16{}, half{});
    default: return f(mpx::mixed_bfloat16{}, bfloat16{});
  }
}

template <class TA, class TB>
void fp8_by_c(draw& d) {
  switch (d.byte() % 3) {
    case 0: return fp8_gemm_case<TA, TB, float>(d);
    case 1: return fp8_gemm_case<TA, TB, half>(d);
    default: return fp8_gemm_case<TA, TB, bfloat16>(d);
  }
}

template <class TX>
void fp8_block_by_c(draw& d) {
  switch (d.byte() % 3) {
    case 0: return fp8_block_case<TX, float>(d);
    case 1: return fp8_block_case<TX, half>(d);
    default: return fp8_block_case<TX, bfloat16>(d);
  }
}

template <class TX>
void pool_by_dy(draw& d, bool backward) {
  switch (d.byte() % 3) {
    case 0: return pool_case_run<TX, float>(d, backward);
    case 1: return pool_case_run<TX, half>(d, backward);
    default: return pool_case_run<TX, bfloat16>(d, backward);
  }
}

}  // namespace matmul_detail

void run_matmul(draw& d) {
  using namespace matmul_detail;
  using mpx::float8_e4m3;
  using mpx::float8_e5m2;
  std::uint8_t const op = d.byte();
  if (op >= 243) {  // the block-scaled recipe (the first bytes the other cases had kept their meaning)
    switch (d.byte() % 3) {
      case 0: return fp8_block_by_c<float>(d);
      case 1: return fp8_block_by_c<half>(d);
      default: return fp8_block_by_c<bfloat16>(d);
    }
  }
  switch (op % 9) {
    case 0: {  // gemm, C in the storage type or float; the last three read their operands in
               // a compute type other than the storage type (rounded as read)
      std::uint8_t const p = d.byte() % 6;
      bool const c_storage = d.coin();
      switch (p) {
        case 0: return gemm_case<mpx::float32, float>(d);  // C float either way
        case 1: return c_storage ? gemm_case<mpx::mixed_float16, half>(d) : gemm_case<mpx::mixed_float16, float>(d);
        case 2:
          return c_storage ? gemm_case<mpx::mixed_bfloat16, bfloat16>(d) : gemm_case<mpx::mixed_bfloat16, float>(d);
        case 3:
          return c_storage ? gemm_case<mpx::policy<float, bfloat16>, float>(d)
                           : gemm_case<mpx::policy<float, half>, float>(d);
        case 4:
          return c_storage ? gemm_case<mpx::policy<half, bfloat16>, half>(d)
                           : gemm_case<mpx::policy<half, bfloat16>, float>(d);
        default:
          return c_storage ? gemm_case<mpx::policy<bfloat16, half>, bfloat16>(d)
                           : gemm_case<mpx::policy<bfloat16, half>, float>(d);
      }
    }
    case 1:  // fp8_gemm: e4m3 x e4m3, e4m3 x e5m2, e5m2 x e4m3
      switch (d.byte() % 3) {
        case 0: return fp8_by_c<float8_e4m3, float8_e4m3>(d);
        case 1: return fp8_by_c<float8_e4m3, float8_e5m2>(d);
        default: return fp8_by_c<float8_e5m2, float8_e4m3>(d);
      }
    case 2: return by_storage(d, [&](auto policy, auto) { conv_case_run<decltype(policy), float>(d, conv_op::forward); });
    case 3:
      return by_storage(d, [&](auto policy, auto) { conv_case_run<decltype(policy), float>(d, conv_op::backward_data); });
    case 4:
    case 5:
      return by_storage(d, [&](auto policy, auto storage) {
        using P = decltype(policy);
        conv_op const op = d.coin() ? conv_op::backward_weights : conv_op::reuse_forward;
        if (d.coin()) conv_case_run<P, float>(d, op);
        else conv_case_run<P, decltype(storage)>(d, op);
      });
    case 6:
    case 7: {
      bool const backward = d.coin();
      switch (d.byte() % 3) {
        case 0: return pool_by_dy<float>(d, backward);
        case 1: return pool_by_dy<half>(d, backward);
        default: return pool_by_dy<bfloat16>(d, backward);
      }
    }
    default: {
      bool const backward = d.coin();
      switch (d.byte() % 3) {
        case 0: return pool_alias_case<float>(d, backward);
        case 1: return pool_alias_case<half>(d, backward);
        default: return pool_alias_case<bfloat16>(d, backward);
      }
    }
  }
}

}  // namespace mpx_fuzz::api
