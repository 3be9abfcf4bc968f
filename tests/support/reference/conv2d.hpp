// The float64 direct convolution every conv2d test checks against (the conv2d kernels,
// the fp8 conv2d layer): NHWC input, [KH, KW, Cin, Cout] weights, strides, padding
// (with Keras 'same''s extra row and column), dilation; the forward output and both
// gradients for the loss sum(dy * y), each with the sum of the magnitudes of its terms.
#pragma once

#include <mpx/kernels/conv2d.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace mpx_test::reference {

//! x [n, h, w, cin], weights [kh, kw, cin, cout], and how the kernel walks x.
struct conv2d_geometry {
  std::int64_t n, h, w, cin, kh, kw, cout;
  mpx::conv2d_options o{};
};

struct conv2d_extent {
  std::int64_t oh, ow;
};

//! The output's height and width, written out from the definition, not taken from the
//! library.
inline conv2d_extent conv2d_output_extent(conv2d_geometry const& g) {
  std::int64_t const sh = (g.kh - 1) * g.o.dilation_h + 1, sw = (g.kw - 1) * g.o.dilation_w + 1;
  return {(g.h + 2 * g.o.pad_h + g.o.extra_pad_h - sh) / g.o.stride_h + 1,
          (g.w + 2 * g.o.pad_w + g.o.extra_pad_w - sw) / g.o.stride_w + 1};
}

struct conv2d_result {
  std::vector<double> y, y_abs, dx, dx_abs, dw, dw_abs;
};

//! y = x * w, dx = dy * w^T scattered back, dw = x^T dy, each with the sum of |terms|.
//! Every sum runs over the output positions in order, then the kernel taps, then the
//! channels.
inline conv2d_result conv2d(conv2d_geometry const& g, std::vector<double> const& x, std::vector<double> const& w,
                            std::vector<double> const& dy) {
  auto const [oh_n, ow_n] = conv2d_output_extent(g);
  auto const& o = g.o;
  auto const outputs = static_cast<std::size_t>(g.n * oh_n * ow_n * g.cout);
  conv2d_result r{std::vector<double>(outputs), std::vector<double>(outputs), std::vector<double>(x.size()),
                  std::vector<double>(x.size()), std::vector<double>(w.size()), std::vector<double>(w.size())};
  for (std::int64_t n = 0; n < g.n; ++n)
    for (std::int64_t oh = 0; oh < oh_n; ++oh)
      for (std::int64_t ow = 0; ow < ow_n; ++ow)
        for (std::int64_t kh = 0; kh < g.kh; ++kh)
          for (std::int64_t kw = 0; kw < g.kw; ++kw) {
            std::int64_t const ih = oh * o.stride_h - o.pad_h + kh * o.dilation_h;
            std::int64_t const iw = ow * o.stride_w - o.pad_w + kw * o.dilation_w;
            if (ih < 0 || ih >= g.h || iw < 0 || iw >= g.w) continue;
            for (std::int64_t ci = 0; ci < g.cin; ++ci)
              for (std::int64_t co = 0; co < g.cout; ++co) {
                auto const xi = static_cast<std::size_t>(((n * g.h + ih) * g.w + iw) * g.cin + ci);
                auto const wi = static_cast<std::size_t>(((kh * g.kw + kw) * g.cin + ci) * g.cout + co);
                auto const yi = static_cast<std::size_t>(((n * oh_n + oh) * ow_n + ow) * g.cout + co);
                r.y[yi] += x[xi] * w[wi];
                r.y_abs[yi] += std::fabs(x[xi] * w[wi]);
                r.dx[xi] += dy[yi] * w[wi];
                r.dx_abs[xi] += std::fabs(dy[yi] * w[wi]);
                r.dw[wi] += x[xi] * dy[yi];
                r.dw_abs[wi] += std::fabs(x[xi] * dy[yi]);
              }
          }
  return r;
}

}  // namespace mpx_test::reference
