// The IDX file format of MNIST and Fashion-MNIST: a big-endian header (0x00 0x00, an
// element type, the number of dimensions, each dimension as a 32-bit count) followed by
// the elements. Files may be gzip-compressed (detected by their first bytes, not their
// name). A file that is missing, truncated, too long or malformed is refused with
// mpx::data_error naming the file and the fault: never a short or silent read, and
// never more memory than the file could hold (a gzip stream is inflated no further
// than its header says). docs/robustness.md lists every check; fuzz/ fuzzes them.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/core/read_file.hpp>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// zlib is optional: Meson's mpx dependency defines MPX_HAS_ZLIB=1 (and links -lz) when
// it finds zlib; without Meson, define it yourself and link -lz. Without it, plain IDX
// files still load and a gzip file is refused with a message that says so.
#ifndef MPX_HAS_ZLIB
#define MPX_HAS_ZLIB 0
#endif
#if MPX_HAS_ZLIB
#include <zlib.h>
#endif

namespace mpx {

//! The contents of an IDX file of unsigned bytes: its dimensions (outermost first) and
//! its elements in row-major order.
struct idx_array {
  std::vector<std::int64_t> dims;
  std::vector<std::uint8_t> data;

  //! The number of elements the dimensions describe.
  [[nodiscard]] std::size_t size() const noexcept {
    std::size_t n = 1;
    for (std::int64_t d : dims) n *= static_cast<std::size_t>(d);
    return n;
  }
};

//! How write_idx stores a file.
enum class idx_compression { none, gzip };

//! Whether this build can read and write gzip-compressed IDX files (zlib was found).
inline constexpr bool idx_gzip_available = MPX_HAS_ZLIB != 0;

namespace detail {

inline constexpr std::uint8_t idx_unsigned_byte = 0x08;

//! "unsigned byte (0x08)", "float32 (0x0D)": an IDX element type as a message names it.
inline std::string idx_type_name(std::uint8_t code) {
  char hex[8];
  std::snprintf(hex, sizeof hex, "0x%02X", static_cast<unsigned>(code));
  char const* name = nullptr;
  switch (code) {
    case 0x08: name = "unsigned byte"; break;
    case 0x09: name = "signed byte"; break;
    case 0x0B: name = "int16"; break;
    case 0x0C: name = "int32"; break;
    case 0x0D: name = "float32"; break;
    case 0x0E: name = "float64"; break;
    default: return std::string("unknown type ") + hex;
  }
  return std::string(name) + " (" + hex + ")";
}

inline std::string hex_bytes(std::span<std::uint8_t const> bytes) {
  std::string out;
  for (std::uint8_t b : bytes) {
    char hex[8];
    std::snprintf(hex, sizeof hex, "%s0x%02X", out.empty() ? "" : " ", static_cast<unsigned>(b));
    out += hex;
  }
  return out;
}

[[noreturn]] inline void refuse_idx(std::string_view op, std::string_view name, std::string const& why,
                                    mpx::source_location loc = mpx::source_location::current()) {
  fail<data_error>(op, "'" + std::string(name) + "': " + why, loc);
}

//! Every byte of a file; data_error when it cannot be opened or read.
inline std::vector<std::uint8_t> read_file_bytes(std::filesystem::path const& path, std::string_view op) {
  std::string const name = path.string();
  return read_whole_file<std::uint8_t>(path, [&](std::string const& why) { refuse_idx(op, name, why); });
}

inline bool is_gzip(std::span<std::uint8_t const> bytes) noexcept {
  return bytes.size() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b;
}

//! The decompressed contents of a gzip file (all members, if several are concatenated),
//! at most `limit` bytes of them: inflation stops there, so a stream that inflates to
//! gigabytes costs no more memory than the caller allows.
inline std::vector<std::uint8_t> gunzip([[maybe_unused]] std::span<std::uint8_t const> compressed,
                                        std::string_view name, std::string_view op,
                                        [[maybe_unused]] std::size_t limit) {
#if MPX_HAS_ZLIB
  std::vector<std::uint8_t> out;
  // The gzip trailer holds the size modulo 2^32: a hint, bounded by deflate's best ratio
  // and by the limit, so a corrupt trailer cannot ask for gigabytes.
  if (compressed.size() >= 18) {
    auto const* t = compressed.data() + compressed.size() - 4;
    std::size_t const hint = t[0] | (t[1] << 8) | (t[2] << 16) | (static_cast<std::size_t>(t[3]) << 24);
    out.reserve(std::min({hint, compressed.size() * 1032, limit}));
  }
  z_stream z{};
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) refuse_idx(op, name, "zlib could not start decompressing");
  struct end_inflate {
    z_stream* z;
    ~end_inflate() { inflateEnd(z); }
  } guard{&z};
  std::size_t in_at = 0;
  std::size_t out_at = 0;
  while (out_at < limit) {
    if (z.avail_in == 0 && in_at < compressed.size()) {
      auto const n = static_cast<uInt>(std::min<std::size_t>(compressed.size() - in_at, UINT_MAX));
      z.next_in = const_cast<Bytef*>(compressed.data() + in_at);  // zlib's API is not const-correct
      z.avail_in = n;
      in_at += n;
    }
    if (out.size() - out_at == 0)
      out.resize(std::min(limit, std::max<std::size_t>(out.size() * 2, out_at + (1 << 16))));
    auto const room = static_cast<uInt>(std::min<std::size_t>(out.size() - out_at, UINT_MAX));
    z.next_out = out.data() + out_at;
    z.avail_out = room;
    int const status = inflate(&z, Z_NO_FLUSH);
    out_at += room - z.avail_out;
    if (status == Z_STREAM_END) {
      std::size_t const left = z.avail_in + (compressed.size() - in_at);
      if (left == 0) break;
      std::size_t const next = compressed.size() - left;
      if (!is_gzip(compressed.subspan(next)))
        refuse_idx(op, name, std::to_string(left) + " bytes of trailing garbage after the end of the gzip stream");
      if (inflateReset(&z) != Z_OK) refuse_idx(op, name, "zlib could not restart at the next gzip member");
      continue;
    }
    if (status == Z_BUF_ERROR && z.avail_in == 0 && in_at == compressed.size())
      refuse_idx(op, name,
                 "the gzip stream ends early (the compressed file is truncated) after " + std::to_string(out_at) +
                     " decompressed bytes");
    if (status != Z_OK && status != Z_BUF_ERROR)
      refuse_idx(op, name,
                 std::string("corrupt gzip stream: ") + (z.msg ? std::string(z.msg) : "zlib error " + std::to_string(status)) +
                     " after " + std::to_string(out_at) + " decompressed bytes");
  }
  out.resize(out_at);
  return out;
#else
  refuse_idx(op, name,
             "it is gzip-compressed, but zlib was not available when this program was built (MPX_HAS_ZLIB "
             "is 0): install zlib (Debian: zlib1g-dev) and rebuild, or decompress the file with gunzip");
#endif
}

//! The deflated (gzip) form of bytes.
inline std::vector<std::uint8_t> gzip_bytes([[maybe_unused]] std::span<std::uint8_t const> bytes,
                                            std::string_view name, std::string_view op) {
#if MPX_HAS_ZLIB
  z_stream z{};
  if (deflateInit2(&z, Z_BEST_COMPRESSION, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY) != Z_OK)
    refuse_idx(op, name, "zlib could not start compressing");
  struct end_deflate {
    z_stream* z;
    ~end_deflate() { deflateEnd(z); }
  } guard{&z};
  std::vector<std::uint8_t> out;
  std::size_t in_at = 0;
  std::size_t out_at = 0;
  int status = Z_OK;
  while (status != Z_STREAM_END) {
    if (z.avail_in == 0 && in_at < bytes.size()) {
      auto const n = static_cast<uInt>(std::min<std::size_t>(bytes.size() - in_at, UINT_MAX));
      z.next_in = const_cast<Bytef*>(bytes.data() + in_at);
      z.avail_in = n;
      in_at += n;
    }
    if (out.size() == out_at) out.resize(out_at + (1 << 16));
    auto const room = static_cast<uInt>(std::min<std::size_t>(out.size() - out_at, UINT_MAX));
    z.next_out = out.data() + out_at;
    z.avail_out = room;
    status = deflate(&z, in_at == bytes.size() && z.avail_in == 0 ? Z_FINISH : Z_NO_FLUSH);
    out_at += room - z.avail_out;
    if (status != Z_OK && status != Z_STREAM_END && status != Z_BUF_ERROR)
      refuse_idx(op, name, "zlib failed while compressing (error " + std::to_string(status) + ")");
  }
  out.resize(out_at);
  return out;
#else
  refuse_idx(op, name,
             "gzip output needs zlib, which was not available when this program was built (MPX_HAS_ZLIB is "
             "0): install zlib (Debian: zlib1g-dev) and rebuild, or write idx_compression::none");
#endif
}

}  // namespace detail

