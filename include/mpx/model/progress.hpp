// The text of fit's progress display, as pure functions a test can check without a
// terminal: a Keras-style bar, durations, and the whole line fitted to a width; plus the
// terminal's width. fit.hpp decides when to print and whether to redraw in place.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <string>

#include <sys/ioctl.h>
#include <unistd.h>

namespace mpx {

//! A bar `width` characters wide, brackets included, filled to `fraction` (clamped to
//! [0, 1]; NaN counts as 0) the way Keras draws it: "[=====>......]" while running,
//! all '=' at 1. Empty when `width` < 3 (no room for one cell).
inline std::string progress_bar(double fraction, std::size_t width) {
  if (width < 3) return {};
  std::size_t const cells = width - 2;
  double const f = std::isnan(fraction) ? 0.0 : std::clamp(fraction, 0.0, 1.0);
  auto const done = static_cast<std::size_t>(f * static_cast<double>(cells));  // rounds down: full only at 1
  std::string bar = "[";
  if (done > 0) bar.append(done - 1, '=');
  if (done > 0) bar += done < cells ? '>' : '=';
  bar.append(cells - done, '.');
  return bar + "]";
}

//! `seconds` as "m:ss" below an hour and "h:mm:ss" above, rounded to the second;
//! "-:--" for a negative, NaN or infinite time (no estimate yet).
inline std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-:--";
  auto const total = static_cast<long long>(std::llround(seconds));
  char buf[48];
  if (total < 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld", total / 60, total % 60);
  else
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", total / 3600, total / 60 % 60, total % 60);
  return buf;
}

//! Columns of the terminal on `fd` (TIOCGWINSZ), or `fallback` when it is not a
//! terminal or does not say.
inline std::size_t terminal_columns(int fd = STDOUT_FILENO, std::size_t fallback = 80) {
  winsize w{};
  if (::ioctl(fd, TIOCGWINSZ, &w) == 0 && w.ws_col > 0) return w.ws_col;
  return fallback;
}

//! What one progress line reports.
struct progress_fields {
  std::size_t epoch = 0, epochs = 0;  //!< epoch from 1
  std::size_t step = 0, steps = 0;    //!< steps done; steps per epoch, 0 when unknown
  double seconds = 0;                 //!< since the epoch began
  double loss = 0;                    //!< mean training loss so far
  double accuracy = 0;                //!< in [0, 1]
  float loss_scale = 0;
  std::size_t skipped = 0;            //!< skipped steps so far
  bool finished = false;              //!< the epoch's summary: time taken instead of ETA
};

//! One line of progress: "epoch 1/5  [====>.....]  312/469  ETA 0:12  26.1 steps/s
//! loss 0.4312  acc 0.8412  scale 32768  skipped 0". With `columns` > 0 the line stays
//! shorter than `columns` (a line as wide as the terminal wraps, and `\r` would then
//! redraw only its second half) and the bar takes the room the rest leaves, 10 to 32
//! characters; where that does not fit, fields go in this order until it does: steps/s,
//! scale, skipped, ETA; then the bar, and the line is cut. With `columns` = 0: no bar,
//! no limit (the plain lines of a log).
inline std::string progress_line(progress_fields const& f, std::size_t columns) {
  auto format = [](char const* pattern, auto... values) {
    char buf[96];
    std::snprintf(buf, sizeof buf, pattern, values...);
    return std::string(buf);
  };
  std::string const head = format("epoch %zu/%zu", f.epoch, f.epochs);
  std::string when;
  if (f.finished)
    when = format_duration(f.seconds);
  else if (f.steps)
    when = "ETA " + format_duration(f.step && f.step <= f.steps ? static_cast<double>(f.steps - f.step) * f.seconds /
                                                                    static_cast<double>(f.step)
                                                              : NAN);
  // The fields after the bar, in order; `drop` lists which go first when space is short.
  enum { count, eta, rate, loss, accuracy, scale, skipped, n_fields };
  std::string fields[n_fields] = {
      f.steps ? format("%zu/%zu", f.step, f.steps) : format("%zu", f.step),
      when,
      format("%.1f steps/s", f.seconds > 0 ? static_cast<double>(f.step) / f.seconds : 0.0),
      format("loss %.4f", f.loss),
      format("acc %.4f", f.accuracy),
      format("scale %g", static_cast<double>(f.loss_scale)),
      format("skipped %zu", f.skipped)};
  auto join = [&](std::string line) {
    for (auto const& field : fields)
      if (!field.empty()) line += "  " + field;
    return line;
  };
  if (columns == 0) return join(head);
  std::size_t const limit = columns - 1;
  constexpr std::size_t min_bar = 10, max_bar = 32;  // Keras's 30 cells at most
  if (f.steps) {
    double const fraction = static_cast<double>(f.step) / static_cast<double>(f.steps);
    for (int const drop : {-1, int{rate}, int{scale}, int{skipped}, int{eta}}) {
      if (drop >= 0) fields[drop].clear();
      std::size_t const rest = join(head).size() + 2;  // the bar brings two spaces
      if (rest + min_bar <= limit) return head + "  " + progress_bar(fraction, std::min(max_bar, limit - rest)) + join("");
    }
  }
  std::string line = join(head);
  if (line.size() > limit) line.resize(limit);
  return line;
}

}  // namespace mpx
