// mpx::lstm_forward and mpx::lstm_backward: a Keras LSTM layer's sequence pass and its
// backpropagation through time, on any executor. The matrix products are mpx::gemm
// calls (one for the input projections of all steps, one per step for the recurrence);
// the gates are one fused pointwise pass per step, in float, with the cell state in float.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/activation.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/kernels/gemm.hpp>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <type_traits>

// Layouts. The user's tensors are batch-major, as Keras's: x [N, T, F], h and dh
// [N, T, U], dx [N, T, F]. The kernel W is [F, 4U] and the recurrent kernel R [U, 4U],
// their columns the gates in Keras's order i, f, c (candidate), o, U columns each.
// A step's product h_{t-1} R needs h_{t-1} as one contiguous [N, U] matrix, which a
// batch-major tensor is not, so everything the steps touch lives in the workspace
// time-major: a copy of x [T, N, F], the states h [T + 1, N, U] (h_0 first), the gate
// pre-activations [T, N, 4U] and the cell states [T + 1, N, U]. The step kernel writes
// each h_t twice, into the workspace and into the user's h; the only transposing copies
// are x on the way in and dx on the way out.
//
// Precision. Storage (x, W, R, h, dx) is the policy's storage_type; the products sum
// in float (mpx::gemm); gate pre-activations, the activations, the cell state c_t and
// every gradient inside a step are float. Only h_t (the output, and the next step's
// gemm operand) and the gate gradients (the operand of the backward products) are
// rounded to storage. The cell state is never 16-bit: with f close to 1 it integrates
// small increments i * g over many steps, and a half c would lose every increment
// below 2^-11 of c (a bfloat16 one, below 2^-8).
//
// Saved for backward: the gate pre-activations, not the activations. The derivatives
// are evaluated at the pre-activation (sigmoid'(z) from z stays exact in relative terms;
// from the output, s (1 - s) is 0 once s rounds to 1), as mpx::activation_backward does.

