// Multi-tensor launches: one kernel over a list of tensors of any count and sizes.
// The list is cut into chunks of multi_tensor_chunk elements, one CUDA block at a time. The
// table of pointers and chunk offsets travels in the kernel's parameters (up to 32 KB
// since CUDA 12.1: about 1,600 tensors per launch for one pointer each), and a list too
// long for one launch is split into tables, each tensor in exactly one, so no element
// is read twice. The host executor walks the same chunks in the same order.
#pragma once

#include <mpx/core/config.hpp>
#include <mpx/core/error.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace mpx::detail {

//! Elements per block: a multiple of every vector width, so each chunk of a tensor
//! starts as aligned as the tensor does.
inline constexpr std::size_t multi_tensor_chunk = 16384;

// CUDA 12.1+ accepts 32,764 bytes of kernel parameters on Volta and newer; the table
// takes what the kernel's other arguments (a few pointers and scalars) leave.
inline constexpr std::size_t kernel_parameter_limit = 32764;
inline constexpr std::size_t other_arguments_budget = 512;

//! One launch's worth of a tensor list: `Lists` pointers per tensor (a gradient; or a
//! parameter, its gradient, master copy and moments), sizes, and which blocks serve
//! which tensor. Passed by value as a kernel parameter.
template <int Lists>
struct tensor_table {
  static constexpr std::size_t bytes_per_tensor = Lists * sizeof(void*) + sizeof(std::size_t) + sizeof(std::uint32_t);
  static constexpr std::uint32_t capacity =
      static_cast<std::uint32_t>((kernel_parameter_limit - other_arguments_budget - 16) / bytes_per_tensor) - 1;

  void* data[Lists][capacity];
  std::size_t size[capacity];
  //! Block b serves tensor t when first_chunk[t] <= b < first_chunk[t + 1];
  //! first_chunk[count] is the number of blocks.
  std::uint32_t first_chunk[capacity + 1];
  //! Index of this table's first chunk in the whole list (where per-chunk results go).
  std::uint32_t first_partial;
  std::uint32_t count;

  [[nodiscard]] MPX_HD std::uint32_t blocks() const noexcept { return first_chunk[count]; }
};

//! The elements block `block` of a table serves: tensor `tensor`, [begin, begin + count).
struct chunk_location {
  std::uint32_t tensor;
  std::size_t begin;
  std::size_t count;
};

template <int Lists>
MPX_HD inline chunk_location locate_chunk(tensor_table<Lists> const& table, std::uint32_t block) noexcept {
  // The last tensor whose first chunk is at or before `block` (empty tensors own no chunk
  // and share their start with the next one, so they are never chosen).
  std::uint32_t lo = 0, hi = table.count;
  while (hi - lo > 1) {
    std::uint32_t const mid = lo + (hi - lo) / 2;
    if (table.first_chunk[mid] <= block) lo = mid;
    else hi = mid;
  }
  std::size_t const begin = static_cast<std::size_t>(block - table.first_chunk[lo]) * multi_tensor_chunk;
  std::size_t const left = table.size[lo] - begin;
  return {lo, begin, left < multi_tensor_chunk ? left : multi_tensor_chunk};
}

//! Launch tables for a list, and for each tensor the range of chunk results it owns.
template <int Lists>
struct multi_tensor_plan {
  std::vector<tensor_table<Lists>> tables;
  std::vector<std::uint32_t> chunk_begin;  //!< tensor t's chunk results: [chunk_begin[t], chunk_begin[t + 1])
  [[nodiscard]] std::uint32_t chunks() const noexcept { return chunk_begin.empty() ? 0 : chunk_begin.back(); }
};

