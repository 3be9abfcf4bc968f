// Causal self-attention at a transformer's sizes (1,024 to 4,096 tokens on the GPU),
// forward and forward + backward, through both of its paths in half and bfloat16:
//
//   fused    the fused attention the program registered (cuDNN's SDPA: the causal mask,
//            the scale and the softmax inside one kernel, the statistics in float, no
//            [tokens, tokens] tensor in memory); CUDA executor only;
//   unfused  two batched cuBLASLt products around the causal softmax, the logits and
//            probabilities written to memory: what the host executor always runs.
//
// Each row is the whole layer (query/key/value projection, attention, output projection),
// at a fixed 16,384 tokens a batch on the GPU (the batch shrinks as the sequence grows),
// with the device memory the layer holds after reserving for that batch: linear in the
// sequence when fused, quadratic when not (the fused attention's workspace, which the
// program keeps per stream, is reported once, apart).
//
//   transformer_bench [--executor host|cuda|all] [--repeat R] [--small] [--tokens T[,T...]]
//                     [--widths W[,W]] [--path fused|unfused|both] [--dropout P] [--fp8]
//                     [--nondeterministic]
//
// --widths picks among the two models (768: GPT-2 small's heads of 64; 1024: heads of
// 128), the wider first.
//
// --dropout P drops attention weights with probability P in the training forwards (inside
// the fused kernel where it runs): what dropout costs each path.
//
// --nondeterministic lets the fused backward sum dQ with atomics (the layer's
// deterministic = false), as PyTorch's SDPA does by default: what mpx's bit-for-bit
// backward costs beside it.
//
// --fp8 times the layer under mpx::mixed_fp8 instead: the projections in fp8 with the
// attention between them in bfloat16 ("fp8 proj"), and the attention in fp8 too
// ("fp8 all": fp8_attention, cuDNN's fp8 SDPA where it runs, mpx's fp8 core elsewhere).
//
// TFLOP/s counts the model's products once: the two projections (8 N D^2 for N tokens of
// width D) and, under the causal mask, half of each [T, T] product (2 B T^2 D for QK^T and
// P V together) forward, and twice that backward (fwd+bwd three times the forward).
// FlashAttention's papers count the attention's backward as 2.5 times its forward (it
// recomputes Q K^T), so their fwd+bwd rates for attention alone read 7/6 of this count's.
// bench/torch_attention.py times PyTorch's same layer (unfused and through
// scaled_dot_product_attention) at the same sizes; bench/NOTES.md has the predictions and
// results. Every output is checked finite and not all zero before its row prints.
#include <mpx/mpx.hpp>

#include "executors.hpp"
#include "tensors.hpp"
#include "timing.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace {

struct options {
  std::string executor = "all";
  int repeat = 5;
  bool small = false;
  std::vector<std::int64_t> tokens;  // empty: the executor's default
  bool fused = true, unfused = true;
  float dropout = 0.0f;  // on the attention weights
  bool fp8 = false;      // the layer under mixed_fp8, its core in bfloat16 and in fp8
  bool deterministic = true;  // the fused backward in a fixed order (the layer's default)
  std::vector<std::int64_t> widths{1024, 768};  // the models timed, in this order
};

struct attention_size {
  std::int64_t batch, tokens, width, heads;
};

//! A width-1,024 model with heads of 128 and GPT-2 small's width and heads (head width
//! 64), each at every sequence length, 16,384 tokens a batch on the GPU. The wider first:
//! on Hopper cuDNN's fp8 backward takes heads of 128 only, and under --fp8 the narrower
//! model's fp8 rows run mpx's fp8 core, slowly.
std::vector<attention_size> sizes_for(options const& opt, bool gpu) {
  if (opt.small) return {{2, 16, 32, 2}};
  std::vector<std::int64_t> const tokens =
      !opt.tokens.empty() ? opt.tokens : gpu ? std::vector<std::int64_t>{1024, 2048, 4096} : std::vector<std::int64_t>{128, 256};
  std::int64_t const tokens_per_batch = gpu ? 16384 : 512;
  std::vector<attention_size> out;
  for (std::int64_t const width : opt.widths)
    for (auto const t : tokens) {
      std::int64_t const heads = width == 768 ? 12 : 8;
      out.push_back({std::max<std::int64_t>(1, tokens_per_batch / t), t, gpu ? width : width / 4, gpu ? heads : heads / 2});
    }
  return out;
}

