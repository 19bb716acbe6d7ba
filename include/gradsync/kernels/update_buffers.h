// gradsync/kernels/update_buffers.h - where a fused optimizer update reads and writes: the one
// description the optimizers hand to the kernels (and that a user's own Optimizer subclass
// receives in update_arena, optim/optimizer.h).
//
// Plain precision: `params` is the parameter values (f32 or f64), `grads` has the same dtype
// and `model` is null. Mixed precision: `params` is the optimizer's f32 master copy, `grads` is
// f32, f16 or bf16, and `model` (f16 or bf16) receives the rounded result in the same pass.
// State buffers (momentum, exp_avg, ...) have param_dtype. The pointers are positioned where
// the update's segments count their offsets from.
#pragma once

#include "gradsync/core/dtype.h"

namespace gradsync::kernels {

// The buffers one fused optimizer update reads and writes (above).
struct UpdateBuffers {
  DType param_dtype;   // of the values stepped (and of the state)
  void* params;        // the values stepped: the master copy, or the model's values themselves
  DType grad_dtype;    // of the gradients
  const void* grads;   // the gradients
  DType model_dtype;   // of the model's values
  void* model;         // the model's 16-bit values the masters are rounded into (null: none)
};

}  // namespace gradsync::kernels
