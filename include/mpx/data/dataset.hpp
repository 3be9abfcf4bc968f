// Image classification data sets in memory: images as a float host tensor [N, H, W, C]
// scaled to [0, 1], labels as int32. Loaded from a pair of IDX files (MNIST's format)
// or from an installed Fashion-MNIST (Debian's dataset-fashion-mnist package).
#pragma once

#include <mpx/core/error.hpp>
#include <mpx/data/idx.hpp>
#include <mpx/exec/tensor.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace mpx {

//! Images and their class labels, on the host.
struct image_dataset {
  tensor<float> images;               //!< [N, H, W, C], pixels / 255 (then normalize()d, if asked)
  std::vector<std::int32_t> labels;   //!< N labels, each in [0, num_classes)
  std::int32_t num_classes = 0;

  [[nodiscard]] std::size_t size() const noexcept { return labels.size(); }
  [[nodiscard]] std::int64_t height() const noexcept { return images.shape()[1]; }
  [[nodiscard]] std::int64_t width() const noexcept { return images.shape()[2]; }
  [[nodiscard]] std::int64_t channels() const noexcept { return images.shape()[3]; }
  //! Elements per image: H * W * C.
  [[nodiscard]] std::size_t image_size() const noexcept {
    return static_cast<std::size_t>(height() * width() * channels());
  }
};

//! Fashion-MNIST's ten classes, in label order (label 0 is "T-shirt/top").
inline constexpr std::array<std::string_view, 10> fashion_mnist_class_names = {
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"};

//! Where Debian's dataset-fashion-mnist package installs the four files.
inline constexpr std::string_view fashion_mnist_default_directory = "/usr/share/datasets/fashion-mnist";

//! The part of a data set to load.
enum class dataset_split { train, test };

//! Options of load_idx_dataset, load_mnist and load_fashion_mnist.
struct dataset_options {
  //! Keep only the first `limit` samples (all of them by default).
  std::size_t limit = std::numeric_limits<std::size_t>::max();
  //! Labels must lie in [0, num_classes).
  std::int32_t num_classes = 10;
};

//! Loads images from one IDX file ([N, H, W] or [N, H, W, C] unsigned bytes) and labels
//! from another ([N] unsigned bytes), plain or gzip. Pixels become floats in [0, 1].
//! Throws mpx::data_error when a file cannot be read (see read_idx), when the image
//! and label counts differ (naming both files and both counts), when the files have the
//! wrong number of dimensions, or when a label is outside [0, num_classes).
inline image_dataset load_idx_dataset(std::filesystem::path const& images_path,
                                      std::filesystem::path const& labels_path, dataset_options const& options = {}) {
  constexpr std::string_view op = "load_idx_dataset";
  if (options.num_classes <= 0 || options.num_classes > 256)
    detail::fail<invalid_argument>(op, "num_classes must be in [1, 256] for byte labels, not " +
                                           std::to_string(options.num_classes));
  idx_array raw_images = read_idx(images_path);
  idx_array raw_labels = read_idx(labels_path);
  auto dims_text = [](idx_array const& a) {
    std::string s = "[";
    for (std::size_t i = 0; i < a.dims.size(); ++i) s += (i ? ", " : "") + std::to_string(a.dims[i]);
    return s + "]";
  };
  if (raw_images.dims.size() != 3 && raw_images.dims.size() != 4)
    detail::refuse_idx(op, images_path.string(),
                       "an image file has 3 dimensions [N, H, W] or 4 [N, H, W, C], not " +
                           dims_text(raw_images) + " (is it a label file?)");
  if (raw_labels.dims.size() != 1)
    detail::refuse_idx(op, labels_path.string(),
                       "a label file has 1 dimension [N], not " + dims_text(raw_labels) + " (is it an image file?)");
  auto const images_count = static_cast<std::size_t>(raw_images.dims[0]);
  auto const labels_count = static_cast<std::size_t>(raw_labels.dims[0]);
  if (images_count != labels_count)
    detail::fail<data_error>(op, "the image and label counts differ: '" + images_path.string() + "' holds " +
                                     std::to_string(images_count) + " images, '" + labels_path.string() +
                                     "' holds " + std::to_string(labels_count) + " labels");

  std::size_t const n = std::min(images_count, options.limit);
  std::int64_t const h = raw_images.dims[1], w = raw_images.dims[2];
  std::int64_t const c = raw_images.dims.size() == 4 ? raw_images.dims[3] : 1;
  image_dataset out{tensor<float>(shape{static_cast<std::int64_t>(n), h, w, c}), {}, options.num_classes};
  out.labels.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::uint8_t const label = raw_labels.data[i];
    if (label >= options.num_classes)
      detail::refuse_idx(op, labels_path.string(),
                         "label " + std::to_string(label) + " of sample " + std::to_string(i) + " is outside [0, " +
                             std::to_string(options.num_classes) + ")");
    out.labels[i] = label;
  }
  float* pixels = out.images.data();
  for (std::size_t i = 0, count = out.images.size(); i < count; ++i)
    pixels[i] = static_cast<float>(raw_images.data[i]) / 255.0f;
  return out;
}

