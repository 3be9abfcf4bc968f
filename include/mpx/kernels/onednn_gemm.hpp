// The host executor's matrix product through oneDNN's matmul, where the build found
// oneDNN (MPX_HAS_ONEDNN, set by Meson on mpx_dep): float operands in float, bfloat16
// operands as bfloat16 on the CPU's own bfloat16 dot products where it has them
// (AVX-512 BF16, AMX), float sums either way, on oneDNN's OpenMP threads. It is what
// PyTorch's CPU products run on. mpx::gemm calls it first; a problem oneDNN has no
// implementation for goes on to OpenBLAS or the blocked product (kernels/gemm.hpp).
// Written against oneDNN's C API: its C++ header does not compile under nvcc in C++20,
// and a .cu file includes this one too.
#pragma once

#include <mpx/core/dtype.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/host_threads.hpp>

#include <dlfcn.h>
#include <oneapi/dnnl/dnnl.h>
#include <unistd.h>

#include <compare>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>

namespace mpx::detail {

//! Whether this thread may run oneDNN now, making it so where it can. OpenMP's thread
//! pool does not survive fork(): a child forked after the parent's first oneDNN product
//! would wait forever for threads it does not have. The process the program started as
//! owns oneDNN. In a forked child each thread asks OpenMP, once, for teams of one thread (its
//! own), which stays so for the child's own OpenMP code in that thread; under a threading
//! runtime other than OpenMP the child leaves its products to the next path.
inline bool onednn_usable_here() {
  if (!in_forked_child()) return true;
  pid_t const self = ::getpid();
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

//! The CPU engine, made once (oneDNN reads the CPU's instruction sets then); null if
//! oneDNN cannot make one, and then every product takes the next path.
inline dnnl_engine_t onednn_engine() {
  static dnnl_engine_t const engine = [] {
    dnnl_engine_t e = nullptr;
    return dnnl_engine_create(&e, dnnl_cpu, 0) == dnnl_success ? e : nullptr;
  }();
  return engine;
}

//! The operand types oneDNN's product takes from mpx as they are: float and bfloat16.
//! Others (half, fp8) are widened to float first.
template <class T>
inline constexpr bool onednn_operand = std::is_same_v<T, float> || std::is_same_v<T, bfloat16>;

template <class T>
inline constexpr dnnl_data_type_t onednn_type = std::is_same_v<T, bfloat16> ? dnnl_bf16 : dnnl_f32;

//! What makes two products the same to oneDNN's compiled kernel.
struct onednn_problem {
  int a_type = 0, c_type = 0;
  std::int64_t batch = 0, m = 0, n = 0, k = 0, stride_a = 0, stride_b = 0, stride_c = 0;
  bool ta = false, tb = false;
  float beta = 0.0f;
  auto operator<=>(onednn_problem const&) const = default;
};

//! One problem's compiled product: the primitive and the memory objects it runs on (their
//! data pointers are set per call). No primitive: oneDNN has no implementation for it.
struct onednn_plan {
  dnnl_primitive_t primitive = nullptr;
  dnnl_memory_t a = nullptr, b = nullptr, c = nullptr;
  onednn_plan() = default;
  onednn_plan(onednn_plan const&) = delete;
  onednn_plan& operator=(onednn_plan const&) = delete;
  ~onednn_plan() {
    if (primitive) dnnl_primitive_destroy(primitive);
    for (dnnl_memory_t m : {a, b, c})
      if (m) dnnl_memory_destroy(m);
  }
};

//! One operand as oneDNN's [batch, rows, cols] over mpx's row-major storage: stored
//! [rows, cols], or [cols, rows] when transposed; a batch stride of 0 (one matrix
//! shared by the batch) is oneDNN's broadcast batch of 1.
inline dnnl_status_t onednn_matrix(dnnl_memory_desc_t* desc, int type, std::int64_t batch,
                                   std::int64_t batch_stride, std::int64_t rows, std::int64_t cols, bool transposed) {
  bool const shared = batch_stride == 0;
  dnnl_dims_t const dims = {shared ? 1 : batch, rows, cols};
  dnnl_dims_t strides = {shared ? rows * cols : batch_stride, cols, 1};
  if (transposed) {
    strides[1] = 1;
    strides[2] = rows;
  }
  return dnnl_memory_desc_init_by_strides(desc, 3, dims, static_cast<dnnl_data_type_t>(type), strides);
}

inline void onednn_compile(onednn_problem const& p, onednn_plan& plan) {
  dnnl_engine_t const engine = onednn_engine();
  if (engine == nullptr) return;
  dnnl_memory_desc_t a_md, b_md, c_md;
  if (onednn_matrix(&a_md, p.a_type, p.batch, p.stride_a, p.m, p.k, p.ta) != dnnl_success ||
      onednn_matrix(&b_md, p.a_type, p.batch, p.stride_b, p.k, p.n, p.tb) != dnnl_success)
    return;
  dnnl_dims_t const c_dims = {p.batch, p.m, p.n}, c_strides = {p.stride_c, p.n, 1};
  if (dnnl_memory_desc_init_by_strides(&c_md, 3, c_dims, static_cast<dnnl_data_type_t>(p.c_type), c_strides) !=
      dnnl_success)
    return;
  dnnl_matmul_desc_t op;
  if (dnnl_matmul_desc_init(&op, &a_md, &b_md, nullptr, &c_md) != dnnl_success) return;
  dnnl_primitive_attr_t attr = nullptr;
  if (dnnl_primitive_attr_create(&attr) != dnnl_success) return;
  bool attr_ok = true;
  if (p.beta != 0.0f) {  // C = product + beta * C: oneDNN's sum post-op
    dnnl_post_ops_t ops = nullptr;
    attr_ok = dnnl_post_ops_create(&ops) == dnnl_success && dnnl_post_ops_append_sum(ops, p.beta) == dnnl_success &&
              dnnl_primitive_attr_set_post_ops(attr, ops) == dnnl_success;
    if (ops) dnnl_post_ops_destroy(ops);
  }
  dnnl_primitive_desc_t pd = nullptr;
  bool const described = attr_ok && dnnl_primitive_desc_create(&pd, &op, attr, engine, nullptr) == dnnl_success;
  dnnl_primitive_attr_destroy(attr);
  if (!described) return;
  dnnl_primitive_t primitive = nullptr;
  dnnl_status_t const made = dnnl_primitive_create(&primitive, pd);
  dnnl_primitive_desc_destroy(pd);
  if (made != dnnl_success) return;
  plan.primitive = primitive;
  if (dnnl_memory_create(&plan.a, &a_md, engine, DNNL_MEMORY_NONE) != dnnl_success ||
      dnnl_memory_create(&plan.b, &b_md, engine, DNNL_MEMORY_NONE) != dnnl_success ||
      dnnl_memory_create(&plan.c, &c_md, engine, DNNL_MEMORY_NONE) != dnnl_success) {
    dnnl_primitive_destroy(plan.primitive);
    plan.primitive = nullptr;
  }
}

//! The calling thread's plan for a problem, compiled on first use. A training step
//! repeats a few dozen shapes, so the cache stays small; it is emptied past 256 plans,
//! and in a forked child (the parent's primitives were made for its thread count).
inline onednn_plan const& onednn_plan_for(onednn_problem const& p) {
  thread_local std::map<onednn_problem, onednn_plan> plans;
  thread_local pid_t plans_of = 0;
  if (plans_of != ::getpid() || plans.size() >= 256) {
    plans.clear();
    plans_of = ::getpid();
  }
  auto const [at, is_new] = plans.try_emplace(p);
  if (is_new) onednn_compile(p, at->second);
  return at->second;
}

//! The calling thread's oneDNN stream.
inline dnnl_stream_t onednn_stream() {
  struct owned_stream {
    dnnl_stream_t stream = nullptr;
    ~owned_stream() {
      if (stream) dnnl_stream_destroy(stream);
    }
  };
  thread_local owned_stream s;
  if (s.stream == nullptr && dnnl_stream_create(&s.stream, onednn_engine(), dnnl_stream_default_flags) != dnnl_success)
    s.stream = nullptr;
  return s.stream;
}

//! c = op(a) op(b) + beta * c for a batch of products described as in gemm_dims (batch
//! strides of 0 share an operand): summed in float, then rounded once to c's type (float,
//! or bfloat16 with bfloat16 operands; c is not read when beta == 0). alpha is the
//! caller's (kernels/gemm.hpp), so that a scale that changes every step (fp8's) does not
//! compile a kernel every step. Returns false, having touched nothing, when oneDNN has no
//! implementation for the problem; a failure while it runs is an mpx::error.
template <class T, class TC>
bool onednn_product(std::int64_t batch, std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t stride_a,
                    std::int64_t stride_b, std::int64_t stride_c, bool ta, bool tb, T const* a, T const* b,
                    float beta, TC* c) {
  static_assert(onednn_operand<T> && onednn_operand<TC>);
  if (!onednn_usable_here()) return false;
  onednn_problem const p{onednn_type<T>, onednn_type<TC>, batch, m, n, k, stride_a, stride_b, stride_c, ta, tb,
                         beta};
  onednn_plan const& plan = onednn_plan_for(p);
  dnnl_stream_t const stream = plan.primitive ? onednn_stream() : nullptr;
  if (stream == nullptr) return false;
  dnnl_status_t status = dnnl_memory_set_data_handle(plan.a, const_cast<T*>(a));  // oneDNN only reads A and B
  if (status == dnnl_success) status = dnnl_memory_set_data_handle(plan.b, const_cast<T*>(b));
  if (status == dnnl_success) status = dnnl_memory_set_data_handle(plan.c, c);
  if (status == dnnl_success) {
    dnnl_exec_arg_t const args[3] = {{DNNL_ARG_SRC, plan.a}, {DNNL_ARG_WEIGHTS, plan.b}, {DNNL_ARG_DST, plan.c}};
    status = dnnl_primitive_execute(plan.primitive, stream, 3, args);
  }
  if (status == dnnl_success) status = dnnl_stream_wait(stream);
  if (status != dnnl_success)
    fail("gemm", "oneDNN's matmul failed with status " + std::to_string(static_cast<int>(status)));
  return true;
}

}  // namespace mpx::detail