namespace detail {

//! The largest IDX header: the magic and eight dimensions.
inline constexpr std::size_t idx_max_header = 4 + 4 * 8;

//! What an IDX header says: its own size, the dimensions and the data bytes they need.
struct idx_header {
  std::size_t bytes = 0;
  std::vector<std::int64_t> dims;
  std::size_t data_bytes = 0;

  [[nodiscard]] std::string dims_text() const {
    std::string out = "[";
    for (std::size_t i = 0; i < dims.size(); ++i) out += (i ? ", " : "") + std::to_string(dims[i]);
    return out + "]";
  }
};

//! Reads the header at the start of `bytes` (the data may follow, or not yet); refuses a
//! wrong magic, element type or rank, a short header, or dimensions whose product does
//! not fit 64 bits. The product is exact: a zero dimension anywhere makes it zero.
inline idx_header parse_idx_header(std::span<std::uint8_t const> bytes, std::string_view name) {
  constexpr std::string_view op = "read_idx";
  if (bytes.size() < 4)
    refuse_idx(op, name,
               "truncated: " + std::to_string(bytes.size()) +
                   " bytes, too short for the 4-byte IDX magic (0x00 0x00 <type> <dimensions>)");
  if (bytes[0] != 0 || bytes[1] != 0)
    refuse_idx(op, name,
               "not an IDX file: wrong magic: it starts with " + hex_bytes(bytes.first(4)) +
                   ", not 0x00 0x00 <type> <dimensions>");
  std::uint8_t const type = bytes[2];
  std::size_t const rank = bytes[3];
  if (type != idx_unsigned_byte)
    refuse_idx(op, name,
               "element type " + idx_type_name(type) + " is not supported: mpx reads IDX files of unsigned bytes (0x08)");
  if (rank == 0 || rank > 8)
    refuse_idx(op, name, "bad number of dimensions " + std::to_string(rank) + " in the magic (mpx reads 1 to 8)");
  idx_header out{4 + 4 * rank, {}, 0};
  if (bytes.size() < out.bytes)
    refuse_idx(op, name,
               "truncated: the header of " + std::to_string(rank) + " dimensions needs " + std::to_string(out.bytes) +
                   " bytes, found " + std::to_string(bytes.size()));
  bool zero = false;
  for (std::size_t i = 0; i < rank; ++i) {
    auto const* d = bytes.data() + 4 + 4 * i;
    std::uint32_t const extent = (std::uint32_t{d[0]} << 24) | (std::uint32_t{d[1]} << 16) |
                                 (std::uint32_t{d[2]} << 8) | std::uint32_t{d[3]};
    out.dims.push_back(extent);
    zero = zero || extent == 0;
  }
  if (zero) return out;  // no data, however large the other dimensions
  std::size_t product = 1;
  for (std::int64_t extent : out.dims) {
    auto const e = static_cast<std::size_t>(extent);
    if (product > (SIZE_MAX - out.bytes) / e)  // header + data must fit a size_t too
      refuse_idx(op, name,
                 "dimensions " + out.dims_text() + " describe more than 2^64 bytes of data; no file holds that");
    product *= e;
  }
  out.data_bytes = product;
  return out;
}

}  // namespace detail

