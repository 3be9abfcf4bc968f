// mpx::data_parallel: one replica of a data-parallel job. Each rank trains the same
// model on its own shard of every batch; after the backward pass the gradients are
// averaged over the ranks, in buckets, through a communicator (MPI between host
// processes, NCCL between GPUs), and every rank then takes the same step.
//
// Why every rank skips the same steps and holds the same loss scale, by construction:
// the non-finite finding rides in the gradient all-reduce itself. A NaN or inf in any
// rank's gradient makes the sum NaN or inf on every rank (IEEE addition keeps them), so
// every rank's unscale_and_check sees the same averaged gradients and reaches the same
// verdict; no extra round trip. Global-norm clipping likewise measures the averaged
// gradients, the same on every rank. Debug builds check it after each step.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/core/fnv1a.hpp>
#include <mpx/dist/communicator.hpp>
#include <mpx/dist/replica_hooks.hpp>
#include <mpx/exec/copy.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/optim/parameter.hpp>
#include <mpx/scaling/unscale_and_check.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx {

struct data_parallel_options {
  //! Gradients are all-reduced in buckets of about this many bytes (of the reduction's
  //! dtype): fewer, larger messages, and on the GPU room to overlap (PyTorch DDP: 25 MB).
  std::size_t bucket_bytes = std::size_t{25} << 20;
  //! true: half and bfloat16 gradients are summed in float (exact for a few ranks, never
  //! overflows: twice the bytes on the wire). false: summed in their own dtype, rounded
  //! after every addition, as NCCL does: half the bytes, but a sum of large finite half
  //! gradients can overflow to inf and skip a step that the average would not have.
  bool reduce_in_float = true;
  //! After each step, all ranks compare their loss scale and verdict (one small
  //! collective that waits for the step): on in debug builds.
#ifdef NDEBUG
  bool check_replicas_agree = false;
#else
  bool check_replicas_agree = true;
#endif
};

namespace ops {
//! The average over `replicas` of a sum, rounded once into the gradient's dtype.
template <class T>
struct average_of_sum {
  float replicas;
  template <class S>
  MPX_HD T operator()(S sum) const noexcept {
    return cast<T>(cast<float>(sum) / replicas);
  }
};
}  // namespace ops

namespace detail {

//! A 64-bit value as two doubles that hold it exactly (for all_gather_values).
inline std::pair<double, double> as_two_doubles(std::uint64_t h) {
  return {static_cast<double>(h >> 32), static_cast<double>(h & 0xffffffffu)};
}

template <class Space>
std::string describe(parameter<Space> const& p) {
  return p.name + " " + std::string(to_string(p.value.dtype())) + " " + p.value.shape().to_string();
}

}  // namespace detail

//! The data-parallel side of one replica: built once after the model and its optimizer,
//! on every rank, with the same model.
//!
//!   mpx::mpi_environment mpi(argc, argv);
//!   mpx::mpi_communicator comm;
//!   auto model = ...; auto opt = mpx::loss_scale_optimizer(...);
//!   mpx::data_parallel dp(exec, comm, opt);          // checks the models, copies rank 0's weights
//!   mpx::fit(exec, model, opt, train, {.replicas = dp.hooks()});
template <communicator Comm>
class data_parallel {
 public:
  using executor_type = typename Comm::executor_type;
  using space = typename Comm::space;

  //! `optimizer` is an mpx optimizer or a loss_scale_optimizer around one. Refuses
  //! (mpx::shape_error, on every rank) models whose parameter lists differ between ranks,
  //! then broadcasts rank 0's parameters (and refreshes the master weights).
  template <class Optimizer>
  data_parallel(executor_type const& exec, Comm& comm, Optimizer& optimizer, data_parallel_options options = {})
      : comm_(&comm), options_(options) {
    auto& core = inner(optimizer);
    core.require_parameters_alive();  // before the broadcast writes into them
    params_ = core.parameters();
    gradients_ = &core.gradients();
    if constexpr (requires { optimizer.scaler().scale(exec); }) {
      read_scale_ = [&optimizer](executor_type const& e) { return static_cast<double>(optimizer.scaler().scale(e)); };
    }
    refuse_different_models();
    for (auto& p : params_) comm_->broadcast(exec, p.value, 0);
    core.reload_master_weights(exec);
    plan_buckets(exec);
  }

