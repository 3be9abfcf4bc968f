// Tensors: mpx::tensor<T, Space> owns shaped, contiguous (row-major) memory in a space
// and is move-only; mpx::tensor_view<T, Space> is the non-owning (pointer, shape) pair
// that algorithms and kernels take. mpx::view(x) gives the view of either.
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/memory_space.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

namespace mpx {

//! A non-owning view of contiguous elements of T in Space, with a shape. Cheap to copy.
template <class T, memory_space Space = host_space>
class tensor_view {
 public:
  using value_type = std::remove_const_t<T>;
  using element_type = T;
  using space_type = Space;

  constexpr tensor_view() = default;
  tensor_view(T* data, mpx::shape shape) noexcept : data_(data), shape_(shape) {}
  //! A view of mutable elements is also a view of const ones.
  template <class U>
    requires(std::is_same_v<U const, T> && !std::is_same_v<U, T>)
  tensor_view(tensor_view<U, Space> other) noexcept : data_(other.data()), shape_(other.shape()) {}

  [[nodiscard]] T* data() const noexcept { return data_; }
  [[nodiscard]] mpx::shape const& shape() const noexcept { return shape_; }
  [[nodiscard]] std::size_t size() const noexcept { return shape_.size(); }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return size() * sizeof(T); }
  [[nodiscard]] bool empty() const noexcept { return size() == 0; }

  //! Elements [offset, offset + count) as a rank-1 view; throws mpx::invalid_argument
  //! when the range leaves the view.
  [[nodiscard]] tensor_view flat(std::size_t offset, std::size_t count) const {
    if (offset > size() || count > size() - offset)
      detail::fail<invalid_argument>("tensor_view::flat", "elements [" + std::to_string(offset) + ", " +
                                                              std::to_string(offset + count) + ") of a view of shape " +
                                                              shape_.to_string() + " are out of range");
    return {data_ + offset, mpx::shape{static_cast<std::int64_t>(count)}};
  }
  //! The same elements under another shape of the same size; throws mpx::shape_error.
  [[nodiscard]] tensor_view reshape(mpx::shape const& s) const {
    if (s.size() != size())
      detail::fail<shape_error>("tensor_view::reshape", "cannot view " + shape_.to_string() + " (" +
                                                            std::to_string(size()) + " elements) as " + s.to_string());
    return {data_, s};
  }

  //! Element access, host memory only (a device element needs a copy).
  T& operator[](std::size_t i) const noexcept
    requires std::is_same_v<Space, host_space>
  {
    return data_[i];
  }
  T* begin() const noexcept
    requires std::is_same_v<Space, host_space>
  {
    return data_;
  }
  T* end() const noexcept
    requires std::is_same_v<Space, host_space>
  {
    return data_ + size();
  }

 private:
  T* data_ = nullptr;
  mpx::shape shape_{0};
};

//! Owns a shaped block of T in Space. Move-only: copying a tensor is a decision (an
//! allocation, maybe a transfer), made with mpx::copy, to_host or to_device.
template <class T, memory_space Space = host_space>
class tensor {
 public:
  using value_type = T;
  using space_type = Space;

  tensor() = default;
  //! An uninitialised host tensor.
  explicit tensor(mpx::shape shape)
    requires std::is_same_v<Space, host_space>
      : tensor(host_executor{}, shape) {}
  //! An uninitialised tensor in the executor's space (on its stream, for the GPU).
  //! Memory that cannot be had is an mpx::allocation_error naming the dtype, the shape
  //! and the bytes.
  template <executor Exec>
  tensor(Exec const& exec, mpx::shape shape) : buffer_(allocate_for(exec, shape)), shape_(shape) {
    detail::require_access<Exec, Space>();
  }

  //! A moved-from tensor is empty: no memory, shape [0].
  tensor(tensor&& other) noexcept
      : buffer_(std::move(other.buffer_)), shape_(std::exchange(other.shape_, empty_shape())) {}
  tensor& operator=(tensor&& other) noexcept {
    buffer_ = std::move(other.buffer_);
    shape_ = std::exchange(other.shape_, empty_shape());
    return *this;
  }
  tensor(tensor const&) = delete;
  tensor& operator=(tensor const&) = delete;

