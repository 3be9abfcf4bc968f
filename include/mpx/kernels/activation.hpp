// Pointwise activations (relu, sigmoid, tanh, gelu, gelu_tanh), the one list a layer
// selects from (mpx::activations, mpx::activation), forward and backward on any executor,
// alone or fused with a bias add, y[i, j] = act(x[i, j] + bias[j]), and with the bias
// gradient db[j] = sum_i dz[i, j]. The arithmetic is float, rounded once to the output.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/convert_span.hpp>
#include <mpx/core/elementary.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/host_threads.hpp>
#include <mpx/exec/host_scratch.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/exec/columns.hpp>
#include <mpx/kernels/elementwise.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

// Why float for 16-bit storage too: these are memory-bound passes, so float arithmetic
// costs nothing, while half arithmetic would round every intermediate (exp, erf, the
// product with dy) and a transcendental in half has no more hardware behind it than in
// float. Casting in, computing in float and rounding once on the way out keeps each
// result within one rounding of storage (plus a few float ulps), for every policy.
//
// Why the backward pass takes the pre-activation x and not the output y: in 16 bits the
// output has already lost what the derivative needs (sigmoid(8) rounds to 1 in half, so
// y * (1 - y) would be 0 instead of 3.4e-4). Reading x instead of y moves the same bytes,
// and recomputing exp or erf is free in a memory-bound pass.

namespace mpx {

//! The activations: MPX_HD functors on float with forward(x) and derivative(x) (the
//! derivative at the pre-activation x). Each is written to stay accurate where the
//! textbook form cancels (sigmoid' for large |x|, gelu for x << 0).
namespace act {

//! f(x) = x (Keras "linear"): a bias add alone.
struct identity {
  static constexpr std::string_view name = "linear";
  MPX_HD float forward(float x) const noexcept { return x; }
  MPX_HD float derivative(float) const noexcept { return 1.0f; }
};

//! f(x) = max(x, 0); f'(0) = 0, as TensorFlow takes it. NaN stays NaN, both ways.
struct relu {
  static constexpr std::string_view name = "relu";
  MPX_HD float forward(float x) const noexcept { return x < 0.0f ? 0.0f : x; }
  MPX_HD float derivative(float x) const noexcept { return x > 0.0f ? 1.0f : (x <= 0.0f ? 0.0f : x); }
};

//! f(x) = 1 / (1 + e^-x); f'(x) = e^-|x| / (1 + e^-|x|)^2, exact in relative terms for
//! every x (the form f(1 - f) rounds to 0 once f rounds to 1).
struct sigmoid {
  static constexpr std::string_view name = "sigmoid";
  MPX_HD float forward(float x) const noexcept { return 1.0f / (1.0f + exp_float(-x)); }
  MPX_HD float derivative(float x) const noexcept {
    float const e = exp_float(-::fabsf(x));
    float const d = 1.0f + e;
    return e / (d * d);
  }
};

//! f(x) = tanh(x); f'(x) = 1 / cosh^2(x) = 4 e / (1 + e)^2 with e = e^-2|x| (1 - f^2
//! loses every digit once |f| rounds to 1).
struct tanh {
  static constexpr std::string_view name = "tanh";
  MPX_HD float forward(float x) const noexcept { return ::tanhf(x); }
  MPX_HD float derivative(float x) const noexcept {
    float const e = exp_float(-2.0f * ::fabsf(x));
    float const d = 1.0f + e;
    return 4.0f * e / (d * d);
  }
};

//! Keras's default gelu (approximate=False): f(x) = x Phi(x) = x/2 erfc(-x/sqrt 2);
//! f'(x) = Phi(x) + x phi(x). erfc, not 1 + erf, so f(-5) = -1.4e-6 keeps its digits.
struct gelu {
  static constexpr std::string_view name = "gelu";
  MPX_HD float forward(float x) const noexcept { return 0.5f * x * erfc_float(-x * 0.70710678118654752f); }
  MPX_HD float derivative(float x) const noexcept {
    float const cdf = 0.5f * erfc_float(-x * 0.70710678118654752f);
    float const pdf = 0.39894228040143268f * exp_neg_half_square(x);
    return cdf + x * pdf;
  }
};

//! gelu's tanh approximation (Keras approximate=True): f(x) = x/2 (1 + tanh(u)),
//! u = sqrt(2/pi) (x + 0.044715 x^3), computed as x sigmoid(2u) to avoid 1 + tanh -> 0.
struct gelu_tanh {
  static constexpr std::string_view name = "gelu_tanh";
  MPX_HD float forward(float x) const noexcept { return x / (1.0f + exp_float(-2.0f * u(x))); }
  MPX_HD float derivative(float x) const noexcept {
    float const v = 2.0f * u(x);
    float const s = 1.0f / (1.0f + exp_float(-v));
    float const e = exp_float(-::fabsf(v));
    float const d = 1.0f + e;
    float const ds = e / (d * d);  // s (1 - s), without the cancellation
    float const dv = 2.0f * 0.79788456080286536f * (1.0f + 3.0f * 0.044715f * x * x);
    return s + x * ds * dv;
  }

