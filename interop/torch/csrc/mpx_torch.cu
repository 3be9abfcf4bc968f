// mpx_torch: mpx's multi-tensor unscale-and-check and its fused Adam/AdamW step, run on
// PyTorch's own tensors without a copy (their data pointers are wrapped as mpx views):
// the host executor for CPU tensors, a cuda_executor on PyTorch's current stream for CUDA
// tensors. The Python package (mpx_torch/__init__.py) builds the optimizer class on it.
// One translation unit: nvcc compiles this file for a CUDA build; mpx_torch_host.cpp
// includes it for the host-only build, where mpx's CUDA paths compile away.
#include <mpx/optim/adam.hpp>
#include <mpx/scaling/unscale_and_check.hpp>

#include <torch/extension.h>

#if MPX_HAS_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace mpx_torch {
namespace {

// ---- PyTorch tensors as mpx views ----------------------------------------------------

[[noreturn]] void refuse(std::string_view op, std::string const& message) {
  mpx::detail::fail<mpx::invalid_argument>(op, message);
}

//! "torch.float64", as Python spells the dtype.
std::string torch_name(at::ScalarType t) { return "torch." + std::string(c10::getDtypeNames(t).first); }

//! The mpx dtype of a PyTorch dtype; anything but float16, bfloat16 and float32 refused.
mpx::dtype_id dtype_of(at::Tensor const& t, std::string_view op, std::string const& what) {
  switch (t.scalar_type()) {
    case at::kHalf: return mpx::dtype_id::float16;
    case at::kBFloat16: return mpx::dtype_id::bfloat16;
    case at::kFloat: return mpx::dtype_id::float32;
    default:
      refuse(op, what + " is " + torch_name(t.scalar_type()) +
                     "; mpx handles torch.float16, torch.bfloat16 and torch.float32 tensors");
  }
}

//! Refuses what a bare data pointer cannot stand for: strided or sparse tensors, and a
//! tensor on another device than the first of its call.
void require_plain(at::Tensor const& t, at::Device device, std::string_view op, std::string const& what) {
  if (t.layout() != at::kStrided) refuse(op, what + " is not a dense tensor");
  if (t.device() != device)
    refuse(op, what + " is on " + t.device().str() + ", the first tensor on " + device.str() +
                   "; one call takes tensors of one device");
  if (!t.is_contiguous()) refuse(op, what + " is not contiguous; mpx reads it as one flat array");
}

//! A one-element float32 tensor (found_inf, inv_scale, grad_scale) on `device`.
float* scalar_of(at::Tensor const& t, at::Device device, std::string_view op, std::string const& what) {
  require_plain(t, device, op, what);
  if (t.scalar_type() != at::kFloat || t.numel() != 1)
    refuse(op, what + " must be a one-element torch.float32 tensor; got " + torch_name(t.scalar_type()) +
                   " with " + std::to_string(t.numel()) + " elements");
  return t.data_ptr<float>();
}

template <class Space>
mpx::tensor_ref<Space> ref_of(at::Tensor const& t, mpx::dtype_id dtype) {
  return mpx::visit_dtype(dtype, [&](auto z) {
    using T = decltype(z);
    return mpx::tensor_ref<Space>(mpx::tensor_view<T, Space>(static_cast<T*>(t.data_ptr()), mpx::shape{t.numel()}));
  });
}

// ---- the executor of a device ----------------------------------------------------------

//! Calls f(exec) with the host executor for CPU tensors, and for CUDA tensors with a
//! cuda_executor on PyTorch's current stream of that device (the device made current).
template <class F>
decltype(auto) on_executor(at::Device device, std::string_view op, F&& f) {
  if (device.is_cpu()) return f(mpx::host_executor{});
#if MPX_HAS_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard const guard(device);
    return f(mpx::cuda_executor{at::cuda::getCurrentCUDAStream(device.index()).stream()});
  }
#endif
  refuse(op, "tensors on " + device.str() + " are not handled by this build of mpx_torch (" +
                 (MPX_HAS_CUDA ? "CPU and CUDA" : "built for the CPU only; rebuild with MPX_TORCH_CUDA=1") + ")");
}

#if MPX_HAS_CUDA
template <class F>
__global__ void run_once_kernel(F f) {
  f();
}
#endif

