#include "gradsync/io/safetensors.h"
#include "gradsync/core/timeline.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <utility>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "atomic_file.h"
#include "json_brief.h"
#include "readable_file.h"

namespace gradsync::io {

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; gradsync reads and writes it without byte swaps");

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// The header is untrusted input. What the reference implementation rejects, we reject, before
// parsing: a UTF-8 byte order mark, NUL bytes, and nesting deeper than any header needs (a
// deeply nested value is also what would make a recursive printer overflow the stack).
// Every dtype the format defines, with its width in bits: enough to check a tensor's byte
// range even when gradsync cannot compute with it (the sub-byte floats pack their elements).
struct FormatDType {
  const char* name;
  int bits;
};
constexpr FormatDType kFormatDTypes[] = {
    {"BOOL", 8},     {"U8", 8},       {"I8", 8},       {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8},
    {"I16", 16},     {"U16", 16},     {"F16", 16},     {"BF16", 16},   {"I32", 32},    {"U32", 32},
    {"F32", 32},     {"F64", 64},     {"I64", 64},     {"U64", 64},    {"C64", 64},    {"F4", 4},
    {"F6_E2M3", 6},  {"F6_E3M2", 6},
};

int format_dtype_bits(const std::string& name) {
  for (const FormatDType& entry : kFormatDTypes) {
    if (name == entry.name) return entry.bits;
  }
  return 0;
}

constexpr int kMaxHeaderNesting = 64;
void check_header_text(const std::string& text, const std::string& where) {
  GRADSYNC_CHECK(text.compare(0, 3, "\xEF\xBB\xBF") != 0, where, ": the header starts with a UTF-8 byte order mark");
  const auto nul = text.find('\0');
  GRADSYNC_CHECK(nul == std::string::npos, where, ": the header holds a NUL byte at offset ", nul);
  int depth = 0;
  bool in_string = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') in_string = true;
    if (c == '[' || c == '{') {
      ++depth;
      GRADSYNC_CHECK(depth <= kMaxHeaderNesting, where, ": the header nests deeper than ", kMaxHeaderNesting,
                     " levels (at byte ", i, ")");
    }
    if (c == ']' || c == '}') --depth;
  }
}


// Reads exactly nbytes at offset, or throws naming the file.
}  // namespace

// ---------------------------------------------------------------------------------------------
// Writing

SafetensorsLayout layout_safetensors(const fs::path& path, const std::vector<TensorSpec>& specs, const Metadata& metadata) {
  // Order as the reference library does: larger elements first, then by name. With a header
  // padded to 8 bytes, every tensor then starts at a multiple of its element size.
  std::vector<std::size_t> order(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    GRADSYNC_CHECK(!specs[i].name.empty(), "cannot save '", path.string(), "': a tensor has an empty name");
    GRADSYNC_CHECK(specs[i].name != "__metadata__", "cannot save '", path.string(),
                   "': the name __metadata__ is reserved by the format");
    order[i] = i;
  }
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const std::size_t size_a = dtype_size(specs[a].dtype), size_b = dtype_size(specs[b].dtype);
    return size_a != size_b ? size_a > size_b : specs[a].name < specs[b].name;
  });
  json header = json::object();
  std::vector<std::size_t> data_offsets(specs.size());
  std::size_t offset = 0;
  for (const std::size_t i : order) {
    const TensorSpec& spec = specs[i];
    GRADSYNC_CHECK(!header.contains(spec.name), "cannot save '", path.string(), "': duplicate tensor name '",
                   spec.name, "'");
    const std::size_t nbytes = static_cast<std::size_t>(shape_numel(spec.shape)) * dtype_size(spec.dtype);
    header[spec.name] = {{"dtype", dtype_safetensors_name(spec.dtype)},
                         {"shape", spec.shape},
                         {"data_offsets", {offset, offset + nbytes}}};
    data_offsets[i] = offset;
    offset += nbytes;
  }
  if (!metadata.empty()) header["__metadata__"] = metadata;

  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  const std::uint64_t header_length = header_text.size();
  SafetensorsLayout layout;
  layout.head.assign(reinterpret_cast<const char*>(&header_length), sizeof header_length);
  layout.head += header_text;
  layout.offsets.resize(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) layout.offsets[i] = layout.head.size() + data_offsets[i];
  layout.file_bytes = layout.head.size() + offset;
  return layout;
}

