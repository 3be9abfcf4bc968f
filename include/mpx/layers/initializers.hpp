// Weight initialisers as Keras names them (glorot_uniform, glorot_normal, he_uniform,
// he_normal, zeros, ones, random_uniform), as PyTorch's layers make them by default
// (torch_linear; normal(1) is nn.Embedding's), and GPT-2's (normal(0.02), and
// gpt2_residual(layers) for the projections that end a residual branch), reproducible
// from a seed on every platform and executor: the values are drawn on the host from a
// counter-based generator (splitmix64 of seed and element index, Box-Muller for
// normals), rounded once to the storage type, then copied to where the layer lives.
// std::mt19937 and std::normal_distribution are avoided because the standard leaves the
// distributions' algorithms unspecified.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/splitmix64.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mpx {

//! How a layer's weights start. A value, used as `initializer::glorot_uniform` or
//! `initializer::normal(0.02)`.
class initializer {
 public:
  enum class kind : std::uint8_t {
    zeros, ones, glorot_uniform, glorot_normal, he_uniform, he_normal, random_uniform,
    normal,        //!< N(0, parameter²), not truncated
    uniform,       //!< U(-parameter, parameter)
    torch_linear,  //!< U(-1/sqrt(fan_in), 1/sqrt(fan_in))
  };
  static initializer const zeros, ones;
  //! Keras's defaults: Dense's and Conv2D's kernels (glorot_uniform), its Embedding's
  //! (random_uniform: RandomUniform(-0.05, 0.05)); the others Keras offers by name.
  static initializer const glorot_uniform, glorot_normal, he_uniform, he_normal, random_uniform;
  //! PyTorch's default for nn.Linear's and nn.Conv2d's weight and bias alike
  //! (kaiming_uniform_ with a = sqrt(5), which comes to U(±1/sqrt(fan_in))).
  static initializer const torch_linear;
  //! N(0, stddev²), not truncated (torch.nn.init.normal_): nn.Embedding's default is
  //! normal(1); GPT-2 starts every weight at normal(0.02).
  [[nodiscard]] static constexpr initializer normal(double stddev) noexcept { return {kind::normal, stddev}; }
  //! U(-limit, limit).
  [[nodiscard]] static constexpr initializer uniform(double limit) noexcept { return {kind::uniform, limit}; }
  //! GPT-2's start for the projections that end a residual branch (attention's output,
  //! the MLP's second dense): normal(0.02 / sqrt(2 x layers)), so that the residual
  //! stream's variance does not grow with depth.
  [[nodiscard]] static initializer gpt2_residual(std::size_t layers) noexcept {
    return normal(0.02 / std::sqrt(2.0 * static_cast<double>(layers > 0 ? layers : 1)));
  }

  constexpr initializer() noexcept = default;  //!< zeros
  [[nodiscard]] constexpr kind which() const noexcept { return kind_; }
  [[nodiscard]] constexpr double parameter() const noexcept { return parameter_; }
  friend constexpr bool operator==(initializer const&, initializer const&) = default;

 private:
  constexpr initializer(kind k, double p) noexcept : kind_(k), parameter_(p) {}
  kind kind_ = kind::zeros;
  double parameter_ = 0;
};

inline constexpr initializer initializer::zeros{initializer::kind::zeros, 0};
inline constexpr initializer initializer::ones{initializer::kind::ones, 0};
inline constexpr initializer initializer::glorot_uniform{initializer::kind::glorot_uniform, 0};
inline constexpr initializer initializer::glorot_normal{initializer::kind::glorot_normal, 0};
inline constexpr initializer initializer::he_uniform{initializer::kind::he_uniform, 0};
inline constexpr initializer initializer::he_normal{initializer::kind::he_normal, 0};
inline constexpr initializer initializer::random_uniform{initializer::kind::random_uniform, 0};
inline constexpr initializer initializer::torch_linear{initializer::kind::torch_linear, 0};

