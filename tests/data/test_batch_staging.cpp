// The GPU's double buffer of batch_loader (data/batches.hpp: detail::double_buffered_staging)
// against a GPU of the test's own: its memory is host memory, and a stream is a queue of
// uploads, event records, waits and the consumer's steps that runs only when the host
// waits for it or the test lets the GPU catch up, the copy stream ahead of the
// consumer's where both can run, or behind it. So an ordering the staging leaves out
// lets an upload overwrite a batch before the consumer's step has read it, or the step
// read a batch before it arrives, and the batch it reads differs from gather_batch's.
// batch_loader on a cuda_executor runs this same code with CUDA's calls
// (cuda_staging_backend).
#include "../support/testing.hpp"

#include <mpx/data/batches.hpp>
#include <mpx/data/dataset.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

//! The consumer's stream; the staging's own streams are numbered from 1.
constexpr int staging_consumer_stream = 0;

//! A pointer's place in a fake buffer, and its bytes.
struct fake_staging_region {
  std::string name;
  unsigned char* begin = nullptr;
  std::size_t bytes = 0;
};

//! Work queued on a fake stream.
struct fake_staging_op {
  enum class kind { upload, record, wait, step } what;
  void* to = nullptr;  // upload
  void const* from = nullptr;
  std::size_t bytes = 0;
  int event = 0;                   // record, wait
  std::size_t record = 0;          // record: the how-manieth of its event; wait: the one it waits for
  std::function<void()> run = {};  // step: the consumer's work
};

struct fake_staging_gpu;

//! An event of fake_staging_gpu: a number, neither copied nor moved (as ordering_event).
class fake_staging_event {
 public:
  fake_staging_event(fake_staging_gpu& gpu, int id) : gpu_(&gpu), id_(id) {}
  ~fake_staging_event();
  fake_staging_event(fake_staging_event const&) = delete;
  fake_staging_event& operator=(fake_staging_event const&) = delete;
  [[nodiscard]] int id() const noexcept { return id_; }

 private:
  fake_staging_gpu* gpu_;
  int id_;
};

//! Memory of fake_staging_gpu (pinned or device: both are host memory); move-only. The bytes
//! stay with the GPU after the free, so a late upload is a recorded fault, never a crash.
template <class U>
class fake_staging_buffer {
 public:
  fake_staging_buffer(fake_staging_gpu& gpu, std::string name, U* data)
      : gpu_(&gpu), name_(std::move(name)), data_(data) {}
  fake_staging_buffer(fake_staging_buffer&& other) noexcept
      : gpu_(std::exchange(other.gpu_, nullptr)), name_(std::move(other.name_)), data_(other.data_) {}
  fake_staging_buffer& operator=(fake_staging_buffer&&) = delete;
  ~fake_staging_buffer();
  [[nodiscard]] U* data() const noexcept { return data_; }

 private:
  fake_staging_gpu* gpu_;
  std::string name_;
  U* data_;
};

//! What the staging asks of the GPU, recorded call by call ("record_event event 2 on
//! consumer"), with the state a real one keeps: live streams, events and memory, and the
//! streams' queues. Any call can be told to throw mpx::cuda_error: the fail_call-th
//! (counted from 1) or every call whose entry starts with fail_on.
struct fake_staging_gpu {
  std::vector<std::string> log;
  std::vector<std::string> reports;  // what the staging reported instead of throwing
  std::vector<std::string> faults;   // what would corrupt memory on a real GPU
  std::size_t calls = 0;
  std::size_t fail_call = 0;
  std::string fail_on;
  bool copies_first = true;  // where both streams can run, which runs

  std::map<int, std::deque<fake_staging_op>> streams{{staging_consumer_stream, {}}};
  std::set<int> live_streams;
  struct event_state {
    std::size_t recorded = 0, completed = 0;
  };
  std::map<int, event_state> events;
  std::set<int> live_events;
  std::vector<fake_staging_region> live_buffers;
  std::vector<std::unique_ptr<unsigned char[]>> memory;
  int next_stream = 1, next_event = 1, next_pinned = 1, next_device = 1;

