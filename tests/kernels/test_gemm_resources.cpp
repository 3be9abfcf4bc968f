// What mpx::gemm keeps between products on the GPU (kernels/gemm_resources.hpp: a handle
// per device, a workspace per stream, a plan per problem) and the problem a product
// becomes (kernels/gemm_problem.hpp), against a backend of the test's own: handles are
// numbers, workspaces are addresses the backend hands out and takes back, a stream is an
// address with an id the test chooses. mpx::gemm on the GPU runs this same code with
// cuBLASLt and CUDA (cublaslt.hpp).
#include "../support/testing.hpp"

#include <mpx/kernels/gemm.hpp>
#include <mpx/kernels/gemm_problem.hpp>
#include <mpx/kernels/gemm_resources.hpp>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

struct fake_gemm_plan {
  mpx::detail::lt_problem problem;
  void const* a_scale = nullptr;
  void const* b_scale = nullptr;
  //! A mutex that knows whether this thread holds it (asking a std::mutex that is
  //! held by the asking thread is undefined).
  struct owned_mutex {
    std::mutex m;
    std::atomic<std::thread::id> owner{};
    void lock() {
      m.lock();
      owner = std::this_thread::get_id();
    }
    void unlock() {
      owner = std::thread::id{};
      m.unlock();
    }
    bool held_here() const { return owner.load() == std::this_thread::get_id(); }
  };
  mutable owned_mutex call_mutex;
};

//! Records what it is asked to do. Streams are addresses; ids[stream] is the stream's
//! driver id (absent: the stream is destroyed, its id cannot be asked for).
struct fake_gemm_backend {
  using handle_type = int;
  using plan_type = fake_gemm_plan;
  using stream_type = void*;

  std::vector<std::string> log;
  std::map<void*, std::uint64_t> ids;
  std::set<std::uintptr_t> live;  // workspaces handed out and not freed
  std::uintptr_t next_address = 0x1000;
  int next_handle = 1;
  int device = 0;
  bool fail_allocation = false, fail_stream_wait = false, fail_free = false;
  std::size_t double_frees = 0;  // counted, not REQUIREd: free runs inside noexcept forget_stream
  std::vector<std::string> reports;

  int create_handle(int on) {
    log.push_back("create_handle " + std::to_string(on));
    return next_handle++;
  }
  void destroy_handle(int h) { log.push_back("destroy_handle " + std::to_string(h)); }
  std::uint64_t stream_id(void* stream) {
    auto const it = ids.find(stream);
    if (it == ids.end()) throw mpx::cuda_error("cudaStreamGetId: invalid resource handle", 400);
    return it->second;
  }
  bool try_stream_id(void* stream, std::uint64_t& id) noexcept {
    auto const it = ids.find(stream);
    if (it == ids.end()) return false;
    id = it->second;
    return true;
  }
  std::size_t workspace_bytes_for(int on) { return on == 0 ? 32u << 20 : 4u << 20; }
  void* allocate(std::size_t bytes) {
    if (fail_allocation) throw mpx::cuda_error("cudaMalloc: out of memory", 2);
    log.push_back("allocate " + std::to_string(bytes) + " on " + std::to_string(device));
    live.insert(next_address);
    auto* const p = reinterpret_cast<void*>(next_address);
    next_address += 0x1000;
    return p;
  }
  void free(void* p) {
    if (fail_free) throw mpx::cuda_error("cudaFree: an illegal memory access", 700);
    log.push_back("free on " + std::to_string(device));
    if (live.erase(reinterpret_cast<std::uintptr_t>(p)) != 1) ++double_frees;  // not handed out, or freed twice
  }
  void wait_for_device() { log.push_back("wait_for_device " + std::to_string(device)); }
  void wait_for_stream(void*) {
    if (fail_stream_wait) throw mpx::cuda_error("cudaStreamSynchronize: an illegal memory access", 700);
    log.push_back("wait_for_stream");
  }
  int current_device() { return device; }
  void set_device(int d) { device = d; }
  void report(char const* what, char const* why) noexcept { reports.push_back(std::string(what) + ": " + why); }
  std::unique_ptr<fake_gemm_plan> make_plan(mpx::detail::lt_problem const& p, int, std::size_t, void const* a_scale,
                                            void const* b_scale) {
    log.push_back("make_plan");
    auto plan = std::make_unique<fake_gemm_plan>();
    plan->problem = p;
    plan->a_scale = a_scale;
    plan->b_scale = b_scale;
    return plan;
  }
  //! Logged with whether this thread holds the plan's lock.
  void set_scale_pointers(fake_gemm_plan const& plan, void const*, void const*) {
    log.push_back(plan.call_mutex.held_here() ? "scales under the lock" : "scales without the lock");
  }

