// The checkpoint file optimizers and loss scalers are saved to: named binary sections,
// a format version and a checksum, written to a temporary file that is flushed to disk
// and then renamed over the target, so a crash mid-save leaves the previous checkpoint
// intact. A reader refuses a file that is truncated, corrupt, of another version or of
// another kind of object, or that repeats a section or holds one its object does not
// save, with mpx::checkpoint_error naming the file and the fault (docs/robustness.md).
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/core/fnv1a.hpp>
#include <mpx/core/read_file.hpp>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#if __has_include(<unistd.h>) && __has_include(<fcntl.h>)
#include <fcntl.h>
#include <unistd.h>
#define MPX_HAS_FSYNC 1
#else
#define MPX_HAS_FSYNC 0
#endif

namespace mpx {

//! A checkpoint that cannot be written, or read back into the object asking for it.
class checkpoint_error : public error {
 public:
  using error::error;
};

namespace detail {

// Layout (in the byte order of the machine that saved it: little-endian wherever CUDA
// runs; a file is not portable to a big-endian host):
//   "MPXCKPT\0" | u32 version | u32 kind length | kind | u64 sections |
//   per section: u32 name length | name | u64 size | bytes |
//   u64 FNV-1a hash of everything before it
inline constexpr char checkpoint_magic[8] = {'M', 'P', 'X', 'C', 'K', 'P', 'T', '\0'};
inline constexpr std::uint32_t checkpoint_version = 1;

//! The most steps a saved counter may hold: 2^53, where a double (Adam's bias
//! correction exponent) still counts exactly; no run gets near it (285 years at a
//! microsecond a step), so a larger count marks a corrupt file, not a long run.
inline constexpr std::uint64_t max_checkpoint_steps = std::uint64_t{1} << 53;

constexpr std::uint32_t byteswap32(std::uint32_t x) noexcept {
  return (x >> 24) | ((x >> 8) & 0xFF00u) | ((x << 8) & 0xFF0000u) | (x << 24);
}

template <class T>
std::span<std::byte const> bytes_of(T const& value) noexcept {
  static_assert(std::is_trivially_copyable_v<T>, "checkpoint values are copied as bytes");
  return {reinterpret_cast<std::byte const*>(&value), sizeof(T)};
}

//! The bytes of a text, for a section (no terminating zero).
inline std::span<std::byte const> text_bytes(std::string_view s) noexcept {
  return {reinterpret_cast<std::byte const*>(s.data()), s.size()};
}

//! "'a', 'b', 'c'": the first eight names, then how many more, for a message.
inline std::string quoted_list(std::vector<std::string> const& names) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < 8; ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > 8) out += " and " + std::to_string(names.size() - 8) + " more";
  return out;
}

//! Fault injection for the crash-point tests: when set, commit() calls it before each
//! step of a write ("create", "write" before each piece, "sync", "close", "rename",
//! "sync directory") with the bytes written so far, so a test can kill the process at
//! that moment. Null (no call) unless a test sets it.
inline void (*checkpoint_write_hook)(std::string_view stage, std::size_t written) = nullptr;
//! The most bytes commit() hands to one write (a test lowers it to die mid-file).
inline std::size_t checkpoint_write_piece = std::size_t{1} << 20;

//! Collects named sections in memory, then commits them to a file atomically.
class checkpoint_writer {
 public:
  //! `kind` names what is saved ("mpx::loss_scale_optimizer"); a reader expecting
  //! another kind refuses the file.
  explicit checkpoint_writer(std::string kind) : kind_(std::move(kind)) {}

  void add(std::string name, std::span<std::byte const> bytes) {
    sections_.emplace_back(std::move(name), std::vector<std::byte>(bytes.begin(), bytes.end()));
  }
  template <class T>
  void add_value(std::string name, T const& value) {
    add(std::move(name), bytes_of(value));
  }