//! Runs a small MPX_HD functor once where the executor computes: the glue between
//! PyTorch's flags and mpx's verdict, which must stay on the device as they do.
template <class Exec, class F>
void run_once([[maybe_unused]] Exec const& exec, F f) {
  if constexpr (mpx::is_host_executor_v<Exec>) {
    f();
  } else {
#if MPX_HAS_CUDA
    run_once_kernel<<<1, 1, 0, exec.stream()>>>(f);
    MPX_CUDA_CHECK_LAUNCH("mpx_torch::run_once_kernel");
#endif
  }
}

// ---- unscale and check -----------------------------------------------------------------

//! found_inf = 1 when the check found a NaN or inf; left as it was otherwise (as
//! torch._amp_foreach_non_finite_check_and_unscale_ leaves it).
struct raise_found_inf {
  mpx::gradient_summary const* summary;
  float* found_inf;
  MPX_HD void operator()() const {
    if (summary->found_nonfinite) *found_inf = 1.0f;
  }
};

//! What identifies a planned gradient list: the same pointers, sizes and dtypes on the
//! same stream can reuse the plan and its scratch (a training loop's steady state).
struct list_key {
  std::vector<std::tuple<void*, std::size_t, mpx::dtype_id>> tensors;
  std::int64_t device;
  std::uintptr_t stream;
  bool operator==(list_key const&) const = default;
};

//! A few planned gradient lists per executor, most recent last. Planning one copies its
//! ranges to the device and synchronises; a hit only enqueues kernels.
template <class Exec>
mpx::gradient_list<Exec>& planned_list(Exec const& exec, list_key key,
                                       std::vector<mpx::tensor_ref<mpx::memory_space_t<Exec>>> refs) {
  // Never destroyed: at exit the CUDA runtime may be gone before static destructors run.
  static auto& cache = *new std::deque<std::pair<list_key, std::unique_ptr<mpx::gradient_list<Exec>>>>();
  constexpr std::size_t capacity = 8;
  for (auto it = cache.begin(); it != cache.end(); ++it) {
    if (it->first == key) {
      auto entry = std::move(*it);
      cache.erase(it);
      cache.push_back(std::move(entry));
      return *cache.back().second;
    }
  }
  if (cache.size() == capacity) cache.pop_front();
  cache.emplace_back(std::move(key), std::make_unique<mpx::gradient_list<Exec>>(exec, std::move(refs)));
  return *cache.back().second;
}

//! What a check reports: (found, first non-finite index or -1, global norm, per-tensor norms).
using report = std::tuple<bool, std::int64_t, double, std::vector<double>>;

//! mpx::unscale_and_check over `grads` in place, multiplying by *inv_scale exactly, and
//! found_inf raised as PyTorch's op raises it. With `want_report` it synchronises and
//! returns the diagnostics; otherwise it only enqueues work (on a CUDA stream).
report check(std::vector<at::Tensor> const& grads, at::Tensor const& found_inf, at::Tensor const& inv_scale,
             bool want_report) {
  constexpr std::string_view op = "unscale_and_check";
  if (grads.empty()) return {false, -1, 0.0, {}};
  at::Device const device = grads.front().device();
  list_key key{{}, device.index(), 0};
  for (std::size_t i = 0; i < grads.size(); ++i) {
    std::string const what = "gradient " + std::to_string(i);
    require_plain(grads[i], device, op, what);
    key.tensors.emplace_back(grads[i].data_ptr(), static_cast<std::size_t>(grads[i].numel()),
                             dtype_of(grads[i], op, what));
  }
  float* const found = scalar_of(found_inf, device, op, "found_inf");
  float const* const inverse = scalar_of(inv_scale, device, op, "inv_scale");
  return on_executor(device, op, [&](auto exec) -> report {
    using Exec = decltype(exec);
    using space = mpx::memory_space_t<Exec>;
    if constexpr (!mpx::is_host_executor_v<Exec>) key.stream = reinterpret_cast<std::uintptr_t>(exec.stream());
    std::vector<mpx::tensor_ref<space>> refs;
    for (std::size_t i = 0; i < grads.size(); ++i) refs.push_back(ref_of<space>(grads[i], std::get<2>(key.tensors[i])));
    auto& list = planned_list(exec, key, std::move(refs));
    mpx::unscale_and_check(exec, list, mpx::inverse_scale{inverse});
    run_once(exec, raise_found_inf{list.summary_data(), found});
    if (!want_report) return {false, -1, 0.0, {}};
    mpx::gradient_summary const s = list.summary(exec);
    auto const norms = list.norms(exec);
    return {s.found_nonfinite != 0, s.first_nonfinite, s.norm, std::vector<double>(norms.begin(), norms.end())};
  });
}