  //! Logs a call, then throws if it is to fail.
  void call(std::string entry) {
    ++calls;
    log.push_back(entry);
    if (calls == fail_call || (!fail_on.empty() && entry.starts_with(fail_on)))
      throw mpx::cuda_error("fake GPU: " + entry + " failed", 999);
  }
  static std::string stream_name(int s) {
    return s == staging_consumer_stream ? "consumer" : "stream " + std::to_string(s);
  }

  template <class U>
  fake_staging_buffer<U> allocate(std::string name, std::size_t n, unsigned char poison) {
    std::size_t const bytes = n * sizeof(U);
    memory.push_back(std::make_unique<unsigned char[]>(bytes + 1));
    std::memset(memory.back().get(), poison, bytes);
    live_buffers.push_back({name, memory.back().get(), bytes});
    return fake_staging_buffer<U>(*this, name, reinterpret_cast<U*>(memory.back().get()));
  }
  void free(std::string const& name) {
    log.push_back("free " + name);
    // An upload still queued would read freed pinned memory, or write freed device memory.
    for (auto const& [s, queue] : streams)
      for (fake_staging_op const& op : queue)
        if (op.what == fake_staging_op::kind::upload && (name_of(op.from) == name || name_of(op.to) == name))
          faults.push_back(name + " freed while an upload on " + stream_name(s) + " was queued");
    std::erase_if(live_buffers, [&](fake_staging_region const& r) { return r.name == name; });
  }
  //! The live buffer holding [p, p + bytes), or "" if none does.
  std::string name_of(void const* p, std::size_t bytes = 1) const {
    auto const* at = static_cast<unsigned char const*>(p);
    for (fake_staging_region const& r : live_buffers)
      if (at >= r.begin && at + bytes <= r.begin + std::max<std::size_t>(r.bytes, 1)) return r.name;
    return "";
  }

  //! Runs one operation that can run, the copy streams' first if copies_first; false if
  //! none can.
  bool step() {
    std::vector<int> order;
    for (auto const& [s, queue] : streams)
      if (s != staging_consumer_stream) order.push_back(s);
    order.insert(copies_first ? order.end() : order.begin(), staging_consumer_stream);
    for (int s : order) {
      auto& queue = streams[s];
      if (queue.empty()) continue;
      fake_staging_op op = queue.front();
      if (op.what == fake_staging_op::kind::wait && events[op.event].completed < op.record) continue;
      queue.pop_front();
      switch (op.what) {
        case fake_staging_op::kind::upload:
          if (name_of(op.from, op.bytes).empty() || name_of(op.to, op.bytes).empty())
            faults.push_back("an upload on " + stream_name(s) + " outside live memory");
          else
            std::memcpy(op.to, op.from, op.bytes);
          break;
        case fake_staging_op::kind::record: events[op.event].completed = op.record; break;
        case fake_staging_op::kind::wait: break;
        case fake_staging_op::kind::step: op.run(); break;
      }
      return true;
    }
    return false;
  }
  template <class Done>
  void run_until(Done done) {
    while (!done())
      if (!step()) throw std::logic_error("fake GPU: every stream waits for an event no queued record completes");
  }
  //! The GPU catches up with everything queued.
  void run_all() {
    run_until([&] {
      for (auto const& [s, queue] : streams)
        if (!queue.empty()) return false;
      return true;
    });
  }
  //! Queues the consumer's work (a training step) on its stream.
  void enqueue_step(std::function<void()> run) {
    streams[staging_consumer_stream].push_back({.what = fake_staging_op::kind::step, .run = std::move(run)});
  }
  [[nodiscard]] bool nothing_live() const {
    return live_streams.empty() && live_events.empty() && live_buffers.empty();
  }
};

fake_staging_event::~fake_staging_event() {
  gpu_->log.push_back("destroy_event event " + std::to_string(id_));
  gpu_->live_events.erase(id_);
}