void save_safetensors(const fs::path& path, const std::vector<NamedTensor>& tensors, const Metadata& metadata) {
  timeline::Span span("checkpoint", [&] { return "save " + path.filename().string(); }, 0);
  std::vector<TensorSpec> specs;
  for (const NamedTensor& entry : tensors) {
    GRADSYNC_CHECK(entry.tensor.defined(), "cannot save '", path.string(), "': tensor '", entry.name,
                   "' is an empty handle");
    specs.push_back({entry.name, entry.tensor.dtype(), entry.tensor.shape()});
  }
  const SafetensorsLayout layout = layout_safetensors(path, specs, metadata);
  // The data in file order, written front to back.
  std::vector<std::size_t> order(tensors.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return layout.offsets[a] < layout.offsets[b]; });
  AtomicFileWriter file(path);
  file.write(layout.head.data(), layout.head.size());
  for (const std::size_t i : order) {
    const Tensor host = tensors[i].tensor.to(Device::cpu());
    file.write(host.data(), host.nbytes());
  }
  file.commit();
}

// ---------------------------------------------------------------------------------------------
// Reading and validation

SafetensorsReader::SafetensorsReader(fs::path path) : path_(std::move(path)) {
  const std::string where = "safetensors file '" + path_.string() + "'";
  file_ = std::make_shared<const ReadableFile>(path_, where);
  const ReadableFile& file = *file_;
  const std::size_t size = static_cast<std::size_t>(file.size());
  GRADSYNC_CHECK(size >= 8, where, " is truncated: ", size, " bytes, less than the 8-byte header length");

  std::uint64_t header_length = 0;
  file.read_at(0, &header_length, sizeof header_length);
  GRADSYNC_CHECK(header_length <= size - 8, where, ": header length ", header_length,
                 " runs past the end of the file (", size, " bytes)");
  GRADSYNC_CHECK(header_length <= kMaxHeaderBytes, where, ": header length ", header_length,
                 " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  data_start_ = 8 + static_cast<std::size_t>(header_length);
  const std::size_t data_size = size - data_start_;

  std::string header_text(header_length, '\0');
  file.read_at(8, header_text.data(), header_text.size());
  check_header_text(header_text, where);
  json header = json::parse(header_text, nullptr, /*allow_exceptions=*/false);
  GRADSYNC_CHECK(!header.is_discarded(), where, ": the header is not valid JSON");
  GRADSYNC_CHECK(header.is_object(), where, ": the header is JSON but not an object");

  for (auto item = header.begin(); item != header.end(); ++item) {
    const std::string& name = item.key();
    const json& entry = item.value();
    if (name == "__metadata__") {
      GRADSYNC_CHECK(entry.is_object(), where, ": __metadata__ must be an object of strings");
      for (auto field = entry.begin(); field != entry.end(); ++field) {
        GRADSYNC_CHECK(field.value().is_string(), where, ": __metadata__ entry '", field.key(),
                       "' is not a string");
        metadata_[field.key()] = field.value().get<std::string>();
      }
      continue;
    }
    const std::string tensor = where + ": tensor '" + name + "'";
    GRADSYNC_CHECK(entry.is_object() && entry.contains("dtype") && entry.contains("shape") &&
                       entry.contains("data_offsets"),
                   tensor, " must be an object with dtype, shape and data_offsets");
    GRADSYNC_CHECK(entry.size() == 3, tensor, " has fields other than dtype, shape and data_offsets");
    GRADSYNC_CHECK(entry["dtype"].is_string(), tensor, ": dtype is not a string");

    TensorInfo info{name, std::nullopt, {}, 0, 0, entry["dtype"].get<std::string>()};
    const int element_bits = format_dtype_bits(info.stored_dtype);
    GRADSYNC_CHECK(element_bits > 0, tensor, ": dtype '", brief(entry["dtype"]),
                   "' is not one the safetensors format defines");
    try {
      info.dtype = dtype_from_safetensors_name(info.stored_dtype);
    } catch (const Error&) {
      // Listed without a DType: the rest of the file stays readable.
    }

    const json& shape = entry["shape"];
    GRADSYNC_CHECK(shape.is_array(), tensor, ": shape is not an array");
    for (const json& extent : shape) {
      GRADSYNC_CHECK(extent.is_number_unsigned() || (extent.is_number_integer() && extent.get<std::int64_t>() >= 0),
                     tensor, ": shape ", brief(shape), " has an entry that is not a non-negative integer");
      GRADSYNC_CHECK(extent.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()),
                     tensor, ": shape ", brief(shape), " has an entry too large");
      info.shape.push_back(extent.get<std::int64_t>());
    }

    const json& offsets = entry["data_offsets"];
    GRADSYNC_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                       offsets[1].is_number_unsigned(),
                   tensor, ": data_offsets must be two non-negative integers, got ", brief(offsets));
    const std::uint64_t begin = offsets[0].get<std::uint64_t>();
    const std::uint64_t end = offsets[1].get<std::uint64_t>();
    GRADSYNC_CHECK(begin <= end, tensor, ": data_offsets [", begin, ", ", end, "] are reversed");
    GRADSYNC_CHECK(end <= data_size, tensor, ": data_offsets [", begin, ", ", end,
                   "] run past the end of the data (", data_size, " bytes)");

    std::int64_t numel = 0;
    try {
      numel = shape_numel(info.shape);
    } catch (const Error&) {
      detail::throw_error(tensor, ": shape ", brief(shape), " has more elements than fit in 64 bits");
    }
    // Bits, so that packed sub-byte elements are checked the same way; a partial last byte is
    // an error, as in the reference library.
    const auto bits = static_cast<std::uint64_t>(element_bits);
    GRADSYNC_CHECK(static_cast<std::uint64_t>(numel) <= std::numeric_limits<std::uint64_t>::max() / bits &&
                       static_cast<std::uint64_t>(numel) * bits % 8 == 0 &&
                       static_cast<std::uint64_t>(numel) * bits / 8 == end - begin,
                   tensor, ": shape ", shape_str(info.shape), " of ", info.dtype_label(), " needs ", numel,
                   " elements, but data_offsets [", begin, ", ", end, "] hold ", end - begin, " bytes");
    info.data_begin = static_cast<std::size_t>(begin);
    info.data_end = static_cast<std::size_t>(end);
    tensors_.push_back(std::move(info));
  }

  // The data section must be covered exactly: in offset order each tensor starts where the
  // previous one ended, and the last one ends at the end of the file.
  std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.data_begin != b.data_begin ? a.data_begin < b.data_begin : a.data_end < b.data_end;
  });
  std::size_t expected_begin = 0;
  for (const TensorInfo& info : tensors_) {
    GRADSYNC_CHECK(info.data_begin >= expected_begin, where, ": tensor '", info.name, "' (bytes ", info.data_begin, "..",
                   info.data_end, ") overlaps the tensor before it (which ends at ", expected_begin, ")");
    GRADSYNC_CHECK(info.data_begin == expected_begin, where, ": bytes ", expected_begin, "..", info.data_begin,
                   " before tensor '", info.name, "' belong to no tensor");
    expected_begin = info.data_end;
  }
  GRADSYNC_CHECK(expected_begin == data_size, where, ": the last ", data_size - expected_begin,
                 " bytes of data belong to no tensor (the file may be truncated or padded)");
  // By name, for find(): restoring a registry of n tensors is then O(n), not O(n^2).
  index_.reserve(tensors_.size());
  for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
}

