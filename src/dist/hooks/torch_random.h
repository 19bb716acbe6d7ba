// Internal: the random numbers PyTorch's PowerSGD draws, reproduced, so that gradsync's PowerSGD
// starts from the same random projections as `powerSGD_hook` with the same seed.
//
// PowerSGD (torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook) keeps a
// numpy.random.RandomState(random_seed); whenever it fills a bucket's Q matrices with random
// values it draws rng.randint(1_000_000_000), seeds torch's CPU generator with it
// (torch.manual_seed) and calls torch.randn for each Q. Both generators are the Mersenne Twister
// MT19937 with the reference initialisation (init_genrand), so one engine serves both:
//   * numpy's legacy randint(high): 32-bit draws masked to the smallest 2^k - 1 >= high - 1,
//     rejected while above high - 1;
//   * torch's randn on the CPU: tensors of 16 elements or more are filled with uniforms first,
//     then Box-Muller in blocks of 16 (u1 from the first 8, u2 from the next 8; a tail block is
//     redrawn over the last 16 elements); smaller tensors draw pairs of 53-bit doubles per
//     element and keep the second normal for the next element, in the generator, across calls.
// torch's own float path may use vectorised log/sin/cos, so values agree to a few ulps, not bits
// (tests/reference/gen_powersgd.py records torch's, and test_powersgd compares within 1e-6).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

namespace gradsync::dist::random {

class Mt19937 {
 public:
  explicit Mt19937(std::uint32_t seed = 5489);
  std::uint32_t next32();
  std::uint64_t next64();  // the high word is drawn first, as torch's random64()

  // The whole state, for checkpoints: 624 words, then the position.
  std::vector<std::int64_t> save() const;
  void load(const std::vector<std::int64_t>& saved);

 private:
  void twist();
  std::array<std::uint32_t, 624> state_{};
  std::size_t position_ = 624;
};

// numpy.random.RandomState(seed).randint(high) for 0 < high <= 2^32.
std::int64_t numpy_randint(Mt19937& engine, std::int64_t high);

// torch.manual_seed(seed) then torch.randn(n) calls, in order, on one generator.
class TorchNormal {
 public:
  explicit TorchNormal(std::uint32_t seed) : engine_(seed) {}
  void fill(float* data, std::size_t n);
  void fill(double* data, std::size_t n);

 private:
  template <typename T>
  void fill_blocks(T* data, std::size_t n);
  template <typename T>
  void fill_pairs(T* data, std::size_t n);

  Mt19937 engine_;
  bool has_cached_ = false;  // torch's next_double_normal_sample
  double cached_ = 0;
};

}  // namespace gradsync::dist::random
