// The communicator between GPUs (dist/nccl_communicator.hpp) without a GPU: what
// basic_nccl_communicator does around NCCL's and CUDA's calls (the order it makes and
// frees things in, abort or destroy, the events that place a collective between the
// caller's work before and after it, the host values' marshalling, the timeouts),
// against a backend of the test's own. It records every call, can be told to fail any
// of them or to leave the collectives enqueued from some point on never complete (a
// hung peer), and plays the other ranks: what they put on the wire is the test's.
// Streams are numbers (the caller's is 7, the communicator's 101), "device" memory is
// host memory, and the kernels of a max or min run on the host executor.
// mpx::nccl_communicator runs this same code with NCCL and CUDA (test_nccl.cu).
#include "../support/testing.hpp"

#include <mpx/dist/basic_nccl_communicator.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using mpx_test::eventually;
using mpx_test::thrown_message;

using namespace std::chrono_literals;

//! A caller's executor: its stream, which may be capturing a CUDA graph.
struct nccl_fake_executor {
  int stream_id = 7;
  bool capturing_graph = false;
  [[nodiscard]] int stream() const { return stream_id; }
  [[nodiscard]] bool capturing() const { return capturing_graph; }
};

struct nccl_fake_id {
  char internal[16];
};

//! A collective's completion: `never` once it was recorded behind a hung collective.
struct nccl_fake_event {
  int id = 0;
  bool never = false;
};

//! What the backend did and is told to do, shared by its copies. Calls may come from the
//! watchdog's thread too: everything is read and written under `mutex`.
struct nccl_fake_world {
  std::mutex mutex;
  std::vector<std::string> log;
  std::vector<std::string> reports;
  std::map<std::string, int> fail_in;  // a call's name -> the how-manieth next such call fails
  std::multiset<std::string> live;     // made and not freed
  int device = 3;
  int comm_stream = 0;
  int next_stream = 101, next_event = 1;
  int rank = -1, size = 0;
  nccl_fake_id id_seen{};
  bool hang = false;   // the collectives enqueued from now on never complete
  bool stuck = false;  // the communicator's stream holds one that never completes
  bool replay_hangs = false;  // a caller's stream holds a graph replay whose collectives never complete
  bool aborted = false;
  std::string async;  // NCCL's asynchronous error, "" for none
  std::string async_once_enqueued;  // becomes `async` when the next collective is enqueued
  std::atomic<int> watchdog_device{-1};
  std::vector<std::shared_ptr<nccl_fake_event>> events;  // every one made
  void* last_data = nullptr;
  //! What each other rank puts on the wire in the next collectives: doubles' bits, or keys.
  std::map<int, std::vector<std::uint64_t>> peers;

  //! Logs `entry`, then throws as the real call would when `name` was told to fail.
  void call(std::string const& entry, std::string const& name, bool nccl) {
    log.push_back(entry);
    auto const it = fail_in.find(name);
    if (it == fail_in.end() || --it->second != 0) return;
    fail_in.erase(it);
    if (nccl)
      throw mpx::collective_error("mpx::nccl_communicator: " + name + " failed: unhandled system error (fake)", {});
    throw mpx::cuda_error("mpx: CUDA call failed: " + name + " returned cudaErrorIllegalAddress (fake)", 700);
  }
  //! Calls `name` that makes `thing`, alive once the call succeeded.
  void make(std::string const& thing, std::string const& entry, std::string const& name, bool nccl) {
    call(entry, name, nccl);
    live.insert(thing);
  }
  //! Calls `name` that frees `thing`: gone whether or not the call then fails, as for the
  //! real calls (nothing is left to free again). One not alive is logged as such.
  void free(std::string const& thing, std::string const& entry, std::string const& name, bool nccl) {
    if (auto const it = live.find(thing); it != live.end()) live.erase(it);
    else log.push_back(thing + " freed again");
    call(entry, name, nccl);
  }
  void fail(std::string const& name, int nth = 1) {
    std::lock_guard lock(mutex);
    fail_in[name] = nth;
  }
  std::vector<std::string> calls() {
    std::lock_guard lock(mutex);
    return log;
  }
  void forget_calls() {
    std::lock_guard lock(mutex);
    log.clear();
    next_event = 1;
  }
  std::size_t count(std::string const& entry) {
    std::lock_guard lock(mutex);
    return static_cast<std::size_t>(std::count(log.begin(), log.end(), entry));
  }
  //! The hung collectives complete after all (a late peer).
  void complete() {
    std::lock_guard lock(mutex);
    hang = stuck = replay_hangs = false;
    for (auto const& e : events) e->never = false;
  }
  //! Every rank's part of a collective but this one's, in rank order, for a word `i`.
  template <class Combine>
  void with_peers(std::size_t i, Combine&& combine) {
    for (auto const& [r, words] : peers)
      if (r != rank && i < words.size()) combine(words[i]);
  }
  void enqueue(std::string const& entry, std::string const& name) {
    call(entry, name, true);
    if (hang) stuck = true;
    if (!async_once_enqueued.empty()) async = std::move(async_once_enqueued);
  }
};

std::string on(int stream) { return " on s" + std::to_string(stream); }

//! The test's backend: every call through nccl_fake_world.
struct nccl_fake_backend {
  using executor_type = nccl_fake_executor;
  using space = mpx::host_space;
  using stream_type = int;
  using comm_type = int;
  using unique_id = nccl_fake_id;
  using event = std::shared_ptr<nccl_fake_event>;

