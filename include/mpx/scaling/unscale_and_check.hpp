// mpx::unscale_and_check: divides every gradient of a list by the loss scale, in place,
// and finds NaN and ±inf, in one pass over the data. One launch per dtype present (per
// ~1,600 tensors), then two small launches turn the per-chunk results into the verdict:
// whether any value was non-finite, the first gradient that held one, per-tensor and
// global L2 norms, and the factor that clips to a maximum norm. Nothing waits for the
// host; the results stay where the executor computes until asked for. The passes are
// kernels/unscale_and_check.hpp.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/resident.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/exec/tensor_ref.hpp>
#include <mpx/kernels/multi_tensor.hpp>
#include <mpx/kernels/unscale_and_check.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mpx {

//! Whether unscale_and_check writes the unscaled gradients back, or leaves them scaled
//! for the consumer to multiply by gradient_summary::gradient_factor as it reads them.
//! Deferring is exact for 16-bit gradients, which could underflow again if written back
//! unscaled (a scaled 2^-10 unscaled by 2^15 is below half's smallest subnormal), and
//! makes the check a read-only pass: loss_scale_optimizer defers.
enum class unscaling { in_place, deferred };

//! A loss scale given as its inverse (PyTorch's GradScaler hands 1 / scale to its
//! check): the gradients are multiplied by exactly *value, with no reciprocal of a
//! reciprocal rounded in between. `value` points into the executor's space.
struct inverse_scale {
  float const* value;
};

namespace detail {

//! The scale operand of unscale_and_check, whichever way the caller gave it.
struct scale_operand {
  float const* value;
  bool is_inverse;
};

}  // namespace detail

//! A fixed list of gradient tensors (of any dtypes of mpx::dtype_list, mixed freely), planned
//! once for multi-tensor launches, and the results of its last unscale_and_check.
//! The tensors must outlive the list and keep their addresses.
template <executor Exec>
class gradient_list {
 public:
  using space = memory_space_t<Exec>;

  //! `names` (optional) label the gradients in reports ("dense_1/kernel").
  gradient_list(Exec const& exec, std::vector<tensor_ref<space>> gradients, std::vector<std::string> names = {})
      : gradients_(std::move(gradients)), names_(std::move(names)) {
    if (!names_.empty() && names_.size() != gradients_.size())
      detail::fail<invalid_argument>("gradient_list", std::to_string(names_.size()) + " names for " +
                                                          std::to_string(gradients_.size()) + " gradients");
    for (std::size_t i = names_.size(); i < gradients_.size(); ++i) names_.push_back("gradient " + std::to_string(i));
    require_no_overlap();
    // One plan per dtype; chunk results numbered dtype after dtype, and each tensor
    // remembers its range of them, in list order.
    std::vector<std::uint32_t> ranges(2 * gradients_.size());
    std::uint32_t next = 0;
    for (std::size_t d = 0; d < detail::all_dtypes.size(); ++d) {
      std::vector<std::array<void*, 1>> pointers;
      std::vector<std::size_t> sizes, members;
      for (std::size_t i = 0; i < gradients_.size(); ++i) {
        if (gradients_[i].dtype() != detail::all_dtypes[d]) continue;
        pointers.push_back({gradients_[i].data()});
        sizes.push_back(gradients_[i].size());
        members.push_back(i);
      }
      plans_[d] = detail::plan_multi_tensor<1>(pointers, sizes, next);
      for (std::size_t k = 0; k < members.size(); ++k) {
        ranges[2 * members[k]] = plans_[d].chunk_begin[k];
        ranges[2 * members[k] + 1] = plans_[d].chunk_begin[k + 1];
      }
      next = plans_[d].chunk_begin.back();
    }
    ranges_ = make_tensor<std::uint32_t>(exec, shape{static_cast<std::int64_t>(ranges.size())});
    copy(exec, tensor_view<std::uint32_t const, host_space>(ranges.data(), ranges_.shape()), ranges_);
    partials_ = make_tensor<detail::chunk_partial>(exec, shape{std::max<std::int64_t>(std::int64_t{next}, 1)});
    sum_of_squares_ = make_tensor<float>(exec, shape{static_cast<std::int64_t>(gradients_.size())});
    verdict_partials_ = make_tensor<detail::tensor_verdict>(exec, shape{std::int64_t{detail::max_item_blocks}});
    summary_ = resident<gradient_summary, space>(exec, gradient_summary{});
    exec.synchronize();  // the host vector `ranges` dies here
  }

