// Faults while writing and reading checkpoint and model files (issue 21), on the host:
//  - a child process killed (SIGKILL) at every step of a checkpoint write and of a model
//    write (the writer's fault-injection hook, pieces of 53 bytes): the previous file
//    always loads and equals what was saved before, or the new one if the rename
//    happened; a leftover temporary file is never what loads;
//  - a full disk (a file-size limit in a child) and a directory the writer may not
//    write (a child without root's rights): a clear checkpoint_error, the previous file
//    unchanged, no temporary left;
//  - every truncation and a flipped bit at every offset of a small checkpoint and model
//    file: refused, the destination unchanged; with the checksum recomputed after the
//    flip, refused or loaded, never anything else;
//  - load_model against files for other models: refused naming the tensors, or a
//    deliberate partial load.
#include "../support/testing.hpp"

#include "../../fuzz/targets.hpp"

#include <mpx/layers/dense.hpp>
#include <mpx/layers/layer_norm.hpp>
#include <mpx/model/model_file.hpp>
#include <mpx/model/sequential.hpp>
#include <mpx/core/checkpoint_file.hpp>

#include <csignal>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <tuple>
#include <vector>

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

using fault_dir = mpx_test::scratch_dir;

std::vector<std::byte> file_content(fs::path const& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> chars{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::vector<std::byte> out(chars.size());
  std::memcpy(out.data(), chars.data(), chars.size());
  return out;
}

void put_content(fs::path const& p, std::vector<std::byte> const& bytes) {
  std::ofstream(p, std::ios::binary)
      .write(reinterpret_cast<char const*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

//! How a child process ended and what it reported.
struct child_end {
  bool killed = false;  // by SIGKILL
  int exit_code = -1;
  std::string report;
};

//! Runs `body` in a forked child; its return value (or the exception it threw) comes
//! back through a pipe. The child leaves with _exit: no Catch2, no destructors.
child_end in_child(std::function<std::string()> const& body) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  pid_t const pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    std::string report;
    int code = 0;
    try {
      report = body();
    } catch (std::exception const& e) {
      report = std::string("exception: ") + e.what();
      code = 3;
    }
    for (std::size_t at = 0; at < report.size();) {
      ssize_t const n = ::write(fds[1], report.data() + at, report.size() - at);
      if (n <= 0) break;
      at += static_cast<std::size_t>(n);
    }
    ::_exit(code);
  }
  ::close(fds[1]);
  child_end end;
  char buffer[4096];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof buffer)) > 0;) end.report.append(buffer, static_cast<std::size_t>(n));
  ::close(fds[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  end.killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
  end.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return end;
}

// The crash hook: a plain function (the writer's hook is a function pointer) that kills
// the process at its n-th call.
std::size_t calls_before_crash = 0;
void crash_at_countdown(std::string_view, std::size_t) {
  if (calls_before_crash-- == 0) ::kill(::getpid(), SIGKILL);
}

//! Every tensor of a model's file as host bytes.
template <class Model>
std::vector<std::vector<std::byte>> model_content(Model& model) {
  std::vector<std::vector<std::byte>> out;
  for (auto const& [name, t] : mpx::detail::model_tensors<mpx::host_space>(model)) {
    auto const* p = static_cast<std::byte const*>(t.data());
    out.emplace_back(p, p + t.size_bytes());
  }
  return out;
}

//! What an optimizer checkpoint restores, as comparable bytes: values, steps, scaler state.
template <class Optimizer>
std::vector<std::byte> optimizer_content(mpx::host_executor const& exec, mpx_fuzz::model_type& model,
                                         Optimizer const& o) {
  std::vector<std::byte> out;
  for (auto const& t : model_content(model)) out.insert(out.end(), t.begin(), t.end());
  auto const state = o.scaler().state(exec);
  auto append = [&](auto value) {
    auto const* p = reinterpret_cast<std::byte const*>(&value);
    out.insert(out.end(), p, p + sizeof value);
  };
  // Field by field: the state struct has padding, whose bytes a load copies from the file.
  append(o.optimizer().steps(exec));
  append(state.scale);
  append(state.good_steps);
  append(state.overflows_left);
  append(state.applied_steps);
  append(state.skipped_steps);
  append(state.overflows_at_minimum);
  append(state.last_step_skipped);
  return out;
}

//! A model and its loss-scaled optimizer (fuzz/targets.hpp's shapes), trained `steps`.
struct trained {
  mpx::host_executor exec;
  mpx_fuzz::model_type model;
  decltype(mpx_fuzz::make_optimizer(exec, model)) optimizer;
  trained(std::uint64_t seed, int steps)
      : model(built(exec, seed)), optimizer(mpx_fuzz::make_optimizer(exec, model)) {
    optimizer.optimizer().allow_step_without_backward(true);  // the gradients are written below, by hand
    for (int i = 0; i < steps; ++i) {
      for (auto& p : model.parameters(exec)) {  // some gradient, different per step
        auto* g = static_cast<mpx::half*>(p.gradient.data());
        if (p.gradient.dtype() != mpx::dtype_id::float16) continue;
        for (std::size_t k = 0; k < p.gradient.size(); ++k) g[k] = mpx::cast<mpx::half>(0.01f * float(k + i + 1));
      }
      optimizer.step(exec);
    }
  }
  std::vector<std::byte> content() { return optimizer_content(exec, model, optimizer); }

 private:
  static mpx_fuzz::model_type built(mpx::host_executor const& exec, std::uint64_t seed) {
    auto m = mpx_fuzz::make_model();
    m.build(exec, {4}, seed);
    return m;
  }
};

//! A kind of file for the crash-point test: how a trained object saves it, how the
//! reader loads one, and what a load restores (as comparable bytes).
struct file_kind {
  std::string name;
  std::function<void(trained&, fs::path const&)> save;
  std::function<void(trained&, fs::path const&)> load;
  std::function<std::vector<std::vector<std::byte>>(trained&)> content;
};

struct crash_counts {
  std::size_t file_bytes = 0;  // of the next file
  int kills = 0;
  int kept_previous = 0;
  int took_next = 0;
  int temporaries = 0;
};

//! The previous file (an object trained `previous_steps`) is on disk; a child saves the
//! next one (trained `next_steps`) over it and is killed at the k-th step of the write,
//! for k = 0, 1, ... until a write completes. After each kill the file must load and
//! equal the previous content, or the next one if the rename happened; each leftover
//! file must be the writer's own temporary, refused or (when complete) equal to the next
//! content. Then the next save must succeed in spite of the crashes.
crash_counts kill_during_writes(file_kind const& kind, int previous_steps, int next_steps) {
  fault_dir dir("crash_" + kind.name);
  fs::path const path = dir.path / (kind.name + ".mpx");
  trained previous(1, previous_steps);
  trained next(2, next_steps);
  trained reader(3, 0);
  kind.save(previous, path);
  auto const previous_content = kind.content(previous);
  auto const next_content = kind.content(next);
  REQUIRE(previous_content != next_content);

  crash_counts counts;
  for (std::size_t k = 0;; ++k) {
    REQUIRE(k < 10000);
    child_end const end = in_child([&] {
      mpx::detail::checkpoint_write_piece = 53;
      mpx::detail::checkpoint_write_hook = crash_at_countdown;
      calls_before_crash = k;
      kind.save(next, path);
      return std::string("completed");
    });
    if (!end.killed) {
      INFO(end.report);
      CHECK(end.exit_code == 0);
      CHECK(end.report == "completed");
      break;
    }
    ++counts.kills;
    INFO(kind.name << " killed at write step " << k);
    kind.load(reader, path);
    auto const got = kind.content(reader);
    CHECK((got == previous_content || got == next_content));
    (got == previous_content ? counts.kept_previous : counts.took_next) += 1;
    for (auto const& entry : fs::directory_iterator(dir.path)) {
      if (entry.path() == path) continue;
      // Only the writer's own temporary may be left: "<name>.tmp-<pid>".
      CHECK(entry.path().filename().string().starts_with(path.filename().string() + ".tmp-"));
      ++counts.temporaries;
      auto const before = kind.content(reader);
      try {
        kind.load(reader, entry.path());
        CHECK(kind.content(reader) == next_content);  // complete: killed at sync, close or rename
      } catch (mpx::checkpoint_error const&) {
        CHECK(kind.content(reader) == before);
      }
      fs::remove(entry.path());
    }
  }
  kind.save(next, path);
  kind.load(reader, path);
  CHECK(kind.content(reader) == next_content);
  counts.file_bytes = fs::file_size(path);
  return counts;
}

}  // namespace