  //! The device buffer: words on the host, its free logged.
  class device_buffer {
   public:
    device_buffer() = default;
    device_buffer(nccl_fake_world* w, std::size_t words) : w_(w), words_(std::make_unique<std::uint64_t[]>(words)) {}
    device_buffer(device_buffer&& other) noexcept : w_(other.w_), words_(std::move(other.words_)) {}
    device_buffer& operator=(device_buffer&& other) noexcept {
      free();
      w_ = other.w_;
      words_ = std::move(other.words_);
      return *this;
    }
    ~device_buffer() { free(); }
    [[nodiscard]] std::uint64_t* data() const noexcept { return words_.get(); }

   private:
    void free() noexcept {
      if (!words_) return;
      std::lock_guard lock(w_->mutex);
      w_->free("device buffer", "free device buffer", "free_device_buffer", false);
      words_.reset();
    }
    nccl_fake_world* w_ = nullptr;
    std::unique_ptr<std::uint64_t[]> words_;
  };

  nccl_fake_world* w = nullptr;

  mpx::host_executor executor_on(int stream) {
    std::lock_guard lock(w->mutex);
    w->call("kernels" + on(stream), "kernels", false);
    return {};
  }

  nccl_fake_id make_unique_id() {
    std::lock_guard lock(w->mutex);
    w->call("make_unique_id", "make_unique_id", true);
    nccl_fake_id id{};
    std::strcpy(id.internal, "rank 0's id");
    return id;
  }
  int init(int size, nccl_fake_id const& id, int rank) {
    std::lock_guard lock(w->mutex);
    w->make("comm", "init rank " + std::to_string(rank) + " of " + std::to_string(size), "init", true);
    w->rank = rank;
    w->size = size;
    w->id_seen = id;
    return 55;
  }
  void destroy(int comm) {
    std::lock_guard lock(w->mutex);
    w->free("comm", "destroy comm " + std::to_string(comm), "destroy", true);
  }
  void abort(int comm) {
    std::lock_guard lock(w->mutex);
    w->aborted = true;  // which ends a hung collective
    w->free("comm", "abort comm " + std::to_string(comm), "abort", true);
  }
  std::string async_error(int) {
    std::lock_guard lock(w->mutex);
    return w->async;
  }

  int current_device() {
    std::lock_guard lock(w->mutex);
    w->call("current_device", "current_device", false);
    return w->device;
  }
  void enter_watchdog_thread(int device) noexcept { w->watchdog_device = device; }

  int create_stream() {
    std::lock_guard lock(w->mutex);
    int const made = w->next_stream++;
    w->make("stream", "create_stream -> s" + std::to_string(made), "create_stream", false);
    w->comm_stream = made;
    return made;
  }
  void destroy_stream(int stream) {
    std::lock_guard lock(w->mutex);
    w->free("stream", "destroy_stream s" + std::to_string(stream), "destroy_stream", false);
  }
  bool stream_done(int stream) {
    std::lock_guard lock(w->mutex);
    return w->aborted || !(stream == w->comm_stream && w->stuck);
  }

  event make_event() {
    std::lock_guard lock(w->mutex);
    int const id = w->next_event++;
    w->call("event e" + std::to_string(id), "make_event", false);
    return w->events.emplace_back(std::make_shared<nccl_fake_event>(nccl_fake_event{id}));
  }
  void record(event const& e, int stream) {
    std::lock_guard lock(w->mutex);
    w->call("record e" + std::to_string(e->id) + on(stream), "record", false);
    if ((stream == w->comm_stream && w->stuck) || (stream != w->comm_stream && w->replay_hangs)) e->never = true;
  }
  void wait(int stream, event const& e) {
    std::lock_guard lock(w->mutex);
    w->call("s" + std::to_string(stream) + " waits for e" + std::to_string(e->id), "wait", false);
  }
  bool done(event const& e) {
    std::lock_guard lock(w->mutex);
    return w->aborted || !e->never;
  }

  device_buffer make_device_buffer(int stream, std::size_t words) {
    {
      std::lock_guard lock(w->mutex);
      w->make("device buffer", "device buffer of " + std::to_string(words) + " words" + on(stream), "device_buffer",
              false);
    }
    return device_buffer(w, words);
  }
  std::uint64_t* allocate_pinned(std::size_t words) {
    std::lock_guard lock(w->mutex);
    w->make("pinned", "allocate pinned " + std::to_string(words) + " words", "allocate_pinned", false);
    return new std::uint64_t[words]();
  }
  void free_pinned(std::uint64_t* pinned) {
    std::lock_guard lock(w->mutex);
    delete[] pinned;
    w->free("pinned", "free pinned", "free_pinned", false);
  }
  void copy_to_device(std::uint64_t* to, std::uint64_t const* from, std::size_t words, int stream) {
    std::lock_guard lock(w->mutex);
    w->call("copy " + std::to_string(words) + " words to device" + on(stream), "copy_to_device", false);
    std::copy(from, from + words, to);
  }
  void copy_to_host(std::uint64_t* to, std::uint64_t const* from, std::size_t words, int stream) {
    std::lock_guard lock(w->mutex);
    w->call("copy " + std::to_string(words) + " words to host" + on(stream), "copy_to_host", false);
    std::copy(from, from + words, to);
  }

