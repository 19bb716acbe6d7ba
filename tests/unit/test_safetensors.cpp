// safetensors: round trips of every dtype, a file written by the reference library loads,
// every kind of corrupt file is rejected with a clear error, saves are atomic, and registry
// checkpoints keep names, shapes, dtypes and defined/undefined gradients.
#include "gradsync/io/safetensors.h"

#include <signal.h>
#include <sys/resource.h>

#include <cstring>
#include <fstream>
#include <random>

#include "gradsync/io/checksum.h"
#include "gradsync/io/registry_checkpoint.h"
#include "gradsync/kernels/ops.h"
#include "test_util.h"

namespace gradsync {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file with the given JSON header and `data_bytes` bytes of data.
std::string make_file(const std::string& header, std::size_t data_bytes) {
  std::string bytes(8, '\0');
  const std::uint64_t length = header.size();
  std::memcpy(bytes.data(), &length, 8);
  return bytes + header + std::string(data_bytes, '\x01');
}

std::size_t leftover_files(const fs::path& folder) {
  return static_cast<std::size_t>(std::distance(fs::directory_iterator(folder), fs::directory_iterator()));
}

// Must match reference_value() in tests/reference/generate_fixtures.py.
double reference_value(std::int64_t index, DType dtype) {
  if (dtype == DType::i32) return static_cast<double>((index * 7919) % 100003 - 50000);
  if (dtype == DType::i64) return static_cast<double>(index * 1000000007 - 3 * (std::int64_t{1} << 40));
  return static_cast<double>(index - 7) * 0.25;
}

TEST(Safetensors, RoundTripEveryDTypeAndShape) {
  TempDir folder;
  std::vector<io::NamedTensor> tensors;
  std::uint64_t seed = 11;
  for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64}) {
    for (const Shape& shape : std::vector<Shape>{{}, {7}, {3, 5}, {0, 4}, {2, 3, 4}}) {
      const std::string name = std::string(dtype_name(dtype)) + shape_str(shape);
      tensors.push_back({name, testing::random_tensor(shape_numel(shape), dtype, seed++).reshape(shape)});
    }
  }
  const io::Metadata metadata{{"step", "42"}, {"note", "round trip \"quoted\" \u00e9"}};
  io::save_safetensors(folder / "all.safetensors", tensors, metadata);

  const io::SafetensorsReader reader(folder / "all.safetensors");
  EXPECT_EQ(reader.metadata(), metadata);
  EXPECT_EQ(reader.tensors().size(), tensors.size());
  for (const io::NamedTensor& original : tensors) {
    const Tensor loaded = reader.read(original.name);
    EXPECT_EQ(loaded.dtype(), original.tensor.dtype()) << original.name;
    EXPECT_EQ(loaded.shape(), original.tensor.shape()) << original.name;
    ASSERT_EQ(loaded.nbytes(), original.tensor.nbytes());
    EXPECT_EQ(std::memcmp(loaded.data(), original.tensor.data(), loaded.nbytes()), 0) << original.name;
  }
  // The reference layout: header length a multiple of 8, so every tensor is aligned.
  const std::string bytes = read_bytes(folder / "all.safetensors");
  std::uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  EXPECT_EQ(header_length % 8, 0u);
  for (const io::TensorInfo& info : reader.tensors()) EXPECT_EQ(info.data_begin % dtype_size(info.dtype.value()), 0u);
  EXPECT_GRADSYNC_ERROR(reader.read("missing"), "no tensor named 'missing'");
}

