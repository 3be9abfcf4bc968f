// mpx::share_bytes_through_file: hands a few bytes from rank 0 to every other rank through
// a file on a filesystem they all see, for launchers without MPI (the NCCL unique id:
// mpx::nccl_unique_id_through_file). Plain C++: no GPU, no MPI.
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/dist/communicator.hpp>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <system_error>
#include <thread>

namespace mpx {

//! Rank 0 writes `bytes` to `path`, atomically (a temporary file beside it, renamed into
//! place); every other rank waits up to `timeout` for the file and reads it into `bytes`,
//! which must be exactly the file's size. Give each job a path of its own (the job's id
//! in the name): a file an earlier job left with the same size is read as this job's.
//! Rank 0's failure to write is an mpx::error; a rank that waited in vain, or found a
//! file of another size, throws mpx::collective_error naming rank 0 as missing.
//! std::chrono::milliseconds::max() waits for ever.
inline void share_bytes_through_file(std::filesystem::path const& path, int rank, std::span<std::byte> bytes,
                                     std::chrono::milliseconds timeout = std::chrono::minutes(5)) {
  char const* const op = "share_bytes_through_file";
  if (rank < 0) detail::fail<invalid_argument>(op, "rank " + std::to_string(rank) + " is negative");
  auto const size = static_cast<std::streamsize>(bytes.size());
  if (rank == 0) {
    std::string const temporary = path.string() + ".partial";
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<char const*>(bytes.data()), size);
    out.close();
    std::error_code renamed;
    if (out) std::filesystem::rename(temporary, path, renamed);
    if (!out || renamed) {
      std::error_code ignored;
      std::filesystem::remove(temporary, ignored);  // no half-written file left behind
      detail::fail<error>(op, !out ? "cannot write " + temporary
                                   : "cannot rename " + temporary + " to " + path.string() + ": " + renamed.message());
    }
    return;
  }
  auto const start = std::chrono::steady_clock::now();
  for (;;) {
    bool other_size = false;
    if (std::ifstream in(path, std::ios::binary); in) {
      in.read(reinterpret_cast<char*>(bytes.data()), size);
      if (in.gcount() == size && in.peek() == std::ifstream::traits_type::eof()) return;
      other_size = true;
    }
    if (detail::waited_past(start, timeout))
      throw collective_error("mpx::" + std::string(op) + ": rank " + std::to_string(rank) + " waited " +
                                 std::to_string(timeout.count()) + " ms for rank 0's " + std::to_string(bytes.size()) +
                                 " bytes in " + path.string() +
                                 (other_size ? " (the file there has another size: left by another job?)" : ""),
                             {0});
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace mpx