  void all_reduce_sum(void* data, std::size_t n, mpx::dtype_id d, int, int stream, std::string const&) {
    std::lock_guard lock(w->mutex);
    w->enqueue("all_reduce sum of " + std::to_string(n) + " " + std::string(mpx::to_string(d)) + on(stream),
               "all_reduce");
    w->last_data = data;
  }
  template <class Key>
  void all_reduce_max(Key* keys, std::size_t n, int, int stream, std::string const&) {
    std::lock_guard lock(w->mutex);
    w->enqueue("all_reduce max of " + std::to_string(n) + (sizeof(Key) == 4 ? " uint32" : " uint64") + " keys" +
                   on(stream),
               "all_reduce");
    for (std::size_t i = 0; i < n; ++i)
      w->with_peers(i, [&](std::uint64_t key) { keys[i] = std::max(keys[i], static_cast<Key>(key)); });
  }
  void all_reduce_float64_sum(std::uint64_t* words, std::size_t n, int, int stream, std::string const&) {
    std::lock_guard lock(w->mutex);
    w->enqueue("all_reduce sum of " + std::to_string(n) + " float64" + on(stream), "all_reduce");
    for (std::size_t i = 0; i < n; ++i) {
      double sum = mpx::detail::bit_cast<double>(words[i]);
      w->with_peers(i, [&](std::uint64_t bits) { sum += mpx::detail::bit_cast<double>(bits); });
      words[i] = mpx::detail::bit_cast<std::uint64_t>(sum);
    }
  }
  void all_gather_float64(std::uint64_t const* mine, std::uint64_t* all, std::size_t n, int, int stream,
                          std::string const&) {
    std::lock_guard lock(w->mutex);
    w->enqueue("all_gather " + std::to_string(n) + " float64" + on(stream), "all_gather");
    // NCCL's in-place all-gather: this rank's part already where it belongs.
    if (mine != all + n * static_cast<std::size_t>(w->rank)) w->log.push_back("all_gather not in place");
    for (auto const& [r, words] : w->peers)
      if (r != w->rank) std::copy(words.begin(), words.begin() + static_cast<std::ptrdiff_t>(n), all + r * n);
  }
  void broadcast_bytes(void* data, std::size_t bytes, int root, int, int stream, std::string const&) {
    std::lock_guard lock(w->mutex);
    w->enqueue("broadcast " + std::to_string(bytes) + " bytes from " + std::to_string(root) + on(stream), "broadcast");
    w->last_data = data;
  }

  void report(char const* what, char const* why) noexcept {
    std::lock_guard lock(w->mutex);
    w->reports.push_back(std::string(what) + ": " + why);
  }
};

using nccl_fake_communicator = mpx::basic_nccl_communicator<nccl_fake_backend>;
static_assert(mpx::communicator<nccl_fake_communicator>);

//! A communicator on `w`: rank `rank` of `size`, collectives timed out after `timeout`.
nccl_fake_communicator make_communicator_on(nccl_fake_world& w, int rank = 0, int size = 2,
                                            std::chrono::milliseconds timeout = 1h) {
  return {nccl_fake_executor{}, nccl_fake_id{}, rank, size, {timeout}, nccl_fake_backend{&w}};
}

//! Rank 0 of 2 on a world of its own, a caller on stream 7, and four floats for the
//! collectives: a test case's fixture.
struct nccl_setup {
  nccl_fake_world w;
  nccl_fake_communicator c;
  nccl_fake_executor const exec{};
  std::vector<float> data = {1, 2, 3, 4};
  mpx::tensor_view<float, mpx::host_space> const x{data.data(), mpx::shape{4}};
  explicit nccl_setup(std::chrono::milliseconds timeout = 1h)
      : c(make_communicator_on(w, 0, 2, timeout)) {}
};
//! The same, its collectives timed out after 50 ms.
struct nccl_setup_50ms : nccl_setup {
  nccl_setup_50ms() : nccl_setup(50ms) {}
};

using log_lines = std::vector<std::string>;

//! The calls a collective's ordering makes around `middle` (its calls on the communicator's
//! stream), `done` being its completion event: made first, then the ready event, recorded
//! on the caller's stream; the communicator's stream waits for it; the collective; done
//! recorded after it; the caller's stream waits for done unless `deferred`.
log_lines ordered_around(log_lines const& middle, bool deferred = false) {
  log_lines out = {"event e1", "event e2", "record e2 on s7", "s101 waits for e2"};
  out.insert(out.end(), middle.begin(), middle.end());
  out.push_back("record e1 on s101");
  if (!deferred) out.push_back("s7 waits for e1");
  return out;
}

//! The calls that end a communicator (no timeout) whose work `hang(w, c)` left hanging,
//! when that work completes 20 ms into the destructor's wait (a late peer).
template <class Hang>
log_lines end_after_late_completion(Hang&& hang) {
  nccl_fake_world w;
  std::thread late;
  {
    auto c = make_communicator_on(w, 0, 2, 1h);
    hang(w, c);
    w.forget_calls();
    late = std::thread([&w] {
      std::this_thread::sleep_for(20ms);
      w.complete();
    });
  }
  late.join();
  return w.calls();
}

//! The max (or min) of two values as the communicator's must be, in float64: any NaN
//! wins, -0 < +0.
double nan_keeping_extreme(double a, double b, bool max) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  if (a == b) return std::signbit(a) == max ? b : a;
  return (a < b) == max ? b : a;
}

double const nccl_nan = std::numeric_limits<double>::quiet_NaN();
double const nccl_inf = std::numeric_limits<double>::infinity();

}  // namespace

TEST_CASE("nccl communicator: made in order, and destroyed with the other ranks once its collectives are done",
          "[dist][nccl_fake]") {
  nccl_fake_world w;
  {
    auto c = make_communicator_on(w, 1, 2);
    CHECK(w.calls() ==
          log_lines{"init rank 1 of 2", "current_device", "create_stream -> s101", "device buffer of 64 words on s101",
                    "allocate pinned 64 words"});
    CHECK(eventually([&] { return w.watchdog_device == 3; }));  // the watchdog runs on the communicator's device
    CHECK(c.rank() == 1);
    CHECK(c.size() == 2);
    CHECK(c.native() == 55);
    CHECK(c.stream() == 101);
    nccl_fake_executor const exec;
    std::vector<float> data(4, 1.0f);
    c.all_reduce(exec, mpx::tensor_view<float, mpx::host_space>(data.data(), mpx::shape{4}), mpx::reduce_op::sum);
    c.poll();
    w.forget_calls();
  }
  // The device buffer on the stream after its work, the communicator with the other
  // ranks, then the pinned buffer and the stream.
  CHECK(w.calls() == log_lines{"free device buffer", "destroy comm 55", "free pinned", "destroy_stream s101"});
  CHECK(w.live.empty());
  CHECK(w.reports.empty());
}

