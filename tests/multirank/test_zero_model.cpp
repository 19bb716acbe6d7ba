// Models that never exist whole (dist/zero.h's initialize / load_model / save_model,
// io/safetensors_piece_writer.h), on Gloo ranks-as-threads: initialization by pieces equals
// initializing whole and sharding, bit for bit, at worlds 1-5; a consolidated file written in
// parallel is byte for byte the one a single process writes (save_safetensors); a model read by
// ranges from a set of files with an index equals the whole; damaged or inconsistent files are
// errors on every rank, and nothing changes; a save that fails leaves the previous file.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <numbers>

#include <nlohmann/json.hpp>

#include "expectations.h"
#include "gradsync/comm/gloo/gloo.h"
#include "gradsync/dist/data_parallel/data_parallel.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/io/checksum.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/io/safetensors_piece_writer.h"
#include "gradsync/optim/sgd.h"
#include "test_util.h"

namespace gradsync {
namespace {

using comm::Communicator;
using testing::TempDir;

// Units of awkward sizes (so pieces cut parameters anywhere), a frozen buffer between them, and
// a head: declared, never initialized here.
struct Declared {
  ParameterRegistry registry;
  std::vector<std::vector<Parameter*>> units;
  explicit Declared(DType dtype = DType::f32, std::int64_t width = 23) {
    for (int b = 0; b < 3; ++b) {
      units.push_back({&registry.add("blocks." + std::to_string(b) + ".weight", {37 + 5 * b, width}, dtype),
                       &registry.add("blocks." + std::to_string(b) + ".bias", {37 + 5 * b}, dtype)});
      if (b == 1) registry.add("blocks.1.rotary", {29}, dtype, Device::cpu(), /*requires_grad=*/false);
    }
    units.push_back({&registry.add("head.weight", {11, width}, dtype)});
    registry.finalize();
  }
};

init::Rule rule_of(const Parameter& p) {
  if (p.name().ends_with(".bias")) return init::zeros();
  if (p.name().ends_with(".rotary")) return init::from_index([](std::int64_t i) { return std::cos(0.1 * static_cast<double>(i)); });
  if (p.name() == "head.weight") return init::uniform(-0.2, 0.2);
  return init::normal(0.0, 0.02);
}
constexpr std::uint64_t kSeed = 1234;

// The DataParallel and ZeroOptimizer over a declared model, never broadcasting its values.
struct Sharded {
  Declared model;
  optim::SGD sgd;
  dist::DataParallel ddp;
  dist::ZeroOptimizer zero;
  static dist::DataParallelOptions options(const Declared& model, int stage) {
    dist::DataParallelOptions options{.bucket_cap_mb = 1e-6, .broadcast_parameters = false, .shard_gradients = stage >= 2};
    if (stage == 3) options.units = model.units;
    return options;
  }
  Sharded(Communicator& comm, int stage, DType dtype = DType::f32, std::int64_t width = 23)
      : model(dtype, width), sgd(model.registry, optim::SGD::Options{.lr = 0.1}), ddp(model.registry, comm, options(model, stage)),
        zero(sgd, ddp, {.stage = stage}) {}
};

// What one process writes for the whole model: save_safetensors with the checksums.
std::vector<io::NamedTensor> whole_model() {
  Declared model;
  std::vector<io::NamedTensor> tensors;
  for (Parameter& p : model.registry) {
    init::initialize(p, rule_of(p), kSeed);
    Tensor copy = Tensor::empty(p.shape(), p.dtype());
    copy.copy_from(p.value());
    tensors.push_back({p.name(), copy});
  }
  return tensors;
}

io::Metadata checksums_of(const std::vector<io::NamedTensor>& tensors, io::Metadata metadata = {}) {
  nlohmann::json sums = nlohmann::json::object();
  for (const io::NamedTensor& t : tensors) sums[t.name] = io::hex_digest(io::piece_checksum(t.name, 0, t.tensor));
  metadata["gradsync.checksums"] = sums.dump();
  return metadata;
}

std::string bytes_of(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>()};
}

std::size_t files_in(const std::filesystem::path& folder) {
  return static_cast<std::size_t>(std::distance(std::filesystem::directory_iterator(folder), {}));
}

TEST(ZeroModel, PiecesInitializeAndSaveAsTheWholeModelAtEveryWorldSize) {
  TempDir folder;
  const auto reference = folder / "reference.safetensors";
  const std::vector<io::NamedTensor> whole = whole_model();
  io::save_safetensors(reference, whole, checksums_of(whole, {{"format", "pt"}}));
  const std::string expected = bytes_of(reference);
  std::uint64_t expected_checksum = 0;
  for (const io::NamedTensor& t : whole) expected_checksum += io::piece_checksum(t.name, 0, t.tensor);
  std::size_t written = 1;
  for (const int stage : {3, 1, 2}) {
    for (int world = 1; world <= 5; ++world) {
      if (stage != 3 && world != 3) continue;
      const auto path = folder / ("stage" + std::to_string(stage) + "-world" + std::to_string(world) + ".safetensors");
      comm::run_gloo_thread_group(world, [&](Communicator& comm) {
        Sharded run(comm, stage);
        const Tensor& values = run.model.registry.arenas()[0].values;
        run.zero.initialize(rule_of, kSeed);
        if (stage == 3 && world > 1) {
          // Only this rank's pieces were written: the rest of the value arena was never touched.
          // Each unit's piece may share two pages with its neighbours (zeroed at release), and the frozen
    // buffer takes up to two pages of its own.
    const std::int64_t slack = 2 * 4096 * static_cast<std::int64_t>(run.model.units.size() + 2);
          EXPECT_LE(testing::resident_bytes(values), values.nbytes() / world + slack) << "rank " << comm.rank();
        }
        EXPECT_EQ(run.zero.model_checksum(), expected_checksum) << "rank " << comm.rank();
        run.zero.save_model(path, {{"format", "pt"}});
      });
      EXPECT_EQ(bytes_of(path), expected) << "stage " << stage << ", " << world << " rank(s)";
      EXPECT_EQ(files_in(folder.path()), ++written) << "no temporary left behind";
    }
  }
}

// Made with broadcast_parameters = false, a stage-3 model is never whole on a rank: after
// construction, initialization, a save and a load, a rank's value arena holds its pieces (resident
// pages, counted by mincore), where DataParallel's broadcast of rank 0's values writes all of it.
TEST(ZeroModel, AStageThreeModelIsNeverWholeOnARank) {
  TempDir folder;
  comm::run_gloo_thread_group(4, [&](Communicator& comm) {
    const std::int64_t width = 2048;  // about 1.1 MiB of values: 4 KiB pages (huge pages start at 4 MiB)
    {
      Declared model(DType::f32, width);
      dist::DataParallelOptions options{.shard_gradients = true};
      options.units = model.units;
      dist::DataParallel ddp(model.registry, comm, options);
      const Tensor& values = model.registry.arenas()[0].values;
      EXPECT_GE(testing::resident_bytes(values), values.nbytes() - 2 * 4096) << "the broadcast writes every page";
    }
    Sharded run(comm, 3, DType::f32, width);
    const Tensor& values = run.model.registry.arenas()[0].values;
    const std::int64_t piece = values.nbytes() / comm.size();
    // Each unit's piece may share two pages with its neighbours (zeroed at release), and the frozen
    // buffer takes up to two pages of its own.
    const std::int64_t slack = 2 * 4096 * static_cast<std::int64_t>(run.model.units.size() + 2);
    EXPECT_LE(testing::resident_bytes(values), slack) << "constructed";
    run.zero.initialize(rule_of, kSeed);
    EXPECT_LE(testing::resident_bytes(values), piece + slack) << "initialized";
    run.zero.save_model(folder / "model.safetensors");
    EXPECT_LE(testing::resident_bytes(values), piece + slack) << "saved";
    run.zero.load_model(folder / "model.safetensors");
    EXPECT_LE(testing::resident_bytes(values), piece + slack) << "loaded";
    EXPECT_GE(testing::resident_bytes(values), piece - slack) << "the pieces are there";
  });
}

// The whole model cut into two files with an index, in `dtype`.
std::filesystem::path write_set(const std::filesystem::path& folder, const std::vector<io::NamedTensor>& whole, DType dtype,
                                bool with_checksums) {
  std::vector<io::NamedTensor> parts[2];
  std::string map;
  for (std::size_t k = 0; k < whole.size(); ++k) {
    parts[k % 2].push_back({whole[k].name, whole[k].tensor.to(dtype)});
    map += std::string(map.empty() ? "" : ", ") + "\"" + whole[k].name + "\": \"part-" + std::to_string(k % 2) + ".safetensors\"";
  }
  for (int f = 0; f < 2; ++f) {
    io::save_safetensors(folder / ("part-" + std::to_string(f) + ".safetensors"), parts[f],
                         with_checksums ? checksums_of(parts[f]) : io::Metadata{});
  }
  std::ofstream(folder / "model.safetensors.index.json") << "{\"metadata\": {}, \"weight_map\": {" << map << "}}";
  return folder / "model.safetensors.index.json";
}

TEST(ZeroModel, RangesFromASetWithAnIndexLoadAsTheWhole) {
  TempDir folder;
  const std::vector<io::NamedTensor> whole = whole_model();
  const auto index = write_set(folder.path(), whole, DType::f32, false);
  const auto reference = folder / "reference.safetensors";
  io::save_safetensors(reference, whole, checksums_of(whole));
  // A bf16 set loads into f32 parameters, each value the bf16 one widened.
  TempDir bf16_folder;
  const auto bf16_index = write_set(bf16_folder.path(), whole, DType::bf16, false);
  std::vector<io::NamedTensor> widened;
  for (const io::NamedTensor& t : whole) widened.push_back({t.name, t.tensor.to(DType::bf16).to(DType::f32)});
  const auto bf16_reference = folder / "bf16-reference.safetensors";
  io::save_safetensors(bf16_reference, widened, checksums_of(widened));
  for (const auto& [world, stage] : std::vector<std::pair<int, int>>{{3, 3}, {4, 3}, {2, 1}, {1, 3}}) {
    const std::string label = std::to_string(world) + " rank(s), stage " + std::to_string(stage);
    comm::run_gloo_thread_group(world, [&](Communicator& comm) {
      Sharded run(comm, stage);
      run.zero.load_model(index);
      run.zero.save_model(folder / "loaded.safetensors");
      run.zero.load_model(bf16_index);
      run.zero.save_model(folder / "loaded-bf16.safetensors");
    });
    EXPECT_EQ(bytes_of(folder / "loaded.safetensors"), bytes_of(reference)) << label;
    EXPECT_EQ(bytes_of(folder / "loaded-bf16.safetensors"), bytes_of(bf16_reference)) << label;
  }
  // Saved at 4 ranks (stage 3), reloaded at 3 and 1: the file carries its checksums, verified.
  comm::run_gloo_thread_group(3, [&](Communicator& comm) {
    Sharded run(comm, 3);
    run.zero.load_model(reference);
    EXPECT_EQ(run.zero.model_checksum(), run.zero.model_checksum());
    run.zero.save_model(folder / "again.safetensors");
  });
  EXPECT_EQ(bytes_of(folder / "again.safetensors"), bytes_of(reference));
}

// Damaged and inconsistent files: an error on every rank naming the fault, and no value changes.
TEST(ZeroModel, DamagedOrInconsistentFilesAreErrorsEverywhereAndNothingChanges) {
  TempDir folder;
  const std::vector<io::NamedTensor> whole = whole_model();
  const auto good = folder / "good.safetensors";
  io::save_safetensors(good, whole, checksums_of(whole));
  const std::string good_bytes = bytes_of(good);
  const auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(folder / name, std::ios::binary | std::ios::trunc) << bytes;
    return folder / name;
  };
  // A flipped bit in the data of the last tensor in the file.
  std::string flipped = good_bytes;
  flipped[flipped.size() - 3] ^= 0x10;
  const auto damaged = write("flipped.safetensors", flipped);
  const auto truncated = write("truncated.safetensors", good_bytes.substr(0, good_bytes.size() - 100));
  TempDir set_folder;
  const auto index = write_set(set_folder.path(), whole, DType::f32, true);
  const auto missing_part = folder / "missing" / "model.safetensors.index.json";
  std::filesystem::create_directories(missing_part.parent_path());
  std::filesystem::copy_file(index, missing_part);
  std::filesystem::copy_file(set_folder / "part-0.safetensors", missing_part.parent_path() / "part-0.safetensors");
  const auto twice = write("twice.index.json", "{\"weight_map\": {\"head.weight\": \"a.safetensors\", \"head.weight\": \"b.safetensors\"}}");
  std::vector<io::NamedTensor> reshaped = whole;
  reshaped.back() = {reshaped.back().name, Tensor::zeros({23, 11}, DType::f32)};
  const auto wrong_shape = folder / "reshaped.safetensors";
  io::save_safetensors(wrong_shape, reshaped);
  std::vector<io::NamedTensor> narrow;
  for (const io::NamedTensor& t : whole) narrow.push_back({t.name, t.tensor.to(DType::bf16)});
  const auto bf16 = folder / "bf16.safetensors";
  io::save_safetensors(bf16, narrow);
  std::vector<io::NamedTensor> fewer(whole.begin(), whole.end() - 1);
  const auto without_head = folder / "fewer.safetensors";
  io::save_safetensors(without_head, fewer);

