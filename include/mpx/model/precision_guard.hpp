// mpx::precision_guard: moves a tiered layer (mpx::tiered) one tier up, to a wider
// policy, when the evidence says its current one fails it, and says why. It is what a
// user otherwise does by hand after a diverged run: "attention overflows in float16;
// give it bfloat16".
//
// The evidence, gathered where the executor computes, without a host synchronisation:
//  - After every step the loss scaler skipped, the first tensor that holds NaN or inf,
//    in the order find_nonfinite reads them (the model's input; each layer's output in
//    forward order; then, backwards, each layer's weight gradients and input gradient),
//    names the layer that made non-finite values from finite ones. One pass over the
//    step's activations and gradients, which returns at once when the step was not
//    skipped, then a one-thread tally. (A data-parallel replica's weight gradients are
//    averaged during the backward pass: it reads its own before, every step, and the
//    scan reads a flag per gradient in their place.)
//      * A layer whose forward pass was first, `forward_overflows` times within `window`
//        steps, moves: no loss scale changes a forward pass, so the scaler cannot help.
//        (One transient overflow never moves anything.)
//      * A layer whose gradients were first while the loss scale was at its floor
//        (the scaler's min_scale; any scale for a static scaler), `stuck_overflows`
//        times, moves: the scaler has nothing left to give. Backward overflows above
//        the floor are the scaler's to handle and are only counted.
//  - After every step, each delayed fp8 scale (mpx::mixed_fp8): whether the step's amax
//    times the scale it was cast with passed the format's range, `fp8_saturation_factor`
//    times over (the cast clipped values: an outlier, or amax growth faster than the
//    history follows). A layer saturated in `fp8_saturations` steps within `window`
//    moves. A one-thread pass over the layers' few scales.
//
//  - With a shadow (classifier_trainer::shadow_every), a layer whose error against its
//    float32 twin passes `shadow_error` on `shadow_strikes` shadow steps moves.
// The evidence is read every `review_every` steps (one synchronisation), as a flag per
// step and layer that data-parallel replicas combine (a step counts once however many
// saw it; every replica moves the same layers at the same step), and each move is kept
// with its evidence in words. Layers not tiered are only reported. Moves back down, to
// try the cheaper tier again after a quiet spell, are optional (move_down_after).
#pragma once

#include <mpx/core/cast.hpp>
#include <mpx/core/checkpoint_file.hpp>
#include <mpx/core/config.hpp>
#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/for_each.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/kernels/step_record.hpp>
#include <mpx/layers/matrix_products.hpp>
#include <mpx/model/shadow.hpp>
#include <mpx/model/tiered.hpp>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx {

struct guard_options {
  //! Steps a layer's forward pass was the first to write NaN or inf (in steps the
  //! scaler skipped) within `window` steps that move it.
  std::size_t forward_overflows = 3;
  //! Steps its gradients were the first non-finite values with the loss scale at its
  //! floor, within `window` steps, that move it.
  std::size_t stuck_overflows = 3;
  //! Steps in which one of a layer's delayed fp8 scales saturated, within `window` steps,
  //! that move it. A cast saturated when the amax the step recorded, times the scale it
  //! was cast with, passed `fp8_saturation_factor` times the format's largest value. (An
  //! amax a little above the history's is normal under delayed scaling, and clips little:
  //! the default counts values clipped to half their size or less.)
  std::size_t fp8_saturations = 3;
  float fp8_saturation_factor = 2.0f;
  std::size_t window = 200;
  //! > 0: a shadow error (the worst of output, input gradient, weight gradients) above
  //! this, on `shadow_strikes` shadow steps since the layer's last move, moves it.
  double shadow_error = 0;
  std::size_t shadow_strikes = 2;
  //! Steps between reviews of the evidence (each synchronises once).
  std::size_t review_every = 25;
  //! > 0: a layer above its first tier (moved there by the guard, by hand or by a
  //! loaded checkpoint) moves back down one tier once it has run this many steps, since
  //! the guard's first review, in its tier with no evidence of any kind above against it
  //! (the cheaper tier is tried again). If it must move up again within as many steps
  //! as it waited, its wait doubles, so a layer that only trains in the higher tier
  //! settles there; after a longer stay below, the wait starts again from this value.
  //! 0, the default: moves are one-way.
  std::size_t move_down_after = 0;
};

//! One move, with its evidence.
struct guard_move {
  std::size_t step = 0;  //!< the review that made it (steps counted from 1); the next step runs in `to`
  std::string layer, from, to;
  std::string evidence;  //!< "3 of its forward passes under mixed_float16 were ..."
  [[nodiscard]] std::string text() const { return layer + ": " + evidence + "; now " + to; }
};

