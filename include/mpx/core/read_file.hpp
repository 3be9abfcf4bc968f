// Reading a whole file for mpx's file readers (IDX data, checkpoints, model files) with
// error codes only: a missing file, a directory, a symlink loop, a name too long or a
// file without permission becomes the reader's own mpx::error naming the file, never a
// std::filesystem::filesystem_error. Nothing is allocated beyond what the file holds.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <type_traits>
#include <vector>

namespace mpx::detail {

//! Every byte of the file at `path` as Byte (std::byte or std::uint8_t). When it cannot
//! be read, calls refuse(why) (which must throw) with "it is a directory, not a file",
//! "cannot open it: <reason>" or "reading it failed: <reason>".
template <class Byte, class Refuse>
std::vector<Byte> read_whole_file(std::filesystem::path const& path, Refuse&& refuse) {
  static_assert(sizeof(Byte) == 1 && std::is_trivially_copyable_v<Byte>, "a file is read as bytes");
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) refuse(std::string("it is a directory, not a file"));
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) refuse(std::string("cannot open it: ") + std::strerror(errno));
  struct closer {
    std::FILE* f;
    ~closer() { std::fclose(f); }
  } guard{f};
  // Grown as bytes arrive, not sized from a stat: what is allocated is what was read.
  std::vector<Byte> bytes;
  Byte chunk[1 << 16];
  std::size_t got = 0;
  while ((got = std::fread(chunk, 1, sizeof chunk, f)) > 0) bytes.insert(bytes.end(), chunk, chunk + got);
  if (std::ferror(f)) refuse(std::string("reading it failed: ") + std::strerror(errno));
  return bytes;
}

}  // namespace mpx::detail
