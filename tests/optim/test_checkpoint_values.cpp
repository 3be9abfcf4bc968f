// Checkpoints whose checksum is valid but whose contents no saver could have written
// (issue 21): impossible loss-scaler states, step counts that would overflow or divide
// by zero, repeated and unknown sections, names the file system refuses. Each is
// refused with mpx::checkpoint_error naming the file and the fault, and the optimizer
// that was asked to load it is left exactly as it was.
#include "../support/testing.hpp"

#include <mpx/optim/adam.hpp>
#include <mpx/core/checkpoint_file.hpp>
#include <mpx/optim/loss_scale_optimizer.hpp>
#include <mpx/optim/sgd.hpp>
#include <mpx/scaling/loss_scaler.hpp>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

//! Two float parameters and their gradients on the host: a tiny model for a tiny file.
struct value_test_parameters {
  mpx::host_executor exec;
  mpx::tensor<float, mpx::host_space> w = mpx_test::upload(exec, std::vector<float>{0.5f, -0.25f, 1.0f, 2.0f}, {4});
  mpx::tensor<float, mpx::host_space> gw = mpx_test::upload(exec, std::vector<float>{0.1f, 0.2f, -0.3f, 0.4f}, {4});
  mpx::tensor<float, mpx::host_space> b = mpx_test::upload(exec, std::vector<float>{0.0f, 1.0f}, {2});
  mpx::tensor<float, mpx::host_space> gb = mpx_test::upload(exec, std::vector<float>{0.5f, -0.5f}, {2});
  std::vector<mpx::parameter<mpx::host_space>> list() { return {{"w", w, gw}, {"b", b, gb}}; }
  std::vector<float> values() { return mpx_test::download(exec, w); }
};

auto make_value_test_optimizer(value_test_parameters& p) {
  mpx::dynamic_scale_rule rule;
  rule.growth_interval = 4;
  rule.hysteresis = 2;
  return mpx::loss_scale_optimizer(mpx::adam(p.exec, p.list(), 1e-2f), mpx::dynamic_loss_scaler(p.exec, rule));
}

//! A copy of checkpoint `from` at `to` with its sections passed through `edit` (which
//! may change, add or drop sections), written by mpx's own writer: the checksum is valid.
void rewrite_checkpoint(fs::path const& from, fs::path const& to, std::string const& kind,
                        std::function<void(std::string const&, std::vector<std::byte>&, mpx::detail::checkpoint_writer&)> const& edit) {
  mpx::detail::checkpoint_reader const in(from, kind);
  mpx::detail::checkpoint_writer out(kind);
  for (std::string const& name : in.unread_sections()) {
    auto const s = in.section(name);
    std::vector<std::byte> bytes(s.begin(), s.end());
    edit(name, bytes, out);
  }
  out.commit(to);
}

//! Field by field: the struct has padding, whose bytes a load copies from the file.
bool same_state(mpx::loss_scale_state const& a, mpx::loss_scale_state const& b) {
  return std::memcmp(&a.scale, &b.scale, sizeof a.scale) == 0 && a.good_steps == b.good_steps &&
         a.overflows_left == b.overflows_left && a.applied_steps == b.applied_steps &&
         a.skipped_steps == b.skipped_steps && a.overflows_at_minimum == b.overflows_at_minimum &&
         a.last_step_skipped == b.last_step_skipped;
}

template <class T>
void set_bytes(std::vector<std::byte>& bytes, std::size_t offset, T value) {
  REQUIRE(offset + sizeof(T) <= bytes.size());
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
}

}  // namespace

