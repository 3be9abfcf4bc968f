// What every mpx optimizer shares: float master weights for 16-bit parameters, moment
// slots, a step count kept on the executor, and one fused multi-tensor kernel per dtype
// per step that reads the gradient check's verdict on the device, leaves everything
// untouched when it says skip, and otherwise updates the float master copy and writes
// it back rounded to the storage type. sgd.hpp and adam.hpp supply the update rules.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/exec/resident.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/kernels/multi_tensor.hpp>
#include <mpx/optim/checkpoint_file.hpp>
#include <mpx/optim/learning_rate.hpp>
#include <mpx/optim/parameter.hpp>
#include <mpx/scaling/unscale_and_check.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx::detail {

//! Updates elements [i, i + N) of one parameter: the float master weight (the value
//! itself for float parameters), the rule's slots, and the stored value.
template <int N, class T, class Rule>
MPX_HD inline void update_elements(Rule const& rule, typename Rule::constants const& c, float factor, std::size_t i,
                                   T* value, T const* gradient, float* master, float* const* slot) {
  constexpr int slots = Rule::slots;
  auto const g = *reinterpret_cast<aligned_vector<T, N> const*>(gradient + i);
  aligned_vector<float, N> w;
  if constexpr (std::is_same_v<T, float>) w = *reinterpret_cast<aligned_vector<float, N> const*>(value + i);
  else w = *reinterpret_cast<aligned_vector<float, N> const*>(master + i);
  // Value-initialised: a slot the rule does not use (SGD without momentum) is never
  // loaded, and is still copied below.
  aligned_vector<float, N> s[slots > 0 ? slots : 1] = {};
  for (int j = 0; j < slots; ++j)
    if (rule.uses_slot(j)) s[j] = *reinterpret_cast<aligned_vector<float, N> const*>(slot[j] + i);
  aligned_vector<T, N> out;
  MPX_UNROLL
  for (int k = 0; k < N; ++k) {
    float sk[slots > 0 ? slots : 1] = {};
    for (int j = 0; j < slots; ++j) sk[j] = s[j].v[k];
    rule(c, w.v[k], cast<float>(g.v[k]) * factor, sk);
    for (int j = 0; j < slots; ++j) s[j].v[k] = sk[j];
    out.v[k] = cast<T>(w.v[k]);
  }
  for (int j = 0; j < slots; ++j)
    if (rule.uses_slot(j)) *reinterpret_cast<aligned_vector<float, N>*>(slot[j] + i) = s[j];
  if constexpr (!std::is_same_v<T, float>) *reinterpret_cast<aligned_vector<float, N>*>(master + i) = w;
  *reinterpret_cast<aligned_vector<T, N>*>(value + i) = out;
}

//! Pointers in a table row: value, gradient, master, then the rule's slots.
inline constexpr int fixed_lists = 3;

template <class T, class Rule, int Lists>
void host_optimizer_step(tensor_table<Lists> const& table, Rule const& rule, std::uint64_t steps,
                         gradient_summary const* verdict) {
  if (verdict && verdict->found_nonfinite) return;
  float const factor = verdict ? verdict->gradient_factor : 1.0f;
  auto const c = rule.at(steps + 1);
  for (std::uint32_t t = 0; t < table.count; ++t) {
    float* slot[Lists - fixed_lists > 0 ? Lists - fixed_lists : 1];
    for (int j = 0; j < Lists - fixed_lists; ++j) slot[j] = static_cast<float*>(table.data[fixed_lists + j][t]);
    for (std::size_t i = 0; i < table.size[t]; ++i)
      update_elements<1>(rule, c, factor, i, static_cast<T*>(table.data[0][t]), static_cast<T const*>(table.data[1][t]),
                         static_cast<float*>(table.data[2][t]), slot);
  }
}

