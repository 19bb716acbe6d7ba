// gpt_ddp: nanoGPT's GPT (examples/gpt/gpt_model.h: the engine's own forward and backward)
// trained data-parallel through gradsync, as nanoGPT's train.py trains it: AdamW with weight
// decay on the 2-D weights only, a linear warmup then a cosine decay of the learning rate,
// clipping by the global norm, gradient accumulation over microbatches.
//
//   scripts/launch.sh 2 build/examples/gpt_ddp --data train.bin --vocab-size 65 --steps 200
//
// Data: nanoGPT's train.bin (token ids as little-endian uint16). Batches are deterministic: at
// step s with W ranks and B sequences per rank of T tokens, sequence i in [0, B W) starts at
// token ((s B W + i) T) mod (len - T - 1) and rank r takes i in [r B, (r + 1) B); targets are the
// inputs shifted by one. So 1 rank with B = 4 and 2 ranks with B = 2 see the same 4 sequences.
//
// One step, top to bottom: for each microbatch, the model's forward and backward (each
// gradient accumulates and is marked ready, the last layer's first; on the last microbatch
// DataParallel reduces the buckets while the backward goes on); then the global norm clipped,
// the learning rate of the step set, AdamW's step. On the CPU or a GPU per rank (--device cuda:
// the model's parameters, activations and arithmetic on the device, gpt/gpt_kernels.cu; NCCL
// between GPUs, or Gloo / MPI staging through the host), in f32 or bf16 (f32 masters);
// --zero 1|2 shards AdamW's state (and the gradients) as digits_ddp does, --zero 3 the
// parameters too (the model gathers each block around its use: Gpt::shard), --shard-group N
// shards inside groups of N ranks and replicates across them (HSDP); --sync-strategy picks
// when microbatches reduce; --uneven gives the ranks different numbers of steps, through Join;
// --replica-groups R: this world is one of R groups that go on when one dies (fault_tolerance.md).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>

#include <sys/resource.h>

#include "common/replica_groups.h"
#include "common/slow_links.h"
#include "common/trainer_support.h"
#include "gpt/gpt_data.h"
#include "gpt/gpt_model.h"
#include "gradsync/comm/connect.h"
#include "gradsync/dist/data_parallel/data_parallel.h"
#include "gradsync/dist/join/join.h"
#include "gradsync/dist/hooks/powersgd.h"
#include "gradsync/dist/zero/shard_groups.h"
#include "gradsync/dist/zero/zero.h"
#include "gradsync/io/registry_checkpoint.h"
#include "gradsync/io/safetensors.h"
#include "gradsync/optim/adam.h"
#include "gradsync/optim/clip.h"

using namespace gradsync;