TEST_CASE("checkpoint values: impossible states, step counts and sections are refused, nothing changed",
          "[optim][checkpoint][errors]") {
  mpx_test::scratch_dir const scratch("checkpoint_values");
  fs::path const& dir = scratch.path;
  value_test_parameters source;
  auto saved = make_value_test_optimizer(source);
  for (int i = 0; i < 3; ++i) saved.step(source.exec);
  fs::path const good = dir / "good.ckpt";
  saved.save(source.exec, good);
  std::string const kind = "mpx::loss_scale_optimizer";

  value_test_parameters target;
  auto loader = make_value_test_optimizer(target);
  auto const values_before = target.values();
  auto const state_before = loader.scaler().state(target.exec);

  // Rewrites one section of the good file (its bytes edited by `change`) and expects
  // the load to be refused with `why`, the target untouched.
  int variant = 0;
  auto refused_when = [&](std::string const& section, std::function<void(std::vector<std::byte>&)> const& change,
                          std::string const& why) {
    fs::path const bad = dir / ("bad" + std::to_string(variant++) + ".ckpt");
    rewrite_checkpoint(good, bad, kind, [&](std::string const& name, std::vector<std::byte>& bytes, auto& out) {
      if (name == section) change(bytes);
      out.add(name, bytes);
    });
    INFO(section << ": " << why);
    CHECK_THROWS_TYPE_WITH(loader.load(target.exec, bad), mpx::checkpoint_error,
                           Contains(bad.string()) && Contains(why));
    CHECK(target.values() == values_before);
    CHECK(loader.optimizer().steps(target.exec) == 0);
    CHECK(same_state(loader.scaler().state(target.exec), state_before));
  };

  // The rewrite itself keeps a good file good: the refusals below are the edits'.
  {
    fs::path const same = dir / "same.ckpt";
    rewrite_checkpoint(good, same, kind, [](std::string const& name, std::vector<std::byte>& bytes, auto& out) {
      out.add(name, bytes);
    });
    value_test_parameters other;
    auto fine = make_value_test_optimizer(other);
    fine.load(other.exec, same);
    CHECK(fine.optimizer().steps(other.exec) == 3);
    CHECK(other.values() == source.values());
  }

  constexpr std::size_t scale_at = offsetof(mpx::loss_scale_state, scale);
  float const inf = std::numeric_limits<float>::infinity();
  for (float scale : {std::nanf(""), 0.0f, -1.0f, inf, -inf, 0.5f /* below min_scale 1 */})
    refused_when("scaler/state", [&](auto& b) { set_bytes(b, scale_at, scale); }, "loss scaler state is impossible: scale");
  refused_when("scaler/state", [](auto& b) { set_bytes(b, offsetof(mpx::loss_scale_state, good_steps), std::int32_t{-1}); },
               "good_steps -1");
  refused_when("scaler/state", [](auto& b) { set_bytes(b, offsetof(mpx::loss_scale_state, good_steps), std::int32_t{4}); },
               "good_steps 4 (within [0, growth_interval 4))");
  refused_when("scaler/state",
               [](auto& b) { set_bytes(b, offsetof(mpx::loss_scale_state, overflows_left), std::int32_t{3}); },
               "overflows_left 3 (within [0, hysteresis 2])");
  refused_when("scaler/state",
               [](auto& b) { set_bytes(b, offsetof(mpx::loss_scale_state, applied_steps), ~std::uint64_t{0}); },
               "more than 2^53");
  refused_when("scaler/state",
               [](auto& b) { set_bytes(b, offsetof(mpx::loss_scale_state, overflows_at_minimum), std::uint32_t{5}); },
               "5 overflows at the minimum scale but only 0 skipped steps");
  refused_when("scaler/state",
               [](auto& b) { set_bytes(b, offsetof(mpx::loss_scale_state, last_step_skipped), std::uint32_t{1}); },
               "last_step_skipped is 1 with 0 skipped steps");
  // Files saved before the state's padding had a name (`unused`) hold whatever it held:
  // ignored, and 0 once loaded, so two saves of the same state are the same bytes.
  {
    fs::path const old_padding = dir / "old_padding.ckpt";
    rewrite_checkpoint(good, old_padding, kind, [](std::string const& name, std::vector<std::byte>& bytes, auto& out) {
      if (name == "scaler/state") set_bytes(bytes, offsetof(mpx::loss_scale_state, unused), std::uint32_t{7});
      out.add(name, bytes);
    });
    value_test_parameters other;
    auto fine = make_value_test_optimizer(other);
    fine.load(other.exec, old_padding);
    CHECK(fine.scaler().state(other.exec).unused == 0);
    CHECK(fine.optimizer().steps(other.exec) == 3);
  }
  refused_when("scaler/rule",
               [](auto& b) { set_bytes(b, offsetof(mpx::dynamic_scale_rule, growth_interval), std::int32_t{0}); },
               "its saved rule is not one a scaler accepts");
  // 2^64 - 1 steps: the next Adam step's bias correction would divide by zero.
  refused_when("optimizer/steps", [](auto& b) { set_bytes(b, 0, ~std::uint64_t{0}); },
               "its optimizer step count 18446744073709551615 is impossible");
  refused_when("optimizer/steps", [](auto& b) { set_bytes(b, 0, (std::uint64_t{1} << 53) + 1); }, "is impossible");

  // A section twice, or one no saver writes: refused, not ignored.
  fs::path const twice = dir / "twice.ckpt";
  rewrite_checkpoint(good, twice, kind, [](std::string const& name, std::vector<std::byte>& bytes, auto& out) {
    out.add(name, bytes);
    if (name == "scaler/state") out.add(name, bytes);
  });
  CHECK_THROWS_TYPE_WITH(loader.load(target.exec, twice), mpx::checkpoint_error,
                         Contains(twice.string()) && Contains("holds section 'scaler/state' twice"));
  fs::path const unknown = dir / "unknown.ckpt";
  rewrite_checkpoint(good, unknown, kind, [](std::string const& name, std::vector<std::byte>& bytes, auto& out) {
    out.add(name, bytes);
    if (name == "optimizer/steps") out.add("slot7/0", bytes);
  });
  CHECK_THROWS_TYPE_WITH(loader.load(target.exec, unknown), mpx::checkpoint_error,
                         Contains(unknown.string()) && Contains("section(s) this object does not save: 'slot7/0'"));
  CHECK(target.values() == values_before);
  CHECK(loader.optimizer().steps(target.exec) == 0);

  // A plain optimizer's file is held to the same: its step count, its sections.
  value_test_parameters plain_source;
  auto plain = mpx::sgd(plain_source.exec, plain_source.list(), 0.1f, {.momentum = 0.9f});
  plain.step(plain_source.exec);
  fs::path const sgd_file = dir / "sgd.ckpt";
  plain.save(plain_source.exec, sgd_file);
  fs::path const sgd_steps = dir / "sgd_steps.ckpt";
  rewrite_checkpoint(sgd_file, sgd_steps, "mpx::optimizer", [](std::string const& name, std::vector<std::byte>& bytes, auto& out) {
    if (name == "optimizer/steps") set_bytes(bytes, 0, ~std::uint64_t{0});
    out.add(name, bytes);
  });
  fs::path const sgd_extra = dir / "sgd_extra.ckpt";
  rewrite_checkpoint(sgd_file, sgd_extra, "mpx::optimizer", [](std::string const& name, std::vector<std::byte>& bytes, auto& out) {
    out.add(name, bytes);
    if (name == "optimizer/steps") out.add("scaler/state", bytes);
  });
  value_test_parameters plain_target;
  auto plain_loader = mpx::sgd(plain_target.exec, plain_target.list(), 0.1f, {.momentum = 0.9f});
  CHECK_THROWS_TYPE_WITH(plain_loader.load(plain_target.exec, sgd_steps), mpx::checkpoint_error,
                         Contains(sgd_steps.string()) && Contains("step count 18446744073709551615"));
  CHECK_THROWS_TYPE_WITH(plain_loader.load(plain_target.exec, sgd_extra), mpx::checkpoint_error,
                         Contains(sgd_extra.string()) && Contains("'scaler/state'"));
  CHECK(plain_loader.steps(plain_target.exec) == 0);
  plain_loader.load(plain_target.exec, sgd_file);  // and the untouched file loads
  CHECK(plain_loader.steps(plain_target.exec) == 1);
}

TEST_CASE("checkpoint files: names the file system refuses are checkpoint_errors, not filesystem_error",
          "[optim][checkpoint][errors]") {
  mpx_test::scratch_dir const scratch("checkpoint_names");
  fs::path const& dir = scratch.path;
  value_test_parameters p;
  auto o = make_value_test_optimizer(p);
  fs::create_symlink(dir / "loop_b", dir / "loop_a");
  fs::create_symlink(dir / "loop_a", dir / "loop_b");
  CHECK_THROWS_TYPE_WITH(o.load(p.exec, dir / "loop_a"), mpx::checkpoint_error,
                         Contains("loop_a") && Contains("symbolic links"));
  std::string const long_name(300, 'c');
  CHECK_THROWS_TYPE_WITH(o.load(p.exec, dir / long_name), mpx::checkpoint_error,
                         Contains(long_name) && Contains("File name too long"));
  CHECK_THROWS_TYPE_WITH(o.save(p.exec, dir / long_name), mpx::checkpoint_error,
                         Contains(long_name) && Contains("File name too long"));
  CHECK_THROWS_TYPE_WITH(o.load(p.exec, dir), mpx::checkpoint_error, Contains("is a directory"));
  CHECK(o.optimizer().steps(p.exec) == 0);
}
