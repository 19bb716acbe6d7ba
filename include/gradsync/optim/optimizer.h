// gradsync/optim/optimizer.h - the optimizer interface: parameter groups, a fused step over
// arenas, per-parameter step counts, state in arenas, and checkpoints.
//
// An optimizer updates some or all of a registry's parameters, organised in *groups* that
// each carry their own hyperparameters (PyTorch's param_groups). Its state buffers
// (momentum, exp_avg, ...) are arenas laid out exactly like the registry's value arenas, so
// one update pass covers a whole arena: step() merges neighbouring parameters that share a
// group and a step count into one contiguous segment and hands the segments of each arena
// to one fused kernel (one CUDA launch per arena).
//
// Semantics follow torch.optim:
//  * step() skips parameters whose gradient is undefined and leaves their state and step
//    count untouched;
//  * each parameter has its own step count (Adam's bias correction uses it);
//  * zero_grad(set_to_undefined = true) undefines the gradients, false zero-fills them.
//
// Mixed precision (docs/mixed_precision.md): f16 and bf16 parameters are stepped through an
// f32 *master copy* the optimizer owns (MasterWeights::f32). The master copy and every state
// buffer of such an arena are f32; the fused pass updates the master value and writes its
// rounded (nearest even) image into the model's 16-bit value in the same loop. Gradients may
// be f16, bf16 or f32 (ParameterRegistry::add's grad_dtype). The master copy of a parameter is
// taken from its 16-bit value at its first step, and again after a load_state() whose file
// holds none; load_master_weights() sets it from an f32 checkpoint instead.
//
// Loss scaling and clipping (GradScaler, clip_grad_norm) do not rewrite the gradients: they
// hand the optimizer factors (1/scale, the clip coefficient) that the next step() applies to
// each gradient inside the same fused pass, rounding as PyTorch's in-place multiplies do.
//
// Subclasses (SGD, Adam, AdamW, or a user's own) supply the hyperparameters and the update;
// the DistributedOptimizer wraps any of them through this interface.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/io/safetensors.h"
#include "gradsync/kernels/update_buffers.h"
#include "gradsync/registry/parameter_registry.h"

namespace gradsync::optim {

namespace internal {
class StateArenas;
}

// Hyperparameters as named numbers (booleans as 0/1): the form checkpoints and messages use.
using Hyperparameters = std::map<std::string, double>;

// Whether the optimizer keeps an f32 master copy of f16/bf16 parameters. Without one, a
// 16-bit parameter is an error: updates of size lr * g vanish when rounded to 8 mantissa bits.
// f32 and f64 parameters are their own master copy either way.
enum class MasterWeights { none, f32 };

// One pass over the optimized gradients, each multiplied by the pending unscale factor as the
// step will see it: what clip_grad_norm and GradScaler need. Sums are accumulated in double.
struct GradientStatistics {
  double sum_of_squares = 0.0;                   // the sum of every element's square
  double max_abs = 0.0;                          // the largest magnitude (inf when one is)
  std::int64_t nonfinite = 0;                    // elements that are inf or NaN
  std::vector<std::string> nonfinite_parameters;  // the parameters holding them, in order
  bool finite() const { return nonfinite == 0; }  // no element is inf or NaN
};

// The statistics of the defined gradients among `parameters`, each multiplied by `factor`.
GradientStatistics gradient_statistics(std::span<Parameter* const> parameters, double factor = 1.0);

// The base of every optimizer: groups, the fused step over arenas, state, checkpoints (above).
class Optimizer {
 public:
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  virtual const char* name() const = 0;  // "SGD", "Adam", "AdamW", ...

  // One update of every parameter with a defined gradient.
  void step();
  // Every optimized parameter's gradient undefined (PyTorch's set_to_none) or, with false,
  // zero-filled; the pending gradient factors return to 1.
  void zero_grad(bool set_to_undefined = true);