namespace detail {

//! One tensor the scan reads, and whose it is.
struct watched_tensor {
  void const* data = nullptr;
  std::uint64_t size = 0;
  std::uint64_t first_chunk = 0;  //!< chunks of guard_chunk elements before this tensor's
  std::uint32_t dtype = 0;
  std::uint32_t owner = 0;        //!< the layer's index, or guard_no_owner (the input, a cast)
  std::uint32_t backward = 0;     //!< 1: written by a backward pass
  std::uint32_t unused = 0;
};
inline constexpr std::uint64_t guard_chunk = 4096;
inline constexpr std::uint32_t guard_no_owner = 0xffffffffu;
//! The dtype of a watched "tensor" that is one flag (unsigned, nonzero: the gradient it
//! stands for held NaN or inf before a replica averaged it).
inline constexpr std::uint32_t guard_flag_dtype = 0xfffffff0u;

template <class T>
inline constexpr bool guard_watchable = std::is_same_v<T, half> || std::is_same_v<T, bfloat16> || std::is_same_v<T, float>;

MPX_HD inline bool finite_element(void const* data, std::uint32_t dtype, std::uint64_t i) noexcept {
  if (dtype == guard_flag_dtype) return static_cast<unsigned const*>(data)[i] == 0u;
  switch (static_cast<dtype_id>(dtype)) {
    case dtype_id::float16: return is_finite(static_cast<half const*>(data)[i]);
    case dtype_id::bfloat16: return is_finite(static_cast<bfloat16 const*>(data)[i]);
    case dtype_id::float32: return is_finite(static_cast<float const*>(data)[i]);
    default: return true;
  }
}

struct max_u32 {
  using value_type = unsigned;
  MPX_HD static unsigned identity() noexcept { return 0u; }
  MPX_HD unsigned operator()(unsigned a, unsigned b) const noexcept { return a > b ? a : b; }
};

//! The index of the tensor that chunk c belongs to: the last whose first chunk is <= c
//! (empty tensors are passed over).
MPX_HD inline unsigned tensor_of_chunk(watched_tensor const* table, unsigned count, std::uint64_t c) noexcept {
  unsigned lo = 0, hi = count;
  while (hi - lo > 1) {
    unsigned const mid = lo + (hi - lo) / 2;
    if (table[mid].first_chunk <= c) lo = mid;
    else hi = mid;
  }
  return lo;
}

//! Whether chunk c (of tensor t) holds only finite values.
MPX_HD inline bool finite_chunk(watched_tensor const& t, std::uint64_t c) noexcept {
  std::uint64_t const begin = (c - t.first_chunk) * guard_chunk;
  std::uint64_t const end = begin + guard_chunk < t.size ? begin + guard_chunk : t.size;
  for (std::uint64_t i = begin; i < end; ++i)
    if (!finite_element(t.data, t.dtype, i)) return false;
  return true;
}

//! Chunk c of the watched tensors: count - (its tensor's index) when it holds NaN or inf,
//! else 0 (so the maximum names the first such tensor). Nothing is read unless the step
//! was skipped. Tensor 0 is the model's input, given by value (it moves every step).
struct first_nonfinite_scan {
  watched_tensor const* table;
  watched_tensor input;
  unsigned count;
  step_record const* record;
  MPX_HD unsigned operator()(std::size_t c) const {
    if (record->skipped == 0) return 0u;
    unsigned const k = tensor_of_chunk(table, count, c);
    // A copy either way (a prvalue): choosing between the parameter's address and the
    // table's would put the parameter in local memory on the GPU.
    watched_tensor const t = k == 0 ? watched_tensor(input) : table[k];
    return finite_chunk(t, c) ? 0u : count - k;
  }
};

//! Chunk first_chunk + row of a replica's own parameter gradients (the model's order),
//! before the all-reduce replaces them by the average: NaN or inf sets the gradient's
//! flag, which first_nonfinite_scan reads in its place. A row body (for_each_row): the
//! chunk's lanes (a block on the GPU, reading it coalesced) test their elements and
//! combine the verdicts, so it costs about one read of the gradients. Runs every step (whether the step is skipped
//! is known only after the average).
struct own_gradient_scan {
  watched_tensor const* table;
  unsigned count;
  std::uint64_t first_chunk;
  unsigned* flags;  //!< [count]
  template <class Lanes>
  MPX_HD void operator()(Lanes const& lanes, std::size_t row) const {
    std::uint64_t const c = first_chunk + row;
    unsigned const k = tensor_of_chunk(table, count, c);
    watched_tensor const t = table[k];
    std::uint64_t const begin = (c - t.first_chunk) * guard_chunk;
    std::uint64_t const left = t.size - begin;
    unsigned const bad = lanes.reduce(left < guard_chunk ? left : guard_chunk, max_u32{}, [&](std::size_t i) {
      return finite_element(t.data, t.dtype, begin + i) ? 0u : 1u;
    });
    lanes.once([&] {
      if (bad) max_into(flags + k, 1u);  // one atomic per chunk, however many elements overflowed
    });
  }
};
struct into_slot {
  unsigned* slot;
  MPX_HD void operator()(unsigned v) const noexcept { max_into(slot, v); }
};

//! Where the tallies write, per review interval: a flag per (kind, step of the interval,
//! layer), so that replicas can combine them step by step (a maximum is an "or"), and a
//! count per layer of backward overflows above the floor (only reported).
//! slot[0] is the scan's result, slot[1] the step's index in the interval.
struct guard_marks {
  unsigned* flags;      //!< [3][steps][owners]: forward overflow, overflow at the floor, fp8 saturation
  unsigned* backward;   //!< [owners]
  unsigned* slot;       //!< [2]
  unsigned owners;
  unsigned steps;       //!< steps per interval (review_every)
  enum kind : unsigned { forward = 0, stuck = 1, saturated = 2 };
  MPX_HD void mark(unsigned k, unsigned owner) const {
    unsigned const step = slot[1] < steps ? slot[1] : steps - 1u;
    flags[(k * steps + step) * owners + owner] = 1u;
  }
};

//! After the scan: marks the first non-finite tensor's layer, clears the scan's slot and
//! ends the step (the last tally of a step).
struct tally_first_nonfinite {
  watched_tensor const* table;
  unsigned count;
  guard_marks marks;
  step_record const* record;
  float floor;
  MPX_HD void operator()() const {
    unsigned const s = marks.slot[0];
    marks.slot[0] = 0u;
    if (s != 0u && s <= count) {
      watched_tensor const& t = table[count - s];
      if (t.owner < marks.owners) {
        if (t.backward == 0u) {
          marks.mark(guard_marks::forward, t.owner);
        } else {
          ++marks.backward[t.owner];
          if (record->loss_scale <= floor) marks.mark(guard_marks::stuck, t.owner);
        }
      }
    }
    ++marks.slot[1];
  }
};

//! A delayed fp8 scale as the guard reads it after each step.
struct watched_fp8_scale {
  fp8_scale_values const* state = nullptr;
  float format_max = 0;
  float previous_scale = 0;  //!< the scale the step was cast with (0: not known yet)
  unsigned owner = 0;
};

//! A resumed run's first step: each watched scale as the saved run's last step left it
//! (the scale it will cast with, loaded with the layer's fp8 state).
struct resume_fp8_scales {
  watched_fp8_scale* scales;
  unsigned count;
  MPX_HD void operator()() const {
    for (unsigned i = 0; i < count; ++i) scales[i].previous_scale = scales[i].state->scale;
  }
};

//! After each step (before tally_first_nonfinite ends it): marks the layers one of whose
//! delayed fp8 casts saturated, then remembers each scale for the next step.
struct tally_fp8_saturation {
  watched_fp8_scale* scales;
  unsigned count;
  guard_marks marks;
  float factor;
  MPX_HD void operator()() const {
    for (unsigned i = 0; i < count; ++i) {
      watched_fp8_scale& w = scales[i];
      float const amax = w.state->last_amax;
      if (w.previous_scale > 0.0f && amax * w.previous_scale > w.format_max * factor && w.owner < marks.owners)
        marks.mark(guard_marks::saturated, w.owner);
      w.previous_scale = w.state->scale;
    }
  }
};

}  // namespace detail