TEST_CASE("nccl communicator: a construction that fails part way releases what it made, aborted, and throws",
          "[dist][nccl_fake]") {
  struct part_way {
    std::string failing;
    log_lines expected;  // every call, the failing one and the release after it
  };
  log_lines const made = {"init rank 0 of 2", "current_device", "create_stream -> s101",
                          "device buffer of 64 words on s101", "allocate pinned 64 words"};
  auto const first = [&](std::size_t n, log_lines const& then) {
    log_lines out(made.begin(), made.begin() + static_cast<std::ptrdiff_t>(n));
    out.insert(out.end(), then.begin(), then.end());
    return out;
  };
  for (auto const& [failing, expected] : std::vector<part_way>{
           {"init", first(1, {})},  // nothing made: nothing to abort
           {"current_device", first(2, {"abort comm 55"})},
           {"create_stream", first(3, {"abort comm 55"})},
           {"device_buffer", first(4, {"abort comm 55", "destroy_stream s101"})},
           {"allocate_pinned", first(5, {"free device buffer", "abort comm 55", "destroy_stream s101"})},
       }) {
    INFO("failing: " << failing);
    nccl_fake_world w;
    w.fail(failing);
    CHECK_THAT(thrown_message<mpx::error>([&] { make_communicator_on(w); }), Catch::Contains(failing + " failed") ||
                                                                             Catch::Contains(failing + " returned"));
    CHECK(w.calls() == expected);
    CHECK(w.count("destroy comm 55") == 0);  // destroying would wait for the other ranks
    CHECK(w.live.empty());
    CHECK(w.reports.empty());
    CHECK(w.watchdog_device == -1);
  }
}

TEST_CASE("nccl communicator: the id comes from rank 0 through the bootstrap", "[dist][nccl_fake]") {
  struct bootstrap {
    int r = 0;
    std::vector<std::byte> sent;
    [[nodiscard]] int rank() const { return r; }
    [[nodiscard]] int size() const { return 3; }
    void broadcast_bytes(std::span<std::byte> bytes, int root) {
      CHECK(root == 0);
      if (r == 0) sent.assign(bytes.begin(), bytes.end());
      else std::memcpy(bytes.data(), "from rank 0", 12);
    }
  };
  nccl_fake_world w0, w1;
  bootstrap b0{0, {}}, b1{1, {}};
  nccl_fake_communicator const c0(nccl_fake_executor{}, b0, {}, nccl_fake_backend{&w0});
  nccl_fake_communicator const c1(nccl_fake_executor{}, b1, {}, nccl_fake_backend{&w1});
  CHECK(w0.calls().front() == "make_unique_id");
  CHECK(w0.count("init rank 0 of 3") == 1);
  CHECK(std::string(w0.id_seen.internal) == "rank 0's id");
  REQUIRE(b0.sent.size() == sizeof(nccl_fake_id));
  CHECK(std::memcmp(b0.sent.data(), "rank 0's id", 12) == 0);  // what rank 0 made is what it sent
  CHECK(w1.count("make_unique_id") == 0);
  CHECK(w1.calls().front() == "init rank 1 of 3");
  CHECK(std::string(w1.id_seen.internal) == "from rank 0");
}

TEST_CASE("nccl communicator: the destructor aborts when a collective is not done within the timeout",
          "[dist][nccl_fake]") {
  nccl_fake_executor const exec;
  std::vector<float> data(4, 1.0f);
  mpx::tensor_view<float, mpx::host_space> const x(data.data(), mpx::shape{4});

  SECTION("hung past the timeout: aborted, not destroyed") {
    nccl_fake_world w;
    std::optional<nccl_fake_communicator> c;
    c.emplace(exec, nccl_fake_id{}, 0, 2, mpx::communicator_options{50ms}, nccl_fake_backend{&w});
    w.hang = true;
    c->all_reduce(exec, x, mpx::reduce_op::sum);
    w.forget_calls();
    auto const start = std::chrono::steady_clock::now();
    c.reset();  // the watchdog stops first: the choice is the destructor's
    CHECK(std::chrono::steady_clock::now() - start >= 50ms);  // it waited for the collective first
    CHECK(w.calls() == log_lines{"free device buffer", "abort comm 55", "free pinned", "destroy_stream s101"});
    CHECK(w.live.empty());
  }
  SECTION("done late, within the timeout: destroyed") {
    CHECK(end_after_late_completion([&](nccl_fake_world& w, nccl_fake_communicator& c) {
            w.hang = true;
            c.all_reduce(exec, x, mpx::reduce_op::sum);
          }) == log_lines{"free device buffer", "destroy comm 55", "free pinned", "destroy_stream s101"});
  }
  SECTION("aborted before: not destroyed, nor aborted again") {
    nccl_fake_world w;
    {
      auto c = make_communicator_on(w, 0, 2, 30ms);
      w.hang = true;
      c.all_reduce(exec, x, mpx::reduce_op::sum);
      std::this_thread::sleep_for(60ms);
      CHECK_THROWS_AS(c.poll(), mpx::collective_error);
      CHECK(w.count("abort comm 55") == 1);
      w.forget_calls();
    }
    CHECK(w.calls() == log_lines{"free device buffer", "free pinned", "destroy_stream s101"});
    CHECK(w.live.empty());
  }
  SECTION("destroyed by an exception's unwinding: aborted, although its collectives are done") {
    nccl_fake_world w;
    try {
      auto c = make_communicator_on(w);
      c.all_reduce(exec, x, mpx::reduce_op::sum);
      w.forget_calls();
      throw std::runtime_error("a layer failed");
    } catch (std::runtime_error const&) {
    }
    CHECK(w.calls() == log_lines{"free device buffer", "abort comm 55", "free pinned", "destroy_stream s101"});
  }
}