TEST(Safetensors, FileWrittenByTheReferenceLibraryLoads) {
  const io::SafetensorsReader reader(testing::fixture_path("reference_tensors.safetensors"));
  EXPECT_EQ(reader.metadata().at("writer"), "safetensors.torch.save_file");
  const std::vector<std::pair<std::string, Shape>> shapes{
      {"scalar", {}}, {"vector", {5}}, {"matrix", {3, 4}}, {"cube", {2, 3, 2}}, {"empty", {0, 3}}};
  std::size_t checked = 0;
  for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64}) {
    for (const auto& [shape_name, shape] : shapes) {
      const std::string name = std::string(dtype_name(dtype)) + "." + shape_name;
      const Tensor tensor = reader.read(name);
      EXPECT_EQ(tensor.dtype(), dtype) << name;
      EXPECT_EQ(tensor.shape(), shape) << name;
      const std::vector<double> values = tensor.to_double_vector();
      for (std::size_t i = 0; i < values.size(); ++i) {
        EXPECT_EQ(values[i], reference_value(static_cast<std::int64_t>(i), dtype)) << name << "[" << i << "]";
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, reader.tensors().size());
}

// PyTorch writes bool masks, bytes and float8 scales next to the weights: the file opens, the
// tensors gradsync handles read, and only reading one it does not is an error naming it.
TEST(Safetensors, AFileWithDTypesGradsyncDoesNotHandleStillOpens) {
  const io::SafetensorsReader reader(testing::fixture_path("torch_dtypes.safetensors"));
  EXPECT_EQ(reader.read("weight").to_double_vector(), (std::vector<double>{0, 0.5, 1, 1.5, 2, 2.5}));
  EXPECT_EQ(reader.read("bias").to_double_vector(), (std::vector<double>{0.25, -1.5}));
  const io::TensorInfo* mask = reader.find("mask");
  ASSERT_NE(mask, nullptr);
  EXPECT_FALSE(mask->dtype.has_value());
  EXPECT_EQ(mask->stored_dtype, "BOOL");
  EXPECT_EQ(mask->shape, (Shape{2, 3}));
  EXPECT_GRADSYNC_ERROR(reader.read("mask"), "tensor 'mask' is BOOL", "does not handle", "torch_dtypes.safetensors");
  EXPECT_GRADSYNC_ERROR(reader.read_all(), "is ", "does not handle");
  for (const char* name : {"tokens", "offsets", "positions"}) EXPECT_FALSE(reader.find(name)->dtype.has_value()) << name;

  // A registry of the weights loads from it; the other tensors are extra, and named as such.
  ParameterRegistry registry;
  registry.add("weight", {2, 3}, DType::f32);
  registry.finalize();
  io::load_registry(registry, testing::fixture_path("torch_dtypes.safetensors"), {.allow_extra_tensors = true});
  EXPECT_EQ(registry.at("weight").value().to_double_vector(), (std::vector<double>{0, 0.5, 1, 1.5, 2, 2.5}));
  ParameterRegistry wrong;
  wrong.add("mask", {2, 3}, DType::f32);
  wrong.finalize();
  EXPECT_GRADSYNC_ERROR(io::load_registry(wrong, testing::fixture_path("torch_dtypes.safetensors"),
                                          {.allow_extra_tensors = true, .convert_dtypes = true}),
                        "'mask' has dtype BOOL in the file, f32 registered");
}

struct CorruptCase {
  const char* label;
  std::string bytes;
  const char* expected;
};

TEST(Safetensors, CorruptFilesAreRejectedWithClearErrors) {
  const std::string good_entry = R"("t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  std::string huge_length(8, '\0');
  const std::uint64_t huge = std::uint64_t{1} << 62;
  std::memcpy(huge_length.data(), &huge, 8);
  const std::vector<CorruptCase> cases{
      {"empty file", "", "truncated"},
      {"shorter than the length field", "abc", "truncated"},
      {"header length past the end", huge_length + "{}", "runs past the end"},
      {"header cut short", make_file("{" + good_entry + "}", 8).substr(0, 20), "runs past the end"},
      {"bad JSON", make_file("{\"t\": [", 0), "not valid JSON"},
      {"JSON that is not an object", make_file("[1,2]", 0), "not an object"},
      {"unknown dtype", make_file(R"({"t":{"dtype":"U7","shape":[2],"data_offsets":[0,2]}})", 2),
       "dtype '\"U7\"' is not one the safetensors format defines"},
      {"a format dtype whose size disagrees", make_file(R"({"t":{"dtype":"BOOL","shape":[3],"data_offsets":[0,2]}})", 2),
       "shape [3] of BOOL needs 3 elements"},
      {"packed 4-bit elements ending mid-byte", make_file(R"({"t":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2),
       "of F4 needs 3 elements"},
      {"dtype not a string", make_file(R"({"t":{"dtype":5,"shape":[2],"data_offsets":[0,8]}})", 8), "dtype"},
      {"missing data_offsets", make_file(R"({"t":{"dtype":"F32","shape":[2]}})", 8), "data_offsets"},
      {"extra field", make_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8), "fields other"},
      {"negative dimension", make_file(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "non-negative"},
      {"fractional dimension", make_file(R"({"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]}})", 8), "non-negative"},
      {"shape and size disagree", make_file(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "hold 8 bytes"},
      {"shape overflows", make_file(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
       "64 bits"},
      {"offsets out of range", make_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4), "past the end"},
      {"offsets reversed", make_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "reversed"},
      {"offsets not integers", make_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8), "two non-negative"},
      {"overlapping tensors",
       make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       "overlaps"},
      {"a hole between tensors",
       make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12),
       "belong to no tensor"},
      {"trailing bytes", make_file("{" + good_entry + "}", 12), "belong to no tensor"},
      {"metadata not strings", make_file(R"({"__metadata__":{"a":1}})", 0), "__metadata__"},
      {"entry not an object", make_file(R"({"t":7})", 0), "must be an object"},
      // What the reference implementation rejects, and what used to crash.
      {"a byte order mark", make_file("\xEF\xBB\xBF{" + good_entry + "}", 8), "byte order mark"},
      {"a NUL inside the header", make_file("{" + good_entry + "}" + std::string(1, '\0') + "junk", 8), "NUL byte"},
      {"deeply nested shape",
       make_file(R"({"t":{"dtype":"F32","shape":)" + std::string(100000, '[') + std::string(100000, ']') +
                     R"(,"data_offsets":[0,8]}})",
                 8),
       "nests deeper than 64"},
      {"moderately nested data_offsets (no recursive printing)",
       make_file(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":)" + std::string(60, '[') + std::string(60, ']') + "}}", 8),
       "data_offsets must be two non-negative integers, got [[...]]"},
  };
  TempDir folder;
  for (const CorruptCase& corrupt : cases) {
    const fs::path path = folder / "corrupt.safetensors";
    write_bytes(path, corrupt.bytes);
    SCOPED_TRACE(corrupt.label);
    EXPECT_GRADSYNC_ERROR(io::SafetensorsReader{path}, corrupt.expected, path.string());
  }
  EXPECT_GRADSYNC_ERROR(io::SafetensorsReader(folder / "does-not-exist.safetensors"), "cannot open",
                        "does-not-exist");
}