  comm::run_gloo_thread_group(3, [&](Communicator& comm) {
    Sharded run(comm, 3);
    run.zero.initialize([](const Parameter&) { return init::constant(0.5); }, 1);
    const std::uint64_t before = run.zero.model_checksum();
    const auto unchanged = [&](const std::string& what) {
      EXPECT_EQ(run.zero.model_checksum(), before) << what << ": rank " << comm.rank() << "'s values changed";
    };
    EXPECT_GRADSYNC_ERROR(run.zero.load_model(damaged), "flipped.safetensors", "is damaged", "nothing was loaded");
    unchanged("a flipped bit");
    EXPECT_GRADSYNC_ERROR(run.zero.load_model(truncated), "truncated.safetensors");
    unchanged("a truncated file");
    EXPECT_GRADSYNC_ERROR(run.zero.load_model(missing_part), "part-1.safetensors");
    unchanged("a missing file of a set");
    EXPECT_GRADSYNC_ERROR(run.zero.load_model(twice), "twice.index.json", "head.weight");
    unchanged("an index naming a tensor twice");
    EXPECT_GRADSYNC_ERROR(run.zero.load_model(wrong_shape), "head.weight", "[23, 11]", "[11, 23]");
    unchanged("a tensor of another shape");
    EXPECT_GRADSYNC_ERROR(run.zero.load_model(without_head), "has no tensor 'head.weight'");
    unchanged("a missing tensor");
    // The ranks must read the same model: rank 1 pointed at another file (the same tensors, bf16).
    EXPECT_GRADSYNC_ERROR(run.zero.load_model(comm.rank() == 1 ? bf16 : good), "model file entries", "BF16", "F32",
                          "rank 1");
    unchanged("ranks reading different files");
    run.zero.load_model(good);
    EXPECT_NE(run.zero.model_checksum(), before);
  });
}

