// Adasum (gradsync/dist/horovod/adasum.h).
#include "gradsync/dist/horovod/adasum.h"

#include <cfloat>
#include <cmath>

#include "dist/reducer/completed_work.h"
#include "gradsync/kernels/ops.h"

namespace gradsync::dist {

namespace {

// Per-tensor coefficients from the summed partials (dot, |a|^2, |b|^2).
std::pair<double, double> coefficients(double dot, double a_norm_sq, double b_norm_sq) {
  static const double tiny = std::sqrt(DBL_MIN);
  const double a_coeff = a_norm_sq >= tiny ? 1.0 - dot / a_norm_sq * 0.5 : 1.0;
  const double b_coeff = b_norm_sq >= tiny ? 1.0 - dot / b_norm_sq * 0.5 : 1.0;
  return {a_coeff, b_coeff};
}

// A Work that is already done: the hook ran synchronously.
bool power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

// Sends `outgoing` to the partner and receives `incoming` from it (host tensors; the one that
// sends first is decided by the caller, the same pair-wise on both sides, so no two sends wait
// for each other). On a device communicator (NCCL) the messages go through device memory.
void swap_with(comm::Communicator& comm, const Tensor& outgoing, Tensor& incoming, int partner, bool send_first, int tag) {
  const Device device = comm.device_type();
  const Tensor out = device.is_cpu() ? outgoing : outgoing.to(device);
  Tensor in = device.is_cpu() ? incoming : Tensor::empty(incoming.shape(), incoming.dtype(), device);
  if (send_first) {
    comm.send(out, partner, tag);
    comm.recv(in, partner, tag);
  } else {
    comm.recv(in, partner, tag);
    comm.send(out, partner, tag);
  }
  if (!device.is_cpu()) incoming.copy_from(in);
}

}  // namespace

void adasum_combine(Tensor& a, const Tensor& b) {
  GRADSYNC_CHECK(a.numel() == b.numel() && is_floating(a.dtype()) && is_floating(b.dtype()), "adasum_combine: ",
                 a.describe(), " and ", b.describe(), " must be floating tensors of one size");
  std::vector<double> x = a.to_double_vector();
  const std::vector<double> y = b.to_double_vector();
  double dot = 0, xx = 0, yy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    dot += x[i] * y[i];
    xx += x[i] * x[i];
    yy += y[i] * y[i];
  }
  const auto [ca, cb] = coefficients(dot, xx, yy);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = ca * x[i] + cb * y[i];
  a.copy_from(Tensor::from_vector(x, a.shape()).to(a.dtype()).to(a.device()));
}

