// mpx::share_bytes_through_file (the NCCL unique id's path for launchers without MPI):
// rank 0's bytes reach the other ranks exactly, a reader waits for a late writer, and a
// missing or wrong-sized file ends in mpx::collective_error naming rank 0, not a hang.
#include "../support/testing.hpp"

#include <mpx/dist/file_bootstrap.hpp>

#include <array>
#include <chrono>
#include <cstddef>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

std::array<std::byte, 128> id_bytes(unsigned seed) {  // an NCCL unique id's size
  std::array<std::byte, 128> b{};
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::byte>((i * 31 + seed) & 0xFF);
  return b;
}

}  // namespace

TEST_CASE("share_bytes_through_file hands rank 0's bytes to the other ranks, exactly", "[dist]") {
  mpx_test::scratch_dir dir("file_bootstrap");
  auto const path = dir.path / "nccl_id";
  auto sent = id_bytes(7);
  mpx::share_bytes_through_file(path, 0, sent);
  CHECK_FALSE(std::filesystem::exists(path.string() + ".partial"));  // renamed into place
  for (int rank : {1, 2, 5}) {
    std::array<std::byte, 128> got{};
    mpx::share_bytes_through_file(path, rank, got, std::chrono::milliseconds(1000));
    CHECK(got == sent);
  }
}

TEST_CASE("share_bytes_through_file: a reader waits for a writer that comes late, for ever if asked", "[dist]") {
  mpx_test::scratch_dir dir("file_bootstrap_late");
  auto const path = dir.path / "nccl_id";
  auto sent = id_bytes(3);
  std::array<std::byte, 128> got{};
  std::string failure;
  std::thread reader([&] {
    try {
      // milliseconds::max(): for ever (a deadline now() + max would overflow and give up at once)
      mpx::share_bytes_through_file(path, 1, got, std::chrono::milliseconds::max());
    } catch (std::exception const& e) {
      failure = e.what();
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  mpx::share_bytes_through_file(path, 0, sent);
  reader.join();
  CHECK(failure.empty());
  CHECK(got == sent);
}

TEST_CASE("share_bytes_through_file: no file, or one of another size, is a collective_error, not a hang", "[dist]") {
  mpx_test::scratch_dir dir("file_bootstrap_bad");
  auto const path = dir.path / "nccl_id";
  std::array<std::byte, 128> got{};
  auto const waited = [&] {
    try {
      mpx::share_bytes_through_file(path, 3, got, std::chrono::milliseconds(60));
    } catch (mpx::collective_error const& e) {
      CHECK(e.missing_ranks() == std::vector<int>{0});
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string const none = waited();
  CHECK_THAT(none, Catch::Matchers::Contains("rank 3 waited 60 ms for rank 0's 128 bytes in " + path.string()));
  CHECK_THAT(none, !Catch::Matchers::Contains("another size"));
  for (std::size_t size : {std::size_t{127}, std::size_t{129}}) {
    { std::ofstream(path, std::ios::binary) << std::string(size, 'x'); }
    CHECK_THAT(waited(), Catch::Matchers::Contains("the file there has another size"));
  }
  CHECK_THROWS_AS(mpx::share_bytes_through_file(path, -1, got), mpx::invalid_argument);
  // Rank 0 cannot write where no folder is: an mpx::error naming the file.
  CHECK_THROWS_WITH(mpx::share_bytes_through_file(dir.path / "no_such_folder" / "id", 0, got),
                    Catch::Matchers::Contains("cannot write"));
}
