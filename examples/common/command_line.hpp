// The command line of mpx's programs (the examples and the benchmarks), not part of the
// library: flags read strictly (a number has no sign it may not have, no trailing junk,
// no overflow, and lies in its flag's range) and every failure reported on one line with
// a non-zero exit status, so that no program ends in `terminate` or runs on a wrapped value.
#pragma once

#include <mpx/core/error.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace mpx_programs {

//! A command line the program cannot run with: main reports it and exits with status 2.
struct usage_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

//! Walks argv flag by flag:
//!
//!   mpx_programs::command_line args(argc, argv, "[--steps N] [--executor auto|host|cuda]");
//!   while (args.next()) {
//!     if (args.is("--steps")) steps = args.whole<int>(1, 1'000'000);
//!     else if (args.is("--executor")) executor = args.choice({"auto", "host", "cuda"});
//!     else args.unknown();
//!   }
//!
//! Every refusal is a usage_error naming the flag; --help and -h print the usage and exit 0.
class command_line {
 public:
  //! `usage` lists the flags, as printed after "usage: <program> " (newlines allowed).
  command_line(int argc, char** argv, std::string usage) : argc_(argc), argv_(argv), usage_(std::move(usage)) {}

  //! Moves to the next argument; false after the last.
  bool next() {
    if (++i_ >= argc_) return false;
    flag_ = argv_[i_];
    if (flag_ == "--help" || flag_ == "-h") {
      std::printf("usage: %s %s\n", argv_[0], usage_.c_str());
      std::exit(0);
    }
    return true;
  }

  //! Whether the current argument is `flag`.
  [[nodiscard]] bool is(std::string_view flag) const { return flag_ == flag; }
  //! The current argument (the flag, before its value is read).
  [[nodiscard]] std::string const& flag() const noexcept { return flag_; }

  //! The current flag's value: the argument after it.
  std::string text() {
    if (i_ + 1 >= argc_) throw usage_error(flag_ + " needs a value");
    return argv_[++i_];
  }

  //! The value, which must be one of `choices`.
  std::string choice(std::initializer_list<std::string_view> choices) {
    std::string const v = text();
    std::string listed;
    for (auto c : choices) {
      if (v == c) return v;
      listed += (listed.empty() ? "" : ", ") + std::string(c);
    }
    throw usage_error(flag_ + " expects one of " + listed + ", got '" + v + "'");
  }

  //! The value as a whole number in [lo, hi]: decimal digits only, '-' only for a signed T.
  //! `why` (" (...)") says where a limit comes from.
  template <class T>
  T whole(T lo, T hi, std::string_view why = {}) {
    std::string const v = text();
    T n{};
    if (!parse_whole(v, n) || n < lo || n > hi)
      throw usage_error(flag_ + " expects a whole number from " + std::to_string(lo) + " to " + std::to_string(hi) +
                        std::string(why) + ", got '" + v + "'");
    return n;
  }

  //! The value as comma-separated whole numbers, at least one, each in [lo, hi].
  template <class T>
  std::vector<T> wholes(T lo, T hi) {
    std::string const v = text();
    std::vector<T> out;
    bool ok = !v.empty();
    for (std::size_t start = 0; ok && start <= v.size();) {
      std::size_t const comma = std::min(v.find(',', start), v.size());
      T n{};
      ok = parse_whole(std::string_view(v).substr(start, comma - start), n) && n >= lo && n <= hi;
      out.push_back(n);
      start = comma + 1;
    }
    if (!ok)
      throw usage_error(flag_ + " expects whole numbers from " + std::to_string(lo) + " to " + std::to_string(hi) +
                        " separated by commas, got '" + v + "'");
    return out;
  }

  //! The value as a finite number in [lo, hi], or in (lo, hi] where `above_lo`.
  double real(double lo, double hi, bool above_lo = false) {
    std::string const v = text();
    char* end = nullptr;
    errno = 0;
    double const x = std::strtod(v.c_str(), &end);  // skips leading blanks: refused below
    bool const ok = !v.empty() && !std::isspace(static_cast<unsigned char>(v[0])) && end == v.c_str() + v.size() &&
                    errno == 0 && std::isfinite(x) && (above_lo ? x > lo : x >= lo) && x <= hi;
    if (!ok)
      throw usage_error(flag_ + " expects a number " + (above_lo ? "above " : "from ") + mpx::detail::to_text(lo) +
                        (above_lo ? " and at most " : " to ") + mpx::detail::to_text(hi) + ", got '" + v + "'");
    return x;
  }

  //! Refuses the current argument: no flag of this program is called that.
  [[noreturn]] void unknown() const {
    throw usage_error((flag_.starts_with("-") ? "unknown flag '" : "unexpected argument '") + flag_ +
                      "'; usage: " + one_line_usage());
  }

 private:
  template <class T>
  static bool parse_whole(std::string_view v, T& n) {
    static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
    auto const [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
    return !v.empty() && ec == std::errc{} && end == v.data() + v.size();
  }

  [[nodiscard]] std::string one_line_usage() const {
    std::string_view name = argv_[0];
    if (auto slash = name.rfind('/'); slash != std::string_view::npos) name.remove_prefix(slash + 1);
    std::string out = std::string(name) + ' ';
    bool space = true;
    for (char c : usage_) {  // the usage's line breaks and indents become single spaces
      bool const blank = c == ' ' || c == '\n';
      if (!blank || !space) out += blank ? ' ' : c;
      space = blank;
    }
    return out;
  }

  int argc_;
  char** argv_;
  std::string usage_;
  int i_ = 0;
  std::string flag_;
};

//! What failed, as main reports it, and the exit status: 2 for a usage error, 1 otherwise.
struct failure {
  std::string what;
  int status;
};

//! The failure the exception in flight describes; call it only inside a catch block.
inline failure current_failure() {
  try {
    throw;
  } catch (usage_error const& e) {
    return {e.what(), 2};
  } catch (mpx::error const& e) {
    return {e.what(), 1};
  } catch (std::bad_alloc const&) {
    return {"out of memory (std::bad_alloc): ask for smaller sizes", 1};
  } catch (std::exception const& e) {
    return {e.what(), 1};
  } catch (...) {
    return {"an exception of unknown type", 1};
  }
}

//! For main's `catch (...)`: prints "<program>: <what failed>" on stderr and returns the
//! exit status.
inline int report_failure(char const* program) {
  failure const f = current_failure();
  std::fprintf(stderr, "%s: %s\n", program, f.what.c_str());
  return f.status;
}

}  // namespace mpx_programs
