// The host executor's matrix product through oneDNN's matmul, where the build found
// oneDNN (MPX_HAS_ONEDNN, set by Meson on mpx_dep): float operands in float, bfloat16
// operands as bfloat16 on the CPU's own bfloat16 dot products where it has them
// (AVX-512 BF16, AMX), float sums either way, on oneDNN's OpenMP threads. It is what
// PyTorch's CPU products run on. mpx::gemm calls it first; a problem oneDNN has no
// implementation for goes on to OpenBLAS or the blocked product (kernels/gemm.hpp).
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>

#include <dlfcn.h>
#include <oneapi/dnnl/dnnl.hpp>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace mpx::detail {

//! The CPU engine, made once (oneDNN reads the CPU's instruction sets then).
inline dnnl::engine const& onednn_engine() {
  static dnnl::engine const engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

//! Whether this thread may run oneDNN now, making it so where it can. OpenMP's thread
//! pool does not survive fork(): a child forked after the parent's first oneDNN product
//! would wait forever for threads it does not have. The process that asks first owns
//! oneDNN. In a forked child each thread asks OpenMP, once, for teams of one thread (its
//! own; oneDNN divides rows and columns among threads, not sums, so the child's products
//! are the parent's bit for bit in every case the tests check); under a threading
//! runtime other than OpenMP the child leaves its products to the next path.
inline bool onednn_usable_here() {
  static pid_t const owner = ::getpid();
  pid_t const self = ::getpid();
  if (self == owner) return true;
#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
  thread_local pid_t narrowed_in = 0;
  if (narrowed_in != self) {
    // OpenMP is loaded (oneDNN links it); looked up rather than linked, so that mpx's
    // users need no -fopenmp.
    using set_threads = void (*)(int);
    auto const set = reinterpret_cast<set_threads>(::dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
    if (set == nullptr) return false;
    set(1);
    narrowed_in = self;
  }
  return true;
#else
  return false;
#endif
}

//! The operand types oneDNN's product takes from mpx as they are: float and bfloat16.
//! Others (half, fp8) are widened to float first.
template <class T>
inline constexpr bool onednn_operand = std::is_same_v<T, float> || std::is_same_v<T, bfloat16>;

template <class T>
inline constexpr dnnl::memory::data_type onednn_type =
    std::is_same_v<T, bfloat16> ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;

//! One operand as oneDNN's [batch, rows, cols] over mpx's row-major storage: stored
//! [rows, cols], or [cols, rows] when transposed; a batch stride of 0 (one matrix
//! shared by the batch) is oneDNN's broadcast batch of 1.
inline dnnl::memory::desc onednn_matrix(dnnl::memory::data_type type, std::int64_t batch, std::int64_t batch_stride,
                                        std::int64_t rows, std::int64_t cols, bool transposed) {
  bool const shared = batch_stride == 0;
  std::int64_t const stride = shared ? rows * cols : batch_stride;
  return {{shared ? 1 : batch, rows, cols}, type,
          transposed ? dnnl::memory::dims{stride, 1, rows} : dnnl::memory::dims{stride, cols, 1}};
}

//! c = alpha * op(a) op(b) + beta * c for a batch of products described as in gemm_dims
//! (batch strides of 0 share an operand): summed in float, then rounded once to c's type
//! (float or bfloat16; c is not read when beta == 0). Returns false, having touched
//! nothing, when oneDNN has no implementation for the problem; a failure while it runs
//! is an mpx::error.
template <class T, class TC>
bool onednn_product(std::int64_t batch, std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t stride_a,
                    std::int64_t stride_b, std::int64_t stride_c, bool ta, bool tb, float alpha, T const* a,
                    T const* b, float beta, TC* c) {
  static_assert(onednn_operand<T> && onednn_operand<TC>);
  if (!onednn_usable_here()) return false;
  using dnnl::memory;
  dnnl::matmul::primitive_desc plan;
  try {
    memory::desc const a_desc = onednn_matrix(onednn_type<T>, batch, stride_a, m, k, ta);
    memory::desc const b_desc = onednn_matrix(onednn_type<T>, batch, stride_b, k, n, tb);
    memory::desc const c_desc({batch, m, n}, onednn_type<TC>, memory::dims{stride_c, n, 1});
    dnnl::primitive_attr attr;
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(beta);
      attr.set_post_ops(ops);
    }
    // oneDNN keeps the primitives it made in its own cache (keyed by these
    // descriptors), so a training step's repeated shapes are compiled once.
    plan = dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_desc, b_desc, c_desc), attr, onednn_engine());
  } catch (dnnl::error const&) {
    return false;
  }
  try {
    thread_local dnnl::stream stream(onednn_engine());
    dnnl::engine const& engine = onednn_engine();
    memory a_mem(plan.src_desc(), engine, const_cast<T*>(a));
    memory b_mem(plan.weights_desc(), engine, const_cast<T*>(b));
    memory c_mem(plan.dst_desc(), engine, c);
    dnnl::matmul(plan).execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
    stream.wait();
  } catch (dnnl::error const& e) {
    fail("gemm", std::string("oneDNN's matmul failed: ") + e.what() + " (status " +
                     std::to_string(static_cast<int>(e.status)) + ")");
  }
  return true;
}

}  // namespace mpx::detail