  //! Writes `path.tmp-<pid>`, flushes it to disk, renames it to `path`. On any failure
  //! the temporary file is removed, `path` is untouched, and checkpoint_error is thrown.
  void commit(std::filesystem::path const& path) const {
    std::vector<std::byte> file;
    append(file, std::span<char const>(checkpoint_magic));
    append_value(file, checkpoint_version);
    append_string(file, kind_);
    append_value(file, static_cast<std::uint64_t>(sections_.size()));
    for (auto const& [name, bytes] : sections_) {
      append_string(file, name);
      append_value(file, static_cast<std::uint64_t>(bytes.size()));
      file.insert(file.end(), bytes.begin(), bytes.end());
    }
    append_value(file, fnv1a(file));

    std::filesystem::path temporary = path;
    temporary += ".tmp-" + std::to_string(process_id());
    auto refuse = [&](std::string const& why) {
      std::error_code ignored;
      std::filesystem::remove(temporary, ignored);
      fail<checkpoint_error>("checkpoint", "cannot write '" + path.string() + "': " + why +
                                               " (the previous file, if any, is unchanged)");
    };
    auto step = [&](std::string_view stage, std::size_t written) {
      if (checkpoint_write_hook) checkpoint_write_hook(stage, written);
    };
    step("create", 0);
    std::FILE* f = std::fopen(temporary.c_str(), "wb");
    if (!f) refuse("cannot create " + temporary.string() + ": " + std::strerror(errno));
    // In pieces, each flushed: a crash finds the file as far as it got (what the
    // crash-point tests kill it at), and the cost is one call per megabyte.
    bool ok = true;
    std::size_t written = 0;
    while (ok && written < file.size()) {
      step("write", written);
      std::size_t const piece = std::min(file.size() - written, std::max<std::size_t>(checkpoint_write_piece, 1));
      ok = std::fwrite(file.data() + written, 1, piece, f) == piece && std::fflush(f) == 0;
      written += ok ? piece : 0;
    }
    step("sync", written);
#if MPX_HAS_FSYNC
    ok = ok && ::fsync(::fileno(f)) == 0;  // the bytes are on disk before the name moves
#endif
    int const saved_errno = errno;
    step("close", written);
    ok = std::fclose(f) == 0 && ok;
    if (!ok) refuse(std::string("writing failed: ") + std::strerror(saved_errno));
    step("rename", written);
    std::error_code ec;
    std::filesystem::rename(temporary, path, ec);
    if (ec) refuse("cannot rename the temporary file into place: " + ec.message());
    step("sync directory", written);
    sync_directory(path);
  }

 private:
  // The rename is atomic; flushing the directory makes it durable across a power cut.
  // Best effort: a failure here does not undo a complete, correctly named file.
  static void sync_directory([[maybe_unused]] std::filesystem::path const& path) noexcept {
#if MPX_HAS_FSYNC
    std::filesystem::path dir = path.parent_path();
    if (dir.empty()) dir = ".";
    if (int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY); fd >= 0) {
      static_cast<void>(::fsync(fd));
      ::close(fd);
    }
#endif
  }
  static long process_id() noexcept {
#if MPX_HAS_FSYNC
    return static_cast<long>(::getpid());
#else
    return 0;
#endif
  }
  template <class C>
  static void append(std::vector<std::byte>& out, std::span<C const> bytes) {
    auto const* p = reinterpret_cast<std::byte const*>(bytes.data());
    out.insert(out.end(), p, p + bytes.size_bytes());
  }
  template <class T>
  static void append_value(std::vector<std::byte>& out, T const& v) {
    append(out, bytes_of(v));
  }
  static void append_string(std::vector<std::byte>& out, std::string const& s) {
    append_value(out, static_cast<std::uint32_t>(s.size()));
    append(out, std::span<char const>(s.data(), s.size()));
  }

  std::string kind_;
  std::vector<std::pair<std::string, std::vector<std::byte>>> sections_;
};

