// Saving and loading a sequential model's weights (and its layers' non-trainable state,
// such as batch norm's running statistics), safely: the file is versioned and
// checksummed and written atomically (optim/checkpoint_file.hpp), and a load checks
// every tensor's name, dtype and shape before it writes any, so a refused file leaves
// the model as it was. The optimizer and loss scaler are saved beside it with
// loss_scale_optimizer::save; save_training_state writes both.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/tensor_ref.hpp>
#include <mpx/optim/checkpoint_file.hpp>
#include <mpx/optim/parameter.hpp>

#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace mpx {

namespace detail {

//! Every tensor a model's file holds: the parameters, then any layer state.
template <class Space, class Model>
std::vector<std::pair<std::string, tensor_ref<Space>>> model_tensors(Model& model) {
  std::vector<std::pair<std::string, tensor_ref<Space>>> out;
  for (auto& p : model.template parameters<Space>()) out.emplace_back(p.name, p.value);
  model.for_each_layer([&](auto& layer) {
    if constexpr (requires { layer.template append_state<Space>(out); }) layer.template append_state<Space>(out);
  });
  return out;
}

inline std::string describe_tensor(dtype_id d, shape const& s) { return std::string(to_string(d)) + " " + s.to_string(); }

}  // namespace detail

//! Writes the model's weights and state to `path` (atomically). Synchronises.
template <executor Exec, class Model>
void save_model(Exec const& exec, Model& model, std::filesystem::path const& path) {
  using Space = memory_space_t<Exec>;
  detail::checkpoint_writer out("mpx::sequential");
  for (auto const& [name, t] : detail::model_tensors<Space>(model)) {
    std::string const header = detail::describe_tensor(t.dtype(), t.shape());
    out.add(name + "#type", std::span<std::byte const>(reinterpret_cast<std::byte const*>(header.data()), header.size()));
    std::vector<std::byte> bytes(t.size_bytes());
    tensor_view<std::byte const, Space> src(static_cast<std::byte const*>(t.data()), shape{static_cast<std::int64_t>(bytes.size())});
    copy(exec, src, tensor_view<std::byte, host_space>(bytes.data(), src.shape()));
    exec.synchronize();
    out.add(name, bytes);
  }
  out.commit(path);
}

//! Restores weights and state saved by save_model into a model built with the same
//! layers. A missing or corrupt file, or one whose tensors differ in name, dtype or
//! shape, is refused with mpx::checkpoint_error naming the tensor; nothing is changed
//! then. Synchronises. An optimizer made before the load still holds float master copies
//! of the old weights, and its next step would write them back: call its
//! reload_master_weights(exec) (or make it after loading, or use load_training_state).
template <executor Exec, class Model>
void load_model(Exec const& exec, Model& model, std::filesystem::path const& path) {
  using Space = memory_space_t<Exec>;
  detail::checkpoint_reader in(path, "mpx::sequential");
  auto const tensors = detail::model_tensors<Space>(model);
  for (auto const& [name, t] : tensors) {  // check everything first
    if (!in.contains(name))
      in.refuse("it holds no tensor '" + name + "' (a model with other layers?); nothing was loaded");
    auto const header = in.section(name + "#type");
    std::string const saved(reinterpret_cast<char const*>(header.data()), header.size());
    std::string const here = detail::describe_tensor(t.dtype(), t.shape());
    if (saved != here)
      in.refuse("its '" + name + "' is " + saved + " but this model's is " + here + "; nothing was loaded");
    (void)in.section(name, t.size_bytes());
  }
  for (auto const& [name, t] : tensors) {
    auto const bytes = in.section(name, t.size_bytes());
    tensor_view<std::byte const, host_space> src(bytes.data(), shape{static_cast<std::int64_t>(bytes.size())});
    copy(exec, src, tensor_view<std::byte, Space>(static_cast<std::byte*>(t.data()), src.shape()));
  }
  exec.synchronize();
}

//! The model to `directory/model.mpx` and the optimizer with its loss scaler to
//! `directory/optimizer.mpx`, each atomically.
template <executor Exec, class Model, class Optimizer>
void save_training_state(Exec const& exec, Model& model, Optimizer const& optimizer,
                         std::filesystem::path const& directory) {
  std::filesystem::create_directories(directory);
  save_model(exec, model, directory / "model.mpx");
  optimizer.save(exec, directory / "optimizer.mpx");
}

//! Restores what save_training_state wrote; the optimizer file is checked against the
//! optimizer's parameter list before anything of it changes.
template <executor Exec, class Model, class Optimizer>
void load_training_state(Exec const& exec, Model& model, Optimizer& optimizer, std::filesystem::path const& directory) {
  load_model(exec, model, directory / "model.mpx");
  optimizer.load(exec, directory / "optimizer.mpx");
}

}  // namespace mpx
