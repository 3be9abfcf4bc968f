// Saving and resuming a training run: the model (model_file.hpp), the optimizer with its
// master weights, moments, step count and loss scaler, the layers' counters and seeds
// (dropout's count of training forwards and its seed, which decide its next mask), the
// fp8 layers' scales and amax histories (under an fp8 policy), and
// where the run is in its data. A run resumed from it continues exactly as the uninterrupted run would have, bit
// for bit on the host executor (tests/model/test_resume.cpp).
//
// A crash at any moment leaves a loadable checkpoint: `directory` holds
// model-<n>.mpx and optimizer-<n>.mpx, each written atomically, and training_state.mpx,
// which names the pair and is renamed into place after both; files of earlier saves are
// removed only then. So training_state.mpx always names a complete pair: the new one, or,
// when the process died before the rename, the previous one.
#pragma once

#include <mpx/core/checkpoint_file.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/layers/matrix_products.hpp>
#include <mpx/model/model_file.hpp>
#include <mpx/model/tiered.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace mpx {

//! Where a run is in its data: the next batch to run is batch `batch` of epoch `epoch`
//! (both from 0; give them to batch_loader::start_epoch(epoch, batch) to resume).
//! `steps` counts the steps run so far, skipped ones included.
struct training_position {
  std::uint64_t epoch = 0;
  std::uint64_t batch = 0;
  std::uint64_t steps = 0;
  friend bool operator==(training_position const&, training_position const&) = default;
};