  std::size_t count(std::string const& entry) const {
    std::size_t n = 0;
    for (auto const& e : log) n += e == entry;
    return n;
  }
  //! Where `entry` first is in the log (the log's length if nowhere), for order checks.
  std::size_t first(std::string const& entry) const {
    std::size_t i = 0;
    while (i < log.size() && log[i] != entry) ++i;
    return i;
  }
};

using gemm_resources = mpx::detail::lt_resources<fake_gemm_backend>;

void* stream_at(std::uintptr_t address) { return reinterpret_cast<void*>(address); }

//! Two live streams, of ids 11 and 12.
std::pair<void*, void*> two_streams(fake_gemm_backend& b) {
  void* const s1 = stream_at(0x100);
  void* const s2 = stream_at(0x200);
  b.ids = {{s1, 11}, {s2, 12}};
  return {s1, s2};
}

}  // namespace

TEST_CASE("gemm resources: a handle per device, made once and never during a capture", "[gemm][resources]") {
  gemm_resources r;
  fake_gemm_backend& b = r.backend();
  CHECK_THROWS_TYPE_WITH(r.handle(0, true), mpx::invalid_argument,
                         Catch::Contains("run one gemm (or one eager step) on this stream before capturing"));
  CHECK(b.log.empty());  // nothing was made for the capture
  int const h0 = r.handle(0, false);
  CHECK(r.handle(0, false) == h0);
  CHECK(r.handle(0, true) == h0);  // once made, a capture may use it
  int const h1 = r.handle(1, false);
  CHECK(h1 != h0);
  CHECK(b.count("create_handle 0") == 1);
  CHECK(b.count("create_handle 1") == 1);
}

TEST_CASE("gemm resources: a workspace per stream, found again by a capture on its handle", "[gemm][resources]") {
  gemm_resources r;
  fake_gemm_backend& b = r.backend();
  auto const [s1, s2] = two_streams(b);

  // A capture on a stream no eager product used is refused, and nothing is allocated.
  CHECK_THROWS_TYPE_WITH(r.workspace_for(0, s1, true), mpx::invalid_argument, Catch::Contains("before capturing"));
  CHECK(b.live.empty());

  auto const w1 = r.workspace_for(0, s1, false);
  CHECK(w1.bytes == std::size_t{32} << 20);
  CHECK(r.workspace_for(0, s1, false).data == w1.data);  // the same stream: the same workspace
  auto const w2 = r.workspace_for(0, s2, false);
  CHECK(w2.data != w1.data);  // two streams that may run at once never share one
  CHECK(r.workspace_for(0, s1, true).data == w1.data);  // a capture finds it by the handle
  CHECK(r.workspace_for(1, s1, false).bytes == std::size_t{4} << 20);  // the device's own size
  CHECK(b.live.size() == 3);
  CHECK(r.workspace_bytes() == (std::size_t{32} << 21) + (std::size_t{4} << 20));
  CHECK(b.count("wait_for_device 0") == 0);  // nothing was inherited

  // A failed allocation leaves nothing behind, and the next product tries again.
  void* const s3 = stream_at(0x300);
  b.ids[s3] = 13;
  b.fail_allocation = true;
  CHECK_THROWS_AS(r.workspace_for(0, s3, false), mpx::cuda_error);
  CHECK_THROWS_AS(r.workspace_for(0, s3, true), mpx::invalid_argument);  // none to capture with
  b.fail_allocation = false;
  CHECK(r.workspace_for(0, s3, false).data != nullptr);
  CHECK(b.live.size() == 4);
}