template <class U>
fake_staging_buffer<U>::~fake_staging_buffer() {
  if (gpu_) gpu_->free(name_);
}

//! The executor the batches are for: only its stream matters.
struct fake_staging_executor {
  int stream = staging_consumer_stream;
};

//! double_buffered_staging's Backend over a fake_staging_gpu the test owns (so it outlives a
//! staging whose constructor throws).
struct fake_staging_backend {
  using consumer_type = fake_staging_executor;
  using stream_type = int;
  using event_type = fake_staging_event;
  template <class U>
  using host_buffer = fake_staging_buffer<U>;
  template <class U>
  using device_buffer = fake_staging_buffer<U>;

  fake_staging_gpu* gpu = nullptr;

  static int stream_of(fake_staging_executor const& e) noexcept { return e.stream; }
  int create_stream() {
    int const s = gpu->next_stream++;
    gpu->call("create_stream " + fake_staging_gpu::stream_name(s));
    gpu->streams[s];
    gpu->live_streams.insert(s);
    return s;
  }
  void synchronize_stream(int s) {
    gpu->call("synchronize_stream " + fake_staging_gpu::stream_name(s));
    gpu->run_until([&] { return gpu->streams[s].empty(); });
  }
  void destroy_stream(int s) {
    gpu->call("destroy_stream " + fake_staging_gpu::stream_name(s));
    gpu->live_streams.erase(s);
  }
  fake_staging_event make_event() {
    int const e = gpu->next_event++;
    gpu->call("make_event event " + std::to_string(e));
    gpu->events[e];
    gpu->live_events.insert(e);
    return fake_staging_event(*gpu, e);
  }
  void record_event(fake_staging_event const& e, int s) {
    gpu->call("record_event event " + std::to_string(e.id()) + " on " + fake_staging_gpu::stream_name(s));
    std::size_t const n = ++gpu->events[e.id()].recorded;
    gpu->streams[s].push_back({.what = fake_staging_op::kind::record, .event = e.id(), .record = n});
  }
  void wait_event(int s, fake_staging_event const& e) {
    gpu->call("wait_event event " + std::to_string(e.id()) + " on " + fake_staging_gpu::stream_name(s));
    // As CUDA: the wait is for the event's latest record when it is enqueued (none: no wait).
    gpu->streams[s].push_back(
        {.what = fake_staging_op::kind::wait, .event = e.id(), .record = gpu->events[e.id()].recorded});
  }
  void synchronize_event(fake_staging_event const& e) {
    gpu->call("synchronize_event event " + std::to_string(e.id()));
    std::size_t const last = gpu->events[e.id()].recorded;
    gpu->run_until([&] { return gpu->events[e.id()].completed >= last; });
  }
  template <class U>
  fake_staging_buffer<U> allocate_pinned(std::size_t n) {
    std::string const name = "pinned " + std::to_string(gpu->next_pinned++);
    gpu->call("allocate_pinned " + name + " (" + std::to_string(n * sizeof(U)) + " bytes)");
    return gpu->allocate<U>(name, n, 0x5a);
  }
  template <class U>
  fake_staging_buffer<U> allocate_device(fake_staging_executor const& e, std::size_t n) {
    std::string const name = "device " + std::to_string(gpu->next_device++);
    gpu->call("allocate_device " + name + " (" + std::to_string(n * sizeof(U)) + " bytes) on " +
              fake_staging_gpu::stream_name(e.stream));
    return gpu->allocate<U>(name, n, 0xa5);
  }
  template <class U>
  void upload(U* to, U const* from, std::size_t n, int s) {
    std::size_t const bytes = n * sizeof(U);
    gpu->call("upload " + gpu->name_of(from, bytes) + " to " + gpu->name_of(to, bytes) + " (" + std::to_string(bytes) +
              " bytes) on " + fake_staging_gpu::stream_name(s));
    gpu->streams[s].push_back({.what = fake_staging_op::kind::upload, .to = to, .from = from, .bytes = bytes});
  }
  void report(char const* what, char const* why) noexcept { gpu->reports.push_back(std::string(what) + ": " + why); }
};

