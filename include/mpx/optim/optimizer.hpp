// What every mpx optimizer shares: float master weights for 16-bit parameters (or none,
// when the policy's param_type is its storage type), moment slots, a step count kept on
// the executor, and one fused multi-tensor kernel per dtype per step that reads the
// gradient check's verdict on the device, leaves everything untouched when it says skip,
// and otherwise updates the weight in float and writes it back rounded to the storage
// type (to nearest even, or stochastically). sgd.hpp and adam.hpp supply the update rules;
// the kernel is kernels/optimizer_update.hpp.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/checkpoint_file.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/resident.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/kernels/multi_tensor.hpp>
#include <mpx/kernels/optimizer_update.hpp>
#include <mpx/optim/learning_rate.hpp>
#include <mpx/optim/parameter.hpp>
#include <mpx/scaling/unscale_and_check.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx {

//! Where an optimizer keeps the weights it updates: a float copy of every 16-bit
//! parameter (float32, the default), or none (the update is computed in float from the
//! stored value and written back rounded to the parameter's dtype).
enum class master_weights { float32, none };

//! How an optimizer keeps and writes back its 16-bit parameters.
struct master_weight_options {
  master_weights master = master_weights::float32;
  //! Without master weights only: a bfloat16 or half result is rounded up with
  //! probability (distance to the lower neighbour) / (distance between the neighbours),
  //! so an update below half an ulp still moves the weight on average. False: to nearest even.
  bool stochastic_rounding = false;
  //! Philox key of the rounding; the draws depend on (seed, step, parameter, element)
  //! alone, so the host and the GPU round alike and a resumed run repeats them (the
  //! value rounded is alike too where the rule writes its products with
  //! mpx::mul_rn, so that nvcc cannot fuse them into FMAs).
  std::uint64_t seed = 0;
};

//! The master weights a policy asks for: float32 when its param_type is float, none
//! when param_type is its storage type (pure 16-bit training).
template <policy_type Policy>
constexpr master_weight_options master_weights_for(bool stochastic_rounding = false, std::uint64_t seed = 0) noexcept {
  using P = typename Policy::param_type;
  static_assert(std::is_same_v<P, float> || std::is_same_v<P, typename Policy::storage_type>,
                "mpx optimizers keep master weights in float (param_type float) or none at all (param_type equal "
                "to the policy's storage type); this policy's param_type is neither");
  if constexpr (std::is_same_v<P, float>) return {master_weights::float32, false, seed};
  else return {master_weights::none, stochastic_rounding, seed};
}

}  // namespace mpx

namespace mpx::detail {

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