  ParameterRegistry& registry() const { return registry_; }  // whose parameters it optimizes
  std::size_t group_count() const { return groups_.size(); }  // parameter groups, in order
  // A group's parameters, in the order it was given them.
  const std::vector<Parameter*>& group_parameters(std::size_t group) const;
  // Every hyperparameter of a group, and the learning rate on its own (what schedules set).
  virtual Hyperparameters hyperparameters(std::size_t group) const = 0;
  double lr(std::size_t group) const;         // a group's learning rate
  void set_lr(std::size_t group, double lr);  // sets it (what LR schedules call each step)
  // Replaces the hyperparameters `values` names, by torch.optim's names (what a config file or
  // a checkpoint gives); the others keep their value. A name this optimizer does not have, or an
  // invalid value, is an error naming it, and nothing changes.
  void update_hyperparameters(std::size_t group, const Hyperparameters& values);

  // Steps taken by this parameter (those with a defined gradient); 0 if never stepped.
  std::int64_t step_count(const Parameter& parameter) const;

  // --- Mixed precision
  MasterWeights master_weights() const { return master_weights_; }
  // The f32 master copy of a 16-bit parameter (a view; writing it changes the next step's
  // starting point), or an undefined Tensor for an f32/f64 parameter or before its first step.
  Tensor master_weight(const Parameter& parameter) const;
  // Sets the master copies of the 16-bit parameters from a checkpoint's tensors of the same
  // names (any floating dtype, e.g. an f32 file), and rounds them into the model values.
  // Returns how many were set; parameters absent from the file keep their master copy.
  std::size_t load_master_weights(const io::SafetensorsReader& file);

  // --- Gradient factors for the next step() (GradScaler and clip_grad_norm use them): each
  // gradient is multiplied by unscale, then by clip, inside the fused pass. Both return to 1
  // after step() and zero_grad(); discard_gradient_factors() does it by hand (a skipped step).
  void defer_gradient_unscale(double factor);
  void defer_gradient_clip(double factor);  // multiplies into an earlier clip factor
  double pending_gradient_unscale() const { return grad_unscale_; }  // 1 when none is pending
  double pending_gradient_clip() const { return grad_clip_; }        // 1 when none is pending
  void discard_gradient_factors();  // both factors back to 1 (a step the GradScaler skips)
  // Statistics of the optimized gradients (those defined) times the pending unscale factor.
  // Computed once and kept until the gradients may change (step, zero_grad, a new unscale
  // factor): clipping computes them, and the GradScaler's finite check reuses that pass.
  const GradientStatistics& gradient_statistics();
  // The names of the state buffers this optimizer may keep ("momentum_buffer", "exp_avg", ...).
  const std::vector<std::string>& state_buffer_names() const { return buffer_names_; }
  // A view of one parameter's state buffer; an undefined Tensor while the buffer does not
  // exist yet (state is created at the first step that needs it, as in PyTorch).
  Tensor state(const Parameter& parameter, std::string_view buffer) const;