template <class T>
using fake_staging = mpx::detail::double_buffered_staging<fake_staging_backend, T>;

//! n images of 3 x 2 x 1 whose pixels differ from every other image's (s + j / 8, exact
//! in half and bfloat16), and labels 10 s + 1.
mpx::image_dataset numbered_images(std::int64_t n) {
  mpx::image_dataset d;
  d.num_classes = 1000;
  d.images = mpx::tensor<float>(mpx::shape{n, 3, 2, 1});
  for (std::int64_t s = 0; s < n; ++s) {
    d.labels.push_back(static_cast<std::int32_t>(10 * s + 1));
    for (std::int64_t j = 0; j < 6; ++j) d.images.data()[s * 6 + j] = static_cast<float>(s) + 0.125f * j;
  }
  return d;
}

//! The bytes of a batch, its images in T and then its labels, as numbers (so a mismatch
//! prints readably).
template <class T>
std::vector<int> batch_bytes(T const* images, std::int32_t const* labels, std::size_t samples) {
  std::size_t const image_bytes = samples * 6 * sizeof(T);
  std::vector<unsigned char> bytes(image_bytes + samples * sizeof(std::int32_t));
  if (samples) {
    std::memcpy(bytes.data(), images, image_bytes);
    std::memcpy(bytes.data() + image_bytes, labels, samples * sizeof(std::int32_t));
  }
  return {bytes.begin(), bytes.end()};
}
//! What the consumer must see of `samples`: gather_batch's images and labels.
template <class T>
std::vector<int> expected_bytes(mpx::image_dataset const& data, std::span<std::size_t const> samples) {
  std::vector<T> images(samples.size() * 6);
  std::vector<std::int32_t> labels(samples.size());
  mpx::detail::gather_batch(data, samples, images.data(), labels.data());
  return batch_bytes(images.data(), labels.data(), samples.size());
}

//! The calls after `from` in the log.
std::vector<std::string> log_since(fake_staging_gpu const& gpu, std::size_t from) {
  return {gpu.log.begin() + static_cast<std::ptrdiff_t>(from), gpu.log.end()};
}

//! What stage() asks for when it fills slot k (events: copied 2k + 1, released 2k + 2;
//! pinned and device memory: images 2k + 1, labels 2k + 2) with a batch of these bytes: the
//! host waits for the slot's last upload, the consumer's stream marks the slot free, the
//! copy stream waits for that, uploads, and marks the upload done.
std::vector<std::string> stage_calls(int k, std::size_t image_bytes, std::size_t label_bytes) {
  auto const n = [k](int i) { return std::to_string(2 * k + i); };
  auto const upload = [&](int i, std::size_t bytes) {
    return "upload pinned " + n(i) + " to device " + n(i) + " (" + std::to_string(bytes) + " bytes) on stream 1";
  };
  return {"synchronize_event event " + n(1),
          "record_event event " + n(2) + " on consumer",
          "wait_event event " + n(2) + " on stream 1",
          upload(1, image_bytes),
          upload(2, label_bytes),
          "record_event event " + n(1) + " on stream 1"};
}

//! Batch k of a loader-like run over n samples: batch_size of them (fewer in the last),
//! in an order that is not the data set's.
std::vector<std::size_t> loader_samples(std::size_t k, std::size_t batch_size, std::size_t n) {
  std::vector<std::size_t> samples;
  for (std::size_t i = k * batch_size; i < std::min((k + 1) * batch_size, n); ++i) samples.push_back((i * 7 + 3) % n);
  return samples;
}

}  // namespace