namespace detail {

inline constexpr std::string_view training_state_file = "training_state.mpx";

//! Every counter a model's layers keep as training state, by name.
template <class Space, class Model>
std::vector<std::pair<std::string, tensor_view<std::uint64_t, Space>>> model_counters(Model& model) {
  std::vector<std::pair<std::string, tensor_view<std::uint64_t, Space>>> out;
  model.for_each_layer([&](auto& layer) {
    if constexpr (requires { layer.template append_counters<Space>(out); }) layer.template append_counters<Space>(out);
  });
  return out;
}

//! Every seed a model's layers draw random numbers with (host values), by name.
template <class Model>
std::vector<std::pair<std::string, std::uint64_t*>> model_seeds(Model& model) {
  std::vector<std::pair<std::string, std::uint64_t*>> out;
  model.for_each_layer([&](auto& layer) {
    if constexpr (requires { layer.append_seeds(out); }) layer.append_seeds(out);
  });
  return out;
}

//! The number of the save after the one training_state.mpx names (1 when there is none
//! or it cannot be read: its files are then not ours to keep anyway).
inline std::uint64_t next_save_number(std::filesystem::path const& directory) {
  std::error_code ec;
  if (!std::filesystem::exists(directory / training_state_file, ec)) return 1;
  try {
    checkpoint_reader const in(directory / training_state_file, "mpx::training_state");
    return in.value<std::uint64_t>("save") + 1;
  } catch (checkpoint_error const&) {
    return 1;
  }
}

//! Whether `name` is one this code writes: "<prefix>-<digits>.mpx", a plain file name. A
//! damaged or hostile training_state.mpx must not send the loader elsewhere.
inline bool is_save_file_name(std::string_view name, std::string_view prefix) {
  if (name.size() <= prefix.size() + 5 || name.substr(0, prefix.size()) != prefix || name[prefix.size()] != '-' ||
      name.substr(name.size() - 4) != ".mpx")
    return false;
  std::string_view const digits = name.substr(prefix.size() + 1, name.size() - prefix.size() - 5);
  if (digits.size() > 20) return false;
  for (char c : digits)
    if (c < '0' || c > '9') return false;
  return true;
}

//! Removes model-*.mpx and optimizer-*.mpx files other than the current pair (earlier
//! saves, or a save that died before its training_state.mpx). Best effort.
inline void remove_other_saves(std::filesystem::path const& directory, std::string const& model_name,
                               std::string const& optimizer_name) {
  std::error_code ec;
  std::vector<std::filesystem::path> stale;
  for (std::filesystem::directory_iterator it(directory, ec), end; !ec && it != end; it.increment(ec)) {
    std::string const name = it->path().filename().string();
    if ((is_save_file_name(name, "model") && name != model_name) ||
        (is_save_file_name(name, "optimizer") && name != optimizer_name))
      stale.push_back(it->path());
  }
  for (auto const& p : stale) std::filesystem::remove(p, ec);
}

//! The model's saved tensors (parameters and layer state) as host bytes, to put back if
//! a later part of a load is refused.
template <executor Exec, class Model>
std::vector<std::vector<std::byte>> snapshot_model(Exec const& exec, Model& model) {
  using Space = memory_space_t<Exec>;
  std::vector<std::vector<std::byte>> out;
  for (auto const& [name, t] : model_tensors<Space>(model)) {
    out.emplace_back(t.size_bytes());
    tensor_view<std::byte const, Space> src(static_cast<std::byte const*>(t.data()),
                                            shape{static_cast<std::int64_t>(t.size_bytes())});
    copy(exec, src, tensor_view<std::byte, host_space>(out.back().data(), src.shape()));
  }
  exec.synchronize();
  return out;
}

template <executor Exec, class Model>
void restore_model(Exec const& exec, Model& model, std::vector<std::vector<std::byte>> const& saved) {
  using Space = memory_space_t<Exec>;
  std::size_t i = 0;
  for (auto const& [name, t] : model_tensors<Space>(model)) {
    tensor_view<std::byte const, host_space> src(saved[i].data(), shape{static_cast<std::int64_t>(saved[i].size())});
    copy(exec, src, tensor_view<std::byte, Space>(static_cast<std::byte*>(t.data()), src.shape()));
    ++i;
  }
  exec.synchronize();
}

//! save_training_state, with `extra` adding sections of its own (a trainer's).
template <executor Exec, class Model, class Optimizer>
void save_training_state_with(Exec const& exec, Model& model, Optimizer const& optimizer,
                              std::filesystem::path const& directory, training_position const& position,
                              std::function<void(checkpoint_writer&)> const& extra) {
  using Space = memory_space_t<Exec>;
  std::error_code ec;
  std::filesystem::create_directories(directory, ec);
  if (ec)
    detail::fail<checkpoint_error>("mpx::save_training_state",
                                   "cannot create the directory " + directory.string() + ": " + ec.message());
  std::uint64_t const number = detail::next_save_number(directory);
  std::string const model_name = "model-" + std::to_string(number) + ".mpx";
  std::string const optimizer_name = "optimizer-" + std::to_string(number) + ".mpx";
  save_model(exec, model, directory / model_name);
  optimizer.save(exec, directory / optimizer_name);

  detail::checkpoint_writer out("mpx::training_state");
  out.add_value("save", number);
  out.add("files/model", detail::text_bytes(model_name));
  out.add("files/optimizer", detail::text_bytes(optimizer_name));
  out.add_value("position", position);
  auto const counters = detail::model_counters<Space>(model);
  out.add_value("counters", static_cast<std::uint64_t>(counters.size()));
  for (auto const& [name, view] : counters) {
    std::uint64_t value = 0;
    copy(exec, tensor_view<std::uint64_t const, Space>(view.data(), shape{1}),
         tensor_view<std::uint64_t, host_space>(&value, shape{1}));
    exec.synchronize();
    out.add_value("counter/" + name, value);
  }
  auto const seeds = detail::model_seeds(model);
  out.add_value("seeds", static_cast<std::uint64_t>(seeds.size()));
  for (auto const& [name, value] : seeds) out.add_value("seed/" + name, *value);
  auto const fp8_scales = detail::model_fp8_scales<Exec>(model);
  out.add_value("fp8 scales", static_cast<std::uint64_t>(fp8_scales.size()));
  for (auto const& entry : fp8_scales) entry.save(exec, out, "fp8/" + entry.name);
  auto const tiers = detail::model_tiers(model);
  out.add_value("tiers", static_cast<std::uint64_t>(tiers.size()));
  for (auto const& t : tiers) out.add("tier/" + t.name, detail::text_bytes(t.policies[*t.active]));
  if (extra) extra(out);
  out.commit(directory / detail::training_state_file);
  detail::remove_other_saves(directory, model_name, optimizer_name);
}
}  // namespace detail

//! Saves a training run to `directory` (created if needed): the model, the optimizer
//! with its loss scaler, the layers' counters, seeds and fp8 scales, and `position`. Synchronises. A crash at
//! any moment leaves the previous save loadable (see the top of this file); on an error
//! (a full disk, no permission) mpx::checkpoint_error is thrown and the previous save
//! stays.
template <executor Exec, class Model, class Optimizer>
void save_training_state(Exec const& exec, Model& model, Optimizer const& optimizer,
                         std::filesystem::path const& directory, training_position const& position = {}) {
  detail::save_training_state_with(exec, model, optimizer, directory, position, {});
}

