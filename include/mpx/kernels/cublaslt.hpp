// The cuBLASLt side of mpx::gemm: a checked call for cuBLAS statuses, and the per-device
// handle, per-(device, stream) workspace and per-problem plan (descriptors and the
// heuristic's algorithm) that are created once and reused by every later call.
// CUDA-only by nature: empty under the plain C++ compiler.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/error.hpp>

#if MPX_HAS_CUDA
#include <mpx/exec/executor.hpp>
#include <mpx/exec/stream_registry.hpp>

#include <cublasLt.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
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

//! What identifies one matrix product to cuBLASLt: the same key gets the same plan.
//! Row-major mpx shapes are already translated to cuBLASLt's column-major terms.
struct lt_problem {
  int device = 0;
  cudaDataType_t a_type{}, b_type{}, c_type{}, scale_type{};
  cublasComputeType_t compute{};
  cublasOperation_t op_a{}, op_b{};
  std::uint64_t a_rows = 0, a_cols = 0, b_rows = 0, b_cols = 0, c_rows = 0, c_cols = 0;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  std::int32_t batch = 1;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  std::uint32_t align_a = 0, align_b = 0, align_c = 0;  // bytes: the heuristic needs them
  //! How A's and B's scales apply (cublasLtMatmulMatrixScale_t): 0, one float per matrix,
  //! unless the operands are block-scaled (mpx::fp8_block_gemm).
  std::int32_t a_scale_mode = 0, b_scale_mode = 0;
  //! alpha and beta are read from device memory (NVFP4: alpha carries the tensors'
  //! decode factors, which live on the device).
  bool alpha_beta_on_device = false;

  auto tie() const {
    return std::tie(device, a_type, b_type, c_type, scale_type, compute, op_a, op_b, a_rows, a_cols, b_rows, b_cols,
                    c_rows, c_cols, lda, ldb, ldc, batch, stride_a, stride_b, stride_c, align_a, align_b, align_c,
                    a_scale_mode, b_scale_mode, alpha_beta_on_device);
  }
  friend bool operator<(lt_problem const& x, lt_problem const& y) { return x.tie() < y.tie(); }
};

//! Descriptors and the chosen algorithm of one problem. Owned by the cache; never
//! destroyed before release_gemm_resources() (destruction at exit would race the
//! CUDA runtime's own teardown).
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
};

//! Per device: one cuBLASLt handle. Per (device, stream): one workspace, since two
//! streams running at once cannot share one. Per problem: one plan.
//!
//! Workspaces are keyed by the stream's driver id, never reused by another stream; a
//! capture, which cannot ask for the id, finds the workspace by the handle through
//! stream_registry. A destroyed stream's workspace is freed by release_gemm_workspace
//! (mpx's own streams call it), taken over by the next stream that gets its handle, or
//! freed by release_gemm_resources.
class lt_context {
 public:
  //! The process-wide cache. Deliberately never destroyed (see lt_plan).
  static lt_context& instance() {
    static lt_context* const context = new lt_context();
    return *context;
  }

  //! Workspace bytes offered to cuBLASLt: 32 MiB on Hopper and later (NVIDIA's
  //! recommendation for sm_90), 4 MiB before.
  static std::size_t workspace_size_for(int device) {
    int major = 0;
    MPX_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major >= 9 ? std::size_t{32} << 20 : std::size_t{4} << 20;
  }

  //! Whether `stream` is capturing a graph: then nothing may be created or allocated.
  static bool capturing(cudaStream_t stream) { return cuda_executor(stream).capturing(); }

  //! The handle of `device`, created on first use (never during a capture).
  cublasLtHandle_t handle(int device, bool capturing) {
    std::lock_guard lock(mutex_);
    auto const known = handles_.find(device);
    if (known != handles_.end()) return known->second;
    if (capturing) fail_cold_capture();
    cublasLtHandle_t h = nullptr;
    check_cublas(cublasLtCreate(&h), "cublasLtCreate");
    handles_.emplace(device, h);
    return h;
  }

  struct workspace {
    void* data = nullptr;
    std::size_t bytes = 0;
  };

