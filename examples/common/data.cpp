// The digits trainers' data by global sample index (data.h).
#include "data.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "gradsync/io/safetensors.h"
#include "gradsync/kernels/ops.h"

namespace gradsync::examples {

std::string default_data_path() { return GRADSYNC_EXAMPLES_DATA "/digits.safetensors"; }

Dataset load_dataset(const std::string& path, double input_scale) {
  const io::SafetensorsReader file(path);
  Dataset data;
  data.images = file.read("images").to(DType::f32);
  GRADSYNC_CHECK(data.images.shape().size() == 2, path, ": 'images' must be [count, features], got ", data.images.describe());
  ops::scale(data.images, input_scale);
  data.labels = file.read("labels");
  GRADSYNC_CHECK(data.labels.dtype() == DType::i64 && data.labels.numel() == data.images.shape()[0], path,
                 ": 'labels' must be i64 [", data.images.shape()[0], "], got ", data.labels.describe());
  data.count = data.images.shape()[0];
  data.features = data.images.shape()[1];
  const std::int64_t* labels = data.labels.data_as<std::int64_t>();
  for (std::int64_t i = 0; i < data.count; ++i) {
    GRADSYNC_CHECK(labels[i] >= 0, path, ": negative label at row ", i);
    data.classes = std::max(data.classes, labels[i] + 1);
  }
  return data;
}

Split split_dataset(const Dataset& data, double holdout, std::uint64_t seed, bool shuffle) {
  GRADSYNC_CHECK(holdout >= 0 && holdout < 1, "--holdout must be in [0, 1), got ", holdout);
  std::vector<std::int64_t> order(static_cast<std::size_t>(data.count));
  std::iota(order.begin(), order.end(), 0);
  if (shuffle) {
    std::mt19937_64 generator(seed);
    std::shuffle(order.begin(), order.end(), generator);
  }
  const auto heldout = static_cast<std::size_t>(static_cast<double>(data.count) * holdout);
  Split split;
  split.train.assign(order.begin(), order.end() - static_cast<std::ptrdiff_t>(heldout));
  split.heldout.assign(order.end() - static_cast<std::ptrdiff_t>(heldout), order.end());
  return split;
}

std::vector<std::int64_t> epoch_order(const std::vector<std::int64_t>& train, std::uint64_t seed, int epoch, int rank,
                                      int world, std::int64_t local_batch, bool shuffle) {
  std::vector<std::int64_t> global = train;
  if (shuffle) {
    std::mt19937_64 generator(seed * 1000003u + static_cast<std::uint64_t>(epoch) * 7919u);
    std::shuffle(global.begin(), global.end(), generator);
  }
  const auto batch = static_cast<std::size_t>(local_batch);
  const std::size_t global_batch = batch * static_cast<std::size_t>(world);
  std::vector<std::int64_t> mine;
  for (std::size_t begin = 0; begin + global_batch <= global.size(); begin += global_batch) {
    const auto slice = global.begin() + static_cast<std::ptrdiff_t>(begin + batch * static_cast<std::size_t>(rank));
    mine.insert(mine.end(), slice, slice + static_cast<std::ptrdiff_t>(batch));
  }
  return mine;
}

Batch gather(const Dataset& data, const std::vector<std::int64_t>& order, std::int64_t begin, std::int64_t end,
             Device device) {
  const std::int64_t rows = end - begin;
  Tensor images = Tensor::empty({rows, data.features}, DType::f32);
  Tensor labels = Tensor::empty({rows}, DType::i64);
  const float* source = data.images.data_as<float>();
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t row = order[static_cast<std::size_t>(begin + r)];
    std::memcpy(images.data_as<float>() + r * data.features, source + row * data.features,
                static_cast<std::size_t>(data.features) * sizeof(float));
    labels.data_as<std::int64_t>()[r] = data.labels.data_as<std::int64_t>()[row];
  }
  return {images.to(device), labels};
}

}  // namespace gradsync::examples