 private:
  MPX_HD static float u(float x) noexcept { return 0.79788456080286536f * (x + 0.044715f * x * x * x); }
};

}  // namespace act

//! What the algorithms below accept as an activation: act::relu and friends, or a
//! user's MPX_HD functor with the same two members.
template <class A>
concept activation_function = std::is_trivially_copyable_v<A> && requires(A const& a, float x) {
  { a.forward(x) } -> std::same_as<float>;
  { a.derivative(x) } -> std::same_as<float>;
};

//! A list of activation functors (a type list; nothing is stored).
template <class... A>
struct activation_list {
  static constexpr std::size_t size = sizeof...(A);
};

//! The activations a layer can select by value: the one list. mpx::activation, its
//! names, its lookup by name and with_activation's dispatch all derive from it, so a new
//! activation is a functor above and an entry here (and, if wanted, an alias below).
using activations = activation_list<act::identity, act::relu, act::sigmoid, act::tanh, act::gelu, act::gelu_tanh>;

namespace detail {
template <class A, class... L>
constexpr std::size_t activation_index(activation_list<L...>) noexcept {
  constexpr bool same[] = {std::is_same_v<A, L>...};
  std::size_t i = 0;
  while (i < sizeof...(L) && !same[i]) ++i;
  return i;
}
template <class... L>
constexpr auto activation_names(activation_list<L...>) noexcept {
  return std::array<std::string_view, sizeof...(L)>{L::name...};
}
inline constexpr auto activation_name_table = activation_names(activations{});

template <class F, class First, class... Rest>
decltype(auto) visit_activation(std::size_t index, F& f, activation_list<First, Rest...>) {
  if constexpr (sizeof...(Rest) == 0) {
    return f(First{});
  } else {
    if (index == 0) return f(First{});
    return visit_activation(index - 1, f, activation_list<Rest...>{});
  }
}
}  // namespace detail

//! Whether A is in mpx::activations (and so selectable by a layer).
template <class A>
concept listed_activation = detail::activation_index<A>(activations{}) < activations::size;

//! An activation chosen at run time from mpx::activations: what a layer's configuration
//! holds. Converts from any listed functor (`mpx::act::gelu_tanh{}`); the aliases below
//! spell the usual ones as `mpx::activation::relu`. Default: linear (no activation).
class activation {
 public:
  static constexpr act::identity linear{};
  static constexpr act::relu relu{};
  static constexpr act::sigmoid sigmoid{};
  static constexpr act::tanh tanh{};
  static constexpr act::gelu gelu{};            //!< exact, with erf (Keras's default)
  static constexpr act::gelu_tanh gelu_tanh{};  //!< the tanh approximation (Keras approximate=True)

  constexpr activation() noexcept = default;
  template <listed_activation A>
  constexpr activation(A) noexcept : index_(static_cast<std::uint8_t>(detail::activation_index<A>(activations{}))) {}

