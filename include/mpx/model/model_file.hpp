// Saving and loading a sequential model's weights (and its layers' non-trainable state,
// such as batch norm's running statistics), safely: the file is versioned and
// checksummed and written atomically (core/checkpoint_file.hpp), and a load checks
// every tensor's name, dtype and shape before it writes any, so a refused file leaves
// the model as it was. A whole training run (this file, the optimizer with its loss
// scaler, the layers' counters, the position in the data) is saved and resumed by
// save_training_state / load_training_state (model/training_state.hpp).
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/checkpoint_file.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/tensor_ref.hpp>

#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string_view>
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

//! The dtype a describe_tensor text begins with, if it names one.
inline std::optional<dtype_id> described_dtype(std::string_view description) {
  std::string_view const name = description.substr(0, description.find(' '));
  for (dtype_id d : all_dtype_ids)
    if (to_string(d) == name) return d;
  return std::nullopt;
}

//! A saved tensor's bytes in dtype `from`, converted to `to` (through float, rounding to
//! nearest even); refused, naming the first value, when `to` cannot hold one that was
//! finite. Host memory only.
inline std::vector<std::byte> converted_tensor(checkpoint_reader const& in, std::string const& name,
                                               std::span<std::byte const> saved, dtype_id from, dtype_id to) {
  std::size_t const count = saved.size() / size_of(from);
  std::vector<std::byte> out(count * size_of(to));
  visit_dtype(from, [&](auto source_tag) {
    visit_dtype(to, [&](auto target_tag) {
      using S = decltype(source_tag);
      using D = decltype(target_tag);
      for (std::size_t i = 0; i < count; ++i) {
        S s;
        std::memcpy(&s, saved.data() + i * sizeof(S), sizeof(S));
        float const wide = cast<float>(s);
        D const d = cast<D>(wide);
        if (is_finite(wide) && !is_finite(cast<float>(d)))
          in.refuse("its '" + name + "' holds " + to_text(wide) + " (element " + std::to_string(i) + "), which " +
                    std::string(to_string(to)) + " cannot hold; nothing was loaded");
        std::memcpy(out.data() + i * sizeof(D), &d, sizeof(D));
      }
    });
  });
  return out;
}

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
  //! as exact, but a tensor saved in another dtype is converted, rounding to nearest
  //! even: a float16 model's file into the same layers under bfloat16, to fine-tune under
  //! another policy. A value the model's dtype cannot hold refuses the file.
  converting,
};

namespace detail {
//! load_model without telling the model's optimizers (load_training_state loads their
//! master weights with it).
template <executor Exec, class Model>
void load_model_tensors(Exec const& exec, Model& model, std::filesystem::path const& path, model_load mode) {
  using Space = memory_space_t<Exec>;
  checkpoint_reader in(path, "mpx::sequential");
  auto const tensors = model_tensors<Space>(model);
  std::vector<std::pair<tensor_ref<Space>, std::span<std::byte const>>> writes;
  std::vector<std::vector<std::byte>> conversions;  // the converted tensors' bytes, which writes point into
  conversions.reserve(tensors.size());
  std::vector<std::string> missing;
  for (auto const& [name, t] : tensors) {  // check everything first
    if (!in.contains(name) && !in.contains(name + "#type")) {
      missing.push_back(name);
      continue;
    }
    std::string const saved = in.text(name + "#type");
    std::string const here = describe_tensor(t.dtype(), t.shape());
    if (saved == here) {
      writes.emplace_back(t, in.section(name, t.size_bytes()));
      continue;
    }
    auto const saved_dtype = described_dtype(saved);
    bool const only_dtype_differs = saved_dtype && describe_tensor(*saved_dtype, t.shape()) == saved;
    if (mode != model_load::converting || !only_dtype_differs)
      in.refuse("its '" + name + "' is " + saved + " but this model's is " + here + "; nothing was loaded" +
                (only_dtype_differs ? " (mpx::model_load::converting converts a tensor saved in another dtype)" : ""));
    auto const bytes = in.section(name, t.size() * size_of(*saved_dtype));
    conversions.push_back(converted_tensor(in, name, bytes, *saved_dtype, t.dtype()));
    writes.emplace_back(t, std::span<std::byte const>(conversions.back()));
  }
  std::vector<std::string> extra;
  for (std::string const& s : in.unread_sections())
    if (!s.ends_with("#type") || !in.contains(s.substr(0, s.size() - 5))) extra.push_back(s);
  if (mode != model_load::partial && (!missing.empty() || !extra.empty()))
    in.refuse("it does not describe this model (one with other layers?):" +
              (missing.empty() ? std::string() : " it lacks this model's " + quoted_list(missing) + ";") +
              (extra.empty() ? std::string()
                             : " it holds " + quoted_list(extra) + ", which this model does not have;") +
              " nothing was loaded (mpx::model_load::partial loads only the tensors both have)");
  if (writes.empty() && !tensors.empty())
    in.refuse("it holds none of this model's tensors, so even a partial load would load nothing");
  for (auto const& [t, bytes] : writes) {
    tensor_view<std::byte const, host_space> src(bytes.data(), shape{static_cast<std::int64_t>(bytes.size())});
    copy(exec, src, tensor_view<std::byte, Space>(static_cast<std::byte*>(t.data()), src.shape()));
  }
  exec.synchronize();
}
}  // namespace detail

//! Restores weights and state saved by save_model into a model built with the same
//! layers. A missing or corrupt file, a tensor whose dtype or shape differs, and (unless
//! `mode` is model_load::partial) a file that lacks a tensor of the model or holds one
//! the model does not have, is refused with mpx::checkpoint_error naming the file and
//! the tensors; nothing is changed then. Synchronises. An optimizer made before the load
//! still holds float master copies of the old weights, and its next step would write
//! them back: it refuses that step until its reload_master_weights(exec) runs (or make
//! it after loading, or use load_training_state).
template <executor Exec, class Model>
void load_model(Exec const& exec, Model& model, std::filesystem::path const& path,
                model_load mode = model_load::exact) {
  detail::load_model_tensors(exec, model, path, mode);
  if constexpr (requires { model.weights_replaced(); }) model.weights_replaced();
}

}  // namespace mpx