//! Reads and verifies a whole checkpoint file; then hands out its sections by name.
class checkpoint_reader {
 public:
  checkpoint_reader(std::filesystem::path const& path, std::string_view expected_kind) : path_(path) {
    file_ = read_whole_file<std::byte>(path, [this](std::string const& why) { refuse(why); });

    constexpr std::size_t header = sizeof(checkpoint_magic) + sizeof(std::uint32_t);
    if (file_.size() < header + sizeof(std::uint64_t) ||
        std::memcmp(file_.data(), checkpoint_magic, sizeof(checkpoint_magic)) != 0)
      refuse("it is not an mpx checkpoint (no MPXCKPT header)");
    std::size_t at = sizeof(checkpoint_magic);
    auto const version = take<std::uint32_t>(at);
    if (version == byteswap32(checkpoint_version))
      refuse("it was written on a machine of the other byte order (its version field reads " +
             std::to_string(version) + " here); checkpoints are not portable between byte orders");
    if (version != checkpoint_version)
      refuse("it has format version " + std::to_string(version) + "; this mpx reads version " +
             std::to_string(checkpoint_version));
    std::size_t const body = file_.size() - sizeof(std::uint64_t);
    std::uint64_t stored;
    std::memcpy(&stored, file_.data() + body, sizeof stored);
    if (fnv1a(std::span<std::byte const>(file_.data(), body)) != stored) {
      auto const [claimed, exact] = claimed_length(at);
      if (claimed > file_.size())
        refuse("its checksum does not match: the file is truncated: its contents claim " +
               std::string(exact ? "" : "at least ") + std::to_string(claimed) + " bytes, it holds " +
               std::to_string(file_.size()));
      refuse("its checksum does not match: the file is corrupt (a byte changed)");
    }

    std::string const kind = take_string(at, body);
    if (kind != expected_kind)
      refuse("it holds a " + kind + ", not a " + std::string(expected_kind));
    auto const count = take<std::uint64_t>(at, body);
    for (std::uint64_t i = 0; i < count; ++i) {
      std::string name = take_string(at, body);
      auto const size = take<std::uint64_t>(at, body);
      if (size > body - at) refuse("section '" + name + "' runs past the end of the file");
      sections_.emplace_back(std::move(name), std::span<std::byte const>(file_.data() + at, size));
      at += size;
    }
    if (at != body) refuse("it has " + std::to_string(body - at) + " unexplained bytes after its sections");
    read_.assign(sections_.size(), false);
    // An index, not a scan per lookup: a hostile file of millions of tiny sections must
    // not make loading quadratic. No saver writes a name twice: which would be the state?
    for (std::size_t i = 0; i < sections_.size(); ++i)
      if (!index_.emplace(sections_[i].first, i).second) refuse("it holds section '" + sections_[i].first + "' twice");
  }

  // The sections point into file_: no copies.
  checkpoint_reader(checkpoint_reader const&) = delete;
  checkpoint_reader& operator=(checkpoint_reader const&) = delete;

  [[nodiscard]] bool contains(std::string_view name) const noexcept { return index_.contains(name); }
  //! The bytes of a section; checkpoint_error when it is missing. (Every reading member
  //! takes the caller's location, so a refusal names the line that asked.)
  [[nodiscard]] std::span<std::byte const> section(std::string_view name,
                                                   source_location loc = source_location::current()) const {
    auto const found = index_.find(name);
    if (found == index_.end()) refuse("it has no section '" + std::string(name) + "'", loc);
    read_[found->second] = true;
    return sections_[found->second].second;
  }
  //! The sections no one has asked for (section(), value()) yet, in file order.
  [[nodiscard]] std::vector<std::string> unread_sections() const {
    std::vector<std::string> out;
    for (std::size_t i = 0; i < sections_.size(); ++i)
      if (!read_[i]) out.push_back(sections_[i].first);
    return out;
  }
  //! Refuses the file when it holds a section that was not read: the saver never writes
  //! one, so it comes from another object or version. Call after reading every section.
  void refuse_unread_sections() const {
    std::vector<std::string> const unread = unread_sections();
    if (unread.empty()) return;
    refuse("it holds " + std::to_string(unread.size()) + " section(s) this object does not save: " +
           quoted_list(unread) + "; nothing was loaded");
  }
  //! The bytes of a section that must hold exactly `size` bytes.
  [[nodiscard]] std::span<std::byte const> section(std::string_view name, std::size_t size,
                                                   source_location loc = source_location::current()) const {
    auto const s = section(name, loc);
    if (s.size() != size)
      refuse("section '" + std::string(name) + "' holds " + std::to_string(s.size()) + " bytes where " +
                 std::to_string(size) + " were expected (a tensor of another shape or dtype)",
             loc);
    return s;
  }
  //! A section that holds text (written with text_bytes), as a string.
  [[nodiscard]] std::string text(std::string_view name, source_location loc = source_location::current()) const {
    auto const bytes = section(name, loc);
    return std::string(reinterpret_cast<char const*>(bytes.data()), bytes.size());
  }
  //! Refuses the file unless section `name` holds `expected`; `what` names it for the
  //! message ("parameter list"), which shows both texts.
  void require_text(std::string_view name, std::string_view expected, std::string_view what,
                    source_location loc = source_location::current()) const {
    std::string const got = text(name, loc);
    if (got != expected)
      refuse("the checkpoint's " + std::string(what) + " differs from this one's:\n" + got + "\nexpected:\n" +
                 std::string(expected),
             loc);
  }
  template <class T>
  [[nodiscard]] T value(std::string_view name, source_location loc = source_location::current()) const {
    static_assert(std::is_trivially_copyable_v<T>, "checkpoint values are copied as bytes");
    T out;
    std::memcpy(&out, section(name, sizeof(T), loc).data(), sizeof(T));
    return out;
  }