TEST_CASE_METHOD(nccl_setup,
                 "nccl communicator: an all-reduce runs between the caller's work before it and after it, by events",
                 "[dist][nccl_fake]") {
  w.forget_calls();
  c.all_reduce(exec, x, mpx::reduce_op::sum);
  CHECK(w.calls() == ordered_around({"all_reduce sum of 4 float32 on s101"}));
  CHECK(w.last_data == data.data());
  for (auto const op : {mpx::reduce_op::max, mpx::reduce_op::min}) {
    INFO(mpx::to_string(op));
    w.forget_calls();
    c.all_reduce(exec, x, op);
    // The keys are made and turned back by kernels on the communicator's stream.
    CHECK(w.calls() == ordered_around({"kernels on s101", "all_reduce max of 4 uint32 keys on s101"}));
  }
  CHECK(data == std::vector<float>{1, 2, 3, 4});  // alone, the keys' round trip changes nothing

  // Another caller's stream is the one ordered.
  nccl_fake_executor const other{9, false};
  w.forget_calls();
  c.broadcast(other, x, 1);
  CHECK(w.calls() == log_lines{"event e1", "event e2", "record e2 on s9", "s101 waits for e2",
                               "broadcast 16 bytes from 1 on s101", "record e1 on s101", "s9 waits for e1"});
  CHECK(w.last_data == data.data());

  std::vector<mpx::float8_e4m3> fp8(4);
  w.forget_calls();
  CHECK_THROWS_TYPE_WITH(
      c.all_reduce(exec, mpx::tensor_view<mpx::float8_e4m3, mpx::host_space>(fp8.data(), mpx::shape{4}),
                   mpx::reduce_op::sum),
      mpx::invalid_argument, Catch::Contains("all-reduces float, half and bfloat16 tensors, not float8_e4m3fn"));
  CHECK(w.calls().empty());
}

namespace {

//! `v` as a T, a NaN's sign bit kept (a cast need not keep it).
template <class T>
T nccl_value_as(double v) {
  if (!std::isnan(v)) return mpx::cast<T>(static_cast<float>(v));
  using traits = mpx::dtype_traits<T>;
  auto const bits = mpx::bits(traits::quiet_nan());
  return mpx::detail::from_bits<T>(std::signbit(v) ? mpx::detail::bits_t<T>(bits | traits::sign_mask) : bits);
}

//! `got` is `expected`, zeros' signs too; a NaN is a NaN whose sign bit says the
//! operation (cleared by a max, set by a min: from_nan_keeping_max_key).
template <class T>
std::string nccl_differs(T got, double expected, bool max) {
  bool same = false;
  bool sign = false;
  if constexpr (std::is_same_v<T, double>) {
    sign = std::signbit(got);
    same = std::isnan(expected) ? std::isnan(got) && sign == !max
                                : got == expected && sign == std::signbit(expected);
  } else {
    sign = (mpx::bits(got) & mpx::dtype_traits<T>::sign_mask) != 0;
    same = std::isnan(expected) ? mpx::is_nan(got) && sign == !max
                                : mpx::detail::to_double(got) == expected && sign == std::signbit(expected);
  }
  return same ? "" : "got " + std::to_string(mpx::detail::to_double(got)) + (sign ? " (sign set)" : "") +
                         ", expected " + std::to_string(expected) + (std::signbit(expected) ? " (sign set)" : "");
}

// Three ranks' values, element by element: this rank is 1. Every column has its answer
// decided by a NaN, an infinity, a zero's sign or plain order.
std::vector<double> const nccl_rank0 = {-1, 0.0, -0.0, 1, -3, 1, -nccl_inf, 2, nccl_nan, -0.0};
std::vector<double> const nccl_rank1 = {1.5, -0.0, 0.0, nccl_nan, -2, nccl_inf, -nccl_inf, -nccl_nan, 3, -0.0};
std::vector<double> const nccl_rank2 = {2, -0.0, -0.0, -1, -2.5, -nccl_inf, -5, 4, -nccl_nan, -0.0};

}  // namespace

TEST_CASE("nccl communicator: an all-reduce's max and min keep a NaN; infinities and signed zeros order right",
          "[dist][nccl_fake]") {
  nccl_fake_executor const exec;
  mpx_test::for_each_dtype([&](auto t) {
    using T = decltype(t);
    for (auto const op : {mpx::reduce_op::max, mpx::reduce_op::min}) {
      bool const max = op == mpx::reduce_op::max;
      INFO(mpx::dtype_name<T> << " " << mpx::to_string(op));
      nccl_fake_world w;
      auto c = make_communicator_on(w, 1, 3);
      // What the other ranks' communicators put on the wire: their values' keys.
      for (auto const& [r, values] : {std::pair{0, nccl_rank0}, std::pair{2, nccl_rank2}})
        for (double const v : values) w.peers[r].push_back(mpx::detail::nan_keeping_max_key(nccl_value_as<T>(v), !max));
      std::vector<T> data;
      for (double const v : nccl_rank1) data.push_back(nccl_value_as<T>(v));
      c.all_reduce(exec, mpx::tensor_view<T, mpx::host_space>(data.data(), mpx::shape{10}), op);
      for (std::size_t i = 0; i < data.size(); ++i) {
        auto const in = [&](std::vector<double> const& v) { return mpx::detail::to_double(nccl_value_as<T>(v[i])); };
        double const expected = nan_keeping_extreme(nan_keeping_extreme(in(nccl_rank0), in(nccl_rank1), max),
                                                    in(nccl_rank2), max);
        INFO("element " << i);
        CHECK(nccl_differs(data[i], expected, max).empty());
      }
    }
  });
}

