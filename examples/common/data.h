// The digits trainers' data by global sample index: the data set file, the held-out split, each
// epoch's order cut into global batches, and a batch gathered onto the device (examples/common/).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gradsync/core/tensor.h"

namespace gradsync::examples {

struct Dataset {
  Tensor images;  // f32 [count, features], scaled
  Tensor labels;  // i64 [count]
  std::int64_t count = 0;
  std::int64_t features = 0;
  std::int64_t classes = 0;
};

// The digits file shipped in examples/data.
std::string default_data_path();
// Reads a data set; images are multiplied by `input_scale`.
Dataset load_dataset(const std::string& path, double input_scale);

// Held-out split: the last `holdout` fraction of a seeded permutation (or of the file order
// when shuffle is off). The same on every rank.
struct Split {
  std::vector<std::int64_t> train;
  std::vector<std::int64_t> heldout;
};
Split split_dataset(const Dataset& data, double holdout, std::uint64_t seed, bool shuffle);

// The rows rank r reads in one epoch, in order. The epoch is one seeded permutation of the whole
// training set, cut into global batches of `local_batch` x `world` samples by global sample
// index; rank r reads slice r of each. So the samples of step s do not depend on the number of
// ranks, and a run resumed on another world size (the same global batch) reads, from the step it
// resumes at, exactly the samples the interrupted run would have.
std::vector<std::int64_t> epoch_order(const std::vector<std::int64_t>& train, std::uint64_t seed, int epoch, int rank,
                                      int world, std::int64_t local_batch, bool shuffle);

// The rows order[begin, end) as a batch on `device`.
struct Batch {
  Tensor images;
  Tensor labels;  // on the host (the loss reads them there)
};
Batch gather(const Dataset& data, const std::vector<std::int64_t>& order, std::int64_t begin, std::int64_t end,
             Device device);

}  // namespace gradsync::examples