void non_finite_check_and_unscale(std::vector<at::Tensor> const& grads, at::Tensor const& found_inf,
                                  at::Tensor const& inv_scale) {
  check(grads, found_inf, inv_scale, false);
}

report unscale_and_check_report(std::vector<at::Tensor> const& grads, at::Tensor const& found_inf,
                                at::Tensor const& inv_scale) {
  return check(grads, found_inf, inv_scale, true);
}

// ---- Adam and AdamW ----------------------------------------------------------------------

//! PyTorch's fused-optimizer contract as mpx's verdict: skip when found_inf is set,
//! gradients multiplied by 1 / grad_scale otherwise.
struct torch_verdict {
  float const* found_inf;   // may be null
  float const* grad_scale;  // may be null
  mpx::gradient_summary* out;
  MPX_HD void operator()() const {
    mpx::gradient_summary s;
    s.found_nonfinite = found_inf && *found_inf != 0 ? 1u : 0u;
    s.gradient_factor = grad_scale ? 1.0f / *grad_scale : 1.0f;
    *out = s;
  }
};

//! The step count advances only when the step was applied (mpx's and PyTorch's rule).
struct advance_step {
  std::int64_t* steps;
  mpx::gradient_summary const* verdict;
  MPX_HD void operator()() const {
    if (!verdict->found_nonfinite) ++*steps;
  }
};

