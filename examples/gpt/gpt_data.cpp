// The GPT example's data and schedule (gpt_data.h).
#include "gpt_data.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <numbers>
#include <random>

#include "gradsync/core/error.h"

namespace gradsync::examples {

std::vector<std::int32_t> read_tokens(const std::string& path, std::int64_t vocab) {
  std::ifstream in(path, std::ios::binary);
  GRADSYNC_CHECK(in, "gpt_ddp: cannot read ", path);
  std::vector<std::uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  GRADSYNC_CHECK(bytes.size() % 2 == 0, path, ": ", bytes.size(), " bytes is not a whole number of uint16 tokens");
  std::vector<std::int32_t> tokens(bytes.size() / 2);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = bytes[2 * i] | (bytes[2 * i + 1] << 8);
    GRADSYNC_CHECK(tokens[i] < vocab, path, ": token ", tokens[i], " at ", i, " is outside the vocabulary of ", vocab);
  }
  return tokens;
}

double learning_rate(std::int64_t step, double lr, double min_lr, std::int64_t warmup, std::int64_t decay_steps) {
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup + 1);
  if (step > decay_steps) return min_lr;
  const double ratio = static_cast<double>(step - warmup) / static_cast<double>(std::max<std::int64_t>(decay_steps - warmup, 1));
  return min_lr + 0.5 * (1.0 + std::cos(std::numbers::pi * ratio)) * (lr - min_lr);
}

Sequences cut_sequences(const std::vector<std::int32_t>& data, std::int64_t first, std::int64_t count,
                        std::int64_t length) {
  const std::int64_t span = static_cast<std::int64_t>(data.size()) - length - 1;
  GRADSYNC_CHECK(span > 0, "gpt_ddp: ", data.size(), " tokens are fewer than a sequence of ", length, " and its target");
  Sequences sequences;
  for (std::int64_t i = first; i < first + count; ++i) {
    const std::int64_t start = (i * length) % span;
    sequences.tokens.insert(sequences.tokens.end(), data.begin() + start, data.begin() + start + length);
    sequences.targets.insert(sequences.targets.end(), data.begin() + start + 1, data.begin() + start + 1 + length);
  }
  return sequences;
}

double validation_loss(Gpt& model, const std::vector<std::int32_t>& val, int batches, std::int64_t batch,
                       std::int64_t length, int rank, int world) {
  double total = 0;
  for (int k = 0; k < batches; ++k) {
    const Sequences sequences = cut_sequences(val, (static_cast<std::int64_t>(k) * world + rank) * batch, batch, length);
    total += model.forward(sequences.tokens, sequences.targets, batch, length) / batches;
  }
  return total;
}

std::string sample_text(Gpt& model, std::int64_t tokens, std::int64_t block, std::uint64_t seed,
                        const std::string& vocab_path, std::int64_t vocab) {
  std::string alphabet;
  if (!vocab_path.empty()) {
    std::ifstream in(vocab_path, std::ios::binary);
    alphabet.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    GRADSYNC_CHECK(static_cast<std::int64_t>(alphabet.size()) >= vocab, vocab_path, " holds ", alphabet.size(),
                   " characters for a vocabulary of ", vocab);
  }
  std::mt19937_64 engine(seed);
  std::vector<std::int32_t> text{0};
  for (std::int64_t n = 0; n < tokens; ++n) {
    const std::int64_t context = std::min<std::int64_t>(static_cast<std::int64_t>(text.size()), block);
    const std::vector<std::int32_t> window(text.end() - context, text.end());
    model.forward(window, std::vector<std::int32_t>(window.size(), 0), 1, context);
    // softmax(logits / 0.8) is softmax(logits) to the power 1 / 0.8, renormalised.
    std::vector<double> weights = model.probabilities(context - 1);
    for (double& w : weights) w = std::pow(w, 1.0 / 0.8);
    text.push_back(static_cast<std::int32_t>(std::discrete_distribution<std::int64_t>(weights.begin(), weights.end())(engine)));
  }
  std::string out;
  for (std::size_t n = 1; n < text.size(); ++n) {
    out += alphabet.empty() ? std::to_string(text[n]) + " " : std::string(1, alphabet[static_cast<std::size_t>(text[n])]);
  }
  return out;
}

}  // namespace gradsync::examples