TEST_CASE("nccl communicator: host values are gathered rank after rank, and reduced keeping NaN",
          "[dist][nccl_fake]") {
  auto const words = [](std::vector<double> const& v) {
    std::vector<std::uint64_t> out;
    for (double const x : v) out.push_back(mpx::detail::bit_cast<std::uint64_t>(x));
    return out;
  };
  nccl_fake_world w;
  auto c = make_communicator_on(w, 1, 3);

  w.peers = {{0, words({10, 11})}, {2, words({30, 31})}};
  w.forget_calls();
  CHECK(c.all_gather_values(std::vector<double>{20.5, -21}) == std::vector<double>{10, 11, 20.5, -21, 30, 31});
  CHECK(w.calls() ==
        log_lines{"copy 2 words to device on s101", "all_gather 2 float64 on s101", "copy 6 words to host on s101"});

  w.peers = {{0, words({1, 0.25, -4})}, {2, words({100, 0.5, 4})}};
  w.forget_calls();
  std::vector<double> sums = {10, 0.125, 1};
  c.all_reduce_values(sums, mpx::reduce_op::sum);
  CHECK(sums == std::vector<double>{111, 0.875, 1});
  CHECK(w.calls() == log_lines{"copy 3 words to device on s101", "all_reduce sum of 3 float64 on s101",
                               "copy 3 words to host on s101"});

  for (auto const op : {mpx::reduce_op::max, mpx::reduce_op::min}) {
    bool const max = op == mpx::reduce_op::max;
    INFO(mpx::to_string(op));
    w.peers.clear();
    for (auto const& [r, values] : {std::pair{0, nccl_rank0}, std::pair{2, nccl_rank2}})
      for (double const v : values) w.peers[r].push_back(mpx::detail::nan_keeping_max_key(v, !max));
    std::vector<double> values = nccl_rank1;
    w.forget_calls();
    c.all_reduce_values(values, op);
    CHECK(w.calls() == log_lines{"copy 10 words to device on s101", "all_reduce max of 10 uint64 keys on s101",
                                 "copy 10 words to host on s101"});
    for (std::size_t i = 0; i < values.size(); ++i) {
      double const expected =
          nan_keeping_extreme(nan_keeping_extreme(nccl_rank0[i], nccl_rank1[i], max), nccl_rank2[i], max);
      INFO("element " << i);
      CHECK(nccl_differs(values[i], expected, max).empty());
    }
  }

  w.peers.clear();
  w.forget_calls();
  c.barrier();
  CHECK(w.calls() == log_lines{"copy 1 words to device on s101", "all_reduce sum of 1 float64 on s101",
                               "copy 1 words to host on s101"});
  c.poll();
}

TEST_CASE_METHOD(nccl_setup,
                 "nccl communicator: too many host values, or a root that is not a rank, are refused before any call",
                 "[dist][nccl_fake]") {
  w.forget_calls();
  CHECK_THROWS_TYPE_WITH(c.all_gather_values(std::vector<double>(33)), mpx::invalid_argument,
                         Catch::Contains("nccl_communicator") &&
                             Catch::Contains("66 host values in one collective (at most 64)"));
  std::vector<double> many(65);
  CHECK_THROWS_TYPE_WITH(c.all_reduce_values(many, mpx::reduce_op::max), mpx::invalid_argument,
                         Catch::Contains("65 host values in one collective (at most 64)"));
  CHECK_THROWS_TYPE_WITH(
      c.broadcast(exec, x, -1), mpx::invalid_argument,
      Catch::Contains("nccl_communicator::broadcast") && Catch::Contains("root -1 is not a rank of 2"));
  CHECK_THROWS_TYPE_WITH(c.broadcast(exec, x, 2), mpx::invalid_argument, Catch::Contains("root 2 is not a rank of 2"));
  CHECK(w.calls().empty());
  c.poll();  // refused, not failed: still usable

  CHECK(c.all_gather_values(std::vector<double>(32, 1.0)).size() == 64);  // at the limit
  std::vector<double> full(64, 1.0);
  c.all_reduce_values(full, mpx::reduce_op::sum);
  c.broadcast(exec, x, 0);
  c.poll();
}

TEST_CASE_METHOD(nccl_setup, "nccl communicator: started all-reduces are each waited for once, by finish_all_reduces",
                 "[dist][nccl_fake]") {
  w.forget_calls();
  c.start_all_reduce(exec, x, mpx::reduce_op::sum);
  CHECK(w.calls() == ordered_around({"all_reduce sum of 4 float32 on s101"}, true));  // the caller does not wait
  c.start_all_reduce(exec, x, mpx::reduce_op::max);  // e3, its done event
  w.forget_calls();
  c.finish_all_reduces(exec);
  CHECK(w.calls() == log_lines{"s7 waits for e1", "s7 waits for e3"});
  w.forget_calls();
  c.finish_all_reduces(exec);
  CHECK(w.calls().empty());

  // A wait that fails: the others are still asked for, the failure thrown, and none is
  // left for the next step.
  c.start_all_reduce(exec, x, mpx::reduce_op::sum);  // e1
  c.start_all_reduce(exec, x, mpx::reduce_op::sum);  // e3
  w.forget_calls();
  w.fail("wait");
  CHECK_THAT(thrown_message<mpx::cuda_error>([&] { c.finish_all_reduces(exec); }), Catch::Contains("wait returned"));
  CHECK(w.calls() == log_lines{"s7 waits for e1", "s7 waits for e3"});
  w.forget_calls();
  c.finish_all_reduces(exec);
  CHECK(w.calls().empty());
  c.poll();
}