  //! The workspace of (device, stream), allocated on first eager use. Keyed by the
  //! stream's id, not its handle: the per-thread default stream (and the null handle
  //! under --default-stream per-thread) is one handle for a different stream in each
  //! thread, two products running at once must not share a workspace, and a destroyed
  //! stream's handle may come back for a new stream. A capture finds the workspace that
  //! the same handle's last eager product used (one must have run: it made it).
  workspace workspace_for(int device, cudaStream_t stream, bool capturing) {
    stream_handle_key const key = stream_handle_key_of(device, stream);
    if (capturing) {
      std::lock_guard lock(mutex_);
      if (workspace const* ws = workspaces_.captured(key)) return *ws;
      fail_cold_capture();
    }
    unsigned long long stream_id = 0;
    MPX_CUDA_CHECK(cudaStreamGetId(stream, &stream_id));
    std::lock_guard lock(mutex_);
    auto found = workspaces_.use(key, stream_id);
    if (found.inherited || !found.retired.empty()) {
      // The handle's former stream is destroyed, and its last products may still be
      // running in the workspace: let them finish before it is reused or freed.
      MPX_CUDA_CHECK(cudaDeviceSynchronize());
      for (workspace const& old : found.retired) MPX_CUDA_CHECK(cudaFree(old.data));
    }
    if (found.resource) return *found.resource;
    workspace made;
    made.bytes = workspace_size_for(device);
    MPX_CUDA_CHECK(cudaMalloc(&made.data, made.bytes));
    return workspaces_.put(device, stream_id, made);
  }

  //! The plan of `p`, made (descriptors, heuristic) on first use.
  //! a_scale and b_scale: the first call's scale pointers, which a block scale mode
  //! needs already when the algorithm is chosen (cuBLASLt refuses the query without
  //! them); every call sets its own before it runs.
  lt_plan const& plan(lt_problem const& p, cublasLtHandle_t handle, std::size_t workspace_bytes,
                      void const* a_scale = nullptr, void const* b_scale = nullptr) {
    std::lock_guard lock(mutex_);
    auto it = plans_.find(p);
    if (it != plans_.end()) return *it->second;
    auto made = make_plan(p, handle, workspace_bytes, a_scale, b_scale);
    return *plans_.emplace(p, std::move(made)).first->second;
  }

  //! Frees every workspace and plan and destroys the handles, after waiting for the
  //! devices that used them. For tests and for programs that made many streams.
  void release() {
    std::lock_guard lock(mutex_);
    int current = 0;
    MPX_CUDA_CHECK(cudaGetDevice(&current));
    for (auto const& [device, ws] : workspaces_.clear()) {
      MPX_CUDA_CHECK(cudaSetDevice(device));
      MPX_CUDA_CHECK(cudaDeviceSynchronize());
      MPX_CUDA_CHECK(cudaFree(ws.data));
    }
    plans_.clear();
    for (auto const& [device, h] : handles_) check_cublas(cublasLtDestroy(h), "cublasLtDestroy");
    handles_.clear();
    ++generation_;
    MPX_CUDA_CHECK(cudaSetDevice(current));
  }

  //! Waits for `stream` and frees the workspace it was given, for a live stream about to
  //! be destroyed (its id is never reused, so its workspace would never be used again).
  //! Never throws: it runs in destructors, and prints what failed.
  void forget_stream(cudaStream_t stream) noexcept {
    unsigned long long stream_id = 0;
    if (cudaStreamGetId(stream, &stream_id) != cudaSuccess) return;
    std::lock_guard lock(mutex_);
    auto const freed = workspaces_.forget(stream_id);
    if (freed.empty()) return;
    int current = 0;
    if (cudaGetDevice(&current) != cudaSuccess) return;
    cudaError_t status = cudaStreamSynchronize(stream);
    for (auto const& [device, ws] : freed) {
      if (status == cudaSuccess) status = cudaSetDevice(device);
      if (status == cudaSuccess) status = cudaFree(ws.data);
    }
    report_if_failed(status, "freeing a stream's cuBLASLt workspace");
    static_cast<void>(cudaSetDevice(current));
  }