template <memory_space Space>
class precision_guard {
 public:
  explicit precision_guard(guard_options options = {}) : options_(checked(options)) {}

  [[nodiscard]] guard_options const& options() const noexcept { return options_; }
  //! Every move so far, oldest first.
  [[nodiscard]] std::vector<guard_move> const& moves() const noexcept { return moves_; }

  //! Its state, for save_training_state given the trainer: the evidence in each layer's
  //! window, the flags of the steps since the last review, the waits of move_down_after
  //! and the moves, under sections named `prefix`..., so that a run resumed with it
  //! reviews and moves as the uninterrupted run would. Synchronises.
  template <executor Exec>
  void save(Exec const& exec, detail::checkpoint_writer& out, std::string const& prefix) const {
    out.add_value(prefix + "review_every", static_cast<std::uint64_t>(options_.review_every));
    out.add_value(prefix + "reviewed", static_cast<std::uint64_t>(reviewed_));
    std::string names;
    for (auto const& n : names_) names += n + "\n";
    out.add(prefix + "layers", detail::text_bytes(names));
    for (std::size_t o = 0; o < names_.size(); ++o) {
      evidence const& e = evidence_[o];
      descent const& d = descents_[o];
      auto const whole = [](std::size_t n) { return std::bit_cast<double>(static_cast<std::uint64_t>(n)); };  // exact
      std::vector<double> v = {e.backward_overflows, e.shadow_strikes, strikes_pending_[o], worst_shadow_[o],
                               whole(d.quiet_since), whole(d.wait), whole(d.came_down), whole(d.came_down_at)};
      for (auto const& r : e.recent) v.insert(v.end(), {whole(r.step), r.forward, r.stuck, r.saturated});
      out.add(prefix + "layer/" + std::to_string(o), std::as_bytes(std::span<double const>(v)));
    }
    if (!names_.empty()) {
      auto const marks = to_host(exec, marks_.view());
      auto const slot = to_host(exec, slot_.view());
      out.add(prefix + "marks", std::as_bytes(std::span<unsigned const>(marks.data(), marks.size())));
      out.add(prefix + "slot", std::as_bytes(std::span<unsigned const>(slot.data(), slot.size())));
    }
    out.add_value(prefix + "moves", static_cast<std::uint64_t>(moves_.size()));
    for (std::size_t i = 0; i < moves_.size(); ++i)
      out.add(prefix + "move/" + std::to_string(i),
              detail::text_bytes(std::to_string(moves_[i].step) + "\n" + moves_[i].layer + "\n" + moves_[i].from + "\n" +
                                 moves_[i].to + "\n" + moves_[i].evidence));
  }