//! Whether `directory` holds a save of save_training_state (its training_state.mpx), for
//! a run that resumes when there is something to resume. A damaged save still counts:
//! load_training_state then says what is wrong with it rather than starting afresh.
inline bool has_training_state(std::filesystem::path const& directory) {
  std::error_code ec;
  return std::filesystem::is_regular_file(directory / detail::training_state_file, ec);
}

namespace detail {
//! What reads a trainer's own sections of a training state: checks them (refusing
//! through the reader) and returns what keeps them, run once everything else is loaded.
using training_state_extra = std::function<std::function<void()>(checkpoint_reader const&)>;

//! load_training_state, with `extra` reading sections of its own; without it, a
//! trainer's sections (its step count, its precision guard) are passed over: the
//! run resumes with a fresh guard.
template <executor Exec, class Model, class Optimizer>
training_position load_training_state_with(Exec const& exec, Model& model, Optimizer& optimizer,
                                           std::filesystem::path const& directory,
                                           training_state_extra const& extra) {
  using Space = memory_space_t<Exec>;
  detail::checkpoint_reader const in(directory / detail::training_state_file, "mpx::training_state");
  auto file_name = [&](std::string const& section, std::string_view prefix) {
    std::string name = in.text(section);
    if (!detail::is_save_file_name(name, prefix))
      in.refuse("its " + section + " is not a file name this library writes");
    return name;
  };
  std::string const model_name = file_name("files/model", "model");
  std::string const optimizer_name = file_name("files/optimizer", "optimizer");
  auto const position = in.value<training_position>("position");
  // The layers' counters and seeds: exactly the ones this model keeps, by name.
  auto read_layer_values = [&](std::string const& count_section, std::string const& prefix,
                               std::vector<std::string> const& names, std::string const& what) {
    std::uint64_t const saved = in.value<std::uint64_t>(count_section);
    if (saved != names.size())
      in.refuse("it holds " + std::to_string(saved) + " layer " + what + "s, this model keeps " +
                std::to_string(names.size()) + "; nothing was loaded");
    std::vector<std::uint64_t> out;
    for (auto const& name : names) {
      if (!in.contains(prefix + name)) in.refuse("it holds no " + what + " '" + name + "'; nothing was loaded");
      out.push_back(in.value<std::uint64_t>(prefix + name));
    }
    return out;
  };
  auto names_of = [](auto const& list) {
    std::vector<std::string> names;
    for (auto const& entry : list) names.push_back(entry.first);
    return names;
  };
  auto const counters = detail::model_counters<Space>(model);
  auto const seeds = detail::model_seeds(model);
  auto const values = read_layer_values("counters", "counter/", names_of(counters), "counter");
  auto const seed_values = read_layer_values("seeds", "seed/", names_of(seeds), "seed");

  if (in.value<std::uint64_t>("save") == 0) in.refuse("its save number is 0, which no save writes");
  auto const fp8_scales = detail::model_fp8_scales<Exec>(model);
  // Saves from before fp8 layers existed hold no count: none.
  std::uint64_t const saved_fp8 = in.contains("fp8 scales") ? in.value<std::uint64_t>("fp8 scales") : 0;
  if (saved_fp8 != fp8_scales.size())
    in.refuse("it holds " + std::to_string(saved_fp8) + " layers' fp8 scales, this model keeps " +
              std::to_string(fp8_scales.size()) + "; nothing was loaded");

  // The tiered layers' tiers (mpx::tiered): each saved one by name, as a policy it has.
  auto const tiers = detail::model_tiers(model);
  std::uint64_t const saved_tiers = in.contains("tiers") ? in.value<std::uint64_t>("tiers") : 0;
  if (saved_tiers != tiers.size())
    in.refuse("it holds " + std::to_string(saved_tiers) + " tiered layers, this model keeps " +
              std::to_string(tiers.size()) + "; nothing was loaded");
  std::vector<std::size_t> tier_values;
  for (auto const& t : tiers) {
    if (!in.contains("tier/" + t.name)) in.refuse("it holds no tiered layer '" + t.name + "'; nothing was loaded");
    std::string const policy = in.text("tier/" + t.name);
    auto const at = std::find(t.policies.begin(), t.policies.end(), policy);
    if (at == t.policies.end())
      in.refuse("its tiered layer '" + t.name + "' runs under " + policy + ", which is not one of this layer's "
                "tiers; nothing was loaded");
    tier_values.push_back(static_cast<std::size_t>(at - t.policies.begin()));
  }

  // Each fp8 state, then each file, checks itself before it writes; what was written
  // goes back if a later part is refused.
  std::function<void()> keep_extra;
  std::vector<std::function<void()>> restore_fp8;
  auto undo_fp8 = [&] {
    for (auto& restore : restore_fp8) restore();
  };
  try {
    for (auto const& entry : fp8_scales) {
      restore_fp8.push_back(entry.snapshot(exec));
      entry.load(exec, in, "fp8/" + entry.name);
    }
    if (extra) keep_extra = extra(in);
    else
      for (auto const& name : in.unread_sections())
        if (name.starts_with("trainer/") || name.starts_with("guard/")) static_cast<void>(in.section(name));
    in.refuse_unread_sections();  // a section this code does not read means another format
  } catch (...) {
    undo_fp8();
    throw;
  }
  auto const before = detail::snapshot_model(exec, model);
  try {
    detail::load_model_tensors(exec, model, directory / model_name, model_load::exact);
  } catch (...) {
    undo_fp8();
    throw;
  }
  try {
    optimizer.load(exec, directory / optimizer_name);
  } catch (...) {
    detail::restore_model(exec, model, before);
    undo_fp8();
    throw;
  }
  for (std::size_t i = 0; i < counters.size(); ++i)
    copy(exec, tensor_view<std::uint64_t const, host_space>(&values[i], shape{1}),
         tensor_view<std::uint64_t, Space>(counters[i].second.data(), shape{1}));
  for (std::size_t i = 0; i < seeds.size(); ++i) *seeds[i].second = seed_values[i];
  for (std::size_t i = 0; i < tiers.size(); ++i) *tiers[i].active = *tiers[i].state_tier = tier_values[i];
  if (keep_extra) keep_extra();
  exec.synchronize();
  return position;
}
}  // namespace detail