TEST_CASE("crash points: a checkpoint or model write killed at any step leaves the previous file loadable",
          "[optim][model][checkpoint][faults]") {
  file_kind const checkpoint{"optimizer", [](trained& t, fs::path const& p) { t.optimizer.save(t.exec, p); },
                             [](trained& t, fs::path const& p) { t.optimizer.load(t.exec, p); },
                             [](trained& t) { return std::vector<std::vector<std::byte>>{t.content()}; }};
  file_kind const model{"model", [](trained& t, fs::path const& p) { mpx::save_model(t.exec, t.model, p); },
                        [](trained& t, fs::path const& p) { mpx::load_model(t.exec, t.model, p); },
                        [](trained& t) { return model_content(t.model); }};
  for (auto const& [kind, previous_steps, next_steps] : {std::tuple{checkpoint, 2, 5}, std::tuple{model, 0, 0}}) {
    auto const c = kill_during_writes(kind, previous_steps, next_steps);
    // The write's steps: create, each 53-byte piece, sync, close, rename, sync directory.
    int const steps = static_cast<int>((c.file_bytes + 52) / 53) + 5;
    INFO(kind.name << ": " << c.file_bytes << " bytes");
    CHECK(c.file_bytes > 300);
    CHECK(c.kills == steps);
    CHECK(c.kept_previous == steps - 1);
    CHECK(c.took_next == 1);               // killed after the rename: the new file is whole
    CHECK(c.temporaries == steps - 2);     // none when killed before it was created, or after the rename
  }
}

