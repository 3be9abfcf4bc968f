// The shape-and-value fuzzer of mpx's public API, its common part: how one input's bytes
// become a call (extents, dtypes, values, offsets, aliasing), and what the call must do.
// Every call either refuses with an mpx::error whose message names the argument that is
// wrong, or produces what a float64 reference produces within the documented bound,
// with NaN exactly where the contract says NaN, and writes nothing outside its outputs.
// Anything else is a finding: mpx_fuzz::api::finding, which nothing in mpx catches, so
// the fuzzer dies on it (with the message) and the host suite's replay reports it.
// The groups (fuzz/api/<group>.cpp) say what each public kernel and layer is given.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/block_formats.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>

#include "../../tests/support/poison.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace mpx_fuzz::api {

//! A call that neither refused cleanly nor matched its reference. Deliberately not an
//! mpx::error.
struct finding : std::logic_error {
  using std::logic_error::logic_error;
};

[[noreturn]] inline void fail(std::string const& what) { throw finding(what); }

//! Largest element count of one drawn tensor: big enough for several host vector
//! widths, blocks and tails, small enough for thousands of calls a second under ASan.
inline constexpr std::int64_t max_elements = 1 << 12;

//! The input's bytes, read front to back. Past the end every draw is 0, the first
//! choice, so every input, however short, is a whole case; libFuzzer's mutations of a
//! byte change one choice.
class draw {
 public:
  explicit draw(std::span<std::uint8_t const> bytes) : bytes_(bytes) {}

  std::uint8_t byte() { return pos_ < bytes_.size() ? bytes_[pos_++] : 0; }
  std::uint32_t u32() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = v << 8 | byte();
    return v;
  }
  bool coin() { return byte() & 1; }
  //! A number in [0, n); n > 0.
  std::size_t below(std::size_t n) { return n <= 256 ? byte() % n : u32() % n; }
  //! One of the choices.
  template <class T>
  T pick(std::initializer_list<T> choices) {
    return choices.begin()[below(choices.size())];
  }

  //! An extent in [0, max]: mostly the sizes that break kernels (0, 1, primes, one
  //! either side of a power of two), sometimes any.
  std::int64_t extent(std::int64_t max) {
    static constexpr std::int64_t awkward[] = {1, 2, 3, 0, 5, 7, 13, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 257};
    std::uint8_t const b = byte();
    std::int64_t const e = b < 200 ? awkward[b % std::size(awkward)] : static_cast<std::int64_t>(u32() % (max + 1));
    return std::min(e, max);
  }
  //! Extents whose product stays within `limit` elements (each at most max_extent).
  std::vector<std::int64_t> extents(std::size_t rank, std::int64_t max_extent, std::int64_t limit = max_elements) {
    std::vector<std::int64_t> e(rank);
    std::int64_t product = 1;
    for (auto& x : e) {
      x = extent(std::min(max_extent, product == 0 ? max_extent : std::max<std::int64_t>(limit / product, 1)));
      if (x != 0) product *= x;
    }
    return e;
  }

  //! A value for a tensor of T: mostly moderate numbers of either sign, and with
  //! `hostile` also what breaks numerics: NaN, ±inf, ±0, ±max, the smallest normal,
  //! subnormals, and numbers near overflow.
  template <class T>
  T value(bool hostile) {
    using traits = mpx::dtype_traits<T>;
    std::uint8_t const b = byte();
    if (hostile && b >= 192) {
      switch (b % 12) {
        case 0: return traits::quiet_nan();
        case 1: return infinity<T>(false);
        case 2: return infinity<T>(true);
        case 3: return mpx::cast<T>(0.0);
        case 4: return mpx::cast<T>(-0.0);
        case 5: return traits::max();
        case 6: return traits::lowest();
        case 7: return traits::min_normal();
        case 8: return mpx::detail::from_bits<T>(typename traits::bits_type(1 + byte() % 3));  // subnormals
        case 9: return mpx::cast<T>(-mpx::detail::to_double(traits::min_normal()) / 2);
        case 10: return mpx::cast<T>(mpx::detail::to_double(traits::max()) * (0.5 + byte() / 512.0));
        default: return mpx::cast<T>(-mpx::detail::to_double(traits::max()) / (1 + byte() % 4));
      }
    }
    // A moderate value: a mantissa from the bytes, an exponent in [-6, 5], a sign.
    double const mantissa = 1.0 + static_cast<double>(byte() << 8 | byte()) / 65536.0;
    int const exponent = static_cast<int>(b % 12) - 6;
    return mpx::cast<T>(((b & 0x80) ? -1.0 : 1.0) * std::ldexp(mantissa, exponent));
  }

  //! n values; `hostile` as above.
  template <class T>
  std::vector<T> values(std::size_t n, bool hostile) {
    std::vector<T> v(n);
    for (auto& x : v) x = value<T>(hostile);
    return v;
  }

  std::size_t consumed() const { return pos_; }

 private:
  //! ±inf, or ±max in a format without infinities (e4m3), where overflow saturates.
  template <class T>
  static T infinity(bool negative) {
    using traits = mpx::dtype_traits<T>;
    if constexpr (traits::has_infinity) return negative ? mpx::cast<T>(-HUGE_VAL) : traits::infinity();
    else return negative ? traits::lowest() : traits::max();
  }

  std::span<std::uint8_t const> bytes_;
  std::size_t pos_ = 0;
};