//! Plans the launches for tensors[i] = its Lists pointers, of sizes[i] elements. Chunk
//! results are numbered from `first_partial` on, in list order.
template <int Lists>
multi_tensor_plan<Lists> plan_multi_tensor(std::span<std::array<void*, Lists> const> tensors,
                                           std::span<std::size_t const> sizes, std::uint32_t first_partial = 0) {
  using table_t = tensor_table<Lists>;
  multi_tensor_plan<Lists> plan;
  plan.chunk_begin.reserve(tensors.size() + 1);
  std::uint64_t next_partial = first_partial;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    std::uint64_t const chunks = (sizes[i] + multi_tensor_chunk - 1) / multi_tensor_chunk;
    // Block indices are 32-bit and a grid holds at most 2^31 - 1 blocks.
    if (next_partial + chunks >= (std::uint64_t{1} << 31))
      fail<invalid_argument>("multi-tensor launch", "the tensor list holds more than 2^31 chunks of " +
                                                        std::to_string(multi_tensor_chunk) + " elements");
    bool const full = !plan.tables.empty() && plan.tables.back().count == table_t::capacity;
    if (plan.tables.empty() || full) {
      plan.tables.emplace_back();
      std::memset(&plan.tables.back(), 0, sizeof(table_t));
      plan.tables.back().first_partial = static_cast<std::uint32_t>(next_partial);
    }
    table_t& table = plan.tables.back();
    std::uint32_t const slot = table.count++;
    for (int l = 0; l < Lists; ++l) table.data[l][slot] = tensors[i][static_cast<std::size_t>(l)];
    table.size[slot] = sizes[i];
    table.first_chunk[slot + 1] = table.first_chunk[slot] + static_cast<std::uint32_t>(chunks);
    plan.chunk_begin.push_back(static_cast<std::uint32_t>(next_partial));
    next_partial += chunks;
  }
  plan.chunk_begin.push_back(static_cast<std::uint32_t>(next_partial));
  return plan;
}

//! True when every pointer allows Width-element vector accesses.
template <int Width, class... Ts>
MPX_HD inline bool vector_aligned(Ts const*... ps) noexcept {
  return ((reinterpret_cast<std::uintptr_t>(ps) % (Width * sizeof(Ts)) == 0) && ...);
}

//! Scalar elements before `p` reaches a Width-element vector boundary (0 to Width - 1).
template <int Width, class T>
MPX_HD inline std::size_t elements_to_alignment(T const* p) noexcept {
  std::size_t const misaligned = (reinterpret_cast<std::uintptr_t>(p) % (Width * sizeof(T))) / sizeof(T);
  return misaligned ? Width - misaligned : 0;
}

//! A chunk of `count` elements as `head` single elements up to a vector boundary, then
//! `vectors` whole vectors of Width elements, then single elements from tail_from().
template <int Width>
struct chunk_split {
  std::size_t head;
  std::size_t vectors;

  MPX_HD chunk_split(std::size_t count, std::size_t to_boundary) noexcept
      : head(to_boundary < count ? to_boundary : count), vectors((count - head) / Width) {}
  [[nodiscard]] MPX_HD std::size_t tail_from() const noexcept { return head + vectors * Width; }
};

//! Calls body(std::integral_constant<int, W>{}, i) over a chunk of `count` elements,
//! shared by the lanes (exec/lanes.hpp: a block's threads on the GPU, emulated on the
//! host). When `aligned` (every pointer reaches a vector boundary after the same `head`
//! elements): W = 1 for the head, W = Width (16-byte accesses) for the body, W = 1 for
//! the tail. Otherwise W = 1 throughout.
template <int Width, class Lanes, class Body>
MPX_HD inline void for_each_in_chunk(Lanes const& lanes, std::size_t count, std::size_t head, bool aligned,
                                     Body&& body) {
  std::size_t scalar_from = 0;
  if (aligned) {
    chunk_split<Width> const split(count, head);
    lanes.for_each(split.head, [&](std::size_t i) { body(std::integral_constant<int, 1>{}, i); });
    lanes.for_each(split.vectors,
                   [&](std::size_t v) { body(std::integral_constant<int, Width>{}, split.head + v * Width); });
    scalar_from = split.tail_from();
  }
  lanes.for_each(count - scalar_from, [&](std::size_t i) { body(std::integral_constant<int, 1>{}, scalar_from + i); });
}

//! The reduction of a chunk of `count` elements by its lanes (exec/lanes.hpp), over
//! columns: `head` single elements up to a vector boundary, then whole vectors of Width
//! (16-byte accesses), then the single elements left. Lane l folds columns l, l + L, ...
//! in order, then the lanes are combined, on the GPU and in the host's emulation alike:
//! the same partial sums, so the same bits. body(std::integral_constant<int, W>{}, i)
//! returns what the W elements from i contribute.
template <int Width, class Lanes, class Op, class Body>
MPX_HD inline typename Op::value_type reduce_in_chunk(Lanes const& lanes, std::size_t count, std::size_t head, Op op,
                                                      Body&& body) {
  chunk_split<Width> const split(count, head);
  std::size_t const columns = count - split.vectors * (Width - 1);
  return lanes.reduce(columns, op, [&](std::size_t c) -> typename Op::value_type {
    if (c >= split.head && c - split.head < split.vectors)
      return body(std::integral_constant<int, Width>{}, split.head + (c - split.head) * Width);
    return body(std::integral_constant<int, 1>{}, c < split.head ? c : c + split.vectors * (Width - 1));
  });
}

}  // namespace mpx::detail
