// Dropout with a counter-based generator: Philox4x32-10 (core/philox.hpp) is an MPX_HD
// function, so the host and the GPU draw the same mask bit for bit from (seed, offset,
// element index), and backward can regenerate the mask instead of storing it.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/philox.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/tensor.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

namespace mpx {

//! Which elements dropout keeps and how much it scales them by.
struct dropout_options {
  float rate = 0.5f;          //!< Probability of dropping an element; in [0, 1).
  std::uint64_t seed = 0;     //!< Philox key.
  std::uint64_t offset = 0;   //!< Upper 64 bits of the Philox counter: a fresh value per step or layer.
  //! Optional: a count in the executor's memory, read when the kernel runs and added to
  //! offset. A CUDA graph replays the offset it captured; a count that the graph itself
  //! advances (advance_dropout_step) gives every replay a fresh mask.
  std::uint64_t const* offset_step = nullptr;
};

namespace detail {

//! The keep test for 4 consecutive elements 4g .. 4g+3: the Philox output for counter
//! (g, offset) and key seed, word k < threshold. threshold = round((1 - rate) * 2^32).
struct dropout_mask_source {
  philox_key key;
  std::uint32_t offset_lo, offset_hi;
  std::uint64_t threshold;
  std::uint64_t const* offset_step;  // added to the offset where the kernel runs, if given
  //! This source with *offset_step added to its offset (read where the pass runs).
  MPX_HD dropout_mask_source resolved() const noexcept {
    if (!offset_step) return *this;
    std::uint64_t const offset = ((static_cast<std::uint64_t>(offset_hi) << 32) | offset_lo) + *offset_step;
    return {key, static_cast<std::uint32_t>(offset), static_cast<std::uint32_t>(offset >> 32), threshold, nullptr};
  }
  MPX_HD philox_counter draw(std::uint64_t group) const noexcept {
    return philox4x32_10(philox_counter{{static_cast<std::uint32_t>(group), static_cast<std::uint32_t>(group >> 32),
                                         offset_lo, offset_hi}},
                         key);
  }
  MPX_HD bool keep(std::uint32_t word) const noexcept { return static_cast<std::uint64_t>(word) < threshold; }
};

//! The one check of a dropout rate (the kernels', the dropout layer's, attention's):
//! mpx::invalid_argument from `op` unless 0 <= rate < 1 (NaN fails).
inline void require_dropout_rate(std::string_view op, float rate) {
  if (!(rate >= 0.0f && rate < 1.0f))
    fail<invalid_argument>(op, "rate must be in [0, 1), got " + to_text(rate) +
                                   " (rate 1 would drop everything and scale by 1 / 0)");
}

inline dropout_mask_source make_mask_source(std::string_view op, dropout_options const& o) {
  require_dropout_rate(op, o.rate);
  auto const keep = 1.0 - static_cast<double>(o.rate);
  auto const threshold = static_cast<std::uint64_t>(std::llround(keep * 4294967296.0));
  return {philox_key{{static_cast<std::uint32_t>(o.seed), static_cast<std::uint32_t>(o.seed >> 32)}},
          static_cast<std::uint32_t>(o.offset), static_cast<std::uint32_t>(o.offset >> 32), threshold, o.offset_step};
}

//! The four passes of the dropout kernel. Each computes y = x * (kept ? scale : 0), so a
//! NaN in x stays NaN even where it is dropped; they differ in where `kept` comes from.
enum class dropout_pass {
  forward_writing_mask,  //!< draws the mask and stores it (uint8, 0 or 1)
  forward,               //!< draws the mask, stores nothing
  backward_redrawn,      //!< draws the forward pass's mask again from the same options
  backward_from_mask,    //!< reads a stored mask; no generator
};

template <dropout_pass Pass, class In, class Out>
MPX_HD inline void dropout_group(dropout_mask_source const& src, In const* in, Out* out, std::uint8_t* mask_out,
                                 std::uint8_t const* mask_in, float scale, std::size_t group, std::size_t n) {
  std::size_t const base = group * 4;
  philox_counter r{};
  if constexpr (Pass != dropout_pass::backward_from_mask) r = src.draw(group);
  MPX_UNROLL
  for (int k = 0; k < 4; ++k) {
    std::size_t const i = base + static_cast<std::size_t>(k);
    if (i < n) {
      bool kept;
      if constexpr (Pass == dropout_pass::backward_from_mask) kept = mask_in[i] != 0;
      else kept = src.keep(r.v[k]);
      if constexpr (Pass == dropout_pass::forward_writing_mask) mask_out[i] = kept ? 1 : 0;
      out[i] = cast<Out>(cast<float>(in[i]) * (kept ? scale : 0.0f));
    }
  }
}

//! One group of four elements of a dropout pass (a draw of the generator each).
template <dropout_pass Pass, class In, class Out>
struct dropout_groups {
  dropout_mask_source source;  // resolved where the pass runs (it may read a step counter there)
  In const* in;
  Out* out;
  std::uint8_t* mask_out;
  std::uint8_t const* mask_in;
  float scale;
  std::size_t n;
  MPX_HD void operator()(std::size_t g) const {
    dropout_group<Pass>(source.resolved(), in, out, mask_out, mask_in, scale, g, n);
  }
};

template <dropout_pass Pass, class Exec, class In, class Out>
void dropout_run(Exec const& exec, dropout_mask_source const& src, In const* in, Out* out, std::uint8_t* mask_out,
                 std::uint8_t const* mask_in, float scale, std::size_t n) {
  for_each_index(exec, (n + 3) / 4, dropout_groups<Pass, In, Out>{src, in, out, mask_out, mask_in, scale, n});
}

//! ++*count.
struct increment_count {
  std::uint64_t* count;
  MPX_HD void operator()() const { ++*count; }
};

inline float dropout_scale(float rate) { return 1.0f / (1.0f - rate); }

//! The checks every dropout call shares (in's and out's shapes, the mask's when given, the
//! rate), then the pass.
template <dropout_pass Pass, class Exec, class InView, class OutView>
void dropout_checked(std::string_view op, Exec const& exec, dropout_options const& options, InView const& in,
                     OutView const& out, std::uint8_t* mask_out, std::uint8_t const* mask_in,
                     shape const* mask_shape) {
  constexpr bool backward = Pass == dropout_pass::backward_redrawn || Pass == dropout_pass::backward_from_mask;
  std::string_view const in_name = backward ? "dy" : "x", out_name = backward ? "dx" : "y";
  require_same_shape(op, in_name, in.shape(), out_name, out.shape());
  require_in_place_or_disjoint(op, out_name, out, in_name, in);
  if (mask_shape) require_same_shape(op, in_name, in.shape(), "the mask", *mask_shape);
  auto const src = make_mask_source(op, options);
  dropout_run<Pass>(exec, src, in.data(), out.data(), mask_out, mask_in, dropout_scale(options.rate), in.size());
}

}  // namespace detail

//! ++step[0] where the executor computes, in stream order: between two dropout passes
//! that read it through dropout_options::offset_step, so each draws a fresh mask, also
//! when a CUDA graph replays both. Asynchronous on a cuda_executor.
template <executor Exec, class Space>
void advance_dropout_step(Exec const& exec, tensor_view<std::uint64_t, Space> step) {
  detail::require_access<Exec, Space>();
  if (step.size() != 1)
    detail::fail<shape_error>("advance_dropout_step", "expected one counter, got shape " + step.shape().to_string());
  detail::run_once(exec, detail::increment_count{step.data()});
}

//! Whether dropout with these options keeps element `index` of a tensor: what
//! dropout_forward writes into its mask, on either executor. Throws as dropout_forward
//! does for a rate outside [0, 1).
inline bool dropout_keeps(dropout_options const& options, std::uint64_t index) {
  if (options.offset_step)
    detail::fail<invalid_argument>("dropout_keeps",
                                   "give the options with offset_step folded into offset (offset_step null): the "
                                   "count may live in device memory");
  auto const src = detail::make_mask_source("dropout_keeps", options);
  return src.keep(src.draw(index / 4).word(index % 4));
}

//! y = x * mask / (1 - rate), mask[i] = 1 with probability 1 - rate, drawn by Philox from
//! (seed, offset, i); computed in float, rounded once to y's dtype. Writes the mask
//! (uint8, 0 or 1, same shape as x) when one is given. rate 0 is the identity; rate
//! outside [0, 1) throws mpx::invalid_argument. y may be x. A NaN in x stays NaN (0 * NaN).
//! Asynchronous on a cuda_executor.
template <executor Exec, tensor_like X, tensor_like Y>
void dropout_forward(Exec const& exec, dropout_options const& options, X&& x, Y&& y) {
  auto [xv, yv] = detail::views_for<Exec>(x, y);
  static_assert(!std::is_const_v<typename decltype(yv)::element_type>, "mpx::dropout_forward: y is const");
  detail::dropout_checked<detail::dropout_pass::forward>("dropout_forward", exec, options, xv, yv, nullptr, nullptr,
                                                        nullptr);
}

//! As above, and writes the mask (uint8 of x's shape) for dropout_backward.
template <executor Exec, tensor_like X, tensor_like Y, tensor_like M>
void dropout_forward(Exec const& exec, dropout_options const& options, X&& x, Y&& y, M&& mask) {
  auto [xv, yv, mv] = detail::views_for<Exec>(x, y, mask);
  static_assert(std::is_same_v<typename decltype(mv)::element_type, std::uint8_t>,
                "mpx::dropout_forward: the mask is a mutable tensor of std::uint8_t");
  static_assert(!std::is_const_v<typename decltype(yv)::element_type>, "mpx::dropout_forward: y is const");
  detail::dropout_checked<detail::dropout_pass::forward_writing_mask>("dropout_forward", exec, options, xv, yv,
                                                                     mv.data(), nullptr, &mv.shape());
}

//! dx = dy * mask / (1 - rate), the mask regenerated from options (which must be the
//! forward pass's). dx may be dy. Asynchronous on a cuda_executor.
template <executor Exec, tensor_like DY, tensor_like DX>
void dropout_backward(Exec const& exec, dropout_options const& options, DY&& dy, DX&& dx) {
  auto [dyv, dxv] = detail::views_for<Exec>(dy, dx);
  static_assert(!std::is_const_v<typename decltype(dxv)::element_type>, "mpx::dropout_backward: dx is const");
  detail::dropout_checked<detail::dropout_pass::backward_redrawn>("dropout_backward", exec, options, dyv, dxv,
                                                                 nullptr, nullptr, nullptr);
}

//! dx = dy * mask / (1 - rate) from the mask dropout_forward stored (only options.rate
//! is used). dx may be dy. Asynchronous on a cuda_executor.
template <executor Exec, tensor_like DY, tensor_like DX, tensor_like M>
void dropout_backward(Exec const& exec, dropout_options const& options, DY&& dy, DX&& dx, M&& mask) {
  auto [dyv, dxv, mv] = detail::views_for<Exec>(dy, dx, mask);
  static_assert(std::is_same_v<typename decltype(mv)::value_type, std::uint8_t>,
                "mpx::dropout_backward: the mask is a tensor of std::uint8_t");
  static_assert(!std::is_const_v<typename decltype(dxv)::element_type>, "mpx::dropout_backward: dx is const");
  detail::dropout_checked<detail::dropout_pass::backward_from_mask>("dropout_backward", exec, options, dyv, dxv,
                                                                   nullptr, mv.data(), &mv.shape());
}

}  // namespace mpx
