// The GPT example's data and schedule: nanoGPT's token files, its learning rate, the batches cut
// by global sequence index, and the validation loss (examples/gpt_ddp.cpp's top comment).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpt_model.h"

namespace gradsync::examples {

// nanoGPT's train.bin / val.bin: uint16 token ids, little-endian, each below `vocab`.
std::vector<std::int32_t> read_tokens(const std::string& path, std::int64_t vocab);

// nanoGPT's get_lr: a linear warmup to lr, then a cosine down to min_lr at decay_steps.
double learning_rate(std::int64_t step, double lr, double min_lr, std::int64_t warmup, std::int64_t decay_steps);

// Sequences of `length` tokens and their targets (shifted by one) from `data`: sequence i starts
// at token (i x length) mod (len - length - 1), for i in [first, first + count).
struct Sequences {
  std::vector<std::int32_t> tokens, targets;
};
Sequences cut_sequences(const std::vector<std::int32_t>& data, std::int64_t first, std::int64_t count,
                        std::int64_t length);

// The mean loss of `model` over `batches` batches of `batch` sequences of `val`, this rank's
// (rank r of `world` takes every world-th batch from r): local, no communication.
double validation_loss(Gpt& model, const std::vector<std::int32_t>& val, int batches, std::int64_t batch,
                       std::int64_t length, int rank, int world);

// `tokens` tokens generated from token 0, each drawn from the softmax of the last position's
// logits at temperature 0.8 (nanoGPT's sample.py), the context cropped to `block`: as text when
// `vocab_path` names the characters in token order (one byte each), else as token ids.
std::string sample_text(Gpt& model, std::int64_t tokens, std::int64_t block, std::uint64_t seed,
                        const std::string& vocab_path, std::int64_t vocab);

}  // namespace gradsync::examples
