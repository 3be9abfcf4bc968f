// The cuBLASLt side of mpx::gemm: a checked call for cuBLAS statuses, a problem's plan
// (descriptors and the heuristic's algorithm), and the backend through which
// gemm_resources.hpp keeps a handle per device, a workspace per (device, stream) and a
// plan per problem. CUDA-only by nature: the rules around these things are plain C++
// (gemm_resources.hpp, gemm_problem.hpp), tested on the host.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/error.hpp>
#include <mpx/kernels/gemm_problem.hpp>
#include <mpx/kernels/gemm_resources.hpp>

#if MPX_HAS_CUDA
#include <mpx/exec/executor.hpp>

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#endif

namespace mpx {

#if MPX_HAS_CUDA

//! A cuBLAS or cuBLASLt call that failed; code() is the cublasStatus_t value and the
//! message names it (CUBLAS_STATUS_NOT_SUPPORTED, ...).
class cublas_error : public cuda_error {
 public:
  using cuda_error::cuda_error;
};

namespace detail {

//! Throws mpx::cublas_error naming the call, the status and where it was made.
inline void check_cublas(cublasStatus_t status, char const* call,
                         mpx::source_location loc = mpx::source_location::current()) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw cublas_error(std::string("mpx: cuBLAS call failed: ") + call + " returned " + cublasLtGetStatusName(status) +
                         " (" + cublasLtGetStatusString(status) + ") at " + where(loc),
                     static_cast<int>(status));
}

//! cuBLASLt's scale mode (cublasLtMatmulMatrixScale_t, an int32_t attribute) of a scaling.
inline std::int32_t lt_scale_mode(lt_operand_scaling s) noexcept {
  switch (s) {
    case lt_operand_scaling::tensor: break;
    case lt_operand_scaling::row: return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    case lt_operand_scaling::vec128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case lt_operand_scaling::tile128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
    case lt_operand_scaling::vec32: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
    case lt_operand_scaling::vec16: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

//! Descriptors and the chosen algorithm of one problem.
struct lt_plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace_bytes = 0;
  //! Held from setting per-call attributes on `desc` (fp8 scale pointers) to the
  //! cublasLtMatmul that reads them: the descriptor is shared by every call of the problem.
  mutable std::mutex call_mutex;

  lt_plan() = default;
  lt_plan(lt_plan const&) = delete;
  lt_plan& operator=(lt_plan const&) = delete;
  ~lt_plan() {
    // Statuses ignored: a destructor cannot throw, and a failure here means the
    // context is already gone.
    if (c) static_cast<void>(cublasLtMatrixLayoutDestroy(c));
    if (b) static_cast<void>(cublasLtMatrixLayoutDestroy(b));
    if (a) static_cast<void>(cublasLtMatrixLayoutDestroy(a));
    if (desc) static_cast<void>(cublasLtMatmulDescDestroy(desc));
  }

  //! Sets an attribute of the descriptor (which the plan points to, so a const plan can).
  template <class V>
  void set(cublasLtMatmulDescAttributes_t attribute, V const& value, char const* call) const {
    check_cublas(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)), call);
  }
};

//! What lt_resources makes and frees on the GPU.
struct cublaslt_backend {
  using handle_type = cublasLtHandle_t;
  using plan_type = lt_plan;
  using stream_type = cudaStream_t;

  static handle_type create_handle(int) {
    cublasLtHandle_t h = nullptr;
    check_cublas(cublasLtCreate(&h), "cublasLtCreate");
    return h;
  }
  static void destroy_handle(handle_type h) { check_cublas(cublasLtDestroy(h), "cublasLtDestroy"); }
  static std::uint64_t stream_id(cudaStream_t stream) {
    unsigned long long id = 0;
    MPX_CUDA_CHECK(cudaStreamGetId(stream, &id));
    return id;
  }
  static bool try_stream_id(cudaStream_t stream, std::uint64_t& id) noexcept {
    unsigned long long got = 0;
    if (cudaStreamGetId(stream, &got) != cudaSuccess) {
      static_cast<void>(cudaGetLastError());  // not to be taken by a later launch check for its own
      return false;
    }
    id = got;
    return true;
  }
  //! 32 MiB on Hopper and later (NVIDIA's recommendation for sm_90), 4 MiB before.
  static std::size_t workspace_bytes_for(int device) {
    return compute_capability_of(device).major >= 9 ? std::size_t{32} << 20 : std::size_t{4} << 20;
  }
  static void* allocate(std::size_t bytes) {
    void* data = nullptr;
    MPX_CUDA_CHECK(cudaMalloc(&data, bytes));
    return data;
  }
  static void free(void* data) { MPX_CUDA_CHECK(cudaFree(data)); }
  static void wait_for_device() { MPX_CUDA_CHECK(cudaDeviceSynchronize()); }
  static void wait_for_stream(cudaStream_t stream) { MPX_CUDA_CHECK(cudaStreamSynchronize(stream)); }
  static int current_device() {
    int device = 0;
    MPX_CUDA_CHECK(cudaGetDevice(&device));
    return device;
  }
  static void set_device(int device) { MPX_CUDA_CHECK(cudaSetDevice(device)); }
  static void report(char const* what, char const* why) noexcept { std::fprintf(stderr, "mpx: %s failed: %s\n", what, why); }