TEST(Safetensors, RandomlyMutatedFilesNeverCrash) {
  // Hostile input: flip bytes of a valid file (header and data) and truncate it at random.
  // Every outcome must be a clean load or a gradsync::Error, never a crash or a hang.
  TempDir folder;
  const fs::path valid = folder / "valid.safetensors";
  io::save_safetensors(valid, {{"a", testing::random_tensor(6, DType::f32, 1)},
                               {"b", testing::random_tensor(3, DType::i64, 2)}},
                       {{"k", "v"}});
  const std::string original = read_bytes(valid);
  std::mt19937 generator(1234);
  int rejected = 0;
  for (int trial = 0; trial < 600; ++trial) {
    std::string bytes = original;
    const int flips = 1 + static_cast<int>(generator() % 4);
    for (int flip = 0; flip < flips; ++flip) bytes[generator() % bytes.size()] = static_cast<char>(generator());
    if (trial % 5 == 0) bytes.resize(generator() % bytes.size());
    const fs::path path = folder / "mutated.safetensors";
    write_bytes(path, bytes);
    try {
      const io::SafetensorsReader reader(path);
      reader.read_all();
    } catch (const Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 100) << "most mutations must be caught";
}

TEST(Safetensors, SaveErrorsLeaveNoFile) {
  TempDir folder;
  const Tensor t = Tensor::zeros({2}, DType::f32);
  EXPECT_GRADSYNC_ERROR(io::save_safetensors(folder / "dup.safetensors", {{"x", t}, {"x", t}}),
                        "duplicate tensor name 'x'");
  EXPECT_GRADSYNC_ERROR(io::save_safetensors(folder / "reserved.safetensors", {{"__metadata__", t}}), "reserved");
  EXPECT_GRADSYNC_ERROR(io::save_safetensors(folder / "empty.safetensors", {{"", t}}), "empty name");
  EXPECT_GRADSYNC_ERROR(io::save_safetensors(folder / "no" / "such" / "dir.safetensors", {{"x", t}}),
                        "cannot save", "dir.safetensors");
  EXPECT_EQ(leftover_files(folder.path()), 0u);
}

TEST(Safetensors, FailedSaveKeepsThePreviousFileIntact) {
  TempDir folder;
  const fs::path path = folder / "checkpoint.safetensors";
  io::save_safetensors(path, {{"w", testing::random_tensor(100, DType::f32, 5)}}, {{"version", "1"}});
  const std::string previous = read_bytes(path);

  // A real write failure midway: limit the size of files this process may write, so the
  // temporary file's writes fail with EFBIG after the first 4 KiB, as on a full disk.
  struct sigaction ignore {};
  struct sigaction saved {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGXFSZ, &ignore, &saved), 0);
  rlimit original_limit{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &original_limit), 0);
  rlimit small_limit = original_limit;
  small_limit.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small_limit), 0);
  bool threw = false;
  std::string message;
  try {
    io::save_safetensors(path, {{"w", testing::random_tensor(1 << 20, DType::f32, 6)}}, {{"version", "2"}});
  } catch (const Error& error) {
    threw = true;
    message = error.what();
  }
  setrlimit(RLIMIT_FSIZE, &original_limit);
  sigaction(SIGXFSZ, &saved, nullptr);

  EXPECT_TRUE(threw) << "a save that cannot write must throw";
  EXPECT_NE(message.find("writing failed"), std::string::npos) << message;
  EXPECT_EQ(read_bytes(path), previous) << "the previous checkpoint must be byte-for-byte intact";
  EXPECT_EQ(io::SafetensorsReader(path).metadata().at("version"), "1");
  EXPECT_EQ(leftover_files(folder.path()), 1u) << "no temporary file may be left behind";
}