  //! The bytes of every workspace held now.
  std::size_t workspace_bytes() {
    std::lock_guard lock(mutex_);
    std::size_t total = 0;
    workspaces_.for_each([&](workspace const& ws) { total += ws.bytes; });
    return total;
  }

  //! Changes with every release(): a graph captured under an older value holds freed
  //! workspaces.
  std::uint64_t generation() {
    std::lock_guard lock(mutex_);
    return generation_;
  }

 private:
  lt_context() = default;

  // cudaMalloc or cublasLtCreate would invalidate the capture with an unhelpful error:
  // say what to do instead.
  [[noreturn]] static void fail_cold_capture() {
    fail<invalid_argument>("mpx::gemm",
                           "the first gemm on a stream creates its cuBLASLt handle and workspace, which a CUDA "
                           "graph capture cannot record: run one gemm (or one eager step) on this stream before "
                           "capturing");
  }

  // Names for the message of a product cuBLASLt has no algorithm for.
  static std::string type_name(cudaDataType_t t) {
    switch (t) {
      case CUDA_R_16F: return "half";
      case CUDA_R_16BF: return "bfloat16";
      case CUDA_R_32F: return "float";
      case CUDA_R_8F_E4M3: return "e4m3";
      case CUDA_R_8F_E5M2: return "e5m2";
      case CUDA_R_4F_E2M1: return "e2m1";
      default: return "cudaDataType " + std::to_string(static_cast<int>(t));
    }
  }
  static std::string operand_name(cudaDataType_t t, std::int32_t scale_mode) {
    switch (scale_mode) {
      case 0: return type_name(t);
      case CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F: return type_name(t) + " (rowwise scales)";
      case CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F: return type_name(t) + " (1x128 block scales)";
      case CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F: return type_name(t) + " (128x128 block scales)";
      case CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0: return type_name(t) + " (1x32 E8M0 block scales)";
      case CUBLASLT_MATMUL_MATRIX_SCALE_VEC16_UE4M3: return type_name(t) + " (1x16 UE4M3 block scales)";
      default: return type_name(t) + " (scale mode " + std::to_string(scale_mode) + ")";
    }
  }

