// A fused attention for host memory, in float64: what causal_self_attention's fused path
// runs against on the host, so the host suite executes the code that hands cuDNN its
// tensors on the GPU (the pointers into the layer's token-major buffers, the statistics,
// the reserved batch's plan, the dropout key of each training forward).
//
// It reads and writes every tensor where fused_attention.hpp's layouts say (the strides
// cuDNN is given), keeps the statistics as the log-sum-exp of each row's scaled logits,
// and draws dropout with mpx's Philox (mpx::dropout_keeps) from the {seed, offset} the
// layer hands it: weight [b, h, i, j] at index ((b * heads + h) * tokens + i) * tokens + j.
// The backward pass redraws the same masks from the same key, as cuDNN's does.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/exec/memory_space.hpp>
#include <mpx/kernels/dropout.hpp>
#include <mpx/kernels/fused_attention.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mpx_test::reference {

class host_fused_attention final : public mpx::fused_attention_backend {
 public:
  //! Every call's shape, in order: what tests ask of the layer's plan.
  std::vector<mpx::fused_attention_shape> prepared, forwards, backwards;

  [[nodiscard]] char const* name() const noexcept override { return "mpx's tests' float64 reference (host)"; }

  [[nodiscard]] std::string prepare(mpx::fused_attention_shape const& s, void* stream) override {
    require_host(stream);
    if (s.io == mpx::fused_attention_io::float8) return "the host reference takes half and bfloat16";
    prepared.push_back(s);
    return "";
  }

  void forward(mpx::fused_attention_shape const& s, mpx::fused_attention_forward_args const& args, void* stream) override {
    require_host(stream);
    forwards.push_back(s);
    with_io(s, [&]<class T>(T) { run_forward<T>(s, args); });
  }

  void backward(mpx::fused_attention_shape const& s, mpx::fused_attention_backward_args const& args,
                void* stream) override {
    require_host(stream);
    backwards.push_back(s);
    with_io(s, [&]<class T>(T) { run_backward<T>(s, args); });
  }