  //! Throws checkpoint_error "refusing <path>: <why>" (for callers' own checks too),
  //! naming the line that refused.
  [[noreturn]] void refuse(std::string const& why, source_location loc = source_location::current()) const {
    fail<checkpoint_error>("checkpoint", "refusing '" + path_.string() + "': " + why, loc);
  }

 private:
  //! The file's length as its own fields claim it (kind, sections, checksum), read from
  //! `at` (after the version) without trusting them: the walk stops as soon as they claim
  //! more than the file holds (then the claim is a lower bound: exact is false). Each
  //! section costs at least 12 bytes of file, so a hostile count cannot make it slow.
  [[nodiscard]] std::pair<std::uint64_t, bool> claimed_length(std::size_t at) const noexcept {
    std::uint64_t const size = file_.size();
    std::uint64_t pos = at;
    auto field = [&](std::size_t bytes, std::uint64_t& value) {
      if (pos + bytes > size) {
        pos += bytes;
        return false;
      }
      value = 0;
      std::memcpy(&value, file_.data() + pos, bytes);  // little-endian, as written
      pos += bytes;
      return true;
    };
    auto skip = [&](std::uint64_t bytes) {
      pos = bytes > size - pos ? size + 1 : pos + bytes;
      return pos <= size;
    };
    std::uint64_t length = 0, count = 0;
    if (!field(4, length) || !skip(length) || !field(8, count)) return {pos, false};
    for (std::uint64_t i = 0; i < count; ++i)
      if (!field(4, length) || !skip(length) || !field(8, length) || !skip(length)) return {pos, false};
    return {pos + sizeof(std::uint64_t), true};
  }

  template <class T>
  T take(std::size_t& at, std::size_t limit = static_cast<std::size_t>(-1)) const {
    limit = std::min(limit, file_.size());
    if (at > limit || limit - at < sizeof(T)) refuse("it ends in the middle of its header");
    T v;
    std::memcpy(&v, file_.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
  }
  std::string take_string(std::size_t& at, std::size_t limit) const {
    auto const n = take<std::uint32_t>(at, limit);
    if (n > limit - at) refuse("a section name runs past the end of the file");
    std::string s(reinterpret_cast<char const*>(file_.data() + at), n);
    at += n;
    return s;
  }

  std::filesystem::path path_;
  std::vector<std::byte> file_;
  std::vector<std::pair<std::string, std::span<std::byte const>>> sections_;
  std::unordered_map<std::string_view, std::size_t> index_;  // names point into sections_
  mutable std::vector<bool> read_;  // per section: asked for yet (see refuse_unread_sections)
};

}  // namespace detail
}  // namespace mpx
