// 2-D convolution over NHWC tensors with Keras's HWIO weights, forward and both
// gradients, as an explicit im2col into a caller's workspace followed by mpx::gemm (so
// the products run on cuBLASLt or the host BLAS and sum in float). The input gradient's
// col2im sums in float and is deterministic on both executors (no atomics).
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/convert_span.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/host_scratch.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/gemm.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

// Layouts (row-major, as Keras and TensorFlow's NHWC kernels hold them):
//   x  [N, H, W, Cin]         input
//   w  [KH, KW, Cin, Cout]    weights (Keras HWIO), read as the matrix [KH*KW*Cin, Cout]
//   y  [N, OH, OW, Cout]      output, read as the matrix [N*OH*OW, Cout]
//   columns [rows, KH*KW*Cin] the workspace: row (n, oh, ow) holds the receptive field of
//                             output pixel (oh, ow) of image n in (kh, kw, cin) order, so
//                             that y = columns * w is one gemm; zeros where it overlaps
//                             the padding.
// A bias is not part of the convolution: y viewed as [N*OH*OW, Cout] is what
// mpx::bias_activation_forward / backward take.

namespace mpx {

//! The geometry of a 2-D convolution. Output extent (per axis, floor as Keras):
//! OH = (H + 2 pad_h + extra_pad_h - ((KH - 1) dilation_h + 1)) / stride_h + 1.
struct conv2d_options {
  std::int64_t stride_h = 1, stride_w = 1;      //!< >= 1
  std::int64_t pad_h = 0, pad_w = 0;            //!< zero rows (columns) on each side, >= 0
  std::int64_t dilation_h = 1, dilation_w = 1;  //!< >= 1; 1 is a dense kernel
  //! Zero rows at the bottom (columns at the right) beyond pad_h (pad_w): Keras 'same'
  //! padding with an odd total puts the odd one there. >= 0; conv2d_padding_same sets it.
  std::int64_t extra_pad_h = 0, extra_pad_w = 0;
};

//! Where mpx::conv2d_backward_weights gets its columns from.
enum class conv2d_columns {
  recompute,      //!< im2col of x again: always right, whatever ran in between.
  reuse_forward,  //!< The workspace still holds conv2d_forward's columns of this x (whole batch).
};

namespace detail {

//! Every extent of one convolution, checked.
struct conv2d_geometry {
  std::int64_t n = 0, h = 0, w = 0, cin = 0;
  std::int64_t kh = 0, kw = 0, cout = 0;
  std::int64_t oh = 0, ow = 0;
  conv2d_options o;
  [[nodiscard]] std::int64_t pixels() const { return oh * ow; }     //!< output pixels per image
  [[nodiscard]] std::int64_t patch() const { return kh * kw * cin; }  //!< columns of the workspace
};

//! The names a message gives the input-side and weight-side tensors: x and w, or dx
//! and w (backward data), or x and dw (backward weights).
struct conv2d_names {
  std::string_view x = "x", w = "w";
};

inline std::string conv2d_shapes_text(shape const& x, shape const& w, conv2d_names names) {
  return std::string(names.x) + " " + x.to_string() + " [N, H, W, Cin] and " + std::string(names.w) + " " +
         w.to_string() + " [KH, KW, Cin, Cout]";
}

//! The geometry of x * w, or mpx::shape_error / invalid_argument naming both shapes.
inline conv2d_geometry conv2d_shapes(std::string_view op, shape const& x, shape const& w, conv2d_options const& o,
                                     mpx::source_location loc, conv2d_names names = {}) {
  auto const both = conv2d_shapes_text(x, w, names);
  if (x.rank() != 4 || w.rank() != 4)
    fail<shape_error>(op, both + ": both must be rank 4", loc);
  if (x[3] != w[2])
    fail<shape_error>(op,
                      both + ": " + std::string(names.x) + " has " + std::to_string(x[3]) + " input channels but " +
                          std::string(names.w) + " expects " + std::to_string(w[2]),
                      loc);
  if (x[0] == 0) fail<shape_error>(op, both + ": the batch is empty", loc);
  for (std::size_t i = 0; i < 4; ++i)
    if (x[i] == 0 || w[i] == 0) fail<shape_error>(op, both + ": every extent must be at least 1", loc);
  if (o.stride_h < 1 || o.stride_w < 1 || o.dilation_h < 1 || o.dilation_w < 1 || o.pad_h < 0 || o.pad_w < 0 ||
      o.extra_pad_h < 0 || o.extra_pad_w < 0)
    fail<invalid_argument>(op,
                           "strides (" + std::to_string(o.stride_h) + ", " + std::to_string(o.stride_w) +
                               ") and dilations (" + std::to_string(o.dilation_h) + ", " +
                               std::to_string(o.dilation_w) + ") must be >= 1, paddings (" +
                               std::to_string(o.pad_h) + ", " + std::to_string(o.pad_w) + ", extra " +
                               std::to_string(o.extra_pad_h) + ", " + std::to_string(o.extra_pad_w) +
                               ") >= 0",
                           loc);
  conv2d_geometry g;
  g.n = x[0];
  g.h = x[1];
  g.w = x[2];
  g.cin = x[3];
  g.kh = w[0];
  g.kw = w[1];
  g.cout = w[3];
  g.o = o;
  std::int64_t const span_h = (g.kh - 1) * o.dilation_h + 1, span_w = (g.kw - 1) * o.dilation_w + 1;
  std::int64_t const padded_h = g.h + 2 * o.pad_h + o.extra_pad_h, padded_w = g.w + 2 * o.pad_w + o.extra_pad_w;
  if (span_h > padded_h || span_w > padded_w)
    fail<shape_error>(op,
                      both + ": the kernel spans " + std::to_string(span_h) + " x " + std::to_string(span_w) +
                          " pixels (dilation included), more than the padded input's " + std::to_string(padded_h) +
                          " x " + std::to_string(padded_w),
                      loc);
  g.oh = (padded_h - span_h) / o.stride_h + 1;
  g.ow = (padded_w - span_w) / o.stride_w + 1;
  return g;
}

inline shape conv2d_output_of(conv2d_geometry const& g) { return shape{g.n, g.oh, g.ow, g.cout}; }

//! Throws shape_error unless `got` (the tensor called `what`) has the shape `wanted`.
inline void conv2d_require(std::string_view op, std::string_view what, shape const& got, shape const& wanted,
                           shape const& x, shape const& w, mpx::source_location loc, conv2d_names names = {}) {
  if (!(got == wanted))
    fail<shape_error>(op,
                      std::string(what) + " has shape " + got.to_string() + " but " +
                          conv2d_shapes_text(x, w, names) +
                          " need " + wanted.to_string(),
                      loc);
}

//! Images per im2col chunk the workspace holds: it must be [rows, KH*KW*Cin] with rows
//! >= OH*OW (one image); rows beyond N*OH*OW are left alone.
inline std::int64_t conv2d_chunk_images(std::string_view op, conv2d_geometry const& g, shape const& ws,
                                        shape const& x, shape const& w, mpx::source_location loc,
                                        conv2d_names names = {}) {
  if (ws.rank() != 2 || ws[1] != g.patch() || ws[0] < g.pixels())
    fail<shape_error>(op,
                      "the workspace has shape " + ws.to_string() + " but " + conv2d_shapes_text(x, w, names) +
                          " need [rows, " + std::to_string(g.patch()) + "] with rows a multiple of " +
                          std::to_string(g.pixels()) + " (OH*OW, one image), ideally " +
                          std::to_string(g.n * g.pixels()) + " (the whole batch): see conv2d_workspace_shape",
                      loc);
  return std::min(g.n, ws[0] / g.pixels());
}

//! The compile-time checks, each with the message a user needs.
template <class Policy, class... Storage>
constexpr void check_conv2d_types() {
  static_assert(policy_type<Policy>,
                "mpx::conv2d: the first template argument must be a policy, as in "
                "mpx::conv2d_forward<mpx::mixed_float16>(exec, x, w, y, workspace)");
  if constexpr (policy_type<Policy>) {
    static_assert(float_accumulating_policy<Policy>,
                  "mpx::conv2d accumulates in float32 (the im2col products and the input gradient's col2im "
                  "sums), but this policy's accumulate_type is 16-bit: use mpx::mixed_float16, "
                  "mpx::mixed_bfloat16, mpx::float32 or a policy<Storage, Compute, float>");
    static_assert((std::is_same_v<Storage, typename Policy::storage_type> && ...),
                  "mpx::conv2d: x, w, y, dy, dx and the workspace must hold the policy's storage_type (half for "
                  "mpx::mixed_float16, bfloat16 for mpx::mixed_bfloat16, float for mpx::float32); convert them "
                  "with mpx::cast first");
  }
}

//! The product a convolution runs: mpx::gemm<Policy>, unless a layer passes its own
//! (mpx::conv2d under an fp8 policy passes its matrix_products, which keep the scales).
template <class Policy>
struct policy_gemm {
  template <class Exec, class A, class B, class C>
  void operator()(Exec const& exec, A const& a, B const& b, C const& c, gemm_options const& o,
                  mpx::source_location loc) const {
    gemm<Policy>(exec, a, b, c, o, loc);
  }
};

// ---- host -----------------------------------------------------------------------------

//! The kernel taps [begin, end) that land inside an input of `extent` pixels for an
//! output pixel whose first tap is at `origin` (taps are `dilation` apart). Contiguous,
//! since the valid positions form an interval.
struct tap_range {
  std::int64_t begin = 0, end = 0;
};

inline std::vector<tap_range> valid_taps(std::int64_t outputs, std::int64_t stride, std::int64_t pad,
                                         std::int64_t taps, std::int64_t dilation, std::int64_t extent) {
  std::vector<tap_range> out(static_cast<std::size_t>(outputs));
  for (std::int64_t o = 0; o < outputs; ++o) {
    std::int64_t const origin = o * stride - pad;
    tap_range r{taps, taps};
    for (std::int64_t t = 0; t < taps; ++t) {
      std::int64_t const i = origin + t * dilation;
      if (i >= 0 && i < extent) {
        if (r.begin == taps) r.begin = t;
        r.end = t + 1;
      }
    }
    if (r.begin == taps) r = {0, 0};
    out[static_cast<std::size_t>(o)] = r;
  }
  return out;
}

template <class T>
void copy_elements(T* dst, T const* src, std::int64_t count) {
  std::memcpy(static_cast<void*>(dst), static_cast<void const*>(src), static_cast<std::size_t>(count) * sizeof(T));
}
template <class T>
void zero_elements(T* dst, std::int64_t count) {
  // All-zero bits are +0 in half, bfloat16 and float.
  if (count > 0) std::memset(static_cast<void*>(dst), 0, static_cast<std::size_t>(count) * sizeof(T));
}

//! Where each output pixel's receptive field lies in one image: the walk the host loops
//! of im2col and col2im share, so that both visit the same elements in the same order
//! (pixels in the order of the columns' rows, then kernel rows, then taps).
class receptive_fields {
 public:
  explicit receptive_fields(conv2d_geometry const& g)
      : g_(g),
        rows_h_(valid_taps(g.oh, g.o.stride_h, g.o.pad_h, g.kh, g.o.dilation_h, g.h)),
        cols_w_(valid_taps(g.ow, g.o.stride_w, g.o.pad_w, g.kw, g.o.dilation_w, g.w)) {}