#if MPX_HAS_CUDA
template <class T, class Rule, int Lists>
__global__ void __launch_bounds__(block_size)
    optimizer_step_kernel(tensor_table<Lists> const table, Rule const rule, std::uint64_t const* __restrict__ steps,
                          gradient_summary const* __restrict__ verdict) {
  // The verdict is one value for the whole grid: every block returns, or none does.
  if (verdict && verdict->found_nonfinite) return;
  float const factor = verdict ? verdict->gradient_factor : 1.0f;
  auto const c = rule.at(*steps + 1);
  chunk_location const loc = locate_chunk(table, blockIdx.x);
  T* const value = static_cast<T*>(table.data[0][loc.tensor]) + loc.begin;
  T const* const gradient = static_cast<T const*>(table.data[1][loc.tensor]) + loc.begin;
  float* const master = static_cast<float*>(table.data[2][loc.tensor]) + loc.begin;
  constexpr int slots = Lists - fixed_lists;
  float* slot[slots > 0 ? slots : 1];
  bool aligned = vector_aligned<vector_width<T, float>>(value, gradient, master);
  for (int j = 0; j < slots; ++j) {
    slot[j] = static_cast<float*>(table.data[fixed_lists + j][loc.tensor]) + loc.begin;
    aligned = aligned && vector_aligned<vector_width<T, float>>(slot[j]);
  }
  // Several pointers: vectorised only when all start on a boundary (the float master and
  // slots always do; a 16-bit value carved out of a packed buffer may not).
  for_each_in_chunk<vector_width<T, float>>(loc.count, 0, aligned, [&](auto w, std::size_t i) {
    update_elements<decltype(w)::value>(rule, c, factor, i, value, gradient, master, slot);
  });
}

template <class Counter>
__global__ void advance_step_count_kernel(Counter* steps) {
  ++*steps;
}
#endif

//! The shared machinery of sgd, adam and adamw (see the header comment). Rule is the
//! update rule: `slots` floats per element, `uses_slot(j)`, `at(step)` giving the
//! step's constants (learning rate, bias corrections), and
//! `operator()(constants, float& w, float g, float* slots)`.
template <executor Exec, class Rule>
class optimizer_core {
 public:
  using space = memory_space_t<Exec>;
  using rule_type = Rule;
  static constexpr int slots = Rule::slots;
  static constexpr int lists = fixed_lists + slots;

  optimizer_core(Exec const& exec, std::vector<parameter<space>> params, Rule rule, std::string kind)
      : kind_(std::move(kind)), params_(std::move(params)), rule_(rule), steps_(exec, std::uint64_t{0}),
        gradients_(exec, gradient_refs(kind_, params_), parameter_names(params_)) {
    if constexpr (requires { rule_.learning_rate; }) validate_learning_rate(kind_, rule_.learning_rate);
    masters_.reserve(params_.size());
    slots_.reserve(params_.size());
    for (auto const& p : params_) {
      shape const flat{static_cast<std::int64_t>(p.value.size())};
      tensor<float, space> master;
      if (p.value.dtype() != dtype_id::float32) {
        master = tensor<float, space>(exec, flat);
        visit_dtype(p.value.dtype(), [&](auto t) {
          using T = decltype(t);
          if constexpr (!std::is_same_v<T, float>) mpx::cast(exec, p.value.template as<T>().reshape(flat), master);
        });
      }
      masters_.push_back(std::move(master));
      std::array<tensor<float, space>, slots> s;
      for (int j = 0; j < slots; ++j) {
        if (!rule_.uses_slot(j)) continue;
        s[static_cast<std::size_t>(j)] = tensor<float, space>(exec, flat);
        fill(exec, s[static_cast<std::size_t>(j)], 0.0f);
      }
      slots_.push_back(std::move(s));
    }
    plan();
  }

