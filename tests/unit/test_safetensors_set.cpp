// Reading by ranges (SafetensorsReader::read_range) and models in several files with an index
// (gradsync/io/safetensors_set.h): a range equals the same elements of a whole read, converted
// as a whole tensor would be; a set split over three files reads as the one file it was cut
// from; every damaged or inconsistent set is an error naming the index and the file or tensor,
// at open, before anything is read; files that are not files (FIFOs, devices, links out of the
// folder) are refused without being read or waited on.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <random>

#include <sys/stat.h>

#include "gradsync/io/checksum.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/io/safetensors_set.h"
#include "test_util.h"

namespace gradsync {
namespace {

using testing::TempDir;

std::vector<io::NamedTensor> model_tensors() {
  std::vector<io::NamedTensor> tensors;
  std::mt19937 random(5);
  std::normal_distribution<float> normal;
  const std::vector<std::pair<std::string, Shape>> shapes = {
      {"embed.weight", {50, 16}}, {"blocks.0.fc.weight", {64, 16}}, {"blocks.0.fc.bias", {64}},
      {"blocks.1.fc.weight", {16, 64}}, {"blocks.1.fc.bias", {16}}, {"head.weight", {7, 16}}};
  for (const auto& [name, shape] : shapes) {
    std::vector<float> values(static_cast<std::size_t>(shape_numel(shape)));
    for (float& v : values) v = normal(random);
    tensors.push_back({name, Tensor::from_vector(values, shape).to(DType::bf16)});
  }
  return tensors;
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::trunc) << text;
}

// The model cut into three files with an index, as pretrained models ship.
std::filesystem::path write_set(const std::filesystem::path& folder, const std::vector<io::NamedTensor>& tensors) {
  std::string map;
  std::uint64_t bytes = 0;
  for (int file = 0; file < 3; ++file) {
    std::vector<io::NamedTensor> part;
    for (std::size_t k = static_cast<std::size_t>(file); k < tensors.size(); k += 3) part.push_back(tensors[k]);
    const std::string name = "model-0000" + std::to_string(file + 1) + "-of-00003.safetensors";
    io::save_safetensors(folder / name, part);
    for (const io::NamedTensor& t : part) {
      map += std::string(map.empty() ? "" : ", ") + "\"" + t.name + "\": \"" + name + "\"";
      bytes += t.tensor.nbytes();
    }
  }
  const auto index = folder / "model.safetensors.index.json";
  write_text(index, "{\"metadata\": {\"total_size\": " + std::to_string(bytes) + "}, \"weight_map\": {" + map + "}}");
  return index;
}

TEST(SafetensorsRanges, ARangeEqualsTheSameElementsOfTheWhole) {
  TempDir folder;
  const std::vector<io::NamedTensor> tensors = model_tensors();
  io::save_safetensors(folder / "one.safetensors", tensors);
  const io::SafetensorsReader file(folder / "one.safetensors");
  std::mt19937 random(9);
  for (const io::NamedTensor& t : tensors) {
    const std::vector<double> whole = file.read(t.name).to_double_vector();
    const std::vector<double> whole_f32 = file.read(t.name).to(DType::f32).to_double_vector();
    const auto numel = static_cast<std::int64_t>(whole.size());
    for (int trial = 0; trial < 20; ++trial) {
      const std::int64_t first = std::uniform_int_distribution<std::int64_t>(0, numel)(random);
      const std::int64_t count = std::uniform_int_distribution<std::int64_t>(0, numel - first)(random);
      const Tensor piece = file.read_range(t.name, first, count);
      ASSERT_EQ(piece.dtype(), DType::bf16);
      EXPECT_EQ(piece.to_double_vector(), std::vector<double>(whole.begin() + first, whole.begin() + first + count));
      const Tensor widened = file.read_range(t.name, first, count, DType::f32);  // bf16 file into f32 masters
      ASSERT_EQ(widened.dtype(), DType::f32);
      EXPECT_EQ(widened.to_double_vector(),
                std::vector<double>(whole_f32.begin() + first, whole_f32.begin() + first + count));
    }
  }
  EXPECT_GRADSYNC_ERROR(file.read_range("head.weight", 100, 20), "elements 100..120 of tensor 'head.weight' are not",
                        "inside its 112 elements");
  EXPECT_GRADSYNC_ERROR(file.read_range("head.weight", -1, 2), "elements -1..1");
  EXPECT_GRADSYNC_ERROR(file.read_range("nothing", 0, 1), "has no tensor named 'nothing'");
}

TEST(SafetensorsSet, ThreeFilesAndAnIndexReadAsTheOneFile) {
  TempDir folder;
  const std::vector<io::NamedTensor> tensors = model_tensors();
  const auto index = write_set(folder.path(), tensors);
  io::save_safetensors(folder / "one.safetensors", tensors);
  const io::SafetensorsSet set(index), one(folder / "one.safetensors");
  EXPECT_EQ(set.names(), one.names());
  EXPECT_EQ(set.metadata().at("total_size"), std::to_string(50 * 16 * 2 + 64 * 16 * 2 + 64 * 2 + 16 * 64 * 2 + 16 * 2 + 7 * 16 * 2));
  for (const io::NamedTensor& t : tensors) {
    EXPECT_EQ(set.read(t.name).to_double_vector(), one.read(t.name).to_double_vector()) << t.name;
    EXPECT_EQ(set.read_range(t.name, 3, 9, DType::f32).to_double_vector(),
              one.read_range(t.name, 3, 9, DType::f32).to_double_vector());
    EXPECT_EQ(set.find(t.name)->shape, t.tensor.shape());
  }
  EXPECT_EQ(set.file_of("blocks.0.fc.weight").path().filename(), "model-00002-of-00003.safetensors");
  EXPECT_EQ(set.find("absent"), nullptr);
}

TEST(SafetensorsSet, DamagedOrInconsistentSetsAreRefusedAtOpen) {
  const std::vector<io::NamedTensor> tensors = model_tensors();
  struct Case {
    const char* label;
    std::function<void(const std::filesystem::path& folder, const std::filesystem::path& index)> damage;
    std::vector<std::string> expected;
  };
  const auto replace_in = [](const std::filesystem::path& index, const std::string& from, const std::string& to) {
    std::ifstream in(index);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    text.replace(text.find(from), from.size(), to);
    write_text(index, text);
  };
  const std::vector<Case> cases = {
      {"a missing file", [](const auto& folder, const auto&) { std::filesystem::remove(folder / "model-00002-of-00003.safetensors"); },
       {"maps tensors to", "model-00002-of-00003.safetensors, which is not there"}},
      {"a truncated file",
       [](const auto& folder, const auto&) {
         const auto path = folder / "model-00003-of-00003.safetensors";
         std::filesystem::resize_file(path, std::filesystem::file_size(path) - 10);
       },
       {"model-00003-of-00003.safetensors"}},
      {"a tensor named twice",
       [&](const auto&, const auto& index) {
         replace_in(index, "\"weight_map\": {", "\"weight_map\": {\"head.weight\": \"model-00001-of-00003.safetensors\", ");
       },
       {"names tensor 'head.weight' twice in its weight_map"}},
      {"a tensor mapped to a file that does not hold it",
       [&](const auto&, const auto& index) {
         replace_in(index, "\"head.weight\": \"model-00003-of-00003.safetensors\"", "\"head.weight\": \"model-00001-of-00003.safetensors\"");
       },
       {"maps tensor 'head.weight' to model-00001-of-00003.safetensors, which does not hold it"}},
      {"a file outside the folder",
       [&](const auto&, const auto& index) {
         replace_in(index, "\"head.weight\": \"model-00003-of-00003.safetensors\"", "\"head.weight\": \"../elsewhere.safetensors\"");
       },
       {"maps to '../elsewhere.safetensors', not a file name in the index's folder"}},
      {"a wrong total size", [&](const auto&, const auto& index) { replace_in(index, "\"total_size\": ", "\"total_size\": 1"); },
       {"metadata.total_size is 1"}},
      {"an index that is not JSON", [](const auto&, const auto& index) { write_text(index, "{\"weight_map\": {"); },
       {"is not a JSON object"}},
      {"no weight map", [](const auto&, const auto& index) { write_text(index, "{\"metadata\": {}}"); }, {"has no weight_map"}},
      {"a file name that is not a string",
       [&](const auto&, const auto& index) {
         replace_in(index, "\"head.weight\": \"model-00003-of-00003.safetensors\"", "\"head.weight\": [1, 2]");
       },
       {"tensor 'head.weight' maps to [1, 2], not a file name"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    TempDir folder;
    const auto index = write_set(folder.path(), tensors);
    c.damage(folder.path(), index);
    try {
      io::SafetensorsSet set(index);
      ADD_FAILURE() << "the damaged set opened";
    } catch (const Error& error) {
      for (const std::string& part : c.expected) {
        EXPECT_NE(std::string(error.what()).find(part), std::string::npos) << error.what();
      }
    }
  }
}

}  // namespace
// Files that are not what they claim, each refused at open with the file and what it is, never
// followed out of the set's folder, never read whole or waited on: a shard that is a link out of
// the folder (relative or absolute), an index or a single file that is a FIFO (it blocked for
// ever) or a link to /dev/zero (read whole: 2.2 GB, then bad_alloc), shards that are a FIFO or a
// folder (they were "not there"), the checksum of a FIFO or of /dev/zero. Links that stay in the
// folder the index really lives in (a Hugging Face cache's layout) still load.
TEST(SafetensorsSet, FilesThatAreNotFilesAreRefused) {
  namespace fs = std::filesystem;
  TempDir folder;
  const std::vector<io::NamedTensor> tensors = model_tensors();
  const fs::path set = folder / "set";
  fs::create_directories(set);
  const fs::path index = write_set(set, tensors);
  const fs::path shard = set / "model-00002-of-00003.safetensors";
  const fs::path outside = folder / "outside.safetensors";
  fs::copy_file(shard, outside);
  const auto with_shard = [&](const std::function<void()>& make, const std::vector<std::string>& expected) {
    fs::rename(shard, folder / "kept");
    make();
    if (expected.empty()) {
      EXPECT_NO_THROW(io::SafetensorsSet{index});
    } else {
      EXPECT_GRADSYNC_ERROR(io::SafetensorsSet{index}, expected[0], expected[1]);
    }
    fs::remove_all(shard);
    fs::remove(set / "real.bin");
    fs::rename(folder / "kept", shard);
  };
  with_shard([&] { fs::create_symlink("../outside.safetensors", shard); },
             {"a link that leads out of the index's folder", "outside.safetensors"});
  with_shard([&] { fs::create_symlink(outside, shard); }, {"a link that leads out of the index's folder", "outside"});
  with_shard([&] { ASSERT_EQ(::mkfifo(shard.c_str(), 0600), 0); }, {"is a FIFO, not a regular file", "model-00002"});
  with_shard([&] { fs::create_directory(shard); }, {"is a folder, not a regular file", "model-00002"});
  // A link inside the folder is the same file.
  with_shard([&] { fs::copy_file(folder / "kept", set / "real.bin"); fs::create_symlink("real.bin", shard); }, {});

  const fs::path fifo = folder / "fifo.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_GRADSYNC_ERROR(io::SafetensorsReader{fifo}, "is a FIFO, not a regular file", "fifo.safetensors");
  EXPECT_GRADSYNC_ERROR(io::checksum_file(fifo), "is a FIFO, not a regular file", "fifo.safetensors");
  const fs::path fifo_index = folder / "fifo.index.json";
  ASSERT_EQ(::mkfifo(fifo_index.c_str(), 0600), 0);
  EXPECT_GRADSYNC_ERROR(io::SafetensorsSet{fifo_index}, "safetensors index", "is a FIFO, not a regular file");
  const fs::path zero_index = folder / "zero.index.json";
  fs::create_symlink("/dev/zero", zero_index);
  EXPECT_GRADSYNC_ERROR(io::SafetensorsSet{zero_index}, "zero.index.json", "is a character device, not a regular file");
  EXPECT_GRADSYNC_ERROR(io::checksum_file("/dev/zero"), "/dev/zero", "is a character device");

  // A Hugging Face cache: snapshots/<rev>/ holds links into blobs/, the index's too.
  const fs::path blobs = folder / "hub" / "blobs", snapshot = folder / "hub" / "snapshots" / "abc";
  fs::create_directories(blobs);
  fs::create_directories(snapshot);
  for (const fs::directory_entry& entry : fs::directory_iterator(set)) {
    if (entry.path().filename() == "real.bin") continue;
    fs::copy_file(entry.path(), blobs / ("blob-" + entry.path().filename().string()));
    fs::create_symlink("../../blobs/blob-" + entry.path().filename().string(), snapshot / entry.path().filename());
  }
  const io::SafetensorsSet cached(snapshot / "model.safetensors.index.json");
  for (const io::NamedTensor& t : tensors) {
    EXPECT_EQ(cached.read(t.name).to(DType::f32).to_double_vector(), t.tensor.to(DType::f32).to_double_vector()) << t.name;
  }
}

}  // namespace gradsync