//! Parses the bytes of an (uncompressed) IDX file; `name` is what errors call it.
//! Only unsigned-byte elements (type 0x08) are read; data_error for anything else,
//! and for a wrong magic, a bad number of dimensions, fewer bytes than the dimensions
//! ask for (expected and found are named) or bytes after the data.
inline idx_array parse_idx(std::span<std::uint8_t const> bytes, std::string_view name = "<memory>") {
  constexpr std::string_view op = "read_idx";
  detail::idx_header const header = detail::parse_idx_header(bytes, name);
  std::size_t const found = bytes.size() - header.bytes;
  std::size_t const expected = header.data_bytes;
  if (found < expected)
    detail::refuse_idx(op, name,
                       "truncated: dimensions " + header.dims_text() + " need " + std::to_string(expected) +
                           " data bytes after the header, found " + std::to_string(found));
  if (found > expected)
    detail::refuse_idx(op, name,
                       "trailing garbage: " + std::to_string(found - expected) + " bytes after the " +
                           std::to_string(expected) + " data bytes that dimensions " + header.dims_text() +
                           " describe");
  idx_array out;
  out.dims = header.dims;
  out.data.assign(bytes.begin() + static_cast<std::ptrdiff_t>(header.bytes), bytes.end());
  return out;
}

//! Decodes the bytes of an IDX file, plain or gzip-compressed (recognised by its first
//! two bytes, 1f 8b); `name` is what errors call it. A gzip stream is inflated no
//! further than its header says the file holds, plus one byte to see that it holds
//! more: a stream that inflates past it is refused before it can fill memory.
inline idx_array decode_idx(std::span<std::uint8_t const> bytes, std::string_view name = "<memory>") {
  constexpr std::string_view op = "read_idx";
  if (!detail::is_gzip(bytes)) return parse_idx(bytes, name);
  std::vector<std::uint8_t> const start = detail::gunzip(bytes, name, op, detail::idx_max_header);
  detail::idx_header header;
  try {
    header = detail::parse_idx_header(start, name);
  } catch (data_error const&) {
    // A corrupt stream can inflate to a nonsense header before zlib sees the damage:
    // name the damage when there is some. Bounded by deflate's best ratio (1032:1),
    // the most the file could hold.
    static_cast<void>(detail::gunzip(bytes, name, op, bytes.size() * 1032));
    throw;
  }
  std::size_t const total = header.bytes + header.data_bytes;
  std::vector<std::uint8_t> const inflated = detail::gunzip(bytes, name, op, total + 1);
  if (inflated.size() > total)
    detail::refuse_idx(op, name,
                       "its gzip stream inflates to more than the " + std::to_string(total) +
                           " bytes its header describes (dimensions " + header.dims_text() +
                           "): trailing garbage, or a decompression bomb; the rest was not inflated");
  return parse_idx(inflated, name);
}