TEST(Safetensors, ASaveRemovesTemporariesThatAKilledSaveLeftBehind) {
  TempDir folder;
  const fs::path path = folder / "checkpoint.safetensors";
  // A process that no longer exists: a child that has exited and been reaped.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  const fs::path stale = folder / ("checkpoint.safetensors.tmp-" + std::to_string(child) + "-3");
  const fs::path live = folder / ("checkpoint.safetensors.tmp-" + std::to_string(::getppid()) + "-0");  // a running save elsewhere
  const fs::path other = folder / ("other.safetensors.tmp-" + std::to_string(child) + "-0");           // another target's
  for (const fs::path& leftover : {stale, live, other}) write_bytes(leftover, "partial");
  io::save_safetensors(path, {{"w", Tensor::zeros({2}, DType::f32)}});
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(other));
  EXPECT_TRUE(fs::exists(path));
}

// XXH64 against the reference implementation (python-xxhash 3.x, which wraps libxxhash) on
// lengths that take every path: empty, the 1-, 4- and 8-byte tails, one stripe less one, one,
// and more, with and without a seed; streaming in uneven pieces gives the one-shot digest.
TEST(Checksum, Xxh64MatchesTheReferenceImplementation) {
  std::vector<unsigned char> data(1000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>((i * 7 + 3) % 256);
  const std::vector<std::pair<std::size_t, std::uint64_t>> expected{
      {0, 0xef46db3751d8e999}, {1, 0x1f25c8d0bc1f4bb6},  {3, 0x31d2363f52e564c9},   {4, 0x9bb64b7d66ee9fda},
      {8, 0xdab99d95c6f90092}, {31, 0xa2aa5f33cc4a6119}, {32, 0x23c3c17ef790fd97},  {33, 0x50a7cfc7ba588784},
      {63, 0x5e3e54b431c7493c}, {64, 0x0eb64b3ef6eeb01f}, {100, 0xa61f8d4c170fe531}, {1000, 0x5f235fa033f1a3fb}};
  for (const auto& [size, digest] : expected) {
    EXPECT_EQ(io::xxh64(data.data(), size), digest) << size << " bytes";
    io::Xxh64 streamed;
    for (std::size_t at = 0, piece = 1; at < size; at += piece, piece = piece * 3 % 41 + 1) {
      streamed.update(data.data() + at, std::min(piece, size - at));
    }
    EXPECT_EQ(streamed.digest(), digest) << size << " bytes, streamed";
  }
  EXPECT_EQ(io::xxh64(data.data(), 100, 2654435761u), 0x86f549ede5ac87e2u);
  EXPECT_EQ(io::xxh64("abc", 3), 0x44bc2cf5ad770999u);
  EXPECT_EQ(io::hex_digest(0x0eb64b3ef6eeb01f), "0eb64b3ef6eeb01f");

  TempDir folder;
  write_bytes(folder / "data", std::string(reinterpret_cast<const char*>(data.data()), data.size()));
  const io::FileChecksum file = io::checksum_file(folder / "data");
  EXPECT_EQ(file.bytes, 1000u);
  EXPECT_EQ(file.xxh64, 0x5f235fa033f1a3fbu);
  EXPECT_GRADSYNC_ERROR(io::checksum_file(folder / "absent"), "cannot open", "absent");
}

TEST(Safetensors, FindsEveryTensorOfALargeFileByName) {
  TempDir folder;
  std::vector<io::NamedTensor> many;
  for (int i = 0; i < 20000; ++i) {
    many.push_back({"t" + std::to_string(i), Tensor::from_vector(std::vector<float>{float(i)}, {1})});
  }
  io::save_safetensors(folder / "many.safetensors", many);
  const io::SafetensorsReader reader(folder / "many.safetensors");
  for (int i = 0; i < 20000; i += 997) {
    const io::TensorInfo* info = reader.find("t" + std::to_string(i));
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->name, "t" + std::to_string(i));
    EXPECT_EQ(reader.read(info->name).to_double_vector()[0], i);
  }
  EXPECT_EQ(reader.find("t20000"), nullptr);
}

