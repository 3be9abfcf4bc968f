// Saving and loading a sequential model's weights (and its layers' non-trainable state,
// such as batch norm's running statistics), safely: the file is versioned and
// checksummed and written atomically (core/checkpoint_file.hpp), and a load checks
// every tensor's name, dtype and shape before it writes any, so a refused file leaves
// the model as it was. A whole training run (this file, the optimizer with its loss
// scaler, the layers' counters, the position in the data) is saved and resumed by
// save_training_state / load_training_state (model/training_state.hpp).
#pragma once

#include <mpx/core/checkpoint_file.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/tensor_ref.hpp>

#include <cstring>
#include <filesystem>
#include <span>
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
    out.add(name + "#type", detail::text_bytes(header));
    std::vector<std::byte> bytes(t.size_bytes());
    tensor_view<std::byte const, Space> src(static_cast<std::byte const*>(t.data()), shape{static_cast<std::int64_t>(bytes.size())});
    copy(exec, src, tensor_view<std::byte, host_space>(bytes.data(), src.shape()));
    exec.synchronize();
    out.add(name, bytes);
  }
  out.commit(path);
}

//! What load_model does with a file that does not describe the model exactly.
enum class model_load {
  exact,    //!< refuse it: the file must hold every tensor of the model and nothing else
  partial,  //!< load the tensors both have (transfer learning); the others keep their values
};

//! Restores weights and state saved by save_model into a model built with the same
//! layers. A missing or corrupt file, a tensor whose dtype or shape differs, and (unless
//! `mode` is model_load::partial) a file that lacks a tensor of the model or holds one
//! the model does not have, is refused with mpx::checkpoint_error naming the file and
//! the tensors; nothing is changed then. Synchronises. An optimizer made before the load
//! still holds float master copies of the old weights, and its next step would write
//! them back: call its reload_master_weights(exec) (or make it after loading, or use
//! load_training_state).
template <executor Exec, class Model>
void load_model(Exec const& exec, Model& model, std::filesystem::path const& path,
                model_load mode = model_load::exact) {
  using Space = memory_space_t<Exec>;
  detail::checkpoint_reader in(path, "mpx::sequential");
  auto const tensors = detail::model_tensors<Space>(model);
  std::vector<std::pair<tensor_ref<Space>, std::span<std::byte const>>> writes;
  std::vector<std::string> missing;
  for (auto const& [name, t] : tensors) {  // check everything first
    if (!in.contains(name) && !in.contains(name + "#type")) {
      missing.push_back(name);
      continue;
    }
    std::string const saved = in.text(name + "#type");
    std::string const here = detail::describe_tensor(t.dtype(), t.shape());
    if (saved != here)
      in.refuse("its '" + name + "' is " + saved + " but this model's is " + here + "; nothing was loaded");
    writes.emplace_back(t, in.section(name, t.size_bytes()));
  }
  std::vector<std::string> extra;
  for (std::string const& s : in.unread_sections())
    if (!s.ends_with("#type") || !in.contains(s.substr(0, s.size() - 5))) extra.push_back(s);
  if (mode == model_load::exact && (!missing.empty() || !extra.empty()))
    in.refuse("it does not describe this model (one with other layers?):" +
              (missing.empty() ? std::string() : " it lacks this model's " + detail::quoted_list(missing) + ";") +
              (extra.empty() ? std::string() : " it holds " + detail::quoted_list(extra) + ", which this model does not have;") +
              " nothing was loaded (mpx::model_load::partial loads only the tensors both have)");
  if (writes.empty() && !tensors.empty())
    in.refuse("it holds none of this model's tensors, so even a partial load would load nothing");
  for (auto const& [t, bytes] : writes) {
    tensor_view<std::byte const, host_space> src(bytes.data(), shape{static_cast<std::int64_t>(bytes.size())});
    copy(exec, src, tensor_view<std::byte, Space>(static_cast<std::byte*>(t.data()), src.shape()));
  }
  exec.synchronize();
}

}  // namespace mpx