// A peer's pieces (fault tolerance's recovery by pieces): each rank takes its own pieces of model
// A, the model becomes B, and adopting the pieces brings A back on every rank, at stage 1 (the
// values gathered after) and 3. Pieces that do not fit this rank's layout are refused on every
// rank, naming what is wrong, with nothing changed: other ranges, another stage, a tensor of
// another size, a missing or a foreign tensor, a frozen parameter missing, each on rank 0 only.
TEST(ZeroModel, APeersPiecesAreAdoptedWholeOrNotAtAll) {
  for (const int stage : {1, 3}) {
    comm::run_gloo_thread_group(2, [&](Communicator& comm) {
      Sharded run(comm, stage);
      run.zero.initialize(rule_of, kSeed);
      const std::uint64_t model_a = run.zero.model_checksum();
      const dist::ZeroOptimizer::State pieces = run.zero.own_pieces();
      std::int64_t bytes = 0;
      for (const io::NamedTensor& t : pieces.tensors) bytes += static_cast<std::int64_t>(t.tensor.nbytes());
      EXPECT_LT(bytes, run.model.registry.total_numel() * 4 * 3 / 4) << "rank " << comm.rank() << ": about half, not all";
      run.zero.initialize([](const Parameter&) { return init::constant(0.5); }, 1);
      const std::uint64_t model_b = run.zero.model_checksum();
      ASSERT_NE(model_a, model_b);
      const auto values_of = [](dist::ZeroOptimizer::State& p) -> io::NamedTensor& {
        for (io::NamedTensor& t : p.tensors) {
          if (t.name == "zero.values.0") return t;
        }
        throw Error("no zero.values.0 among the pieces");
      };
      const auto damaged = [&](const std::function<void(dist::ZeroOptimizer::State&)>& damage) {
        dist::ZeroOptimizer::State copy = pieces;
        if (comm.rank() == 0) damage(copy);
        return copy;
      };
      const auto unchanged = [&](const std::string& what) {
        EXPECT_EQ(run.zero.model_checksum(), model_b) << "stage " << stage << ", " << what << ": rank " << comm.rank()
                                                      << "'s values changed";
      };
      const std::string origin = "group 0's pieces";
      EXPECT_GRADSYNC_ERROR(run.zero.adopt_pieces(damaged([](auto& p) { p.metadata["zero.ranges"] = "[[0,0,1]]"; }), origin),
                            "group 0's pieces", "other element ranges");
      unchanged("other ranges");
      EXPECT_GRADSYNC_ERROR(run.zero.adopt_pieces(damaged([](auto& p) { p.metadata["zero.stage"] = "2"; }), origin),
                            "pieces of ZeRO stage 2");
      unchanged("another stage");
      EXPECT_GRADSYNC_ERROR(
          run.zero.adopt_pieces(damaged([&](auto& p) { values_of(p).tensor = Tensor::zeros({3}, DType::f32); }), origin),
          "zero.values.0", "[3]");
      unchanged("a tensor of another size");
      EXPECT_GRADSYNC_ERROR(run.zero.adopt_pieces(damaged([&](auto& p) { values_of(p).name = "zero.shard.0.7"; }), origin),
                            "'zero.shard.0.7' is not a state buffer");
      unchanged("a foreign name");
      EXPECT_GRADSYNC_ERROR(run.zero.adopt_pieces(damaged([&](auto& p) {
                                                    p.tensors.erase(p.tensors.begin() + (&values_of(p) - p.tensors.data()));
                                                  }),
                                                  origin),
                            "no 'zero.values.0'");
      unchanged("a missing tensor");
      EXPECT_GRADSYNC_ERROR(
          run.zero.adopt_pieces(damaged([](auto& p) { p.tensors.push_back({"zero.values.99", Tensor::zeros({1}, DType::f32)}); }),
                                origin),
          "'zero.values.99' is not a state buffer or the values of this rank's ranges");
      unchanged("a foreign tensor");
      EXPECT_GRADSYNC_ERROR(run.zero.adopt_pieces(damaged([](auto& p) {
                                                    std::erase_if(p.tensors, [](const io::NamedTensor& t) {
                                                      return t.name == "zero.frozen.blocks.1.rotary";
                                                    });
                                                  }),
                                                  origin),
                            "no 'zero.frozen.blocks.1.rotary' (a frozen parameter's values)");
      unchanged("a frozen parameter missing");
      run.zero.adopt_pieces(pieces, origin);
      EXPECT_EQ(run.zero.model_checksum(), model_a) << "stage " << stage << ", rank " << comm.rank();
      if (stage == 1) {  // the values whole again on every rank: rank 0's equal rank 1's
        std::vector<double> mine;
        for (Parameter& p : run.model.registry) {
          for (const double v : p.value().to_double_vector()) mine.push_back(v);
        }
        Tensor high = Tensor::from_vector(mine, {static_cast<std::int64_t>(mine.size())});
        Tensor low = high.clone();
        comm.allreduce_host(high, comm::ReduceOp::max);
        comm.allreduce_host(low, comm::ReduceOp::min);
        EXPECT_EQ(high.to_double_vector(), low.to_double_vector());
      }
    });
  }
}