  //! The name Keras gives it: "linear", "relu", "sigmoid", "tanh", "gelu", "gelu_tanh".
  [[nodiscard]] constexpr std::string_view name() const noexcept { return detail::activation_name_table[index_]; }
  //! Its position in mpx::activations.
  [[nodiscard]] constexpr std::size_t index() const noexcept { return index_; }
  //! The activation called `name`; mpx::invalid_argument listing the names otherwise.
  [[nodiscard]] static activation from_name(std::string_view name) {
    for (std::size_t i = 0; i < activations::size; ++i)
      if (detail::activation_name_table[i] == name) return activation(static_cast<std::uint8_t>(i));
    std::string known;
    for (std::string_view n : detail::activation_name_table) known += (known.empty() ? "" : ", ") + std::string(n);
    detail::fail<invalid_argument>("mpx::activation", "no activation is called '" + std::string(name) +
                                                          "' (the activations are " + known + ")");
  }
  friend constexpr bool operator==(activation, activation) noexcept = default;

 private:
  constexpr explicit activation(std::uint8_t index) noexcept : index_(index) {}
  std::uint8_t index_ = 0;
};

//! The activation's name ("relu").
[[nodiscard]] constexpr std::string_view to_string(activation a) noexcept { return a.name(); }

//! Calls f with the mpx::act functor `a` stands for (one instantiation of f per
//! activation in the list); returns what f returns, which must be one type for all.
template <class F>
decltype(auto) with_activation(activation a, F&& f) {
  return detail::visit_activation(a.index(), f, activations{});
}

namespace ops {
//! act(x), computed in float, rounded once to Out.
template <class Act, class Out>
struct activation_of {
  Act act;
  template <class In>
  MPX_HD Out operator()(In x) const noexcept {
    return cast<Out>(act.forward(cast<float>(x)));
  }
};
//! dy * act'(x), computed in float, rounded once to Out.
template <class Act, class Out>
struct activation_gradient_of {
  Act act;
  template <class X, class DY>
  MPX_HD Out operator()(X x, DY dy) const noexcept {
    return cast<Out>(cast<float>(dy) * act.derivative(cast<float>(x)));
  }
};
}  // namespace ops

namespace detail {

//! [rows, cols] of a tensor whose last axis meets a bias of `cols` elements; throws
//! mpx::shape_error naming both shapes otherwise.
inline void bias_layout(std::string_view op, shape const& x, shape const& bias, std::size_t& rows,
                        std::size_t& cols) {
  if (x.rank() < 1 || bias.rank() != 1 || bias[0] != x[x.rank() - 1])
    fail<shape_error>(op, "a bias of shape " + bias.to_string() + " does not match the last axis of x of shape " +
                              x.to_string() + " (the bias must be rank 1, as long as x's last axis)");
  cols = static_cast<std::size_t>(bias[0]);
  rows = cols ? x.size() / cols : 0;
}

//! The fused bias passes' per-row buffers (host_scratch_floats), slot by slot.
struct bias_activation_scratch {};
enum bias_scratch_slot : std::size_t { bias_slot, x_row_slot, y_row_slot, dy_row_slot };

template <bias_scratch_slot Slot>
float* bias_row_buffer(std::size_t cols) {
  return host_scratch_floats<bias_activation_scratch, Slot>(cols);
}

//! Row (or bias) x of cols elements as floats: x itself when it is float, else widened
//! into the slot's buffer.
template <bias_scratch_slot Slot, class X>
float const* bias_row_as_float(X const* x, std::size_t cols) {
  return host_floats_of<bias_activation_scratch, Slot>(x, cols);
}

//! y[i] = act(x[i] + bias[i % cols]) in float, rounded once.
template <class Act, class X, class B, class Y>
struct bias_activation_element {
  Act act;
  X const* x;
  B const* bias;
  Y* y;  // may be x
  std::size_t rows, cols;
  MPX_HD void operator()(std::size_t i) const {
    y[i] = cast<Y>(act.forward(cast<float>(x[i]) + cast<float>(bias[i % cols])));
  }
  // The host's loop, the same arithmetic row by row: each 16-bit row is widened and
  // rounded as a whole (eight elements per instruction with F16C).
  // Rows are shared among the host's threads; each widens into its own scratch.
  void host_loop() const {
    host_parallel_ranges(rows, rows * cols, [&](std::size_t begin, std::size_t end) {
      float const* b = bias_row_as_float<bias_slot>(bias, cols);
      float* y_row = bias_row_buffer<y_row_slot>(cols);
      for (std::size_t r = begin; r < end; ++r) {
        float const* xr = bias_row_as_float<x_row_slot>(x + r * cols, cols);
        for (std::size_t j = 0; j < cols; ++j) y_row[j] = act.forward(xr[j] + b[j]);
        round_span(y_row, y + r * cols, cols);
      }
    });
  }
};

// The terms of the bias gradient: dz = dy * act'(x + bias) in float; dx = dz rounded
// (when dx is given) as a side output; db sums the float dz (not the rounded dx) in the
// column reduction (exec/columns.hpp). x and bias are null for the identity.
template <class Act, class X, class B, class DY, class DX>
struct bias_backward_terms {
  Act act;
  X const* x;
  B const* bias;
  DY const* dy;
  DX* dx;
  std::size_t cols;

