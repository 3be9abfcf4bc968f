// What every typed layer shares: the placeholder for "the model's policy", the memory a
// layer owns once built, and the `layer` concept a model checks at compile time. (The
// activation a layer may fuse, mpx::activation, is one list in kernels/activation.hpp.)
//
// A layer is a value you construct from its configuration alone
// (`mpx::dense<mpx::mixed_float16> fc(128, mpx::activation::relu)`); `build(exec,
// sample_shape, seed)` then allocates and initialises its parameters where `exec`
// computes, and `reserve(exec, batch)` its per-batch workspace, so a training step
// allocates nothing. Shapes given to build are per sample (no batch axis), as Keras
// prints them; tensors given to forward and backward carry the batch axis first.
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/core/policy.hpp>
#include <mpx/core/shape.hpp>
#include <mpx/exec/executor.hpp>
#include <mpx/exec/tensor.hpp>
#include <mpx/kernels/elementwise.hpp>
#include <mpx/optim/parameter.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx {

//! A layer's policy when it should take the model's: `mpx::dense<>(128)` inside
//! `mpx::sequential<mpx::mixed_float16>(...)` is a `dense<mixed_float16>`.
//! Its member types only let such a layer be declared; building one is refused.
struct model_policy {
  using storage_type = float;
  using compute_type = float;
  using accumulate_type = float;
  using param_type = float;
  static constexpr std::string_view name = "(the model's policy)";
};

namespace detail {

//! Owns one tensor of T in whichever memory space the layer was built for, so a layer's
//! type does not depend on the executor. Move-only, like mpx::tensor.
template <class T>
class layer_tensor {
 public:
  layer_tensor() = default;

  template <executor Exec>
  void allocate(Exec const& exec, mpx::shape s) {
    using Space = memory_space_t<Exec>;
    auto t = std::make_unique<tensor<T, Space>>(exec, s);
    // Zeros, so that nothing a layer owns is ever read uninitialised: a gradient before
    // the first backward is 0, not whatever the allocator left there.
    mpx::fill(exec, *t, T{});
    data_ = t->data();
    shape_ = s;
    on_device_ = std::is_same_v<Space, device_space>;
    owner_ = std::unique_ptr<void, void (*)(void*)>(t.release(),
                                                    [](void* p) { delete static_cast<tensor<T, Space>*>(p); });
  }
  //! Allocates unless it already holds at least `s.size()` elements; then views them as
  //! s. Returns whether it allocated (the buffer moved).
  template <executor Exec>
  bool ensure(Exec const& exec, mpx::shape s) {
    bool const grow = !owner_ || capacity_ < s.size();
    if (grow) {
      allocate(exec, s);
      capacity_ = s.size();
    }
    shape_ = s;
    return grow;
  }

  [[nodiscard]] bool allocated() const noexcept { return owner_ != nullptr; }
  //! Where the memory is (nullptr before the first allocation), in whichever space: for
  //! tests that a buffer did not move.
  [[nodiscard]] void const* address() const noexcept { return data_; }
  [[nodiscard]] mpx::shape const& shape() const noexcept { return shape_; }
  [[nodiscard]] std::size_t size() const noexcept { return shape_.size(); }

  template <memory_space Space>
  [[nodiscard]] tensor_view<T, Space> view() const {
    require<Space>();
    return {data_, shape_};
  }
  template <memory_space Space>
  [[nodiscard]] tensor_view<T, Space> view(mpx::shape s) const {
    require<Space>();
    if (s.size() > capacity_)
      fail<shape_error>("layer workspace", "a view of shape " + s.to_string() + " needs " + std::to_string(s.size()) +
                                               " elements, but " + std::to_string(capacity_) +
                                               " were reserved (call reserve with the larger batch)");
    return {data_, s};
  }

 private:
  template <memory_space Space>
  void require() const {
    if (!owner_)
      fail<invalid_argument>("mpx layer", "used before it was built and reserved (call build, then reserve(exec, "
                                          "batch) for its workspace, or build the model)");
    if (on_device_ != std::is_same_v<Space, device_space>)
      fail<invalid_argument>("mpx layer", std::string("built in ") + (on_device_ ? "device" : "host") +
                                              " memory but used with an executor of " + std::string(Space::name));
  }

