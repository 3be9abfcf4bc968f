// The API fuzzer's fp8_layers group: mpx::dense and conv2d under every fp8 and fp4
// preset, and causal_self_attention under them (its core in bfloat16, or in fp8 under the per-tensor
// recipes), trained two steps on inputs that hold NaN, ±inf, ±0 and subnormals. The
// values stay moderate otherwise, so nothing can overflow and what fp8 training owes is
// exact (docs/fp8_training.md, "How the tests prove it"):
//   - A NaN in row r of x makes every output of row r NaN (in conv2d, of the pixels whose
//     windows hold it, so its claims are per image; in the attention, of token t
//     and of every later token of its sequence: each attends to it; the earlier tokens
//     stay finite where the core sums only the keys each attends to). An inf saturates to
//     the format's largest value under per-tensor scaling, as Transformer Engine's casts
//     do, and is NaN under the block recipes (a block's scale comes from its finite
//     values; the value itself cannot be represented).
//   - Every other row comes out finite, and so does every row of dx that no NaN reaches:
//     a bad row never makes another non-finite through a tensor-wide amax or scale (under
//     current scaling it leaves the previous scale in force for the step, which the
//     unit tests' references cover).
//   - After each step every delayed scale is finite and positive, and the second step,
//     on clean inputs, is finite everywhere: a NaN in one step's amax never poisons the
//     next.
//   - Every output element is written (outputs start as a poison NaN whose bits mpx never
//     makes) and nothing outside the outputs is.
// Values are compared with nothing else here: the float64 references of each recipe are
// in the unit tests (tests/layers/test_fp8_layers.cpp, test_fp8_attention.cpp).

#include "groups.hpp"

#include <mpx/core/policy.hpp>
#include <mpx/layers/attention.hpp>
#include <mpx/layers/conv2d.hpp>
#include <mpx/layers/dense.hpp>
#include <mpx/scaling/fp8_block_scaling.hpp>

#include <cmath>
#include <type_traits>