//! Bytes in use from the device's current stream-ordered pool, where every mpx tensor
//! lives (cudaMallocAsync); 0 on the host (not measured there). cuBLASLt's workspace is
//! plain cudaMalloc, outside it.
template <class Exec>
std::int64_t pool_bytes_in_use([[maybe_unused]] Exec const& exec) {
#if MPX_HAS_CUDA
  if constexpr (mpx::is_cuda_executor_v<Exec>) {
    exec.synchronize();  // frees on the stream have returned their memory
    int device = 0;
    MPX_CUDA_CHECK(cudaGetDevice(&device));
    cudaMemPool_t pool{};
    MPX_CUDA_CHECK(cudaDeviceGetMemPool(&pool, device));
    std::uint64_t used = 0;
    MPX_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    return static_cast<std::int64_t>(used);
  }
#endif
  return 0;
}

struct row {
  double forward = 0, both = 0;  // seconds
  bool fused = false;
  std::int64_t layer_bytes = 0;  // what the layer holds: weights, gradients, reserved buffers
};

//! The layer's memory is what the pool holds while it lives, over what it holds once the
//! layer is gone: the fused attention's workspace, which the program keeps for the
//! stream (made when a layer first needs it), is not the layer's. Its growth is added to
//! `workspace_bytes`.
template <class P, class Exec>
row time_attention(Exec const& exec, options const& opt, attention_size const z, bool fused, bool fp8_core,
                   std::int64_t& workspace_bytes) {
  using space = mpx::memory_space_t<Exec>;
  using T = typename P::storage_type;
  std::int64_t const before = pool_bytes_in_use(exec);
  row r;
  std::int64_t with_layer = 0;
  {
    mpx::causal_self_attention<P> layer(
        mpx::causal_self_attention_config{
            .heads = z.heads, .dropout = opt.dropout, .fused = fused, .fp8_attention = fp8_core,
            .deterministic = opt.deterministic});
    layer.set_name("attention");
    layer.build(exec, {z.tokens, z.width}, 1);
    layer.reserve(exec, z.batch);
    with_layer = pool_bytes_in_use(exec);
    auto x = mpx_bench::random_tensor<T>(exec, {z.batch, z.tokens, z.width}, 21);
    auto dy = mpx_bench::random_tensor<T>(exec, {z.batch, z.tokens, z.width}, 22, 0.01f);
    auto y = mpx::make_tensor<T>(exec, {z.batch, z.tokens, z.width});
    auto dx = mpx::make_tensor<T>(exec, {z.batch, z.tokens, z.width});
    auto const xv = mpx::tensor_view<T const, space>(mpx::view(x));
    auto const yv = mpx::tensor_view<T const, space>(mpx::view(y));
    auto const dyv = mpx::tensor_view<T const, space>(mpx::view(dy));
    r.forward = mpx_bench::median_seconds(exec, opt.repeat, [&] { layer.forward(exec, xv, mpx::view(y), true); });
    mpx_bench::check_output(exec, y, "attention forward");
    r.both = mpx_bench::median_seconds(exec, opt.repeat, [&] {
      layer.forward(exec, xv, mpx::view(y), true);
      layer.backward(exec, xv, yv, dyv, mpx::view(dx));
    });
    mpx_bench::check_output(exec, dx, "attention backward dx");
    r.fused = layer.fused();
  }
  std::int64_t const after = pool_bytes_in_use(exec);
  r.layer_bytes = with_layer - after;
  workspace_bytes += after - before;
  return r;
}

template <class P, class Exec>
void bench_attention(Exec const& exec, options const& opt, attention_size const z, bool fused, bool fp8_core,
                     std::int64_t& workspace_bytes) {
  row const r = time_attention<P>(exec, opt, z, fused, fp8_core, workspace_bytes);
  std::string const label = mpx::computes_in_fp8<P> ? (fp8_core ? "fp8 all" : "fp8 proj")
                                                    : std::string(mpx::dtype_name<typename P::storage_type>);
  double const n = static_cast<double>(z.batch * z.tokens), d = static_cast<double>(z.width),
               t = static_cast<double>(z.tokens);
  double const forward_flops = 8 * n * d * d + 2 * n * t * d;
  bool constexpr gpu = !mpx::is_host_executor_v<Exec>;
  double const unit = gpu ? 1e12 : 1e9;
  std::string const mib = gpu ? std::to_string(std::llround(static_cast<double>(r.layer_bytes) / (1 << 20))) : "-";
  std::printf("%-6s %-9s %-22s %-8s %10.3f %9.1f %12.3f %9.1f %11s\n", std::string(Exec::name).c_str(),
              label.c_str(),
              (mpx_bench::shape_text({z.batch, z.tokens, z.width}) + " / " + std::to_string(z.heads)).c_str(),
              r.fused ? "fused" : "unfused", r.forward * 1e3, forward_flops / r.forward / unit, r.both * 1e3,
              3 * forward_flops / r.both / unit, mib.c_str());
  std::fflush(stdout);
}