  static std::unique_ptr<lt_plan> make_plan(lt_problem const& p, cublasLtHandle_t handle, std::size_t workspace_bytes,
                                            void const* a_scale, void const* b_scale) {
    auto plan = std::make_unique<lt_plan>();
    check_cublas(cublasLtMatmulDescCreate(&plan->desc, p.half_sums ? CUBLAS_COMPUTE_16F : CUBLAS_COMPUTE_32F,
                                          p.half_sums ? CUDA_R_16F : CUDA_R_32F),
                 "cublasLtMatmulDescCreate");
    cublasOperation_t const op_a = p.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t const op_b = p.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    plan->set(CUBLASLT_MATMUL_DESC_TRANSA, op_a, "cublasLtMatmulDescSetAttribute(TRANSA)");
    plan->set(CUBLASLT_MATMUL_DESC_TRANSB, op_b, "cublasLtMatmulDescSetAttribute(TRANSB)");
    make_layout(plan->a, "A", p.a_type, p.a_rows, p.a_cols, p.lda, p.batch, p.stride_a);
    make_layout(plan->b, "B", p.b_type, p.b_rows, p.b_cols, p.ldb, p.batch, p.stride_b);
    make_layout(plan->c, "C", p.c_type, p.c_rows, p.c_cols, p.ldc, p.batch, p.stride_c);
    if (p.alpha_beta_on_device)
      plan->set(CUBLASLT_MATMUL_DESC_POINTER_MODE, CUBLASLT_POINTER_MODE_DEVICE,
                "cublasLtMatmulDescSetAttribute(POINTER_MODE)");
    // Set before the heuristic, which picks kernels by them (as PyTorch's scaled_gemm and
    // Transformer Engine set them), whenever the product has scales.
    bool const blocks = p.a_scaling != lt_operand_scaling::tensor || p.b_scaling != lt_operand_scaling::tensor;
    if (blocks || a_scale != nullptr || b_scale != nullptr) {
      plan->set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, lt_scale_mode(p.a_scaling),
                "cublasLtMatmulDescSetAttribute(A_SCALE_MODE)");
      plan->set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, lt_scale_mode(p.b_scaling),
                "cublasLtMatmulDescSetAttribute(B_SCALE_MODE)");
      plan->set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale, "cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)");
      plan->set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale, "cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)");
    }

    cublasLtMatmulPreference_t pref = nullptr;
    check_cublas(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    // The preference is only needed for the query: destroy it on every way out.
    std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, cublasStatus_t (*)(cublasLtMatmulPreference_t)>
        pref_guard(pref, &cublasLtMatmulPreferenceDestroy);
    auto const prefer = [&](cublasLtMatmulPreferenceAttributes_t attribute, auto value, char const* call) {
      check_cublas(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &value, sizeof(value)), call);
    };
    prefer(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, std::uint64_t{workspace_bytes},
           "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
    // The default assumes 256-byte aligned pointers; views at an offset and batch
    // strides can be less aligned, and an algorithm that needs more would fault.
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p.align_a, "cublasLtMatmulPreferenceSetAttribute(ALIGNMENT_A)");
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p.align_b, "cublasLtMatmulPreferenceSetAttribute(ALIGNMENT_B)");
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, p.align_c, "cublasLtMatmulPreferenceSetAttribute(ALIGNMENT_C)");
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p.align_c, "cublasLtMatmulPreferenceSetAttribute(ALIGNMENT_D)");
    // Split-K partial products must be summed in the compute type. The in-place and
    // output-type schemes sum them in C's type, which for a 16-bit C rounds every
    // partial sum to half or bfloat16: one rounding per slice of K, not the one rounding
    // at the end that gemm's error bound (and docs/gemm.md) promises.
    prefer(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
           p.c_type == CUDA_R_32F
               ? std::uint32_t{CUBLASLT_REDUCTION_SCHEME_MASK}
               : std::uint32_t{CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE},
           "cublasLtMatmulPreferenceSetAttribute(REDUCTION_SCHEME_MASK)");

    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    // D is C (in place), so the C layout serves both. "Not supported" is how the
    // heuristic itself usually says it found nothing: report it with the product's
    // shape, like an empty result.
    cublasStatus_t const asked =
        cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->c, plan->c, pref, 1, &result, &found);
    if (asked != CUBLAS_STATUS_NOT_SUPPORTED) check_cublas(asked, "cublasLtMatmulAlgoGetHeuristic");
    if (asked == CUBLAS_STATUS_NOT_SUPPORTED || found < 1 || result.state != CUBLAS_STATUS_SUCCESS) {
      cublasStatus_t const status = asked != CUBLAS_STATUS_SUCCESS ? asked
                                    : found < 1                    ? CUBLAS_STATUS_NOT_SUPPORTED
                                                                   : result.state;
      throw cublas_error(lt_no_algorithm_message(p, cublasLtGetStatusName(status)), static_cast<int>(status));
    }
    plan->algo = result.algo;
    plan->workspace_bytes = result.workspaceSize;
    return plan;
  }

 private:
  // `name`: cuBLASLt's operand (A, B or C), for the message of a failed call.
  static void make_layout(cublasLtMatrixLayout_t& layout, char const* name, cudaDataType_t type, std::uint64_t rows,
                          std::uint64_t cols, std::int64_t ld, std::int32_t batch, std::int64_t stride) {
    auto const call = [name](char const* what) { return std::string("cublasLtMatrixLayout") + what + " (" + name + ")"; };
    check_cublas(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld), call("Create").c_str());
    if (batch == 1) return;
    check_cublas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)),
                 call("SetAttribute(BATCH_COUNT)").c_str());
    check_cublas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                  sizeof(stride)),
                 call("SetAttribute(STRIDED_BATCH_OFFSET)").c_str());
  }
};

