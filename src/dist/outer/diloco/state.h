// Internal: DiLoCo's state (gradsync/dist/outer/diloco.h), shared by its schedule and reductions
// (diloco.cpp) and its checkpoints (checkpoint.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/dist/outer/diloco.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/optim/sgd.h"
#include "dist/join/census.h"

namespace gradsync::dist {

// The options as lines: compared across the ranks, written into and checked against a checkpoint.
std::vector<std::pair<std::string, std::string>> diloco_option_entries(const DiLoCoOptions& options);

struct DiLoCo::Impl {
  // One buffer on the wire: a fragment's members of one dtype and device, packed.
  struct Wire {
    Tensor buffer;
    std::vector<std::pair<std::size_t, std::size_t>> members;  // (trainable index, element offset)
  };
  // A fragment of the model and its reduction (the whole model when there is one).
  struct Fragment {
    std::vector<std::size_t> members;  // indices into `trainable`
    std::int64_t offset = 0;           // o_i: its first synchronization, in inner steps after the warm-up
    std::vector<Wire> wires;           // while pending: its averaged (or averaging) pseudo-gradients
    std::vector<comm::WorkHandle> works;
    bool pending = false;          // reduced or reducing, its outer step not landed yet
    bool progressed = false;       // inner steps taken since its last launch (on this rank)
  };

  ParameterRegistry& registry;
  comm::Communicator& comm;
  comm::Communicator* within = nullptr;  // a group of ranks holding the same model, or null
  DiLoCoOptions options;
  std::vector<Parameter*> trainable;  // the model's, in registration order
  ParameterRegistry outer;            // g: the mirror of `trainable`
  std::vector<Parameter*> mirror;     // outer[k] mirrors trainable[k]
  std::unique_ptr<optim::SGD> outer_sgd;
  std::vector<Fragment> fragments;
  std::vector<std::int64_t> fragment_of;  // by trainable index
  std::int64_t steps = 0;
  std::int64_t bytes_sent = 0;
  JoinCensus census;  // dist::Join (docs/slow_links.md): taken before each launch inside one

  Impl(ParameterRegistry& registry, comm::Communicator& comm, comm::Communicator* within, const DiLoCoOptions& options);

  void take_outer_model();
  void allocate_wires(Fragment& fragment);
  // The part of a wire buffer this rank reduces across: all of it, or its 1/S under `within`.
  Tensor my_slice(const Wire& wire) const;
  static void to_wire(const Tensor& source, Wire& wire, std::size_t offset);
  static void from_wire(const Wire& wire, std::size_t offset, Tensor& destination);
  void launch(Fragment& fragment, double factor);  // factor: the census's (dist/join/census.h)
  void land(Fragment& fragment);
  void apply(Fragment& fragment);
  bool due(std::int64_t s, std::int64_t offset) const { return s >= offset && (s - offset) % options.sync_every == 0; }
  // Whether the schedule can have `fragment`'s reduction in flight after `steps` step() calls:
  // launched at its last due step and not landed yet (a state to load is checked against it).
  bool may_be_pending(const Fragment& fragment, std::int64_t steps) const;
  // A state file read and checked against this DiLoCo (checkpoint.cpp), nothing changed yet.
  struct Loaded;
  Loaded read_state(const io::SafetensorsReader& file, const std::string& where) const;
  // The next inner step: the launches and outer steps due at it. A joined rank takes no inner
  // step; its steps stop at the first launch, which it reports through `census` (null: active).
  bool advance(JoinStep* step);
  // Every fragment in flight lands, then an outer step of every fragment any rank moved since its
  // last launch: every rank then holds g (DiLoCo::synchronize, and the end of a Join).
  void synchronize_all();
};

}  // namespace gradsync::dist
