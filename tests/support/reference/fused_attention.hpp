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
//
// In float8 (the fp8 attention core's fused path, cuDNN's sdpa_fp8 and
// sdpa_fp8_backward) it computes in float64 what those graphs compute from the scalars
// in their slots (fused_fp8_slot): Q K V and O in e4m3, dO dQ dK dV in e5m2; S from the
// descaled fp8 products; P cast to e4m3 under scale_s before P V; dS cast to e5m2 under
// scale_dp before dQ and dK; each output cast under its scale; and the amaxes of P, O,
// dS, dQ, dK and dV (before their casts) written to their slots. No dropout in float8
// (the layer never asks: cuDNN's fp8 backward masks no dP).
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/exec/memory_space.hpp>
#include <mpx/kernels/dropout.hpp>
#include <mpx/kernels/fused_attention.hpp>

#include "softmax.hpp"

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
  //! float8 forward only: cast the probabilities before they are normalised, as a
  //! single-pass flash kernel can (exp(S - the row's max) at scale_s, P V divided by the
  //! row's sum after), rather than the normalised P the graph describes and mpx's core
  //! casts. cuDNN's kernel may do either; the GPU test's bounds must hold for both.
  bool fp8_probabilities_unnormalized = false;

  [[nodiscard]] char const* name() const noexcept override { return "mpx's tests' float64 reference (host)"; }

  [[nodiscard]] std::string prepare(mpx::fused_attention_shape const& s, void* stream) override {
    require_host(stream);
    if (s.io == mpx::fused_attention_io::float8 && s.dropout > 0.0f) return "the host reference has no float8 dropout";
    prepared.push_back(s);
    return "";
  }

  void forward(mpx::fused_attention_shape const& s, mpx::fused_attention_forward_args const& args, void* stream) override {
    require_host(stream);
    forwards.push_back(s);
    if (s.io == mpx::fused_attention_io::float8) return run_forward_fp8(s, args);  // (a member: it reads the option)
    with_io(s, [&]<class T>(T) { run_forward<T>(s, args); });
  }

  void backward(mpx::fused_attention_shape const& s, mpx::fused_attention_backward_args const& args,
                void* stream) override {
    require_host(stream);
    backwards.push_back(s);
    if (s.io == mpx::fused_attention_io::float8) return run_backward_fp8(s, args);
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
    else throw std::logic_error("host_fused_attention: float8 takes its own path");
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
          auto const [m, sum] = softmax_statistics_of(x);
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

  // ---- float8 -----------------------------------------------------------------------------

  static double slot(float const* scalars, mpx::fused_fp8_slot k) {
    return static_cast<double>(scalars[mpx::fused_fp8_offset(k)]);
  }
  static void write_slot(float* scalars, mpx::fused_fp8_slot k, double v) {
    scalars[mpx::fused_fp8_offset(k)] = static_cast<float>(v);
  }
  // x * scale in the format, as a float64 value of it.
  template <class F>
  static double quantized(double x, double scale) {
    return mpx::cast<double>(mpx::saturate_cast<F>(static_cast<float>(x * scale)));
  }
  template <class F>
  static void store(void* p, std::int64_t at, double x, double scale) {
    static_cast<F*>(p)[at] = mpx::saturate_cast<F>(static_cast<float>(x * scale));
  }

  // Row i's scaled logits from the fp8 Q and K, and their log-sum-exp.
  static std::vector<double> fp8_logits(mpx::fused_attention_shape const& s, void const* q, void const* k,
                                        double descale, std::int64_t b, std::int64_t h, std::int64_t i) {
    std::vector<double> x = logits<mpx::float8_e4m3>(s, q, k, b, h, i);
    for (double& v : x) v *= descale * descale;
    return x;
  }

  void run_forward_fp8(mpx::fused_attention_shape const& s, mpx::fused_attention_forward_args const& a) const {
    using f = mpx::fused_fp8_slot;
    using e4m3 = mpx::float8_e4m3;
    auto const qkv = mpx::fused_qkv_layout(s), o = mpx::fused_o_layout(s), stats = mpx::fused_stats_layout(s);
    double const descale_qkv = slot(a.fp8_scalars, f::descale_qkv), scale_s = slot(a.fp8_scalars, f::scale_s),
                 descale_s = slot(a.fp8_scalars, f::descale_s), scale_o = slot(a.fp8_scalars, f::scale_o);
    double amax_s = 0, amax_o = 0;
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t h = 0; h < s.heads; ++h)
        for (std::int64_t i = 0; i < s.tokens; ++i) {
          std::vector<double> const x = fp8_logits(s, a.q, a.k, descale_qkv, b, h, i);
          auto const [m, sum] = softmax_statistics_of(x);
          double const lse = m + std::log(sum);
          a.stats[stats.offset(b, h, i, 0)] = static_cast<float>(lse);
          // Cast normalised (P = exp(S - lse)), or before the normalisation (exp(S - max),
          // the product then divided by the row's sum).
          double const shift = fp8_probabilities_unnormalized ? m : lse;
          double const divide = fp8_probabilities_unnormalized ? sum : 1.0;
          std::vector<double> p8(x.size());
          for (std::size_t j = 0; j < x.size(); ++j) {
            amax_s = std::max(amax_s, std::exp(x[j] - lse));
            p8[j] = quantized<e4m3>(std::exp(x[j] - shift), scale_s);
          }
          for (std::int64_t d = 0; d < s.head_width; ++d) {
            double out = 0;
            for (std::int64_t j = 0; j <= i; ++j) out += p8[static_cast<std::size_t>(j)] * at<e4m3>(a.v, qkv, b, h, j, d);
            out *= descale_s * descale_qkv / divide;
            amax_o = std::max(amax_o, std::abs(out));
            store<e4m3>(a.o, o.offset(b, h, i, d), out, scale_o);
          }
        }
    write_slot(a.fp8_scalars, f::amax_s, amax_s);
    write_slot(a.fp8_scalars, f::amax_o, amax_o);
  }

  static void run_backward_fp8(mpx::fused_attention_shape const& s, mpx::fused_attention_backward_args const& a) {
    using f = mpx::fused_fp8_slot;
    using e4m3 = mpx::float8_e4m3;
    using e5m2 = mpx::float8_e5m2;
    auto const qkv = mpx::fused_qkv_layout(s), o = mpx::fused_o_layout(s), stats = mpx::fused_stats_layout(s);
    float const* const k8 = a.fp8_scalars;
    double const descale_qkv = slot(k8, f::descale_qkv), descale_s = slot(k8, f::descale_s),
                 scale_s = slot(k8, f::scale_s), descale_o = slot(k8, f::descale_o),
                 descale_d_o = slot(k8, f::descale_d_o), descale_dp = slot(k8, f::descale_dp),
                 scale_dp = slot(k8, f::scale_dp), scale_dqkv = slot(k8, f::scale_dqkv);
    auto const width = static_cast<std::size_t>(s.head_width);
    double amax_dp = 0, amax[3] = {0, 0, 0};  // dQ, dK, dV
    for (std::int64_t b = 0; b < s.batch; ++b)
      for (std::int64_t h = 0; h < s.heads; ++h) {
        std::vector<double> grads[3];  // dQ, dK, dV before their descales
        for (auto& g : grads) g.assign(static_cast<std::size_t>(s.tokens) * width, 0.0);
        for (std::int64_t i = 0; i < s.tokens; ++i) {
          std::vector<double> const x = fp8_logits(s, a.q, a.k, descale_qkv, b, h, i);
          double const lse = static_cast<double>(a.stats[stats.offset(b, h, i, 0)]);
          double row_dot = 0;
          for (std::int64_t d = 0; d < s.head_width; ++d)
            row_dot += at<e5m2>(a.d_o, o, b, h, i, d) * at<e4m3>(a.o, o, b, h, i, d);
          row_dot *= descale_d_o * descale_o;
          for (std::int64_t j = 0; j <= i; ++j) {
            double const p = std::exp(x[static_cast<std::size_t>(j)] - lse);
            double dp = 0;
            for (std::int64_t d = 0; d < s.head_width; ++d)
              dp += at<e5m2>(a.d_o, o, b, h, i, d) * at<e4m3>(a.v, qkv, b, h, j, d);
            double const ds = p * (dp * descale_d_o * descale_qkv - row_dot) * static_cast<double>(s.scale);
            amax_dp = std::max(amax_dp, std::abs(ds));
            double const ds8 = quantized<e5m2>(ds, scale_dp), p8 = quantized<e4m3>(p, scale_s);
            for (std::int64_t d = 0; d < s.head_width; ++d) {
              std::size_t const id = static_cast<std::size_t>(i) * width + static_cast<std::size_t>(d);
              std::size_t const jd = static_cast<std::size_t>(j) * width + static_cast<std::size_t>(d);
              grads[0][id] += ds8 * at<e4m3>(a.k, qkv, b, h, j, d);
              grads[1][jd] += ds8 * at<e4m3>(a.q, qkv, b, h, i, d);
              grads[2][jd] += p8 * at<e5m2>(a.d_o, o, b, h, i, d);
            }
          }
        }
        void* const out[3] = {a.d_q, a.d_k, a.d_v};
        double const descale[3] = {descale_dp * descale_qkv, descale_dp * descale_qkv, descale_s * descale_d_o};
        for (int g = 0; g < 3; ++g)
          for (std::int64_t t = 0; t < s.tokens; ++t)
            for (std::int64_t d = 0; d < s.head_width; ++d) {
              double const y = grads[g][static_cast<std::size_t>(t) * width + static_cast<std::size_t>(d)] * descale[g];
              amax[g] = std::max(amax[g], std::abs(y));
              store<e5m2>(out[g], qkv.offset(b, h, t, d), y, scale_dqkv);
            }
      }
    write_slot(a.fp8_scalars, f::amax_dp, amax_dp);
    write_slot(a.fp8_scalars, f::amax_dq, amax[0]);
    write_slot(a.fp8_scalars, f::amax_dk, amax[1]);
    write_slot(a.fp8_scalars, f::amax_dv, amax[2]);
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
