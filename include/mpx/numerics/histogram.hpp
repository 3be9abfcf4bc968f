// mpx::exponent_histogram: how many elements of a tensor have each binary exponent,
// floor(log2 |x|), with zeros, NaN and inf counted apart. The picture that decides a
// loss scale: float16 keeps exponents -24 ... 15 (below -14 only as subnormals, with
// fewer bits), so a histogram whose mass sits below -24 is a gradient that becomes 0
// in half, and multiplying by 2^k shifts every bin k to the right. bfloat16 keeps
// float32's exponents (-133 ... 127, below -126 as subnormals); float8_e4m3 keeps
// -9 ... 8, float8_e5m2 -16 ... 15 (dtype_traits has their limits).
//
// One pass, integer counts (so the result is exact and deterministic): on the host a
// loop, on the GPU CUB's DeviceHistogram over the bin of each element. Both count the
// bins of one MPX_HD function, detail::exponent_bin. Synchronises a cuda_executor's stream.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#if MPX_HAS_CUDA
#include <cub/device/device_histogram.cuh>
#include <thrust/iterator/transform_iterator.h>
#endif

namespace mpx {

struct exponent_histogram {
  static constexpr int min_exponent = -149;  //!< float32's smallest subnormal, 2^-149
  static constexpr int max_exponent = 127;   //!< float32's largest binade
  static constexpr std::size_t bins = max_exponent - min_exponent + 1;

  //! counts[e - min_exponent]: finite nonzero elements with floor(log2 |x|) == e.
  std::array<std::uint64_t, bins> counts{};
  std::uint64_t zero = 0;  //!< +0 and -0
  std::uint64_t nan = 0;
  std::uint64_t inf = 0;

  [[nodiscard]] std::uint64_t count(int exponent) const noexcept {
    return exponent < min_exponent || exponent > max_exponent ? 0 : counts[static_cast<std::size_t>(exponent - min_exponent)];
  }
  //! Finite nonzero elements with an exponent in [lo, hi].
  [[nodiscard]] std::uint64_t count_between(int lo, int hi) const noexcept {
    std::uint64_t n = 0;
    for (int e = std::max(lo, min_exponent); e <= std::min(hi, max_exponent); ++e) n += count(e);
    return n;
  }
  [[nodiscard]] std::uint64_t size() const noexcept { return count_between(min_exponent, max_exponent) + zero + nan + inf; }

  //! What float16 makes of the binade 2^e ... 2^(e+1).
  static constexpr char const* half_fate(int e) noexcept {
    if (e >= 16) return "inf in half";
    if (e == 15) return "inf in half from 65520";
    if (e >= -14) return "";
    if (e >= -24) return "subnormal in half";
    if (e == -25) return "0 in half up to 2^-25, else 2^-24";
    return "0 in half";
  }