namespace mpx {

//! How lstm_backward writes the parameter gradients.
struct lstm_backward_options {
  //! false: dkernel, drecurrent_kernel and dbias are overwritten. true: the gradients
  //! of this call are added to them (a sequence split into chunks, shared weights).
  bool accumulate = false;
};

namespace detail {

template <class P>
constexpr void require_float_lstm() {
  static_assert(policy_type<P>,
                "mpx::lstm_forward / mpx::lstm_backward: the template argument must be a policy such as "
                "mpx::mixed_float16, as in mpx::lstm_forward<mpx::mixed_float16>(exec, x, ...)");
  static_assert(float_accumulating_policy<P>,
                "mpx::lstm_forward and mpx::lstm_backward accumulate in float32 (the cell state, the gates "
                "and the products over time steps lose their small terms in 16 bits), but this policy's "
                "accumulate_type is 16-bit: use mpx::mixed_float16, mpx::mixed_bfloat16, mpx::float32 or a "
                "policy<Storage, Compute, float>");
}

template <class Policy, class T>
constexpr void require_lstm_storage() {
  if constexpr (policy_type<Policy>)
    static_assert(std::is_same_v<T, typename Policy::storage_type>,
                  "mpx::lstm_forward / mpx::lstm_backward: x, kernel, recurrent_kernel, h (and h0) and dx must "
                  "hold the policy's storage_type (half for mpx::mixed_float16, bfloat16 for "
                  "mpx::mixed_bfloat16, float for mpx::float32); convert them with mpx::cast first");
}

template <class Policy, class T>
constexpr void require_lstm_float_or_storage() {
  if constexpr (policy_type<Policy>)
    static_assert(std::is_same_v<T, typename Policy::storage_type> || std::is_same_v<T, float>,
                  "mpx::lstm_forward / mpx::lstm_backward: bias and dh hold float or the policy's storage_type");
}

template <class T>
constexpr void require_lstm_float() {
  static_assert(std::is_same_v<T, float>,
                "mpx::lstm_forward / mpx::lstm_backward: the workspace, c0 and the parameter gradients "
                "(dkernel, drecurrent_kernel, dbias) are float32 tensors");
}

//! Where each part of the workspace starts, in floats from its beginning. Every part
//! starts on a 256-byte boundary (cuBLASLt's best alignment, whole 16-byte vectors).
struct lstm_layout {
  // Written by the forward pass, read by the backward pass:
  std::size_t gates = 0;    //!< float [T, N, 4U]: pre-activations x W + h R + b
  std::size_t cells = 0;    //!< float [T + 1, N, U]: c_0, c_1, ..., c_T
  std::size_t x_steps = 0;  //!< storage [T, N, F]: x, time-major
  std::size_t h_steps = 0;  //!< storage [T + 1, N, U]: h_0, h_1, ..., h_T
  // Scratch of the backward pass:
  std::size_t dgates = 0;     //!< storage [T, N, 4U]: d loss / d pre-activations
  std::size_t dh = 0;         //!< float [N, U]: the gradient reaching h_{t-1} through R
  std::size_t dc = 0;         //!< float [N, U]: the gradient reaching c_{t-1}
  std::size_t dx_steps = 0;   //!< storage [T, N, F]: dx, time-major
  std::size_t dbias = 0;      //!< float [4U]: this call's bias gradient, when accumulating
  std::size_t total = 0;      //!< floats in all
};

inline constexpr std::size_t lstm_align_floats = 64;

template <class S>
lstm_layout lstm_layout_for(std::int64_t batch, std::int64_t steps, std::int64_t features, std::int64_t units) {
  if (batch < 0 || steps < 0 || features < 0 || units < 0)
    fail<invalid_argument>("lstm_workspace_elements", "extents must be >= 0, got N = " + std::to_string(batch) +
                                                          ", T = " + std::to_string(steps) + ", F = " +
                                                          std::to_string(features) + ", U = " + std::to_string(units));
  auto const n = static_cast<std::size_t>(batch), t = static_cast<std::size_t>(steps);
  auto const f = static_cast<std::size_t>(features), u = static_cast<std::size_t>(units);
  lstm_layout l;
  std::size_t at = 0;
  auto const part = [&at](std::size_t count, std::size_t bytes_each) {
    std::size_t const start = at;
    std::size_t const floats = (count * bytes_each + sizeof(float) - 1) / sizeof(float);
    at += (floats + lstm_align_floats - 1) / lstm_align_floats * lstm_align_floats;
    return start;
  };
  l.gates = part(t * n * 4 * u, sizeof(float));
  l.cells = part((t + 1) * n * u, sizeof(float));
  l.x_steps = part(t * n * f, sizeof(S));
  l.h_steps = part((t + 1) * n * u, sizeof(S));
  l.dgates = part(t * n * 4 * u, sizeof(S));
  l.dh = part(n * u, sizeof(float));
  l.dc = part(n * u, sizeof(float));
  l.dx_steps = part(t * n * f, sizeof(S));
  l.dbias = part(4 * u, sizeof(float));
  l.total = at;
  return l;
}

//! out[b, a, c] = cast<Out>(in[a, b, c]) for in [A, B, C]: batch-major <-> time-major.
template <class In, class Out>
struct lstm_swap_leading {
  In const* in;
  Out* out;
  std::size_t a, b, c;
  MPX_HD void operator()(std::size_t k) const {
    std::size_t const col = k % c;
    std::size_t const row = k / c;  // = bi * a + ai in out
    std::size_t const ai = row % a, bi = row / a;
    out[k] = cast<Out>(in[(ai * b + bi) * c + col]);
  }
};

//! One step of the forward pass for element k = (n, j) of [N, U]: adds the bias to the
//! four pre-activations (x W + h R, from the gemms) and keeps them; c_t, h_t.
template <class S, class B>
struct lstm_forward_cell {
  float* gates;          //!< [N, 4U] of this step
  B const* bias;         //!< [4U]
  float const* c_prev;   //!< [N, U]
  float* c;              //!< [N, U]
  S* h_next;             //!< [N, U], the workspace's h_t
  S* h_out;              //!< h[:, t, :] of the user's [N, T, U]
  std::size_t units;
  std::size_t out_row;   //!< T * U: the distance between batch rows of h_out
  MPX_HD void operator()(std::size_t k) const {
    std::size_t const n = k / units, j = k % units;
    float* g = gates + n * 4 * units;
    float const zi = g[j] + cast<float>(bias[j]);
    float const zf = g[units + j] + cast<float>(bias[units + j]);
    float const zg = g[2 * units + j] + cast<float>(bias[2 * units + j]);
    float const zo = g[3 * units + j] + cast<float>(bias[3 * units + j]);
    g[j] = zi;
    g[units + j] = zf;
    g[2 * units + j] = zg;
    g[3 * units + j] = zo;
    act::sigmoid const sig;
    act::tanh const th;
    float const ct = sig.forward(zf) * c_prev[k] + sig.forward(zi) * th.forward(zg);
    c[k] = ct;
    S const ht = cast<S>(sig.forward(zo) * th.forward(ct));
    h_next[k] = ht;
    h_out[n * out_row + j] = ht;
  }
};

//! One step of the backward pass for element k = (n, j) of [N, U], from the saved
//! pre-activations and cell states: the four gate gradients (rounded to storage for the
//! products) and the gradient reaching c_{t-1}. dh_rec is the gradient that reached
//! h_t through R from step t + 1; on the last step (first = true) it and dc are zero
//! and not read.
template <class S, class DH>
struct lstm_backward_cell {
  float const* gates;   //!< [N, 4U] pre-activations of this step
  float const* c_prev;  //!< [N, U]
  float const* c;       //!< [N, U]
  DH const* dh_out;     //!< dh[:, t, :] of the user's [N, T, U]
  float const* dh_rec;  //!< [N, U]
  float* dc;            //!< [N, U]: in, from step t + 1; out, for step t - 1
  S* dgates;            //!< [N, 4U] of this step
  std::size_t units;
  std::size_t out_row;
  bool first;
  MPX_HD void operator()(std::size_t k) const {
    std::size_t const n = k / units, j = k % units;
    float const* g = gates + n * 4 * units;
    float const zi = g[j], zf = g[units + j], zg = g[2 * units + j], zo = g[3 * units + j];
    act::sigmoid const sig;
    act::tanh const th;
    float const i = sig.forward(zi), f = sig.forward(zf), cand = th.forward(zg), o = sig.forward(zo);
    float const ct = c[k];
    float const dh = cast<float>(dh_out[n * out_row + j]) + (first ? 0.0f : dh_rec[k]);
    float const dct = (first ? 0.0f : dc[k]) + dh * o * th.derivative(ct);
    S* d = dgates + n * 4 * units;
    d[j] = cast<S>(dct * cand * sig.derivative(zi));
    d[units + j] = cast<S>(dct * c_prev[k] * sig.derivative(zf));
    d[2 * units + j] = cast<S>(dct * i * th.derivative(zg));
    d[3 * units + j] = cast<S>(dh * th.forward(ct) * sig.derivative(zo));
    dc[k] = dct * f;
  }
};

//! The extents of one LSTM call.
struct lstm_extents {
  std::int64_t n = 0, t = 0, f = 0, u = 0;
};

//! Throws shape_error "<what> of shape [..] does not match <other> of shape [..] (<why>)".
inline void lstm_require_shape(std::string_view op, std::string_view what, shape const& got, shape const& expected,
                               std::string_view other, shape const& other_shape, mpx::source_location loc) {
  if (got == expected) return;
  fail<shape_error>(op,
                    std::string(what) + " of shape " + got.to_string() + " does not match " + std::string(other) +
                        " of shape " + other_shape.to_string() + " (" + std::string(what) + " must be " +
                        expected.to_string() + ")",
                    loc);
}

inline void lstm_require_workspace(std::string_view op, shape const& ws, std::size_t needed, lstm_extents const& e,
                                   mpx::source_location loc) {
  if (ws.size() >= needed) return;
  fail<shape_error>(op, "a workspace of shape " + ws.to_string() + " holds " + std::to_string(ws.size()) +
                            " floats, but N = " + std::to_string(e.n) + ", T = " + std::to_string(e.t) +
                            ", F = " + std::to_string(e.f) + ", U = " + std::to_string(e.u) + " need " +
                            std::to_string(needed) + " (mpx::lstm_workspace_elements<Policy>(N, T, F, U))",
                    loc);
}

template <class S, class Space>
tensor_view<S, Space> lstm_part(float* base, std::size_t offset, shape const& s) {
  return tensor_view<S, Space>(reinterpret_cast<S*>(base + offset), s);
}

//! A tensor of an LSTM call, as the memory it covers.
struct lstm_memory {
  std::string_view name;
  void const* data;
  std::size_t bytes;
};
template <class V>
lstm_memory lstm_memory_of(std::string_view name, V const& v) {
  return {name, v.data(), v.size_bytes()};
}

//! The passes write their outputs step after step while still reading the inputs (and
//! the workspace), so no output may share memory with any other tensor of the call.
inline void lstm_require_apart(std::string_view op, std::initializer_list<lstm_memory> outputs,
                               std::initializer_list<lstm_memory> tensors, mpx::source_location loc) {
  auto const at = [](lstm_memory const& m) { return reinterpret_cast<std::uintptr_t>(m.data); };
  for (auto const& o : outputs)
    for (auto const& t : tensors)
      if (t.name != o.name && o.bytes != 0 && t.bytes != 0 && at(o) < at(t) + t.bytes && at(t) < at(o) + o.bytes)
        fail<invalid_argument>(op, std::string(o.name) + " and " + std::string(t.name) +
                                       " overlap in memory; give them separate buffers", loc);
}

template <class Policy, class Exec, class XV, class WV, class RV, class BV, class HV, class WSV>
void lstm_forward_impl(Exec const& exec, XV const& xv, WV const& wv, RV const& rv, BV const& bv,
                       typename Policy::storage_type const* h0, float const* c0, HV const& hv, WSV const& wsv,
                       mpx::source_location loc) {
  using S = typename Policy::storage_type;
  using space = memory_space_t<Exec>;
  constexpr std::string_view op = "lstm_forward";
  shape const& xs = xv.shape();
  if (xs.rank() != 3) fail<shape_error>(op, "x must be [batch, steps, features], got shape " + xs.to_string(), loc);
  shape const& rs = rv.shape();
  if (rs.rank() != 2 || rs[1] != 4 * rs[0])
    fail<shape_error>(op, "recurrent_kernel must be [units, 4 * units] (gates i, f, c, o), got shape " +
                              rs.to_string() + " beside x of shape " + xs.to_string(),
                      loc);
  lstm_extents const e{xs[0], xs[1], xs[2], rs[0]};
  lstm_require_shape(op, "kernel", wv.shape(), shape{e.f, 4 * e.u}, "x", xs, loc);
  lstm_require_shape(op, "bias", bv.shape(), shape{4 * e.u}, "recurrent_kernel", rs, loc);
  lstm_require_shape(op, "h", hv.shape(), shape{e.n, e.t, e.u}, "x", xs, loc);
  lstm_layout const l = lstm_layout_for<S>(e.n, e.t, e.f, e.u);
  lstm_require_workspace(op, wsv.shape(), l.total, e, loc);
  {
    std::size_t const state_elements = static_cast<std::size_t>(e.n * e.u);
    lstm_memory const h_out = lstm_memory_of("h", hv), ws_out = lstm_memory_of("the workspace", wsv);
    lstm_require_apart(op, {h_out, ws_out},
                       {lstm_memory_of("x", xv), lstm_memory_of("kernel", wv), lstm_memory_of("recurrent_kernel", rv),
                        lstm_memory_of("bias", bv), h_out, ws_out,
                        {"h0", h0, h0 ? state_elements * sizeof(S) : 0}, {"c0", c0, c0 ? state_elements * sizeof(float) : 0}},
                       loc);
  }

  auto const n = static_cast<std::size_t>(e.n), t_count = static_cast<std::size_t>(e.t);
  auto const f = static_cast<std::size_t>(e.f), u = static_cast<std::size_t>(e.u);
  float* ws = wsv.data();
  auto const gates = lstm_part<float, space>(ws, l.gates, shape{e.t * e.n, 4 * e.u});
  auto const x_steps = lstm_part<S, space>(ws, l.x_steps, shape{e.t * e.n, e.f});
  auto const state = shape{e.n, e.u};
  S* const h_steps = reinterpret_cast<S*>(ws + l.h_steps);
  float* const cells = ws + l.cells;

  // The initial state, then the input projections of all steps in one product.
  if (h0) copy(exec, tensor_view<S const, space>(h0, state), tensor_view<S, space>(h_steps, state));
  else fill(exec, tensor_view<S, space>(h_steps, state), cast<S>(0.0f));
  if (c0) copy(exec, tensor_view<float const, space>(c0, state), tensor_view<float, space>(cells, state));
  else fill(exec, tensor_view<float, space>(cells, state), 0.0f);
  if (n * t_count == 0 || u == 0) return;
  for_each_index(exec, n * t_count * f, lstm_swap_leading<S, S>{xv.data(), x_steps.data(), n, t_count, f});
  gemm<Policy>(exec, x_steps, wv, gates);

  gemm_options add_to_c;
  add_to_c.beta = 1.0f;
  for (std::size_t t = 0; t < t_count; ++t) {
    float* const gates_t = gates.data() + t * n * 4 * u;
    S* const h_prev = h_steps + t * n * u;
    gemm<Policy>(exec, tensor_view<S const, space>(h_prev, state), rv,
                 tensor_view<float, space>(gates_t, shape{e.n, 4 * e.u}), add_to_c);
    for_each_index(exec, n * u,
                   lstm_forward_cell<S, value_t<BV>>{gates_t, bv.data(), cells + t * n * u, cells + (t + 1) * n * u,
                                                     h_prev + n * u, hv.data() + t * u, u, t_count * u});
  }
}

}  // namespace detail

//! Floats of workspace that lstm_forward and lstm_backward need for a batch of N
//! sequences of T steps, F features and U units under Policy (the storage-typed parts
//! are packed two to a float for 16-bit storage): T N (7.5 U + F) + 3.5 N U + 4 U
//! floats for 16-bit storage, T N (10 U + 2 F) + 4 N U + 4 U for float, each part
//! rounded up to 64 floats. Allocate it once (a float tensor of any
//! shape) and reuse it from call to call. Throws mpx::invalid_argument for a negative extent.
template <class Policy>
std::size_t lstm_workspace_elements(std::int64_t batch, std::int64_t steps, std::int64_t features,
                                    std::int64_t units) {
  detail::require_float_lstm<Policy>();
  return detail::lstm_layout_for<typename Policy::storage_type>(batch, steps, features, units).total;
}

//! The forward pass of a Keras LSTM layer (activation tanh, recurrent_activation
//! sigmoid, use_bias, return_sequences = true) over a batch of sequences:
//!   [zi zf zg zo] = x_t W + h_{t-1} R + b      (gate order i, f, c, o; sums in float)
//!   c_t = sigmoid(zf) c_{t-1} + sigmoid(zi) tanh(zg)                 (float)
//!   h_t = sigmoid(zo) tanh(c_t)                     (rounded once to storage)
//! x: [N, T, F]; kernel W: [F, 4U]; recurrent_kernel R: [U, 4U]; bias b: [4U], float or
//! storage; h: [N, T, U], every step's output (the last step, h[:, T-1, :], is Keras's
//! return_sequences = false output). x, W, R and h hold Policy::storage_type. h_0 = c_0 = 0.
//! workspace: float, at least lstm_workspace_elements<Policy>(N, T, F, U) elements; it
//! keeps what lstm_backward needs, so leave it untouched in between. N = 0 or T = 0 is
//! allowed (nothing to compute). Shape mismatches throw mpx::shape_error naming both
//! shapes. Asynchronous on a cuda_executor (1 + T products and T + 1 pointwise launches).
template <class Policy, executor Exec, tensor_like X, tensor_like W, tensor_like R, tensor_like B, tensor_like H,
          tensor_like WS>
void lstm_forward(Exec const& exec, X&& x, W&& kernel, R&& recurrent_kernel, B&& bias, H&& h, WS&& workspace,
                  mpx::source_location loc = mpx::source_location::current()) {
  detail::require_float_lstm<Policy>();
  detail::require_access<Exec, space_t<X>, space_t<W>, space_t<R>, space_t<B>, space_t<H>, space_t<WS>>();
  detail::require_lstm_storage<Policy, value_t<X>>();
  detail::require_lstm_storage<Policy, value_t<W>>();
  detail::require_lstm_storage<Policy, value_t<R>>();
  detail::require_lstm_storage<Policy, value_t<H>>();
  detail::require_lstm_float_or_storage<Policy, value_t<B>>();
  detail::require_lstm_float<value_t<WS>>();
  auto const hv = mpx::view(h);
  auto const wsv = mpx::view(workspace);
  static_assert(!std::is_const_v<typename decltype(hv)::element_type> &&
                    !std::is_const_v<typename decltype(wsv)::element_type>,
                "mpx::lstm_forward: h and the workspace are outputs and cannot be const");
  detail::lstm_forward_impl<Policy>(exec, mpx::view(x), mpx::view(kernel), mpx::view(recurrent_kernel),
                                    mpx::view(bias), nullptr, nullptr, hv, wsv, loc);
}

//! lstm_forward from a given initial state (Keras's initial_state = [h0, c0]): h0
//! [N, U] in storage, c0 [N, U] in float. lstm_backward does not return the gradients
//! with respect to h0 and c0.
template <class Policy, executor Exec, tensor_like X, tensor_like W, tensor_like R, tensor_like B, tensor_like H0,
          tensor_like C0, tensor_like H, tensor_like WS>
void lstm_forward(Exec const& exec, X&& x, W&& kernel, R&& recurrent_kernel, B&& bias, H0&& h0, C0&& c0, H&& h,
                  WS&& workspace, mpx::source_location loc = mpx::source_location::current()) {
  detail::require_float_lstm<Policy>();
  detail::require_access<Exec, space_t<X>, space_t<W>, space_t<R>, space_t<B>, space_t<H0>, space_t<C0>,
                         space_t<H>, space_t<WS>>();
  detail::require_lstm_storage<Policy, value_t<X>>();
  detail::require_lstm_storage<Policy, value_t<W>>();
  detail::require_lstm_storage<Policy, value_t<R>>();
  detail::require_lstm_storage<Policy, value_t<H0>>();
  detail::require_lstm_storage<Policy, value_t<H>>();
  detail::require_lstm_float_or_storage<Policy, value_t<B>>();
  detail::require_lstm_float<value_t<C0>>();
  detail::require_lstm_float<value_t<WS>>();
  auto const xv = mpx::view(x);
  auto const h0v = mpx::view(h0);
  auto const c0v = mpx::view(c0);
  auto const hv = mpx::view(h);
  auto const wsv = mpx::view(workspace);
  static_assert(!std::is_const_v<typename decltype(hv)::element_type> &&
                    !std::is_const_v<typename decltype(wsv)::element_type>,
                "mpx::lstm_forward: h and the workspace are outputs and cannot be const");
  auto const rv = mpx::view(recurrent_kernel);
  if (xv.shape().rank() == 3 && rv.shape().rank() == 2) {
    shape const state{xv.shape()[0], rv.shape()[0]};
    detail::lstm_require_shape("lstm_forward", "h0", h0v.shape(), state, "x", xv.shape(), loc);
    detail::lstm_require_shape("lstm_forward", "c0", c0v.shape(), state, "x", xv.shape(), loc);
  }
  detail::lstm_forward_impl<Policy>(exec, xv, mpx::view(kernel), rv, mpx::view(bias), h0v.data(), c0v.data(), hv,
                                    wsv, loc);
}

//! Backpropagation through time for lstm_forward, from the gradient dh [N, T, U] of the
//! loss with respect to every output step (zeros but for the last step where only the
//! last output is used), float or storage, and the workspace the forward pass filled:
//!   dx [N, T, F]         storage, rounded once from float sums,
//!   dkernel [F, 4U]      float, = sum over steps x_t^T dz_t,
//!   drecurrent_kernel [U, 4U]  float, = sum over steps h_{t-1}^T dz_t,
//!   dbias [4U]           float, = sum over steps and batch of dz_t,
//! dz_t being the gate pre-activation gradients, computed in float and rounded to
//! storage for the products (as cuDNN does; a loss scale keeps them above half's
//! underflow). The parameter gradients are overwritten, or added to with
//! options.accumulate. kernel and recurrent_kernel are the forward pass's. The workspace
//! is read, and its backward scratch part written; a second backward pass from the
//! same forward pass is allowed. Shape mismatches throw mpx::shape_error naming both
//! shapes. Asynchronous on a cuda_executor (T + 3 products, T + 1 pointwise launches and
//! a column sum).
template <class Policy, executor Exec, tensor_like DH, tensor_like W, tensor_like R, tensor_like DX, tensor_like DW,
          tensor_like DR, tensor_like DB, tensor_like WS>
void lstm_backward(Exec const& exec, DH&& dh, W&& kernel, R&& recurrent_kernel, DX&& dx, DW&& dkernel,
                   DR&& drecurrent_kernel, DB&& dbias, WS&& workspace, lstm_backward_options const& options = {},
                   mpx::source_location loc = mpx::source_location::current()) {
  detail::require_float_lstm<Policy>();
  detail::require_access<Exec, space_t<DH>, space_t<W>, space_t<R>, space_t<DX>, space_t<DW>, space_t<DR>,
                         space_t<DB>, space_t<WS>>();
  detail::require_lstm_float_or_storage<Policy, value_t<DH>>();
  detail::require_lstm_storage<Policy, value_t<W>>();
  detail::require_lstm_storage<Policy, value_t<R>>();
  detail::require_lstm_storage<Policy, value_t<DX>>();
  detail::require_lstm_float<value_t<DW>>();
  detail::require_lstm_float<value_t<DR>>();
  detail::require_lstm_float<value_t<DB>>();
  detail::require_lstm_float<value_t<WS>>();
  using S = typename Policy::storage_type;
  using space = memory_space_t<Exec>;
  auto const dhv = mpx::view(dh);
  auto const wv = mpx::view(kernel);
  auto const rv = mpx::view(recurrent_kernel);
  auto const dxv = mpx::view(dx);
  auto const dwv = mpx::view(dkernel);
  auto const drv = mpx::view(drecurrent_kernel);
  auto const dbv = mpx::view(dbias);
  auto const wsv = mpx::view(workspace);
  static_assert(!std::is_const_v<typename decltype(dxv)::element_type> &&
                    !std::is_const_v<typename decltype(dwv)::element_type> &&
                    !std::is_const_v<typename decltype(drv)::element_type> &&
                    !std::is_const_v<typename decltype(dbv)::element_type> &&
                    !std::is_const_v<typename decltype(wsv)::element_type>,
                "mpx::lstm_backward: dx, dkernel, drecurrent_kernel, dbias and the workspace are outputs and "
                "cannot be const");
  constexpr std::string_view op = "lstm_backward";
  shape const& hs = dhv.shape();
  if (hs.rank() != 3) detail::fail<shape_error>(op, "dh must be [batch, steps, units], got shape " + hs.to_string(), loc);
  shape const& rs = rv.shape();
  detail::lstm_require_shape(op, "recurrent_kernel", rs, shape{hs[2], 4 * hs[2]}, "dh", hs, loc);
  shape const& ws = wv.shape();
  if (ws.rank() != 2 || ws[1] != 4 * hs[2])
    detail::fail<shape_error>(op, "kernel of shape " + ws.to_string() + " does not match dh of shape " +
                                      hs.to_string() + " (kernel must be [features, 4 * units])",
                              loc);
  detail::lstm_extents const e{hs[0], hs[1], ws[0], hs[2]};
  detail::lstm_require_shape(op, "dx", dxv.shape(), shape{e.n, e.t, e.f}, "dh", hs, loc);
  detail::lstm_require_shape(op, "dkernel", dwv.shape(), ws, "kernel", ws, loc);
  detail::lstm_require_shape(op, "drecurrent_kernel", drv.shape(), rs, "recurrent_kernel", rs, loc);
  detail::lstm_require_shape(op, "dbias", dbv.shape(), shape{4 * e.u}, "recurrent_kernel", rs, loc);
  detail::lstm_layout const l = detail::lstm_layout_for<S>(e.n, e.t, e.f, e.u);
  detail::lstm_require_workspace(op, wsv.shape(), l.total, e, loc);
  {
    using detail::lstm_memory_of;
    detail::lstm_memory const outputs[] = {lstm_memory_of("dx", dxv), lstm_memory_of("dkernel", dwv),
                                           lstm_memory_of("drecurrent_kernel", drv), lstm_memory_of("dbias", dbv),
                                           lstm_memory_of("the workspace", wsv)};
    detail::lstm_require_apart(op, {outputs[0], outputs[1], outputs[2], outputs[3], outputs[4]},
                               {outputs[0], outputs[1], outputs[2], outputs[3], outputs[4], lstm_memory_of("dh", dhv),
                                lstm_memory_of("kernel", wv), lstm_memory_of("recurrent_kernel", rv)},
                               loc);
  }

  auto const n = static_cast<std::size_t>(e.n), t_count = static_cast<std::size_t>(e.t);
  auto const f = static_cast<std::size_t>(e.f), u = static_cast<std::size_t>(e.u);
  float* ws_base = wsv.data();
  float const* const gates = ws_base + l.gates;
  float const* const cells = ws_base + l.cells;
  auto const dgates = detail::lstm_part<S, space>(ws_base, l.dgates, shape{e.t * e.n, 4 * e.u});
  float* const dh_rec = ws_base + l.dh;
  float* const dc = ws_base + l.dc;
  shape const state{e.n, e.u};

  // (No sequences: nothing flows back through the steps, and dh has no address to offset.)
  for (std::size_t step = n > 0 ? t_count : 0; step-- > 0;) {
    S* const dgates_t = dgates.data() + step * n * 4 * u;
    for_each_index(exec, n * u,
                           detail::lstm_backward_cell<S, value_t<DH>>{
                               gates + step * n * 4 * u, cells + step * n * u, cells + (step + 1) * n * u,
                               dhv.data() + step * u, dh_rec, dc, dgates_t, u, t_count * u, step + 1 == t_count});
    if (step > 0)  // the gradient reaching h_{t-1} through R: dz_t R^T
      gemm<Policy>(exec, tensor_view<S const, space>(dgates_t, shape{e.n, 4 * e.u}), rv,
                   tensor_view<float, space>(dh_rec, state), gemm_options{false, true, 1.0f, 0.0f});
  }

  // The parameter gradients over all steps at once: the steps are rows of the products.
  float const beta = options.accumulate ? 1.0f : 0.0f;
  auto const x_steps = detail::lstm_part<S const, space>(ws_base, l.x_steps, shape{e.t * e.n, e.f});
  auto const h_prev = detail::lstm_part<S const, space>(ws_base, l.h_steps, shape{e.t * e.n, e.u});
  gemm<Policy>(exec, x_steps, dgates, dwv, gemm_options{true, false, 1.0f, beta});
  gemm<Policy>(exec, h_prev, dgates, drv, gemm_options{true, false, 1.0f, beta});
  if (options.accumulate) {
    auto const db_call = detail::lstm_part<float, space>(ws_base, l.dbias, shape{4 * e.u});
    bias_gradient(exec, dgates, db_call);
    axpy(exec, 1.0f, db_call, dbv);
  } else {
    bias_gradient(exec, dgates, dbv);
  }
  if (n * t_count * f == 0) return;
  auto const dx_steps = detail::lstm_part<S, space>(ws_base, l.dx_steps, shape{e.t * e.n, e.f});
  gemm<Policy>(exec, dgates, wv, dx_steps, gemm_options{false, true, 1.0f, 0.0f});
  for_each_index(exec, n * t_count * f,
                         detail::lstm_swap_leading<S, S>{dx_steps.data(), dxv.data(), t_count, n, f});
}

}  // namespace mpx
