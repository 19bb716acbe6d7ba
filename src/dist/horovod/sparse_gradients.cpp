// Row-sparse gradients (sparse_gradients.h).
#include "sparse_gradients.h"

namespace gradsync::dist {

namespace {

std::int64_t row_elements(const Parameter& parameter) {
  return parameter.shape().empty() ? 1 : parameter.numel() / parameter.shape()[0];
}

// The one densify routine: `count` rows of `row` elements at `indices` added into `dense`.
void add_rows(std::vector<double>& dense, const std::int64_t* indices, std::size_t count, const double* values,
              std::int64_t row) {
  for (std::size_t k = 0; k < count; ++k) {
    double* target = dense.data() + indices[k] * row;
    const double* source = values + static_cast<std::int64_t>(k) * row;
    for (std::int64_t e = 0; e < row; ++e) target[e] += source[e];
  }
}

void write_gradient(Parameter& parameter, const std::vector<double>& dense) {
  parameter.grad_for_overwrite().copy_from(
      Tensor::from_vector(dense, parameter.shape()).to(parameter.grad_dtype()).to(parameter.device()));
}

std::vector<double> zeros_like(const Parameter& parameter) {
  return std::vector<double>(static_cast<std::size_t>(parameter.numel()), 0.0);
}

}  // namespace

void SparseGradients::validate(const Parameter& parameter, const Tensor& indices, const Tensor& rows) {
  const std::int64_t row = row_elements(parameter);
  const std::int64_t rows_count = parameter.shape().empty() ? 1 : parameter.shape()[0];
  GRADSYNC_CHECK(indices.dtype() == DType::i64 && indices.shape().size() == 1, "set_sparse_grad('", parameter.name(),
                 "'): indices must be a 1-D i64 tensor, got ", indices.describe());
  GRADSYNC_CHECK(rows.numel() == indices.numel() * row, "set_sparse_grad('", parameter.name(), "'): ", indices.numel(),
                 " indices need ", indices.numel() * row, " row elements, got ", rows.describe());
  const Tensor host = indices.to(Device::cpu());
  const std::int64_t* at = host.data_as<std::int64_t>();
  for (std::int64_t k = 0; k < indices.numel(); ++k) {
    GRADSYNC_CHECK(at[k] >= 0 && at[k] < rows_count, "set_sparse_grad('", parameter.name(), "'): index ", at[k],
                   " is outside its ", rows_count, " rows");
  }
}

void SparseGradients::add_into_gradient(Parameter& parameter, const Tensor& indices, const Tensor& rows) {
  std::vector<double> dense = parameter.grad_defined() ? parameter.grad().to_double_vector() : zeros_like(parameter);
  const Tensor host = indices.to(Device::cpu());
  const std::vector<double> values = rows.to_double_vector();
  add_rows(dense, host.data_as<std::int64_t>(), static_cast<std::size_t>(indices.numel()), values.data(),
           row_elements(parameter));
  write_gradient(parameter, dense);
}

void SparseGradients::accumulate(const Parameter& parameter, const Tensor& indices, const Tensor& rows) {
  Rows& accumulated = rows_[&parameter];
  const Tensor host = indices.to(Device::cpu());
  const std::int64_t* at = host.data_as<std::int64_t>();
  accumulated.indices.insert(accumulated.indices.end(), at, at + indices.numel());
  const std::vector<double> values = rows.to_double_vector();
  accumulated.values.insert(accumulated.values.end(), values.begin(), values.end());
}

void SparseGradients::reduce(comm::Communicator& comm, const std::vector<Parameter*>& sparse, Compression compression,
                             bool average) {
  for (Parameter* parameter : sparse) {
    Rows& mine = rows_[parameter];
    const std::int64_t row = row_elements(*parameter);
    Tensor my_count = Tensor::zeros({1}, DType::i64);
    my_count.data_as<std::int64_t>()[0] = static_cast<std::int64_t>(mine.indices.size());
    Tensor all_counts = Tensor::zeros({comm.size()}, DType::i64);
    comm.allgather_host(my_count, all_counts);
    const std::vector<std::int64_t> counts(all_counts.data_as<std::int64_t>(),
                                           all_counts.data_as<std::int64_t>() + comm.size());
    std::int64_t total = 0;
    for (const std::int64_t count : counts) total += count;

    Tensor indices = Tensor::zeros({static_cast<std::int64_t>(mine.indices.size())}, DType::i64);
    std::copy(mine.indices.begin(), mine.indices.end(), indices.data_as<std::int64_t>());
    Tensor all_indices = Tensor::zeros({total}, DType::i64);
    comm.allgatherv_host(indices, all_indices, counts);

    // Values travel in the gradient's dtype, or compressed.
    DType wire = parameter->grad_dtype();
    if (compression == Compression::fp16 && is_floating(wire)) wire = DType::f16;
    if (compression == Compression::bf16 && is_floating(wire)) wire = DType::bf16;
    Tensor values = Tensor::from_vector(mine.values, {static_cast<std::int64_t>(mine.values.size())}).to(wire);
    std::vector<std::int64_t> value_counts;
    for (const std::int64_t count : counts) value_counts.push_back(count * row);
    Tensor all_values = Tensor::zeros({total * row}, wire);
    comm.allgatherv_host(values, all_values, value_counts);

    std::vector<double> dense = zeros_like(*parameter);
    const std::vector<double> gathered = all_values.to_double_vector();
    add_rows(dense, all_indices.data_as<std::int64_t>(), static_cast<std::size_t>(total), gathered.data(), row);
    if (average) {
      for (double& value : dense) value /= comm.size();
    }
    write_gradient(*parameter, dense);
    mine = Rows{};
  }
}

void SparseGradients::densify_locally(const std::vector<Parameter*>& parameters) {
  for (Parameter* parameter : parameters) {
    auto found = rows_.find(parameter);
    if (found == rows_.end() || found->second.indices.empty()) continue;
    std::vector<double> dense = zeros_like(*parameter);
    add_rows(dense, found->second.indices.data(), found->second.indices.size(), found->second.values.data(),
             row_elements(*parameter));
    write_gradient(*parameter, dense);
    found->second = Rows{};
  }
}

}  // namespace gradsync::dist