TEST_CASE("gemm resources: a destroyed stream's workspace is waited for before a new stream reuses or frees it",
          "[gemm][resources]") {
  gemm_resources r;
  fake_gemm_backend& b = r.backend();
  void* const handle = stream_at(0x100);
  b.ids[handle] = 11;
  auto const old = r.workspace_for(0, handle, false);

  // The stream is destroyed without forget_stream and its handle comes back for stream 21:
  // the new stream takes the workspace over, after the device has finished the old one's work.
  b.ids[handle] = 21;
  auto const taken = r.workspace_for(0, handle, false);
  CHECK(taken.data == old.data);
  CHECK(b.count("wait_for_device 0") == 1);
  CHECK(b.live.size() == 1);
  CHECK(r.workspace_for(0, handle, false).data == old.data);
  CHECK(b.count("wait_for_device 0") == 1);  // waited once, not on every product

  // Stream 31 made its workspace under another handle; then a destroyed stream's handle
  // names it: the dead stream's workspace can never be used again, and is freed after a wait.
  void* const other = stream_at(0x200);
  b.ids[other] = 31;
  auto const own = r.workspace_for(0, other, false);
  b.log.clear();
  b.ids[handle] = 31;
  CHECK(r.workspace_for(0, handle, false).data == own.data);
  CHECK(b.count("wait_for_device 0") == 1);
  CHECK(b.count("free on 0") == 1);
  CHECK(b.first("wait_for_device 0") < b.first("free on 0"));  // waited for before it is freed
  CHECK(b.live.size() == 1);
  CHECK(b.double_frees == 0);
}

TEST_CASE("gemm resources: forgetting a stream waits for it and frees its workspace, and never throws",
          "[gemm][resources]") {
  gemm_resources r;
  fake_gemm_backend& b = r.backend();
  auto const [s1, s2] = two_streams(b);
  b.device = 1;
  r.workspace_for(1, s1, false);
  b.device = 0;
  r.workspace_for(0, s2, false);

  r.forget_stream(s1);
  CHECK(b.log.back() == "free on 1");  // on the workspace's device,
  CHECK(b.count("wait_for_stream") == 1);  // after the stream's work,
  CHECK(b.first("wait_for_stream") < b.first("free on 1"));
  CHECK(b.device == 0);                    // and the caller's device is put back
  CHECK(b.live.size() == 1);
  CHECK_THROWS_AS(r.workspace_for(1, s1, true), mpx::invalid_argument);  // no capture finds it now

  std::size_t const before = b.log.size();
  r.forget_stream(s1);                // again: nothing left to free
  r.forget_stream(stream_at(0x999));  // a stream whose id cannot be asked for: nothing
  CHECK(b.log.size() == before);

  // A failed wait is reported, not thrown, and the workspace is not freed under the work.
  b.fail_stream_wait = true;
  r.forget_stream(s2);
  REQUIRE(b.reports.size() == 1);
  CHECK_THAT(b.reports[0], Catch::StartsWith("freeing a stream's cuBLASLt workspace: ") &&
                               Catch::Contains("illegal memory access"));
  CHECK(b.live.size() == 1);
  CHECK(b.device == 0);

  // A failed free on another device: reported, and the caller's device put back.
  void* const s3 = stream_at(0x300);
  b.ids[s3] = 13;
  b.fail_stream_wait = false;
  b.device = 1;
  r.workspace_for(1, s3, false);
  b.device = 0;
  b.fail_free = true;
  r.forget_stream(s3);
  CHECK(b.reports.size() == 2);
  CHECK(b.device == 0);
  CHECK(b.double_frees == 0);
}