  [[nodiscard]] int rank() const noexcept { return comm_->rank(); }
  [[nodiscard]] int replicas() const noexcept { return comm_->size(); }
  [[nodiscard]] Comm& communicator() const noexcept { return *comm_; }
  [[nodiscard]] std::size_t buckets() const noexcept { return buckets_.size(); }
  //! Buckets whose all-reduce has started this step (before all_reduce_gradients).
  [[nodiscard]] std::size_t buckets_started() const noexcept {
    return static_cast<std::size_t>(std::count_if(buckets_.begin(), buckets_.end(), [](auto const& b) { return b.started; }));
  }
  [[nodiscard]] data_parallel_options const& options() const noexcept { return options_; }

  //! Replaces every rank's gradients by their average over the ranks. Call it after the
  //! backward pass and before the optimizer step, on every rank. Buckets whose
  //! all-reduce gradients_final_from already started are only finished.
  void all_reduce_gradients(executor_type const& exec) {
    for (auto& b : buckets_)
      if (!b.started) start(exec, b);
    if constexpr (requires { comm_->finish_all_reduces(exec); }) comm_->finish_all_reduces(exec);
    for (auto& b : buckets_) {
      average(exec, b);
      b.started = false;
    }
  }

  //! Forgets the all-reduces an abandoned step started (a step that threw after
  //! gradients_final_from), after waiting for those in flight, so the next step starts
  //! every bucket anew. Never throws: it runs while an exception unwinds the step.
  void abandon_step(executor_type const& exec) noexcept {
    if (buckets_started() == 0) return;
    try {
      if constexpr (requires { comm_->finish_all_reduces(exec); }) comm_->finish_all_reduces(exec);
    } catch (...) {  // the step's own exception is the one to report
    }
    for (auto& b : buckets_) b.started = false;
  }

  //! During the backward pass: the gradients from `first` on (in the optimizer's order)
  //! are final. Starts the all-reduce of every bucket that holds only such gradients; on
  //! a GPU it runs while the earlier layers' backward does.
  void gradients_final_from(executor_type const& exec, std::size_t first) {
    for (auto& b : buckets_) {  // the last parameters' buckets come first
      if (b.started) continue;
      if (b.members.back().index < first) break;
      start(exec, b);
    }
  }

  //! Throws mpx::error on every rank when the ranks hold different loss scales or
  //! reached different verdicts in the last step (what data_parallel makes impossible;
  //! a check for debug builds and tests). Synchronises.
  void check_replicas_agree(executor_type const& exec) {
    gradient_summary const s = gradients_->summary(exec);
    double const mine[2] = {read_scale_ ? read_scale_(exec) : 0.0, static_cast<double>(s.found_nonfinite)};
    auto const all = comm_->all_gather_values(mine);
    for (int r = 1; r < comm_->size(); ++r) {
      auto const at = static_cast<std::size_t>(2 * r);
      if (all[at] != all[0] || all[at + 1] != all[1])
        detail::fail<error>("data_parallel::check_replicas_agree",
                            "the replicas drifted apart: rank 0 has loss scale " + detail::to_text(all[0]) +
                                (all[1] != 0 ? " and skipped" : " and stepped") + ", rank " + std::to_string(r) +
                                " has " + detail::to_text(all[at]) + (all[at + 1] != 0 ? " and skipped" : " and stepped"));
    }
  }

  //! A checksum of this rank's parameter bytes. Synchronises.
  [[nodiscard]] std::uint64_t parameter_checksum(executor_type const& exec) const {
    std::uint64_t h = detail::fnv1a({});
    for (auto const& p : params_) {
      auto const bytes = tensor_view<std::uint8_t const, space>(static_cast<std::uint8_t const*>(p.value.data()),
                                                                shape{static_cast<std::int64_t>(p.value.size_bytes())});
      auto const host = to_host(exec, bytes);
      h = detail::fnv1a(std::as_bytes(std::span<std::uint8_t const>(host.data(), host.size())), h);
    }
    return h;
  }

  //! Throws mpx::error on every rank unless every rank holds the same parameters, bit
  //! for bit (after a resume, say). Synchronises.
  void check_parameters_agree(executor_type const& exec) {
    auto const [hi, lo] = detail::as_two_doubles(parameter_checksum(exec));
    double const mine[2] = {hi, lo};
    auto const all = comm_->all_gather_values(mine);
    std::vector<int> differ;
    for (int r = 1; r < comm_->size(); ++r)
      if (all[2 * static_cast<std::size_t>(r)] != all[0] || all[2 * static_cast<std::size_t>(r) + 1] != all[1])
        differ.push_back(r);
    if (!differ.empty())
      detail::fail<error>("data_parallel::check_parameters_agree",
                          detail::rank_list(differ) + " hold parameters other than rank 0's");
  }