  static void set_layout(cublasLtMatrixLayout_t layout, std::int32_t batch, std::int64_t stride) {
    if (batch == 1) return;
    check_cublas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)),
                 "cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)");
    check_cublas(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                  sizeof(stride)),
                 "cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)");
  }

  static std::unique_ptr<lt_plan> make_plan(lt_problem const& p, cublasLtHandle_t handle,
                                            std::size_t workspace_bytes, void const* a_scale,
                                            void const* b_scale) {
    auto plan = std::make_unique<lt_plan>();
    check_cublas(cublasLtMatmulDescCreate(&plan->desc, p.compute, p.scale_type), "cublasLtMatmulDescCreate");
    check_cublas(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &p.op_a, sizeof(p.op_a)),
                 "cublasLtMatmulDescSetAttribute(TRANSA)");
    check_cublas(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &p.op_b, sizeof(p.op_b)),
                 "cublasLtMatmulDescSetAttribute(TRANSB)");
    check_cublas(cublasLtMatrixLayoutCreate(&plan->a, p.a_type, p.a_rows, p.a_cols, p.lda),
                 "cublasLtMatrixLayoutCreate(A)");
    check_cublas(cublasLtMatrixLayoutCreate(&plan->b, p.b_type, p.b_rows, p.b_cols, p.ldb),
                 "cublasLtMatrixLayoutCreate(B)");
    check_cublas(cublasLtMatrixLayoutCreate(&plan->c, p.c_type, p.c_rows, p.c_cols, p.ldc),
                 "cublasLtMatrixLayoutCreate(C)");
    set_layout(plan->a, p.batch, p.stride_a);
    set_layout(plan->b, p.batch, p.stride_b);
    set_layout(plan->c, p.batch, p.stride_c);
    if (p.alpha_beta_on_device) {
      cublasLtPointerMode_t const mode = CUBLASLT_POINTER_MODE_DEVICE;
      check_cublas(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode, sizeof(mode)),
                   "cublasLtMatmulDescSetAttribute(POINTER_MODE)");
    }
    // Set before the heuristic, which picks kernels by them (as PyTorch's scaled_gemm and
    // Transformer Engine set them), whenever the product has scales.
    if (p.a_scale_mode != 0 || p.b_scale_mode != 0 || a_scale != nullptr || b_scale != nullptr) {
      check_cublas(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &p.a_scale_mode,
                                                  sizeof(p.a_scale_mode)),
                   "cublasLtMatmulDescSetAttribute(A_SCALE_MODE)");
      check_cublas(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &p.b_scale_mode,
                                                  sizeof(p.b_scale_mode)),
                   "cublasLtMatmulDescSetAttribute(B_SCALE_MODE)");
      check_cublas(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale,
                                                  sizeof(a_scale)),
                   "cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)");
      check_cublas(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale,
                                                  sizeof(b_scale)),
                   "cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)");
    }

    cublasLtMatmulPreference_t pref = nullptr;
    check_cublas(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    // The preference is only needed for the query: destroy it on every way out.
    std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, cublasStatus_t (*)(cublasLtMatmulPreference_t)>
        pref_guard(pref, &cublasLtMatmulPreferenceDestroy);
    std::uint64_t const max_workspace = workspace_bytes;
    check_cublas(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace,
                                                      sizeof(max_workspace)),
                 "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
    // The default assumes 256-byte aligned pointers; views at an offset and batch
    // strides can be less aligned, and an algorithm that needs more would fault.
    std::uint32_t const aligns[4] = {p.align_a, p.align_b, p.align_c, p.align_c};
    cublasLtMatmulPreferenceAttributes_t const align_attrs[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i)
      check_cublas(cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &aligns[i], sizeof(aligns[i])),
                   "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)");
    // Split-K partial products must be summed in the compute type. The in-place and
    // output-type schemes sum them in C's type, which for a 16-bit C rounds every
    // partial sum to half or bfloat16: one rounding per slice of K, not the one rounding
    // at the end that gemm's error bound (and docs/gemm.md) promises.
    std::uint32_t const schemes = p.c_type == CUDA_R_32F ? std::uint32_t{CUBLASLT_REDUCTION_SCHEME_MASK}
                                                         : std::uint32_t{CUBLASLT_REDUCTION_SCHEME_NONE |
                                                                         CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE};
    check_cublas(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes,
                                                      sizeof(schemes)),
                 "cublasLtMatmulPreferenceSetAttribute(REDUCTION_SCHEME_MASK)");

    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    // D is C (in place), so the C layout serves both.
    // "Not supported" is how the heuristic itself usually says it found nothing: report
    // it with the product's shape, like an empty result.
    cublasStatus_t const asked =
        cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->a, plan->b, plan->c, plan->c, pref, 1, &result, &found);
    if (asked != CUBLAS_STATUS_NOT_SUPPORTED) check_cublas(asked, "cublasLtMatmulAlgoGetHeuristic");
    if (asked == CUBLAS_STATUS_NOT_SUPPORTED || found < 1 || result.state != CUBLAS_STATUS_SUCCESS) {
      cublasStatus_t const status = asked != CUBLAS_STATUS_SUCCESS ? asked
                                    : found < 1                    ? CUBLAS_STATUS_NOT_SUPPORTED
                                                                   : result.state;
      std::uint64_t const k = p.op_a == CUBLAS_OP_N ? p.a_cols : p.a_rows;
      // In mpx's terms: its A is cuBLASLt's B and its B cuBLASLt's A (cuda_gemm).
      throw cublas_error("mpx::gemm: cuBLASLt has no algorithm for this product (M x N x K = " +
                             std::to_string(p.c_cols) + " x " + std::to_string(p.c_rows) + " x " + std::to_string(k) +
                             ", batch " + std::to_string(p.batch) + "; A " + operand_name(p.b_type, p.b_scale_mode) +
                             ", B " + operand_name(p.a_type, p.a_scale_mode) + ", C " + type_name(p.c_type) +
                             (p.alpha_beta_on_device ? ", alpha on the device" : "") +
                             "): " + cublasLtGetStatusName(status),
                         static_cast<int>(status));
    }
    plan->algo = result.algo;
    plan->workspace_bytes = result.workspaceSize;
    return plan;
  }

  std::mutex mutex_;
  std::map<int, cublasLtHandle_t> handles_;
  stream_registry<workspace> workspaces_;  // by (device, stream id), and by handle for captures
  std::map<lt_problem, std::unique_ptr<lt_plan>> plans_;
  std::uint64_t generation_ = 0;
};