//! What a case is called in a finding's message: the operation and its arguments,
//! written as the case draws them ("cast float32[3,7]+5 -> bfloat16[3,7]").
class call_name {
 public:
  explicit call_name(std::string op) : text_(std::move(op)) {}
  template <class T>
  call_name& operator<<(T const& part) {
    std::ostringstream os;
    os << part;
    text_ += os.str();
    return *this;
  }
  std::string const& str() const { return text_; }

 private:
  std::string text_;
};

template <class T>
std::string shape_text(std::vector<std::int64_t> const& e) {
  std::string s(mpx::dtype_name<T>);
  s += '[';
  for (std::size_t i = 0; i < e.size(); ++i) s += (i ? "," : "") + std::to_string(e[i]);
  return s + ']';
}

using mpx_test::poison;  // tests/support/poison.hpp: what guard bands and outputs hold before a call


//! A host tensor seen through a view that starts `offset` elements into its buffer,
//! with guard elements on both sides that no call may write: the views users make into
//! bigger buffers (a slice of a batch, a parameter in a flat arena) and unaligned starts
//! for the host's vector loops.
template <class T>
class guarded {
 public:
  static constexpr std::int64_t guard = 8;

  guarded(mpx::host_executor const& exec, std::vector<std::int64_t> extents, std::int64_t offset)
      : extents_(std::move(extents)), offset_(offset) {
    std::int64_t n = 1;
    for (auto e : extents_) n *= e;
    size_ = n;
    buffer_ = mpx::make_tensor<T>(exec, mpx::shape{offset_ + n + guard});
    std::fill_n(buffer_.data(), offset_ + n + guard, poison<T>());
  }
  //! The same, the offset drawn (0 to 7 elements).
  guarded(mpx::host_executor const& exec, std::vector<std::int64_t> extents, draw& d)
      : guarded(exec, std::move(extents), static_cast<std::int64_t>(d.byte() % 8)) {}

  mpx::tensor_view<T> view() { return {data(), mpx::shape(extents_)}; }
  mpx::tensor_view<T const> cview() const { return {data(), mpx::shape(extents_)}; }
  T* data() { return buffer_.data() + offset_; }
  T const* data() const { return buffer_.data() + offset_; }
  std::size_t size() const { return static_cast<std::size_t>(size_); }
  std::vector<std::int64_t> const& extents() const { return extents_; }
  std::int64_t offset() const { return offset_; }

  void assign(std::vector<T> const& v) { std::copy(v.begin(), v.end(), data()); }
  std::vector<T> values() const { return {data(), data() + size_}; }
  std::vector<double> wide() const {
    std::vector<double> out(size());
    for (std::size_t i = 0; i < size(); ++i) out[i] = mpx::detail::to_double(data()[i]);
    return out;
  }