  //! Runs `save` on rank 0 only (a checkpoint, a log), then every rank waits for it. A
  //! failure on rank 0 is reported on every rank (mpx::error), so none waits forever
  //! and none goes on believing the save happened.
  template <class F>
  void on_rank_zero(F&& save) {
    double failed[1] = {0};
    std::string why;
    if (comm_->rank() == 0) {
      try {
        std::forward<F>(save)();
      } catch (std::exception const& e) {
        failed[0] = 1;
        why = e.what();
      }
    }
    comm_->all_reduce_values(failed, reduce_op::max);
    if (failed[0] != 0)
      detail::fail<error>("data_parallel::on_rank_zero",
                          comm_->rank() == 0 ? "failed on rank 0: " + why : "failed on rank 0 (its message is in rank 0's output)");
  }

  //! What classifier_trainer and fit call when they run as this replica. Each hook acts
  //! on the executor of the step that calls it (replica_hooks passes it): a graph-mode
  //! step runs on the trainer's own stream, and its collectives must be ordered after its
  //! backward pass and before its optimizer step there (and be captured with it).
  [[nodiscard]] replica_hooks hooks() {
    replica_hooks h;
    h.rank = comm_->rank();
    h.count = static_cast<std::size_t>(comm_->size());
    if constexpr (requires { comm_->poll(); })  // an asynchronous transport (NCCL)
      h.before_step = [this] { comm_->poll(); };
    if constexpr (requires(executor_type const& e) { comm_->watch_replay(e); })  // a replay's collectives timed
      h.step_replayed = [this](step_executor at) { comm_->watch_replay(at.as<executor_type>()); };
    h.gradients_final = [this](step_executor at, std::size_t first) {
      gradients_final_from(at.as<executor_type>(), first);
    };
    h.after_backward = [this](step_executor at) { all_reduce_gradients(at.as<executor_type>()); };
    h.step_abandoned = [this](step_executor at) noexcept { abandon_step(at.as<executor_type>()); };
    if (options_.check_replicas_agree)
      h.after_step = [this](step_executor at) { check_replicas_agree(at.as<executor_type>()); };
    h.sum_values = [this](std::span<double> v) { comm_->all_reduce_values(v, reduce_op::sum); };
    h.max_values = [this](std::span<double> v) { comm_->all_reduce_values(v, reduce_op::max); };
    h.max_in_place = [this](step_executor at, float* x) {
      comm_->all_reduce(at.as<executor_type>(), tensor_view<float, memory_space_t<executor_type>>(x, shape{1}),
                        reduce_op::max);
    };
    return h;
  }
  //! The same hooks: `exec` is not kept (each hook runs on its step's executor). For the
  //! callers that name the executor, as `dp.hooks(exec)` reads.
  [[nodiscard]] replica_hooks hooks(executor_type const& /*exec*/) { return hooks(); }

 private:
  struct member {
    std::size_t index;     // in the gradient list
    std::int64_t offset;   // in the bucket, in elements
  };
  struct bucket {
    dtype_id dtype;        // on the wire
    std::int64_t elements = 0;
    bool in_place = false;        // one tensor already in the wire dtype: reduced where it is
    std::vector<member> members;  // by decreasing index
    std::size_t scratch_offset = 0;  // bytes into scratch_ (its own: reductions overlap)
    bool started = false;            // its all-reduce began this step
  };

  // The bucket's values on the wire: the tensor itself, or its own part of the scratch.
  template <class W>
  tensor_view<W, space> wire_of(bucket const& b) const {
    if (b.in_place) return (*gradients_)[b.members.front().index].template as<W>().reshape(shape{b.elements});
    return tensor_view<W, space>(reinterpret_cast<W*>(scratch_.data() + b.scratch_offset), shape{b.elements});
  }

  template <class F>
  static void visit_wire(dtype_id d, F&& f) {
    visit_dtype(d, [&](auto t) {
      using W = decltype(t);
      if constexpr (std::is_same_v<W, float> || std::is_same_v<W, half> || std::is_same_v<W, bfloat16>) f(W{});
    });
  }

  // Packs the bucket (unless in place) and starts its sum over the ranks.
  void start(executor_type const& exec, bucket& b) {
    visit_wire(b.dtype, [&](auto w) {
      using W = decltype(w);
      auto const wire = wire_of<W>(b);
      if (!b.in_place)
        for (auto const& m : b.members) for_member(m, [&](auto g) { cast(exec, g, wire.flat(m.offset, g.size())); });
      if constexpr (requires { comm_->start_all_reduce(exec, wire, reduce_op::sum); })
        comm_->start_all_reduce(exec, wire, reduce_op::sum);
      else
        comm_->all_reduce(exec, wire, reduce_op::sum);
    });
    b.started = true;
  }

