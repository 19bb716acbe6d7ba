// Internal: row-sparse gradients (an embedding's rows) for the DistributedOptimizer, Horovod's
// sparse path. A backward pass hands a parameter's gradient as rows at indices
// (set_sparse_grad); passes accumulate by concatenation, as sparse tensors do. At the
// synchronization every rank takes part for every sparse parameter, in registry order, with
// whatever rows it has (none is fine): counts, indices and values travel by allgatherv, and
// the gathered rows are summed (duplicate indices add, as in a coalesced sparse tensor) into
// the dense gradient the optimizers step. One routine (add_rows) densifies, whatever the path.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "gradsync/comm/communicator.h"
#include "gradsync/dist/reducer/reducer.h"
#include "gradsync/registry/parameter.h"

namespace gradsync::dist {

class SparseGradients {
 public:
  // set_sparse_grad's arguments checked: 1-D i64 indices within the parameter's rows, and
  // indices.numel() rows of the parameter's row size. Errors name the parameter.
  static void validate(const Parameter& parameter, const Tensor& indices, const Tensor& rows);
  // sparse_as_dense: the rows added into the parameter's dense gradient (zeros when undefined).
  static void add_into_gradient(Parameter& parameter, const Tensor& indices, const Tensor& rows);

  // One pass's rows, kept until the synchronization.
  void accumulate(const Parameter& parameter, const Tensor& indices, const Tensor& rows);
  // Every parameter of `sparse` (registry order, the same on every rank): gathered from every
  // rank and written densely into its gradient, the sum, or the average when `average`. Values
  // travel in the gradient's dtype, or compressed to 16 bits. Collective.
  void reduce(comm::Communicator& comm, const std::vector<Parameter*>& sparse, Compression compression, bool average);
  // One rank, or Adasum: each parameter's own rows become its dense gradient.
  void densify_locally(const std::vector<Parameter*>& parameters);
  void clear() { rows_.clear(); }

 private:
  struct Rows {
    std::vector<std::int64_t> indices;
    std::vector<double> values;  // indices.size() x row elements, in f64 until reduced
  };
  std::map<const Parameter*, Rows> rows_;
};

}  // namespace gradsync::dist
