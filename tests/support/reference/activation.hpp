// The float64 reference of every activation in mpx::activations, value and derivative,
// shared by the activation kernel tests, the LSTM's gates and the layer tests: one
// overload of activation_of per functor, so an activation added to the list without a
// reference stops these tests from compiling.
#pragma once

#include <mpx/kernels/activation.hpp>

#include <cmath>

namespace mpx_test::reference {

// Plain functions, not lambdas: nvcc's front end rejects a lambda converted to a
// function pointer in a braced initializer. Each form stays exact in double for |x| <= 30.
inline constexpr double pi = 3.14159265358979323846;
//! sigmoid(v) without overflow or cancellation for either sign.
inline double sigmoid_f(double v) { return v >= 0 ? 1 / (1 + std::exp(-v)) : std::exp(v) / (1 + std::exp(v)); }
inline double sigmoid_df(double x) { return std::exp(-std::fabs(x)) / std::pow(1 + std::exp(-std::fabs(x)), 2); }
inline double tanh_f(double x) { return std::tanh(x); }
inline double tanh_df(double x) { return 1 / std::pow(std::cosh(x), 2); }
inline double identity_f(double x) { return x; }
inline double identity_df(double) { return 1.0; }
inline double relu_f(double x) { return x > 0 ? x : 0.0; }
inline double relu_df(double x) { return x > 0 ? 1.0 : 0.0; }
inline double gelu_f(double x) { return 0.5 * x * std::erfc(-x / std::sqrt(2.0)); }
inline double gelu_df(double x) {
  return 0.5 * std::erfc(-x / std::sqrt(2.0)) + x * std::exp(-0.5 * x * x) / std::sqrt(2 * pi);
}
//! gelu_tanh's u = sqrt(2/pi) (x + 0.044715 x^3).
inline double gelu_u(double x) { return std::sqrt(2 / pi) * (x + 0.044715 * x * x * x); }
// 0.5 (1 + tanh u) = sigmoid(2u) and 0.5 (1 - tanh^2 u) = 2 sigmoid(2u) sigmoid(-2u): the
// textbook form cancels to 0 even in double for x < -6.
inline double gelu_tanh_f(double x) { return x * sigmoid_f(2 * gelu_u(x)); }
inline double gelu_tanh_df(double x) {
  double const s = sigmoid_f(2 * gelu_u(x));
  return s + x * 2 * s * sigmoid_f(-2 * gelu_u(x)) * std::sqrt(2 / pi) * (1 + 3 * 0.044715 * x * x);
}

//! f and f' of one activation in float64.
struct activation {
  double (*f)(double);
  double (*df)(double);
};

inline activation activation_of(mpx::act::identity) { return {identity_f, identity_df}; }
inline activation activation_of(mpx::act::relu) { return {relu_f, relu_df}; }
inline activation activation_of(mpx::act::sigmoid) { return {sigmoid_f, sigmoid_df}; }
inline activation activation_of(mpx::act::tanh) { return {tanh_f, tanh_df}; }
inline activation activation_of(mpx::act::gelu) { return {gelu_f, gelu_df}; }
inline activation activation_of(mpx::act::gelu_tanh) { return {gelu_tanh_f, gelu_tanh_df}; }

//! The reference of a runtime-selected activation.
inline activation activation_of(mpx::activation a) {
  return mpx::with_activation(a, [](auto f) { return activation_of(f); });
}

template <class F, class... A>
void for_each_activation_in(F& f, mpx::activation_list<A...>) {
  (f(A{}), ...);
}
//! Calls f(A{}) for every functor A in mpx::activations.
template <class F>
void for_each_listed_activation(F&& f) {
  for_each_activation_in(f, mpx::activations{});
}

}  // namespace mpx_test::reference
