// Philox4x32-10 (Salmon et al., SC'11, as in Random123, cuRAND and PyTorch): a
// counter-based generator that is an MPX_HD function, so the host and the GPU draw the
// same words bit for bit from (counter, key). Dropout's masks and the optimizers'
// stochastic rounding draw from it.
#pragma once

#include <mpx/core/config.hpp>

#include <cstdint>

namespace mpx {

//! Philox's 128-bit counter, four 32-bit words (word 0 least significant).
struct philox_counter {
  std::uint32_t v[4];
  //! Word i (0 to 3), chosen by selects: v[i] with i known only at run time would put
  //! the four words in local memory on the GPU (a stack frame).
  [[nodiscard]] MPX_HD constexpr std::uint32_t word(std::uint64_t i) const noexcept {
    return i == 0 ? v[0] : i == 1 ? v[1] : i == 2 ? v[2] : v[3];
  }
};
//! Philox's 64-bit key, two 32-bit words.
struct philox_key {
  std::uint32_t v[2];
};

//! Philox4x32 with 10 rounds: four random 32-bit words for a (counter, key). Matches
//! Random123's philox4x32_10 known-answer vectors on host and device.
MPX_HD constexpr philox_counter philox4x32_10(philox_counter ctr, philox_key key) noexcept {
  constexpr std::uint32_t m0 = 0xD2511F53u, m1 = 0xCD9E8D57u;
  constexpr std::uint32_t w0 = 0x9E3779B9u, w1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key.v[0] += w0;
      key.v[1] += w1;
    }
    std::uint64_t const p0 = static_cast<std::uint64_t>(m0) * ctr.v[0];
    std::uint64_t const p1 = static_cast<std::uint64_t>(m1) * ctr.v[2];
    auto const hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    auto const hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    ctr = philox_counter{{hi1 ^ ctr.v[1] ^ key.v[0], lo1, hi0 ^ ctr.v[3] ^ key.v[1], lo0}};
  }
  return ctr;
}

}  // namespace mpx
