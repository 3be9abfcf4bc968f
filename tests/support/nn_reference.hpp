// Support for the activation, softmax and loss tests: awkward [rows, cols] shapes, the
// rounding unit of each dtype, and a checker that compares kernel output with a float64
// reference under a per-element error bound and reports the first violation.
#pragma once

#include "testing.hpp"

#include <cmath>
#include <cstddef>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace mpx_test {

//! [rows, cols] pairs drawn from {1, 2, 7, 31, 33, 1000, 4099} (every warp/block path:
//! one value per lane, partial warps, a full 1000-wide row in registers, a 4099-wide
//! row in shared memory), plus one row too long for shared memory (12000).
inline std::vector<std::pair<std::size_t, std::size_t>> awkward_matrices() {
  return {{1, 1},    {1, 2},     {2, 7},   {7, 31},  {31, 33},  {33, 7},    {1, 1000}, {1000, 1}, {2, 4099},
          {4099, 2}, {7, 1000},  {33, 33}, {31, 4099}, {1000, 33}, {4099, 31}, {33, 1000}, {2, 12000}};
}

//! Half the distance from 1 to the next value: the relative error of one rounding.
template <class T>
double unit_roundoff() {
  return std::ldexp(1.0, -(mpx::dtype_traits<T>::mantissa_bits + 1));
}
//! Float's unit roundoff: the scale of the errors of float arithmetic.
inline double const uf = std::ldexp(1.0, -24);

template <class T>
double min_subnormal() {
  return mpx::detail::to_double(mpx::dtype_traits<T>::min_subnormal());
}

template <class T>
double to_d(T x) {
  return mpx::detail::to_double(x);
}

//! The reference as storage T can hold it: +-inf where rounding to T overflows (a
//! loss-scaled half gradient beyond 65504 is inf, as the scaler expects), else ref.
template <class T>
double representable_in(double ref) {
  double const r = to_d(mpx::cast<T>(ref));
  return std::isinf(r) ? r : ref;
}

//! Collects element checks: got must be within tol of ref; NaN must meet NaN (a NaN
//! where the reference is a number fails, and so does a number where it is NaN); an
//! infinite reference must be met exactly.
class bound_checker {
 public:
  explicit bound_checker(std::string what) : what_(std::move(what)) {}
  void check(std::size_t i, double got, double ref, double tol) {
    ++checked_;
    bool ok;
    if (std::isnan(ref)) ok = std::isnan(got);
    else if (std::isinf(ref)) ok = got == ref;
    else ok = !std::isnan(got) && std::fabs(got - ref) <= tol;
    if (!ok && bad_++ == 0) {
      std::ostringstream os;
      os.precision(10);
      os << what_ << ": first violation at " << i << ": got " << got << ", reference " << ref << ", |error| "
         << std::fabs(got - ref) << " > bound " << tol;
      first_ = os.str();
    }
  }
  [[nodiscard]] std::size_t bad() const { return bad_; }
  [[nodiscard]] std::size_t checked() const { return checked_; }
  [[nodiscard]] std::string report() const { return std::to_string(bad_) + " of " + std::to_string(checked_) + " bad; " + first_; }

 private:
  std::string what_;
  std::string first_;
  std::size_t bad_ = 0;
  std::size_t checked_ = 0;
};

#define MPX_REQUIRE_WITHIN(checker)     \
  do {                                  \
    INFO((checker).report());           \
    REQUIRE((checker).bad() == 0);      \
    REQUIRE((checker).checked() > 0);   \
  } while (false)

//! Central finite difference of f at x with step h (float64).
inline double finite_difference(std::function<double(double)> const& f, double x, double h = 1e-6) {
  return (f(x + h) - f(x - h)) / (2 * h);
}

}  // namespace mpx_test