  //! One line per occupied exponent, a bar of its share, and what float16 makes of it.
  [[nodiscard]] std::string to_string() const {
    std::string out;
    std::uint64_t const total = size();
    if (total == 0) return "(empty)\n";
    char line[160];
    auto row = [&](char const* label, std::uint64_t n, char const* note) {
      double const share = static_cast<double>(n) / static_cast<double>(total);
      int const width = static_cast<int>(share * 40 + 0.5);
      std::snprintf(line, sizeof line, "%10s %10llu %6.2f%% %-40s %s\n", label, static_cast<unsigned long long>(n),
                    100 * share, std::string(static_cast<std::size_t>(width), '#').c_str(), note);
      out += line;
    };
    for (int e = max_exponent; e >= min_exponent; --e) {
      std::uint64_t const n = count(e);
      if (n == 0) continue;
      char label[16];
      std::snprintf(label, sizeof label, "2^%d", e);
      row(label, n, half_fate(e));
    }
    if (zero) row("zero", zero, "");
    if (nan) row("NaN", nan, "");
    if (inf) row("inf", inf, "");
    return out;
  }
};

namespace detail {

//! The histogram bin of x (a float, exact widening of any mpx dtype): 0 ... bins-1 for
//! finite nonzero values, then zero, NaN, inf.
inline constexpr unsigned histogram_zero_bin = exponent_histogram::bins;
inline constexpr unsigned histogram_nan_bin = exponent_histogram::bins + 1;
inline constexpr unsigned histogram_inf_bin = exponent_histogram::bins + 2;
inline constexpr unsigned histogram_all_bins = exponent_histogram::bins + 3;

MPX_HD inline unsigned exponent_bin(float x) noexcept {
  std::uint32_t const magnitude = bit_cast<std::uint32_t>(x) & 0x7FFF'FFFFu;
  std::uint32_t const biased = magnitude >> 23;
  if (biased == 0xFFu) return (magnitude & 0x7F'FFFFu) ? histogram_nan_bin : histogram_inf_bin;
  if (magnitude == 0) return histogram_zero_bin;
  if (biased != 0) return biased + 22u;  // e + 149 with e = biased - 127: bins 23 ... 276
  unsigned top = 0;  // subnormal: magnitude = m * 2^-149, so floor(log2) = -149 + the top bit of m
  for (std::uint32_t m = magnitude >> 1; m != 0; m >>= 1) ++top;
  return top;
}

//! The bin of one element of any dtype, for the GPU's histogram of bin numbers.
struct exponent_bin_of {
  template <class T>
  MPX_HD int operator()(T x) const noexcept {
    return static_cast<int>(exponent_bin(cast<float>(x)));
  }
};

}  // namespace detail

//! The exponent histogram of x (any dtype of mpx::dtype_list). Synchronises a cuda_executor.
template <executor Exec, tensor_like X>
exponent_histogram log2_histogram([[maybe_unused]] Exec const& exec, X&& x) {
  auto const v = mpx::view(x);
  using T = value_t<X>;
  static_assert(dtype<T>, "mpx::log2_histogram: x must hold a dtype of mpx::dtype_list (mpx::half, mpx::bfloat16, "
                          "float, mpx::float8_e4m3, mpx::float8_e5m2)");
  detail::require_access<Exec, space_t<X>>();
  std::array<std::uint64_t, detail::histogram_all_bins> all{};
  if constexpr (is_host_executor_v<Exec>) {
    for (std::size_t i = 0; i < v.size(); ++i) ++all[detail::exponent_bin(cast<float>(v.data()[i]))];
  } else if (!v.empty()) {
#if MPX_HAS_CUDA
    // Bin numbers 0 ... histogram_all_bins-1 in bins of width one: CUB counts them with
    // integer atomics (per block, then per grid), so the counts are exact. Its scratch
    // comes from the stream-ordered pool.
    tensor<unsigned long long, device_space> counts(exec, shape{static_cast<std::int64_t>(detail::histogram_all_bins)});
    thrust::transform_iterator<detail::exponent_bin_of, T const*, int> const bins(v.data(), {});
    auto const items = static_cast<std::int64_t>(v.size());
    constexpr int levels = static_cast<int>(detail::histogram_all_bins) + 1;
    std::size_t scratch_bytes = 0;
    MPX_CUDA_CHECK(cub::DeviceHistogram::HistogramEven(nullptr, scratch_bytes, bins, counts.data(), levels, 0,
                                                       levels - 1, items, exec.stream()));
    detail::buffer<unsigned char, device_space> scratch(scratch_bytes, exec.stream());
    MPX_CUDA_CHECK(cub::DeviceHistogram::HistogramEven(scratch.data(), scratch_bytes, bins, counts.data(), levels, 0,
                                                       levels - 1, items, exec.stream()));
    auto const host = to_host(exec, counts);
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = host[i];
#else
    detail::kernels_need_nvcc<Exec>();
#endif
  }
  exponent_histogram h;
  std::copy(all.begin(), all.begin() + exponent_histogram::bins, h.counts.begin());
  h.zero = all[detail::histogram_zero_bin];
  h.nan = all[detail::histogram_nan_bin];
  h.inf = all[detail::histogram_inf_bin];
  return h;
}

}  // namespace mpx