TEST_CASE_METHOD(nccl_setup_50ms,
                 "nccl communicator: after an abort, finish_all_reduces orders the caller after them, then throws",
                 "[dist][nccl_fake]") {
  w.hang = true;
  c.start_all_reduce(exec, x, mpx::reduce_op::sum);  // e1
  std::this_thread::sleep_for(80ms);
  CHECK_THROWS_AS(c.poll(), mpx::collective_error);  // (or the watchdog aborted first: poll throws its reason)
  w.forget_calls();
  // An aborted kernel may still write into the tensor: the caller's stream waits first.
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { c.finish_all_reduces(exec); }),
             Catch::Contains("all_reduce (sum of 4 float32) #1: not complete") &&
                 Catch::EndsWith("(the communicator is aborted; end the job)"));
  CHECK(w.calls() == log_lines{"s7 waits for e1"});
  w.forget_calls();
  CHECK_THROWS_AS(c.finish_all_reduces(exec), mpx::collective_error);
  CHECK(w.calls().empty());  // forgotten
}

TEST_CASE("nccl communicator: a collective captured into a CUDA graph is not watched", "[dist][nccl_fake]") {
  nccl_fake_world w;
  {
    auto c = make_communicator_on(w, 0, 2, 30ms);
    nccl_fake_executor const capture{7, true};
    std::vector<float> data(4);
    mpx::tensor_view<float, mpx::host_space> const x(data.data(), mpx::shape{4});
    w.hang = true;  // what a capture enqueues runs at replays; its event here never completes
    w.forget_calls();
    c.all_reduce(capture, x, mpx::reduce_op::sum);
    CHECK(w.calls() == ordered_around({"all_reduce sum of 4 float32 on s101"}));
    c.start_all_reduce(capture, x, mpx::reduce_op::sum);
    c.finish_all_reduces(capture);
    std::this_thread::sleep_for(60ms);
    c.poll();  // its event cannot be queried: not timed
    CHECK(w.count("abort comm 55") == 0);
    w.forget_calls();
  }
  CHECK(w.calls() == log_lines{"free device buffer", "destroy comm 55", "free pinned", "destroy_stream s101"});
}

// A replayed CUDA graph's collectives cannot be watched one by one (their events were
// recorded in the capture), so the replay is timed as a whole, on the caller's stream.
TEST_CASE_METHOD(nccl_setup_50ms,
                 "nccl communicator: a replay of a CUDA graph that does not complete in time aborts it, named",
                 "[dist][nccl_fake]") {
  w.forget_calls();
  c.watch_replay(exec);  // #1, completes
  CHECK(w.calls() == log_lines{"event e1", "record e1 on s7"});
  std::this_thread::sleep_for(80ms);
  c.poll();
  CHECK(w.count("abort comm 55") == 0);

  w.replay_hangs = true;  // the next replay's collectives wait for a peer that never comes
  c.watch_replay(exec);   // #2
  CHECK(eventually([&] { return w.count("abort comm 55") == 1; }));  // the watchdog, with no call made
  std::string const why = "mpx::nccl_communicator: rank 0: a training step replayed from a CUDA graph #2: not "
                          "complete 50 ms after it was enqueued";
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { c.poll(); }), Catch::StartsWith(why));
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { c.watch_replay(exec); }),
             Catch::StartsWith(why) && Catch::EndsWith("(the communicator is aborted; end the job)"));
}

// The destructor waits for a replay as for a collective: one still running after the
// timeout is aborted, not destroyed with the other ranks.
TEST_CASE("nccl communicator: at the end, a replay still running past the timeout aborts it, one done late does not",
          "[dist][nccl_fake]") {
  nccl_fake_executor const exec;
  SECTION("past the timeout: aborted, not destroyed") {
    nccl_fake_world w;
    std::optional<nccl_fake_communicator> c;
    c.emplace(exec, nccl_fake_id{}, 0, 2, mpx::communicator_options{50ms}, nccl_fake_backend{&w});
    c->watch_replay(exec);  // completes
    w.replay_hangs = true;
    c->watch_replay(exec);
    w.forget_calls();
    auto const start = std::chrono::steady_clock::now();
    c.reset();  // the watchdog stops first: the choice is the destructor's
    CHECK(std::chrono::steady_clock::now() - start >= 50ms);  // it waited for the replay first
    CHECK(w.calls() == log_lines{"free device buffer", "abort comm 55", "free pinned", "destroy_stream s101"});
  }
  SECTION("done late, within the timeout, after an eager collective: destroyed") {
    std::vector<float> data(4);
    CHECK(end_after_late_completion([&](nccl_fake_world& w, nccl_fake_communicator& c) {
            c.all_reduce(exec, mpx::tensor_view<float, mpx::host_space>(data.data(), mpx::shape{4}),
                         mpx::reduce_op::sum);
            w.replay_hangs = true;
            c.watch_replay(exec);
          }) == log_lines{"free device buffer", "destroy comm 55", "free pinned", "destroy_stream s101"});
  }
}

