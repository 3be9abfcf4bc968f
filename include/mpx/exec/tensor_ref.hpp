// mpx::tensor_ref<Space>: a mutable view whose element type is a runtime value, for
// lists that mix dtypes (a model's parameters: half weights beside float norm scales).
// Multi-tensor kernels and optimizers take lists of these and group them by dtype.
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/tensor.hpp>

#include <cstddef>
#include <string>

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

}  // namespace mpx
