// compare_checkpoints A B TOLERANCE: every tensor of A exists in B with the same shape, and
// |a - b| <= TOLERANCE * max(1, |b|) element-wise (0: bit-equal values). Prints the largest
// difference; exits 1 when a tensor differs. Used by the example tests, which must not need Python.
#include <cmath>
#include <cstdio>
#include <string>

#include "gradsync/io/safetensors.h"

int main(int argc, char** argv) try {
  if (argc != 4) {
    std::fprintf(stderr, "usage: compare_checkpoints A.safetensors B.safetensors TOLERANCE\n");
    return 2;
  }
  const gradsync::io::SafetensorsReader a(argv[1]);
  const gradsync::io::SafetensorsReader b(argv[2]);
  const double tolerance = std::stod(argv[3]);
  bool same = true;
  for (const auto& info : a.tensors()) {
    if (b.find(info.name) == nullptr) {
      std::fprintf(stderr, "%s: no tensor '%s'\n", argv[2], info.name.c_str());
      same = false;
      continue;
    }
    const auto x = a.read(info.name).to_double_vector();
    const auto y = b.read(info.name).to_double_vector();
    if (x.size() != y.size()) {
      std::fprintf(stderr, "'%s': %zu elements against %zu\n", info.name.c_str(), x.size(), y.size());
      same = false;
      continue;
    }
    double worst = 0;
    bool within = true;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double difference = std::abs(x[i] - y[i]);
      worst = std::max(worst, difference);
      within = within && (tolerance == 0 ? x[i] == y[i] : difference <= tolerance * std::max(1.0, std::abs(y[i])));
    }
    std::printf("%-24s max |a - b| = %.3g%s\n", info.name.c_str(), worst, within ? "" : "  EXCEEDS the tolerance");
    same = same && within;
  }
  return same ? 0 : 1;
} catch (const std::exception& error) {
  std::fprintf(stderr, "compare_checkpoints: %s\n", error.what());
  return 2;
}