// A save that fails leaves the previous file as it was and no temporary behind; ranks that would
// write different headers are refused before anything is written.
TEST(ZeroModel, AFailedSaveLeavesThePreviousFile) {
  TempDir folder;
  const auto path = folder / "model.safetensors";
  std::string previous;
  comm::run_gloo_thread_group(2, [&](Communicator& comm) {
    Sharded run(comm, 3);
    run.zero.initialize(rule_of, kSeed);
    run.zero.save_model(path);
    if (comm.rank() == 0) previous = bytes_of(path);
    comm.barrier();
    run.zero.initialize([](const Parameter&) { return init::ones(); }, 0);
    EXPECT_GRADSYNC_ERROR(run.zero.save_model(path, {{"note", "rank " + std::to_string(comm.rank())}}), "save_model",
                          "metadata");
    EXPECT_GRADSYNC_ERROR(run.zero.save_model(path, {{"gradsync.checksums", "{}"}}), "gradsync's own");
  });
  EXPECT_EQ(bytes_of(path), previous);
  EXPECT_EQ(files_in(folder.path()), 1u);

  // The writer itself: a creator gone before commit() takes its temporary with it, whatever the
  // others wrote into it; after commit() the file is the one save_safetensors writes.
  const std::vector<io::NamedTensor> tensors{{"a", Tensor::from_vector(std::vector<float>{1, 2, 3, 4, 5}, {5})},
                                             {"b", Tensor::from_vector(std::vector<double>{6, 7}, {2})}};
  const std::vector<io::TensorSpec> specs{{"a", DType::f32, {5}}, {"b", DType::f64, {2}}};
  {
    io::SafetensorsPieceWriter creator(path, specs);
    io::SafetensorsPieceWriter other(path, specs);
    other.open(creator.create());
    other.write("a", 2, tensors[0].tensor.view(2, {3}));
    other.flush();
    EXPECT_GRADSYNC_ERROR(other.write("b", 1, tensors[1].tensor), "outside 'b'");
    EXPECT_GRADSYNC_ERROR(creator.write("a", 0, tensors[1].tensor), "f64", "f32");
    EXPECT_GRADSYNC_ERROR(creator.write("c", 0, tensors[1].tensor), "'c' is not in its header");
  }
  EXPECT_EQ(bytes_of(path), previous);
  EXPECT_EQ(files_in(folder.path()), 1u);
  {
    io::SafetensorsPieceWriter creator(path, specs);
    io::SafetensorsPieceWriter other(path, specs);
    other.open(creator.create());
    creator.write("a", 0, tensors[0].tensor.view(0, {2}));
    other.write("a", 2, tensors[0].tensor.view(2, {3}));
    other.write("b", 0, tensors[1].tensor);
    other.flush();
    creator.flush();
    creator.commit();
  }
  io::save_safetensors(folder / "single.safetensors", tensors);
  EXPECT_EQ(bytes_of(path), bytes_of(folder / "single.safetensors"));
}

}  // namespace
}  // namespace gradsync
