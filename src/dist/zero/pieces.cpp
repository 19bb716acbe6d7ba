// A rank's pieces of a ZeRO state, put back into the optimizer (pieces.h).
#include "pieces.h"

#include <map>

#include <nlohmann/json.hpp>

namespace gradsync::dist {

using json = nlohmann::json;

std::vector<PieceView> views_of(const std::vector<zero_set::Piece>& pieces) {
  std::vector<PieceView> views;
  for (const zero_set::Piece& piece : pieces) {
    const io::SafetensorsReader* file = piece.file.get();
    views.push_back({&file->metadata(), file->path().string(), piece.ranges,
                     [file](const std::string& key) { return file->read(key); }});
  }
  return views;
}

void assemble(const optim::Optimizer& optimizer, const ShardLayout& layout, const std::vector<PieceView>& pieces,
              std::vector<io::NamedTensor>& tensors, io::Metadata& metadata) {
  const io::Metadata& first = *pieces.front().metadata;
  for (const char* key : {"optimizer.type", "optimizer.groups", "optimizer.steps"}) metadata[key] = first.at(key);
  const json present = json::parse(first.at("zero.present"), nullptr, /*allow_exceptions=*/false);
  GRADSYNC_CHECK(present.is_object(), pieces.front().where, ": 'zero.present' is not a JSON object");
  const auto& names = optimizer.state_buffer_names();
  std::map<std::pair<std::size_t, std::size_t>, std::map<std::size_t, Tensor>> buffers;  // (piece, arena) -> buffer -> data
  json elsewhere = json::object();
  for (const Parameter& parameter : optimizer.registry()) {
    if (!parameter.requires_grad() || !present.contains(parameter.name())) continue;
    const json& bits_value = present[parameter.name()];
    GRADSYNC_CHECK(bits_value.is_number_unsigned() && bits_value.get<std::uint64_t>() < (std::uint64_t{1} << names.size()),
                   pieces.front().where, ": 'zero.present' of '", parameter.name(),
                   "' is not a set of ", names.size(), " buffers");
    const auto bits = bits_value.get<std::uint32_t>();
    const auto p_begin = static_cast<std::int64_t>(parameter.arena_offset());
    const std::int64_t p_end = p_begin + parameter.numel();
    bool mine = false;
    for (const auto& range : layout.ranges.at(parameter.arena_index())) mine = mine || (range.begin < p_end && p_begin < range.end);
    if (!mine) {
      elsewhere[parameter.name()] = bits;
      continue;
    }
    const DType dtype = optimizer.state_dtype(parameter.arena_index());
    for (std::size_t b = 0; b < names.size(); ++b) {
      if (!(bits & (1u << b))) continue;
      Tensor whole = Tensor::zeros({parameter.numel()}, dtype);
      for (std::size_t k = 0; k < pieces.size(); ++k) {
        for (const zero_set::PieceRange& piece : pieces[k].ranges) {
          if (piece.arena != parameter.arena_index()) continue;
          const std::int64_t lo = std::max(piece.begin, p_begin), hi = std::min(piece.end, p_end);
          if (lo >= hi) continue;
          Tensor& data = buffers[{k, piece.arena}][b];
          if (!data.defined()) data = pieces[k].read(zero_set::shard_key(piece.arena, b));
          Tensor target = whole.view(static_cast<std::size_t>(lo - p_begin), {hi - lo});
          target.copy_from(data.view(static_cast<std::size_t>(piece.packed + (lo - piece.begin)), {hi - lo}));
        }
      }
      tensors.push_back({"optimizer.state." + parameter.name() + "." + names[b], whole.view(0, parameter.shape())});
    }
  }
  metadata["optimizer.present_elsewhere"] = elsewhere.dump();
}

Tensor owned_values(const optim::Optimizer& optimizer, const ShardLayout& layout, std::size_t arena) {
  const Arena& source = optimizer.registry().arenas()[arena];
  std::int64_t count = 0;
  for (const auto& range : layout.ranges[arena]) count += range.end - range.begin;
  Tensor packed = Tensor::empty({count}, source.dtype);
  std::int64_t at = 0;
  for (const auto& range : layout.ranges[arena]) {
    packed.view(static_cast<std::size_t>(at), {range.end - range.begin})
        .copy_from(source.values.view(static_cast<std::size_t>(range.begin), {range.end - range.begin}));
    at += range.end - range.begin;
  }
  return packed;
}

std::vector<ValuesRun> read_values(const ShardLayout& layout, const std::vector<PieceView>& pieces) {
  std::vector<ValuesRun> runs;
  for (const PieceView& piece : pieces) {
    std::map<std::size_t, Tensor> saved;  // arena -> the piece's packed values, read once
    for (const zero_set::PieceRange& range : piece.ranges) {
      const auto take = [&](std::int64_t lo, std::int64_t hi) {
        if (lo >= hi) return;
        Tensor& data = saved[range.arena];
        if (!data.defined()) data = piece.read(zero_set::values_key(range.arena));
        runs.push_back({range.arena, lo, data.view(static_cast<std::size_t>(range.packed + (lo - range.begin)), {hi - lo})});
      };
      if (layout.stage < 3) {
        take(range.begin, range.end);
        continue;
      }
      for (const auto& mine : layout.ranges[range.arena]) take(std::max(range.begin, mine.begin), std::min(range.end, mine.end));
    }
  }
  return runs;
}

void apply_values(optim::Optimizer& optimizer, const std::vector<ValuesRun>& runs) {
  for (const ValuesRun& run : runs) {
    optimizer.registry().arenas()[run.arena].values.view(static_cast<std::size_t>(run.begin), {run.data.numel()}).copy_from(run.data);
  }
}


std::string presence_of(const optim::Optimizer& optimizer) {
  json present = json::object();
  for (const Parameter& parameter : optimizer.registry()) {
    if (!parameter.requires_grad()) continue;
    try {
      if (const std::uint32_t bits = optimizer.state_presence(parameter)) present[parameter.name()] = bits;
    } catch (const Error&) {  // not optimized by this optimizer
    }
  }
  return present.dump();
}

namespace {

const std::string kFrozen = "zero.frozen.";  // + a frozen parameter's name: its whole values

std::string ranges_text(const ShardLayout& layout) {
  json list = json::array();
  for (std::size_t a = 0; a < layout.ranges.size(); ++a) {
    for (const auto& range : layout.ranges[a]) list.push_back({a, range.begin, range.end});
  }
  return list.dump();
}

}  // namespace

ZeroOptimizer::State own_pieces(const optim::Optimizer& optimizer, const ShardLayout& layout) {
  ZeroOptimizer::State pieces;
  const std::size_t buffers = optimizer.state_buffer_names().size();
  for (std::size_t a = 0; a < layout.ranges.size(); ++a) {
    if (layout.ranges[a].empty()) continue;
    for (std::size_t b = 0; b < buffers; ++b) {
      const Tensor mine = optimizer.shard_state(a, b);
      if (mine.defined() && mine.numel() > 0) pieces.tensors.push_back({zero_set::shard_key(a, b), mine});
    }
    pieces.tensors.push_back({zero_set::values_key(a), owned_values(optimizer, layout, a)});
  }
  // Frozen parameters are never sharded (whole on every rank): each rank sends them whole, so
  // that a newcomer holds the same values there too.
  for (const Parameter& parameter : optimizer.registry()) {
    if (!parameter.requires_grad()) pieces.tensors.push_back({kFrozen + parameter.name(), parameter.value().clone()});
  }
  pieces.metadata = optimizer.state_metadata();
  pieces.metadata["zero.stage"] = std::to_string(layout.stage);
  pieces.metadata["zero.ranges"] = ranges_text(layout);
  pieces.metadata["zero.present"] = presence_of(optimizer);
  return pieces;
}

CheckedPieces check_pieces(const optim::Optimizer& optimizer, const ShardLayout& layout, const ZeroOptimizer::State& pieces,
                           const std::string& origin) {
  const io::Metadata& metadata = pieces.metadata;
  const auto entry = [&](const char* key) {
    const auto found = metadata.find(key);
    GRADSYNC_CHECK(found != metadata.end(), origin, ": no '", key, "' (not a rank's ZeRO pieces)");
    return found->second;
  };
  // The same cut: the peer is the rank at this rank's place of a replica with the same layout.
  GRADSYNC_CHECK(entry("zero.stage") == std::to_string(layout.stage), origin, ": pieces of ZeRO stage ",
                 entry("zero.stage").substr(0, 8), ", this rank runs stage ", layout.stage);
  GRADSYNC_CHECK(entry("zero.ranges") == ranges_text(layout), origin, ": the pieces cover other element ranges than ",
                 "this rank's (a peer cut otherwise: another group size, other buckets, another place)");
  for (const char* key : {"optimizer.type", "optimizer.groups", "optimizer.steps"}) entry(key);
  // Every tensor one of this rank's: a state buffer or the values of its ranges, of their size.
  PieceView view{&metadata, origin, {}, nullptr};
  std::map<std::string, Tensor> by_key;
  std::map<std::size_t, std::int64_t> count;
  for (std::size_t a = 0; a < layout.ranges.size(); ++a) {
    for (const auto& range : layout.ranges[a]) {
      view.ranges.push_back({a, range.begin, range.end, count[a]});
      count[a] += range.end - range.begin;
    }
  }
  const auto& arenas = optimizer.registry().arenas();
  const std::size_t buffers = optimizer.state_buffer_names().size();
  CheckedPieces checked;
  for (const io::NamedTensor& tensor : pieces.tensors) {
    if (tensor.name.starts_with(kFrozen)) {
      const std::string name = tensor.name.substr(kFrozen.size());
      const Parameter* frozen = optimizer.registry().find(name);
      GRADSYNC_CHECK(frozen != nullptr && !frozen->requires_grad(), origin, ": '", tensor.name.substr(0, 64),
                     "' is not a frozen parameter of this model");
      GRADSYNC_CHECK(tensor.tensor.dtype() == frozen->dtype() && tensor.tensor.shape() == frozen->shape(), origin, ": '",
                     tensor.name, "' is ", dtype_name(tensor.tensor.dtype()), shape_str(tensor.tensor.shape()),
                     ", the parameter is ", dtype_name(frozen->dtype()), shape_str(frozen->shape()));
      GRADSYNC_CHECK(by_key.emplace(tensor.name, tensor.tensor).second, origin, ": '", tensor.name, "' twice");
      checked.frozen.push_back({name, tensor.tensor});
      continue;
    }
    bool known = false;
    for (const auto& [a, elements] : count) {
      const bool values = tensor.name == zero_set::values_key(a);
      std::size_t buffer = buffers;
      for (std::size_t b = 0; b < buffers; ++b) buffer = tensor.name == zero_set::shard_key(a, b) ? b : buffer;
      if (!values && buffer == buffers) continue;
      const DType dtype = values ? arenas[a].dtype : optimizer.state_dtype(a);
      GRADSYNC_CHECK(tensor.tensor.dtype() == dtype && tensor.tensor.shape() == Shape{elements}, origin, ": '", tensor.name,
                     "' is ", dtype_name(tensor.tensor.dtype()), shape_str(tensor.tensor.shape()), ", this rank's ranges need ",
                     dtype_name(dtype), shape_str(Shape{elements}));
      GRADSYNC_CHECK(by_key.emplace(tensor.name, tensor.tensor).second, origin, ": '", tensor.name, "' twice");
      known = true;
    }
    GRADSYNC_CHECK(known, origin, ": '", tensor.name.substr(0, 64), "' is not a state buffer or the values of this rank's ranges");
  }
  for (const Parameter& parameter : optimizer.registry()) {
    GRADSYNC_CHECK(parameter.requires_grad() || by_key.contains(kFrozen + parameter.name()), origin, ": no '", kFrozen,
                   parameter.name(), "' (a frozen parameter's values)");
  }
  for (const auto& [a, elements] : count) {
    GRADSYNC_CHECK(by_key.contains(zero_set::values_key(a)), origin, ": no '", zero_set::values_key(a), "' (the values of ",
                   "this rank's ranges)");
  }
  view.read = [&](const std::string& key) {
    const auto found = by_key.find(key);
    GRADSYNC_CHECK(found != by_key.end(), origin, ": no '", key, "', which 'zero.present' says exists");
    return found->second;
  };
  const std::vector<PieceView> views{view};
  ShardLayout stage3 = layout;
  stage3.stage = 3;  // the pieces carry only this rank's values, at every stage
  assemble(optimizer, layout, views, checked.tensors, checked.metadata);
  optimizer.check_state(checked.tensors, checked.metadata, origin);
  checked.values = read_values(stage3, views);
  return checked;
}

void adopt_pieces(optim::Optimizer& optimizer, const CheckedPieces& pieces, const std::string& origin) {
  optimizer.load_state(pieces.tensors, pieces.metadata, origin);
  apply_values(optimizer, pieces.values);
  for (const auto& [name, values] : pieces.frozen) optimizer.registry().at(name).value().copy_from(values);
}

}  // namespace gradsync::dist
