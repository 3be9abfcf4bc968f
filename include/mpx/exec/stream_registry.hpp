// One resource per CUDA stream (cuBLASLt's workspace), found again by the stream's
// handle while the stream captures a graph, when its driver id cannot be asked for.
// Plain C++, so the bookkeeping is tested on the host; the CUDA calls stay with the user.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace mpx::detail {

//! What the host knows of a stream during a capture: its device, its handle, and, for
//! the handles that name another stream in each thread (the null handle under
//! --default-stream per-thread, cudaStreamPerThread), the thread.
struct stream_handle_key {
  int device = 0;
  std::uintptr_t handle = 0;
  std::thread::id thread{};
  friend bool operator<(stream_handle_key const& x, stream_handle_key const& y) {
    return std::tie(x.device, x.handle, x.thread) < std::tie(y.device, y.handle, y.thread);
  }
};

//! The key of `stream` (a cudaStream_t, as an address) on `device` in this thread.
inline stream_handle_key stream_handle_key_of(int device, void const* stream) noexcept {
  // The null handle (under --default-stream per-thread) and cudaStreamPerThread
  // (((cudaStream_t)0x2) in CUDA's driver_types.h) name a different stream in each thread.
  bool const per_thread = stream == nullptr || reinterpret_cast<std::uintptr_t>(stream) == 0x2;
  return {device, reinterpret_cast<std::uintptr_t>(stream), per_thread ? std::this_thread::get_id() : std::thread::id{}};
}

//! Resources keyed by (device, stream id): a driver stream id (cudaStreamGetId) is never
//! given to another stream, so a resource is never shared by two streams. Each handle
//! key remembers the id it last named when used eagerly, for captures.
//!
//! A handle is unique only among live streams: a destroyed stream's handle may come back
//! for a new stream. When a key, used eagerly, names a new id, the stream it named
//! before is therefore gone; its resource passes to the new stream (inherited: the dead
//! stream's last work may still use it, so wait for the device first) unless another key
//! still names the old id, and is retired (to be freed) if the new stream has one already.
//! Without the registry being told (forget), a destroyed stream's resource lives on until
//! its handle comes back or clear().
//!
//! Not thread-safe: the owner locks.
template <class Resource>
class stream_registry {
 public:
  //! What use() found for a stream.
  struct found {
    Resource* resource = nullptr;  //!< the stream's resource; null: make one and put() it
    bool inherited = false;        //!< taken over from a destroyed stream: wait before use
    std::vector<Resource> retired; //!< resources no stream can reach any more: free them
  };

  //! The stream `id`, named by `key`, used outside a capture.
  found use(stream_handle_key const& key, std::uint64_t id) {
    found out;
    auto const named = names_.find(key);
    if (named != names_.end() && named->second != id) {
      std::uint64_t const old = named->second;
      names_.erase(named);
      if (!named_by_any(old)) {
        auto const dead = resources_.find({key.device, old});
        if (dead != resources_.end()) {
          if (resources_.contains({key.device, id})) {
            out.retired.push_back(std::move(dead->second));
          } else {
            resources_.emplace(std::pair{key.device, id}, std::move(dead->second));
            out.inherited = true;
          }
          resources_.erase(dead);
        }
      }
    }
    names_[key] = id;
    auto const it = resources_.find({key.device, id});
    if (it != resources_.end()) out.resource = &it->second;
    return out;
  }

  //! The resource of the stream `key` named when last used eagerly, or null (during a
  //! capture, where the stream's id cannot be asked for).
  Resource* captured(stream_handle_key const& key) {
    auto const named = names_.find(key);
    if (named == names_.end()) return nullptr;
    auto const it = resources_.find({key.device, named->second});
    return it == resources_.end() ? nullptr : &it->second;
  }

  //! Gives stream `id` on `device` its resource (after use() found none).
  Resource& put(int device, std::uint64_t id, Resource resource) {
    return resources_.insert_or_assign(std::pair{device, id}, std::move(resource)).first->second;
  }
  //! Undoes put() (its resource could not be made).
  void drop(int device, std::uint64_t id) { resources_.erase({device, id}); }

  //! Removes the stream `id` (on any device) and the keys that name it; returns its
  //! resources, to be freed once the stream's work is done.
  std::vector<std::pair<int, Resource>> forget(std::uint64_t id) {
    std::vector<std::pair<int, Resource>> out;
    for (auto it = resources_.begin(); it != resources_.end();) {
      if (it->first.second != id) {
        ++it;
        continue;
      }
      out.emplace_back(it->first.first, std::move(it->second));
      it = resources_.erase(it);
    }
    std::erase_if(names_, [&](auto const& entry) { return entry.second == id; });
    return out;
  }

  //! Removes everything; returns every resource with its device.
  std::vector<std::pair<int, Resource>> clear() {
    std::vector<std::pair<int, Resource>> out;
    for (auto& [key, resource] : resources_) out.emplace_back(key.first, std::move(resource));
    resources_.clear();
    names_.clear();
    return out;
  }

  //! Calls f(resource) for each resource held.
  template <class F>
  void for_each(F&& f) const {
    for (auto const& [key, resource] : resources_) f(resource);
  }
  [[nodiscard]] std::size_t size() const noexcept { return resources_.size(); }

 private:
  bool named_by_any(std::uint64_t id) const {
    for (auto const& [key, named] : names_)
      if (named == id) return true;
    return false;
  }

  std::map<std::pair<int, std::uint64_t>, Resource> resources_;  // (device, stream id)
  std::map<stream_handle_key, std::uint64_t> names_;             // handle key -> the id it last named
};

}  // namespace mpx::detail