int main(int argc, char** argv) try {
  examples::line_buffered_progress();
  examples::Flags flags(argc, argv);
  if (flags.flag("--help")) {
    std::printf(
        "gpt_ddp flags:\n  --data train.bin (uint16 tokens)   --vocab-size V   --backend auto|gloo|mpi|nccl\n"
        "  --device cpu|cuda|cuda:N (cuda: the local rank's GPU; with auto, NCCL when every rank has one)\n"
        "  --layers 2 --heads 2 --embd 64 --block 32 --gelu tanh|erf   --init WEIGHTS.safetensors   --seed 1\n"
        "  --batch 4 (sequences per rank per step)   --length T (block)   --microbatches 1   --steps 50\n"
        "  --lr 1e-3 --min-lr 1e-4 --warmup 10 --decay-steps (steps)   --weight-decay 0.1 --beta1 0.9 --beta2 0.95 --eps 1e-8\n"
        "  --clip-norm 1.0 (0: off)   --metrics FILE.jsonl   --quiet\n"
        "  --save FILE.safetensors (nanoGPT's model loads it strictly; AdamW's state beside it)   --resume FILE.safetensors\n"
        "  --powersgd-rank R (PowerSGD compression of rank R; 0: off)   --powersgd-start N (plain steps first: 10)\n"
        "  --zero 0|1|2|3 (ZeRO: 1 shards AdamW's state over the ranks, 2 the reduced gradients too, 3 the\n"
        "    parameters too: each block gathered for its forward and backward; f32)\n"
        "  --shard-group N (with --zero 2|3, HSDP: sharded inside groups of N consecutive ranks, 0: one group\n"
        "    per node, replicated across the groups; only one piece per rank crosses between groups)\n"
        "  --val val.bin (the validation loss at the end)   --sample N (N tokens generated at the end)\n"
        "  --vocab FILE (one byte per token, in token order: samples print as text)\n"
        "  --precision f32|bf16 (bf16: bf16 parameters and gradients, f32 arithmetic and master weights)\n"
        "  --sync-strategy single|multi|forced|auto (across microbatches; Composer's)   --uneven (rank r stops\n"
        "    after (2W - r) / 2W of the steps and joins: Join shadows the others' steps)\n"
        "  --val-every N (the validation loss every N steps, 4 batches per rank, into --metrics)\n"
        "  --time-budget S (stop at the first --val-every point after S seconds)\n%s\n%s\n%s\n",
        examples::kSlowLinkHelp, examples::kRestartHelp, examples::kReplicaGroupHelp);
    return 0;
  }
  const std::string data_path = flags.text("--data", "");
  const std::int64_t vocab = flags.integer("--vocab-size", 0);
  const std::string backend = flags.text("--backend", "auto");
  const std::string device_text = flags.text("--device", "cpu");
  examples::GptConfig config;
  config.layers = flags.count("--layers", 2), config.heads = flags.count("--heads", 2);
  config.embd = flags.count("--embd", 64), config.block = flags.count("--block", 32);
  config.vocab = vocab;
  const std::string gelu = flags.text("--gelu", "tanh");
  config.gelu_tanh = gelu == "tanh";
  const std::string init = flags.text("--init", "");
  const std::int64_t seed = flags.integer("--seed", 1);
  const std::int64_t batch = flags.count("--batch", 4), length = flags.count("--length", config.block);
  const std::int64_t microbatches = flags.count("--microbatches", 1);
  const std::int64_t steps = flags.count("--steps", 50);
  const double lr = flags.number("--lr", 1e-3), min_lr = flags.number("--min-lr", 1e-4);
  const std::int64_t warmup = flags.count("--warmup", 10, 0), decay_steps = flags.count("--decay-steps", steps);
  const double weight_decay = flags.number("--weight-decay", 0.1), eps = flags.number("--eps", 1e-8);
  const double beta1 = flags.number("--beta1", 0.9), beta2 = flags.number("--beta2", 0.95);
  const double clip_norm = flags.number("--clip-norm", 1.0);
  const std::string metrics_path = flags.text("--metrics", "");
  const std::string save = flags.text("--save", "");
  const std::string resume_flag = flags.text("--resume", "");
  const examples::RestartOptions restarts = examples::parse_restart_options(flags);
  const std::string val_path = flags.text("--val", "");
  const std::string vocab_path = flags.text("--vocab", "");
  const std::int64_t sample_tokens = flags.count("--sample", 0, 0);
  const bool quiet = flags.flag("--quiet");
  const int zero_stage = static_cast<int>(flags.integer("--zero", 0));
  const int shard_group = static_cast<int>(flags.integer("--shard-group", -1));
  const int powersgd_rank = static_cast<int>(flags.count("--powersgd-rank", 0, 0));
  const std::int64_t powersgd_start = flags.integer("--powersgd-start", 10);
  const std::string precision = flags.text("--precision", "f32");
  const dist::DDPSyncStrategy strategy = examples::sync_strategy_from(flags.text("--sync-strategy", ""), false);
  const bool uneven = flags.flag("--uneven");
  const examples::SlowLinkOptions slow_options = examples::parse_slow_link_options(flags);
  const std::int64_t val_every = flags.count("--val-every", 0, 0);
  const double time_budget = flags.number("--time-budget", 0.0);
  const examples::ReplicaGroupOptions replica_options = examples::parse_replica_group_options(flags);
  flags.finish();
  GRADSYNC_CHECK(!replica_options.enabled() || (powersgd_rank == 0 && !slow_options.enabled() && !uneven),
                 "--replica-groups runs without --powersgd-rank, --local-sgd / --diloco and --uneven ",
                 "(docs/fault_tolerance.md says why)");
  // Slow links compose with ZeRO 1 and 2 inside --inner-group groups (whole values on every rank);
  // not with ZeRO 3 (sharded values), nor across ranks that are replicas of their own.
  GRADSYNC_CHECK(!slow_options.enabled() ||
                     ((zero_stage == 0 || (zero_stage <= 2 && slow_options.inner_group > 0)) && shard_group < 0 &&
                      powersgd_rank == 0 && !uneven && restarts.checkpoint_every == 0 && resume_flag.empty()),
                 "--local-sgd / --diloco run without --zero (but 1 or 2 with --inner-group), --shard-group, ",
                 "--powersgd-rank, --uneven and checkpoints in gpt_ddp (each rank's model and AdamW state are its own ",
                 "between synchronizations: a checkpoint would hold every rank's; the library's LocalSGD and DiLoCo ",
                 "checkpoint their own state)");
  GRADSYNC_CHECK((val_every == 0 && time_budget == 0) || !val_path.empty(), "--val-every and --time-budget need --val");
  GRADSYNC_CHECK(time_budget == 0 || val_every > 0, "--time-budget is checked at the --val-every points: give --val-every");
  GRADSYNC_CHECK(val_every == 0 || !uneven, "--val-every with --uneven: its allreduce has no partner on a joined rank");
  GRADSYNC_CHECK(precision == "f32" || precision == "bf16", "--precision ", precision, ": expected f32 or bf16");
  GRADSYNC_CHECK(!data_path.empty() && vocab > 0, "gpt_ddp: --data FILE and --vocab-size V are required");
  GRADSYNC_CHECK(gelu == "tanh" || gelu == "erf", "--gelu ", gelu, ": expected tanh or erf");
  GRADSYNC_CHECK(batch % microbatches == 0, "--batch ", batch, " must divide into --microbatches ", microbatches);
  GRADSYNC_CHECK(zero_stage >= 0 && zero_stage <= 3, "--zero ", zero_stage, ": expected 0, 1, 2 or 3");
  GRADSYNC_CHECK(shard_group < 0 || zero_stage >= 2, "--shard-group ", shard_group, " needs --zero 2 or 3 (HSDP shards ",
                 "the gradients inside each group)");
  GRADSYNC_CHECK(!(uneven && restarts.checkpoint_every > 0), "--uneven does not combine with --checkpoint-every: ranks ",
                 "with uneven inputs reach a step count at different times (checkpoints are written at the end)");
  GRADSYNC_CHECK(zero_stage < 3 || precision == "f32", "--zero 3 --precision ", precision, ": stage 3 runs f32 ",
                 "parameters here (the model widens every bf16 weight at once, which sharding would undo)");


  // 1. The ranks, the data, the model (every rank starts from rank 0's weights). First, what every
  // rank must run alike: a rank started with another --batch would train with mixed batches.
  examples::Ranks ranks = examples::connect_ranks(backend, Device::parse(device_text), device_text == "cuda");
  std::unique_ptr<comm::Communicator> comm = std::move(ranks.comm);
  const Device device = ranks.device;
  using examples::number_setting;
  examples::require_same_settings(
      *comm,
      {"--batch " + std::to_string(batch), "--length " + std::to_string(length),
       "--microbatches " + std::to_string(microbatches), "--steps " + std::to_string(steps),
       examples::file_setting("--data", data_path), "--vocab-size " + std::to_string(vocab),
       "--layers " + std::to_string(config.layers), "--heads " + std::to_string(config.heads),
       "--embd " + std::to_string(config.embd), "--block " + std::to_string(config.block), "--gelu " + gelu,
       examples::file_setting("--init", init), "--seed " + std::to_string(seed), "--precision " + precision,
       "--zero " + std::to_string(zero_stage), "--shard-group " + std::to_string(shard_group),
       std::string("--sync-strategy ") + dist::sync_strategy_name(strategy),
       std::string("--uneven ") + (uneven ? "on" : "off"), "--powersgd-rank " + std::to_string(powersgd_rank),
       "--powersgd-start " + std::to_string(powersgd_start), number_setting("--lr", lr), number_setting("--min-lr", min_lr),
       "--warmup " + std::to_string(warmup), "--decay-steps " + std::to_string(decay_steps),
       number_setting("--weight-decay", weight_decay), number_setting("--beta1", beta1), number_setting("--beta2", beta2),
       number_setting("--eps", eps), number_setting("--clip-norm", clip_norm),
       "--checkpoint-every " + std::to_string(restarts.checkpoint_every), "--val-every " + std::to_string(val_every),
       number_setting("--time-budget", time_budget)},
      "gpt_ddp");
  examples::require_same_settings(*comm, examples::slow_link_settings(slow_options), "gpt_ddp");
  const std::vector<std::int32_t> data = examples::read_tokens(data_path, vocab);
  GRADSYNC_CHECK(static_cast<std::int64_t>(data.size()) > length + 1, data_path, " holds ", data.size(),
                 " tokens, fewer than a sequence of ", length, " and its target");
  ParameterRegistry registry;
  examples::Gpt model(registry, config, precision == "bf16" ? DType::bf16 : DType::f32, device);
  registry.finalize();
  if (init.empty()) {
    model.initialize(static_cast<std::uint64_t>(seed));
  } else {
    io::load_registry(registry, init, {.convert_dtypes = true});
  }

  // 2. AdamW in nanoGPT's two groups: decay for the matrices, none for biases and LayerNorms.
  std::vector<Parameter*> decay, no_decay;
  for (Parameter& p : registry) (p.shape().size() >= 2 ? decay : no_decay).push_back(&p);
  optim::Adam::Options options{.lr = lr, .beta1 = beta1, .beta2 = beta2, .eps = eps, .weight_decay = weight_decay};
  optim::Adam::Options no_decay_options = options;
  no_decay_options.weight_decay = 0.0;
  // bf16 parameters: AdamW updates an f32 master copy and rounds it into them after each step.
  optim::AdamW optimizer(registry, {{decay, options}, {no_decay, no_decay_options}},
                         precision == "bf16" ? optim::MasterWeights::f32 : optim::MasterWeights::none);
  // A checkpoint (examples/common/checkpoints.h: weights, AdamW's state, the step) is read whole
  // on every rank, before ZeRO shards the state: --resume, else the latest in --checkpoint-dir
  // (a run restarted by torchrun resumes by itself). Its global batch is this run's: the batches
  // are cut by global sequence index, so the steps after it read what an uninterrupted run would.
  examples::Progress progress;
  const std::string resume = examples::resume_point(restarts, resume_flag);
  if (!resume.empty()) {
    const std::int64_t trained_with = examples::checkpoint_global_batch(resume);
    GRADSYNC_CHECK(trained_with == 0 || trained_with == batch * comm->size(), resume, " was trained with a global batch ",
                   "of ", trained_with, " sequences; this run's is ", batch * comm->size(), " (", comm->size(),
                   " ranks x --batch ", batch, "), and a resumed run keeps it");
    if (comm->rank() == 0 && !quiet) std::printf("resuming from %s\n", resume.c_str());
    progress = examples::load_checkpoint(resume, registry, optimizer);
  }
  progress.global_batch = batch * comm->size();

  // Stage 3: each unit (the embeddings, each block, the final LayerNorm) is one bucket.
  dist::DataParallelOptions ddp_options{.shard_gradients = zero_stage >= 2};
  if (zero_stage == 3) ddp_options.units = model.units();
  // HSDP: ZeRO over each group of ranks, the groups' pieces averaged across them.
  std::optional<dist::ShardGroups> groups;
  if (shard_group >= 0 && comm->size() > 1) {
    groups.emplace(*comm, shard_group);
    ddp_options.replicas = &groups->replicas();
  }
  // Slow links: LocalSGD or DiLoCo across the ranks (or across --inner-group groups, which the
  // DataParallel then synchronizes every step).
  std::optional<examples::SlowLinks> slow;
  if (slow_options.enabled()) slow.emplace(slow_options, registry, *comm);
  dist::DataParallel ddp(registry, slow ? slow->inner() : groups ? groups->shard() : *comm, ddp_options);
  std::shared_ptr<dist::PowerSGDState> powersgd;
  if (powersgd_rank > 0 && comm->size() > 1) {
    powersgd = std::make_shared<dist::PowerSGDState>(
        dist::PowerSGDOptions{.matrix_approximation_rank = powersgd_rank, .start_powerSGD_iter = powersgd_start});
    ddp.register_comm_hook(dist::powersgd_hook(powersgd));
  }

  // ZeRO: this rank keeps AdamW's state (and with stage 2 the reduced gradient) of its pieces
  // of each bucket only; the step updates those and gathers the parameters. Stage 3 keeps only
  // its pieces of the values too: the model gathers each unit for its forward and backward.
  std::unique_ptr<dist::ZeroOptimizer> zero;
  if (zero_stage > 0 && ddp.communicator().size() > 1) {
    zero = std::make_unique<dist::ZeroOptimizer>(optimizer, ddp, dist::ZeroOptions{.stage = zero_stage});
    if (zero_stage == 3) model.shard(zero.get());
  }
  // Fault tolerance across replica groups: each step in the coordinator's quorum (replica_groups.h).
  std::unique_ptr<dist::FaultTolerance> ft = replica_options.enabled() ? examples::make_fault_tolerance(
      replica_options, registry, &optimizer, *comm, batch * comm->size(), zero.get()) : nullptr;
  if (ft && !resume.empty()) examples::resume_across_groups(*ft, progress, resume);
  examples::Metrics metrics(metrics_path, comm->rank() == 0, /*append=*/ft != nullptr);  // a restarted group adds
  if (comm->rank() == 0 && !quiet) {
    std::printf("gpt_ddp: %d rank(s) on %s, %s, %lld parameters (%lld layers, %lld heads, width %lld, block %lld), %zu tokens, "
                "%lld x %lld sequences of %lld per step\n",
                comm->size(), comm->backend(), device.str().c_str(), static_cast<long long>(model.parameter_count()),
                static_cast<long long>(config.layers), static_cast<long long>(config.heads),
                static_cast<long long>(config.embd), static_cast<long long>(config.block), data.size(),
                static_cast<long long>(comm->size()), static_cast<long long>(batch), static_cast<long long>(length));
  }
  if (slow && comm->rank() == 0 && !quiet) std::printf("slow links: %s\n", slow->describe().c_str());

  // 3. The steps. With --uneven, rank r has data for fewer steps the higher it is; it then
  // joins, and shadows the collectives of the others' steps until all have joined (the last
  // to join then gives every rank its weights and AdamW's state).
  const std::int64_t world = comm->size();
  const std::int64_t my_steps = uneven ? steps * (2 * world - comm->rank()) / (2 * world) : steps;
  std::optional<dist::Join> join;
  if (uneven && world > 1) {
    std::vector<dist::Joinable*> participants{&ddp};
    if (zero) participants.push_back(zero.get());
    join.emplace(participants, dist::JoinOptions{}, &optimizer);
  }
  const std::int64_t micro = batch / microbatches;
  const auto start = std::chrono::steady_clock::now();
  const std::int64_t node_bytes_at_start = comm::node_bytes_sent();
  const std::vector<std::int32_t> val = val_every > 0 ? examples::read_tokens(val_path, vocab) : std::vector<std::int32_t>{};
  // Where the time goes, per step: waiting for the gradient synchronization (what the backward
  // did not hide: end_backward and the strategy's close) and the optimizer (clipping, the step).
  using Clock = std::chrono::steady_clock;
  const auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  double total_seconds = 0, total_sync = 0, total_optimizer = 0;
  // What a checkpoint holds of AdamW: its state (ZeRO's pieces gathered: every rank takes part).
  const auto optimizer_state = [&] {
    if (!zero) return examples::OptimizerCheckpoint{optimizer.state_tensors(), optimizer.state_metadata()};
    dist::ZeroOptimizer::State consolidated = zero->consolidated_state();
    return examples::OptimizerCheckpoint{std::move(consolidated.tensors), std::move(consolidated.metadata)};
  };
  const std::int64_t first_step = progress.global_step;
  for (std::int64_t step = first_step; ft ? ft->step() < steps && !ft->stopping() : step < my_steps; ++step) {
    if (ft) {
      ft->start_step();  // the quorum (a replacement recovers here); the step is the committed count
      step = ft->step();
    }
    const Clock::time_point step_start = Clock::now();
    double step_loss = 0, sync_seconds = 0;
    std::optional<dist::DataParallel::NoSync> local_only;  // slow links: this step's gradients stay local
    if (slow && !slow->synchronizes_gradients()) local_only.emplace(ddp);
    for (std::int64_t m = 0; m < microbatches; ++m) {
      // By global sequence index: this rank's microbatch m of the step's B W sequences.
      const std::int64_t first = ft ? ft->first_sample() : step * batch * world;  // this group's, with replicas
      const examples::Sequences sequences =
          examples::cut_sequences(data, first + comm->rank() * batch + m * micro, micro, length);
      // The strategy decides which microbatches' backwards reduce (SINGLE: the last one's,
      // overlapped; MULTI: every one's; FORCED: all at once when the last one's context closes).
      dist::DDPSyncContext sync(ddp, m + 1 == microbatches, strategy);
      ddp.begin_backward();
      step_loss += model.forward(sequences.tokens, sequences.targets, micro, length) / static_cast<double>(microbatches);
      model.backward(1.0 / static_cast<double>(microbatches));
      const Clock::time_point wait_start = Clock::now();
      ddp.end_backward();
      sync.close();
      sync_seconds += since(wait_start);
    }
    const Clock::time_point optimizer_start = Clock::now();
    // Across replica groups: the quorum's average and the coordinator's decision first; clipping
    // then sees that average, the same bits in every group, and a discarded step clipped nothing.
    if (ft && !examples::commit_across_groups(*ft, replica_options, comm->rank())) {
      optimizer.zero_grad();
      examples::report_events(*ft, metrics, comm->rank(), quiet);
      continue;  // discarded by every group: run again in the next quorum
    }
    // The total norm before clipping; with clipping off it is still measured for --metrics (the
    // optimizer's statistics of the gradients it steps: under ZeRO, every rank's pieces summed).
    const double norm = clip_norm > 0 ? (zero ? zero->clip_grad_norm(clip_norm)  // the norm over every rank's pieces
                                              : optim::clip_grad_norm(optimizer, clip_norm))
                        : metrics_path.empty() ? std::nan("")
                                               : std::sqrt(optimizer.gradient_statistics().sum_of_squares);
    const double rate = examples::learning_rate(step, lr, min_lr, warmup, decay_steps);
    optimizer.set_lr(0, rate);
    optimizer.set_lr(1, rate);
    zero ? zero->step() : optimizer.step();
    optimizer.zero_grad();
    if (slow) slow->step();
    if (ft) examples::report_events(*ft, metrics, comm->rank(), quiet);
    const double optimizer_seconds = since(optimizer_start);
    const double step_seconds = since(step_start);
    total_seconds += step_seconds;
    total_sync += sync_seconds;
    total_optimizer += optimizer_seconds;
    // The mean over the ranks (a collective a joined rank would not shadow, and one that would cross
    // the slow link every step: local under --uneven and the slow-link strategies).
    if (!join && !slow) {
      Tensor loss = Tensor::from_vector(std::vector<double>{step_loss}, {1});
      comm->allreduce_host(loss, comm::ReduceOp::avg);
      step_loss = loss.to_double_vector()[0];
    }
    const double tokens = static_cast<double>(batch * world * length);
    metrics.step(step + 1, 0, step_loss, norm,  // the steps done, 1 after the first (as digits_ddp)
                 {{"lr", rate},
                  {"tokens_per_s", tokens / step_seconds},
                  {"sync_share", sync_seconds / step_seconds},
                  {"optimizer_share", optimizer_seconds / step_seconds},
                  {"seconds", since(start)},
                  {"node_bytes_sent", static_cast<double>(comm::node_bytes_sent() - node_bytes_at_start)},
                  {"outer_bytes_sent", slow ? static_cast<double>(slow->bytes_sent()) : 0.0}});
    if (comm->rank() == 0 && !quiet && (step % 10 == 0 || step + 1 == steps)) {
      const double seconds = since(start);
      std::printf("step %5lld  loss %.4f  lr %.3g  %.0f tokens/s  (of the step so far: sync wait %.1f%%, optimizer %.1f%%)\n",
                  static_cast<long long>(step + 1), step_loss, rate,
                  static_cast<double>(step + 1 - first_step) * tokens / seconds, 100 * total_sync / total_seconds,
                  100 * total_optimizer / total_seconds);
    }
    // --val-every: the validation loss of each rank's model (the replicas differ between the slow-link
    // strategies' synchronizations: their mean), and --time-budget's stop, in one allreduce so that
    // every rank stops at the same step.
    if (val_every > 0 && (step + 1) % val_every == 0) {
      const double local = examples::validation_loss(model, val, 4, batch, length, comm->rank(), comm->size());
      const bool over_budget = time_budget > 0 && since(start) >= time_budget;
      Tensor words = Tensor::from_vector(std::vector<double>{local / comm->size(), over_budget ? 1.0 : 0.0}, {2});
      comm->allreduce_host(words, comm::ReduceOp::sum);
      const std::vector<double> agreed = words.to_double_vector();
      metrics.record(step + 1, {{"val_loss", agreed[0]}, {"seconds", since(start)}});
      if (comm->rank() == 0 && !quiet) {
        std::printf("step %5lld  validation loss %.4f  at %.1f s\n", static_cast<long long>(step + 1), agreed[0],
                    since(start));
      }
      if (agreed[1] > 0 && !ft) { progress.global_step = step + 1; break; }
      if (agreed[1] > 0 && ft) ft->request_stop();  // across the groups: a stop the quorum decides
    }
    // --checkpoint-every (at stage 3 the model gathered for it, then released); --kill-rank after it.
    progress.global_step = step + 1;  // across replica groups one group writes (checkpoint_writer)
    if (ft) progress.position = ft->position();
    if (examples::checkpoint_due(restarts, progress.global_step) && (!ft || ft->checkpoint_writer())) {
      if (zero && zero_stage == 3) for (std::size_t unit = 0; unit < zero->unit_count(); ++unit) zero->gather(unit);
      examples::checkpoint_into_folder(restarts, *comm, registry, optimizer_state(), progress);
      if (zero && zero_stage == 3) for (std::size_t unit = 0; unit < zero->unit_count(); ++unit) zero->release(unit);
    }
    examples::kill_if_asked(restarts, comm->rank(), progress.global_step, "gpt_ddp");
  }
  if (join) {
    const int last = join->join();
    if (comm->rank() == 0 && !quiet) {
      std::printf("uneven: rank 0 took %lld steps, rank %d (the last to join) %lld; every rank holds its weights\n",
                  static_cast<long long>(my_steps), last, static_cast<long long>(steps * (2 * world - last) / (2 * world)));
    }
    join.reset();
  }
  if (zero && zero_stage == 3) {
    // Validation, the sample (rank 0 alone) and the checkpoint read the whole model: every unit
    // gathered, on every rank, and the model used whole from here.
    for (std::size_t unit = 0; unit < zero->unit_count(); ++unit) zero->gather(unit);
    model.shard(nullptr);
  }
  // 4. The validation loss: the mean over up to 16 batches of the rank's sequences of val.bin,
  // averaged over the ranks (the same weights everywhere).
  if (!val_path.empty()) {
    Tensor mean = Tensor::from_vector(
        std::vector<double>{examples::validation_loss(model, examples::read_tokens(val_path, vocab), 16, batch, length,
                                                      comm->rank(), comm->size())},
        {1});
    comm->allreduce_host(mean, comm::ReduceOp::avg);
    if (comm->rank() == 0) std::printf("validation loss %.4f\n", mean.to_double_vector()[0]);
  }
  // 5. A sample (nanoGPT's sample.py: temperature 0.8), from rank 0.
  if (sample_tokens > 0 && comm->rank() == 0) {
    std::printf("sample:\n%s\n", examples::sample_text(model, sample_tokens, config.block, static_cast<std::uint64_t>(seed),
                                                       vocab_path, vocab).c_str());
  }
  if (powersgd && comm->rank() == 0 && !quiet) {
    std::printf("PowerSGD rank %d from step %lld: in its steps %lld gradient elements went to collectives for %lld "
                "(%.1fx fewer)\n",
                powersgd_rank, static_cast<long long>(powersgd_start),
                static_cast<long long>(powersgd->numel_after_compression()),
                static_cast<long long>(powersgd->numel_before_compression()),
                static_cast<double>(powersgd->numel_before_compression()) /
                    static_cast<double>(std::max<std::int64_t>(powersgd->numel_after_compression(), 1)));
  }
  // The memory each rank held at its peak (getrusage's maximum resident set), the largest of
  // the ranks: what --zero 1|2 and --precision bf16 change.
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  Tensor peak = Tensor::from_vector(std::vector<double>{static_cast<double>(usage.ru_maxrss) / 1024.0}, {1});
  comm->allreduce_host(peak, comm::ReduceOp::max);
  if (comm->rank() == 0 && !quiet) {
    std::printf("peak RSS per rank: %.0f MiB (the largest of %lld ranks; parameters %.1f MiB)\n", peak.to_double_vector()[0],
                static_cast<long long>(world), static_cast<double>(registry.total_numel() * dtype_size(registry.begin()->dtype())) / (1 << 20));
  }
  // The weights under nanoGPT's names (PyTorch loads them), AdamW's state, the step; one file,
  // written atomically by rank 0: --save, and the restarts folder's last checkpoint.
  if (uneven) progress.global_step = std::max(progress.global_step, steps);  // (a joined rank shadowed the rest)
  if (!restarts.checkpoint_dir.empty() && (!ft || ft->checkpoint_writer())) {
    examples::checkpoint_into_folder(restarts, *comm, registry, optimizer_state(), progress);
  }
  if (!save.empty()) {
    const examples::OptimizerCheckpoint state = optimizer_state();
    // nanoGPT's model takes the file with load_state_dict(strict=True): its lm_head.weight (tied to
    // the token embedding) is written too, the model's config rides in the metadata, and AdamW's
    // state is in the file beside it that this one names (--resume reads both).
    examples::ModelFile model_file;
    model_file.extra.push_back({"lm_head.weight", registry.at("transformer.wte.weight").value()});
    model_file.metadata["config"] = "{\"n_layer\": " + std::to_string(config.layers) + ", \"n_head\": " +
                                    std::to_string(config.heads) + ", \"n_embd\": " + std::to_string(config.embd) +
                                    ", \"block_size\": " + std::to_string(config.block) + ", \"vocab_size\": " +
                                    std::to_string(config.vocab) + ", \"bias\": true, \"dropout\": 0.0, \"gelu\": \"" +
                                    gelu + "\"}";
    if (comm->rank() == 0) examples::save_checkpoint(save, registry, state, progress, nullptr, &model_file);
  }
  return 0;
} catch (const std::exception& error) {
  return comm::report_fatal_error("gpt_ddp", error);
}
