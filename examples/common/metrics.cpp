// The trainers' metrics file (metrics.h).
#include "metrics.h"

#include <cmath>
#include <filesystem>

#include "gradsync/core/error.h"

namespace gradsync::examples {

void line_buffered_progress() { std::setvbuf(stdout, nullptr, _IOLBF, 0); }

Metrics::Metrics(const std::string& path, bool writer, bool append) {
  if (path.empty() || !writer) return;
  // The folder it names is made, as a user who writes --metrics runs/today/metrics.jsonl means.
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  std::error_code ignored;  // a failure shows as the fopen's below, naming the file
  if (!parent.empty()) std::filesystem::create_directories(parent, ignored);
  file_ = std::fopen(path.c_str(), append ? "a" : "w");
  GRADSYNC_CHECK(file_ != nullptr, "cannot write the metrics file ", path);
}

Metrics::~Metrics() {
  if (file_ != nullptr) std::fclose(file_);
}

void Metrics::step(std::int64_t step, int epoch, double loss, double grad_norm,
                   const std::vector<std::pair<const char*, double>>& extra) {
  if (file_ == nullptr) return;
  std::fprintf(file_, "{\"step\": %lld, \"epoch\": %d, \"loss\": %.9g", static_cast<long long>(step), epoch, loss);
  if (std::isfinite(grad_norm)) std::fprintf(file_, ", \"grad_norm\": %.17g", grad_norm);
  for (const auto& [name, value] : extra) std::fprintf(file_, ", \"%s\": %.15g", name, value);
  std::fprintf(file_, "}\n");
  std::fflush(file_);
}

void Metrics::record(std::int64_t step, const std::vector<std::pair<const char*, double>>& fields) {
  if (file_ == nullptr) return;
  std::fprintf(file_, "{\"step\": %lld", static_cast<long long>(step));
  for (const auto& [name, value] : fields) std::fprintf(file_, ", \"%s\": %.15g", name, value);
  std::fprintf(file_, "}\n");
  std::fflush(file_);
}

void Metrics::stragglers(std::int64_t step, const comm::StragglerReport& report) {
  if (file_ == nullptr) return;
  std::fprintf(file_, "{\"step\": %lld, \"stragglers\": {\"steps\": %lld, \"slowest\": %d, \"waited_ms_per_step\": %.3f, "
               "\"max_waited_ms_per_step\": %.3f, \"wire_ms\": [", static_cast<long long>(step),
               static_cast<long long>(report.steps), report.slowest, report.waited_ms_per_step,
               report.worst_waited_ms_per_step);
  for (std::size_t r = 0; r < report.wire_ms.size(); ++r) std::fprintf(file_, "%s%.3f", r ? ", " : "", report.wire_ms[r]);
  std::fprintf(file_, "]}}\n");
  std::fflush(file_);
}

void Metrics::event(std::int64_t step, const std::string& kind, const std::string& detail,
                    const std::vector<std::pair<const char*, double>>& fields) {
  if (file_ == nullptr) return;
  std::string text;  // JSON's string escapes, for the few characters an error message may hold
  for (const char c : detail) {
    if (c == '"' || c == '\\') text += '\\';
    text += (static_cast<unsigned char>(c) < 0x20) ? ' ' : c;
  }
  std::fprintf(file_, "{\"step\": %lld, \"event\": \"%s\", \"detail\": \"%s\"", static_cast<long long>(step), kind.c_str(),
               text.c_str());
  for (const auto& [name, value] : fields) std::fprintf(file_, ", \"%s\": %.15g", name, value);
  std::fprintf(file_, "}\n");
  std::fflush(file_);
}

void Metrics::epoch(std::int64_t step, int epoch, double loss, double accuracy) {
  if (file_ == nullptr) return;
  std::fprintf(file_, "{\"step\": %lld, \"epoch\": %d, \"epoch_loss\": %.9g, \"accuracy\": %.6f}\n",
               static_cast<long long>(step), epoch, loss, accuracy);
  std::fflush(file_);
}

}  // namespace gradsync::examples