// ---------------------------------------------------------------------------------------------
// Registry checkpoints

void build_registry(ParameterRegistry& registry) {
  registry.add("encoder.weight", {4, 3});
  registry.add("encoder.bias", {4});
  registry.add("scale", {}, DType::f64);
  registry.add("frozen.table", {2, 2}, DType::bf16, Device::cpu(), /*requires_grad=*/false);
  registry.finalize();
}

TEST(RegistryCheckpoint, RoundTripValuesAndDefinedGradients) {
  TempDir folder;
  ParameterRegistry source;
  build_registry(source);
  std::uint64_t seed = 100;
  for (Parameter& p : source) p.value().copy_from(testing::random_tensor(p.numel(), p.dtype(), seed++).reshape(p.shape()));
  source.at("encoder.weight").set_grad(testing::random_tensor(12, DType::f32, 7).reshape({4, 3}));
  // encoder.bias and scale keep undefined gradients.
  io::save_registry(source, folder / "ckpt.safetensors", {.include_grads = true, .metadata = {{"epoch", "3"}}});

  ParameterRegistry target;
  build_registry(target);
  target.at("scale").set_grad(Tensor::from_vector(std::vector<double>{9}, {}));  // must become undefined
  const io::Metadata metadata =
      io::load_registry(target, folder / "ckpt.safetensors", {.load_grads = true, .allow_extra_tensors = false});
  EXPECT_EQ(metadata.at("epoch"), "3");
  for (const Parameter& p : source) {
    const Parameter& q = target.at(p.name());
    EXPECT_EQ(q.value().to_double_vector(), p.value().to_double_vector()) << p.name();
    EXPECT_EQ(q.grad_defined(), p.grad_defined()) << p.name();
    if (p.grad_defined()) {
      EXPECT_EQ(q.grad().to_double_vector(), p.grad().to_double_vector()) << p.name();
    }
  }

  // Without load_grads, the grad entries are unexpected tensors unless extras are allowed.
  ParameterRegistry values_only;
  build_registry(values_only);
  EXPECT_GRADSYNC_ERROR(io::load_registry(values_only, folder / "ckpt.safetensors"), "'encoder.weight.grad'",
                        "matches no registered parameter");
  io::load_registry(values_only, folder / "ckpt.safetensors", {.load_grads = false, .allow_extra_tensors = true});
  EXPECT_EQ(values_only.at("scale").value().to_double_vector(), source.at("scale").value().to_double_vector());
}

