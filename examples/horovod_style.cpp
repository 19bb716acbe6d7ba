// horovod_style: the digits MLP trained the Horovod way, through the DistributedOptimizer.
//
// What it demonstrates:
//   * broadcast_parameters and broadcast_optimizer_state from rank 0 before training;
//   * the wrapped optimizer: gradients are reduced as the backward signals them, fused into
//     buckets; step() waits for them and steps (Horovod's DistributedOptimizer);
//   * --backward-passes-per-step k: k backward passes accumulate locally, the k-th launches
//     the reduction, then one step;
//   * --compression none|fp16|bf16 and --op average|sum|adasum (adasum reduces the deltas of a
//     local step, as Horovod's Adasum optimizer; it needs a power-of-two number of ranks);
//   * gradient clipping (--clip-norm) through DistributedOptimizer::clip_grad_norm, which does
//     what Horovod users write by hand: synchronize(), clip the now-global gradient, then step()
//     without synchronizing again;
//   * --uneven: ranks with different numbers of batches; a rank out of them calls join()
//     (hvd.join()), then every rank takes the last joiner's weights and optimizer state;
//   * --precision bf16|fp16: 16-bit weights and gradients (reduced in 16 bits), f32 master
//     weights; fp16 adds loss scaling, and a step whose gradients overflowed is skipped on
//     every rank.
//
//   mpirun -np 2 build/examples/horovod_style --backward-passes-per-step 2 --compression fp16 --clip-norm 1
#include <cstdio>

#include "common/trainer_support.h"
#include "gradsync/comm/connect.h"
#include "gradsync/dist/horovod/distributed_optimizer.h"
#include "gradsync/nn/loss.h"
#include "gradsync/optim/clip.h"

using namespace gradsync;

int main(int argc, char** argv) try {
  examples::line_buffered_progress();
  examples::Flags flags(argc, argv);
  if (flags.flag("--help")) {
    std::printf("horovod_style flags:\n  --backward-passes-per-step 1   --compression none|fp16|bf16   "
                "--op average|sum|adasum\n%s\n%s\n",
                examples::kCommonHelp, examples::kRestartHelp);
    return 0;
  }
  const examples::TrainerOptions options = examples::parse_trainer_options(flags, "--backward-passes-per-step");
  const dist::Compression compression = dist::parse_compression(flags.text("--compression", "none"));
  const dist::Op op = dist::parse_op(flags.text("--op", "average"));
  flags.finish();
  GRADSYNC_CHECK(!(options.clip_norm > 0 && op == dist::Op::adasum),
                 "--clip-norm does not combine with --op adasum: Adasum reduces the deltas of a local step inside "
                 "step(), so there is no reduced gradient to clip (Horovod's Adasum optimizer has no skip_synchronize)");

  auto training = examples::prepare_training(
      options, "horovod_style",
      {std::string("--compression ") + dist::compression_name(compression), std::string("--op ") + dist::op_name(op)});
  comm::Communicator& comm = *training->comm;
  // Horovod's start of training: everyone begins from rank 0's weights and optimizer state.
  dist::broadcast_parameters(training->registry, comm, 0);
  dist::broadcast_optimizer_state(*training->optimizer, comm, 0);
  dist::DistributedOptimizer optimizer(*training->optimizer, comm,
                                       {.compression = compression,
                                        .backward_passes_per_step = static_cast<int>(options.passes),
                                        .op = op});
  if (comm.rank() == 0 && !options.quiet) {
    std::printf("horovod_style: %d rank(s) on %s, op %s, compression %s, %lld backward pass(es) per step, clip %g, %s in %s\n",
                comm.size(), comm.backend(), dist::op_name(op), dist::compression_name(compression),
                static_cast<long long>(options.passes), options.clip_norm, options.optimizer.c_str(),
                options.precision.c_str());
  }

  const auto step = [&](const std::vector<std::int64_t>& order, std::int64_t first_row) {
    double step_loss = 0;
    for (std::int64_t pass = 0; pass < options.passes; ++pass) {
      const std::int64_t begin = first_row + pass * training->micro;
      const examples::Batch batch = examples::gather(training->data, order, begin, begin + training->micro, training->device);
      const nn::LossResult loss =
          nn::softmax_cross_entropy(training->model->forward(batch.images), batch.labels,
                                    training->loss_scale() / static_cast<double>(training->local_batch));
      training->model->backward(loss.grad);  // each gradient signals ready; the k-th pass launches the reduction
      step_loss += loss.loss / static_cast<double>(options.passes);
    }
    const auto step_now = [&] { optimizer.step(); };
    if (training->scaler) {
      // The loss scaler checks the reduced gradients for inf/NaN before the step: reduce them
      // first, then step without reducing again (Horovod's synchronize / skip_synchronize).
      optimizer.synchronize();
      auto guard = optimizer.skip_synchronize();
      training->finish_step(
          options, [&](double max_norm) { return optim::clip_grad_norm(*training->optimizer, max_norm); }, step_now);
    } else {
      // clip_grad_norm synchronizes, clips, and leaves step() nothing to reduce.
      training->finish_step(options, [&](double max_norm) { return optimizer.clip_grad_norm(max_norm); }, step_now);
    }
    optimizer.zero_grad();
    return step_loss;
  };
  // --uneven: a rank out of batches calls hvd.join(); Horovod then leaves the replicas as they
  // are, so the last rank to join (which took every step) gives everyone its weights and state.
  const examples::UnevenInputs uneven{.enter = {}, .join = [&] {
                                        const int last = optimizer.join();
                                        dist::broadcast_parameters(training->registry, comm, last);
                                        dist::broadcast_optimizer_state(*training->optimizer, comm, last);
                                        return last;
                                      }};
  return examples::run_training(*training, options, "horovod_style", step, uneven);
} catch (const std::exception& error) {
  return comm::report_fatal_error("horovod_style", error);
}
