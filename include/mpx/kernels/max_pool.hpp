// 2-D max pooling over NHWC tensors, forward and backward, on any executor. A selection,
// so the forward pass is exact in every dtype; the gradient goes to the first maximum of
// each window in scan order, and a NaN in a window wins (it propagates, never vanishes).
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/convert_span.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/host_vector.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/host_scratch.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/tensor.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

// Which element a window selects, the rule both passes and both executors share: scan
// the window row by row (then column by column), keep the first element, and replace it
// by a later one only if the kept one is not NaN and the later one is greater or NaN.
// So the output is the first maximum, or the first NaN if there is one (as
// tf.nn.max_pool and torch.max_pool2d propagate NaN), and ties go to the first in scan
// order. Padding (pad_h, pad_w) is never selected: a window holds at least one element
// of x, since padding is smaller than the window.
//
// The backward pass recomputes each window's selection from x rather than storing
// indices: no workspace, and the scan costs what reading an index would. Each dx element
// is the float sum of dy over the windows that selected it, in window order, rounded
// once (one term, so exact, when windows do not overlap); elements no window selected
// get 0.

namespace mpx {

//! The geometry of a 2-D pooling window. Output extent (floor, Keras's 'valid'):
//! OH = (H + 2 pad_h - pool_h) / stride_h + 1, likewise OW.
struct pool_options {
  std::int64_t pool_h = 2, pool_w = 2;      //!< window extent, >= 1
  std::int64_t stride_h = 0, stride_w = 0;  //!< >= 1; 0 means the window's extent (Keras strides=None)
  std::int64_t pad_h = 0, pad_w = 0;        //!< never-selected rows (columns) on each side; 0 <= pad < pool
};

namespace detail {

struct pool_geometry {
  std::int64_t n = 0, h = 0, w = 0, c = 0, oh = 0, ow = 0;
  std::int64_t pool_h = 0, pool_w = 0, stride_h = 0, stride_w = 0, pad_h = 0, pad_w = 0;
};

//! The geometry of pooling x, or mpx::shape_error / invalid_argument naming x's shape.
inline pool_geometry pool_shapes(std::string_view op, shape const& x, pool_options const& o,
                                 mpx::source_location loc) {
  if (x.rank() != 4) fail<shape_error>(op, "x " + x.to_string() + " must be rank 4 [N, H, W, C]", loc);
  pool_geometry g;
  g.pool_h = o.pool_h;
  g.pool_w = o.pool_w;
  g.stride_h = o.stride_h == 0 ? o.pool_h : o.stride_h;
  g.stride_w = o.stride_w == 0 ? o.pool_w : o.stride_w;
  g.pad_h = o.pad_h;
  g.pad_w = o.pad_w;
  if (g.pool_h < 1 || g.pool_w < 1 || g.stride_h < 1 || g.stride_w < 1 || g.pad_h < 0 || g.pad_w < 0 ||
      g.pad_h >= g.pool_h || g.pad_w >= g.pool_w)
    fail<invalid_argument>(op,
                           "pool (" + std::to_string(o.pool_h) + ", " + std::to_string(o.pool_w) + ") and strides (" +
                               std::to_string(o.stride_h) + ", " + std::to_string(o.stride_w) +
                               ") must be >= 1 (stride 0: the pool extent), padding (" + std::to_string(o.pad_h) +
                               ", " + std::to_string(o.pad_w) + ") >= 0 and smaller than the pool",
                           loc);
  g.n = x[0];
  g.h = x[1];
  g.w = x[2];
  g.c = x[3];
  if (g.n == 0 || g.h == 0 || g.w == 0 || g.c == 0)
    fail<shape_error>(op, "x " + x.to_string() + " [N, H, W, C] has an empty extent", loc);
  if (g.h + 2 * g.pad_h < g.pool_h || g.w + 2 * g.pad_w < g.pool_w)
    fail<shape_error>(op,
                      "x " + x.to_string() + " [N, H, W, C] is smaller than the " + std::to_string(g.pool_h) + " x " +
                          std::to_string(g.pool_w) + " window (padding included)",
                      loc);
  g.oh = (g.h + 2 * g.pad_h - g.pool_h) / g.stride_h + 1;
  g.ow = (g.w + 2 * g.pad_w - g.pool_w) / g.stride_w + 1;
  return g;
}

inline shape pool_output_of(pool_geometry const& g) { return shape{g.n, g.oh, g.ow, g.c}; }

inline void pool_require(std::string_view op, std::string_view what, shape const& got, shape const& wanted,
                         shape const& x, mpx::source_location loc) {
  if (!(got == wanted))
    fail<shape_error>(op,
                      std::string(what) + " has shape " + got.to_string() + " but pooling x " + x.to_string() +
                          " needs " + wanted.to_string(),
                      loc);
}

//! Whether the scan replaces the kept value `best` by the later value `v` (see the top
//! of this header). NaN tests as x != x; mpx builds without -ffast-math.
MPX_HD inline bool pool_takes(float best, float v) noexcept { return best == best && (v > best || v != v); }

//! The window of output (oh, ow) clipped to x: rows [h0, h1), columns [w0, w1).
struct pool_window {
  std::int64_t h0, h1, w0, w1;
};
MPX_HD inline pool_window window_of(pool_geometry const& g, std::int64_t oh, std::int64_t ow) noexcept {
  std::int64_t const hs = oh * g.stride_h - g.pad_h, ws = ow * g.stride_w - g.pad_w;
  pool_window win{hs < 0 ? 0 : hs, hs + g.pool_h, ws < 0 ? 0 : ws, ws + g.pool_w};
  if (win.h1 > g.h) win.h1 = g.h;
  if (win.w1 > g.w) win.w1 = g.w;
  return win;
}

// ---- host -----------------------------------------------------------------------------

//! For every channel of window `win` of one image (image points at its [H, W, C]
//! block, of fewer than 2^31 elements, as floats): at[ch] = the offset in the image of
//! the element the window selects in channel ch. The channel loop is innermost:
//! contiguous, no divisions, selects rather than branches (on real data the comparison
//! is a coin toss).
inline void host_window_select(pool_geometry const& g, float const* image, pool_window const& win,
                               std::int32_t* at) {
  std::int64_t const c = g.c;
  auto const first = static_cast<std::int32_t>((win.h0 * g.w + win.w0) * c);
  std::int64_t ch = 0;
#if defined(__GNUC__)
  // Four channels at a time in SSE registers (core/host_vector.hpp): the scan is most of
  // a pooling layer's time.
  for (; ch + 4 <= c; ch += 4) {
    int4_vector const lanes = {0, 1, 2, 3};
    float4_vector best = load_float4(image + first + ch);
    int4_vector where = first + static_cast<std::int32_t>(ch) + lanes;
    for (std::int64_t ih = win.h0; ih < win.h1; ++ih)
      for (std::int64_t iw = ih == win.h0 ? win.w0 + 1 : win.w0; iw < win.w1; ++iw) {
        auto const base = static_cast<std::int32_t>((ih * g.w + iw) * c + ch);
        float4_vector const v = load_float4(image + base);
        int4_vector const take = (best == best) & ((v > best) | (v != v));  // pool_takes, per lane
        best = take ? v : best;
        where = take ? base + lanes : where;
      }
    __builtin_memcpy(at + ch, &where, sizeof(where));
  }
#endif
  for (; ch < c; ++ch) {
    float best = image[first + ch];
    std::int32_t where = first + static_cast<std::int32_t>(ch);
    for (std::int64_t ih = win.h0; ih < win.h1; ++ih)
      for (std::int64_t iw = ih == win.h0 ? win.w0 + 1 : win.w0; iw < win.w1; ++iw) {
        auto const i = static_cast<std::int32_t>((ih * g.w + iw) * c + ch);
        float const v = image[i];
        bool const take = pool_takes(best, v);
        best = take ? v : best;
        where = take ? i : where;
      }
    at[ch] = where;
  }
}

//! The host kernels index within an image in 32 bits.
inline void require_host_pool_image(std::string_view op, pool_geometry const& g, mpx::source_location loc) {
  if (g.h * g.w * g.c > 0x7FFF'FFFF)
    fail<invalid_argument>(op, "an image of more than 2^31 - 1 elements (H * W * C) is not supported on the host",
                           loc);
}

//! The host pooling's scratch (host_scratch_floats), slot by slot.
struct pool_scratch {};
enum pool_scratch_slot : std::size_t { pool_x_slot, pool_dy_slot, pool_sum_slot };

//! One image as floats: a 16-bit image is widened as a whole (eight elements per
//! instruction with F16C), once, rather than each element as each window reads it; a
//! float image is used as is.
template <pool_scratch_slot Slot, class T>
float const* host_pool_image_as_float(T const* image, std::int64_t image_size) {
  return host_floats_of<pool_scratch, Slot>(image, static_cast<std::size_t>(image_size));
}

template <class T>
void host_max_pool_forward(pool_geometry const& g, T const* x, T* y) {
  std::vector<std::int32_t> at(static_cast<std::size_t>(g.c));
  std::int64_t const image_size = g.h * g.w * g.c;
  T* out = y;
  for (std::int64_t i = 0; i < g.n; ++i) {
    T const* image = x + i * image_size;
    float const* image_f = host_pool_image_as_float<pool_x_slot>(image, image_size);
    for (std::int64_t oh = 0; oh < g.oh; ++oh)
      for (std::int64_t ow = 0; ow < g.ow; ++ow, out += g.c) {
        host_window_select(g, image_f, window_of(g, oh, ow), at.data());
        for (std::int64_t ch = 0; ch < g.c; ++ch) out[ch] = image[at[static_cast<std::size_t>(ch)]];
      }
  }
}

// Scatter form: each window adds its dy to the float sum of the element it selected,
// windows in order; then one rounding per element.
template <class T, class G>
void host_max_pool_backward(pool_geometry const& g, T const* x, G const* dy, G* dx) {
  std::vector<std::int32_t> at(static_cast<std::size_t>(g.c));
  std::int64_t const image_size = g.h * g.w * g.c, grad_size = g.oh * g.ow * g.c;
  float* acc = host_scratch_floats<pool_scratch, pool_sum_slot>(static_cast<std::size_t>(image_size));
  for (std::int64_t i = 0; i < g.n; ++i) {
    float const* image_f = host_pool_image_as_float<pool_x_slot>(x + i * image_size, image_size);
    float const* grad = host_pool_image_as_float<pool_dy_slot>(dy + i * grad_size, grad_size);
    std::fill(acc, acc + image_size, 0.0f);
    for (std::int64_t oh = 0; oh < g.oh; ++oh)
      for (std::int64_t ow = 0; ow < g.ow; ++ow, grad += g.c) {
        host_window_select(g, image_f, window_of(g, oh, ow), at.data());
        for (std::int64_t ch = 0; ch < g.c; ++ch) acc[at[static_cast<std::size_t>(ch)]] += grad[ch];
      }
    round_span(acc, dx + i * image_size, static_cast<std::size_t>(image_size));
  }
}

// ---- the element bodies: what the GPU runs (and the host, with host loops off) -------

//! The flat index in x of the element window (oh, ow) of image `image`, channel ch,
//! selects (the same scan as the host's).
template <class T>
MPX_HD std::int64_t window_select(pool_geometry const& g, T const* x, std::int64_t image, std::int64_t oh,
                                  std::int64_t ow, std::int64_t ch) {
  pool_window const win = window_of(g, oh, ow);
  std::int64_t const base = image * g.h * g.w * g.c + ch;
  std::int64_t at = base + (win.h0 * g.w + win.w0) * g.c;
  float best = cast<float>(x[at]);
  for (std::int64_t ih = win.h0; ih < win.h1; ++ih)
    for (std::int64_t iw = ih == win.h0 ? win.w0 + 1 : win.w0; iw < win.w1; ++iw) {
      std::int64_t const i = base + (ih * g.w + iw) * g.c;
      float const v = cast<float>(x[i]);
      if (pool_takes(best, v)) {
        best = v;
        at = i;
      }
    }
  return at;
}

//! Where flat index e of an NHWC tensor [images, rows, cols, channels] lies.
struct nhwc_position {
  std::int64_t image, row, col, channel;
};
MPX_HD inline nhwc_position nhwc_of(std::size_t e, std::int64_t rows, std::int64_t cols, std::int64_t channels) {
  auto const i = static_cast<std::int64_t>(e);
  std::int64_t t = i / channels;
  std::int64_t const col = t % cols;
  t /= cols;
  return {t / rows, t % rows, col, i % channels};
}

// One element of y: on the GPU neighbouring threads take neighbouring channels, so
// every read of the window is coalesced.
template <class T>
struct max_pool_forward_element {
  pool_geometry g;
  T const* x;
  T* y;
  MPX_HD void operator()(std::size_t e) const {
    nhwc_position const p = nhwc_of(e, g.oh, g.ow, g.c);
    y[e] = x[window_select(g, x, p.image, p.row, p.col, p.channel)];
  }
  void host_loop() const { host_max_pool_forward(g, x, y); }  // image by image, channels in SSE
};

// Gather form, one element of dx: it visits the windows that cover it, in window order,
// and adds dy of those that select it (a window whose y differs from this element's
// value cannot, and is skipped without its scan). No atomics: deterministic, and the
// same float sums in the same order as the host's scatter (its host loop).
template <class T, class G>
struct max_pool_backward_element {
  pool_geometry g;
  T const* x;
  T const* y;
  G const* dy;
  G* dx;
  MPX_HD void operator()(std::size_t e) const {
    nhwc_position const p = nhwc_of(e, g.h, g.w, g.c);
    auto const i = static_cast<std::int64_t>(e);
    std::int64_t const ch = p.channel, iw = p.col, ih = p.row, image = p.image;
    float const v = cast<float>(x[e]);
    // Windows whose span [o * stride - pad, o * stride - pad + pool) holds ih.
    std::int64_t const ph = ih + g.pad_h, pw = iw + g.pad_w;
    std::int64_t const oh0 = ph < g.pool_h ? 0 : (ph - g.pool_h) / g.stride_h + 1;
    std::int64_t const ow0 = pw < g.pool_w ? 0 : (pw - g.pool_w) / g.stride_w + 1;
    std::int64_t const oh1 = ph / g.stride_h + 1 < g.oh ? ph / g.stride_h + 1 : g.oh;
    std::int64_t const ow1 = pw / g.stride_w + 1 < g.ow ? pw / g.stride_w + 1 : g.ow;
    float sum = 0.0f;
    for (std::int64_t oh = oh0; oh < oh1; ++oh)
      for (std::int64_t ow = ow0; ow < ow1; ++ow) {
        std::int64_t const out = ((image * g.oh + oh) * g.ow + ow) * g.c + ch;
        float const selected = cast<float>(y[out]);
        if (!(selected == v || (selected != selected && v != v))) continue;
        if (window_select(g, x, image, oh, ow, ch) == i) sum += cast<float>(dy[out]);
      }
    dx[e] = cast<G>(sum);
  }
  void host_loop() const { host_max_pool_backward(g, x, dy, dx); }  // the scatter form, windows in order
};

}  // namespace detail

//! The shape of max_pool2d_forward's output: [N, OH, OW, C] (see pool_options).
//! Throws mpx::shape_error for an x that is not rank 4, has an empty extent or is
//! smaller than the window; mpx::invalid_argument for a pool or stride < 1 or a padding
//! outside [0, pool).
inline shape max_pool2d_output_shape(shape const& x_shape, pool_options const& options = {},
                                     mpx::source_location loc = mpx::source_location::current()) {
  return detail::pool_output_of(detail::pool_shapes("max_pool2d_output_shape", x_shape, options, loc));
}

//! y[n, oh, ow, c] = the maximum of x[n, ., ., c] over the window of (oh, ow): the
//! first maximum in scan order, or NaN if the window holds one. x [N, H, W, C], y [N,
//! OH, OW, C] (max_pool2d_output_shape), the same dtype; exact (a copy of the selected
//! element). Asynchronous on a cuda_executor.
template <executor Exec, tensor_like X, tensor_like Y>
void max_pool2d_forward(Exec const& exec, X&& x, Y&& y, pool_options const& options = {},
                        mpx::source_location loc = mpx::source_location::current()) {
  static_assert(std::is_same_v<value_t<X>, value_t<Y>>, "mpx::max_pool2d_forward: x and y must hold the same dtype");
  auto const [xv, yv] = detail::views_for<Exec>(x, y);
  static_assert(!std::is_const_v<typename decltype(yv)::element_type>, "mpx::max_pool2d_forward: y is const");
  constexpr std::string_view op = "max_pool2d_forward";
  auto const g = detail::pool_shapes(op, xv.shape(), options, loc);
  detail::pool_require(op, "y", yv.shape(), detail::pool_output_of(g), xv.shape(), loc);
  detail::require_disjoint(op, "y", yv, "x", xv);  // y is written while windows of x are still read
  detail::check_on_host(exec, [&] { detail::require_host_pool_image(op, g, loc); });
  for_each_index(exec, yv.size(), detail::max_pool_forward_element<value_t<X>>{g, xv.data(), yv.data()});
}

//! dx = the gradient of sum(dy * max_pool2d(x)) with respect to x: each window's dy goes
//! to the element it selected (the first maximum, or the first NaN), summed in float
//! where windows overlap, rounded once; dx is overwritten, 0 where nothing was selected.
//! x and y are the forward pass's input and output (y = max_pool2d_forward(x, options);
//! the selection is recomputed from x, y only lets the GPU skip windows quickly). y must
//! be exactly that output, unmodified: the GPU gives no gradient through a window whose
//! y differs from its selected x (the host, which does not read y, would).
//! dy [N, OH, OW, C] and dx [N, H, W, C] share a dtype, which may differ from x's.
//! Deterministic on both executors (a gather on the GPU, no atomics). Asynchronous on a
//! cuda_executor.
template <executor Exec, tensor_like X, tensor_like Y, tensor_like DY, tensor_like DX>
void max_pool2d_backward(Exec const& exec, X&& x, Y&& y, DY&& dy, DX&& dx,
                         pool_options const& options = {},
                         mpx::source_location loc = mpx::source_location::current()) {
  static_assert(std::is_same_v<value_t<X>, value_t<Y>>, "mpx::max_pool2d_backward: x and y must hold the same dtype");
  static_assert(std::is_same_v<value_t<DY>, value_t<DX>>,
                "mpx::max_pool2d_backward: dy and dx must hold the same dtype");
  auto const [xv, yv, dyv, dxv] = detail::views_for<Exec>(x, y, dy, dx);
  static_assert(!std::is_const_v<typename decltype(dxv)::element_type>, "mpx::max_pool2d_backward: dx is const");
  constexpr std::string_view op = "max_pool2d_backward";
  auto const g = detail::pool_shapes(op, xv.shape(), options, loc);
  detail::pool_require(op, "y", yv.shape(), detail::pool_output_of(g), xv.shape(), loc);
  detail::pool_require(op, "dy", dyv.shape(), detail::pool_output_of(g), xv.shape(), loc);
  detail::pool_require(op, "dx", dxv.shape(), xv.shape(), xv.shape(), loc);
  // dx is written while x, y and dy are still read (by other elements' windows).
  detail::require_disjoint(op, "dx", dxv, "x", xv);
  detail::require_disjoint(op, "dx", dxv, "y", yv);
  detail::require_disjoint(op, "dx", dxv, "dy", dyv);
  detail::check_on_host(exec, [&] { detail::require_host_pool_image(op, g, loc); });
  for_each_index(exec, dxv.size(),
                         detail::max_pool_backward_element<value_t<X>, value_t<DY>>{g, xv.data(), yv.data(),
                                                                                    dyv.data(), dxv.data()});
}

}  // namespace mpx