  std::unique_ptr<void, void (*)(void*)> owner_{nullptr, [](void*) {}};
  T* data_ = nullptr;
  mpx::shape shape_{0};
  std::size_t capacity_ = 0;
  bool on_device_ = false;
};

//! The static_assert every layer makes about its policy.
template <class P>
constexpr void require_layer_policy() {
  static_assert(!std::is_same_v<P, model_policy>,
                "this layer was given mpx::model_policy (or no policy) but is used outside a model that sets one: "
                "give it a policy, e.g. mpx::dense<mpx::mixed_float16>, or put it in "
                "mpx::sequential<mpx::mixed_float16>(...)");
  static_assert(policy_type<P>,
                "an mpx layer's template argument must be a policy: mpx::float32, mpx::mixed_float16, "
                "mpx::mixed_bfloat16 or an mpx::policy<Storage, Compute, Accumulate, Param>");
}

//! The static_assert of the layers whose products have no fp8 path (LSTM).
template <class P>
constexpr void require_products_without_fp8() {
  if constexpr (policy_type<P>)
    static_assert(!computes_in_fp8<P>,
                  "this layer (an LSTM) has no fp8 matrix products, but its policy computes in fp8 "
                  "(mpx::mixed_fp8): give it mpx::without_fp8<Policy>, e.g. "
                  "mpx::lstm<mpx::without_fp8<mpx::mixed_fp8>>(...), which keeps its products in bfloat16 "
                  "(Transformer Engine, too, runs only linear layers in fp8); mpx::dense, mpx::conv2d and the "
                  "projections of mpx::causal_self_attention run in fp8");
}

//! "dense_2: <what>" for a layer's errors.
inline std::string layer_op(std::string const& name, std::string_view what) { return name + ": " + std::string(what); }

//! The check of a layer's unit count when it is made (mpx::dense, mpx::lstm):
//! mpx::invalid_argument from `layer` unless units > 0.
inline void require_positive_units(std::string_view layer, std::int64_t units) {
  if (units <= 0) fail<invalid_argument>(layer, "units must be positive, got " + std::to_string(units));
}

//! Throws shape_error unless x has `batch` rows of the per-sample shape `sample`.
inline void require_batch_shape(std::string const& layer, std::string_view what, mpx::shape const& got,
                                mpx::shape const& sample) {
  bool ok = got.rank() == sample.rank() + 1 && got[0] > 0;
  for (std::size_t i = 0; ok && i < sample.rank(); ++i) ok = got[i + 1] == sample[i];
  if (!ok)
    fail<shape_error>(layer, std::string(what) + " has shape " + got.to_string() + ", expected [batch" +
                                 (sample.rank() ? ", " : "") + sample.to_string().substr(1) +
                                 (got.rank() >= 1 && got[0] == 0 ? " (the batch is empty)" : ""));
}

//! [batch, sample...] as one shape.
inline mpx::shape with_batch(std::int64_t batch, mpx::shape const& sample) {
  std::vector<std::int64_t> e{batch};
  for (std::size_t i = 0; i < sample.rank(); ++i) e.push_back(sample[i]);
  return mpx::shape(std::span<std::int64_t const>(e.data(), e.size()));
}

}  // namespace detail

//! What a layer's code shares: its name in the model ("dense_1"), the per-sample input
//! and output shapes it was built for, and the batch its workspace holds.
class layer_base {
 public:
  [[nodiscard]] std::string const& name() const noexcept { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }
  [[nodiscard]] mpx::shape const& input_shape() const noexcept { return input_shape_; }
  [[nodiscard]] mpx::shape const& output_shape() const noexcept { return output_shape_; }
  [[nodiscard]] bool built() const noexcept { return built_; }
  [[nodiscard]] std::int64_t reserved_batch() const noexcept { return reserved_batch_; }

 protected:
  void mark_built(mpx::shape in, mpx::shape out) {
    input_shape_ = in;
    output_shape_ = out;
    built_ = true;
  }
  void require_built(std::string_view what) const {
    if (!built_) detail::fail<invalid_argument>(name_, std::string(what) + " before build(exec, input_shape, seed)");
  }
  //! Checks x against the built input shape; returns the batch.
  std::int64_t check_input(mpx::shape const& x, mpx::shape const& y) const {
    require_built("forward");
    detail::require_batch_shape(name_, "input", x, input_shape_);
    detail::require_batch_shape(name_, "output", y, output_shape_);
    if (x[0] != y[0])
      detail::fail<shape_error>(name_, "input " + x.to_string() + " and output " + y.to_string() +
                                           " hold different batches");
    return x[0];
  }
  //! check_input, then grows the layer's workspace (self.reserve, the layer's own) when
  //! the batch is larger than the one it holds; returns the batch.
  template <class Layer, class Exec>
  std::int64_t check_input_and_reserve(Layer& self, Exec const& exec, mpx::shape const& x, mpx::shape const& y) {
    std::int64_t const batch = check_input(x, y);
    if (batch > reserved_batch_) self.reserve(exec, batch);
    return batch;
  }