void adasum_allreduce(comm::Communicator& comm, Tensor& flat, const Segments& segments) {
  const int p = comm.size();
  const int rank = comm.rank();
  GRADSYNC_CHECK(power_of_two(p), "Adasum needs a power-of-two number of ranks; this world has ", p, " ranks");
  GRADSYNC_CHECK(is_floating(flat.dtype()), "Adasum reduces floating tensors, got ", flat.describe());
  if (p == 1 || flat.numel() == 0) return;

  // Work in f64 on the host.
  Tensor data = flat.to(Device::cpu()).to(DType::f64);
  double* v = data.data_as<double>();
  const std::int64_t n = data.numel();
  Tensor received = Tensor::empty({n}, DType::f64);
  double* r = received.data_as<double>();
  const std::size_t tensors = segments.size();

  // Regions held at each level: [lo, hi).
  std::vector<std::pair<std::int64_t, std::int64_t>> regions{{0, n}};
  const auto exchange = [&](std::int64_t send_lo, std::int64_t send_hi, std::int64_t recv_lo, std::int64_t recv_hi,
                            int partner, bool send_first, int tag) {
    Tensor outgoing = data.view(static_cast<std::size_t>(send_lo), {send_hi - send_lo});
    Tensor incoming = received.view(static_cast<std::size_t>(recv_lo), {recv_hi - recv_lo});
    swap_with(comm, outgoing, incoming, partner, send_first, tag);
  };

  // Reduce-scatter: vector halving, distance doubling.
  for (int level = 1; level < p; level <<= 1) {
    const int partner = rank ^ level;
    const bool lower = (rank & level) == 0;
    const auto [lo, hi] = regions.back();
    const std::int64_t mid = lo + (hi - lo) / 2;
    const std::int64_t keep_lo = lower ? lo : mid;
    const std::int64_t keep_hi = lower ? mid : hi;
    const std::int64_t give_lo = lower ? mid : lo;
    const std::int64_t give_hi = lower ? hi : mid;
    // The partner keeps what we give, so we receive its copy of what we keep.
    exchange(give_lo, give_hi, keep_lo, keep_hi, partner, lower, 2 * level);

    // Partials per tensor on the kept slice: "a" is the lower side's vector.
    std::vector<double> partial(3 * tensors, 0.0);  // dot, |a|^2, |b|^2 per tensor
    for (std::size_t t = 0; t < tensors; ++t) {
      const std::int64_t begin = std::max(keep_lo, segments[t].first);
      const std::int64_t end = std::min(keep_hi, segments[t].first + segments[t].second);
      double dot = 0, aa = 0, bb = 0;
      for (std::int64_t i = begin; i < end; ++i) {
        const double a = lower ? v[i] : r[i];
        const double b = lower ? r[i] : v[i];
        dot += a * b;
        aa += a * a;
        bb += b * b;
      }
      partial[3 * t] = dot;
      partial[3 * t + 1] = aa;
      partial[3 * t + 2] = bb;
    }
    // Sum the partials over the 2*level ranks holding slices of this operand pair, by
    // recursive doubling. x + y == y + x exactly, so both partners of each step get the
    // same bits, and so does the whole group.
    if (tensors > 0) {
      Tensor mine = Tensor::from_vector(partial, {static_cast<std::int64_t>(partial.size())});
      Tensor theirs = Tensor::empty({mine.numel()}, DType::f64);
      for (int distance = 1; distance <= level; distance <<= 1) {
        const int peer = rank ^ distance;
        swap_with(comm, mine, theirs, peer, rank < peer, 2 * level + 1);
        double* m = mine.data_as<double>();
        const double* o = theirs.data_as<double>();
        for (std::int64_t i = 0; i < mine.numel(); ++i) m[i] = m[i] + o[i];
      }
      partial = mine.to_double_vector();
    }
    for (std::size_t t = 0; t < tensors; ++t) {
      const auto [a_coeff, b_coeff] = coefficients(partial[3 * t], partial[3 * t + 1], partial[3 * t + 2]);
      const std::int64_t begin = std::max(keep_lo, segments[t].first);
      const std::int64_t end = std::min(keep_hi, segments[t].first + segments[t].second);
      for (std::int64_t i = begin; i < end; ++i) {
        const double a = lower ? v[i] : r[i];
        const double b = lower ? r[i] : v[i];
        v[i] = a_coeff * a + b_coeff * b;
      }
    }
    regions.emplace_back(keep_lo, keep_hi);
  }

  // Allgather: the levels in reverse; partners swap the halves of their parent region.
  for (int level = p / 2; level >= 1; level >>= 1) {
    const int partner = rank ^ level;
    const bool lower = (rank & level) == 0;
    const auto [keep_lo, keep_hi] = regions.back();
    regions.pop_back();
    const auto [lo, hi] = regions.back();
    const std::int64_t other_lo = lower ? keep_hi : lo;
    const std::int64_t other_hi = lower ? hi : keep_lo;
    exchange(keep_lo, keep_hi, other_lo, other_hi, partner, lower, 2 * p + level);
    for (std::int64_t i = other_lo; i < other_hi; ++i) v[i] = r[i];
  }
  flat.copy_from(data.to(flat.dtype()).to(flat.device()));
}

ReduceHook adasum_hook() {
  return [](comm::Communicator& comm, Tensor& flat, const BucketInfo& info) -> comm::WorkHandle {
    Segments segments;
    for (std::size_t m = 0; m < info.members.size(); ++m) {
      segments.emplace_back(info.member_offset[m], info.members[m]->numel());
    }
    adasum_allreduce(comm, flat, segments);
    return std::make_shared<CompletedWork>("adasum bucket " + std::to_string(info.index));
  };
}

}  // namespace gradsync::dist