  //! For each output pixel: pixel(row, th, tw), `row` the offset of its row of columns
  //! (one image's rows start at 0), th and tw its kernel rows and columns whose taps land
  //! inside the image (the rest reads padding); then for each kernel row in th,
  //! run(column, at, count): `count` elements of the columns from offset `column` match
  //! the image's from offset `at`. One run per kernel row when dilation_w is 1 (KW*Cin
  //! contiguous elements at most), else one run of Cin per tap.
  template <class Pixel, class Run>
  void for_each(Pixel&& pixel, Run&& run) const {
    auto const& o = g_.o;
    std::int64_t const c = g_.cin, kwc = g_.kw * c, patch = g_.patch();
    for (std::int64_t oh = 0; oh < g_.oh; ++oh) {
      tap_range const th = rows_h_[static_cast<std::size_t>(oh)];
      std::int64_t const ih0 = oh * o.stride_h - o.pad_h;
      for (std::int64_t ow = 0; ow < g_.ow; ++ow) {
        tap_range const tw = cols_w_[static_cast<std::size_t>(ow)];
        std::int64_t const iw0 = ow * o.stride_w - o.pad_w;
        std::int64_t const row = (oh * g_.ow + ow) * patch;
        pixel(row, th, tw);
        for (std::int64_t kh = th.begin; kh < th.end; ++kh) {
          std::int64_t const column = row + kh * kwc;
          std::int64_t const at = ((ih0 + kh * o.dilation_h) * g_.w + iw0) * c;  // (ih, iw0): may be left of x
          if (o.dilation_w == 1) {
            run(column + tw.begin * c, at + tw.begin * c, (tw.end - tw.begin) * c);
          } else {
            for (std::int64_t kw = tw.begin; kw < tw.end; ++kw) run(column + kw * c, at + kw * o.dilation_w * c, c);
          }
        }
      }
    }
  }