  [[nodiscard]] T* data() const noexcept { return buffer_.data(); }
  [[nodiscard]] mpx::shape const& shape() const noexcept { return shape_; }
  [[nodiscard]] std::size_t size() const noexcept { return shape_.size(); }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return size() * sizeof(T); }
  [[nodiscard]] bool empty() const noexcept { return size() == 0; }

  [[nodiscard]] tensor_view<T, Space> view() noexcept { return {data(), shape_}; }
  [[nodiscard]] tensor_view<T const, Space> view() const noexcept { return {data(), shape_}; }
  operator tensor_view<T, Space>() noexcept { return view(); }
  operator tensor_view<T const, Space>() const noexcept { return view(); }

  T& operator[](std::size_t i) noexcept
    requires std::is_same_v<Space, host_space>
  {
    return data()[i];
  }
  T const& operator[](std::size_t i) const noexcept
    requires std::is_same_v<Space, host_space>
  {
    return data()[i];
  }
  T* begin() noexcept
    requires std::is_same_v<Space, host_space>
  {
    return data();
  }
  T* end() noexcept
    requires std::is_same_v<Space, host_space>
  {
    return data() + size();
  }

 private:
  static mpx::shape empty_shape() noexcept { return mpx::shape(std::span<std::int64_t const>(&zero_extent, 1)); }
  static constexpr std::int64_t zero_extent = 0;

  template <executor Exec>
  static detail::buffer<T, Space> allocate_for(Exec const& exec, mpx::shape const& shape) {
    try {
      return detail::allocate<T>(exec, shape.size());
    } catch (allocation_error const& e) {
      std::string what = "a tensor of shape " + shape.to_string();
      if constexpr (dtype<T>) what = "a " + std::string(dtype_name<T>) + " tensor of shape " + shape.to_string();
      throw allocation_error("mpx::tensor: " + what + ": " + e.what());
    }
  }

  detail::buffer<T, Space> buffer_;
  mpx::shape shape_ = empty_shape();
};

//! An uninitialised tensor of T in the executor's memory space.
template <class T, executor Exec>
tensor<T, memory_space_t<Exec>> make_tensor(Exec const& exec, mpx::shape shape) {
  return tensor<T, memory_space_t<Exec>>(exec, shape);
}

//! The view of a tensor or a view: what algorithms accept, so users pass either.
template <class T, class Space>
tensor_view<T, Space> view(tensor<T, Space>& t) noexcept {
  return t.view();
}
template <class T, class Space>
tensor_view<T const, Space> view(tensor<T, Space> const& t) noexcept {
  return t.view();
}
// By reference, not by value: GCC 12.2 at -O1 lost track of the pointer that a by-value
// view returned through the return slot carries, and dropped the writes algorithms made
// through it into a caller's local array (test_tensor.cpp, "writes through a view...").
template <class T, class Space>
tensor_view<T, Space> view(tensor_view<T, Space> const& v) noexcept {
  return v;
}

//! A tensor or a view of one.
template <class X>
concept tensor_like = requires(X& x) { mpx::view(x); };

//! The view type of X (tensor_view<T const, S> for a const tensor).
template <tensor_like X>
using view_t = decltype(mpx::view(std::declval<X&>()));

//! The element type of X, without const.
template <tensor_like X>
using value_t = typename view_t<X>::value_type;

//! The memory space of X.
template <tensor_like X>
using space_t = typename view_t<X>::space_type;

namespace detail {
//! Whether every view's elements may be written: an operation's outputs, checked with a
//! static_assert that names them.
template <class... Views>
inline constexpr bool all_writable = (!std::is_const_v<typename Views::element_type> && ...);

//! An operation's tensor arguments as views, after the check every operation makes
//! first: that Exec can reach each of them (a compile-time error naming the fix
//! otherwise). `auto [xv, yv] = detail::views_for<Exec>(x, y);` (A lambda that needs
//! one of the names takes it by an init-capture: clang before 16 cannot capture a
//! structured binding.)
template <class Exec, tensor_like... Xs>
auto views_for(Xs&... xs) {
  require_access<Exec, space_t<Xs>...>();
  return std::tuple{mpx::view(xs)...};
}

//! Refuses an output whose memory overlaps an input's, for operations that read an
//! input after writing the output (or whose kernels assume distinct pointers).
template <class A, class B, class Space>
void require_disjoint(std::string_view op, std::string_view a_name, tensor_view<A, Space> a, std::string_view b_name,
                      tensor_view<B, Space> b) {
  auto const a0 = reinterpret_cast<std::uintptr_t>(a.data()), b0 = reinterpret_cast<std::uintptr_t>(b.data());
  if (a.size() != 0 && b.size() != 0 && a0 < b0 + b.size_bytes() && b0 < a0 + a.size_bytes())
    fail<invalid_argument>(op, std::string(a_name) + " and " + std::string(b_name) +
                                   " overlap in memory; give them separate buffers");
}

//! Refuses an input that overlaps the output other than element for element (the same
//! address and element size: an operation in place). Element-wise kernels read each
//! element in the thread that writes it, so only that overlap is safe on a GPU.
template <class Out, class In, class Space>
void require_in_place_or_disjoint(std::string_view op, tensor_view<Out, Space> out, tensor_view<In, Space> in) {
  if (static_cast<void const*>(out.data()) == static_cast<void const*>(in.data()) && sizeof(Out) == sizeof(In)) return;
  require_disjoint(op, "the output", out, "an input", in);
}

//! The same for an operation that works in place along a row or column (softmax, the
//! norms, dropout), naming both arguments: a shifted overlap would let one element's
//! write clobber another's input before it is read.
template <class Out, class In, class Space>
void require_in_place_or_disjoint(std::string_view op, std::string_view out_name, tensor_view<Out, Space> out,
                                  std::string_view in_name, tensor_view<In, Space> in) {
  if (static_cast<void const*>(out.data()) == static_cast<void const*>(in.data()) && sizeof(Out) == sizeof(In)) return;
  require_disjoint(op, out_name, out, in_name, in);
}
}  // namespace detail

}  // namespace mpx