template <class Exec>
void run_all(Exec const& exec, options const& opt) {
  bool constexpr gpu = !mpx::is_host_executor_v<Exec>;
  if (gpu && opt.fused)
    std::printf("fused attention: %s; its backward %s\n",
                mpx::fused_attention() ? std::string(mpx::fused_attention()->name()).c_str()
                                       : "none registered: the fused rows run unfused (stderr says why)",
                opt.deterministic ? "deterministic (the layer's default)"
                                  : "not deterministic (dQ summed with atomics, as PyTorch's SDPA by default)");
  std::printf("\n%-6s %-9s %-22s %-8s %10s %9s %12s %9s %11s\n", std::string(Exec::name).c_str(), "dtype",
              "B x T x D / heads", "path", "fwd (ms)", gpu ? "TFLOP/s" : "GFLOP/s", "fwd+bwd (ms)",
              gpu ? "TFLOP/s" : "GFLOP/s", "memory MiB");
  std::int64_t workspace_bytes = 0;
  for (auto const z : sizes_for(opt, gpu)) {
    auto for_policy = [&](auto tag, bool fp8_core = false) {
      using P = typename decltype(tag)::type;
      if (opt.fused && gpu) bench_attention<P>(exec, opt, z, true, fp8_core, workspace_bytes);  // (the host has no fused path)
      if (opt.unfused || !gpu) bench_attention<P>(exec, opt, z, false, fp8_core, workspace_bytes);
    };
    if (opt.fp8) {
      for_policy(boost::hana::type_c<mpx::mixed_fp8>);
      for_policy(boost::hana::type_c<mpx::mixed_fp8>, true);
    } else {
      for_policy(boost::hana::type_c<mpx::mixed_bfloat16>);
      for_policy(boost::hana::type_c<mpx::mixed_float16>);
    }
  }
  if (gpu)
    std::printf("(memory: what each layer holds in the stream-ordered pool; beside the rows, the program keeps %lld "
                "MiB of fused-attention workspace for the stream: each size it grew to, since a workspace keeps the "
                "blocks it outgrew for graphs captured on them)\n",
                static_cast<long long>(std::llround(static_cast<double>(workspace_bytes) / (1 << 20))));
}

}  // namespace

int main(int argc, char** argv) try {
  options opt;
  mpx_programs::command_line args(argc, argv,
                                  "[--executor host|cuda|all] [--repeat R] [--small] [--tokens T[,T...]]\n"
                                  "          [--widths W[,W]] [--path fused|unfused|both] [--dropout P] [--fp8] [--nondeterministic]");
  while (args.next()) {
    if (args.is("--executor")) opt.executor = args.choice({"host", "cuda", "all"});
    else if (args.is("--repeat")) opt.repeat = args.whole<int>(1, 10'000);
    else if (args.is("--small")) opt.small = true;
    else if (args.is("--tokens")) opt.tokens = args.wholes<std::int64_t>(1, 65'536);
    else if (args.is("--widths")) {
      opt.widths = args.wholes<std::int64_t>(768, 1024);
      for (std::int64_t const w : opt.widths)
        if (w != 768 && w != 1024)
          throw mpx_programs::usage_error("--widths takes 768 and 1024 (the two models), got " + std::to_string(w));
    }
    else if (args.is("--path")) {
      std::string const path = args.choice({"fused", "unfused", "both"});
      opt.fused = path != "unfused";
      opt.unfused = path != "fused";
    } else if (args.is("--dropout")) opt.dropout = static_cast<float>(args.real(0.0, 0.9, true));
    else if (args.is("--fp8")) opt.fp8 = true;
    else if (args.is("--nondeterministic")) opt.deterministic = false;
    else args.unknown();
  }
  std::printf("median of %d runs%s; causal model FLOPs (the masked half of each [T, T] product not counted)%s\n",
              opt.repeat, opt.small ? ", --small sizes" : "",
              opt.dropout > 0 ? ("; attention dropout " + mpx::detail::to_text(opt.dropout)).c_str() : "");
  return mpx_bench::run_on_executors(opt.executor, [&](auto const& exec) { run_all(exec, opt); });
} catch (...) {
  return mpx_programs::report_failure("transformer_bench");
}
