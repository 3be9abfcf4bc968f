// fit's progress display: the pure formatting of progress.hpp (bar, durations, the line
// fitted to a width), and fit itself writing to a pseudo-terminal (a bar redrawn with
// `\r` and clear-to-end, no wider than the terminal) and to a pipe (plain lines, no `\r`,
// no escape codes). Host executor only: the display does not depend on where steps run.
#include "../support/testing.hpp"

#include <mpx/data/tensor_batches.hpp>
#include <mpx/layers/dense.hpp>
#include <mpx/layers/softmax_layer.hpp>
#include <mpx/model/fit.hpp>
#include <mpx/model/progress.hpp>
#include <mpx/model/sequential.hpp>
#include <mpx/optim/sgd.hpp>
#include <mpx/scaling/loss_scaler.hpp>

#include <cerrno>
#include <cstdio>
#include <functional>
#include <string_view>
#include <string>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <pty.h>
#include <termios.h>
#include <unistd.h>

namespace progress_test {

// Runs `body` with file descriptor 1 replaced by `write_end` and returns what arrived at
// `read_end` (read by a thread, so a full pipe or pty buffer cannot block the writer).
// Both ends are closed; stdout is restored even when `body` throws.
std::string capture_stdout(int write_end, int read_end, std::function<void()> const& body) {
  std::fflush(stdout);
  int const saved = ::dup(STDOUT_FILENO);
  REQUIRE(saved >= 0);
  std::string out;
  std::thread reader([&] {
    char buf[4096];
    for (;;) {
      ssize_t const n = ::read(read_end, buf, sizeof buf);
      if (n > 0) out.append(buf, static_cast<std::size_t>(n));
      else if (n < 0 && errno == EINTR) continue;
      else break;  // EOF (pipe) or EIO (pty: every slave descriptor closed)
    }
  });
  ::dup2(write_end, STDOUT_FILENO);
  ::close(write_end);
  auto restore = [&] {
    std::fflush(stdout);
    ::dup2(saved, STDOUT_FILENO);
    ::close(saved);
    reader.join();
    ::close(read_end);
  };
  try {
    body();
  } catch (...) {
    restore();
    throw;
  }
  restore();
  return out;
}

// A pseudo-terminal `columns` wide that passes bytes unchanged (raw: no "\n" -> "\r\n").
struct pseudo_terminal {
  int master = -1, slave = -1;
  explicit pseudo_terminal(unsigned short columns) {
    winsize size{};
    size.ws_row = 24;
    size.ws_col = columns;
    REQUIRE(::openpty(&master, &slave, nullptr, nullptr, &size) == 0);
    termios raw{};
    REQUIRE(::tcgetattr(slave, &raw) == 0);
    ::cfmakeraw(&raw);
    REQUIRE(::tcsetattr(slave, TCSANOW, &raw) == 0);
  }
};

// A small float32 classifier trained for `epochs` epochs of 8 steps with the default
// display (progress = -1: redraw on a terminal, plain lines elsewhere), redrawing at every step.
void tiny_fit(std::size_t epochs) {
  mpx::host_executor exec;
  std::vector<float> xy(2 * 64);
  std::vector<std::int32_t> labels(64);
  for (std::size_t i = 0; i < 64; ++i) {
    xy[2 * i] = static_cast<float>(i % 8) - 3.5f;
    xy[2 * i + 1] = static_cast<float>(i / 8) - 3.5f;
    labels[i] = xy[2 * i] > 0;
  }
  auto const images = mpx_test::upload(exec, xy, {64, 2});
  auto const classes = mpx_test::upload(exec, labels, {64});
  mpx::tensor_batches<float, mpx::host_space> data(images, classes, 8);
  auto model = mpx::sequential<mpx::float32>(mpx::dense<>(2), mpx::softmax_layer<mpx::float32>());
  model.build(exec, {2}, 1);
  auto optimizer = mpx::loss_scale_optimizer(mpx::sgd(exec, model.parameters(exec), 0.1f),
                                             mpx::static_loss_scaler(exec, 1.0f));
  mpx::fit_options options;
  options.epochs = epochs;
  options.progress_interval_s = 0;
  mpx::fit(exec, model, optimizer, data, options);
}

std::size_t count_of(std::string const& s, char c) { return static_cast<std::size_t>(std::count(s.begin(), s.end(), c)); }

// Whether `bar` is a running bar, "[" then '=' (at least `min_done`), '>', at least
// one '.', and "]" (std::regex would do, but <regex> breaks the -Werror sanitizer build).
inline bool is_running_bar(std::string_view bar, std::size_t min_done) {
  if (bar.size() < 4 || bar.front() != '[' || bar.back() != ']') return false;
  std::size_t i = 1;
  while (i < bar.size() && bar[i] == '=') ++i;
  if (i - 1 < min_done || bar[i] != '>') return false;
  std::size_t const dots = ++i;
  while (i < bar.size() && bar[i] == '.') ++i;
  return i > dots && i == bar.size() - 1;
}

// Whether `text` holds `before` + a running bar + `after`.
inline bool has_bar_between(std::string const& text, std::string const& before, std::string const& after,
                            std::size_t min_done) {
  for (std::size_t at = text.find(before); at != std::string::npos; at = text.find(before, at + 1)) {
    std::size_t const open = at + before.size() - 1;  // `before` ends with '['
    std::size_t const close = text.find(']', open);
    if (close == std::string::npos) return false;
    if (is_running_bar(std::string_view(text).substr(open, close - open + 1), min_done) &&
        text.compare(close + 1, after.size(), after) == 0)
      return true;
  }
  return false;
}

}  // namespace progress_test