TEST_CASE("batch staging: construction makes the copy stream first, then each slot's memory and events",
          "[data][batches][staging]") {
  auto const data = numbered_images(10);
  fake_staging_gpu gpu;
  {
    fake_staging<float> s(fake_staging_executor{}, data, 4, fake_staging_backend{&gpu});
    // Images of 4 x 6 floats (96 bytes) and 4 labels (16 bytes) per slot; the device
    // memory in the consumer's stream order. Slot 0's events: copied 1, released 2.
    CHECK(gpu.log == std::vector<std::string>{
                         "create_stream stream 1",
                         "allocate_pinned pinned 1 (96 bytes)",
                         "allocate_pinned pinned 2 (16 bytes)",
                         "allocate_device device 1 (96 bytes) on consumer",
                         "allocate_device device 2 (16 bytes) on consumer",
                         "make_event event 1",
                         "make_event event 2",
                         "allocate_pinned pinned 3 (96 bytes)",
                         "allocate_pinned pinned 4 (16 bytes)",
                         "allocate_device device 3 (96 bytes) on consumer",
                         "allocate_device device 4 (16 bytes) on consumer",
                         "make_event event 3",
                         "make_event event 4",
                     });
    CHECK(gpu.live_streams == std::set<int>{1});
    CHECK(gpu.live_events.size() == 4);
    CHECK(gpu.live_buffers.size() == 8);
  }
  CHECK(gpu.nothing_live());
  CHECK(gpu.faults.empty());
  CHECK(gpu.reports.empty());
}

TEST_CASE("batch staging: rounds alternate the slots, and the host waits for a slot's upload before refilling it",
          "[data][batches][staging]") {
  auto const data = numbered_images(10);
  fake_staging_gpu gpu;
  fake_staging<mpx::half> s(fake_staging_executor{}, data, 4, fake_staging_backend{&gpu});
  std::vector<std::size_t> const b0{7, 2, 5}, b1{0, 9, 1, 4}, b2{3, 8};
  // stage() into slot k, checking its calls (images of 6 halves, 12 bytes, per sample).
  auto const stage = [&](std::vector<std::size_t> const& samples, int k) {
    std::size_t const mark = gpu.log.size();
    s.stage(samples);
    CHECK(log_since(gpu, mark) == stage_calls(k, samples.size() * 12, samples.size() * 4));
  };
  // take() from slot k: the consumer's stream waits for its upload, and gets its memory.
  auto const take = [&](int k) {
    std::size_t const mark = gpu.log.size();
    auto const taken = s.take();
    auto const n = [k](int i) { return std::to_string(2 * k + i); };
    CHECK(log_since(gpu, mark) == std::vector<std::string>{"wait_event event " + n(1) + " on consumer"});
    CHECK(gpu.name_of(taken.first) == "device " + n(1));
    CHECK(gpu.name_of(taken.second) == "device " + n(2));
    return taken;
  };

  // As batch_loader: the first batch is staged, then each take is followed by the next
  // batch's stage.
  stage(b0, 0);  // (the host waits for no upload: none was made)
  auto const batch0 = take(0);
  stage(b1, 1);
  // Nothing has run on the GPU yet: neither upload, nor the consumer's waits.
  CHECK(gpu.streams[1].size() == 8);
  CHECK(gpu.streams[staging_consumer_stream].size() == 3);
  CHECK(gpu.events[1].completed == 0);
  auto const batch1 = take(1);

  // Slot 0 again: the host waits until batch 0's upload has run (it reads the pinned
  // memory about to be overwritten), and only that far.
  stage(b2, 0);
  CHECK(gpu.events[1].completed == 1);
  CHECK(batch_bytes(batch0.first, batch0.second, b0.size()) == expected_bytes<mpx::half>(data, b0));
  CHECK(gpu.events[3].completed == 0);  // batch 1's upload did not have to run, nor batch 2's
  auto const batch2 = take(0);

  gpu.run_all();
  CHECK(batch_bytes(batch1.first, batch1.second, b1.size()) == expected_bytes<mpx::half>(data, b1));
  CHECK(batch_bytes(batch2.first, batch2.second, b2.size()) == expected_bytes<mpx::half>(data, b2));
  CHECK(gpu.faults.empty());
}

