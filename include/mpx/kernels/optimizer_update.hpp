// The optimizers' fused multi-tensor update (optim/optimizer.hpp holds the optimizers
// that plan and call it): one pass per dtype over value, gradient, float master weight
// and the rule's slots, which reads the gradient check's verdict where it runs and skips
// the step when it says so, and writes 16-bit results back rounded to nearest even or
// stochastically. One row body for both executors: a row is a chunk of a tensor list.
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/math.hpp>
#include <mpx/core/philox.hpp>
#include <mpx/core/stochastic_round.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/launch.hpp>
#include <mpx/kernels/multi_tensor.hpp>
#include <mpx/kernels/unscale_and_check.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace mpx::detail {

//! How update_elements writes a 16-bit result back: to nearest even, or stochastically
//! with Philox draws keyed by the seed and counted by (element, parameter, step).
struct weight_rounding {
  bool stochastic = false;
  std::uint64_t seed = 0;
  //! Index of the table's first parameter among the optimizer's parameters of its dtype,
  //! dtype in the top byte: the `parameter` word of the counter.
  std::uint32_t first_stream = 0;

  //! 4 random words for elements 4q .. 4q + 3 of parameter `stream` at step `step`.
  [[nodiscard]] MPX_HD philox_counter draws(std::uint64_t step, std::uint32_t stream, std::uint64_t q) const noexcept {
    return philox4x32_10(
        philox_counter{{static_cast<std::uint32_t>(q), static_cast<std::uint32_t>(q >> 32), stream,
                        static_cast<std::uint32_t>(step)}},
        philox_key{{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32) ^
                                                          static_cast<std::uint32_t>(step >> 32)}});
  }
};

//! The rounding of one table's updates: where its random draws start.
struct rounding_position {
  std::uint64_t step;     // the step being applied, 1, 2, ...
  std::uint32_t stream;   // the parameter
  std::size_t element0;   // index of value[0] within the parameter
};

//! Updates elements [i, i + N) of one parameter: the float master weight (the value
//! itself for float parameters; none when master is null), the rule's slots, and the
//! stored value.
template <int N, class T, class Rule>
MPX_HD inline void update_elements(Rule const& rule, typename Rule::constants const& c, float factor, std::size_t i,
                                   T* value, T const* gradient, float* master, float* const* slot,
                                   weight_rounding const& rounding = {}, rounding_position const& at = {}) {
  constexpr int slots = Rule::slots;
  auto const g = *reinterpret_cast<aligned_vector<T, N> const*>(gradient + i);
  aligned_vector<float, N> w;
  if constexpr (std::is_same_v<T, float>) {
    w = *reinterpret_cast<aligned_vector<float, N> const*>(value + i);
  } else if (master) {
    w = *reinterpret_cast<aligned_vector<float, N> const*>(master + i);
  } else {
    auto const v = *reinterpret_cast<aligned_vector<T, N> const*>(value + i);
    MPX_UNROLL
    for (int k = 0; k < N; ++k) w.v[k] = cast<float>(v.v[k]);
  }
  // Value-initialised: a slot the rule does not use (SGD without momentum) is never
  // loaded, and is still copied below.
  aligned_vector<float, N> s[slots > 0 ? slots : 1] = {};
  for (int j = 0; j < slots; ++j)
    if (rule.uses_slot(j)) s[j] = *reinterpret_cast<aligned_vector<float, N> const*>(slot[j] + i);
  aligned_vector<T, N> out;
  [[maybe_unused]] philox_counter r{};
  MPX_UNROLL
  for (int k = 0; k < N; ++k) {
    float sk[slots > 0 ? slots : 1] = {};
    for (int j = 0; j < slots; ++j) sk[j] = s[j].v[k];
    rule(c, w.v[k], mul_rn(cast<float>(g.v[k]), factor), sk);
    for (int j = 0; j < slots; ++j) s[j].v[k] = sk[j];
    if constexpr (std::is_same_v<T, bfloat16> || std::is_same_v<T, half>) {
      if (rounding.stochastic) {
        std::uint64_t const e = at.element0 + i + static_cast<std::size_t>(k);
        if (k == 0 || e % 4 == 0) r = rounding.draws(at.step, at.stream, e / 4);
        out.v[k] = stochastic_round<T>(w.v[k], r.word(e % 4));
        continue;
      }
    }
    out.v[k] = cast<T>(w.v[k]);
  }
  for (int j = 0; j < slots; ++j)
    if (rule.uses_slot(j)) *reinterpret_cast<aligned_vector<float, N>*>(slot[j] + i) = s[j];
  if constexpr (!std::is_same_v<T, float>)
    if (master) *reinterpret_cast<aligned_vector<float, N>*>(master + i) = w;
  *reinterpret_cast<aligned_vector<T, N>*>(value + i) = out;
}