TEST_CASE("gemm resources: a plan per problem, made once with the first call's scales", "[gemm][resources]") {
  gemm_resources r;
  fake_gemm_backend& b = r.backend();
  mpx::detail::lt_problem p;
  p.a_rows = p.c_rows = 8;
  p.a_cols = p.b_rows = 16;
  p.b_cols = p.c_cols = 4;
  int const s1 = 1, s2 = 2;
  auto const& first = r.plan(p, 1, 1024, &s1, &s2);
  CHECK(first.a_scale == &s1);
  CHECK(first.b_scale == &s2);
  CHECK(&r.plan(p, 1, 1024) == &first);
  CHECK(b.count("make_plan") == 1);
  // Any field of the key makes another problem: an alignment, a scaling, alpha's place.
  auto q = p;
  q.align_c = 2;
  auto s = p;
  s.a_scaling = mpx::detail::lt_operand_scaling::vec128;
  auto t = p;
  t.alpha_beta_on_device = true;
  CHECK(&r.plan(q, 1, 1024) != &first);
  CHECK(&r.plan(s, 1, 1024) != &first);
  CHECK(&r.plan(t, 1, 1024) != &first);
  CHECK(b.count("make_plan") == 4);
}

TEST_CASE("gemm resources: a product asks for its workspace first, and sets its scales under the plan's lock",
          "[gemm][resources]") {
  gemm_resources r;
  fake_gemm_backend& b = r.backend();
  auto const [s1, s2] = two_streams(b);
  mpx::detail::lt_problem p;
  p.a_rows = p.c_rows = 8;
  p.a_cols = p.b_rows = 16;
  p.b_cols = p.c_cols = 4;
  int launches = 0;
  auto const launch = [&](int handle, fake_gemm_plan const& plan, mpx::detail::lt_workspace ws) {
    bool const locked = plan.call_mutex.held_here();
    b.log.push_back(std::string("launch with handle ") + std::to_string(handle) +
                    (ws.data ? " and a workspace" : " and no workspace") + (locked ? ", locked" : ", unlocked"));
    ++launches;
  };
  // Without scales: workspace, handle, plan, launch; the lock is not taken.
  r.run(p, s1, false, {}, launch);
  CHECK(b.log == std::vector<std::string>{"allocate 33554432 on 0", "create_handle 0", "make_plan",
                                          "launch with handle 1 and a workspace, unlocked"});
  // With scales: set, then launched, both under the plan's lock; the same plan and handle.
  b.log.clear();
  int const a_scale = 1, b_scale = 2;
  mpx::detail::lt_operand_scales scales;
  scales.a = &a_scale;
  scales.b = &b_scale;
  r.run(p, s1, false, scales, launch);
  CHECK(b.log == std::vector<std::string>{"scales under the lock", "launch with handle 1 and a workspace, locked"});
  // A capture on a stream that never ran a product eagerly is refused before anything is
  // made or launched: of a new problem too, whose plan a handle-first order would make.
  b.log.clear();
  auto q = p;
  q.c_cols = q.b_cols = 12;
  CHECK_THROWS_AS(r.run(q, s2, true, scales, launch), mpx::error);
  CHECK(b.log.empty());
  CHECK(launches == 2);
  // Once it has, the capture runs on what the eager product made.
  r.run(p, s2, false, {}, launch);
  b.log.clear();
  r.run(p, s2, true, scales, launch);
  CHECK(b.log == std::vector<std::string>{"scales under the lock", "launch with handle 1 and a workspace, locked"});
}

TEST_CASE("gemm resources: release frees everything after each device's work and starts a new generation",
          "[gemm][resources]") {
  gemm_resources r;
  fake_gemm_backend& b = r.backend();
  auto const [s1, s2] = two_streams(b);
  r.handle(0, false);
  r.handle(1, false);
  r.workspace_for(0, s1, false);
  r.workspace_for(1, s2, false);
  mpx::detail::lt_problem p;
  r.plan(p, 1, 1024);
  CHECK(r.generation() == 0);
  b.device = 0;  // the caller's; release visits device 0, then device 1

  b.log.clear();
  r.release();
  CHECK(b.live.empty());
  CHECK(b.count("wait_for_device 0") == 1);
  CHECK(b.count("wait_for_device 1") == 1);
  CHECK(b.count("free on 0") == 1);
  CHECK(b.count("free on 1") == 1);
  CHECK(b.first("wait_for_device 0") < b.first("free on 0"));  // each device's work done first
  CHECK(b.first("wait_for_device 1") < b.first("free on 1"));
  CHECK(b.count("destroy_handle 1") == 1);
  CHECK(b.count("destroy_handle 2") == 1);
  CHECK(b.device == 0);  // the caller's device, put back
  CHECK(r.workspace_bytes() == 0);
  CHECK(r.generation() == 1);  // a graph captured before holds freed workspaces

  // Everything is made again on demand; a capture first is refused, as on a cold stream.
  CHECK_THROWS_AS(r.workspace_for(0, s1, true), mpx::invalid_argument);
  CHECK_THROWS_AS(r.handle(0, true), mpx::invalid_argument);
  r.plan(p, 1, 1024);
  CHECK(b.count("make_plan") == 1);
  CHECK(b.double_frees == 0);

  // A release that fails part way: the error comes through, the caller's device is put
  // back, and the generation has moved on all the same (what graphs held may be gone).
  r.workspace_for(0, s1, false);
  r.workspace_for(1, s2, false);
  b.fail_free = true;
  CHECK_THROWS_AS(r.release(), mpx::cuda_error);
  CHECK(b.device == 0);
  CHECK(r.generation() == 2);
  b.fail_free = false;
}