TEMPLATE_LIST_TEST_CASE("batch staging: a training loop's batches arrive intact whatever the GPU runs first",
                        "[data][batches][staging]", mpx_test::dtypes) {
  using T = TestType;
  std::size_t const n = 23, batch_size = 4, batches = 6;  // the last batch holds 3
  auto const data = numbered_images(n);
  bool const copies_first = GENERATE(true, false);
  bool const catch_up = GENERATE(false, true);  // the GPU runs everything after each step, or only when waited for
  INFO((copies_first ? "the copy stream" : "the consumer's stream")
       << " runs first where both can; " << (catch_up ? "" : "no ") << "catching up");
  fake_staging_gpu gpu;
  gpu.copies_first = copies_first;
  std::vector<std::vector<int>> seen(batches);
  {
    fake_staging<T> s(fake_staging_executor{}, data, batch_size, fake_staging_backend{&gpu});
    // batch_loader's order: stage(0); then per batch k: take(k), stage(k + 1), and the
    // step on batch k is enqueued on the consumer's stream, where it reads the batch.
    s.stage(loader_samples(0, batch_size, n));
    for (std::size_t k = 0; k < batches; ++k) {
      auto const taken = s.take();
      if (k + 1 < batches) s.stage(loader_samples(k + 1, batch_size, n));
      std::size_t const size = loader_samples(k, batch_size, n).size();
      gpu.enqueue_step([&seen, k, taken, size] { seen[k] = batch_bytes(taken.first, taken.second, size); });
      if (catch_up) gpu.run_all();
    }
    // The staging goes with steps still queued: it waits for its uploads. (A GPU releases
    // the device memory in the consumer's stream, after the steps; the fake keeps it.)
  }
  gpu.run_all();
  for (std::size_t k = 0; k < batches; ++k) {
    INFO("batch " << k);
    CHECK(seen[k] == expected_bytes<T>(data, loader_samples(k, batch_size, n)));
  }
  CHECK(gpu.faults.empty());
  CHECK(gpu.reports.empty());
  CHECK(gpu.nothing_live());
}

TEST_CASE("batch staging: an empty batch uploads nothing and is still ordered", "[data][batches][staging]") {
  auto const data = numbered_images(10);
  fake_staging_gpu gpu;
  fake_staging<float> s(fake_staging_executor{}, data, 4, fake_staging_backend{&gpu});
  std::size_t const mark = gpu.log.size();
  s.stage({});
  auto const [images, labels] = s.take();
  CHECK(log_since(gpu, mark) == std::vector<std::string>{
                                    "synchronize_event event 1",
                                    "record_event event 2 on consumer",
                                    "wait_event event 2 on stream 1",
                                    "record_event event 1 on stream 1",
                                    "wait_event event 1 on consumer",
                                });
  CHECK(gpu.name_of(images) == "device 1");
  CHECK(gpu.name_of(labels) == "device 2");
  gpu.run_all();
  CHECK(gpu.faults.empty());
}