//! Reads an IDX file of unsigned bytes, plain or gzip-compressed (recognised by its
//! first two bytes, 1f 8b). Throws mpx::data_error naming the path and the fault: the
//! file is missing or unreadable, truncated, has trailing bytes, a wrong magic, an
//! unsupported element type or a corrupt gzip stream, or is compressed and this build
//! has no zlib.
inline idx_array read_idx(std::filesystem::path const& path) {
  return decode_idx(detail::read_file_bytes(path, "read_idx"), path.string());
}

//! The bytes of an IDX file holding `array` (unsigned bytes): what write_idx writes,
//! before any compression. invalid_argument when the dimensions and data disagree.
inline std::vector<std::uint8_t> idx_bytes(idx_array const& array) {
  if (array.dims.empty() || array.dims.size() > 8)
    detail::fail<invalid_argument>("write_idx", "an IDX array has 1 to 8 dimensions, not " +
                                                    std::to_string(array.dims.size()));
  for (std::int64_t d : array.dims)
    if (d < 0 || d > std::int64_t{UINT32_MAX})
      detail::fail<invalid_argument>("write_idx", "dimension " + std::to_string(d) + " does not fit IDX's 32 bits");
  if (array.size() != array.data.size())
    detail::fail<invalid_argument>("write_idx", "the dimensions describe " + std::to_string(array.size()) +
                                                    " elements but the data holds " +
                                                    std::to_string(array.data.size()));
  std::vector<std::uint8_t> out{0, 0, detail::idx_unsigned_byte, static_cast<std::uint8_t>(array.dims.size())};
  for (std::int64_t d : array.dims)
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<std::uint8_t>(d >> shift));
  out.insert(out.end(), array.data.begin(), array.data.end());
  return out;
}

//! Writes `array` as an IDX file of unsigned bytes, gzip-compressed if asked (which
//! needs zlib). data_error when the file cannot be written.
inline void write_idx(std::filesystem::path const& path, idx_array const& array,
                      idx_compression compression = idx_compression::none) {
  constexpr std::string_view op = "write_idx";
  std::string const name = path.string();
  std::vector<std::uint8_t> bytes = idx_bytes(array);
  if (compression == idx_compression::gzip) bytes = detail::gzip_bytes(bytes, name, op);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) detail::refuse_idx(op, name, std::string("cannot create it: ") + std::strerror(errno));
  bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  int const saved_errno = errno;
  ok = std::fclose(f) == 0 && ok;
  if (!ok) detail::refuse_idx(op, name, std::string("writing it failed: ") + std::strerror(saved_errno));
}

}  // namespace mpx