  // --- Sharding (ZeRO, dist/zero.h): this optimizer keeps state for, and steps, only the
  // given element ranges of each arena ([begin, end) in arena elements; sorted, disjoint; an
  // arena with no range is not stepped here). Its state buffers (and master copies) then hold
  // only those elements, packed in range order, so the state takes (owned / total) of the
  // memory. Step counts stay per parameter and global. Call before the first step; the
  // optimizer must support it (SGD, Adam and AdamW do). While sharded, state() and
  // master_weight() of a parameter are undefined, gradient_statistics() covers the owned
  // elements only (the ZeRO front end sums them over ranks), and checkpoints go through
  // dist/zero.h; load_state() works sharded too (each rank takes its pieces from a full
  // checkpoint, whatever world size wrote it). State that exists when shard() is called (a
  // loaded checkpoint) is cut down to the owned pieces.
  struct ElementRange {
    std::int64_t begin = 0;  // the first element, in arena elements
    std::int64_t end = 0;    // one past the last
  };
  // `combine` turns this rank's statistics of its owned elements into everybody's (the ZeRO
  // front end allreduces them), so clipping and the GradScaler see the global ones.
  void shard(std::vector<std::vector<ElementRange>> ranges_per_arena,
             std::function<void(GradientStatistics&)> combine = {});
  bool sharded() const;  // shard() was called
  // The element ranges of `arena` this optimizer steps (the whole arena unless sharded).
  const std::vector<ElementRange>& shard_ranges(std::size_t arena) const;
  // Elements one state buffer of `arena` holds (its full size unless sharded).
  std::int64_t state_elements(std::size_t arena) const;
  // Bytes of state allocated now, every buffer of every arena (master copies included).
  std::int64_t state_bytes() const;
  // Whether update_arena() reads and writes only through its slice and state_data(slice, b):
  // then a sharded step can hand it the owned ranges one by one.
  virtual bool supports_sharding() const { return false; }
  // Which state buffers a parameter holds (bit b for buffer b), the same on every rank.
  std::uint32_t state_presence(const Parameter& parameter) const;
  // This rank's packed state of one buffer (an undefined Tensor while it does not exist).
  Tensor shard_state(std::size_t arena, std::size_t buffer) const;
  // The checkpoint tensors (as state_tensors() names them) of state buffers given in the full
  // arena layout, full[arena][buffer] (undefined: none), for the parameters holding that state:
  // what dist/zero.h writes after gathering every rank's pieces.
  std::vector<io::NamedTensor> state_tensors_of(const std::vector<std::vector<Tensor>>& full) const;
  // The dtype of `arena`'s state buffers: the arena's own, or f32 for a 16-bit arena stepped
  // through master weights.
  DType state_dtype(std::size_t arena) const;

  // --- Checkpoints (safetensors): state tensors named "optimizer.state.<param>.<buffer>",
  // the type, the groups with their hyperparameters and the step counts in the metadata.
  std::vector<io::NamedTensor> state_tensors() const;  // every state buffer of every parameter holding one
  io::Metadata state_metadata() const;  // the type, the groups with their hyperparameters, the step counts
  // Both in one safetensors file, written atomically (a failed save leaves the old file whole).
  void save_state(const std::filesystem::path& path) const;
  // Loads a state saved by an optimizer of the same type over the same parameters: groups
  // (their members and hyperparameters), step counts and buffers. A piece of a sharded set may
  // carry "optimizer.present_elsewhere" ({name: bits}): state held by parameters whose tensors
  // are in the set's other files (so a rank learns every parameter's presence). Any mismatch raises one
  // error listing every difference, and leaves this optimizer unchanged.
  void load_state(const std::filesystem::path& path);
  void load_state(const io::SafetensorsReader& file);
  // The same from memory (state_tensors() and state_metadata() of another optimizer, e.g.
  // received over a communicator); `origin` names them in errors.
  void load_state(const std::vector<io::NamedTensor>& tensors, const io::Metadata& metadata, const std::string& origin);
  // Throws what load_state(tensors, metadata, origin) would, and changes nothing: lets several
  // ranks agree that every one of them can load before any does (ZeRO's sharded sets).
  void check_state(const std::vector<io::NamedTensor>& tensors, const io::Metadata& metadata,
                   const std::string& origin) const;

 protected:
  // One contiguous run of elements of one arena, to update with one group's hyperparameters.
  // `step` is the step count after this update (1 on the first). `present` has bit b set when
  // the run's parameters already hold state in buffer b; a buffer without state starts from
  // PyTorch's initial value (SGD: the gradient itself; Adam: zeros). `begin` counts from the
  // slice's start (below).
  struct Segment {
    std::int64_t begin;         // the first element, from the slice's start
    std::int64_t count;         // elements in the run
    std::size_t group;          // whose hyperparameters update it
    std::int64_t step;          // the step count after this update
    std::uint32_t present;      // bit b: the run already holds state in buffer b
    double grad_unscale = 1.0;  // the pending gradient factors, the same for every segment
    double grad_clip = 1.0;     // (unscale first, then clip)
  };