 private:
  conv2d_geometry g_;
  std::vector<tap_range> rows_h_, cols_w_;
};

//! columns[(i - n0) * OH*OW + oh * OW + ow, :] = the receptive field of (oh, ow) in image
//! i of x, for i in [n0, n0 + images): runs of Cin (or KW*Cin, undilated) elements
//! copied whole, zeros for the padding.
template <class T>
void host_im2col(conv2d_geometry const& g, T const* x, std::int64_t n0, std::int64_t images, T* columns) {
  receptive_fields const fields(g);
  std::int64_t const c = g.cin, kwc = g.kw * c, image_size = g.h * g.w * c;
  for (std::int64_t i = n0; i < n0 + images; ++i) {
    T const* image = x + i * image_size;
    T* image_columns = columns + (i - n0) * g.pixels() * g.patch();
    fields.for_each(
        [&](std::int64_t row, tap_range th, tap_range tw) {  // the padding's zeros
          T* r = image_columns + row;
          zero_elements(r, th.begin * kwc);
          for (std::int64_t kh = th.begin; kh < th.end; ++kh) {
            zero_elements(r + kh * kwc, tw.begin * c);
            zero_elements(r + kh * kwc + tw.end * c, (g.kw - tw.end) * c);
          }
          zero_elements(r + th.end * kwc, (g.kh - th.end) * kwc);
        },
        [&](std::int64_t column, std::int64_t at, std::int64_t count) {
          copy_elements(image_columns + column, image + at, count);
        });
  }
}

struct col2im_scratch {};

//! dx[i] for i in [n0, n0 + images) = the sum, in float, of the column gradients of
//! every output pixel whose receptive field holds the element (scatter-add in order of
//! output pixel, then tap), rounded once to T. Elements no window reaches get 0.
template <class T>
void host_col2im(conv2d_geometry const& g, T const* dcolumns, std::int64_t n0, std::int64_t images, T* dx) {
  receptive_fields const fields(g);
  std::int64_t const image_size = g.h * g.w * g.cin;
  float* acc = host_scratch_floats<col2im_scratch, 0>(static_cast<std::size_t>(image_size));
  for (std::int64_t i = n0; i < n0 + images; ++i) {
    std::fill(acc, acc + image_size, 0.0f);
    T const* image_columns = dcolumns + (i - n0) * g.pixels() * g.patch();
    fields.for_each([](std::int64_t, tap_range, tap_range) {},  // the padding receives no gradient
                    [&](std::int64_t column, std::int64_t at, std::int64_t count) {
                      float* __restrict d = acc + at;
                      T const* __restrict s = image_columns + column;
                      for (std::int64_t e = 0; e < count; ++e) d[e] += widen_to_float_fast(s[e]);
                    });
    T* out = dx + i * image_size;
    round_span(acc, out, static_cast<std::size_t>(image_size));
  }
}

// ---- the element bodies: what the GPU runs (and the host, with host loops off) -------

//! The extents the element bodies need, as plain integers (the GPU's index arithmetic).
struct conv2d_params {
  int h, w, cin, kh, kw, oh, ow;
  int stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
};

inline conv2d_params conv2d_params_of(std::string_view op, conv2d_geometry const& g) {
  std::int64_t const values[] = {g.h,          g.w,          g.cin,      g.kh,       g.kw,
                                 g.oh,         g.ow,         g.o.stride_h, g.o.stride_w, g.o.pad_h,
                                 g.o.pad_w,    g.o.dilation_h, g.o.dilation_w};
  for (std::int64_t v : values)
    if (v > 0x7FFF'FFFF) fail<invalid_argument>(op, "an extent, stride, padding or dilation exceeds 2^31 - 1");
  return {static_cast<int>(g.h),          static_cast<int>(g.w),          static_cast<int>(g.cin),
          static_cast<int>(g.kh),         static_cast<int>(g.kw),         static_cast<int>(g.oh),
          static_cast<int>(g.ow),         static_cast<int>(g.o.stride_h), static_cast<int>(g.o.stride_w),
          static_cast<int>(g.o.pad_h),    static_cast<int>(g.o.pad_w),    static_cast<int>(g.o.dilation_h),
          static_cast<int>(g.o.dilation_w)};
}

// One element of the columns: on the GPU neighbouring threads read neighbouring channels
// of x and write neighbouring columns, both coalesced. Counted in 32 bits where the
// sizes allow (the divisions are the cost). Its host loop is the blocked host_im2col.
template <class T>
struct im2col_element {
  conv2d_params p;
  conv2d_geometry g;
  T const* x;  // all of x; the chunk's images start at n0
  T* columns;
  std::int64_t n0, images;
  [[nodiscard]] std::size_t largest_index() const {  // the last element of the chunk's images in x
    return static_cast<std::size_t>((n0 + images) * g.h * g.w * g.cin);
  }
  template <class Index>
  MPX_HD void operator()(Index e) const {
    Index const patch = static_cast<Index>(p.kh) * p.kw * p.cin;
    Index const r = e / patch, k = e - r * patch;
    int const ci = static_cast<int>(k % p.cin);
    Index const tap = k / p.cin;
    int const kw = static_cast<int>(tap % p.kw), kh = static_cast<int>(tap / p.kw);
    int const ow = static_cast<int>(r % p.ow);
    Index const t = r / p.ow;
    int const oh = static_cast<int>(t % p.oh);
    Index const image = static_cast<Index>(n0) + t / p.oh;
    int const ih = oh * p.stride_h - p.pad_h + kh * p.dilation_h;
    int const iw = ow * p.stride_w - p.pad_w + kw * p.dilation_w;
    T v = cast<T>(0.0f);
    if (ih >= 0 && ih < p.h && iw >= 0 && iw < p.w)
      v = x[((image * p.h + static_cast<Index>(ih)) * p.w + static_cast<Index>(iw)) * p.cin + static_cast<Index>(ci)];
    columns[e] = v;
  }
  void host_loop() const { host_im2col(g, x, n0, images, columns); }
};

// Gather-form col2im, one element of dx: it sums, in float, the column gradients of the
// output pixels whose receptive field holds it, in order of output pixel (taps
// descending), the order the host's scatter (its host loop) adds them in. No atomics:
// deterministic.
template <class T>
struct col2im_element {
  conv2d_params p;
  conv2d_geometry g;
  T const* dcolumns;  // the chunk's rows
  T* dx;              // all of dx; the chunk's images start at n0
  std::int64_t n0, images;
  [[nodiscard]] std::size_t largest_index() const {  // the chunk's last column and element of dx
    auto const columns = static_cast<std::size_t>(images * g.pixels() * g.patch());
    return std::max(columns, static_cast<std::size_t>((n0 + images) * g.h * g.w * g.cin));
  }
  template <class Index>
  MPX_HD void operator()(Index e) const {
    Index const patch = static_cast<Index>(p.kh) * p.kw * p.cin;
    int const ci = static_cast<int>(e % p.cin);
    Index t = e / p.cin;
    int const iw = static_cast<int>(t % p.w);
    t /= p.w;
    int const ih = static_cast<int>(t % p.h);
    Index const image = t / p.h;
    float sum = 0.0f;
    for (int kh = p.kh - 1; kh >= 0; --kh) {
      int const ph = ih + p.pad_h - kh * p.dilation_h;  // oh * stride_h
      if (ph < 0 || ph % p.stride_h != 0) continue;
      int const oh = ph / p.stride_h;
      if (oh >= p.oh) continue;
      for (int kw = p.kw - 1; kw >= 0; --kw) {
        int const pw = iw + p.pad_w - kw * p.dilation_w;
        if (pw < 0 || pw % p.stride_w != 0) continue;
        int const ow = pw / p.stride_w;
        if (ow >= p.ow) continue;
        Index const row = (image * p.oh + static_cast<Index>(oh)) * p.ow + static_cast<Index>(ow);
        sum += cast<float>(dcolumns[row * patch + static_cast<Index>((kh * p.kw + kw) * p.cin + ci)]);
      }
    }
    dx[static_cast<Index>(n0) * p.h * p.w * p.cin + e] = cast<T>(sum);
  }
  void host_loop() const { host_col2im(g, dcolumns, n0, images, dx); }
};

//! im2col of images [n0, n0 + images) of x into the first rows of `columns`.
template <class Exec, class T>
void im2col(Exec const& exec, std::string_view op, conv2d_geometry const& g, T const* x, std::int64_t n0,
            std::int64_t images, T* columns) {
  std::size_t const total = static_cast<std::size_t>(images * g.pixels() * g.patch());
  for_each_index(exec, total, im2col_element<T>{conv2d_params_of(op, g), g, x, columns, n0, images});
}

//! col2im of the first rows of `dcolumns` into images [n0, n0 + images) of dx.
template <class Exec, class T>
void col2im(Exec const& exec, std::string_view op, conv2d_geometry const& g, T const* dcolumns, std::int64_t n0,
            std::int64_t images, T* dx) {
  std::size_t const total = static_cast<std::size_t>(images * g.h * g.w * g.cin);
  for_each_index(exec, total, col2im_element<T>{conv2d_params_of(op, g), g, dcolumns, dx, n0, images});
}

//! What each pass of a convolution checks before it runs: the geometry of the image-side
//! and weight-side tensors (x or dx, w or dw), the output-side one (y or dy, called
//! `output`) against the output shape, and how many images a chunk of the workspace
//! holds.
struct conv2d_plan {
  conv2d_geometry g;
  std::int64_t chunk_images;
};

inline conv2d_plan plan_conv2d(std::string_view op, shape const& image, shape const& weights,
                               std::string_view output, shape const& output_shape, shape const& workspace,
                               conv2d_options const& o, mpx::source_location loc, conv2d_names names = {}) {
  conv2d_plan p;
  p.g = conv2d_shapes(op, image, weights, o, loc, names);
  conv2d_require(op, output, output_shape, conv2d_output_of(p.g), image, weights, loc, names);
  p.chunk_images = conv2d_chunk_images(op, p.g, workspace, image, weights, loc, names);
  return p;
}

//! The workspace's first rows as the [images*OH*OW, KH*KW*Cin] columns of one chunk.
template <class V>
V chunk_columns(V const& workspace, conv2d_geometry const& g, std::int64_t images) {
  return workspace.flat(0, static_cast<std::size_t>(images * g.pixels() * g.patch()))
      .reshape(shape{images * g.pixels(), g.patch()});
}

//! The rows of a [N*OH*OW, cols] matrix that belong to images [n0, n0 + images).
template <class V>
V image_rows(V const& matrix, conv2d_geometry const& g, std::int64_t n0, std::int64_t images, std::int64_t cols) {
  auto const rows = images * g.pixels();
  return matrix.flat(static_cast<std::size_t>(n0 * g.pixels() * cols), static_cast<std::size_t>(rows * cols))
      .reshape(shape{rows, cols});
}

//! The loop every pass runs: for each chunk of images the workspace holds, in batch
//! order, step(n0, images, columns, rows) with the chunk's columns (chunk_columns) and
//! its rows of the output-side tensor (y or dy) as a [N*OH*OW, Cout] matrix.
template <class Cols, class OutputSide, class Step>
void for_each_image_chunk(conv2d_plan const& plan, Cols const& workspace, OutputSide const& output_side,
                          Step&& step) {
  auto const& g = plan.g;
  auto const matrix = output_side.reshape(shape{g.n * g.pixels(), g.cout});
  for (std::int64_t n0 = 0; n0 < g.n; n0 += plan.chunk_images) {
    std::int64_t const images = std::min(plan.chunk_images, g.n - n0);
    step(n0, images, chunk_columns(workspace, g, images), image_rows(matrix, g, n0, images, g.cout));
  }
}

//! Outputs are written while inputs are still read: an overlap is refused, not computed.
//! The output against both inputs, the workspace against all three.
template <class Out, class A, class B, class Cols>
void require_conv2d_disjoint(std::string_view op, std::string_view out_name, Out const& out, std::string_view a_name,
                             A const& a, std::string_view b_name, B const& b, Cols const& workspace) {
  require_disjoint(op, out_name, out, a_name, a);
  require_disjoint(op, out_name, out, b_name, b);
  require_disjoint(op, "the workspace", workspace, a_name, a);
  require_disjoint(op, "the workspace", workspace, b_name, b);
  require_disjoint(op, "the workspace", workspace, out_name, out);
}

}  // namespace detail

//! The shape of y = conv2d(x, w): [N, OH, OW, Cout] (see conv2d_options for OH, OW).
//! Throws mpx::shape_error naming both shapes when they cannot be convolved (ranks,
//! channels, an empty batch or extent, a kernel wider than the padded input), and
//! mpx::invalid_argument for a stride or dilation < 1 or a negative padding.
inline shape conv2d_output_shape(shape const& x_shape, shape const& w_shape, conv2d_options const& options = {},
                                 mpx::source_location loc = mpx::source_location::current()) {
  return detail::conv2d_output_of(detail::conv2d_shapes("conv2d_output_shape", x_shape, w_shape, options, loc));
}

//! The workspace (im2col columns) for the whole batch: [N*OH*OW, KH*KW*Cin] in the
//! policy's storage type. The kernels also take fewer rows, any multiple of OH*OW (they
//! then work through the batch that many images at a time), or more (the extra rows are
//! left alone: a workspace sized for the largest batch serves every smaller one).
inline shape conv2d_workspace_shape(shape const& x_shape, shape const& w_shape, conv2d_options const& options = {},
                                    mpx::source_location loc = mpx::source_location::current()) {
  auto const g = detail::conv2d_shapes("conv2d_workspace_shape", x_shape, w_shape, options, loc);
  return shape{g.n * g.pixels(), g.patch()};
}

//! `options` with the padding Keras's padding='same' uses for this input and kernel:
//! OH = ceil(H / stride_h) (likewise W), total padding max((OH - 1) stride_h + (KH - 1)
//! dilation_h + 1 - H, 0), half of it (rounded down) on top, the rest at the bottom
//! (pad_h, extra_pad_h). Strides and dilations are kept from `options`.
inline conv2d_options conv2d_padding_same(shape const& x_shape, shape const& w_shape, conv2d_options options = {},
                                          mpx::source_location loc = mpx::source_location::current()) {
  options.pad_h = options.pad_w = options.extra_pad_h = options.extra_pad_w = 0;
  if (x_shape.rank() == 4 && w_shape.rank() == 4 && options.stride_h >= 1 && options.stride_w >= 1) {
    auto const total = [](std::int64_t in, std::int64_t k, std::int64_t s, std::int64_t d) {
      std::int64_t const out = (in + s - 1) / s;
      return std::max<std::int64_t>((out - 1) * s + (k - 1) * d + 1 - in, 0);
    };
    std::int64_t const th = total(x_shape[1], w_shape[0], options.stride_h, options.dilation_h);
    std::int64_t const tw = total(x_shape[2], w_shape[1], options.stride_w, options.dilation_w);
    options.pad_h = th / 2;
    options.extra_pad_h = th % 2;
    options.pad_w = tw / 2;
    options.extra_pad_w = tw % 2;
  }
  detail::conv2d_shapes("conv2d_padding_same", x_shape, w_shape, options, loc);  // refuses what cannot be convolved
  return options;
}

//! y = conv2d(x, w): y[n, oh, ow, co] = sum over kh, kw, ci of
//! x[n, oh*stride_h - pad_h + kh*dilation_h, ow*stride_w - pad_w + kw*dilation_w, ci] *
//! w[kh, kw, ci, co] (zero outside x), summed in float, rounded once to y's dtype.
//!
//! x [N, H, W, Cin], w [KH, KW, Cin, Cout] (Keras HWIO), y [N, OH, OW, Cout]
//! (conv2d_output_shape), workspace [rows, KH*KW*Cin] (conv2d_workspace_shape), all in
//! Policy::storage_type, which must accumulate in float. im2col into the workspace,
//! then one mpx::gemm per chunk of images it holds (one for a whole-batch workspace,
//! which then keeps x's columns for conv2d_backward_weights). Nothing is allocated.
//! Outputs must not overlap inputs (mpx::invalid_argument). Shape errors throw mpx::shape_error naming x's and
//! w's shapes. Asynchronous on a cuda_executor. Error bounds: docs/conv_and_pooling.md.
template <class Policy, executor Exec, tensor_like X, tensor_like W, tensor_like Y, tensor_like Cols,
          class Product = detail::policy_gemm<Policy>>
void conv2d_forward(Exec const& exec, X&& x, W&& w, Y&& y, Cols&& workspace, conv2d_options const& options = {},
                    mpx::source_location loc = mpx::source_location::current(), Product&& product = {}) {
  detail::check_conv2d_types<Policy, value_t<X>, value_t<W>, value_t<Y>, value_t<Cols>>();
  auto const [xv, wv, yv, cv] = detail::views_for<Exec>(x, w, y, workspace);
  static_assert(detail::all_writable<decltype(yv), decltype(cv)>,
                "mpx::conv2d_forward: y and the workspace are written and cannot be const");
  constexpr std::string_view op = "conv2d_forward";
  auto const plan = detail::plan_conv2d(op, xv.shape(), wv.shape(), "y", yv.shape(), cv.shape(), options, loc);
  detail::require_conv2d_disjoint(op, "y", yv, "x", xv, "w", wv, cv);
  auto const weights = wv.reshape(shape{plan.g.patch(), plan.g.cout});
  // (The lambdas capture a binding's pointer by name: clang before 16 cannot capture a
  // structured binding.)
  detail::for_each_image_chunk(plan, cv, yv, [&, x_data = xv.data()](std::int64_t n0, std::int64_t images,
                                                                     auto const& columns, auto const& y_rows) {
    detail::im2col(exec, op, plan.g, x_data, n0, images, columns.data());
    product(exec, columns, weights, y_rows, gemm_options{}, loc);
  });
}

//! dx = the gradient of sum(dy * conv2d(x, w)) with respect to x: dcolumns = dy w^T (one
//! mpx::gemm per chunk, into the workspace, rounded to storage), then col2im: each dx
//! element is the float sum of its column gradients, rounded once. dx is overwritten
//! (elements no window reaches get 0). Deterministic on both executors (the GPU's col2im
//! is a gather, without atomics). Shapes as conv2d_forward, with dx [N, H, W, Cin] and dy
//! [N, OH, OW, Cout]. Overwrites the workspace. Asynchronous on a cuda_executor.
template <class Policy, executor Exec, tensor_like DY, tensor_like W, tensor_like DX, tensor_like Cols,
          class Product = detail::policy_gemm<Policy>>
void conv2d_backward_data(Exec const& exec, DY&& dy, W&& w, DX&& dx, Cols&& workspace,
                          conv2d_options const& options = {},
                          mpx::source_location loc = mpx::source_location::current(), Product&& product = {}) {
  detail::check_conv2d_types<Policy, value_t<DY>, value_t<W>, value_t<DX>, value_t<Cols>>();
  auto const [dyv, wv, dxv, cv] = detail::views_for<Exec>(dy, w, dx, workspace);
  static_assert(detail::all_writable<decltype(dxv), decltype(cv)>,
                "mpx::conv2d_backward_data: dx and the workspace are written and cannot be const");
  constexpr std::string_view op = "conv2d_backward_data";
  auto const plan = detail::plan_conv2d(op, dxv.shape(), wv.shape(), "dy", dyv.shape(), cv.shape(), options, loc,
                                        {"dx", "w"});
  detail::require_conv2d_disjoint(op, "dx", dxv, "dy", dyv, "w", wv, cv);
  auto const weights = wv.reshape(shape{plan.g.patch(), plan.g.cout});
  detail::for_each_image_chunk(plan, cv, dyv, [&, dx_data = dxv.data()](std::int64_t n0, std::int64_t images,
                                                                       auto const& dcolumns, auto const& dy_rows) {
    product(exec, dy_rows, weights, dcolumns, gemm_options{.transpose_b = true}, loc);
    detail::col2im(exec, op, plan.g, dcolumns.data(), n0, images, dx_data);
  });
}

//! dw = the gradient of sum(dy * conv2d(x, w)) with respect to w: dw [KH*KW*Cin, Cout] =
//! columns(x)^T dy, one mpx::gemm (transpose_a) per chunk of images, summed in float.
//! dw [KH, KW, Cin, Cout] holds the storage type or float (a float master gradient);
//! with a workspace smaller than the batch, the chunks' products are added into dw
//! (gemm beta = 1), one rounding to dw's type per chunk. `columns`:
//! conv2d_columns::recompute runs im2col of x again; conv2d_columns::reuse_forward
//! trusts the workspace to hold conv2d_forward's columns of this x and options (a
//! whole-batch workspace, not written since, e.g. by conv2d_backward_data: call this
//! first), saving the im2col. Asynchronous on a cuda_executor.
template <class Policy, executor Exec, tensor_like X, tensor_like DY, tensor_like DW, tensor_like Cols,
          class Product = detail::policy_gemm<Policy>>
void conv2d_backward_weights(Exec const& exec, X&& x, DY&& dy, DW&& dw, Cols&& workspace,
                             conv2d_options const& options = {}, conv2d_columns columns = conv2d_columns::recompute,
                             mpx::source_location loc = mpx::source_location::current(), Product&& product = {}) {
  detail::check_conv2d_types<Policy, value_t<X>, value_t<DY>, value_t<Cols>>();
  static_assert(!policy_type<Policy> || std::is_same_v<value_t<DW>, typename Policy::storage_type> ||
                    std::is_same_v<value_t<DW>, float>,
                "mpx::conv2d_backward_weights: dw must hold the policy's storage_type or float");
  auto const [xv, dyv, dwv, cv] = detail::views_for<Exec>(x, dy, dw, workspace);
  static_assert(detail::all_writable<decltype(dwv), decltype(cv)>,
                "mpx::conv2d_backward_weights: dw and the workspace are written and cannot be const");
  constexpr std::string_view op = "conv2d_backward_weights";
  auto const plan = detail::plan_conv2d(op, xv.shape(), dwv.shape(), "dy", dyv.shape(), cv.shape(), options, loc,
                                        {"x", "dw"});
  auto const& g = plan.g;
  detail::require_conv2d_disjoint(op, "dw", dwv, "x", xv, "dy", dyv, cv);
  bool const reuse = columns == conv2d_columns::reuse_forward;
  if (reuse && plan.chunk_images < g.n)
    detail::fail<invalid_argument>(op,
                                   "conv2d_columns::reuse_forward needs a workspace that holds the whole batch's "
                                   "columns, [" + std::to_string(g.n * g.pixels()) + ", " +
                                       std::to_string(g.patch()) + "] or more; it has shape " +
                                       cv.shape().to_string(),
                                   loc);
  auto const dweights = dwv.reshape(shape{g.patch(), g.cout});
  detail::for_each_image_chunk(plan, cv, dyv, [&, x_data = xv.data()](std::int64_t n0, std::int64_t images,
                                                                      auto const& cols, auto const& dy_rows) {
    if (!reuse) detail::im2col(exec, op, g, x_data, n0, images, cols.data());
    product(exec, cols, dy_rows, dweights, gemm_options{.transpose_a = true, .beta = n0 == 0 ? 0.0f : 1.0f}, loc);
  });
}

//! Both gradients of a convolution: conv2d_backward_weights (with `columns`), then
//! conv2d_backward_data, which overwrites the workspace. The order lets a layer reuse
//! the forward pass's columns (conv2d_columns::reuse_forward) with one workspace.
template <class Policy, executor Exec, tensor_like X, tensor_like W, tensor_like DY, tensor_like DX, tensor_like DW,
          tensor_like Cols>
void conv2d_backward(Exec const& exec, X&& x, W&& w, DY&& dy, DX&& dx, DW&& dw, Cols&& workspace,
                     conv2d_options const& options = {}, conv2d_columns columns = conv2d_columns::recompute,
                     mpx::source_location loc = mpx::source_location::current()) {
  conv2d_backward_weights<Policy>(exec, x, dy, dw, workspace, options, columns, loc);
  conv2d_backward_data<Policy>(exec, dy, w, dx, workspace, options, loc);
}

}  // namespace mpx