  //! Reads what save wrote, checks it (mpx::checkpoint_error through `in`, before
  //! anything is kept) and returns what applies it: to this guard now, or, before its
  //! first step has named the layers, at that step (which refuses layers other than the
  //! saved ones with mpx::invalid_argument). A save of a guard that never ran a step
  //! leaves the guard as it is.
  [[nodiscard]] std::function<void()> read(detail::checkpoint_reader const& in, std::string const& prefix) {
    if (!names_.empty())
      detail::fail<invalid_argument>("mpx::precision_guard::read", "the guard has watched steps: load its state into "
                                                                   "a new guard");
    auto const every = in.value<std::uint64_t>(prefix + "review_every");
    if (every != options_.review_every)
      in.refuse("its precision guard reviewed every " + std::to_string(every) + " steps, this one every " +
                std::to_string(options_.review_every) + "; nothing was loaded");
    saved_state state;
    state.reviewed = in.value<std::uint64_t>(prefix + "reviewed") != 0;
    std::string const names = in.text(prefix + "layers");
    for (std::size_t at = 0; at < names.size();) {
      std::size_t const end = names.find('\n', at);
      if (end == std::string::npos) in.refuse("its precision guard's layer list is damaged; nothing was loaded");
      state.names.push_back(names.substr(at, end - at));
      at = end + 1;
    }
    std::size_t const owners = state.names.size();
    for (std::size_t o = 0; o < owners; ++o) {
      auto const bytes = in.section(prefix + "layer/" + std::to_string(o));
      std::size_t const n = bytes.size() / sizeof(double);
      if (bytes.size() % sizeof(double) != 0 || n < 8 || (n - 8) % 4 != 0)
        in.refuse("its precision guard's state of layer " + state.names[o] + " is damaged; nothing was loaded");
      std::vector<double> v(n);
      std::memcpy(v.data(), bytes.data(), bytes.size());
      auto whole = [&](std::size_t i) { return static_cast<std::size_t>(std::bit_cast<std::uint64_t>(v[i])); };
      auto count = [&](std::size_t i) {
        if (!(v[i] >= 0.0) || !std::isfinite(v[i]))
          in.refuse("its precision guard's state of layer " + state.names[o] + " holds a count of " +
                    detail::to_text(v[i]) + "; nothing was loaded");
        return v[i];
      };
      evidence e;
      e.backward_overflows = count(0);
      e.shadow_strikes = count(1);
      for (std::size_t i = 8; i < n; i += 4) e.recent.push_back({whole(i), count(i + 1), count(i + 2), count(i + 3)});
      state.windows.push_back(std::move(e));
      state.strikes_pending.push_back(count(2));
      state.worst_shadow.push_back(count(3));
      state.waits.push_back({whole(4), whole(5), whole(6) != 0, whole(7)});
    }
    if (owners) {
      std::size_t const marks = (3 * options_.review_every + 1) * owners;
      auto const m = in.section(prefix + "marks", marks * sizeof(unsigned));
      auto const sl = in.section(prefix + "slot", 2 * sizeof(unsigned));
      state.marks.resize(marks);
      state.slot.resize(2);
      std::memcpy(state.marks.data(), m.data(), m.size());
      std::memcpy(state.slot.data(), sl.data(), sl.size());
    }
    auto const moves = in.value<std::uint64_t>(prefix + "moves");
    if (moves > in.unread_sections().size())
      in.refuse("its precision guard claims " + std::to_string(moves) + " moves it does not hold; nothing was loaded");
    for (std::uint64_t i = 0; i < moves; ++i) {
      std::string const t = in.text(prefix + "move/" + std::to_string(i));
      std::vector<std::string> parts;
      for (std::size_t at = 0, k = 0; k < 4; ++k) {
        std::size_t const end = t.find('\n', at);
        if (end == std::string::npos) in.refuse("its precision guard's move " + std::to_string(i) + " is damaged; nothing was loaded");
        parts.push_back(t.substr(at, end - at));
        at = end + 1;
        if (k == 3) parts.push_back(t.substr(at));
      }
      std::uint64_t step = 0;
      auto const [end, error] = std::from_chars(parts[0].data(), parts[0].data() + parts[0].size(), step);
      if (error != std::errc{} || end != parts[0].data() + parts[0].size())
        in.refuse("its precision guard's move " + std::to_string(i) + " names no step; nothing was loaded");
      state.moves.push_back({static_cast<std::size_t>(step), parts[1], parts[2], parts[3], parts[4]});
    }
    // Kept at the first watch, which names the layers (and refuses other ones).
    return [this, state = std::move(state)]() mutable {
      if (state.names.empty()) return;  // saved before its first step: nothing to carry
      moves_ = std::move(state.moves);
      pending_ = std::move(state);
    };
  }

  //! After a step's record is written (its `skipped` is the scan's gate): enqueues the
  //! scan of what the model's latest forward and backward wrote, and the tallies.
  //! `input` is the batch as the caller gave it; `floor` the loss scale's floor. As a
  //! data-parallel replica (`replica`), the parameter gradients are the replicas'
  //! average by now: the scan reads what scan_own_gradients found in this replica's own.
  template <executor Exec, class Model, class T>
  void watch(Exec const& exec, Model& model, tensor_view<T const, Space> input, step_record const* record,
             float floor, bool replica = false) {
    table const& t = table_for(exec, model, static_cast<void const*>(input.data()), replica);
    detail::watched_tensor in;
    if constexpr (detail::guard_watchable<T>) {
      in.data = input.data();
      in.size = std::min<std::uint64_t>(input.size(), t.input_size);  // table 0's chunks were counted for that
      in.dtype = static_cast<std::uint32_t>(dtype_id_of<T>);
    }
    in.owner = detail::guard_no_owner;
    for_each_index_into(exec, t.chunks, detail::max_u32{},
                        detail::first_nonfinite_scan{t.device.data(), in, t.count, record},
                        detail::into_slot{slot_.data()});
    if (fp8_count_) run_once(exec, detail::tally_fp8_saturation{fp8_.data(), fp8_count_, marks(), options_.fp8_saturation_factor});
    run_once(exec, detail::tally_first_nonfinite{t.device.data(), t.count, marks(), record, floor});
  }

  //! As a data-parallel replica, before each step's forward pass: no gradient of this
  //! step has been read yet, and the flags forget what a backward pass outside a step
  //! (probe_loss_scales, or one that threw) found.
  template <executor Exec>
  void begin_replica_step(Exec const& exec) {
    own_.cursor = own_.count;
    if (own_.count) fill(exec, own_.flags.view(), 0u);
  }

  //! As a data-parallel replica, during the backward pass, before the gradients of
  //! parameters `first` and later (the model's parameters() order) are averaged over the
  //! replicas, and with `first` = 0 before the rest are: notes which of this replica's own
  //! gradients hold NaN or inf. (Its weight gradients are the only evidence a replica
  //! loses to the all-reduce: a layer whose weight gradient overflows while its input
  //! gradient does not would otherwise be missed, and the next layer down blamed.) It
  //! reads each gradient once per step: about one more read of the gradients than the
  //! all-reduce and the optimizer make.
  template <executor Exec, class Model>
  void scan_own_gradients(Exec const& exec, Model& model, std::size_t first) {
    own_gradients_for(exec, model);
    if (first >= own_.cursor) return;
    std::uint64_t const begin = own_.chunk_at[first], end = own_.chunk_at[own_.cursor];
    own_.cursor = first;
    if (end > begin)
      for_each_row(exec, end - begin, detail::guard_chunk,
                   detail::own_gradient_scan{own_.table.data(), own_.count, begin, own_.flags.data()});
  }

  //! A shadow step's report (mpx::model_shadow): a layer whose error passed the bound
  //! gets a strike. Errors of values that were already non-finite do not count.
  void add_shadow(shadow_report const& report) {
    if (!(options_.shadow_error > 0)) return;
    if (names_.empty()) {  // before the first watch() named the layers: counted then
      early_shadows_.push_back(report);
      return;
    }
    for (auto const& e : report.layers) {
      double const worst = e.worst().value_or(0.0);
      if (e.read_nonfinite || !std::isfinite(worst) || !(worst > options_.shadow_error)) continue;
      std::size_t const o = owner_of(e.layer);
      if (o == npos) continue;
      strikes_pending_[o] += 1;
      worst_shadow_[o] = std::max(worst_shadow_[o], worst);
    }
  }

