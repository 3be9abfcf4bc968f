// What a composite layer (mpx::residual, mpx::repeat: a layer made of whole models, its
// parts) hands on from its parts to the model around it: parameters, training state,
// fp8 scales, seeds, tiers, summary rows and the gradients-final signal, each named
// under the part ("residual_1/dense/kernel", "repeat/3/residual/dense/kernel").
//
// A composite derives from composite_parts<Self> and gives for_each_part(f), calling
// f(part, "<its name>/...") for each part in the order its forward runs them, and
// for_each_part_model(f), calling f(part) alone.
#pragma once

#include <mpx/exec/executor.hpp>
#include <mpx/exec/memory_space.hpp>
#include <mpx/exec/tensor_ref.hpp>
#include <mpx/layers/layer.hpp>
#include <mpx/layers/matrix_products.hpp>
#include <mpx/model/tiered.hpp>
#include <mpx/optim/parameter.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx::detail {

// The name of a (name, value) pair, an fp8_scales_entry or a layer_tiers_entry.
// (Overloads rather than an if constexpr on a requires-expression, which nvcc 13's front
// end instantiates whole.)
template <class First, class Second>
std::string& entry_name(std::pair<First, Second>& entry) noexcept {
  return entry.first;
}
template <class Exec>
std::string& entry_name(fp8_scales_entry<Exec>& entry) noexcept {
  return entry.name;
}
inline std::string& entry_name(layer_tiers_entry& entry) noexcept { return entry.name; }

template <class Self>
class composite_parts {
 public:
  static constexpr bool composite = true;

  //! The parts' parameters, in order, each named under its part.
  template <memory_space Space>
  void append_parameters(std::vector<parameter<Space>>& out) {
    self().for_each_part([&](auto& part, std::string const& prefix) {
      for (auto p : part.template parameters<Space>()) {
        p.name = prefix + p.name;
        out.push_back(std::move(p));
      }
    });
  }
  [[nodiscard]] std::size_t parameter_count() const {
    std::size_t n = 0;
    self().for_each_part([&](auto const& part, std::string const&) { n += part.parameter_count(); });
    return n;
  }

  //! The parts' layers' training state (dropout's counters and seeds, fp8 scales), the
  //! state a model file keeps (batch norm's statistics) and the tiered layers, named like
  //! the parameters, for save_training_state, save_model and the precision guard.
  template <memory_space Space>
  void append_counters(std::vector<std::pair<std::string, tensor_view<std::uint64_t, Space>>>& out) {
    append_prefixed(out, [&](auto& l) -> decltype(l.template append_counters<Space>(out)) {
      l.template append_counters<Space>(out);
    });
  }
  template <memory_space Space>
  void append_state(std::vector<std::pair<std::string, tensor_ref<Space>>>& out) {
    append_prefixed(out, [&](auto& l) -> decltype(l.template append_state<Space>(out)) {
      l.template append_state<Space>(out);
    });
  }
  template <executor Exec>
  void append_fp8_scales(std::vector<fp8_scales_entry<Exec>>& out) {
    append_prefixed(out, [&](auto& l) -> decltype(l.template append_fp8_scales<Exec>(out)) {
      l.template append_fp8_scales<Exec>(out);
    });
  }
  void append_seeds(std::vector<std::pair<std::string, std::uint64_t*>>& out) {
    append_prefixed(out, [&](auto& l) -> decltype(l.append_seeds(out)) { l.append_seeds(out); });
  }
  void append_tiers(std::vector<layer_tiers_entry>& out) {
    append_prefixed(out, [&](auto& l) -> decltype(l.append_tiers(out)) { l.append_tiers(out); });
  }

  //! The parts' rows for the model's summary, indented under the composite (a repeat's
  //! rows carry their copy's number).
  [[nodiscard]] std::vector<std::array<std::string, 4>> part_summary_rows() const {
    std::vector<std::array<std::string, 4>> rows;
    std::size_t const own = self().name().size() + 1;  // "<name>/"
    self().for_each_part([&](auto const& part, std::string const& prefix) {
      for (auto r : part.summary_rows()) {
        bool const nested = !r[0].empty() && r[0][0] == ' ';  // a row of a composite inside the part, or a cast
        r[0] = "  | " + (nested ? std::string() : prefix.substr(own)) + r[0];
        rows.push_back(std::move(r));
      }
    });
    return rows;
  }

  //! Forwards a model's gradients-final signal into the parts (see
  //! sequential_model::on_gradients_final): f(first), with `first` counted from this
  //! layer's first parameter, after each layer of each part.
  template <memory_space Space>
  void on_part_gradients_final(std::function<void(std::size_t)> f) {
    std::size_t offset = 0;
    self().for_each_part([&](auto& part, std::string const&) {
      std::function<void(std::size_t)> from_part;
      if (f) from_part = [f, offset](std::size_t first) { f(offset + first); };
      part.template on_gradients_final<Space>(std::move(from_part));
      offset += part.template parameters<Space>().size();
    });
  }

 private:
  Self& self() noexcept { return static_cast<Self&>(*this); }
  Self const& self() const noexcept { return static_cast<Self const&>(*this); }

  //! Runs append(layer) for each layer of each part that has it (append is
  //! SFINAE-friendly: its return type names the call), then prefixes the new entries'
  //! names with the part's.
  template <class Entries, class Append>
  void append_prefixed(Entries& out, Append append) {
    self().for_each_part([&](auto& part, std::string const& prefix) {
      part.for_each_layer([&](auto& l) {
        if constexpr (std::is_invocable_v<Append&, decltype(l)>) {
          std::size_t const first = out.size();
          append(l);
          for (std::size_t i = first; i < out.size(); ++i) entry_name(out[i]) = prefix + entry_name(out[i]);
        }
      });
    });
  }
};

}  // namespace mpx::detail