  MPX_HD void operator()(std::size_t r, std::size_t j, float (&t)[1]) const {
    std::size_t const i = r * cols + j;
    float dz = cast<float>(dy[i]);
    if constexpr (!std::is_same_v<Act, act::identity>) dz *= act.derivative(cast<float>(x[i]) + cast<float>(bias[j]));
    if (dx) dx[i] = cast<DX>(dz);
    t[0] = dz;
  }
  // The host's row at a time: each 16-bit row widened and rounded as a whole.
  void row(std::size_t r, float* dz) const {
    float const* dyr = bias_row_as_float<dy_row_slot>(dy + r * cols, cols);
    if constexpr (std::is_same_v<Act, act::identity>) {
      std::copy(dyr, dyr + cols, dz);
    } else {
      float const* b = bias_row_as_float<bias_slot>(bias, cols);
      float const* xr = bias_row_as_float<x_row_slot>(x + r * cols, cols);
      for (std::size_t j = 0; j < cols; ++j) dz[j] = dyr[j] * act.derivative(xr[j] + b[j]);
    }
    if (dx) round_span(dz, dx + r * cols, cols);
  }
};

// Shared by bias_activation_backward and bias_gradient: dx may be null (not written),
// and for act::identity x and bias are not read.
template <class Act, class Exec, class X, class B, class DY, class DX, class DB>
void bias_backward(Exec const& exec, Act const& act, X const* x, B const* bias, DY const* dy, DX* dx, DB* db,
                   std::size_t rows, std::size_t cols) {
  column_reduce<1, float>(exec, bias_backward_terms<Act, X, B, DY, DX>{act, x, bias, dy, dx, cols},
                          store_sum_as<float, DB>{db}, rows, cols);
}

}  // namespace detail

//! y = act(x), elementwise over any shape; computed in float, rounded once to y's dtype.
//! y may be x. Shapes must match (else mpx::shape_error). Asynchronous on a cuda_executor.
template <activation_function Act, executor Exec, tensor_like X, tensor_like Y>
void activation_forward(Exec const& exec, Act act, X&& x, Y&& y) {
  detail::require_same_shape("activation_forward", "x", mpx::view(x).shape(), "y", mpx::view(y).shape());
  transform(exec, y, ops::activation_of<Act, value_t<Y>>{act}, x);
}

//! dx = dy * act'(x), x the pre-activation input of the forward pass (see the note at
//! the top of this header); float arithmetic, one rounding to dx's dtype. dx may be dy.
template <activation_function Act, executor Exec, tensor_like X, tensor_like DY, tensor_like DX>
void activation_backward(Exec const& exec, Act act, X&& x, DY&& dy, DX&& dx) {
  detail::require_same_shape("activation_backward", "x", mpx::view(x).shape(), "dy", mpx::view(dy).shape());
  detail::require_same_shape("activation_backward", "dy", mpx::view(dy).shape(), "dx", mpx::view(dx).shape());
  transform(exec, dx, ops::activation_gradient_of<Act, value_t<DX>>{act}, x, dy);
}

//! y[i, j] = act(x[i, j] + bias[j]) over x of shape [..., cols] (row-major) and a bias of
//! shape [cols]: the bias add and the activation in one pass, in float (x + bias is not
//! rounded to storage first), one rounding to y's dtype. y may be x. Asynchronous on a
//! cuda_executor. Shape mismatches throw mpx::shape_error naming both shapes.
template <activation_function Act, executor Exec, tensor_like X, tensor_like B, tensor_like Y>
void bias_activation_forward(Exec const& exec, Act act, X&& x, B&& bias, Y&& y) {
  auto [xv, bv, yv] = detail::views_for<Exec>(x, bias, y);
  static_assert(!std::is_const_v<typename decltype(yv)::element_type>, "mpx::bias_activation_forward: y is const");
  std::size_t rows = 0, cols = 0;
  detail::bias_layout("bias_activation_forward", xv.shape(), bv.shape(), rows, cols);
  detail::require_same_shape("bias_activation_forward", "x", xv.shape(), "y", yv.shape());
  for_each_index(exec, rows * cols,
                         detail::bias_activation_element<Act, value_t<X>, value_t<B>, value_t<Y>>{
                             act, xv.data(), bv.data(), yv.data(), rows, cols});
}

//! The backward pass of bias_activation_forward: dz = dy * act'(x + bias) in float;
//! dx = dz rounded to dx's dtype (dx may be dy); db[j] = sum over rows of the float dz,
//! accumulated in float and rounded once to db's dtype. Deterministic: the column
//! reduction of exec/columns.hpp (no atomics; its order depends only on the
//! shape). Asynchronous on a cuda_executor (it allocates its partial sums
//! on the stream, 256 x cols floats at most).
template <activation_function Act, executor Exec, tensor_like X, tensor_like B, tensor_like DY, tensor_like DX,
          tensor_like DB>
void bias_activation_backward(Exec const& exec, Act act, X&& x, B&& bias, DY&& dy, DX&& dx, DB&& db) {
  auto [xv, bv, dyv, dxv, dbv] = detail::views_for<Exec>(x, bias, dy, dx, db);
  static_assert(!std::is_const_v<typename decltype(dxv)::element_type> &&
                    !std::is_const_v<typename decltype(dbv)::element_type>,
                "mpx::bias_activation_backward: dx and db are outputs and cannot be const");
  std::size_t rows = 0, cols = 0;
  detail::bias_layout("bias_activation_backward", xv.shape(), bv.shape(), rows, cols);
  detail::require_same_shape("bias_activation_backward", "x", xv.shape(), "dy", dyv.shape());
  detail::require_same_shape("bias_activation_backward", "x", xv.shape(), "dx", dxv.shape());
  detail::require_same_shape("bias_activation_backward", "bias", bv.shape(), "dbias", dbv.shape());
  detail::bias_backward(exec, act, xv.data(), bv.data(), dyv.data(), dxv.data(), dbv.data(), rows, cols);
}

//! db[j] = sum_i dy[i, j] over dy of shape [..., cols] and db of shape [cols]: the bias
//! gradient of a layer without activation, accumulated in float, deterministic (as
//! bias_activation_backward). Asynchronous on a cuda_executor.
template <executor Exec, tensor_like DY, tensor_like DB>
void bias_gradient(Exec const& exec, DY&& dy, DB&& db) {
  auto [dyv, dbv] = detail::views_for<Exec>(dy, db);
  static_assert(!std::is_const_v<typename decltype(dbv)::element_type>, "mpx::bias_gradient: db is const");
  std::size_t rows = 0, cols = 0;
  detail::bias_layout("bias_gradient", dyv.shape(), dbv.shape(), rows, cols);
  using dy_t = value_t<DY>;
  using db_t = value_t<DB>;
  detail::bias_backward(exec, act::identity{}, static_cast<dy_t const*>(nullptr), static_cast<db_t const*>(nullptr),
                        dyv.data(), static_cast<dy_t*>(nullptr), dbv.data(), rows, cols);
}

}  // namespace mpx