  //! Reads the evidence gathered since the last review (synchronises), combines it over
  //! the replicas step by step (`max_values` of per-step flags, an "or": a step counts
  //! once however many replicas saw it; empty for one process), and moves the layers it
  //! condemns. Every replica must call it at the same step, with the same options.
  //! Returns this review's moves.
  template <executor Exec, class Model>
  std::vector<guard_move> review(Exec const& exec, Model& model, std::size_t step,
                                 std::function<void(std::span<double>)> const& max_values, float floor) {
    std::size_t const owners = names_.size();
    if (owners == 0) return {};
    std::size_t const steps = options_.review_every, flags = 3 * steps * owners;
    // [flags | backward counts | shadow strikes], combined over the replicas by a maximum
    std::vector<double> v(flags + 2 * owners, 0.0);
    {
      auto const host = to_host(exec, marks_.view());
      for (std::size_t i = 0; i < flags + owners; ++i) v[i] = host.data()[i];
    }
    fill(exec, marks_.view(), 0u);
    fill(exec, slot_.view(), 0u);
    for (std::size_t o = 0; o < owners; ++o) v[flags + owners + o] = strikes_pending_[o];
    if (max_values) max_values(std::span<double>(v));
    std::fill(strikes_pending_.begin(), strikes_pending_.end(), 0.0);
    if (!reviewed_) {  // the waits count from the steps this first review covers
      reviewed_ = true;
      for (descent& d : descents_) d.quiet_since = step > steps ? step - steps : 0;
    }
    // A step where some replica's forward pass overflowed is that pass's evidence: a
    // gradient overflow on it, on any replica, counts against no layer.
    std::vector<bool> forward_step(steps, false);
    for (std::size_t i = 0; i < steps; ++i)
      for (std::size_t o = 0; o < owners; ++o) forward_step[i] = forward_step[i] || v[i * owners + o] > 0;
    for (std::size_t o = 0; o < owners; ++o) {
      evidence& e = evidence_[o];
      double kinds[3] = {0, 0, 0};  // steps of the interval with a forward overflow, one at the floor, a saturation
      for (std::size_t k = 0; k < 3; ++k)
        for (std::size_t i = 0; i < steps; ++i)
          kinds[k] += v[(k * steps + i) * owners + o] > 0 && !(k == 1 && forward_step[i]) ? 1 : 0;
      if (kinds[0] > 0 || kinds[1] > 0 || kinds[2] > 0) e.recent.push_back({step, kinds[0], kinds[1], kinds[2]});
      if (kinds[0] > 0 || kinds[1] > 0 || kinds[2] > 0 || v[flags + owners + o] > 0) descents_[o].quiet_since = step;
      e.backward_overflows += v[flags + o];
      e.shadow_strikes += v[flags + owners + o];
      while (!e.recent.empty() && e.recent.front().step + options_.window <= step) e.recent.erase(e.recent.begin());
    }
    std::vector<guard_move> made;
    for (auto& tiers : detail::model_tiers(model)) {
      std::size_t const o = owner_of(tiers.name);
      if (o == npos) continue;
      if (*tiers.active + 1 >= tiers.policies.size()) {
        if (auto down = move_down(o, tiers, step)) made.push_back(std::move(*down));
        continue;
      }
      evidence& e = evidence_[o];
      double forward = 0, stuck = 0, saturated = 0;
      for (auto const& r : e.recent) {
        forward += r.forward;
        stuck += r.stuck;
        saturated += r.saturated;
      }
      std::string const& from = tiers.policies[*tiers.active];
      std::string why;
      if (forward >= static_cast<double>(options_.forward_overflows)) {
        why = std::to_string(static_cast<long long>(forward)) + " of its forward passes under " + from +
              " wrote the first NaN or inf of their step in the last " + std::to_string(options_.window) +
              " steps (no loss scale changes a forward pass)";
      } else if (stuck >= static_cast<double>(options_.stuck_overflows)) {
        why = "its gradients were the first NaN or inf of " + std::to_string(static_cast<long long>(stuck)) +
              " steps with the loss scale at its floor (" + detail::to_text(floor) + ") in the last " +
              std::to_string(options_.window) + " steps under " + from;
      } else if (saturated >= static_cast<double>(options_.fp8_saturations)) {
        why = "its fp8 casts saturated (values beyond the delayed scale's range were clipped) in " +
              std::to_string(static_cast<long long>(saturated)) + " steps in the last " +
              std::to_string(options_.window) + " steps under " + from;
      } else if (options_.shadow_error > 0 && e.shadow_strikes >= static_cast<double>(options_.shadow_strikes)) {
        why = "its error against its float32 twin passed " + detail::to_text(static_cast<float>(options_.shadow_error)) +
              " on " + std::to_string(static_cast<long long>(e.shadow_strikes)) + " shadow steps under " + from +
              (worst_shadow_[o] > 0 ? " (worst " + detail::to_text(static_cast<float>(worst_shadow_[o])) + " here)" : "");
      }
      if (why.empty()) {
        if (auto down = move_down(o, tiers, step)) made.push_back(std::move(*down));
        continue;
      }
      *tiers.active += 1;
      made.push_back({step, tiers.name, from, tiers.policies[*tiers.active], why});
      e = evidence{};
      worst_shadow_[o] = 0;
      descent& d = descents_[o];
      if (d.came_down && step - d.came_down_at <= d.wait)  // the cheaper tier failed as soon as it was tried
        d.wait = d.wait > std::numeric_limits<std::size_t>::max() / 2 ? d.wait : 2 * d.wait;
      else if (d.came_down)  // it held there longer than it had waited above
        d.wait = options_.move_down_after;
      d.came_down = false;
      d.quiet_since = step;
    }
    moves_.insert(moves_.end(), made.begin(), made.end());
    return made;
  }

