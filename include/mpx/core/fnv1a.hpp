// 64-bit FNV-1a over bytes: the checksum of checkpoint files and the fingerprint ranks
// compare before data-parallel training. Defined by its integer arithmetic alone, so
// every compiler and platform agrees on it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace mpx::detail {

//! 64-bit FNV-1a of `bytes`, continuing from `h` (the offset basis by default): a
//! checksum against truncation and bit rot, not an adversary.
inline std::uint64_t fnv1a(std::span<std::byte const> bytes, std::uint64_t h = 0xcbf29ce484222325ull) noexcept {
  for (std::byte b : bytes) {
    h ^= static_cast<std::uint64_t>(b);
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace mpx::detail
