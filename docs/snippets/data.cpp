// docs/data.md: write a tiny IDX data set (what MNIST and Fashion-MNIST ship as), load
// it, cut it into shuffled half-precision mini-batches, and see a bad file refused.
#include <mpx/mpx.hpp>

#include <cstdio>
#include <filesystem>
#include <set>
#include <string>

int main() {
  bool ok = true;
  namespace fs = std::filesystem;
  fs::path const dir = fs::temp_directory_path() / "mpx_doc_data";
  fs::create_directories(dir);

  // Ten 4 x 4 images with pixel values 0..255, and their labels: the same format as
  // train-images-idx3-ubyte and train-labels-idx1-ubyte.
  mpx::idx_array images{{10, 4, 4}, {}};
  for (int i = 0; i < 10 * 16; ++i) images.data.push_back(static_cast<std::uint8_t>(i % 256));
  mpx::idx_array labels{{10}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}};
  auto const compression = mpx::idx_gzip_available ? mpx::idx_compression::gzip : mpx::idx_compression::none;
  mpx::write_idx(dir / "images-idx3-ubyte.gz", images, compression);
  mpx::write_idx(dir / "labels-idx1-ubyte.gz", labels, compression);

  // Load: images [N, H, W, 1] as float in [0, 1], labels as int32.
  mpx::image_dataset data = mpx::load_idx_dataset(dir / "images-idx3-ubyte.gz", dir / "labels-idx1-ubyte.gz");
  std::printf("%zu images of %s\n", data.size(), data.images.shape().to_string().c_str());
  ok &= data.size() == 10 && data.images.shape() == mpx::shape{10, 4, 4, 1};
  ok &= data.images[17] == 17.0f / 255.0f;
  // For real data: auto train = mpx::load_fashion_mnist();  // Debian: dataset-fashion-mnist

  // Mini-batches of 4, shuffled from a seed, stored as half in the executor's memory.
  mpx::host_executor exec;  // in a .cu file: mpx::cuda_executor exec{stream};
  mpx::batch_loader<mpx::host_executor, mpx::half> loader(exec, data, {.batch_size = 4, .shuffle = true, .seed = 1});
  for (std::uint64_t epoch = 0; epoch < 2; ++epoch) {
    loader.start_epoch(epoch);
    std::set<std::int32_t> seen;
    while (auto batch = loader.next()) {
      // batch->images: tensor_view<half const> [B, 4, 4, 1]; batch->labels: int32 [B].
      std::printf("epoch %d batch %zu: %zu images, labels", static_cast<int>(epoch), batch->index, batch->size);
      for (std::int32_t label : batch->labels) {
        std::printf(" %d", label);
        seen.insert(label);
      }
      std::printf("\n");
      ok &= batch->images.shape()[0] == static_cast<std::int64_t>(batch->size);
      ok &= mpx::cast<float>(batch->images[0]) == mpx::cast<float>(mpx::cast<mpx::half>(data.images[batch->samples[0] * 16]));
    }
    ok &= seen.size() == 10;  // every sample once per epoch (batches of 4, 4 and 2)
  }

  // A truncated file is refused with the file and the fault named.
  images.data.resize(100);
  mpx::write_idx(dir / "short", mpx::idx_array{{100}, images.data});
  fs::resize_file(dir / "short", 50);
  try {
    mpx::read_idx(dir / "short");
    ok = false;
  } catch (mpx::data_error const& e) {
    std::printf("%s\n", e.what());
    ok &= std::string(e.what()).find("need 100 data bytes after the header, found 42") != std::string::npos;
  }

  fs::remove_all(dir);
  std::printf(ok ? "ok\n" : "FAILED\n");
  return ok ? 0 : 1;
}