  //! Each layer's evidence so far (for reports and tests): within the window, its
  //! forward overflows, gradient overflows at the scale's floor and fp8 saturations; and
  //! all its backward overflows.
  struct layer_counts {
    std::string layer;
    double forward = 0, stuck = 0, backward = 0, saturated = 0;
  };
  [[nodiscard]] std::vector<layer_counts> counts() const {
    std::vector<layer_counts> out;
    for (std::size_t o = 0; o < names_.size(); ++o) {
      layer_counts c{names_[o], 0, 0, evidence_[o].backward_overflows};
      for (auto const& r : evidence_[o].recent) {
        c.forward += r.forward;
        c.stuck += r.stuck;
        c.saturated += r.saturated;
      }
      if (c.forward > 0 || c.stuck > 0 || c.backward > 0 || c.saturated > 0) out.push_back(c);
    }
    return out;
  }

  //! The moves in words, one per line; "" when none.
  [[nodiscard]] std::string summary() const {
    std::string out;
    for (auto const& m : moves_) out += "step " + std::to_string(m.step) + ": " + m.text() + "\n";
    return out;
  }

 private:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  struct table {
    std::uint64_t generation = 0;
    std::int64_t batch = 0;
    bool replica = false;
    std::vector<detail::watched_tensor> host;
    tensor<detail::watched_tensor, Space> device;
    unsigned count = 0;
    std::uint64_t chunks = 0;
    std::uint64_t input_size = 0;
  };
  struct interval {
    std::size_t step;
    double forward, stuck, saturated;
  };
  struct evidence {
    std::vector<interval> recent;
    double backward_overflows = 0;
    double shadow_strikes = 0;
  };
  //! A layer's way back down (guard_options::move_down_after): the step since which no
  //! evidence was held against it (its last move, or its last review with evidence), the
  //! steps it must wait, and whether its last move was down, at which step.
  struct descent {
    std::size_t quiet_since = 0;
    std::size_t wait = 0;
    bool came_down = false;
    std::size_t came_down_at = 0;
  };

  //! A saved state read by read(), kept until the layers are named when the guard had
  //! not run a step yet.
  struct saved_state {
    bool reviewed = false;
    std::vector<std::string> names;
    std::vector<evidence> windows;
    std::vector<double> strikes_pending, worst_shadow;
    std::vector<descent> waits;
    std::vector<unsigned> marks, slot;
    std::vector<guard_move> moves;
  };

  void take_host_state(saved_state& state) {
    reviewed_ = state.reviewed;
    evidence_ = std::move(state.windows);
    strikes_pending_ = std::move(state.strikes_pending);
    worst_shadow_ = std::move(state.worst_shadow);
    descents_ = std::move(state.waits);
  }
  template <executor Exec>
  void take_flags(Exec const& exec, saved_state const& state) {
    copy(exec, tensor_view<unsigned const, host_space>(state.marks.data(), marks_.shape()), marks_.view());
    copy(exec, tensor_view<unsigned const, host_space>(state.slot.data(), slot_.shape()), slot_.view());
    exec.synchronize();  // the host vectors go
  }

  static guard_options checked(guard_options o) {
    if (o.forward_overflows == 0 || o.stuck_overflows == 0 || o.fp8_saturations == 0 || o.window == 0 || o.review_every == 0 ||
        o.shadow_strikes == 0 || !(o.shadow_error >= 0) || !std::isfinite(o.shadow_error) ||
        !(o.fp8_saturation_factor >= 1.0f) || !std::isfinite(o.fp8_saturation_factor))
      detail::fail<invalid_argument>("mpx::precision_guard",
                                     "forward_overflows, stuck_overflows, fp8_saturations, window, review_every and "
                                     "shadow_strikes must be positive, shadow_error finite and >= 0 (0: off), and "
                                     "fp8_saturation_factor finite and >= 1");
    return o;
  }

  //! guard_options::move_down_after: the move back down one tier of a layer above its
  //! first tier that has waited its turn with no evidence against it, if due.
  std::optional<guard_move> move_down(std::size_t o, layer_tiers_entry& tiers, std::size_t step) {
    descent& d = descents_[o];
    if (options_.move_down_after == 0 || *tiers.active == 0 || step - d.quiet_since < d.wait) return std::nullopt;
    std::string const& from = tiers.policies[*tiers.active];
    std::string why = "no forward overflow, overflow at the scale's floor, fp8 saturation or shadow strike in its last " +
                      std::to_string(step - d.quiet_since) + " steps under " + from +
                      " (guard_options::move_down_after " + std::to_string(d.wait) + ")";
    *tiers.active -= 1;
    evidence_[o] = evidence{};
    worst_shadow_[o] = 0;
    d.came_down = true;
    d.came_down_at = step;
    d.quiet_since = step;
    return guard_move{step, tiers.name, from, tiers.policies[*tiers.active], std::move(why)};
  }

  std::size_t owner_of(std::string const& name) const {
    for (std::size_t o = 0; o < names_.size(); ++o)
      if (names_[o] == name) return o;
    return npos;
  }
  //! The layer an fp8 scale entry belongs to: "<layer>", "<layer>@<policy>" (a tier's),
  //! or "<layer>/<part>" (a layer's own sub-layer).
  static std::size_t owner_of_entry(std::string name, std::vector<std::string> const& names) {
    if (auto const at = name.find('@'); at != std::string::npos) name.resize(at);
    for (;;) {
      for (std::size_t o = 0; o < names.size(); ++o)
        if (names[o] == name) return o;
      auto const slash = name.rfind('/');
      if (slash == std::string::npos) return npos;
      name.resize(slash);
    }
  }