TEST_CASE("a gemm's cuBLASLt problem: the operands swapped into column-major terms, its key and its refusal",
          "[gemm][resources]") {
  using mpx::detail::lt_operand_scaling;
  // A [3, 5, 7] transposed (each [K = 5, M = 7]) times B [5, 4]: a batch of 3 with a shared B.
  mpx::detail::gemm_dims d;
  d.batch = 3;
  d.m = 7;
  d.n = 4;
  d.k = 5;
  d.stride_a = 35;
  d.stride_c = 28;
  auto const* a = reinterpret_cast<mpx::half const*>(std::uintptr_t{0x10000});
  auto const* b = reinterpret_cast<mpx::bfloat16 const*>(std::uintptr_t{0x20008});
  auto const* c = reinterpret_cast<float const*>(std::uintptr_t{0x30000});
  auto const p = mpx::detail::lt_problem_of<float>(2, d, true, false, a, b, c);
  CHECK(p.device == 2);
  CHECK(p.a_type == CUDA_R_16BF);  // cuBLASLt's A is mpx's B
  CHECK(p.b_type == CUDA_R_16F);
  CHECK(p.c_type == CUDA_R_32F);
  CHECK_FALSE(p.half_sums);
  CHECK_FALSE(p.transpose_a);
  CHECK(p.transpose_b);
  CHECK(p.batch == 3);  // a transposed A does not fold into one tall product
  CHECK((p.a_rows == 4 && p.a_cols == 5 && p.lda == 4 && p.stride_a == 0));
  CHECK((p.b_rows == 7 && p.b_cols == 5 && p.ldb == 7 && p.stride_b == 35));
  CHECK((p.c_rows == 4 && p.c_cols == 7 && p.ldc == 4 && p.stride_c == 28));
  CHECK(p.align_a == 8);    // B's address
  CHECK(p.align_b == 2);    // A's batch stride: 35 halves
  CHECK(p.align_c == 16);   // C's batch stride: 28 floats
  CHECK_FALSE(p.alpha_beta_on_device);
  CHECK(mpx::detail::lt_problem_of<float>(2, d, true, false, a, b, c) == p);  // the same product, the same key

  // Not transposed, the shared-B batch is one tall product.
  auto const tall = mpx::detail::lt_problem_of<mpx::half>(0, d, false, false, a, b, c);
  CHECK(tall.batch == 1);
  CHECK(tall.c_cols == 21);
  CHECK(tall.half_sums);

  mpx::detail::lt_operand_scales scales;
  scales.a_scaling = lt_operand_scaling::vec16;
  scales.b_scaling = lt_operand_scaling::tile128;
  float const alpha_beta[2] = {1, 0};
  scales.device_alpha_beta = alpha_beta;
  auto const scaled = mpx::detail::lt_problem_of<float>(0, d, true, false, a, b, c, scales);
  CHECK(scaled.a_scaling == lt_operand_scaling::vec16);
  CHECK(scaled.b_scaling == lt_operand_scaling::tile128);
  CHECK(scaled.alpha_beta_on_device);
  CHECK(((scaled < p) != (p < scaled)));  // a different key
  CHECK_FALSE((scaled.a_scaled || scaled.b_scaled));
  // A product whose calls give scale pointers (fp8's per-tensor scales) has its scale
  // modes set before the heuristic: not the plan of the same product without them.
  float const scale_values[2] = {0.5f, 2.0f};
  mpx::detail::lt_operand_scales with_pointers;
  with_pointers.a = &scale_values[0];
  auto const a_pointer = mpx::detail::lt_problem_of<float>(2, d, true, false, a, b, c, with_pointers);
  CHECK((a_pointer.a_scaled && !a_pointer.b_scaled));
  CHECK_FALSE(a_pointer == p);
  CHECK(((a_pointer < p) != (p < a_pointer)));
  with_pointers.b = &scale_values[1];
  auto const both_pointers = mpx::detail::lt_problem_of<float>(2, d, true, false, a, b, c, with_pointers);
  CHECK((both_pointers.a_scaled && both_pointers.b_scaled));
  CHECK_FALSE(both_pointers == a_pointer);
  // Other pointers of the same kind: the same plan (every call sets its own).
  float const other_values[2] = {4.0f, 8.0f};
  with_pointers.a = &other_values[0];
  with_pointers.b = &other_values[1];
  CHECK(mpx::detail::lt_problem_of<float>(2, d, true, false, a, b, c, with_pointers) == both_pointers);

  // What a product cuBLASLt has no algorithm for says, in mpx's terms (M x N x K, mpx's A).
  CHECK(mpx::detail::lt_no_algorithm_message(scaled, "CUBLAS_STATUS_NOT_SUPPORTED") ==
        "mpx::gemm: cuBLASLt has no algorithm for this product (M x N x K = 7 x 4 x 5, batch 3; A half (128x128 "
        "block scales), B bfloat16 (1x16 UE4M3 block scales), C float, alpha on the device): "
        "CUBLAS_STATUS_NOT_SUPPORTED");
  auto e2m1 = p;
  e2m1.a_type = CUDA_R_4F_E2M1;
  e2m1.b_type = CUDA_R_8F_E4M3;
  e2m1.c_type = CUDA_R_16BF;
  CHECK_THAT(mpx::detail::lt_no_algorithm_message(e2m1, "X"),
             Catch::Contains("A e4m3, B e2m1, C bfloat16): X") && Catch::Contains("7 x 4 x 5"));

  // Extents past cuBLASLt's int32 are refused before anything is asked of it.
  auto huge = d;
  huge.batch = 1;
  huge.k = std::int64_t{1} << 31;
  CHECK_THROWS_TYPE_WITH(mpx::detail::lt_problem_of<float>(0, huge, false, false, a, b, c), mpx::invalid_argument,
                         Catch::Contains("cuBLASLt takes extents up to 2^31 - 1") && Catch::Contains("K = 2147483648"));
}

