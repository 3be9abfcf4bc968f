// mpx::tensor_ref<Space>: a mutable view whose element type is a runtime value, for
// lists that mix dtypes (a model's parameters: half weights beside float norm scales).
// Multi-tensor kernels and optimizers take lists of these and group them by dtype.
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/tensor.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mpx {

template <memory_space Space>
class tensor_ref {
 public:
  tensor_ref() = default;
  template <mpx::dtype T>
  tensor_ref(tensor_view<T, Space> v) noexcept : dtype_(dtype_id_of<T>), data_(v.data()), shape_(v.shape()) {}
  template <mpx::dtype T>
  tensor_ref(tensor<T, Space>& t) noexcept : tensor_ref(t.view()) {}

  [[nodiscard]] dtype_id dtype() const noexcept { return dtype_; }
  [[nodiscard]] void* data() const noexcept { return data_; }
  [[nodiscard]] mpx::shape const& shape() const noexcept { return shape_; }
  [[nodiscard]] std::size_t size() const noexcept { return shape_.size(); }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return size() * size_of(dtype_); }

  //! The typed view; throws mpx::invalid_argument when T is not the referenced dtype.
  template <mpx::dtype T>
  [[nodiscard]] tensor_view<T, Space> as() const {
    if (dtype_id_of<T> != dtype_)
      detail::fail<invalid_argument>("tensor_ref::as", "the tensor holds " + std::string(to_string(dtype_)) +
                                                           ", not " + std::string(dtype_name<T>));
    return {static_cast<T*>(data_), shape_};
  }

 private:
  dtype_id dtype_ = dtype_id::float32;
  void* data_ = nullptr;
  mpx::shape shape_{0};
};

namespace detail {

//! Refuses a list of tensors (each with its name) in which two share memory: a list the
//! op updates in place would update the shared elements twice. Names both, in list
//! order. O(n log n); empty tensors share nothing.
template <memory_space Space>
void require_no_overlap(std::string_view op, std::vector<std::pair<std::string, tensor_ref<Space>>> const& named,
                        std::string_view hint) {
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < named.size(); ++i)
    if (named[i].second.size() != 0) order.push_back(i);
  auto const start = [&](std::size_t i) { return reinterpret_cast<std::uintptr_t>(named[i].second.data()); };
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return start(a) < start(b); });
  std::uintptr_t reach = 0;  // the furthest end of the tensors seen so far, and whose it is
  std::size_t reacher = 0;
  for (std::size_t k = 0; k < order.size(); ++k) {
    std::size_t const b = order[k];
    if (k > 0 && start(b) < reach)
      fail<invalid_argument>(op, named[std::min(reacher, b)].first + " and " + named[std::max(reacher, b)].first +
                                     " overlap in memory (" + std::string(hint) + ")");
    if (std::uintptr_t const end = start(b) + named[b].second.size_bytes(); end > reach) reach = end, reacher = b;
  }
}

}  // namespace detail

}  // namespace mpx