  std::string name_;
  mpx::shape input_shape_{0};
  mpx::shape output_shape_{0};
  std::int64_t reserved_batch_ = 0;
  bool built_ = false;
};

namespace detail {

//! The member types mpx::sequential reads of a layer whose input and output are its
//! policy's storage dtype (most layers): `policy`, `config_type` (what its constructor
//! takes), `input_type` and `output_type`. Such a layer derives from it beside
//! layer_base; its own code names the dtype `typename Policy::storage_type`.
template <class Policy, class Config>
struct storage_dtype_layer {
  using policy = Policy;
  using config_type = Config;
  using input_type = typename Policy::storage_type;
  using output_type = input_type;
};

}  // namespace detail

//! What mpx::sequential asks of a layer (the built-in layers and a user's own):
//! a policy, the dtypes it reads and writes, a kind for summaries, and
//! build / reserve / forward / backward / parameters on host_executor.
template <class L>
concept layer = std::move_constructible<L> && requires(L& l, L const& cl, host_executor const& exec, shape const& s,
                                                       std::vector<parameter<host_space>>& params) {
  typename L::policy;
  typename L::input_type;
  typename L::output_type;
  { L::kind } -> std::convertible_to<std::string_view>;
  { cl.compute_output_shape(s) } -> std::same_as<shape>;
  l.build(exec, s, std::uint64_t{});
  l.reserve(exec, std::int64_t{});
  l.forward(exec, tensor_view<typename L::input_type const>{}, tensor_view<typename L::output_type>{}, true);
  l.backward(exec, tensor_view<typename L::input_type const>{}, tensor_view<typename L::output_type const>{},
             tensor_view<typename L::output_type const>{}, tensor_view<typename L::input_type>{});
  l.append_parameters(params);
  { cl.parameter_count() } -> std::convertible_to<std::size_t>;
  { cl.name() } -> std::convertible_to<std::string>;
  l.set_name(std::string{});
};

//! A layer made of whole models (mpx::residual's branch, mpx::repeat's copies): the
//! model's walks (visit_in_flight, trace, the shadow, the guard) go into its parts
//! through for_each_part(f), f(part, "<its name>/..."), rather than treating it as one
//! (and for_each_part_model(f), f(part), where no name is needed).
template <class L>
concept composite_layer = requires { requires L::composite; };

namespace detail {

//! The same layer, not built: a composite copies its parts, any other layer is made
//! again from its configuration (what mpx::repeat makes its copies with).
template <class L>
L unbuilt_copy(L const& layer) {
  if constexpr (requires { layer.unbuilt_copy(); }) return layer.unbuilt_copy();
  else return L(layer.config());
}

//! How many of a model's layer positions a layer takes when seeds are handed out (layer i
//! of a model is initialised from seed + 1000 * i): one, or what the layer says. A repeat
//! of n copies of a k-layer block takes n * k, so it initialises exactly as the n * k
//! layers written out would.
template <class L>
std::size_t seed_slots(L const& layer) {
  if constexpr (requires { layer.seed_slots(); }) return layer.seed_slots();
  else return 1;
}

}  // namespace detail

}  // namespace mpx

namespace mpx::detail {

//! A trainable tensor and its gradient, of one dtype and shape, allocated together and
//! handed to the optimizer as one mpx::parameter ("dense_1/kernel").
template <class T>
class trainable {
 public:
  template <executor Exec>
  void allocate(Exec const& exec, mpx::shape s) {
    value_.allocate(exec, s);
    gradient_.allocate(exec, s);
  }

  [[nodiscard]] mpx::shape const& shape() const noexcept { return value_.shape(); }
  //! 0 before it is allocated.
  [[nodiscard]] std::size_t size() const noexcept { return value_.size(); }
  template <memory_space Space>
  [[nodiscard]] tensor_view<T, Space> value() const { return value_.template view<Space>(); }
  template <memory_space Space>
  [[nodiscard]] tensor_view<T, Space> gradient() const { return gradient_.template view<Space>(); }

  //! Appends it as "<layer>/<what>" with its gradient, for the optimizer.
  template <memory_space Space>
  void append_to(std::vector<parameter<Space>>& out, std::string const& layer, std::string_view what) const {
    out.push_back({layer + "/" + std::string(what), value<Space>(), gradient<Space>()});
  }

 private:
  layer_tensor<T> value_, gradient_;
};

}  // namespace mpx::detail