TEST_CASE("batch staging: a construction that fails part way destroys what it made and throws the error",
          "[data][batches][staging]") {
  auto const data = numbered_images(10);
  std::size_t const calls = 13;  // the copy stream, then 6 per slot
  for (std::size_t failing = 1; failing <= calls; ++failing) {
    fake_staging_gpu gpu;
    gpu.fail_call = failing;
    INFO("call " << failing << " fails");
    std::string error;
    try {
      fake_staging<float> s(fake_staging_executor{}, data, 4, fake_staging_backend{&gpu});
    } catch (mpx::cuda_error const& e) {
      error = e.what();
    }
    REQUIRE(gpu.log.size() >= failing);
    CHECK(error == "fake GPU: " + gpu.log[failing - 1] + " failed");  // that call's error, unchanged
    CHECK(gpu.nothing_live());
    CHECK(gpu.reports.empty());
    if (failing == 1) {
      CHECK(gpu.log == std::vector<std::string>{"create_stream stream 1"});  // nothing else was tried
    } else {
      // Nothing is tried after the failure but freeing; the stream goes last, after the
      // memory and events, as in the destructor.
      CHECK(gpu.calls == failing + 1);
      CHECK(gpu.log.back() == "destroy_stream stream 1");
      for (std::size_t i = failing; i + 1 < gpu.log.size(); ++i)
        CHECK((gpu.log[i].starts_with("free ") || gpu.log[i].starts_with("destroy_event ")));
    }
  }

  // The construction succeeds with one call more to give.
  fake_staging_gpu gpu;
  gpu.fail_call = calls + 1;
  CHECK_NOTHROW(fake_staging<float>(fake_staging_executor{}, data, 4, fake_staging_backend{&gpu}));

  // A stream that cannot be destroyed on the way out is reported; the first error is thrown.
  fake_staging_gpu failing_twice;
  failing_twice.fail_call = 4;
  failing_twice.fail_on = "destroy_stream";
  CHECK_THROWS_WITH(fake_staging<float>(fake_staging_executor{}, data, 4, fake_staging_backend{&failing_twice}),
                    "fake GPU: allocate_device device 1 (96 bytes) on consumer failed");
  REQUIRE(failing_twice.reports.size() == 1);
  CHECK(failing_twice.reports[0] ==
        "batch_loader: destroying the copy stream: fake GPU: destroy_stream stream 1 failed");
  CHECK(failing_twice.live_events.empty());
  CHECK(failing_twice.live_buffers.empty());
}

TEST_CASE("batch staging: destruction waits for the uploads, frees the slots, destroys the stream, never throws",
          "[data][batches][staging]") {
  auto const data = numbered_images(10);
  std::vector<std::size_t> const b0{1, 2, 3}, b1{4, 5, 6, 7};
  // Slot k's members in the reverse of their order: its events (released, then copied),
  // device memory (labels, then images), pinned memory (likewise).
  auto const freed = [](int k) {
    auto const n = [k](int i) { return std::to_string(2 * k + i); };
    return std::vector<std::string>{"destroy_event event " + n(2), "destroy_event event " + n(1),
                                    "free device " + n(2),         "free device " + n(1),
                                    "free pinned " + n(2),         "free pinned " + n(1)};
  };
  {
    fake_staging_gpu gpu;
    std::size_t mark = 0;
    {
      fake_staging<float> s(fake_staging_executor{}, data, 4, fake_staging_backend{&gpu});
      s.stage(b0);
      s.take();
      s.stage(b1);  // two uploads still queued
      mark = gpu.log.size();
    }
    std::vector<std::string> expected{"synchronize_stream stream 1"};
    for (int k : {0, 1}) std::ranges::copy(freed(k), std::back_inserter(expected));
    expected.push_back("destroy_stream stream 1");
    CHECK(log_since(gpu, mark) == expected);
    CHECK(gpu.streams[1].empty());  // the uploads ran before the memory went
    CHECK(gpu.faults.empty());
    CHECK(gpu.nothing_live());
  }
  {
    // Failures are reported, and everything is freed all the same.
    fake_staging_gpu gpu;
    {
      fake_staging<float> s(fake_staging_executor{}, data, 4, fake_staging_backend{&gpu});
      s.stage(b0);
      gpu.run_all();
      gpu.fail_on = "synchronize_stream";
      gpu.fail_call = gpu.calls + 2;  // destroy_stream (freeing memory and events is no call that can fail)
    }
    CHECK(gpu.reports == std::vector<std::string>{
                             "batch_loader: waiting for the copy stream: fake GPU: synchronize_stream stream 1 failed",
                             "batch_loader: destroying the copy stream: fake GPU: destroy_stream stream 1 failed"});
    CHECK(gpu.live_events.empty());
    CHECK(gpu.live_buffers.empty());
    CHECK(gpu.faults.empty());
  }
}