TEST_CASE_METHOD(nccl_setup_50ms,
                 "nccl communicator: a hung collective aborts it, and every later call throws naming the collective",
                 "[dist][nccl_fake]") {
  c.all_reduce(exec, x, mpx::reduce_op::sum);  // #1, done
  w.hang = true;
  c.all_reduce(exec, x, mpx::reduce_op::sum);  // #2, never done
  std::this_thread::sleep_for(80ms);
  std::string const why =
      "mpx::nccl_communicator: rank 0: all_reduce (sum of 4 float32) #2: not complete 50 ms after it was enqueued";
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { c.poll(); }), Catch::StartsWith(why));
  CHECK(w.count("abort comm 55") == 1);
  CHECK(c.native() == 0);
  w.forget_calls();
  std::vector<double> values(1);
  auto const later = [&](auto&& call) {
    CHECK_THAT(thrown_message<mpx::collective_error>(call),
               Catch::StartsWith(why) && Catch::EndsWith("(the communicator is aborted; end the job)"));
  };
  later([&] { c.all_reduce(exec, x, mpx::reduce_op::max); });
  later([&] { c.start_all_reduce(exec, x, mpx::reduce_op::sum); });
  later([&] { c.broadcast(exec, x, 0); });
  later([&] { static_cast<void>(c.all_gather_values(values)); });
  later([&] { c.all_reduce_values(values, mpx::reduce_op::sum); });
  later([&] { c.barrier(); });
  later([&] { c.poll(); });
  later([&] { c.finish_all_reduces(exec); });
  for (auto const& line : w.calls()) CHECK_THAT(line, Catch::StartsWith("event"));  // no collective's call
  CHECK(w.count("abort comm 55") == 0);  // aborted once
}

TEST_CASE_METHOD(nccl_setup_50ms,
                 "nccl communicator: the watchdog aborts a hung collective while the caller makes no call",
                 "[dist][nccl_fake]") {
  w.hang = true;
  c.all_reduce(exec, x, mpx::reduce_op::min);
  CHECK(eventually([&] { return w.count("abort comm 55") == 1; }));
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { c.poll(); }),
             Catch::StartsWith("mpx::nccl_communicator: rank 0: all_reduce (min of 4 float32) #1: not complete"));
}

TEST_CASE_METHOD(nccl_setup_50ms,
                 "nccl communicator: a host-value collective whose result never comes throws at the timeout, aborted",
                 "[dist][nccl_fake]") {
  w.hang = true;
  std::vector<double> values = {1, 2};
  auto const start = std::chrono::steady_clock::now();
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { c.all_reduce_values(values, mpx::reduce_op::max); }),
             Catch::Equals("mpx::nccl_communicator: rank 0: all_reduce (max of 2 values) #1: not complete after "
                           "50 ms"));
  auto const waited = std::chrono::steady_clock::now() - start;
  CHECK(waited >= 50ms);
  CHECK(waited < 5s);
  CHECK(w.count("abort comm 55") == 1);
  CHECK_THROWS_AS(c.barrier(), mpx::collective_error);

  // NCCL's asynchronous error ends the wait at once, with its reason.
  nccl_setup other;
  other.w.hang = true;
  other.w.async_once_enqueued = "remote process exited or there was a network error";
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { other.c.barrier(); }),
             Catch::Equals("mpx::nccl_communicator: rank 0: all_reduce (sum of 1 values) #1: remote process exited "
                           "or there was a network error"));
  CHECK(other.w.count("abort comm 55") == 1);
}

TEST_CASE_METHOD(nccl_setup, "nccl communicator: a collective that NCCL refuses aborts it", "[dist][nccl_fake]") {
  w.fail("all_reduce");
  CHECK_THAT(thrown_message<mpx::collective_error>([&] { c.all_reduce(exec, x, mpx::reduce_op::sum); }),
             Catch::Contains("all_reduce failed"));
  CHECK(w.count("abort comm 55") == 1);
  CHECK_THROWS_WITH(c.poll(), Catch::EndsWith("(the communicator is aborted; end the job)"));
}

TEST_CASE_METHOD(nccl_setup, "nccl communicator: a CUDA call that fails while a collective is enqueued aborts it",
                 "[dist][nccl_fake]") {
  w.fail("record");  // the ready event's
  CHECK_THROWS_AS(c.all_reduce(exec, x, mpx::reduce_op::sum), mpx::cuda_error);
  CHECK(w.count("abort comm 55") == 1);
  CHECK(w.count("all_reduce sum of 4 float32 on s101") == 0);
  CHECK_THROWS_WITH(c.poll(), Catch::Contains("all_reduce (sum of 4 float32) #1: failed while it was enqueued"));
}

TEST_CASE("nccl communicator: what fails in its release is reported, never thrown, and the rest still freed",
          "[dist][nccl_fake]") {
  nccl_fake_world w;
  {
    auto c = make_communicator_on(w);
    w.fail("destroy");
    w.fail("free_pinned");
    w.fail("destroy_stream");
    w.forget_calls();
  }
  CHECK(w.calls() == log_lines{"free device buffer", "destroy comm 55", "free pinned", "destroy_stream s101"});
  REQUIRE(w.reports.size() == 3);
  CHECK_THAT(w.reports[0],
             Catch::StartsWith("destroying the NCCL communicator: ") && Catch::Contains("destroy failed"));
  CHECK_THAT(w.reports[1],
             Catch::StartsWith("freeing the communicator's pinned buffer: ") &&
                 Catch::Contains("free_pinned returned"));
  CHECK_THAT(w.reports[2],
             Catch::StartsWith("destroying the communicator's stream: ") && Catch::Contains("destroy_stream returned"));
  CHECK(w.live.empty());
}