TEST_CASE("progress_bar draws Keras's bar at 0%, partway and at 100%", "[model][progress]") {
  CHECK(mpx::progress_bar(0.0, 12) == "[..........]");
  CHECK(mpx::progress_bar(0.5, 12) == "[====>.....]");
  CHECK(mpx::progress_bar(0.99, 12) == "[========>.]");  // rounds down: full only when done
  CHECK(mpx::progress_bar(1.0, 12) == "[==========]");
  CHECK(mpx::progress_bar(0.1, 12) == "[>.........]");
  CHECK(mpx::progress_bar(2.0, 12) == "[==========]");   // clamped
  CHECK(mpx::progress_bar(-1.0, 12) == "[..........]");
  CHECK(mpx::progress_bar(std::nan(""), 12) == "[..........]");
  for (double f : {0.0, 0.3, 0.7, 1.0}) CHECK(mpx::progress_bar(f, 40).size() == 40);
}

TEST_CASE("progress_bar at narrow widths", "[model][progress]") {
  CHECK(mpx::progress_bar(0.5, 0).empty());
  CHECK(mpx::progress_bar(0.5, 2).empty());
  CHECK(mpx::progress_bar(0.5, 3) == "[.]");
  CHECK(mpx::progress_bar(1.0, 3) == "[=]");
  CHECK(mpx::progress_bar(0.5, 4) == "[>.]");
}

TEST_CASE("format_duration writes m:ss, then h:mm:ss", "[model][progress]") {
  CHECK(mpx::format_duration(0) == "0:00");
  CHECK(mpx::format_duration(12.4) == "0:12");
  CHECK(mpx::format_duration(59.6) == "1:00");  // rounded to the second
  CHECK(mpx::format_duration(754) == "12:34");
  CHECK(mpx::format_duration(3599) == "59:59");
  CHECK(mpx::format_duration(3600) == "1:00:00");
  CHECK(mpx::format_duration(3 * 3600 + 2 * 60 + 1) == "3:02:01");
  CHECK(mpx::format_duration(100 * 3600.0) == "100:00:00");
  CHECK(mpx::format_duration(-1) == "-:--");
  CHECK(mpx::format_duration(std::nan("")) == "-:--");
  CHECK(mpx::format_duration(HUGE_VAL) == "-:--");
}

