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
  //! A call's scale pointers, on the plan's descriptor (under the plan's lock).
  static void set_scale_pointers(lt_plan const& plan, void const* a_scale, void const* b_scale) {
    plan.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale, "cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)");
    plan.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale, "cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)");
  }

  //! The plan of `p`: its settings (lt_plan_settings_of, where the decisions and their
  //! reasons are) applied to new descriptors, then the heuristic's algorithm.
  static std::unique_ptr<lt_plan> make_plan(lt_problem const& p, cublasLtHandle_t handle, std::size_t workspace_bytes,
                                            void const* a_scale, void const* b_scale) {
    lt_plan_settings const s = lt_plan_settings_of(p, a_scale, b_scale);
    auto plan = std::make_unique<lt_plan>();
    check_cublas(cublasLtMatmulDescCreate(&plan->desc, s.half_compute ? CUBLAS_COMPUTE_16F : CUBLAS_COMPUTE_32F,
                                          s.half_compute ? CUDA_R_16F : CUDA_R_32F),
                 "cublasLtMatmulDescCreate");
    cublasOperation_t const op_a = s.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t const op_b = s.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    plan->set(CUBLASLT_MATMUL_DESC_TRANSA, op_a, "cublasLtMatmulDescSetAttribute(TRANSA)");
    plan->set(CUBLASLT_MATMUL_DESC_TRANSB, op_b, "cublasLtMatmulDescSetAttribute(TRANSB)");
    make_layout(plan->a, "A", p.a_type, p.a_rows, p.a_cols, p.lda, p.batch, p.stride_a);
    make_layout(plan->b, "B", p.b_type, p.b_rows, p.b_cols, p.ldb, p.batch, p.stride_b);
    make_layout(plan->c, "C", p.c_type, p.c_rows, p.c_cols, p.ldc, p.batch, p.stride_c);
    if (s.device_pointers)  // a cublasLtPointerMode_t, as cuBLASLt reads it
      plan->set(CUBLASLT_MATMUL_DESC_POINTER_MODE, CUBLASLT_POINTER_MODE_DEVICE,
                "cublasLtMatmulDescSetAttribute(POINTER_MODE)");
    if (s.set_scales) {  // before the heuristic, which picks kernels by them
      plan->set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, lt_scale_mode(s.a_scaling),
                "cublasLtMatmulDescSetAttribute(A_SCALE_MODE)");
      plan->set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, lt_scale_mode(s.b_scaling),
                "cublasLtMatmulDescSetAttribute(B_SCALE_MODE)");
      set_scale_pointers(*plan, s.a_scale, s.b_scale);
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
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, s.align_a, "cublasLtMatmulPreferenceSetAttribute(ALIGNMENT_A)");
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, s.align_b, "cublasLtMatmulPreferenceSetAttribute(ALIGNMENT_B)");
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, s.align_c, "cublasLtMatmulPreferenceSetAttribute(ALIGNMENT_C)");
    prefer(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, s.align_d, "cublasLtMatmulPreferenceSetAttribute(ALIGNMENT_D)");
    prefer(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
           s.split_k_sums == lt_split_k_sums::any
               ? std::uint32_t{CUBLASLT_REDUCTION_SCHEME_MASK}
               : std::uint32_t{CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE},
           "cublasLtMatmulPreferenceSetAttribute(REDUCTION_SCHEME_MASK)");

    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    // D is C (in place), so the C layout serves both.
    cublasStatus_t const asked =
        cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->c, plan->c, pref, 1, &result, &found);
    bool const unsupported = asked == CUBLAS_STATUS_NOT_SUPPORTED;
    if (!unsupported) check_cublas(asked, "cublasLtMatmulAlgoGetHeuristic");
    auto const refuse = [&p](cublasStatus_t status) {
      return cublas_error(lt_no_algorithm_message(p, cublasLtGetStatusName(status)), static_cast<int>(status));
    };
    switch (lt_heuristic_outcome_of(unsupported, found, result.state == CUBLAS_STATUS_SUCCESS)) {
      case lt_heuristic_outcome::found: break;
      case lt_heuristic_outcome::unsupported: throw refuse(asked);
      case lt_heuristic_outcome::none_found: throw refuse(CUBLAS_STATUS_NOT_SUPPORTED);
      case lt_heuristic_outcome::failed: throw refuse(result.state);
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
  // lt_resources::run refuses a stream that never ran a product eagerly during a capture.
  bool const capturing = cuda_executor(stream).capturing();
  lt_cache().run(p, stream, capturing, scales, [&](cublasLtHandle_t handle, lt_plan const& plan, lt_workspace ws) {
    check_cublas(cublasLtMatmul(handle, plan.desc, alpha, a, plan.a, b, plan.b, beta, c, plan.c, c, plan.c,
                                &plan.algo, ws.data, ws.bytes, stream),
                 "cublasLtMatmul");
  });
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