  //! The gradients, planned for unscale_and_check (loss_scale_optimizer uses them).
  [[nodiscard]] gradient_list<Exec>& gradients() noexcept { return gradients_; }
  [[nodiscard]] gradient_list<Exec> const& gradients() const noexcept { return gradients_; }
  [[nodiscard]] std::vector<parameter<space>> const& parameters() const noexcept { return params_; }
  //! The update rule with its hyperparameters; change them between steps if you like.
  [[nodiscard]] Rule& rule() noexcept { return rule_; }
  [[nodiscard]] Rule const& rule() const noexcept { return rule_; }

  //! Where kernels (and schedules) find the number of applied steps.
  [[nodiscard]] std::uint64_t* steps_data() const noexcept { return steps_.get(); }
  //! Steps applied so far (skipped ones do not count). Synchronises a cuda_executor.
  [[nodiscard]] std::uint64_t steps(Exec const& exec) const { return steps_.read(exec); }

  //! One plain step with the current gradients: no finiteness check, no clipping.
  void step(Exec const& exec) {
    apply(exec, nullptr);
    if constexpr (is_host_executor_v<Exec>) {
      ++*steps_.get();
    } else {
#if MPX_HAS_CUDA
      advance_step_count_kernel<<<1, 1, 0, exec.stream()>>>(steps_.get());
      MPX_CUDA_CHECK_LAUNCH("mpx::advance_step_count_kernel");
#endif
    }
  }

  //! The update alone, reading `verdict` (may be null) on the executor: skipped entirely
  //! when it found a non-finite gradient, gradients multiplied by its gradient_factor
  //! (unscaling and clipping) otherwise. Does not advance the step count (the caller does, when applied).
  void apply([[maybe_unused]] Exec const& exec, gradient_summary const* verdict) {
    require_slots();
    for (std::size_t d = 0; d < all_dtypes.size(); ++d) {
      visit_dtype(all_dtypes[d], [&](auto t) {
        using T = decltype(t);
        for (auto const& table : plans_[d].tables) {
          if constexpr (is_host_executor_v<Exec>) {
            host_optimizer_step<T>(table, rule_, *steps_.get(), verdict);
          } else {
#if MPX_HAS_CUDA
            if (table.blocks() == 0) continue;
            optimizer_step_kernel<T><<<table.blocks(), block_size, 0, exec.stream()>>>(table, rule_, steps_.get(),
                                                                                      verdict);
            MPX_CUDA_CHECK_LAUNCH("mpx::optimizer_step_kernel");
#else
            kernels_need_nvcc<Exec>();
#endif
          }
        }
      });
    }
  }