TEST_CASE("a full disk and a directory that may not be written: refused, the previous file unchanged",
          "[optim][checkpoint][faults]") {
  fault_dir dir("full");
  fs::path const path = dir.path / "optimizer.mpx";
  fs::path const model_path = dir.path / "model.mpx";
  trained previous(1, 2);
  trained next(2, 5);
  previous.optimizer.save(previous.exec, path);
  mpx::save_model(previous.exec, previous.model, model_path);
  auto const previous_bytes = file_content(path);
  auto const previous_model_bytes = file_content(model_path);
  auto only_the_previous_files = [&] {
    CHECK(file_content(path) == previous_bytes);
    CHECK(file_content(model_path) == previous_model_bytes);
    for (auto const& entry : fs::directory_iterator(dir.path))
      CHECK((entry.path() == path || entry.path() == model_path));  // no temporary left
  };

  // A full disk: the file-size limit stops the write at 300 bytes (EFBIG), as ENOSPC would.
  for (bool model : {false, true}) {
    child_end const end = in_child([&] {
      ::signal(SIGXFSZ, SIG_IGN);
      rlimit const limit{300, 300};
      if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) return std::string("setrlimit failed");
      if (model)
        mpx::save_model(next.exec, next.model, model_path);
      else
        next.optimizer.save(next.exec, path);
      return std::string("saved");
    });
    INFO(end.report);
    CHECK(end.exit_code == 3);
    CHECK_THAT(end.report, Contains("exception: mpx::checkpoint: cannot write '" + (model ? model_path : path).string()) &&
                               Contains("writing failed: File too large") && Contains("previous file, if any, is unchanged"));
    only_the_previous_files();
  }

  // A directory this process may not write, and a file it may not read. As root (CI, the
  // container) permissions do not stop anything, so the child gives up root's rights.
  ::chmod(dir.path.c_str(), 0555);
  ::chmod(path.c_str(), 0600);
  child_end const end = in_child([&] {
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return std::string("cannot drop root");
    std::string report;
    try {
      next.optimizer.save(next.exec, path);
      report += "saved;";
    } catch (mpx::checkpoint_error const& e) {
      report += std::string(e.what()) + ";";
    }
    try {
      next.optimizer.load(next.exec, path);
      report += "loaded;";
    } catch (mpx::checkpoint_error const& e) {
      report += e.what();
    }
    return report;
  });
  ::chmod(dir.path.c_str(), 0755);
  if (end.report == "cannot drop root") {
    WARN("skipped the read-only directory case: running as root and setuid(65534) failed, so permissions "
         "cannot stop a write here");
  } else {
    INFO(end.report);
    CHECK(end.exit_code == 0);
    CHECK_THAT(end.report, Contains("cannot write '" + path.string()) && Contains("Permission denied") &&
                               Contains("refusing '" + path.string() + "': cannot open it: Permission denied"));
    only_the_previous_files();
  }
}

