// Where a tensor's memory lives (host_space, device_space) and the move-only buffers
// that own it. Device memory is stream-ordered (cudaMallocAsync from the device's
// pool), so allocating a tensor in a training step does not synchronise the GPU.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/exec/per_device.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>

namespace mpx {

//! Ordinary host memory (64-byte aligned, so vectorised host loops and device copies
//! start on a cache line).
struct host_space {
  static constexpr std::string_view name = "host_space";
};

//! GPU global memory, allocated on a stream.
struct device_space {
  static constexpr std::string_view name = "device_space";
};

template <class S>
concept memory_space = std::is_same_v<S, host_space> || std::is_same_v<S, device_space>;

namespace detail {

inline constexpr std::size_t host_alignment = 64;

struct host_release {
  void operator()(void* p) const noexcept { ::operator delete(p, std::align_val_t{host_alignment}); }
};

template <class T, class Space>
class buffer;

//! "17179869184 bytes (16 GiB)", for messages about memory.
inline std::string byte_count(std::size_t bytes) {
  char readable[32];
  double const gib = static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0);
  if (gib >= 1) std::snprintf(readable, sizeof readable, "%.3g GiB", gib);
  else std::snprintf(readable, sizeof readable, "%.3g MiB", gib * 1024.0);
  return std::to_string(bytes) + " bytes (" + readable + ")";
}

//! Throws mpx::allocation_error for n elements of `element_bytes` in `space` memory.
[[noreturn]] inline void fail_allocation(std::string_view space, std::size_t n, std::size_t element_bytes,
                                         std::string_view why) {
  std::string const amount = n > SIZE_MAX / element_bytes
                                 ? std::to_string(n) + " elements of " + std::to_string(element_bytes) + " bytes in " +
                                       std::string(space) + " memory (more bytes than an address can count)"
                                 : byte_count(n * element_bytes) + " of " + std::string(space) + " memory for " +
                                       std::to_string(n) + " elements";
  fail<allocation_error>("allocate", "cannot allocate " + amount + ": " + std::string(why) + "; nothing was allocated");
}

//! Owns `size` elements of T in host memory. Move-only; a moved-from buffer is empty.
//! Memory the host cannot give is an mpx::allocation_error, not a std::bad_alloc.
template <class T>
class buffer<T, host_space> {
 public:
  buffer() = default;
  explicit buffer(std::size_t size) {
    if (!size) return;
    if (size > SIZE_MAX / sizeof(T)) fail_allocation("host", size, sizeof(T), "the size does not fit in size_t");
    try {
      data_.reset(static_cast<T*>(::operator new(size * sizeof(T), std::align_val_t{host_alignment})));
    } catch (std::bad_alloc const&) {
      fail_allocation("host", size, sizeof(T), "the system has no more to give (std::bad_alloc)");
    }
  }
  [[nodiscard]] T* data() const noexcept { return data_.get(); }

 private:
  std::unique_ptr<T, host_release> data_;
};

#if MPX_HAS_CUDA_RUNTIME
//! Keeps the memory that stream-ordered frees return to `device`'s default pool in the
//! pool, once per device (thread-safe). The pool's release threshold is 0 by default:
//! every stream, event or device synchronisation (the batch loader's, a step's read of
//! its record) would hand the freed temporaries back to the driver and the next step
//! would map them again. A threshold a program set itself (non-zero) is left alone, and
//! so is a pool installed with cudaDeviceSetMemPool; cudaMemPoolTrimTo gives the memory
//! back on request.
inline void keep_pool_memory(int device) {
  static per_device<bool>& kept = *new per_device<bool>;  // never destroyed: buffers may be made at exit
  kept.get(device, [device] {
    cudaMemPool_t pool = nullptr;
    MPX_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    std::uint64_t threshold = 0;
    MPX_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    if (threshold == 0) {
      threshold = UINT64_MAX;
      MPX_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    }
    return true;
  });
}

//! Frees device memory in the order of the stream it was allocated on.
struct device_release {
  cudaStream_t stream = nullptr;
  void operator()(void* p) const noexcept {
    // A destructor cannot throw; a failed free means the context is already broken
    // (an earlier kernel faulted), and the next checked call reports that.
    report_if_failed(cudaFreeAsync(p, stream), "cudaFreeAsync (a device buffer)");
  }
};

//! Owns `size` elements of T in device memory, allocated and freed in the order of
//! `stream`. Move-only; a moved-from buffer is empty.
template <class T>
class buffer<T, device_space> {
 public:
  buffer() = default;
  buffer(std::size_t size, cudaStream_t stream) : data_(nullptr, device_release{stream}) {
    if (size) {
      int device = 0;
      MPX_CUDA_CHECK(cudaGetDevice(&device));
      keep_pool_memory(device);
      if (size > SIZE_MAX / sizeof(T)) fail_allocation("device", size, sizeof(T), "the size does not fit in size_t");
      void* p = nullptr;
      try {
        MPX_CUDA_CHECK(cudaMallocAsync(&p, size * sizeof(T), stream));  // (clears the error it reports)
      } catch (cuda_error const& e) {
        if (e.code() != cudaErrorMemoryAllocation) throw;
        fail_allocation("device", size, sizeof(T),
                        "the GPU has no more to give (cudaMallocAsync returned cudaErrorMemoryAllocation)");
      }
      data_.reset(static_cast<T*>(p));
    }
  }
  [[nodiscard]] T* data() const noexcept { return data_.get(); }
  //! Hands the memory to the caller, who frees it with device_release{stream}.
  [[nodiscard]] T* release() noexcept { return data_.release(); }

 private:
  std::unique_ptr<T, device_release> data_;
};

//! Frees page-locked host memory (a pinned_buffer's, or one it released).
struct pinned_release {
  void operator()(void* p) const noexcept { report_if_failed(cudaFreeHost(p), "cudaFreeHost (pinned memory)"); }
};

//! Owns `size` elements of T in page-locked host memory, uninitialised: a copy between
//! it and the device is truly asynchronous. Mapped memory (pinned_mapping::mapped) is
//! also addressable by the device, through device_pointer(). Move-only.
enum class pinned_mapping { host_only, mapped };
template <class T>
class pinned_buffer {
 public:
  pinned_buffer() = default;
  explicit pinned_buffer(std::size_t size, pinned_mapping mapping = pinned_mapping::host_only) {
    if (size == 0) return;
    if (size > SIZE_MAX / sizeof(T)) fail_allocation("pinned host", size, sizeof(T), "the size does not fit in size_t");
    void* p = nullptr;
    MPX_CUDA_CHECK(cudaHostAlloc(&p, size * sizeof(T),
                                 mapping == pinned_mapping::mapped ? cudaHostAllocMapped : cudaHostAllocDefault));
    data_.reset(static_cast<T*>(p));
  }
  [[nodiscard]] T* data() const noexcept { return data_.get(); }
  //! Where the device reads and writes mapped memory.
  [[nodiscard]] T* device_pointer() const {
    void* d = nullptr;
    MPX_CUDA_CHECK(cudaHostGetDevicePointer(&d, data_.get(), 0));
    return static_cast<T*>(d);
  }
  //! Hands the memory to the caller, who frees it with pinned_release.
  [[nodiscard]] T* release() noexcept { return data_.release(); }

 private:
  std::unique_ptr<T, pinned_release> data_;
};
#endif

}  // namespace detail
}  // namespace mpx