TEST(RegistryCheckpoint, MismatchListsEveryDifferenceAndChangesNothing) {
  TempDir folder;
  ParameterRegistry saved;
  saved.add("encoder.weight", {3, 4});          // transposed shape
  saved.add("encoder.bias", {4}, DType::f64);   // wrong dtype
  saved.add("extra", {1});                      // unknown to the target
  saved.finalize();                             // "scale" and "frozen.table" are missing
  io::save_registry(saved, folder / "other.safetensors");

  ParameterRegistry target;
  build_registry(target);
  ops::fill(target.at("encoder.bias").value(), 5.0);
  try {
    io::load_registry(target, folder / "other.safetensors");
    FAIL() << "a mismatched checkpoint must not load";
  } catch (const Error& error) {
    const std::string message = error.what();
    for (const char* fragment : {"5 differences", "'encoder.weight' has shape [3, 4] in the file, [4, 3] registered",
                                 "'encoder.bias' has dtype f64 in the file, f32 registered",
                                 "'scale' is missing", "'frozen.table' is missing", "'extra' is in the file"}) {
      EXPECT_NE(message.find(fragment), std::string::npos) << "missing \"" << fragment << "\" in:\n" << message;
    }
  }
  EXPECT_EQ(target.at("encoder.bias").value().to_double_vector(), (std::vector<double>{5, 5, 5, 5}))
      << "a failed load leaves the registry unchanged";
}

TEST(RegistryCheckpoint, CorruptCheckpointLeavesRegistryUnchanged) {
  TempDir folder;
  ParameterRegistry registry;
  build_registry(registry);
  io::save_registry(registry, folder / "good.safetensors");
  std::string bytes = read_bytes(folder / "good.safetensors");
  bytes.resize(bytes.size() - 3);  // truncated data
  write_bytes(folder / "bad.safetensors", bytes);
  ops::fill(registry.at("encoder.weight").value(), 2.0);
  EXPECT_GRADSYNC_ERROR(io::load_registry(registry, folder / "bad.safetensors"), "bad.safetensors");
  for (double v : registry.at("encoder.weight").value().to_double_vector()) EXPECT_EQ(v, 2.0);
}

TEST(RegistryCheckpoint, GradientKeyCollisionIsAnError) {
  TempDir folder;
  ParameterRegistry registry;
  registry.add("w", {1});
  registry.add("w.grad", {1});
  registry.finalize();
  registry.at("w").grad_for_overwrite();
  EXPECT_GRADSYNC_ERROR(io::save_registry(registry, folder / "x.safetensors", {.include_grads = true, .metadata = {}}),
                        "'w.grad' is used twice");
  io::save_registry(registry, folder / "x.safetensors");  // without gradients there is no collision
}

}  // namespace
}  // namespace gradsync