TEST_CASE("every truncation and every flipped byte of a checkpoint and a model file is refused, nothing changed",
          "[optim][model][checkpoint][faults]") {
  fault_dir dir("flips");
  trained saved(1, 3);
  fs::path const ckpt = dir.path / "optimizer.mpx";
  fs::path const model_file = dir.path / "model.mpx";
  saved.optimizer.save(saved.exec, ckpt);
  mpx::save_model(saved.exec, saved.model, model_file);
  fs::path const damaged = dir.path / "damaged";
  trained target(2, 0);

  struct kind_of_file {
    fs::path good;
    std::function<void()> load;
    std::function<std::vector<std::byte>()> content;
  };
  std::vector<kind_of_file> const kinds{
      {ckpt, [&] { target.optimizer.load(target.exec, damaged); }, [&] { return target.content(); }},
      {model_file, [&] { mpx::load_model(target.exec, target.model, damaged); },
       [&] { return optimizer_content(target.exec, target.model, target.optimizer); }}};
  for (auto const& kind : kinds) {
    auto const good = file_content(kind.good);
    auto const before = kind.content();
    INFO(kind.good.filename().string() << ", " << good.size() << " bytes");
    int refused = 0;
    auto expect_refused = [&](std::size_t at, char const* what) {
      try {
        kind.load();
        FAIL_CHECK(what << " at byte " << at << " loaded");
      } catch (mpx::checkpoint_error const& e) {
        ++refused;
        if (std::string_view(e.what()).find(damaged.string()) == std::string_view::npos) FAIL_CHECK(e.what());
      }
      if (kind.content() != before) FAIL_CHECK(what << " at byte " << at << " changed the destination");
    };
    for (std::size_t n = 0; n < good.size(); ++n) {
      put_content(damaged, {good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n)});
      expect_refused(n, "a file cut");
    }
    for (std::size_t at = 0; at < good.size(); ++at) {
      auto flipped = good;
      flipped[at] ^= std::byte{static_cast<unsigned char>(1u << (at % 8))};
      put_content(damaged, flipped);
      expect_refused(at, "a flipped bit");
    }
    CHECK(refused == static_cast<int>(2 * good.size()));

    // The checksum recomputed after the flip: the structure is all that stands between
    // the bytes and the load. Refused (nothing changed) or loaded, never anything else.
    int loaded = 0;
    for (std::size_t at = 0; at + 8 < good.size(); ++at) {
      auto flipped = good;
      flipped[at] ^= std::byte{static_cast<unsigned char>(1u << (at % 8))};
      std::uint64_t const sum = mpx::detail::fnv1a(std::span<std::byte const>(flipped.data(), flipped.size() - 8));
      std::memcpy(flipped.data() + flipped.size() - 8, &sum, 8);
      put_content(damaged, flipped);
      auto const current = kind.content();
      try {
        kind.load();
        ++loaded;
      } catch (mpx::checkpoint_error const&) {
        if (kind.content() != current) FAIL_CHECK("a refused file changed the destination (byte " << at << ")");
      }
    }
    CHECK(loaded > 0);  // flips inside the stored values load as other values
  }
}

