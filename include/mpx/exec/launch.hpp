// Launch helpers shared by mpx's kernels: aligned vectors for 16-byte loads and a grid
// sized to the device. CUDA-only by nature (the aligned_vector type is usable anywhere).
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/error.hpp>
#include <mpx/exec/per_device.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace mpx::detail {

//! N consecutive elements of T loaded or stored as one instruction (N * sizeof(T) <= 16).
template <class T, int N>
struct alignas(sizeof(T) * N) aligned_vector {
  T v[N];
};

//! N consecutive elements at p (aligned for an aligned_vector<T, N>), read and written in
//! place: on the GPU through one 16-byte load into registers and, by store(), one 16-byte
//! store; on the host straight through p. (On the host a vector assembled element by
//! element on the stack and then stored whole waits on store forwarding: it halved the
//! host's unscale-and-check.)
template <class T, int N>
struct vector_access {
  T* p;
  aligned_vector<T, N> v;  // the GPU's registers; not used on the host

  MPX_HD explicit vector_access(T* at) noexcept : p(at) {
#if MPX_DEVICE_PASS
    v = *reinterpret_cast<aligned_vector<T, N> const*>(at);
#endif
  }
  MPX_HD T& operator[](int k) noexcept {
#if MPX_DEVICE_PASS
    return v.v[k];
#else
    return p[k];
#endif
  }
  //! Writes back what operator[] changed (on the host it was written already).
  MPX_HD void store() const noexcept {
#if MPX_DEVICE_PASS
    *reinterpret_cast<aligned_vector<T, N>*>(p) = v;
#endif
  }
};

//! Elements per 16-byte access for a kernel that reads or writes all of Ts: the widest
//! type sets the count, so no access exceeds 16 bytes.
template <class... Ts>
inline constexpr int vector_width = static_cast<int>(16 / std::max({sizeof(Ts)...}));

inline constexpr int block_size = 256;

//! Whether a grid-stride loop over `total` elements, on `grid` blocks of block_size,
//! whose indices reach at most `largest`, may count in 32 bits (cheaper divisions). The
//! last `e += stride` must not pass 2^32: it would wrap below `total` and loop again.
constexpr bool fits_32_bit_grid_stride(std::size_t total, std::size_t largest, unsigned grid) noexcept {
  std::size_t const threads = static_cast<std::size_t>(grid) * block_size;
  return total + threads <= 0xFFFF'FFFFu && largest <= 0xFFFF'FFFFu;
}

#if MPX_HAS_CUDA_RUNTIME
//! Multiprocessors of the current device, asked once per device.
inline int sm_count() {
  static per_device<int>& counts = *new per_device<int>;  // never destroyed: kernels may run at exit
  int device = 0;
  MPX_CUDA_CHECK(cudaGetDevice(&device));
  return counts.get(device, [device] {
    int count = 0;
    MPX_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    return count;
  });
}

//! Blocks for a grid-stride loop over `items` work items: enough to fill every SM
//! `blocks_per_sm` times, no more than the work needs, at least one.
inline unsigned grid_for(std::size_t items, int blocks_per_sm = 8) {
  std::size_t const needed = (items + block_size - 1) / block_size;
  std::size_t const cap = static_cast<std::size_t>(sm_count()) * static_cast<std::size_t>(blocks_per_sm);
  return static_cast<unsigned>(std::max<std::size_t>(1, std::min(needed, cap)));
}
#endif

}  // namespace mpx::detail