namespace detail {
//! `name` or `name.gz` in `directory`, whichever exists (the plain file first).
inline std::filesystem::path find_idx_file(std::filesystem::path const& directory, std::string const& name,
                                           std::string_view op, std::string_view dataset, std::string_view hint) {
  std::error_code ec;
  for (std::string const& candidate : {name, name + ".gz"})
    if (std::filesystem::is_regular_file(directory / candidate, ec)) return directory / candidate;
  fail<data_error>(op, std::string(dataset) + ": neither '" + name + "' nor '" + name + ".gz' is in '" +
                           directory.string() + "'" + std::string(hint));
}

inline image_dataset load_mnist_layout(std::filesystem::path const& directory, dataset_split split,
                                       dataset_options const& options, std::string_view op, std::string_view dataset,
                                       std::string_view hint) {
  std::string const prefix = split == dataset_split::train ? "train" : "t10k";
  auto const images = find_idx_file(directory, prefix + "-images-idx3-ubyte", op, dataset, hint);
  auto const labels = find_idx_file(directory, prefix + "-labels-idx1-ubyte", op, dataset, hint);
  return load_idx_dataset(images, labels, options);
}
}  // namespace detail

//! Loads MNIST's training (60000) or test (10000) split from `directory`, which holds
//! the standard file names (train-images-idx3-ubyte, train-labels-idx1-ubyte,
//! t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte), each plain or with ".gz".
inline image_dataset load_mnist(std::filesystem::path const& directory, dataset_split split = dataset_split::train,
                                dataset_options const& options = {}) {
  return detail::load_mnist_layout(directory, split, options, "load_mnist", "MNIST", "");
}

//! Loads Fashion-MNIST's training (60000 images, 28 x 28) or test (10000) split, with
//! the same file names as MNIST. The default directory is where Debian's
//! dataset-fashion-mnist package installs them; data_error says so when they are absent.
inline image_dataset load_fashion_mnist(std::filesystem::path const& directory = fashion_mnist_default_directory,
                                        dataset_split split = dataset_split::train,
                                        dataset_options const& options = {}) {
  return detail::load_mnist_layout(directory, split, options, "load_fashion_mnist", "Fashion-MNIST",
                                   "; install Debian's dataset-fashion-mnist package (apt-get install "
                                   "dataset-fashion-mnist) or pass the directory that holds the files");
}

//! The mean and standard deviation of every pixel of a data set (summed in double).
struct pixel_statistics {
  double mean = 0;
  double stddev = 0;
};

//! The mean and (population) standard deviation of all pixels: compute them on the
//! training split and normalize() every split with them.
inline pixel_statistics compute_pixel_statistics(image_dataset const& data) {
  double sum = 0, sum_sq = 0;
  for (float x : data.images.view()) {
    sum += x;
    sum_sq += static_cast<double>(x) * x;
  }
  auto const n = static_cast<double>(data.images.size());
  if (n == 0) return {};
  double const mean = sum / n;
  return {mean, std::sqrt(std::max(0.0, sum_sq / n - mean * mean))};
}

//! Replaces every pixel x by (x - mean) / stddev. invalid_argument unless stddev > 0.
inline void normalize(image_dataset& data, pixel_statistics const& statistics) {
  if (!(statistics.stddev > 0))
    detail::fail<invalid_argument>("normalize", "the standard deviation must be positive, not " +
                                                    detail::to_text(statistics.stddev));
  auto const mean = static_cast<float>(statistics.mean);
  auto const inverse = static_cast<float>(1.0 / statistics.stddev);
  for (float& x : data.images) x = (x - mean) * inverse;
}

}  // namespace mpx