TEST_CASE("load_model refuses a file of another model, naming the tensors; partial loads only on request",
          "[model][errors]") {
  fault_dir dir("partial");
  mpx::host_executor exec;
  auto two = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(3, mpx::activation::tanh), mpx::dense<>(2));
  auto three = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(3, mpx::activation::tanh), mpx::dense<>(2),
                                                   mpx::dense<>(5));
  two.build(exec, {4}, 1);
  three.build(exec, {4}, 2);
  mpx::save_model(exec, two, dir.path / "two.mpx");
  mpx::save_model(exec, three, dir.path / "three.mpx");
  auto const two_before = model_content(two);
  auto const three_before = model_content(three);

  // A file with an extra layer: refused, the extra tensors named, nothing loaded.
  CHECK_THROWS_TYPE_WITH(mpx::load_model(exec, two, dir.path / "three.mpx"), mpx::checkpoint_error,
                         Contains((dir.path / "three.mpx").string()) && Contains("does not describe this model") &&
                             Contains("it holds 'dense_2/kernel', 'dense_2/bias'") &&
                             Contains("mpx::model_load::partial"));
  CHECK(model_content(two) == two_before);
  // A file lacking a layer: refused, the missing tensors named.
  CHECK_THROWS_TYPE_WITH(mpx::load_model(exec, three, dir.path / "two.mpx"), mpx::checkpoint_error,
                         Contains("it lacks this model's 'dense_2/kernel', 'dense_2/bias'"));
  CHECK(model_content(three) == three_before);

  // Partial, on request: the tensors both have are loaded, the rest keep their values.
  mpx::load_model(exec, three, dir.path / "two.mpx", mpx::model_load::partial);
  auto const three_after = model_content(three);
  REQUIRE(three_after.size() == 6);
  for (std::size_t i = 0; i < 4; ++i) CHECK(three_after[i] == two_before[i]);
  CHECK(three_after[4] == three_before[4]);
  CHECK(three_after[5] == three_before[5]);
  mpx::load_model(exec, two, dir.path / "three.mpx", mpx::model_load::partial);
  auto const two_after = model_content(two);
  for (std::size_t i = 0; i < 4; ++i) CHECK(two_after[i] == three_before[i]);
  // ... but a tensor both have in another shape is still refused, and so is a file
  // with nothing in common.
  auto wide = mpx::sequential<mpx::mixed_float16>(mpx::dense<>(7));
  wide.build(exec, {4}, 3);
  CHECK_THROWS_TYPE_WITH(mpx::load_model(exec, wide, dir.path / "two.mpx", mpx::model_load::partial),
                         mpx::checkpoint_error, Contains("'dense/kernel' is float16 [4, 3] but this model's is float16 [4, 7]"));
  auto norm_only = mpx::sequential<mpx::mixed_float16>(mpx::layer_norm<>());
  norm_only.build(exec, {4}, 4);
  CHECK_THROWS_TYPE_WITH(mpx::load_model(exec, norm_only, dir.path / "two.mpx", mpx::model_load::partial),
                         mpx::checkpoint_error, Contains("holds none of this model's tensors"));

  // Names the file system refuses: checkpoint_errors, never filesystem_error.
  fs::create_symlink(dir.path / "loop_b", dir.path / "loop_a");
  fs::create_symlink(dir.path / "loop_a", dir.path / "loop_b");
  CHECK_THROWS_TYPE_WITH(mpx::load_model(exec, two, dir.path / "loop_a"), mpx::checkpoint_error,
                         Contains("loop_a") && Contains("symbolic links"));
  std::string const long_name(300, 'm');
  CHECK_THROWS_TYPE_WITH(mpx::load_model(exec, two, dir.path / long_name), mpx::checkpoint_error,
                         Contains(long_name) && Contains("File name too long"));
  CHECK_THROWS_TYPE_WITH(mpx::save_model(exec, two, dir.path / long_name), mpx::checkpoint_error,
                         Contains("File name too long"));
}