//! Restores what save_training_state wrote into a model built with the same layers and
//! an optimizer over its parameters, and returns where the run was. Everything is checked
//! before anything is kept: a missing, damaged or mismatched file is refused with
//! mpx::checkpoint_error and the model, optimizer and scaler are as they were.
//! Synchronises.
template <executor Exec, class Model, class Optimizer>
training_position load_training_state(Exec const& exec, Model& model, Optimizer& optimizer,
                                      std::filesystem::path const& directory) {
  return detail::load_training_state_with(exec, model, optimizer, directory, {});
}

//! save_training_state for a run a trainer (mpx::classifier_trainer) drives: its model
//! and optimizer as above, and the trainer's own state: its step count and its precision
//! guard's (the evidence, the waits, the moves), so that a guarded run, resumed through
//! load_training_state(exec, trainer, directory), reviews and moves its layers at the
//! steps the uninterrupted run would. Synchronises.
template <executor Exec, class Trainer>
  requires requires(Trainer& t) { t.model(); t.optimizer(); t.read_state(std::declval<detail::checkpoint_reader const&>()); }
void save_training_state(Exec const& exec, Trainer& trainer, std::filesystem::path const& directory,
                         training_position const& position = {}) {
  detail::save_training_state_with(exec, trainer.model(), trainer.optimizer(), directory, position,
                                   [&](detail::checkpoint_writer& out) { trainer.save_state(exec, out); });
}

//! load_training_state into a trainer's model and optimizer, and the trainer's own
//! state when the save holds it (saved through a trainer; else the trainer is left as it
//! is). The trainer must not have run a step. Everything is checked before anything is
//! kept. Synchronises.
template <executor Exec, class Trainer>
  requires requires(Trainer& t) { t.model(); t.optimizer(); t.read_state(std::declval<detail::checkpoint_reader const&>()); }
training_position load_training_state(Exec const& exec, Trainer& trainer, std::filesystem::path const& directory) {
  return detail::load_training_state_with(exec, trainer.model(), trainer.optimizer(), directory,
                                          [&](detail::checkpoint_reader const& in) { return trainer.read_state(in); });
}

}  // namespace mpx