TEST_CASE("a gemm's cuBLASLt plan settings: compute type, transposes, pointer mode and alignments",
          "[gemm][resources]") {
  mpx::detail::lt_problem p;
  p.transpose_b = true;
  p.align_a = 4;
  p.align_b = 8;
  p.align_c = 16;
  auto const s = mpx::detail::lt_plan_settings_of(p, nullptr, nullptr);
  CHECK_FALSE(s.half_compute);  // float sums, never TF32
  CHECK_FALSE(s.transpose_a);
  CHECK(s.transpose_b);
  CHECK_FALSE(s.device_pointers);
  CHECK_FALSE(s.set_scales);  // a plain product sets no scale modes
  // The problem's alignments become the heuristic's, D's being C's (the product is in place).
  CHECK((s.align_a == 4 && s.align_b == 8 && s.align_c == 16 && s.align_d == 16));

  auto half = p;
  half.half_sums = true;
  half.transpose_a = true;
  half.transpose_b = false;
  half.alpha_beta_on_device = true;
  auto const h = mpx::detail::lt_plan_settings_of(half, nullptr, nullptr);
  CHECK(h.half_compute);
  CHECK(h.transpose_a);
  CHECK_FALSE(h.transpose_b);
  CHECK(h.device_pointers);  // alpha and beta read from the device
}