namespace mpx_fuzz::api {

namespace fp8_layers_detail {

using S = mpx::bfloat16;  // every fp8 preset stores bfloat16
using exec_type = mpx::host_executor;

template <class P>
constexpr bool block_recipe = mpx::is_block_recipe_v<std::remove_cvref_t<decltype(mpx::fp8_recipe_for<P>)>>;

//! A value of x: moderate ((1 + m/256) 2^e, e in [-6, 1], either sign), and where
//! `hostile` one in eight of what breaks numerics: NaN, ±inf, ±0, a subnormal, a small
//! normal.
S value(draw& d, bool hostile) {
  std::uint8_t const b = d.byte();
  if (hostile && b >= 224) {
    using traits = mpx::dtype_traits<S>;
    switch (b % 8) {
      case 0: return traits::quiet_nan();
      case 1: return traits::infinity();
      case 2: return mpx::cast<S>(-HUGE_VAL);
      case 3: return mpx::cast<S>(0.0);
      case 4: return mpx::cast<S>(-0.0);
      case 5: return mpx::detail::from_bits<S>(std::uint16_t{1});  // the smallest subnormal
      case 6: return mpx::cast<S>(-mpx::detail::to_double(traits::min_normal()));
      default: return mpx::cast<S>(std::ldexp(1.0, -40));
    }
  }
  double const mantissa = 1.0 + static_cast<double>(d.byte()) / 256.0;
  return mpx::cast<S>(((b & 0x80) ? -1.0 : 1.0) * std::ldexp(mantissa, static_cast<int>(b % 8) - 6));
}

//! A layer's width: often a multiple of 16 (what per-tensor fp8 products take on the
//! GPU, and so everywhere), else an awkward extent.
std::int64_t width(draw& d, std::int64_t max) {
  if (d.coin()) return 16 * (1 + static_cast<std::int64_t>(d.below(static_cast<std::size_t>(max / 16))));
  return std::max<std::int64_t>(d.extent(max), 1);
}

void assign(draw& d, guarded<S>& t, bool hostile) {
  std::vector<S> v(t.size());
  for (auto& x : v) x = value(d, hostile);
  t.assign(v);
}

//! Whether x turns into NaN where the layer casts it: NaN always, ±inf under a block
//! recipe (per-tensor casts saturate it).
bool becomes_nan(S x, bool block) {
  double const v = mpx::detail::to_double(x);
  return std::isnan(v) || (block && std::isinf(v));
}

//! What a row of an output must hold.
enum class row_due { finite, nan, written };

//! Row r of an output [rows, width]: every element finite or NaN as due, and written
//! (an element still holding the poison's bits was never written).
void require_row(call_name const& call, std::string_view what, guarded<S> const& t, std::size_t width, std::size_t r,
                 row_due due) {
  for (std::size_t c = 0; c < width; ++c) {
    S const v = t.data()[r * width + c];
    double const x = mpx::detail::to_double(v);
    std::string const where = call.str() + ": " + std::string(what) + "[" + std::to_string(r) + ", " +
                              std::to_string(c) + "]";
    if (mpx::bits(v) == mpx::bits(poison<S>())) fail(where + " was never written");
    if (due == row_due::nan && !std::isnan(x))
      fail(where + " is " + std::to_string(x) + ", NaN due (its row's input holds a NaN)");
    if (due == row_due::finite && !std::isfinite(x))
      fail(where + " is " + std::to_string(x) + " though no NaN reaches it (the inputs are moderate)");
  }
}
void require_row(call_name const& call, std::string_view what, guarded<S> const& t, std::size_t width, std::size_t r,
                 bool nan_due) {
  require_row(call, what, t, width, r, nan_due ? row_due::nan : row_due::finite);
}

void require_scale_sound(call_name const& call, mpx::fp8_scale_values const& v, std::string_view whose, int step) {
  if (!(std::isfinite(v.scale) && v.scale > 0 && std::isfinite(v.inverse_scale) && v.inverse_scale > 0))
    fail(call.str() + ": after step " + std::to_string(step) + " a scale of " + std::string(whose) + " is " +
         std::to_string(v.scale) + " (inverse " + std::to_string(v.inverse_scale) + "): finite and positive due");
}

//! Every per-tensor scale of the layer finite and positive, and its inverse too: the
//! delayed ones it lists for the precision guard, and under a per-tensor recipe the
//! three of a layer's own products (current scaling's among them). Block recipes keep no
//! scale between casts (their scales are checked where they are made: the unit tests).
template <class Layer>
void require_scales_sound(call_name const& call, Layer& layer, int step) {
  std::vector<mpx::fp8_scales_entry<exec_type>> entries;
  layer.template append_fp8_scales<exec_type>(entries);
  for (auto const& e : entries)
    for (auto const& w : e.watched) require_scale_sound(call, *w.state, e.name, step);
  if constexpr (requires { layer.fp8_core(); }) {  // attention's fp8 core: its six states, current ones too
    if (layer.fp8_core()) {
      auto const sc = layer.template attention_core_scales<exec_type>();
      for (auto const* v : {sc.qkv, sc.s, sc.o, sc.d_o, sc.dp, sc.dqkv}) require_scale_sound(call, *v, "the fp8 core", step);
    }
  }
  if constexpr (requires { layer.products(); }) {
    using products = std::remove_cvref_t<decltype(layer.products())>;
    if constexpr (products::tensorwise) {
      exec_type exec;
      using role = mpx::operand_role;
      require_scale_sound(call, layer.products().template scale<role::activation>(exec).values(exec), "x", step);
      require_scale_sound(call, layer.products().template scale<role::weight>(exec).values(exec), "the kernel", step);
      require_scale_sound(call, layer.products().template scale<role::gradient>(exec).values(exec), "dy", step);
    }
  }
}

//! What every step ends with: nothing written outside the outputs, nor into the
//! inputs' guards, and the layer's scales sound.
template <class Layer>
void end_of_step(call_name const& at, Layer& layer, int step, guarded<S> const& x, guarded<S> const& dy,
                 guarded<S> const& y, guarded<S> const& dx) {
  y.require_guards_intact(at, "y");
  dx.require_guards_intact(at, "dx");
  x.require_guards_intact(at, "x");
  dy.require_guards_intact(at, "dy");
  require_scales_sound(at, layer, step);
}

// ---- dense ----

template <class P>
void run_dense(draw& d, std::string_view policy) {
  exec_type exec;
  constexpr bool block = block_recipe<P>;
  std::int64_t const batch = std::max<std::int64_t>(d.extent(33), 1);
  std::int64_t const in = width(d, 300);
  std::int64_t const units = width(d, 160);
  mpx::activation const act = d.pick<mpx::activation>({mpx::activation::linear, mpx::activation::relu, mpx::activation::gelu});
  call_name call("dense<");
  call << policy << ">(" << units << ", " << act.name() << ") x " << shape_text<S>({batch, in});
  mpx::dense<P> layer(units, act);
  layer.set_name("hidden");
  // cuBLASLt's fp8 kernels tile a product's N by 16, so every fp8 layer does: its units
  // are refused when it is built, its input width before an input gradient.
  if (units % 16 != 0) {
    call << " (units not a multiple of 16)";
    require_refusal(call, {"hidden", "multiple of 16", "unit count"}, [&] { layer.build(exec, mpx::shape{in}, 1); });
    return;
  }
  require_accepted(call, [&] { layer.build(exec, mpx::shape{in}, 1 + d.byte()); });
  guarded<S> x(exec, {batch, in}, d), dy(exec, {batch, units}, d);
  assign(d, dy, false);
  if (in % 16 != 0) {
    guarded<S> y(exec, {batch, units}, d), dx(exec, {batch, in}, d);
    assign(d, x, false);
    call << " (input width not a multiple of 16)";
    require_accepted(call, [&] { layer.forward(exec, x.cview(), y.view(), true); });
    require_refusal(call, {"hidden", "multiple of 16", "input width"},
                    [&] { layer.backward(exec, x.cview(), y.cview(), dy.cview(), dx.view()); });
    dx.require_guards_intact(call, "dx");
    for (std::size_t i = 0; i < dx.size(); ++i)
      if (mpx::bits(dx.data()[i]) != mpx::bits(poison<S>())) fail(call.str() + ": refused, yet wrote dx");
    return;
  }
  for (int step = 1; step <= 2; ++step) {
    assign(d, x, step == 1);  // the second step's inputs are clean
    guarded<S> y(exec, {batch, units}, d), dx(exec, {batch, in}, d);
    call_name const at = call_name(call.str()) << " step " << step;
    require_accepted(at, [&] { layer.forward(exec, x.cview(), y.view(), true); });
    require_accepted(at, [&] { layer.backward(exec, x.cview(), y.cview(), dy.cview(), dx.view()); });
    for (std::size_t r = 0; r < static_cast<std::size_t>(batch); ++r) {
      bool nan_row = false;
      for (std::size_t k = 0; k < static_cast<std::size_t>(in); ++k) nan_row |= becomes_nan(x.data()[r * in + k], block);
      require_row(at, "y", y, static_cast<std::size_t>(units), r, nan_row);
      // dx = (dy · f'(z)) Wᵀ: a NaN row of z can reach its own row of dx only.
      if (!nan_row || act == mpx::activation::linear) require_row(at, "dx", dx, static_cast<std::size_t>(in), r, false);
    }
    end_of_step(at, layer, step, x, dy, y, dx);
  }
}

// ---- conv2d ----

//! conv2d: a NaN reaches the output pixels whose windows hold it, so the claims are per
//! image: an image without one comes out finite, and so does its dx.
template <class P>
void run_conv(draw& d, std::string_view policy) {
  exec_type exec;
  constexpr bool block = block_recipe<P>;
  mpx::conv2d_config config;
  config.filters = d.pick<std::int64_t>({16, 32, 16, 12});
  config.kernel_h = d.pick<std::int64_t>({1, 3, 2});
  config.kernel_w = d.pick<std::int64_t>({1, 3, 2});
  config.padding = d.coin() ? mpx::padding::same : mpx::padding::valid;
  config.stride_h = config.stride_w = d.pick<std::int64_t>({1, 2});
  config.activation = d.pick<mpx::activation>({mpx::activation::linear, mpx::activation::relu});
  std::int64_t const batch = d.pick<std::int64_t>({1, 2, 3});
  std::int64_t const height = d.pick<std::int64_t>({5, 3, 8, 7}), width = d.pick<std::int64_t>({5, 4, 9, 3});
  std::int64_t const channels = d.pick<std::int64_t>({16, 3, 32, 8});
  call_name call("conv2d<");
  call << policy << ">(" << config.filters << ", " << config.kernel_h << "x" << config.kernel_w
       << (config.padding == mpx::padding::same ? ", same" : ", valid") << ", stride " << config.stride_h << ", "
       << config.activation.name() << ") x " << shape_text<S>({batch, height, width, channels});
  mpx::conv2d<P> layer(config);
  layer.set_name("image_conv");
  mpx::shape const in{height, width, channels};
  if (config.filters % 16 != 0) {  // N of its forward product
    call << " (filters not a multiple of 16)";
    require_refusal(call, {"image_conv", "multiple of 16", "filter count"}, [&] { layer.build(exec, in, 1); });
    return;
  }
  if (config.padding == mpx::padding::valid && (config.kernel_h > height || config.kernel_w > width)) return;
  require_accepted(call, [&] { layer.build(exec, in, 1 + d.byte()); });
  mpx::shape const out = layer.output_shape();
  std::vector<std::int64_t> const xs{batch, height, width, channels}, ys{batch, out[0], out[1], out[2]};
  guarded<S> x(exec, xs, d), dy(exec, ys, d);
  assign(d, dy, false);
  bool const dx_refused = config.kernel_h * config.kernel_w * channels % 16 != 0;  // N of dx's product
  std::size_t const image = static_cast<std::size_t>(height * width * channels);
  std::size_t const image_out = static_cast<std::size_t>(out.size());
  for (int step = 1; step <= 2; ++step) {
    assign(d, x, step == 1);
    guarded<S> y(exec, ys, d), dx(exec, xs, d);
    call_name const at = call_name(call.str()) << " step " << step;
    require_accepted(at, [&] { layer.forward(exec, x.cview(), y.view(), true); });
    if (dx_refused) {
      require_refusal(at, {"image_conv", "multiple of 16", "kernel taps x input channels"},
                      [&] { layer.backward(exec, x.cview(), y.cview(), dy.cview(), dx.view()); });
      require_accepted(at, [&] {  // a model's first layer: no dx
        layer.backward(exec, x.cview(), y.cview(), dy.cview(), mpx::tensor_view<S, mpx::host_space>{});
      });
    } else {
      require_accepted(at, [&] { layer.backward(exec, x.cview(), y.cview(), dy.cview(), dx.view()); });
    }
    for (std::size_t n = 0; n < static_cast<std::size_t>(batch); ++n) {
      bool clean = true;
      for (std::size_t i = 0; i < image; ++i) clean = clean && !becomes_nan(x.data()[n * image + i], block);
      row_due const due = clean ? row_due::finite : row_due::written;
      require_row(at, "y", y, image_out, n, due);
      if (!dx_refused) require_row(at, "dx", dx, image, n, due);
    }
    end_of_step(at, layer, step, x, dy, y, dx);
  }
}

// ---- causal_self_attention ----

template <class P>
void run_attention(draw& d, std::string_view policy) {
  exec_type exec;
  constexpr bool block = block_recipe<P>;
  mpx::causal_self_attention_config config;
  config.heads = d.pick<std::int64_t>({1, 2, 3});
  std::int64_t const head_width = d.pick<std::int64_t>({16, 64, 48, 1, 5, 8});
  std::int64_t const B = d.pick<std::int64_t>({1, 2, 3});
  std::int64_t const T = std::max<std::int64_t>(std::min<std::int64_t>(d.extent(33), 33), 1);
  std::int64_t const D = config.heads * head_width;
  config.dropout = d.pick({0.0f, 0.0f, 0.2f});
  config.fp8_attention = d.coin();
  call_name call("causal_self_attention<");
  call << policy << ">(" << config.heads << (config.dropout > 0 ? ", dropout 0.2" : "")
       << (config.fp8_attention ? ", fp8_attention" : "") << ") x " << shape_text<S>({B, T, D});
  if (block && config.fp8_attention) {  // the core's scales are per tensor: refused under a block recipe
    require_refusal(call, {"fp8_attention", "block-scaled"}, [&] { mpx::causal_self_attention<P> layer(config); });
    return;
  }
  mpx::causal_self_attention<P> layer(config);
  layer.set_name("token_mixer");
  if (D % 16 != 0) {  // its projections' units (3 D and D): refused when built
    call << " (width not a multiple of 16)";
    require_refusal(call, {"token_mixer", "multiple of 16", "width"}, [&] { layer.build(exec, mpx::shape{T, D}, 1); });
    return;
  }
  if (config.fp8_attention && d.byte() % 8 == 0) {  // a head wider than the fp8 core takes
    std::int64_t const wide = config.heads * (mpx::fp8_attention_max_head_width + 16);
    call << " built for width " << wide;
    require_refusal(call, {"token_mixer", std::to_string(mpx::fp8_attention_max_head_width)},
                    [&] { layer.build(exec, mpx::shape{T, wide}, 1); });
    return;
  }
  require_accepted(call, [&] { layer.build(exec, mpx::shape{T, D}, 1 + d.byte()); });
  guarded<S> x(exec, {B, T, D}, d), dy(exec, {B, T, D}, d);
  assign(d, dy, false);
  std::size_t const width = static_cast<std::size_t>(D), tokens = static_cast<std::size_t>(T);
  for (int step = 1; step <= 2; ++step) {
    assign(d, x, step == 1);
    guarded<S> y(exec, {B, T, D}, d), dx(exec, {B, T, D}, d);
    call_name const at = call_name(call.str()) << " step " << step;
    require_accepted(at, [&] { layer.forward(exec, x.cview(), y.view(), true); });
    require_accepted(at, [&] { layer.backward(exec, x.cview(), y.cview(), dy.cview(), dx.view()); });
    for (std::size_t b = 0; b < static_cast<std::size_t>(B); ++b) {
      // Token t of sequence b is reached by a NaN when any token up to t holds one. The
      // tokens before the first NaN: finite where the core sums only the keys a row
      // attends to (mpx's fp8 core); the unfused 16-bit core's O = P V is a whole product,
      // where a masked weight is an exact 0 and 0 · NaN is NaN, so a NaN in a later
      // token's V may reach them (docs/transformers.md), never another sequence.
      std::size_t first_nan = tokens;
      for (std::size_t t = 0; t < tokens && first_nan == tokens; ++t)
        for (std::size_t c = 0; c < width; ++c)
          if (becomes_nan(x.data()[(b * tokens + t) * width + c], block)) first_nan = t;
      bool const sequence_clean = first_nan == tokens;
      row_due const before = sequence_clean || layer.fp8_core() ? row_due::finite : row_due::written;
      for (std::size_t t = 0; t < tokens; ++t)
        require_row(at, "y", y, width, b * tokens + t, t >= first_nan ? row_due::nan : before);
      // The backward pass carries a NaN to every token of its sequence (dK and dV of
      // earlier tokens sum over the later ones), and to no other sequence.
      if (sequence_clean)
        for (std::size_t t = 0; t < tokens; ++t) require_row(at, "dx", dx, width, b * tokens + t, false);
    }
    end_of_step(at, layer, step, x, dy, y, dx);
  }
}

//! Calls f with the preset and its name.
template <class F>
void with_fp8_preset(draw& d, F&& f) {
  switch (d.below(6)) {
    case 0: f(std::type_identity<mpx::mixed_fp8>{}, "mixed_fp8"); break;
    case 1: f(std::type_identity<mpx::mixed_fp8_current>{}, "mixed_fp8_current"); break;
    case 2: f(std::type_identity<mpx::mixed_fp8_block>{}, "mixed_fp8_block"); break;
    case 3: f(std::type_identity<mpx::mixed_fp8_rowwise>{}, "mixed_fp8_rowwise"); break;
    case 4: f(std::type_identity<mpx::mixed_mxfp8>{}, "mixed_mxfp8"); break;
    default: f(std::type_identity<mpx::mixed_nvfp4>{}, "mixed_nvfp4"); break;
  }
}

}  // namespace fp8_layers_detail

void run_fp8_layers(draw& d) {
  using namespace fp8_layers_detail;
  std::uint8_t const layer = d.byte() % 3;
  with_fp8_preset(d, [&](auto p, std::string_view name) {
    using P = typename decltype(p)::type;
    if (layer == 1) run_attention<P>(d, name);
    else if (layer == 2) run_conv<P>(d, name);
    else run_dense<P>(d, name);
  });
}

}  // namespace mpx_fuzz::api