//! Device pointers to what cuBLASLt multiplies its A's and B's values by (fp8 operands'
//! dequantisation: CUBLASLT_MATMUL_DESC_A/B_SCALE_POINTER): one float each, or block
//! scales (floats, or E8M0 bytes) in the layout of their mode. Null: none.
struct lt_operand_scales {
  void const* a = nullptr;
  void const* b = nullptr;
  //! cublasLtMatmulMatrixScale_t of each: 0 (one float), or a block mode, when the
  //! pointers are to block scales (mpx::fp8_block_gemm).
  std::int32_t a_mode = 0, b_mode = 0;
  //! Where alpha and beta are in device memory (two floats), for products whose alpha
  //! the GPU computes (NVFP4's decode factors); null: they are host values.
  float const* device_alpha_beta = nullptr;
};

//! Runs one planned product on `stream`: D = C = alpha * scales.a * scales.b * op(A) op(B)
//! + beta * C, in cuBLASLt's column-major terms. alpha and beta point to host values of
//! the scale type (device floats when p.alpha_beta_on_device); the scales (when given)
//! to device memory, read when the product runs.
inline void lt_matmul(lt_problem const& p, cudaStream_t stream, void const* alpha, void const* a, void const* b,
                      void const* beta, void* c, lt_operand_scales const& scales = {}) {
  lt_context& context = lt_context::instance();
  // Asked first: during a capture nothing may be created, so a cold stream is refused
  // before a handle or workspace would be.
  bool const capturing = lt_context::capturing(stream);
  lt_context::workspace const ws = context.workspace_for(p.device, stream, capturing);
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
  check_cublas(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scales.a,
                                              sizeof(scales.a)),
               "cublasLtMatmulDescSetAttribute(A_SCALE_POINTER)");
  check_cublas(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scales.b,
                                              sizeof(scales.b)),
               "cublasLtMatmulDescSetAttribute(B_SCALE_POINTER)");
  run();
}

}  // namespace detail

//! Frees the cuBLASLt handles, workspaces and plans mpx::gemm has cached, after waiting for
//! every device that used them. Optional: for a program that created many streams (each
//! keeps a workspace) or wants the memory back. A CUDA graph captured before the call holds
//! the freed workspace's address: capture it again (a classifier_trainer does so by itself)
//! or destroy it first. A captured gemm uses its capture stream's workspace, so launch a
//! graph on the stream it was captured on.
inline void release_gemm_resources() { detail::lt_context::instance().release(); }

//! Waits for `stream` and frees the cuBLASLt workspace (32 MiB on Hopper) that mpx::gemm
//! made for it. Call it before destroying a stream of your own that ran a gemm; mpx's
//! own streams do. Without it the workspace stays until a new stream gets the destroyed
//! one's handle (that stream takes it over, after waiting for the device once) or until
//! release_gemm_resources(). A graph captured on the stream uses that workspace: do not
//! launch it afterwards. Never throws.
inline void release_gemm_workspace(cudaStream_t stream) noexcept {
  detail::lt_context::instance().forget_stream(stream);
}

//! The device memory mpx::gemm holds now in cuBLASLt workspaces (one per stream that ran
//! a product), for memory accounting: they are plain cudaMalloc allocations, outside
//! the stream-ordered pool that tensors come from.
inline std::size_t gemm_workspace_bytes() { return detail::lt_context::instance().workspace_bytes(); }

#endif  // MPX_HAS_CUDA

}  // namespace mpx