  //! Fails the case when anything outside the view changed.
  void require_guards_intact(call_name const& call, std::string_view what) const {
    T const* b = buffer_.data();
    auto const intact = [](T x) { return mpx::bits(x) == mpx::bits(poison<T>()); };
    for (std::int64_t i = 0; i < offset_; ++i)
      if (!intact(b[i])) fail(call.str() + ": wrote " + std::to_string(offset_ - i) + " element(s) before " + std::string(what));
    for (std::int64_t i = 0; i < guard; ++i)
      if (!intact(b[offset_ + size_ + i])) fail(call.str() + ": wrote past the end of " + std::string(what) + " (element " + std::to_string(size_ + i) + ")");
  }

 private:
  std::vector<std::int64_t> extents_;
  std::int64_t offset_ = 0, size_ = 0;
  mpx::tensor<T> buffer_;
};

//! Runs a call the case made invalid on purpose: it must throw an mpx::error whose
//! message contains each of `names` (the argument or quantity that is wrong).
template <class F>
void require_refusal(call_name const& call, std::initializer_list<std::string_view> names, F&& f) {
  try {
    f();
  } catch (mpx::error const& e) {
    std::string_view const message = e.what();
    for (auto n : names)
      if (message.find(n) == std::string_view::npos)
        fail(call.str() + ": refused, but without naming '" + std::string(n) + "': " + std::string(message));
    return;
  }
  std::string expected;
  for (auto n : names) expected += (expected.empty() ? "" : ", ") + std::string(n);
  fail(call.str() + ": accepted an invalid call (a refusal naming " + expected + " was due)");
}

//! Runs a valid call: a refusal is a finding.
template <class F>
void require_accepted(call_name const& call, F&& f) {
  try {
    f();
  } catch (mpx::error const& e) {
    fail(call.str() + ": refused a valid call: " + e.what());
  }
}

//! Element i of an output against its reference: NaN exactly where the reference is
//! NaN, the same infinity where it is infinite, otherwise within `tolerance`
//! (absolute; the case scales it by what the documented bound says).
inline void require_near(call_name const& call, std::string_view what, std::size_t i, double got, double expected,
                         double tolerance) {
  auto const where = [&] {
    std::ostringstream os;
    os.precision(17);
    os << call.str() << ": " << what << "[" << i << "] is " << got << ", the float64 reference " << expected;
    return os.str();
  };
  if (std::isnan(expected)) {
    if (!std::isnan(got)) fail(where() + " (NaN due)");
    return;
  }
  if (std::isnan(got)) fail(where() + " (NaN where none is due)");
  if (std::isinf(expected) || std::isinf(got)) {
    if (got != expected) fail(where());
    return;
  }
  if (!(std::fabs(got - expected) <= tolerance)) {
    std::ostringstream os;
    os << " (off by " << std::fabs(got - expected) << ", allowed " << tolerance << ")";
    fail(where() + os.str());
  }
}

//! Bitwise equality of two outputs (NaN equal to NaN): for results the contract makes
//! exact, such as a cast or the same call in place and out of place.
template <class T>
void require_same(call_name const& call, std::string_view what, std::span<T const> got, std::span<T const> expected) {
  if (got.size() != expected.size()) fail(call.str() + ": " + std::string(what) + " has the wrong size");
  for (std::size_t i = 0; i < got.size(); ++i) {
    bool const same = mpx::is_nan(got[i]) || mpx::is_nan(expected[i])
                          ? mpx::is_nan(got[i]) && mpx::is_nan(expected[i])
                          : mpx::bits(got[i]) == mpx::bits(expected[i]);
    if (!same) {
      std::ostringstream os;
      os.precision(17);
      os << call.str() << ": " << what << "[" << i << "] is " << mpx::detail::to_double(got[i]) << ", "
         << mpx::detail::to_double(expected[i]) << " was due exactly";
      fail(os.str());
    }
  }
}

//! The unit roundoff of T (2^-p for p significand bits).
template <class T>
double unit_roundoff() {
  return std::ldexp(1.0, -(mpx::dtype_traits<T>::mantissa_bits + 1));
}

}  // namespace mpx_fuzz::api