TEST_CASE("progress_line fits the bar into the width and reports ETA and rates", "[model][progress]") {
  mpx::progress_fields f{.epoch = 1, .epochs = 5, .step = 312, .steps = 469, .seconds = 12.0, .loss = 0.43121,
                         .accuracy = 0.84123, .loss_scale = 32768.0f, .skipped = 0};
  std::string const plain = mpx::progress_line(f, 0);
  CHECK(plain == "epoch 1/5  312/469  ETA 0:06  26.0 steps/s  loss 0.4312  acc 0.8412  scale 32768  skipped 0");
  for (std::size_t columns : {80u, 100u, 120u, 200u}) {
    std::string const line = mpx::progress_line(f, columns);
    INFO(columns << " columns: " << line);
    CHECK(line.size() < columns);
    CHECK(line.starts_with("epoch 1/5  ["));
    CHECK(progress_test::has_bar_between(line, "epoch 1/5  [", "  312/469  ETA 0:06  ", 1));
    CHECK(line.find("loss 0.4312  acc 0.8412") != std::string::npos);
    CHECK(line.find("skipped 0") != std::string::npos);
  }
  CHECK(mpx::progress_line(f, 120).size() == 119);  // the bar takes what is left ...
  CHECK(mpx::progress_line(f, 120).find("26.0 steps/s  loss") != std::string::npos);
  CHECK(mpx::progress_line(f, 200).find(mpx::progress_bar(312.0 / 469, 32)) != std::string::npos);  // ... up to 32
  // Narrower: steps/s goes first, then the scale, and the bar keeps at least 10.
  CHECK(mpx::progress_line(f, 100).find("steps/s") == std::string::npos);
  CHECK(mpx::progress_line(f, 100).find("scale 32768") != std::string::npos);
  CHECK(mpx::progress_line(f, 80).find("scale") == std::string::npos);
  CHECK(mpx::progress_line(f, 60) == "epoch 1/5  [======>.....]  312/469  loss 0.4312  acc 0.8412");
  // Too narrow for a bar: none, and the line is cut to the width.
  CHECK(mpx::progress_line(f, 50) == "epoch 1/5  312/469  loss 0.4312  acc 0.8412");
  CHECK(mpx::progress_line(f, 30) == "epoch 1/5  312/469  loss 0.43");
  CHECK(mpx::progress_line(f, 1).empty());
  // The epoch's summary: the time taken instead of the estimate; a full bar.
  f.step = 469;
  f.seconds = 3725;
  f.finished = true;
  CHECK(mpx::progress_line(f, 0).find("469/469  1:02:05  0.1 steps/s") != std::string::npos);
  CHECK(mpx::progress_line(f, 140).find("[" + std::string(30, '=') + "]") != std::string::npos);
  // No estimate before the first step; no bar or estimate when the length is unknown.
  f.finished = false;
  f.step = 0;
  CHECK(mpx::progress_line(f, 0).find("ETA -:--") != std::string::npos);
  f.steps = 0;
  f.step = 7;
  CHECK(mpx::progress_line(f, 120).find("epoch 1/5  7  ") == 0);
  CHECK(mpx::progress_line(f, 120).find("ETA") == std::string::npos);
}

TEST_CASE("terminal_columns reads the terminal's width, 80 elsewhere", "[model][progress]") {
  progress_test::pseudo_terminal pty(97);
  CHECK(mpx::terminal_columns(pty.slave) == 97);
  int ends[2];
  REQUIRE(::pipe(ends) == 0);
  CHECK(mpx::terminal_columns(ends[1]) == 80);
  CHECK(mpx::terminal_columns(ends[1], 123) == 123);
  for (int fd : {pty.master, pty.slave, ends[0], ends[1]}) ::close(fd);
}

TEST_CASE("fit redraws a bar on a terminal and prints plain lines to a pipe", "[model][progress]") {
  using progress_test::count_of;
  SECTION("a pseudo-terminal 72 columns wide") {
    progress_test::pseudo_terminal pty(72);
    std::string const out = progress_test::capture_stdout(pty.slave, pty.master, [] { progress_test::tiny_fit(2); });
    INFO(out);
    CHECK(count_of(out, '\r') >= 16);                       // a redraw per step
    CHECK(out.find("\033[K") != std::string::npos);          // clearing what a longer line left
    CHECK(progress_test::has_bar_between(out, "\repoch 1/2  [", "  4/8  ETA ", 0));
    CHECK(out.find("epoch 2/2  [" + std::string(8, '=')) != std::string::npos);  // the summary's full bar
    CHECK(count_of(out, '\n') == 2);                         // one summary line per epoch stays
    // Every redrawn line fits the terminal: no wrap that `\r` could not undo.
    std::string visible = out;
    for (std::size_t at = visible.find("\033[K"); at != std::string::npos; at = visible.find("\033[K", at))
      visible.erase(at, 3);
    std::size_t longest = 0, run = 0;
    for (char c : visible) {
      run = (c == '\r' || c == '\n') ? 0 : run + 1;
      longest = std::max(longest, run);
    }
    CHECK(longest < 72);
    CHECK(longest > 60);  // and the bar used the room
  }
  SECTION("a pipe") {
    int ends[2];
    REQUIRE(::pipe(ends) == 0);
    std::string const out = progress_test::capture_stdout(ends[1], ends[0], [] { progress_test::tiny_fit(2); });
    INFO(out);
    CHECK(out.find('\r') == std::string::npos);
    CHECK(out.find('\033') == std::string::npos);
    CHECK(out.find('[') == std::string::npos);
    CHECK(out.find("epoch 1/2  2/8  ETA ") != std::string::npos);  // plain lines, four per epoch
    CHECK(out.find("epoch 2/2  8/8  ") != std::string::npos);      // and the summaries
    CHECK(count_of(out, '\n') == 2 * 4);
  }
}