  void dropout_keeps(mpx::fused_attention_shape const& s, mpx::fused_attention_forward_args const& args, float* keeps,
                     void* stream) override {
    require_host(stream);
    std::int64_t const row = mpx::fused_dropout_keeps_row(s.tokens);
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t h = 0; h < s.heads; ++h)
        for (std::int64_t i = 0; i < s.tokens; ++i)
          for (std::int64_t j = 0; j <= i; ++j)
            keeps[((b * s.heads + h) * s.tokens + i) * row + j] = kept(s, args.dropout_key, b, h, i, j) != 0.0 ? 1.0f : 0.0f;
  }

 private:
  static void require_host(void* stream) {
    if (stream != nullptr) throw std::logic_error("host_fused_attention: called with a CUDA stream");
  }

  template <class F>
  static void with_io(mpx::fused_attention_shape const& s, F&& f) {
    if (s.io == mpx::fused_attention_io::half) f(mpx::half{});
    else if (s.io == mpx::fused_attention_io::bfloat16) f(mpx::bfloat16{});
    else throw std::logic_error("host_fused_attention: float8 was refused at prepare");
  }

  // The factor weight [b, h, i, j] is multiplied by: 1 without dropout, else 0 (dropped)
  // or 1 / (1 - rate).
  static double kept(mpx::fused_attention_shape const& s, std::int64_t const* key, std::int64_t b, std::int64_t h,
                     std::int64_t i, std::int64_t j) {
    if (s.dropout <= 0.0f) return 1.0;
    if (key == nullptr) throw std::logic_error("host_fused_attention: dropout without a key");
    mpx::dropout_options const options{s.dropout, static_cast<std::uint64_t>(key[0]), static_cast<std::uint64_t>(key[1]),
                                       nullptr};
    auto const index = static_cast<std::uint64_t>(((b * s.heads + h) * s.tokens + i) * s.tokens + j);
    return mpx::dropout_keeps(options, index) ? 1.0 / (1.0 - static_cast<double>(s.dropout)) : 0.0;
  }

  template <class T>
  static double at(void const* p, mpx::fused_tensor_layout const& l, std::int64_t b, std::int64_t h, std::int64_t t,
                   std::int64_t d) {
    return mpx::cast<double>(static_cast<T const*>(p)[l.offset(b, h, t, d)]);
  }

  // Row i's scaled logits against tokens 0..i.
  template <class T>
  static std::vector<double> logits(mpx::fused_attention_shape const& s, void const* q, void const* k, std::int64_t b,
                                    std::int64_t h, std::int64_t i) {
    auto const l = mpx::fused_qkv_layout(s);
    std::vector<double> out(static_cast<std::size_t>(i + 1));
    for (std::int64_t j = 0; j <= i; ++j) {
      double dot = 0;
      for (std::int64_t d = 0; d < s.head_width; ++d) dot += at<T>(q, l, b, h, i, d) * at<T>(k, l, b, h, j, d);
      out[static_cast<std::size_t>(j)] = static_cast<double>(s.scale) * dot;
    }
    return out;
  }

  template <class T>
  static void run_forward(mpx::fused_attention_shape const& s, mpx::fused_attention_forward_args const& a) {
    auto const qkv = mpx::fused_qkv_layout(s), o = mpx::fused_o_layout(s), stats = mpx::fused_stats_layout(s);
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t h = 0; h < s.heads; ++h)
        for (std::int64_t i = 0; i < s.tokens; ++i) {
          std::vector<double> const x = logits<T>(s, a.q, a.k, b, h, i);
          double const m = *std::max_element(x.begin(), x.end());
          double sum = 0;
          for (double v : x) sum += std::exp(v - m);
          double const lse = m + std::log(sum);
          a.stats[stats.offset(b, h, i, 0)] = static_cast<float>(lse);
          std::vector<double> weight(x.size());  // softmax, dropped
          for (std::int64_t j = 0; j <= i; ++j)
            weight[static_cast<std::size_t>(j)] =
                std::exp(x[static_cast<std::size_t>(j)] - lse) * kept(s, a.dropout_key, b, h, i, j);
          for (std::int64_t d = 0; d < s.head_width; ++d) {
            double out = 0;
            for (std::int64_t j = 0; j <= i; ++j) out += weight[static_cast<std::size_t>(j)] * at<T>(a.v, qkv, b, h, j, d);
            static_cast<T*>(a.o)[o.offset(b, h, i, d)] = mpx::cast<T>(out);
          }
        }
  }

  // P = exp(S - lse) from the statistics; with M the dropout factors, O = (P M) V, so
  // dV = (P M)ᵀ dO, dP = (dO Vᵀ) M, dS = P (dP - rowsum(dO O)), dQ = scale dS K and
  // dK = scale dSᵀ Q. O and dO are read as stored, as cuDNN reads them.
  template <class T>
  static void run_backward(mpx::fused_attention_shape const& s, mpx::fused_attention_backward_args const& a) {
    auto const qkv = mpx::fused_qkv_layout(s), o = mpx::fused_o_layout(s), stats = mpx::fused_stats_layout(s);
    auto const width = static_cast<std::size_t>(s.head_width);
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t h = 0; h < s.heads; ++h) {
        std::vector<double> dq(static_cast<std::size_t>(s.tokens) * width), dk(dq.size()), dv(dq.size());
        for (std::int64_t i = 0; i < s.tokens; ++i) {
          std::vector<double> const x = logits<T>(s, a.q, a.k, b, h, i);
          double const lse = static_cast<double>(a.stats[stats.offset(b, h, i, 0)]);
          double row_dot = 0;  // dO_i . O_i
          for (std::int64_t d = 0; d < s.head_width; ++d) row_dot += at<T>(a.d_o, o, b, h, i, d) * at<T>(a.o, o, b, h, i, d);
          for (std::int64_t j = 0; j <= i; ++j) {
            double const p = std::exp(x[static_cast<std::size_t>(j)] - lse), m = kept(s, a.dropout_key, b, h, i, j);
            double dp = 0;
            for (std::int64_t d = 0; d < s.head_width; ++d) dp += at<T>(a.d_o, o, b, h, i, d) * at<T>(a.v, qkv, b, h, j, d);
            double const ds = p * (dp * m - row_dot) * static_cast<double>(s.scale);
            for (std::int64_t d = 0; d < s.head_width; ++d) {
              std::size_t const id = static_cast<std::size_t>(i) * width + static_cast<std::size_t>(d);
              std::size_t const jd = static_cast<std::size_t>(j) * width + static_cast<std::size_t>(d);
              dv[jd] += p * m * at<T>(a.d_o, o, b, h, i, d);
              dq[id] += ds * at<T>(a.k, qkv, b, h, j, d);
              dk[jd] += ds * at<T>(a.q, qkv, b, h, i, d);
            }
          }
        }
        for (std::int64_t t = 0; t < s.tokens; ++t)
          for (std::int64_t d = 0; d < s.head_width; ++d) {
            std::size_t const td = static_cast<std::size_t>(t) * width + static_cast<std::size_t>(d);
            std::int64_t const at_td = qkv.offset(b, h, t, d);
            static_cast<T*>(a.d_q)[at_td] = mpx::cast<T>(dq[td]);
            static_cast<T*>(a.d_k)[at_td] = mpx::cast<T>(dk[td]);
            static_cast<T*>(a.d_v)[at_td] = mpx::cast<T>(dv[td]);
          }
      }
  }
};

//! host_fused_attention registered for host memory while it lives (the one before it
//! restored after).
struct host_fused_attention_registered {
  host_fused_attention backend;
  mpx::fused_attention_backend* const previous = mpx::register_fused_attention<mpx::host_space>(&backend);
  host_fused_attention_registered() = default;
  host_fused_attention_registered(host_fused_attention_registered const&) = delete;
  host_fused_attention_registered& operator=(host_fused_attention_registered const&) = delete;
  ~host_fused_attention_registered() { mpx::register_fused_attention<mpx::host_space>(previous); }
};

}  // namespace mpx_test::reference