using lt_context = lt_resources<cublaslt_backend>;

//! The process-wide handles, workspaces and plans. Deliberately never destroyed (see
//! lt_resources): release_gemm_resources() frees what they hold.
inline lt_context& lt_cache() {
  static lt_context* const cache = new lt_context();
  return *cache;
}

//! Runs one planned product on `stream`: D = C = alpha * scales.a * scales.b * op(A) op(B)
//! + beta * C, in cuBLASLt's column-major terms. alpha and beta point to host values of
//! the scale type (device floats when p.alpha_beta_on_device); the scales (when given)
//! to device memory, read when the product runs.
inline void lt_matmul(lt_problem const& p, cudaStream_t stream, void const* alpha, void const* a, void const* b,
                      void const* beta, void* c, lt_operand_scales const& scales = {}) {
  lt_context& context = lt_cache();
  // Asked first: during a capture nothing may be created, so a cold stream is refused
  // before a handle or workspace would be.
  bool const capturing = cuda_executor(stream).capturing();
  lt_workspace const ws = context.workspace_for(p.device, stream, capturing);
  cublasLtHandle_t const handle = context.handle(p.device, capturing);
  lt_plan const& plan = context.plan(p, handle, ws.bytes, scales.a, scales.b);
  auto const run = [&] {
    check_cublas(cublasLtMatmul(handle, plan.desc, alpha, a, plan.a, b, plan.b, beta, c, plan.c, c, plan.c,
                                &plan.algo, ws.data, ws.bytes, stream),
                 "cublasLtMatmul");
  };
  if (!scales.a && !scales.b) return run();
  // The pointers are attributes of the cached descriptor, which other threads' products
  // of the same problem share: set them and launch under the plan's lock (cuBLASLt reads
  // the attributes when it enqueues the kernel, not when the kernel runs).
  std::lock_guard lock(plan.call_mutex);
  plan.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scales.a, "cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)");
  plan.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scales.b, "cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)");
  run();
}

}  // namespace detail

//! Frees the cuBLASLt handles, workspaces and plans mpx::gemm has cached, after waiting for
//! every device that used them. Optional: for a program that created many streams (each
//! keeps a workspace) or wants the memory back. A CUDA graph captured before the call holds
//! the freed workspace's address: capture it again (a classifier_trainer does so by itself)
//! or destroy it first. A captured gemm uses its capture stream's workspace, so launch a
//! graph on the stream it was captured on.
inline void release_gemm_resources() { detail::lt_cache().release(); }

//! Waits for `stream` and frees the cuBLASLt workspace (32 MiB on Hopper) that mpx::gemm
//! made for it. Call it before destroying a stream of your own that ran a gemm; mpx's
//! own streams do. Without it the workspace stays until a new stream gets the destroyed
//! one's handle (that stream takes it over, after waiting for the device once) or until
//! release_gemm_resources(). A graph captured on the stream uses that workspace: do not
//! launch it afterwards. Never throws.
inline void release_gemm_workspace(cudaStream_t stream) noexcept {
  detail::lt_cache().forget_stream(stream);
}

//! The device memory mpx::gemm holds now in cuBLASLt workspaces (one per stream that ran
//! a product), for memory accounting: they are plain cudaMalloc allocations, outside
//! the stream-ordered pool that tensors come from.
inline std::size_t gemm_workspace_bytes() { return detail::lt_cache().workspace_bytes(); }

#endif  // MPX_HAS_CUDA

}  // namespace mpx
