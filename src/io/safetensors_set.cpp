// A model in several safetensors files with an index (gradsync/io/safetensors_set.h).
#include "gradsync/io/safetensors_set.h"

#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "json_brief.h"
#include "readable_file.h"

namespace gradsync::io {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// The index's JSON, refusing a tensor named twice in its weight_map (JSON allows the repeat, and
// a parser keeps only one of them: which file holds that tensor would be a guess).
json parse_index(const fs::path& path) {
  // Opened once, only a regular file, its size capped before and while it is read (an index
  // linked to /dev/zero was read whole first).
  const std::string text =
      ReadableFile(path, "safetensors index '" + path.string() + "'").read_all(SafetensorsReader::kMaxHeaderBytes);
  std::string top_key;
  std::set<std::string> mapped;
  std::string repeated;
  const json::parser_callback_t callback = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && parsed.is_string()) {
      if (depth == 1) top_key = parsed.get<std::string>();
      if (depth == 2 && top_key == "weight_map" && !mapped.insert(parsed.get<std::string>()).second && repeated.empty()) {
        repeated = parsed.get<std::string>();
      }
    }
    return true;
  };
  json index = json::parse(text, callback, /*allow_exceptions=*/false);
  GRADSYNC_CHECK(!index.is_discarded() && index.is_object(), "safetensors index '", path.string(),
                 "' is not a JSON object");
  GRADSYNC_CHECK(repeated.empty(), "safetensors index '", path.string(), "' names tensor '", repeated,
                 "' twice in its weight_map");
  return index;
}

}  // namespace

SafetensorsSet::SafetensorsSet(const fs::path& path) : path_(path) {
  if (path.extension() != ".json") {  // one file
    files_.push_back(std::make_unique<SafetensorsReader>(path));
    metadata_ = files_.front()->metadata();
    for (const TensorInfo& info : files_.front()->tensors()) owner_.emplace(info.name, 0);
    return;
  }
  const json index = parse_index(path);
  const auto where = [&] { return "safetensors index '" + path.string() + "'"; };
  const auto map = index.find("weight_map");
  GRADSYNC_CHECK(map != index.end() && map->is_object() && !map->empty(), where(),
                 " has no weight_map (an object of tensor name -> file)");
  if (const auto meta = index.find("metadata"); meta != index.end()) {
    GRADSYNC_CHECK(meta->is_object(), where(), ": 'metadata' is ", brief(*meta), ", not an object");
    for (const auto& [key, value] : meta->items()) {
      metadata_[key] = value.is_string() ? value.get<std::string>() : value.is_number() ? value.dump() : brief(value);
    }
  }
  // The files, each opened (and its header validated) once.
  std::map<std::string, std::size_t> file_number;
  for (const auto& [name, file] : map->items()) {
    GRADSYNC_CHECK(file.is_string(), where(), ": tensor '", name, "' maps to ", brief(file), ", not a file name");
    const std::string file_name = file.get<std::string>();
    GRADSYNC_CHECK(!file_name.empty() && file_name.find('/') == std::string::npos && file_name != "." &&
                       file_name != "..",
                   where(), ": tensor '", name, "' maps to '", file_name, "', not a file name in the index's folder");
    if (!file_number.count(file_name)) {
      const fs::path file_path = path.parent_path() / file_name;
      GRADSYNC_CHECK(fs::exists(fs::symlink_status(file_path)), where(), " maps tensors to ", file_path.string(),
                     ", which is not there");
      // A link may lead to the folder the index really lives in (a Hugging Face cache), not out.
      GRADSYNC_CHECK(resolves_inside(file_path, path.parent_path(), path), where(), " maps tensors to ",
                     file_path.string(), ", a link that leads out of the index's folder (to ",
                     fs::weakly_canonical(file_path).string(), "): a set's files are in its folder");
      file_number[file_name] = files_.size();
      files_.push_back(std::make_unique<SafetensorsReader>(file_path));
    }
    const std::size_t number = file_number[file_name];
    GRADSYNC_CHECK(files_[number]->find(name) != nullptr, where(), " maps tensor '", name, "' to ", file_name,
                   ", which does not hold it");
    owner_.emplace(name, number);
  }
  // A tensor in two files, or in a file that the index maps it elsewhere from: which holds it?
  std::uint64_t bytes = 0;
  for (std::size_t number = 0; number < files_.size(); ++number) {
    for (const TensorInfo& info : files_[number]->tensors()) {
      const auto owner = owner_.find(info.name);
      GRADSYNC_CHECK(owner == owner_.end() || owner->second == number, where(), ": tensor '", info.name, "' is in ",
                     files_[number]->path().filename().string(), " and in ",
                     files_[owner->second]->path().filename().string());
      bytes += info.data_end - info.data_begin;
    }
  }
  if (const auto total = metadata_.find("total_size"); total != metadata_.end()) {
    GRADSYNC_CHECK(total->second == std::to_string(bytes), where(), ": metadata.total_size is ", total->second,
                   ", its files hold ", bytes, " bytes of tensors");
  }
}

std::vector<std::string> SafetensorsSet::names() const {
  std::vector<std::string> all;
  for (const auto& [name, file] : owner_) all.push_back(name);
  return all;
}

const TensorInfo* SafetensorsSet::find(std::string_view name) const {
  const auto owner = owner_.find(name);
  return owner == owner_.end() ? nullptr : files_[owner->second]->find(name);
}

const SafetensorsReader& SafetensorsSet::file_of(std::string_view name) const {
  const auto owner = owner_.find(name);
  GRADSYNC_CHECK(owner != owner_.end(), "'", path_.string(), "' has no tensor named '", name, "'");
  return *files_[owner->second];
}

Tensor SafetensorsSet::read(std::string_view name) const { return file_of(name).read(name); }

Tensor SafetensorsSet::read_range(std::string_view name, std::int64_t first, std::int64_t count,
                                  std::optional<DType> dtype) const {
  return file_of(name).read_range(name, first, count, dtype);
}

}  // namespace gradsync::io