  // Where one update_arena call reads and writes: the kernels' buffers (kernels/update_buffers.h)
  // positioned at the start of the elements being updated, the arena's start or, when the
  // optimizer is sharded (ZeRO), the start of one owned range (update_arena is then called once
  // per range). Segments count from there; so does state_data(slice, b).
  struct ArenaSlice {
    std::size_t arena;               // which of the registry's arenas
    kernels::UpdateBuffers buffers;  // positioned at the slice's first element
    std::int64_t state_offset;  // the slice's first element in the state buffers
  };

  // groups: the parameters of each group (every one trainable, of this registry, in at most
  // one group); buffer_names: the state buffers the subclass may request.
  Optimizer(ParameterRegistry& registry, std::vector<std::vector<Parameter*>> groups,
            std::vector<std::string> buffer_names, MasterWeights master_weights = MasterWeights::none);

  // Replaces a group's hyperparameters after validating them (errors name the group and value).
  virtual void set_hyperparameters(std::size_t group, const Hyperparameters& values) = 0;
  // Which state buffers a group's update reads and writes (bit b for buffer b).
  virtual std::uint32_t buffers_used(std::size_t group) const = 0;
  // Updates one slice of an arena; the segments are in arena order. Request state buffers
  // with state_data().
  virtual void update_arena(const ArenaSlice& slice, std::span<const Segment> segments) = 0;

  // Inside update_arena: where the slice's part of state buffer `buffer` starts (the buffer is
  // created zero-filled on first request).
  void* state_data(const ArenaSlice& slice, std::size_t buffer);

 private:
  static constexpr std::size_t kNoGroup = static_cast<std::size_t>(-1);
  struct LoadPlan;  // load_state's checked contents (optimizer_checkpoint.cpp)

  void require_optimized(const Parameter& parameter, const char* what) const;
  void require_unsharded(const char* what) const;
  bool has_master(std::size_t arena) const { return master_buffer_ != kNoGroup && master_arena_[arena]; }
  void initialize_master_weights(std::size_t arena);
  // The segments of one arena: neighbours with the same group, step and state merged.
  std::vector<Segment> segments_of(std::size_t arena) const;
  ArenaSlice slice(std::size_t arena, std::int64_t begin, std::int64_t state_offset);
  // load_state's one implementation, over a file or tensors in memory: check everything, then
  // commit (optimizer_checkpoint.cpp).
  void load_state_from(const std::string& where, const io::Metadata& metadata, const std::vector<io::TensorInfo>& tensors,
                       const std::function<Tensor(const std::string&)>& read);
  LoadPlan plan_load(const std::string& where, const io::Metadata& metadata,
                     const std::vector<io::TensorInfo>& tensors) const;
  void check_groups(const std::string& where, const io::Metadata& metadata, LoadPlan& plan) const;
  void check_steps(const std::string& where, const io::Metadata& metadata, LoadPlan& plan) const;
  void check_tensors(const std::vector<io::TensorInfo>& tensors, LoadPlan& plan) const;
  void commit(const std::string& where, const LoadPlan& plan, const std::vector<Tensor>& data);

  ParameterRegistry& registry_;
  std::vector<std::vector<Parameter*>> groups_;
  std::vector<std::size_t> group_of_;         // per registry index; npos when not optimized
  std::vector<std::int64_t> steps_;           // per registry index
  std::vector<std::uint32_t> present_;        // per registry index: bit b = holds state in buffer b
  std::vector<std::string> buffer_names_;
  std::unique_ptr<internal::StateArenas> state_;  // the buffers, whole or sharded (state_arenas.h)
  MasterWeights master_weights_;
  std::size_t master_buffer_ = kNoGroup;  // index of the "master" buffer, when master weights are on
  std::vector<bool> master_arena_;        // per arena: a 16-bit arena stepped through a master copy
  double grad_unscale_ = 1.0;
  double grad_clip_ = 1.0;
  std::optional<GradientStatistics> statistics_;
  std::function<void(GradientStatistics&)> combine_statistics_;
};

// The registry's trainable parameters, in registration order: the default single group.
std::vector<Parameter*> trainable_parameters(ParameterRegistry& registry);

}  // namespace gradsync::optim