//! Pointers in a table row: value, gradient, master (the value for a float parameter,
//! null for a 16-bit one without master weights), then the rule's slots.
inline constexpr int fixed_lists = 3;

//! One step of the rule over one chunk of a table of dtype T: a row body of
//! for_each_row (a block's threads share the chunk on the GPU; the host emulates them).
//! Skipped when the verdict (may be null) found a non-finite gradient; `steps` (the
//! steps applied so far, in the executor's memory) is read where the update runs.
template <class T, class Rule, int Lists>
struct optimizer_update_chunk {
  tensor_table<Lists> table;
  Rule rule;
  std::uint64_t const* steps;
  gradient_summary const* verdict;
  weight_rounding rounding;

  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t chunk) const {
    // The verdict is one value for the whole pass: every chunk returns, or none does.
    if (verdict && verdict->found_nonfinite) return;
    float const factor = verdict ? verdict->gradient_factor : 1.0f;
    std::uint64_t const step = *steps + 1;
    auto const c = rule.at(step);
    chunk_location const loc = locate_chunk(table, static_cast<std::uint32_t>(chunk));
    T* const value = static_cast<T*>(table.data[0][loc.tensor]) + loc.begin;
    T const* const gradient = static_cast<T const*>(table.data[1][loc.tensor]) + loc.begin;
    float* const master =
        table.data[2][loc.tensor] ? static_cast<float*>(table.data[2][loc.tensor]) + loc.begin : nullptr;
    constexpr int slots = Lists - fixed_lists;
    constexpr int width = vector_width<T, float>;
    float* slot[slots > 0 ? slots : 1];
    bool aligned = vector_aligned<width>(value, gradient, master);
    for (int j = 0; j < slots; ++j) {
      float* const list = static_cast<float*>(table.data[fixed_lists + j][loc.tensor]);
      slot[j] = list ? list + loc.begin : nullptr;  // (a tensor without this slot: nothing to offset)
      aligned = aligned && vector_aligned<width>(slot[j]);
    }
    rounding_position const at{step, rounding.first_stream + loc.tensor, loc.begin};
    // Several pointers: vectorised only when all start on a boundary (the float master and
    // slots always do; a 16-bit value carved out of a packed buffer may not). The
    // arithmetic is per element, so the vectors change no bits.
    for_each_in_chunk<width>(lanes, loc.count, 0, aligned, [&](auto w, std::size_t i) {
      update_elements<decltype(w)::value>(rule, c, factor, i, value, gradient, master, slot, rounding, at);
    });
  }
};

//! One step of the rule over a table of one dtype T, host or CUDA (see
//! optimizer_update_chunk): one row of for_each_row per chunk of the table.
template <class T, class Exec, class Rule, int Lists>
void optimizer_update_pass(Exec const& exec, tensor_table<Lists> const& table, Rule const& rule,
                           std::uint64_t const* steps, gradient_summary const* verdict, weight_rounding const& rounding) {
  using body = optimizer_update_chunk<T, Rule, Lists>;
  static_assert(sizeof(body) + sizeof(std::size_t) <= kernel_parameter_limit,
                "optimizer_update_chunk's parameters exceed what CUDA 12.1+ accepts");
  for_each_row(exec, table.blocks(), multi_tensor_chunk, body{table, rule, steps, verdict, rounding});
}

//! ++*steps.
struct advance_count {
  std::uint64_t* steps;
  MPX_HD void operator()() const { ++*steps; }
};

//! ++*steps where the executor computes, in stream order.
template <class Exec>
void advance_step_count(Exec const& exec, std::uint64_t* steps) {
  run_once(exec, advance_count{steps});
}

}  // namespace mpx::detail