  //! The delayed fp8 scales of the model's layers, once (they live as long as the layers).
  template <class Exec, class Model>
  void watch_fp8_scales(Exec const& exec, Model& model, std::vector<std::string> const& names) {
    fp8_made_ = true;
    fp8_generation_ = model.buffer_generation();
    std::vector<detail::watched_fp8_scale> scales;
    for (auto const& entry : detail::model_fp8_scales<Exec>(model)) {
      std::size_t const o = owner_of_entry(entry.name, names);
      for (auto const& w : entry.watched)
        scales.push_back({w.state, w.format_max, 0.0f, o == npos ? detail::guard_no_owner : static_cast<unsigned>(o)});
    }
    fp8_count_ = static_cast<unsigned>(scales.size());
    if (scales.empty()) {
      fp8_ = {};
      return;
    }
    fp8_ = tensor<detail::watched_fp8_scale, Space>(exec, shape{static_cast<std::int64_t>(scales.size())});
    copy(exec, tensor_view<detail::watched_fp8_scale const, host_space>(scales.data(), fp8_.shape()), fp8_.view());
    exec.synchronize();  // `scales` goes out of scope
  }

  //! The watched tensors of the model's buffers for its latest step's batch: made once
  //! per (buffers, batch) and kept (a captured CUDA graph reads the one it was made with).
  template <class Exec, class Model>
  table const& table_for(Exec const& exec, Model& model, void const* caller_input, bool replica) {
    std::uint64_t const generation = model.buffer_generation();
    std::int64_t const batch = model.batch_in_flight();
    for (auto const& t : tables_)
      if (t.generation == generation && t.batch == batch && t.replica == replica) return t;
    refuse_capture(exec);
    if (replica) own_gradients_for(exec, model);
    // Tables of older buffers go (a graph that read one is captured again before it runs
    // anew); a current one is never freed under a captured graph.
    std::erase_if(tables_, [&](table const& old) { return old.generation != generation; });
    table t;
    t.generation = generation;
    t.batch = batch;
    t.replica = replica;
    std::vector<std::string> names;
    struct backward_part {
      std::size_t owner;
      bool block;
      std::string name;
      std::vector<detail::watched_tensor> tensors;
    };
    std::vector<backward_part> backward;
    // Forward tensors already watched (or the caller's batch, tensor 0): a residual block
    // re-reads its input, which is not the block's to answer for.
    std::vector<void const*> seen{caller_input};
    auto watched = [](auto const& view, std::uint32_t owner, bool in_backward) {
      detail::watched_tensor w;
      w.data = view.data();
      w.size = view.size();
      using value_type = typename std::remove_cvref_t<decltype(view)>::value_type;
      w.dtype = static_cast<std::uint32_t>(dtype_id_of<std::remove_const_t<value_type>>);
      w.owner = owner;
      w.backward = in_backward ? 1u : 0u;
      return w;
    };
    t.host.push_back({});  // 0: the model's input, given to each scan
    bool first = true;
    model.template visit_in_flight<Space>([&](std::string const& name, auto& layer, auto x, auto y, auto dy, auto dx,
                                              bool in_backward, bool /*began_here*/) {
      using X = std::remove_const_t<typename decltype(x)::value_type>;
      using Y = std::remove_const_t<typename decltype(y)::value_type>;
      using DY = std::remove_const_t<typename decltype(dy)::value_type>;
      using DX = std::remove_const_t<typename decltype(dx)::value_type>;
      auto const owner = static_cast<std::uint32_t>(names.size());
      names.push_back(name);
      if (first) {  // the model's first layer (or the first layer inside a first composite)
        t.input_size = x.size();
        first = false;
      }
      if constexpr (detail::guard_watchable<X>) {
        // A cast the model inserted (of its input, too: as find_nonfinite, not the layer's).
        if (std::find(seen.begin(), seen.end(), static_cast<void const*>(x.data())) == seen.end()) {
          t.host.push_back(watched(x, detail::guard_no_owner, false));
          seen.push_back(x.data());
        }
      }
      if constexpr (detail::guard_watchable<Y>) {
        t.host.push_back(watched(y, owner, false));
        seen.push_back(y.data());
      }
      if (!in_backward) return;
      backward_part part{owner, false, name, {}};
      using L = std::remove_cvref_t<decltype(layer)>;
      if constexpr (composite_layer<L>) part.block = true;
      if constexpr (detail::guard_watchable<DY>)
        if (dy.size()) part.tensors.push_back(watched(dy, detail::guard_no_owner, true));
      if constexpr (!composite_layer<L>) {
        std::vector<parameter<Space>> ps;
        layer.template append_parameters<Space>(ps);
        for (auto const& p : ps) {
          detail::watched_tensor w;
          w.data = p.gradient.data();
          w.size = p.gradient.size();
          w.dtype = static_cast<std::uint32_t>(p.gradient.dtype());
          w.owner = owner;
          w.backward = 1;
          if (replica) {  // the average by now: this replica's own flag instead
            auto const at = std::find(own_.gradients.begin(), own_.gradients.end(), w.data);
            if (at == own_.gradients.end()) continue;
            w.data = own_.flags.data() + (at - own_.gradients.begin());
            w.size = 1;
            w.dtype = detail::guard_flag_dtype;
          }
          part.tensors.push_back(w);
        }
      }
      if constexpr (detail::guard_watchable<DX>)
        if (dx.size()) part.tensors.push_back(watched(dx, owner, true));
      backward.push_back(std::move(part));
    });
    // Backwards: the layers in reverse, a residual block's own input gradient (the skip
    // path's sum) after its branch's layers, which ran before it.
    std::vector<backward_part const*> blocks;
    auto flush = [&](std::string const* next) {
      while (!blocks.empty() && (!next || !next->starts_with(blocks.back()->name + "/"))) {
        for (auto const& w : blocks.back()->tensors) t.host.push_back(w);
        blocks.pop_back();
      }
    };
    for (std::size_t i = backward.size(); i-- > 0;) {
      flush(&backward[i].name);
      if (backward[i].block) blocks.push_back(&backward[i]);
      else
        for (auto const& w : backward[i].tensors) t.host.push_back(w);
    }
    flush(nullptr);
    // Chunk offsets: tensor 0 (the input) counted at the size the table was made for.
    t.host[0].size = t.input_size;
    t.host[0].owner = detail::guard_no_owner;
    std::uint64_t chunks = 0;
    for (auto& w : t.host) {
      w.first_chunk = chunks;
      chunks += (w.size + detail::guard_chunk - 1) / detail::guard_chunk;
    }
    t.count = static_cast<unsigned>(t.host.size());
    t.chunks = chunks;
    t.device = tensor<detail::watched_tensor, Space>(exec, shape{static_cast<std::int64_t>(t.host.size())});
    copy(exec, tensor_view<detail::watched_tensor const, host_space>(t.host.data(), t.device.shape()), t.device.view());
    if (!names_.empty() && names != names_)
      detail::fail<invalid_argument>("mpx::precision_guard", "the model's layers changed: make one guard per model");
    if (fp8_generation_ != generation || !fp8_made_) watch_fp8_scales(exec, model, names);
    if (names_.empty()) {
      if (pending_ && pending_->names != names)
        detail::fail<invalid_argument>("mpx::precision_guard", "the loaded guard state names other layers than this "
                                                               "model's");
      names_ = names;
      evidence_.assign(names.size(), {});
      strikes_pending_.assign(names.size(), 0.0);
      worst_shadow_.assign(names.size(), 0.0);
      descents_.assign(names.size(), descent{0, options_.move_down_after, false, 0});
      marks_ = tensor<unsigned, Space>(exec, shape{static_cast<std::int64_t>((3 * options_.review_every + 1) * names.size())});
      fill(exec, marks_.view(), 0u);
      slot_ = tensor<unsigned, Space>(exec, shape{2});
      fill(exec, slot_.view(), 0u);
      if (pending_) {
        saved_state state = *std::exchange(pending_, std::nullopt);
        take_host_state(state);
        take_flags(exec, state);
        if (fp8_count_) run_once(exec, detail::resume_fp8_scales{fp8_.data(), fp8_count_});
      }
    }
    tables_.push_back(std::move(t));
    if (!early_shadows_.empty()) {
      for (auto const& r : std::exchange(early_shadows_, {})) add_shadow(r);
    }
    return tables_.back();
  }