  optimizer_core(Exec const& exec, std::vector<parameter<space>> params, Rule rule, std::string kind,
                 master_weight_options masters = {})
      : kind_(std::move(kind)), params_(std::move(params)), rule_(rule), master_options_(masters),
        steps_(exec, std::uint64_t{0}), gradients_(exec, gradient_refs(kind_, params_), parameter_names(params_)) {
    if constexpr (requires { rule_.learning_rate; }) validate_learning_rate(kind_, rule_.learning_rate);
    validate_master_options();
    masters_.reserve(params_.size());
    slots_.reserve(params_.size());
    for (auto const& p : params_) {
      shape const flat{static_cast<std::int64_t>(p.value.size())};
      tensor<float, space> master;
      if (p.value.dtype() != dtype_id::float32 && masters.master == master_weights::float32) {
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
    watch_models();
  }

  //! The gradients, planned for unscale_and_check (loss_scale_optimizer uses them).
  [[nodiscard]] gradient_list<Exec>& gradients() noexcept { return gradients_; }
  [[nodiscard]] gradient_list<Exec> const& gradients() const noexcept { return gradients_; }
  [[nodiscard]] std::vector<parameter<space>> const& parameters() const noexcept { return params_; }
  //! The update rule with its hyperparameters; change them between steps if you like.
  [[nodiscard]] Rule& rule() noexcept { return rule_; }
  [[nodiscard]] Rule const& rule() const noexcept { return rule_; }
  //! Whether float master weights are kept, and how results are rounded without them.
  [[nodiscard]] master_weight_options const& master_options() const noexcept { return master_options_; }

  //! Where kernels (and schedules) find the number of applied steps.
  [[nodiscard]] std::uint64_t* steps_data() const noexcept { return steps_.get(); }
  //! Steps applied so far (skipped ones do not count). Synchronises a cuda_executor.
  [[nodiscard]] std::uint64_t steps(Exec const& exec) const { return steps_.read(exec); }

  //! One plain step with the current gradients: no finiteness check, no clipping.
  void step(Exec const& exec) {
    apply(exec, nullptr);
    advance_step_count(exec, steps_.get());
  }

  //! The update alone, reading `verdict` (may be null) on the executor: skipped entirely
  //! when it found a non-finite gradient, gradients multiplied by its gradient_factor
  //! (unscaling and clipping) otherwise. Does not advance the step count (the caller does, when applied).
  void apply(Exec const& exec, gradient_summary const* verdict) {
    require_current_parameters();
    require_slots();
    require_backward_since_last_step();
    for (std::size_t d = 0; d < all_dtypes.size(); ++d) {
      visit_dtype(all_dtypes[d], [&](auto t) {
        using T = decltype(t);
        weight_rounding rounding{master_options_.stochastic_rounding, master_options_.seed,
                                 static_cast<std::uint32_t>(d) << 24};
        for (auto const& table : plans_[d].tables) {
          optimizer_update_pass<T>(exec, table, rule_, steps_.get(), verdict, rounding);
          rounding.first_stream += table.count;
        }
      });
    }
  }

  //! Lets a step apply gradients no backward wrote since the previous step (gradients
  //! you wrote yourself into a model's gradient tensors, say). Returns the previous
  //! setting. By default such a step is refused with mpx::invalid_argument.
  bool allow_step_without_backward(bool allow) noexcept { return std::exchange(step_without_backward_allowed_, allow); }

  //! Refuses a step, with mpx::invalid_argument and before anything runs, on parameters
  //! whose model was built again since it handed them out (the build allocated new tensors
  //! and freed these), or on float master weights older than weights the model has loaded
  //! since (load_model; the step would write the old weights back). Every step checks it;
  //! loss_scale_optimizer checks it before it reads the gradients. Host only: no executor.
  void require_current_parameters() const {
    require_parameters_alive();
    for (auto const& w : watched_) {
      if (w.first_master && w.count->weight_loads != w.loads_seen)
        fail<invalid_argument>("mpx::" + kind_,
                               "the model's weights were replaced (load_model) after this optimizer copied them into "
                               "its float master weights (e.g. '" + *w.first_master +
                                   "'): this step would write the old weights back over them. Call the optimizer's "
                                   "reload_master_weights(exec) after loading, make the optimizer after loading, or "
                                   "use load_training_state (an optimizer's own load restores its master weights: "
                                   "load it after the model)");
    }
  }

  //! Refuses (mpx::invalid_argument) any use of parameters whose model was built again
  //! since it handed them out: the build allocated new tensors and freed these.
  void require_parameters_alive() const {
    for (auto const& w : watched_)
      if (w.count->builds != w.build)
        fail<invalid_argument>("mpx::" + kind_,
                               "its parameters (e.g. '" + w.first_parameter +
                                   "') are no longer the model's: the model was built again after this optimizer was "
                                   "made, and the build allocated new tensors and freed these. Make the optimizer "
                                   "(and its loss_scale_optimizer) after the model's last build");
  }

  //! Copies the parameters' current values into the float master weights (after you
  //! changed the parameters yourself, e.g. re-initialised them).
  void reload_master_weights(Exec const& exec) {
    require_parameters_alive();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (masters_[i].empty()) continue;
      visit_dtype(params_[i].value.dtype(), [&](auto t) {
        using T = decltype(t);
        if constexpr (!std::is_same_v<T, float>)
          mpx::cast(exec, params_[i].value.template as<T>().reshape(masters_[i].shape()), masters_[i]);
      });
    }
    masters_match_weights();
  }

  //! Adds the optimizer's state to a checkpoint: the parameter list (checked on load),
  //! step count, values, master weights (when kept), the rounding and its seed, and
  //! slots. Synchronises a cuda_executor.
  void save(Exec const& exec, checkpoint_writer& out) const {
    require_parameters_alive();
    out.add("optimizer/kind", text_bytes("mpx::" + kind_));
    std::string const listing = parameter_listing();
    out.add("optimizer/parameters", text_bytes(listing));
    out.add("optimizer/state", text_bytes(state_listing()));
    out.add("optimizer/master weights", text_bytes(master_listing()));
    if (master_options_.stochastic_rounding) out.add_value("optimizer/rounding seed", master_options_.seed);
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
  //! on any mismatch mpx::checkpoint_error is thrown and nothing changes. A stochastic
  //! rounding seed is restored from the file, so the resumed run draws as the saved one would.
  template <class LastCheck>
  void load(Exec const& exec, checkpoint_reader const& in, LastCheck&& last_check) {
    require_parameters_alive();
    in.require_text("optimizer/kind", "mpx::" + kind_, "optimizer");
    in.require_text("optimizer/parameters", parameter_listing(), "parameter list");
    in.require_text("optimizer/state", state_listing(), "state kept per parameter");
    // Files written before master weights became optional always kept them.
    std::string const saved_masters = in.contains("optimizer/master weights") ? in.text("optimizer/master weights")
                                                                               : std::string(master_listing_float32);
    if (saved_masters != master_listing())
      in.refuse("it was saved by an optimizer with master weights \"" + saved_masters + "\"; this one has \"" +
                master_listing() + "\" (make the optimizer with the same mpx::master_weight_options)");
    std::uint64_t const seed =
        master_options_.stochastic_rounding ? in.value<std::uint64_t>("optimizer/rounding seed") : master_options_.seed;
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
    master_options_.seed = seed;
    masters_match_weights();
    exec.synchronize();
  }

 private:
  static std::vector<tensor_ref<space>> gradient_refs(std::string const& kind, std::vector<parameter<space>> const& ps) {
    std::vector<tensor_ref<space>> out;
    std::vector<std::pair<std::string, tensor_ref<space>>> named;  // every tensor the step reads or writes
    for (auto const& p : ps) {
      require_matching_gradient(kind, p);
      out.push_back(p.gradient);
      named.emplace_back("the value of '" + p.name + "'", p.value);
      named.emplace_back("the gradient of '" + p.name + "'", p.gradient);
    }
    // A parameter listed twice would be stepped twice; a gradient in a value's memory
    // would be overwritten by the update it feeds.
    detail::require_no_overlap("mpx::" + kind, named, "a parameter listed twice? each value and gradient needs memory of its own");
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

  void validate_master_options() const {
    if (master_options_.master == master_weights::float32 && master_options_.stochastic_rounding)
      fail<invalid_argument>(kind_, "stochastic rounding applies only without master weights (master_weights::none): "
                                    "with float master weights the stored value is a rounded copy and rounds to nearest");
  }

  static constexpr std::string_view master_listing_float32 = "float32";
  //! What a checkpoint records of master_options_ (the seed is a value of its own).
  [[nodiscard]] std::string master_listing() const {
    if (master_options_.master == master_weights::float32) return std::string(master_listing_float32);
    return master_options_.stochastic_rounding ? "none, stochastic rounding" : "none, rounded to nearest even";
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
        // The float master copy; a float parameter is its own, a 16-bit one without masters has none.
        row[2] = !masters_[i].empty()                            ? static_cast<void*>(masters_[i].data())
                 : params_[i].value.dtype() == dtype_id::float32 ? params_[i].value.data()
                                                                 : nullptr;
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
  // The bytes of a tensor of the executor's memory, and back: exec/copy.hpp's rules.
  static std::vector<std::byte> download_bytes(Exec const& exec, void const* from, std::size_t bytes) {
    std::vector<std::byte> out(bytes);
    if (bytes == 0) return out;
    shape const flat{static_cast<std::int64_t>(bytes)};
    copy(exec, tensor_view<std::byte const, space>(static_cast<std::byte const*>(from), flat),
         tensor_view<std::byte, host_space>(out.data(), flat));
    exec.synchronize();
    return out;
  }
  static void upload_bytes(Exec const& exec, void* to, std::span<std::byte const> from) {
    if (from.empty()) return;
    shape const flat{static_cast<std::int64_t>(from.size())};
    copy(exec, tensor_view<std::byte const, host_space>(from.data(), flat),
         tensor_view<std::byte, space>(static_cast<std::byte*>(to), flat));
  }

  //! Refuses a step when a model whose gradients this optimizer applies ran no backward
  //! since the previous step, before anything is changed; then remembers the counts.
  void require_backward_since_last_step() {
    if (step_without_backward_allowed_) return;
    for (auto const& w : watched_)
      if (w.count->passes == w.seen)
        fail<invalid_argument>(
            "mpx::" + kind_,
            std::string(w.seen == 0 ? "a step before any backward" : "a second step with no backward since the last one") +
                ": the gradients (e.g. '" + w.first_parameter + "') are " +
                (w.seen == 0 ? "the zeros the model was built with" : "the ones the last step already applied") +
                ". Run forward(exec, x, true) and backward before each step, or call "
                "allow_step_without_backward(true) if you wrote the gradients yourself");
    for (auto& w : watched_) w.seen = w.count->passes;
  }

  //! Each distinct model (history) among the parameters, and the build it handed them out
  //! from, found once, so a step checks a handful of counters, not every parameter.
  void watch_models() {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto const& p = params_[i];
      if (!p.written_by) continue;
      auto w = std::find_if(watched_.begin(), watched_.end(),
                            [&](watched_model const& m) { return m.count == p.written_by && m.build == p.build; });
      if (w == watched_.end())
        w = watched_.insert(watched_.end(),
                            watched_model{p.written_by, 0, p.name, p.build, p.written_by->weight_loads, {}});
      if (!masters_[i].empty() && !w->first_master) w->first_master = p.name;
    }
  }

  //! The master weights were copied from the weights (or loaded with them): what the
  //! models have loaded so far is in them.
  void masters_match_weights() noexcept {
    for (auto& w : watched_) w.loads_seen = w.count->weight_loads;
  }

  std::string kind_;  // "sgd", "adam", "adamw": names errors and checkpoints
  std::vector<parameter<space>> params_;
  struct watched_model {
    std::shared_ptr<model_history const> count;
    std::uint64_t seen = 0;  // the model's backward passes at this optimizer's last step
    std::string first_parameter;
    std::uint64_t build = 0;       // the model's build the parameters came from
    std::uint64_t loads_seen = 0;  // the model's weight loads the master weights hold
    std::optional<std::string> first_master;  // a parameter with a float master copy, if any
  };
  std::vector<watched_model> watched_;
  bool step_without_backward_allowed_ = false;
  Rule rule_;
  master_weight_options master_options_;
  resident<std::uint64_t, space> steps_;
  gradient_list<Exec> gradients_;
  std::vector<tensor<float, space>> masters_;
  std::vector<std::array<tensor<float, space>, slots>> slots_;
  std::array<multi_tensor_plan<lists>, dtype_count> plans_;
};

}  // namespace mpx::detail