std::string TensorInfo::dtype_label() const { return dtype ? dtype_name(*dtype) : stored_dtype; }

const TensorInfo* SafetensorsReader::find(std::string_view name) const {
  const auto found = index_.find(std::string(name));
  return found == index_.end() ? nullptr : &tensors_[found->second];
}

Tensor SafetensorsReader::read(std::string_view name) const {
  const TensorInfo* info = find(name);
  GRADSYNC_CHECK(info != nullptr, "safetensors file '", path_.string(), "' has no tensor named '", name, "'");
  return read_tensor(*info);
}

std::vector<NamedTensor> SafetensorsReader::read_all() const {
  std::vector<NamedTensor> all;
  for (const TensorInfo& info : tensors_) all.push_back({info.name, read_tensor(info)});
  return all;
}

Tensor SafetensorsReader::read_range(std::string_view name, std::int64_t first, std::int64_t count,
                                     std::optional<DType> dtype) const {
  const TensorInfo* info = find(name);
  GRADSYNC_CHECK(info != nullptr, "safetensors file '", path_.string(), "' has no tensor named '", name, "'");
  GRADSYNC_CHECK(info->dtype.has_value(), "safetensors file '", path_.string(), "': tensor '", info->name, "' is ",
                 info->stored_dtype, ", which gradsync does not handle (it handles F32, F64, F16, BF16, I32, I64)");
  const std::int64_t numel = shape_numel(info->shape);
  GRADSYNC_CHECK(first >= 0 && count >= 0 && first <= numel && count <= numel - first, "safetensors file '",
                 path_.string(), "': elements ", first, "..", first + count, " of tensor '", info->name, "' are not ",
                 "inside its ", numel, " elements");
  Tensor piece = Tensor::empty({count}, *info->dtype);
  if (count > 0) {
    const std::size_t element = dtype_size(*info->dtype);
    file_->read_at(data_start_ + info->data_begin + static_cast<std::size_t>(first) * element, piece.data(), piece.nbytes());
  }
  return dtype && *dtype != *info->dtype ? piece.to(*dtype) : piece;
}

Tensor SafetensorsReader::read_tensor(const TensorInfo& info) const {
  GRADSYNC_CHECK(info.dtype.has_value(), "safetensors file '", path_.string(), "': tensor '", info.name, "' is ",
                 info.stored_dtype, ", which gradsync does not handle (it handles F32, F64, F16, BF16, I32, I64)");
  Tensor tensor = Tensor::empty(info.shape, *info.dtype);
  file_->read_at(data_start_ + info.data_begin, tensor.data(), tensor.nbytes());
  return tensor;
}

}  // namespace gradsync::io