//! "glorot_uniform", "normal(0.02)", ...
[[nodiscard]] inline std::string to_string(initializer i) {
  auto with = [&](std::string name) { return name + "(" + detail::to_text(i.parameter()) + ")"; };
  switch (i.which()) {
    case initializer::kind::zeros: return "zeros";
    case initializer::kind::ones: return "ones";
    case initializer::kind::glorot_uniform: return "glorot_uniform";
    case initializer::kind::glorot_normal: return "glorot_normal";
    case initializer::kind::he_uniform: return "he_uniform";
    case initializer::kind::he_normal: return "he_normal";
    case initializer::kind::random_uniform: return "random_uniform";
    case initializer::kind::normal: return with("normal");
    case initializer::kind::uniform: return with("uniform");
    case initializer::kind::torch_linear: return "torch_linear";
  }
  return "?";
}

namespace detail {

//! A uniform double in (0, 1) from 53 random bits of draw `i` of stream `seed`.
inline double uniform_open01(std::uint64_t seed, std::uint64_t i) noexcept {
  std::uint64_t const bits = splitmix64::mix(splitmix64::mix(seed) ^ (i * 0xD1342543DE82EF95ull + 1));
  return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53;
}

//! A standard normal (Box-Muller, from draws 2i and 2i + 1), not truncated.
inline double standard_normal(std::uint64_t seed, std::uint64_t i) noexcept {
  constexpr double two_pi = 6.283185307179586476925;
  return std::sqrt(-2.0 * std::log(uniform_open01(seed, 2 * i))) * std::cos(two_pi * uniform_open01(seed, 2 * i + 1));
}

//! Keras's *_normal initialisers draw a normal truncated at two standard deviations,
//! by rejection, with the deviation corrected by 0.8796; so do we.
inline double truncated_normal(std::uint64_t seed, std::uint64_t i) noexcept {
  for (std::uint64_t attempt = 0;; ++attempt) {
    double const z = standard_normal(seed, i + (attempt << 40));
    if (std::fabs(z) <= 2.0) return z / 0.87962566103423978;
  }
}

}  // namespace detail

//! Fills x with `init` for a weight of fan_in inputs and fan_out outputs per unit
//! (Keras: dense [in, out] has fan_in = in; a conv kernel [kh, kw, cin, cout] has
//! fan_in = kh*kw*cin, fan_out = kh*kw*cout; a layer's bias is given its kernel's fans,
//! as PyTorch gives them). Same seed, same values, everywhere. An initializer whose
//! deviation or limit is negative or not finite is an mpx::invalid_argument.
template <executor Exec, tensor_like X>
void initialize(Exec const& exec, X&& x, initializer init, std::int64_t fan_in, std::int64_t fan_out,
                std::uint64_t seed) {
  using T = value_t<X>;
  auto v = mpx::view(x);
  tensor<T, host_space> values(v.shape());
  double const fi = static_cast<double>(fan_in > 0 ? fan_in : 1);
  double const fo = static_cast<double>(fan_out > 0 ? fan_out : 1);
  double const p = init.parameter();
  if (!std::isfinite(p) || p < 0)
    detail::fail<invalid_argument>("mpx::initialize", to_string(init) + ": the deviation or limit must be finite and >= 0");
  using k = initializer::kind;
  for (std::size_t i = 0; i < values.size(); ++i) {
    double r = 0;
    auto symmetric = [&] { return 2 * detail::uniform_open01(seed, i) - 1; };  // U(-1, 1)
    switch (init.which()) {
      case k::zeros: r = 0; break;
      case k::ones: r = 1; break;
      case k::glorot_uniform: r = std::sqrt(6.0 / (fi + fo)) * symmetric(); break;
      case k::he_uniform: r = std::sqrt(6.0 / fi) * symmetric(); break;
      case k::glorot_normal: r = std::sqrt(2.0 / (fi + fo)) * detail::truncated_normal(seed, i); break;
      case k::he_normal: r = std::sqrt(2.0 / fi) * detail::truncated_normal(seed, i); break;
      case k::random_uniform: r = 0.05 * symmetric(); break;
      case k::normal: r = p * detail::standard_normal(seed, i); break;
      case k::uniform: r = p * symmetric(); break;
      case k::torch_linear: r = symmetric() / std::sqrt(fi); break;
    }
    values[i] = cast<T>(static_cast<float>(r));
  }
  copy(exec, values, v);
  exec.synchronize();  // `values` is freed on return
}

}  // namespace mpx