//! One fused Adam (or AdamW) step over every parameter: lists of values, gradients,
//! float32 master copies (None for float32 values, which are their own master),
//! first and second moments (float32), and `steps`, a one-element int64 tensor holding
//! the number of steps applied so far, shared by all of them.
template <bool Decoupled>
void adam_step(std::vector<at::Tensor> const& params, std::vector<at::Tensor> const& grads,
               std::vector<std::optional<at::Tensor>> const& masters, std::vector<at::Tensor> const& exp_avgs,
               std::vector<at::Tensor> const& exp_avg_sqs, at::Tensor const& steps, double lr, double beta1,
               double beta2, double eps, double weight_decay, std::optional<at::Tensor> const& grad_scale,
               std::optional<at::Tensor> const& found_inf) {
  constexpr std::string_view op = Decoupled ? "adamw" : "adam";
  std::size_t const n = params.size();
  if (grads.size() != n || masters.size() != n || exp_avgs.size() != n || exp_avg_sqs.size() != n)
    refuse(op, "the lists of parameters, gradients, master weights and moments differ in length");
  mpx::adam_options const options{static_cast<float>(beta1), static_cast<float>(beta2), static_cast<float>(eps),
                                  static_cast<float>(weight_decay)};
  mpx::detail::validate_adam(op, options);
  mpx::adam_rule<mpx::constant_learning_rate, Decoupled> const rule{mpx::constant_learning_rate(static_cast<float>(lr)),
                                                                   options};
  mpx::detail::validate_learning_rate(op, rule.learning_rate);
  if (n == 0) return;
  at::Device const device = params.front().device();
  require_plain(steps, device, op, "the step count");
  if (steps.scalar_type() != at::kLong || steps.numel() != 1) refuse(op, "the step count must be one int64 element");
  auto* const step_count = steps.data_ptr<std::int64_t>();

  // Rows as mpx's optimizer plans them: value, gradient, master, first, second moment.
  constexpr int lists = mpx::detail::fixed_lists + 2;
  std::array<std::vector<std::array<void*, lists>>, mpx::dtype_count> rows;
  std::array<std::vector<std::size_t>, mpx::dtype_count> sizes;
  for (std::size_t i = 0; i < n; ++i) {
    std::string const what = "parameter " + std::to_string(i);
    require_plain(params[i], device, op, what);
    require_plain(grads[i], device, op, "the gradient of " + what);
    mpx::dtype_id const dtype = dtype_of(params[i], op, what);
    if (grads[i].scalar_type() != params[i].scalar_type() || grads[i].numel() != params[i].numel())
      refuse(op, "the gradient of " + what + " differs from it in dtype or size");
    auto const float_state = [&](at::Tensor const& t, std::string const& name) {
      require_plain(t, device, op, name + " of " + what);
      if (t.scalar_type() != at::kFloat || t.numel() != params[i].numel())
        refuse(op, name + " of " + what + " must be float32 with as many elements as it");
      return t.data_ptr();
    };
    void* master = params[i].data_ptr();
    if (dtype != mpx::dtype_id::float32) {
      if (!masters[i])
        refuse(op, what + " is " + std::string(mpx::to_string(dtype)) + " and needs a float32 master copy");
      master = float_state(*masters[i], "the master copy");
    }
    auto const d = static_cast<std::size_t>(dtype);
    rows[d].push_back({params[i].data_ptr(), grads[i].data_ptr(), master, float_state(exp_avgs[i], "the first moment"),
                       float_state(exp_avg_sqs[i], "the second moment")});
    sizes[d].push_back(static_cast<std::size_t>(params[i].numel()));
  }
  float const* const found = found_inf ? scalar_of(*found_inf, device, op, "found_inf") : nullptr;
  float const* const scale = grad_scale ? scalar_of(*grad_scale, device, op, "grad_scale") : nullptr;
  // The verdict lives where the executor computes; PyTorch's caching allocator holds it.
  at::Tensor const verdict_storage =
      at::empty({static_cast<std::int64_t>(sizeof(mpx::gradient_summary))}, at::TensorOptions(device).dtype(at::kByte));
  auto* const verdict = reinterpret_cast<mpx::gradient_summary*>(verdict_storage.data_ptr());

  on_executor(device, op, [&](auto exec) {
    run_once(exec, torch_verdict{found, scale, verdict});
    for (std::size_t d = 0; d < mpx::detail::all_dtypes.size(); ++d) {
      if (rows[d].empty()) continue;
      auto const plan = mpx::detail::plan_multi_tensor<lists>(rows[d], sizes[d]);
      mpx::visit_dtype(mpx::detail::all_dtypes[d], [&](auto z) {
        using T = decltype(z);
        // mpx's own update pass, on either executor: the step count is read where it runs.
        for (auto const& table : plan.tables)
          mpx::detail::optimizer_update_pass<T>(exec, table, rule, reinterpret_cast<std::uint64_t const*>(step_count),
                                                verdict, mpx::detail::weight_rounding{});
      });
    }
    run_once(exec, advance_step{step_count, verdict});
  });
}

}  // namespace
}  // namespace mpx_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mpx's multi-tensor unscale-and-check and fused Adam/AdamW over PyTorch tensors, without copies";
  // Every mpx::error (a refused dtype, a bad hyperparameter, a CUDA failure) arrives in
  // Python as mpx_torch.Error, with mpx's message.
  pybind11::register_exception<mpx::error>(m, "Error", PyExc_ValueError);
  m.def("non_finite_check_and_unscale_", &mpx_torch::non_finite_check_and_unscale, pybind11::arg("grads"),
        pybind11::arg("found_inf"), pybind11::arg("inv_scale"),
        "torch._amp_foreach_non_finite_check_and_unscale_ on mpx::unscale_and_check: grads *= inv_scale in place, "
        "found_inf set to 1 if any value is NaN or inf. Does not synchronise a CUDA stream.");
  m.def("unscale_and_check_report", &mpx_torch::unscale_and_check_report, pybind11::arg("grads"),
        pybind11::arg("found_inf"), pybind11::arg("inv_scale"),
        "The same, then (found, first non-finite index or -1, global L2 norm, per-tensor L2 norms), unscaled. "
        "Synchronises.");
  m.def("adam_step_", &mpx_torch::adam_step<false>, "One fused Adam step (mpx::adam's update rule).");
  m.def("adamw_step_", &mpx_torch::adam_step<true>, "One fused AdamW step (mpx::adamw's update rule).");
  m.attr("cuda") = pybind11::bool_(MPX_HAS_CUDA != 0);
}