TEST_CASE("a gemm's cuBLASLt plan settings: split-K sums in C's type only when C is float", "[gemm][resources]") {
  using mpx::detail::lt_split_k_sums;
  mpx::detail::lt_problem p;
  p.c_type = CUDA_R_32F;
  CHECK(mpx::detail::lt_plan_settings_of(p, nullptr, nullptr).split_k_sums == lt_split_k_sums::any);
  // A 16-bit C would round every partial sum: only none or the compute type's sums.
  for (cudaDataType_t const c : {CUDA_R_16F, CUDA_R_16BF}) {
    p.c_type = c;
    CHECK(mpx::detail::lt_plan_settings_of(p, nullptr, nullptr).split_k_sums == lt_split_k_sums::compute_type);
    p.half_sums = true;  // half sums as well: C's type is not the compute type's rule
    CHECK(mpx::detail::lt_plan_settings_of(p, nullptr, nullptr).split_k_sums == lt_split_k_sums::compute_type);
    p.half_sums = false;
  }
}

TEST_CASE("a gemm's cuBLASLt plan settings: scales set before the heuristic whenever the product has any",
          "[gemm][resources]") {
  using mpx::detail::lt_operand_scaling;
  int const a_scale = 0, b_scale = 0;
  mpx::detail::lt_problem p;
  p.a_type = p.b_type = CUDA_R_8F_E4M3;

  // fp8 with tensor scales: a pointer on either operand is enough.
  auto const only_a = mpx::detail::lt_plan_settings_of(p, &a_scale, nullptr);
  CHECK(only_a.set_scales);
  CHECK((only_a.a_scale == &a_scale && only_a.b_scale == nullptr));
  CHECK((only_a.a_scaling == lt_operand_scaling::tensor && only_a.b_scaling == lt_operand_scaling::tensor));
  auto const only_b = mpx::detail::lt_plan_settings_of(p, nullptr, &b_scale);
  CHECK(only_b.set_scales);
  CHECK((only_b.a_scale == nullptr && only_b.b_scale == &b_scale));
  CHECK_FALSE(mpx::detail::lt_plan_settings_of(p, nullptr, nullptr).set_scales);

  // Block scales on either operand set the modes even before a call's pointers are known.
  auto blocks_a = p;
  blocks_a.a_scaling = lt_operand_scaling::vec32;
  auto const a = mpx::detail::lt_plan_settings_of(blocks_a, nullptr, nullptr);
  CHECK(a.set_scales);
  CHECK((a.a_scaling == lt_operand_scaling::vec32 && a.b_scaling == lt_operand_scaling::tensor));
  auto blocks_b = p;
  blocks_b.b_scaling = lt_operand_scaling::tile128;
  auto const b = mpx::detail::lt_plan_settings_of(blocks_b, &a_scale, &b_scale);
  CHECK(b.set_scales);
  CHECK((b.a_scaling == lt_operand_scaling::tensor && b.b_scaling == lt_operand_scaling::tile128));
  CHECK((b.a_scale == &a_scale && b.b_scale == &b_scale));
}

TEST_CASE("a gemm's cuBLASLt plan: what the heuristic's answer comes to", "[gemm][resources]") {
  using mpx::detail::lt_heuristic_outcome;
  using mpx::detail::lt_heuristic_outcome_of;
  CHECK(lt_heuristic_outcome_of(false, 1, true) == lt_heuristic_outcome::found);
  // NOT_SUPPORTED from the query is a refusal with its status, whatever it returned.
  CHECK(lt_heuristic_outcome_of(true, 1, true) == lt_heuristic_outcome::unsupported);
  CHECK(lt_heuristic_outcome_of(true, 0, false) == lt_heuristic_outcome::unsupported);
  // An empty answer is NOT_SUPPORTED, whatever its (unset) result's state.
  CHECK(lt_heuristic_outcome_of(false, 0, true) == lt_heuristic_outcome::none_found);
  CHECK(lt_heuristic_outcome_of(false, 0, false) == lt_heuristic_outcome::none_found);
  CHECK(lt_heuristic_outcome_of(false, -1, true) == lt_heuristic_outcome::none_found);
  // An algorithm whose state failed is refused with that state.
  CHECK(lt_heuristic_outcome_of(false, 1, false) == lt_heuristic_outcome::failed);
}