  // Each gradient of the bucket becomes its sum / ranks, rounded once into its dtype.
  void average(executor_type const& exec, bucket const& b) {
    float const n = static_cast<float>(comm_->size());
    visit_wire(b.dtype, [&](auto w) {
      using W = decltype(w);
      auto const wire = wire_of<W>(b);
      for (auto const& m : b.members)
        for_member(m, [&](auto g) {
          using G = typename decltype(g)::value_type;
          transform(exec, g, ops::average_of_sum<G>{n}, tensor_view<W const, space>(wire.flat(m.offset, g.size())));
        });
    });
  }

  template <class Optimizer>
  static auto& inner(Optimizer& o) {
    if constexpr (requires { o.optimizer().gradients(); }) return o.optimizer();
    else return o;
  }

  template <class F>
  void for_member(member const& m, F&& f) const {
    auto const& g = (*gradients_)[m.index];
    visit_dtype(g.dtype(), [&](auto t) {
      using T = decltype(t);
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16>)
        f(g.template as<T>().reshape(shape{static_cast<std::int64_t>(g.size())}));
    });
  }

  // Every rank describes its parameter list; a rank whose description differs from
  // rank 0's is named, with the first parameter that differs as this rank sees it.
  void refuse_different_models() {
    std::uint64_t whole = detail::fnv1a({});
    for (auto const& p : params_) {
      std::string const d = detail::describe(p) + ";";
      whole = detail::fnv1a(std::as_bytes(std::span<char const>(d.data(), d.size())), whole);
    }
    auto const [hi, lo] = detail::as_two_doubles(whole);
    double const mine[3] = {static_cast<double>(params_.size()), hi, lo};
    auto const all = comm_->all_gather_values(mine);
    std::vector<int> differ;
    for (int r = 1; r < comm_->size(); ++r) {
      auto const at = 3 * static_cast<std::size_t>(r);
      if (all[at] != all[0] || all[at + 1] != all[1] || all[at + 2] != all[2]) differ.push_back(r);
    }
    if (differ.empty()) return;
    std::string message = "the replicas' models differ from rank 0's at " + detail::rank_list(differ) +
                          " (every rank must build the same model: same layers, sizes and policies); rank 0 has " +
                          std::to_string(static_cast<std::size_t>(all[0])) + " parameters";
    for (int r : differ)
      message += ", rank " + std::to_string(r) + " " + std::to_string(static_cast<std::size_t>(all[3 * static_cast<std::size_t>(r)]));
    message += ". This rank's (" + std::to_string(comm_->rank()) + "): ";
    for (std::size_t i = 0; i < params_.size(); ++i) message += (i ? ", " : "") + detail::describe(params_[i]);
    detail::fail<shape_error>("data_parallel", message);
  }

  // Buckets in reverse parameter order (the backward pass finishes the last layers'
  // gradients first), each holding whole tensors of about bucket_bytes.
  void plan_buckets(executor_type const& exec) {
    for (std::size_t k = gradients_->size(); k-- > 0;) {
      auto const& g = (*gradients_)[k];
      detail::require_reducible("data_parallel", g.dtype());
      dtype_id const wire = options_.reduce_in_float ? dtype_id::float32 : g.dtype();
      auto const n = static_cast<std::int64_t>(g.size());
      bool const fits = !buckets_.empty() && buckets_.back().dtype == wire &&
                        static_cast<std::size_t>(buckets_.back().elements + n) * size_of(wire) <= options_.bucket_bytes;
      if (!fits) buckets_.push_back(bucket{wire, 0, false, {}});
      auto& b = buckets_.back();
      b.members.push_back(member{k, b.elements});
      b.elements += n;
    }
    std::size_t bytes = 0;
    for (auto& b : buckets_) {
      auto const& first = (*gradients_)[b.members.front().index];
      b.in_place = b.members.size() == 1 && first.dtype() == b.dtype;
      if (b.in_place) continue;
      b.scratch_offset = bytes;
      bytes += (static_cast<std::size_t>(b.elements) * size_of(b.dtype) + 255) / 256 * 256;  // aligned for any wire dtype
    }
    scratch_ = tensor<std::uint8_t, space>(exec, shape{static_cast<std::int64_t>(std::max<std::size_t>(bytes, 1))});
  }

  Comm* comm_;
  data_parallel_options options_;
  std::vector<parameter<space>> params_;
  gradient_list<executor_type>* gradients_ = nullptr;
  std::function<double(executor_type const&)> read_scale_;
  std::vector<bucket> buckets_;
  tensor<std::uint8_t, space> scratch_;
};

template <class Comm, class Optimizer>
data_parallel(typename Comm::executor_type const&, Comm&, Optimizer&, data_parallel_options = {}) -> data_parallel<Comm>;

}  // namespace mpx
