// The extents of a tensor: up to eight dimensions, row-major, with a printable form
// ("[32, 28, 28, 1]") so every shape error can name the shapes involved.
#pragma once

#include <mpx/core/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

namespace mpx {

class shape {
 public:
  static constexpr std::size_t max_rank = 8;

  constexpr shape() = default;  //!< Rank 0: a scalar, one element.
  //! shape{batch, height, width, channels}; every extent must be >= 0.
  shape(std::initializer_list<std::int64_t> extents) : shape(std::span(extents.begin(), extents.size())) {}
  explicit shape(std::span<std::int64_t const> extents) {
    if (extents.size() > max_rank)
      detail::fail<invalid_argument>("shape", "rank " + std::to_string(extents.size()) + " exceeds the maximum of " +
                                                  std::to_string(max_rank));
    std::uint64_t count = 1;
    bool empty = false, too_many = false;  // the product is checked as it grows: it must not wrap to a small size
    for (std::int64_t e : extents) {
      if (e < 0) detail::fail<invalid_argument>("shape", "negative extent " + std::to_string(e));
      extents_[rank_++] = e;
      empty = empty || e == 0;
      if (e > 0 && !too_many) {
        too_many = count > static_cast<std::uint64_t>(INT64_MAX) / static_cast<std::uint64_t>(e);
        count *= static_cast<std::uint64_t>(e);
      }
    }
    if (too_many && !empty)
      detail::fail<invalid_argument>("shape", "the extents " + to_string() + " hold more than 2^63 - 1 elements");
  }

  [[nodiscard]] constexpr std::size_t rank() const noexcept { return rank_; }
  [[nodiscard]] constexpr std::int64_t operator[](std::size_t axis) const noexcept { return extents_[axis]; }
  //! Number of elements: the product of the extents (1 for rank 0).
  [[nodiscard]] constexpr std::size_t size() const noexcept {
    std::size_t n = 1;
    for (std::size_t i = 0; i < rank_; ++i) n *= static_cast<std::size_t>(extents_[i]);
    return n;
  }
  [[nodiscard]] constexpr std::span<std::int64_t const> extents() const noexcept { return {extents_.data(), rank_}; }

  friend constexpr bool operator==(shape const& a, shape const& b) noexcept {
    if (a.rank_ != b.rank_) return false;
    for (std::size_t i = 0; i < a.rank_; ++i)
      if (a.extents_[i] != b.extents_[i]) return false;
    return true;
  }

  //! "[2, 3]"; "[]" for a scalar.
  [[nodiscard]] std::string to_string() const {
    std::string s = "[";
    for (std::size_t i = 0; i < rank_; ++i) s += (i ? ", " : "") + std::to_string(extents_[i]);
    return s + "]";
  }

 private:
  std::array<std::int64_t, max_rank> extents_{};
  std::size_t rank_ = 0;
};

namespace detail {
//! Throws mpx::shape_error "mpx::<op>: <what> [a] and [b] differ" unless a == b.
inline void require_same_shape(std::string_view op, shape const& a, shape const& b,
                               mpx::source_location loc = mpx::source_location::current()) {
  if (!(a == b))
    fail<shape_error>(op, "shapes " + a.to_string() + " and " + b.to_string() + " differ", loc);
}
//! The same, naming the two arguments: "src has shape [2, 3] but dst has shape [3, 2]".
inline void require_same_shape(std::string_view op, std::string_view a_name, shape const& a, std::string_view b_name,
                               shape const& b, mpx::source_location loc = mpx::source_location::current()) {
  if (!(a == b))
    fail<shape_error>(op, std::string(a_name) + " has shape " + a.to_string() + " but " + std::string(b_name) +
                              " has shape " + b.to_string(),
                      loc);
}
}  // namespace detail

}  // namespace mpx