  //! Copies the parameters' current values into the float master weights (after you
  //! changed the parameters yourself, e.g. re-initialised them).
  void reload_master_weights(Exec const& exec) {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (masters_[i].empty()) continue;
      visit_dtype(params_[i].value.dtype(), [&](auto t) {
        using T = decltype(t);
        if constexpr (!std::is_same_v<T, float>)
          mpx::cast(exec, params_[i].value.template as<T>().reshape(masters_[i].shape()), masters_[i]);
      });
    }
  }

  //! Adds the optimizer's state to a checkpoint: the parameter list (checked on load),
  //! step count, values, master weights and slots. Synchronises a cuda_executor.
  void save(Exec const& exec, checkpoint_writer& out) const {
    out.add("optimizer/kind", as_bytes("mpx::" + kind_));
    std::string const listing = parameter_listing();
    out.add("optimizer/parameters", as_bytes(listing));
    out.add("optimizer/state", as_bytes(state_listing()));
    out.add_value("optimizer/steps", steps(exec));
    for (std::size_t i = 0; i < params_.size(); ++i) {
      std::string const n = std::to_string(i);
      out.add("value/" + n, download_bytes(exec, params_[i].value.data(), params_[i].value.size_bytes()));
      if (!masters_[i].empty())
        out.add("master/" + n, download_bytes(exec, masters_[i].data(), masters_[i].size_bytes()));
      for (int j = 0; j < slots; ++j) {
        auto const& s = slots_[i][static_cast<std::size_t>(j)];
        if (!s.empty()) out.add("slot" + std::to_string(j) + "/" + n, download_bytes(exec, s.data(), s.size_bytes()));
      }
    }
  }

  //! Writes the optimizer alone to `path`, atomically (see checkpoint_file.hpp); to
  //! save it with a loss scaler, save the loss_scale_optimizer instead. Synchronises.
  void save(Exec const& exec, std::filesystem::path const& path) const {
    checkpoint_writer out("mpx::optimizer");
    save(exec, out);
    out.commit(path);
  }
  //! Restores a file written by save(exec, path); refused with mpx::checkpoint_error,
  //! nothing changed, when it is corrupt or for another optimizer or parameter list.
  void load(Exec const& exec, std::filesystem::path const& path) {
    checkpoint_reader in(path, "mpx::optimizer");
    load(exec, in, [&] { in.refuse_unread_sections(); });
  }

  //! Restores what save() wrote. Everything is checked against this optimizer's
  //! parameters first, then `last_check()` runs (the caller's own checks of the file);
  //! on any mismatch mpx::checkpoint_error is thrown and nothing changes.
  template <class LastCheck>
  void load(Exec const& exec, checkpoint_reader const& in, LastCheck&& last_check) {
    check_section_text(in, "optimizer/kind", "mpx::" + kind_, "optimizer");
    check_section_text(in, "optimizer/parameters", parameter_listing(), "parameter list");
    check_section_text(in, "optimizer/state", state_listing(), "state kept per parameter");
    struct pending {
      void* to;
      std::span<std::byte const> from;
    };
    std::vector<pending> writes;
    auto const steps = in.value<std::uint64_t>("optimizer/steps");
    if (steps > max_checkpoint_steps)
      in.refuse("its optimizer step count " + std::to_string(steps) +
                " is impossible (no run takes more than 2^53 steps; the next step's bias correction would be "
                "meaningless): the file is corrupt");
    for (std::size_t i = 0; i < params_.size(); ++i) {
      std::string const n = std::to_string(i);
      writes.push_back({params_[i].value.data(), in.section("value/" + n, params_[i].value.size_bytes())});
      if (!masters_[i].empty()) writes.push_back({masters_[i].data(), in.section("master/" + n, masters_[i].size_bytes())});
      for (int j = 0; j < slots; ++j) {
        auto const& s = slots_[i][static_cast<std::size_t>(j)];
        if (!s.empty()) writes.push_back({s.data(), in.section("slot" + std::to_string(j) + "/" + n, s.size_bytes())});
      }
    }
    last_check();
    // Every section is present and of the right size: now, and only now, write.
    for (auto const& w : writes) upload_bytes(exec, w.to, w.from);
    steps_.write(exec, steps);
    exec.synchronize();
  }

 private:
  static std::vector<tensor_ref<space>> gradient_refs(std::string const& kind, std::vector<parameter<space>> const& ps) {
    std::vector<tensor_ref<space>> out;
    for (auto const& p : ps) {
      require_matching_gradient(kind, p);
      out.push_back(p.gradient);
    }
    return out;
  }
  static std::vector<std::string> parameter_names(std::vector<parameter<space>> const& ps) {
    std::vector<std::string> out;
    for (auto const& p : ps) out.push_back(p.name);
    return out;
  }

  // Slots are allocated for what the rule used at construction; a rule changed since to
  // need one (momentum switched on) would write through a null pointer.
  void require_slots() const {
    for (int j = 0; j < slots; ++j) {
      if (!rule_.uses_slot(j) || params_.empty()) continue;
      for (std::size_t i = 0; i < params_.size(); ++i)
        if (slots_[i][static_cast<std::size_t>(j)].empty() && params_[i].value.size() != 0)
          fail<invalid_argument>(kind_, "the update rule now needs state (a momentum or moment buffer) that it "
                                        "did not need when the optimizer was made; make a new optimizer instead");
    }
  }

  void plan() {
    for (std::size_t d = 0; d < all_dtypes.size(); ++d) {
      std::vector<std::array<void*, lists>> rows;
      std::vector<std::size_t> sizes;
      for (std::size_t i = 0; i < params_.size(); ++i) {
        if (params_[i].value.dtype() != all_dtypes[d]) continue;
        std::array<void*, lists> row{};
        row[0] = params_[i].value.data();
        row[1] = params_[i].gradient.data();
        row[2] = masters_[i].empty() ? params_[i].value.data() : static_cast<void*>(masters_[i].data());
        for (int j = 0; j < slots; ++j) row[static_cast<std::size_t>(fixed_lists + j)] = slots_[i][static_cast<std::size_t>(j)].data();
        rows.push_back(row);
        sizes.push_back(params_[i].value.size());
      }
      plans_[d] = plan_multi_tensor<lists>(rows, sizes);
    }
  }

  //! Which per-element buffers this optimizer keeps ("momentum buffer", "first and
  //! second moments", "none"): SGD with and without momentum differ here.
  [[nodiscard]] std::string state_listing() const {
    std::string s;
    for (int j = 0; j < slots; ++j)
      if (rule_.uses_slot(j)) s += (s.empty() ? "" : ", ") + std::string(Rule::slot_names[j]);
    return s.empty() ? "none" : s;
  }

  [[nodiscard]] std::string parameter_listing() const {
    std::string s;
    for (auto const& p : params_)
      s += p.name + " " + std::string(to_string(p.value.dtype())) + " " + p.value.shape().to_string() + "\n";
    return s;
  }
  static std::span<std::byte const> as_bytes(std::string const& s) noexcept {
    return {reinterpret_cast<std::byte const*>(s.data()), s.size()};
  }
  static void check_section_text(checkpoint_reader const& in, std::string const& name, std::string const& expected,
                                 std::string_view what) {
    auto const got = in.section(name);
    if (std::string(reinterpret_cast<char const*>(got.data()), got.size()) != expected)
      in.refuse("the checkpoint's " + std::string(what) + " differs from this one's:\n" +
                std::string(reinterpret_cast<char const*>(got.data()), got.size()) + "\nexpected:\n" + expected);
  }
  static std::vector<std::byte> download_bytes(Exec const& exec, void const* from, std::size_t bytes) {
    std::vector<std::byte> out(bytes);
    if (bytes == 0) return out;
    if constexpr (is_host_executor_v<Exec>) {
      std::memcpy(out.data(), from, bytes);
    } else {
#if MPX_HAS_CUDA_RUNTIME
      MPX_CUDA_CHECK(cudaMemcpyAsync(out.data(), from, bytes, cudaMemcpyDeviceToHost, exec.stream()));
      exec.synchronize();
#endif
    }
    return out;
  }
  static void upload_bytes([[maybe_unused]] Exec const& exec, void* to, std::span<std::byte const> from) {
    if (from.empty()) return;
    if constexpr (is_host_executor_v<Exec>) {
      std::memcpy(to, from.data(), from.size());
    } else {
#if MPX_HAS_CUDA_RUNTIME
      MPX_CUDA_CHECK(cudaMemcpyAsync(to, from.data(), from.size(), cudaMemcpyHostToDevice, exec.stream()));
#endif
    }
  }

  std::string kind_;  // "sgd", "adam", "adamw": names errors and checkpoints
  std::vector<parameter<space>> params_;
  Rule rule_;
  resident<std::uint64_t, space> steps_;
  gradient_list<Exec> gradients_;
  std::vector<tensor<float, space>> masters_;
  std::vector<std::array<tensor<float, space>, slots>> slots_;
  std::array<multi_tensor_plan<lists>, dtype_count> plans_;
};

}  // namespace mpx::detail