  [[nodiscard]] std::size_t size() const noexcept { return gradients_.size(); }
  [[nodiscard]] tensor_ref<space> const& operator[](std::size_t i) const noexcept { return gradients_[i]; }
  [[nodiscard]] std::string const& name(std::size_t i) const noexcept { return names_[i]; }
  [[nodiscard]] std::vector<std::string> const& names() const noexcept { return names_; }
  [[nodiscard]] std::size_t elements() const noexcept {
    std::size_t n = 0;
    for (auto const& g : gradients_) n += g.size();
    return n;
  }

  //! Where kernels find the last check's verdict (the optimizer reads it to skip).
  [[nodiscard]] gradient_summary const* summary_data() const noexcept { return summary_.get(); }
  //! The last check's verdict. Synchronises a cuda_executor.
  [[nodiscard]] gradient_summary summary(Exec const& exec) const { return summary_.read(exec); }
  //! Each gradient's L2 norm after the last check. Synchronises a cuda_executor.
  [[nodiscard]] std::vector<float> norms(Exec const& exec) const {
    auto host = to_host(exec, sum_of_squares_);
    std::vector<float> out(host.begin(), host.end());
    for (float& x : out) x = std::sqrt(x);
    return out;
  }

 private:
  //! A gradient listed twice, or two that share memory, would be unscaled twice in place
  //! (and counted twice in the norms).
  void require_no_overlap() const {
    std::vector<std::pair<std::string, tensor_ref<space>>> named;
    for (std::size_t i = 0; i < gradients_.size(); ++i) named.emplace_back("'" + names_[i] + "'", gradients_[i]);
    detail::require_no_overlap("gradient_list", named, "a gradient listed twice? each gradient needs memory of its own");
  }

  template <executor E>
  friend void unscale_and_check(E const& exec, gradient_list<E>& gradients, detail::scale_operand scale,
                                float max_norm, unscaling mode);

  std::vector<tensor_ref<space>> gradients_;
  std::vector<std::string> names_;
  std::array<detail::multi_tensor_plan<1>, dtype_count> plans_;
  tensor<std::uint32_t, space> ranges_;
  tensor<detail::chunk_partial, space> partials_;
  tensor<float, space> sum_of_squares_;
  tensor<detail::tensor_verdict, space> verdict_partials_;  // the finishing pass's per-block results
  resident<gradient_summary, space> summary_;
};

// The work of both public overloads below.
template <executor Exec>
void unscale_and_check(Exec const& exec, gradient_list<Exec>& gradients, detail::scale_operand scale,
                       float max_norm, unscaling mode) {
  detail::unscale_and_check_pass(exec, gradients.plans_, scale.value, scale.is_inverse, max_norm,
                                 mode == unscaling::deferred, static_cast<std::uint32_t>(gradients.size()),
                                 gradients.ranges_.data(), gradients.partials_.data(), gradients.sum_of_squares_.data(),
                                 gradients.verdict_partials_.data(), gradients.summary_.get());
}

//! Multiplies every gradient by 1 / *scale (scale: a float in the executor's space, such
//! as a loss scaler's) in place, or with unscaling::deferred leaves them scaled and
//! records the factor to read them with; and records in `gradients` whether any value
//! was NaN or ±inf, which gradient first held one, the norms (in unscaled units) and the
//! factor that clips the global norm to `max_norm` (<= 0: no clipping). On a
//! cuda_executor it only enqueues work: no allocation, no synchronisation, so it can be
//! captured in a CUDA graph.
template <executor Exec>
void unscale_and_check(Exec const& exec, gradient_list<Exec>& gradients, float const* scale, float max_norm = 0,
                       unscaling mode = unscaling::in_place) {
  unscale_and_check(exec, gradients, detail::scale_operand{scale, false}, max_norm, mode);
}

//! The same, multiplying by *inverse.value as given (GradScaler's inv_scale), so the
//! result is bit for bit GradScaler's: `float(g) * inv_scale` rounded to float, then to
//! the gradient's dtype (one rounding for float gradients, two for 16-bit ones).
template <executor Exec>
void unscale_and_check(Exec const& exec, gradient_list<Exec>& gradients, inverse_scale inverse, float max_norm = 0,
                       unscaling mode = unscaling::in_place) {
  unscale_and_check(exec, gradients, detail::scale_operand{inverse.value, true}, max_norm, mode);
}

}  // namespace mpx