  //! Refuses to make tables while a step is captured in a CUDA graph: a capture follows
  //! an eager step, which made them.
  template <executor Exec>
  static void refuse_capture(Exec const& exec) {
    if (exec.capturing())
      detail::fail<invalid_argument>("mpx::precision_guard", "a step is being captured for buffers the guard "
                                                             "has not seen run eagerly (run one eager step first)");
  }

  //! A replica's own parameter gradients, in the model's parameters() order, and a flag
  //! per gradient (see scan_own_gradients); made once per model buffers.
  struct own_gradients {
    bool made = false;
    std::uint64_t generation = 0;
    std::vector<void const*> gradients;
    std::vector<std::uint64_t> chunk_at;  //!< [count + 1]: gradient i's first chunk; the total last
    tensor<detail::watched_tensor, Space> table;
    tensor<unsigned, Space> flags;
    unsigned count = 0;
    std::size_t cursor = 0;  //!< gradients [cursor, count) were read this step
  };

  template <class Exec, class Model>
  void own_gradients_for(Exec const& exec, Model& model) {
    if (own_.made && own_.generation == model.buffer_generation()) return;
    refuse_capture(exec);
    own_gradients o;
    o.made = true;
    o.generation = model.buffer_generation();
    std::vector<detail::watched_tensor> host;
    std::uint64_t chunks = 0;
    for (auto const& p : model.template parameters<Space>()) {
      detail::watched_tensor w;
      w.data = p.gradient.data();
      w.size = p.gradient.size();
      w.dtype = static_cast<std::uint32_t>(p.gradient.dtype());
      w.first_chunk = chunks;
      o.gradients.push_back(w.data);
      o.chunk_at.push_back(chunks);
      chunks += (w.size + detail::guard_chunk - 1) / detail::guard_chunk;
      host.push_back(w);
    }
    o.chunk_at.push_back(chunks);
    o.count = static_cast<unsigned>(host.size());
    o.cursor = host.size();
    if (!host.empty()) {
      o.table = tensor<detail::watched_tensor, Space>(exec, shape{static_cast<std::int64_t>(host.size())});
      copy(exec, tensor_view<detail::watched_tensor const, host_space>(host.data(), o.table.shape()), o.table.view());
      o.flags = tensor<unsigned, Space>(exec, shape{static_cast<std::int64_t>(host.size())});
      fill(exec, o.flags.view(), 0u);
      exec.synchronize();  // `host` goes out of scope
    }
    own_ = std::move(o);
  }

  guard_options options_;
  std::vector<std::string> names_;  // the layers, in visit_in_flight's order (blocks too)
  std::vector<evidence> evidence_;
  std::vector<double> strikes_pending_, worst_shadow_;
  std::vector<descent> descents_;
  bool reviewed_ = false;
  std::vector<guard_move> moves_;
  std::vector<table> tables_;
  tensor<unsigned, Space> marks_, slot_;  // see detail::guard_marks

  detail::guard_marks marks() {
    auto const owners = static_cast<unsigned>(names_.size());
    auto const steps = static_cast<unsigned>(options_.review_every);
    return {marks_.data(), marks_.data() + 3 * steps * owners, slot_.data(), owners, steps};
  }
  tensor<detail::watched_fp8_scale, Space> fp8_;
  unsigned fp8_count_ = 0;
  bool fp8_made_ = false;
  std::uint64_t fp8_generation_ = 0;  // the model's buffers when the fp8 scales were found (a rebuild moves them)
  std::vector<shadow_report> early_shadows_;  // reports before the first watch
  std::optional<saved_state> pending_;  // a loaded state for the layers the first watch names
  own_gradients own_;                         // a replica's (see scan_own_gradients)
};

}  // namespace mpx
