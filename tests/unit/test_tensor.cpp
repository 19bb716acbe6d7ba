// Tensors: shapes, ownership, views and offsets, copies, and the errors around them.
#include "gradsync/core/tensor.h"

#include <limits>
#include <thread>

#include "test_util.h"

namespace gradsync {
namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::f32), 4u);
  EXPECT_EQ(dtype_size(DType::f64), 8u);
  EXPECT_EQ(dtype_size(DType::f16), 2u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::i32), 4u);
  EXPECT_EQ(dtype_size(DType::i64), 8u);
  for (DType dtype : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64}) {
    EXPECT_EQ(dtype_from_safetensors_name(dtype_safetensors_name(dtype)), dtype);
  }
  EXPECT_STREQ(dtype_safetensors_name(DType::bf16), "BF16");
  EXPECT_GRADSYNC_ERROR(dtype_from_safetensors_name("U8"), "unsupported dtype 'U8'");
}

TEST(Device, ParseAndPrint) {
  EXPECT_EQ(Device::parse("cpu"), Device::cpu());
  EXPECT_EQ(Device::parse("cuda"), Device::cuda(0));
  EXPECT_EQ(Device::parse("cuda:3"), Device::cuda(3));
  EXPECT_EQ(Device::cuda(2).str(), "cuda:2");
  EXPECT_GRADSYNC_ERROR(Device::parse("cuda:x"), "cuda:x");
  EXPECT_GRADSYNC_ERROR(Device::parse("gpu"), "cannot parse device 'gpu'");
  EXPECT_GRADSYNC_ERROR(Device::parse("cuda:-1"), "cuda:-1");
}

TEST(Shape, NumelAndOverflow) {
  EXPECT_EQ(shape_numel({}), 1);
  EXPECT_EQ(shape_numel({0, 5}), 0);
  EXPECT_EQ(shape_numel({2, 3, 4}), 24);
  EXPECT_GRADSYNC_ERROR(shape_numel({-1, 2}), "negative dimension", "[-1, 2]");
  const std::int64_t big = std::int64_t{1} << 40;
  EXPECT_GRADSYNC_ERROR(shape_numel({big, big}), "more elements than fit");
}

TEST(Tensor, OwningTensorBasics) {
  Tensor tensor = Tensor::zeros({3, 4}, DType::f64);
  EXPECT_TRUE(tensor.defined());
  EXPECT_EQ(tensor.numel(), 12);
  EXPECT_EQ(tensor.nbytes(), 96u);
  EXPECT_EQ(tensor.dim(1), 4);
  EXPECT_FALSE(tensor.is_view());
  EXPECT_EQ(tensor.storage_offset(), 0u);
  EXPECT_EQ(tensor.describe(), "f64[3, 4] on cpu");
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(tensor.data()) % 256, 0u) << "host allocations are 256-byte aligned";
  for (double value : tensor.to_double_vector()) EXPECT_EQ(value, 0.0);
  EXPECT_GRADSYNC_ERROR(tensor.dim(2), "axis 2 out of range", "f64[3, 4]");
  EXPECT_GRADSYNC_ERROR(tensor.data_as<float>(), "accessed as f32");
  EXPECT_FALSE(Tensor().defined());
  EXPECT_GRADSYNC_ERROR(Tensor().data(), "empty tensor");
}

TEST(Tensor, ViewsShareStorageAtAnOffset) {
  Tensor base = Tensor::from_vector(std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, {10});
  Tensor view = base.view(4, {2, 3});
  EXPECT_TRUE(view.is_view());
  EXPECT_TRUE(view.shares_storage_with(base));
  EXPECT_EQ(view.storage_offset(), 4u);
  EXPECT_EQ(view.data_as<float>(), base.data_as<float>() + 4);
  view.data_as<float>()[0] = 40.0f;
  EXPECT_EQ(base.data_as<float>()[4], 40.0f);

  // A view of a view adds offsets.
  Tensor inner = view.view(2, {3});
  EXPECT_EQ(inner.storage_offset(), 6u);
  EXPECT_EQ(inner.to_double_vector(), (std::vector<double>{6, 7, 8}));

  // Views keep the storage alive after the base handle is gone.
  Tensor survivor;
  {
    Tensor temporary = Tensor::from_vector(std::vector<double>{1, 2, 3}, {3});
    survivor = temporary.view(1, {2});
  }
  EXPECT_EQ(survivor.to_double_vector(), (std::vector<double>{2, 3}));

  EXPECT_GRADSYNC_ERROR(base.view(8, {3}), "out of range", "f32[10]");
  EXPECT_GRADSYNC_ERROR(base.view(11, {0}), "out of range");
  EXPECT_EQ(base.view(10, {0}).numel(), 0);
}

TEST(Tensor, ReshapeKeepsElements) {
  Tensor base = Tensor::from_vector(std::vector<double>{1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor reshaped = base.reshape({3, 2});
  EXPECT_TRUE(reshaped.shares_storage_with(base));
  EXPECT_EQ(reshaped.shape(), (Shape{3, 2}));
  EXPECT_EQ(base.flatten().shape(), (Shape{6}));
  EXPECT_GRADSYNC_ERROR(base.reshape({4, 2}), "cannot reshape f64[2, 3] on cpu to [4, 2]");
}

TEST(Tensor, CloneAndCopyAreDeep) {
  Tensor base = Tensor::from_vector(std::vector<float>{1, 2, 3}, {3});
  Tensor copy = base.clone();
  EXPECT_FALSE(copy.shares_storage_with(base));
  copy.data_as<float>()[0] = 9;
  EXPECT_EQ(base.data_as<float>()[0], 1);

  // to(cpu) on a cpu tensor is the same handle, not a copy.
  EXPECT_TRUE(base.to(Device::cpu()).shares_storage_with(base));

  Tensor destination = Tensor::zeros({3}, DType::f32);
  destination.copy_from(base);
  EXPECT_EQ(destination.to_double_vector(), (std::vector<double>{1, 2, 3}));
  EXPECT_GRADSYNC_ERROR(destination.copy_from(Tensor::zeros({3}, DType::f64)), "dtype and element count must match");
  EXPECT_GRADSYNC_ERROR(destination.copy_from(Tensor::zeros({4}, DType::f32)), "f32[4]", "f32[3]");
}

TEST(Tensor, WrapBorrowsMemory) {
  std::vector<double> engine_buffer{1, 2, 3, 4};
  {
    Tensor wrapped = Tensor::wrap(engine_buffer.data(), {2, 2}, DType::f64);
    EXPECT_TRUE(wrapped.is_view());
    wrapped.data_as<double>()[3] = 40;
  }  // the wrapped handle is gone; the engine's buffer is still valid and was written through
  EXPECT_EQ(engine_buffer[3], 40);
  EXPECT_GRADSYNC_ERROR(Tensor::wrap(nullptr, {2}, DType::f32), "null pointer");
}

// Paged memory costs the pages written; zero_releasing_pages gives the whole pages of a view
// back (they read as zeros) and writes zeros into the partial ones, leaving the rest alone.
TEST(Tensor, PagedMemoryIsCommittedWhenWrittenAndGivenBack) {
  const std::int64_t n = 1 << 20;  // 4 MiB of f32
  Tensor paged = Tensor::zeros_paged({n}, DType::f32);
  EXPECT_EQ(testing::resident_bytes(paged), 0) << "nothing written yet";
  EXPECT_EQ(paged.to_double_vector()[12345], 0.0);
  float* data = paged.data_as<float>();
  for (std::int64_t i = 0; i < n; ++i) data[i] = 1.0f + static_cast<float>(i % 7);
  EXPECT_EQ(testing::resident_bytes(paged), n * 4);

  // A view that starts and ends inside pages: [1000, n - 100). Only the two partial pages at
  // its ends stay resident (resident_bytes counts the zero page that reading a given-back page
  // maps, so the contents are read after the counts).
  Tensor middle = paged.view(1000, {n - 1100});
  middle.zero_releasing_pages();
  const std::int64_t page = sysconf(_SC_PAGESIZE);
  EXPECT_EQ(testing::resident_bytes(paged), 2 * page);
  data[n / 2] = 5.0f;  // written again, a page is committed again
  EXPECT_EQ(testing::resident_bytes(paged), 3 * page);
  for (std::int64_t i = 0; i < n; ++i) {
    const float expected = i < 1000 || i >= n - 100 ? 1.0f + static_cast<float>(i % 7) : i == n / 2 ? 5.0f : 0.0f;
    ASSERT_EQ(data[i], expected) << "element " << i;
  }

  // Ordinary memory: the same call is a zero fill.
  Tensor ordinary = Tensor::from_vector(std::vector<float>{1, 2, 3, 4}, {4});
  ordinary.view(1, {2}).zero_releasing_pages();
  EXPECT_EQ(ordinary.to_double_vector(), (std::vector<double>{1, 0, 0, 4}));
  // A tiny view inside one page of paged memory.
  Tensor small = Tensor::zeros_paged({16}, DType::f64);
  small.data_as<double>()[3] = 2.0;
  small.view(2, {4}).zero_releasing_pages();
  EXPECT_EQ(small.to_double_vector()[3], 0.0);
}

TEST(Tensor, CudaWithoutDeviceIsAClearError) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is present; the gpu suite covers it";
  EXPECT_GRADSYNC_ERROR(Tensor::zeros({4}, DType::f32, Device::cuda(0)), "cuda:0", "not usable");
  EXPECT_GRADSYNC_ERROR(Tensor::zeros({4}, DType::f32, Device::cuda(7)), "cuda:7");
  EXPECT_FALSE(cuda_unavailable_reason().empty());
}

TEST(Error, CarriesTheThreadRank) {
  std::string message;
  std::thread worker([&] {
    ThreadRankScope rank(3);
    try {
      Tensor().data();
    } catch (const Error& error) {
      message = error.what();
    }
  });
  worker.join();
  EXPECT_EQ(message.rfind("rank 3: ", 0), 0u) << message;
  EXPECT_EQ(thread_rank(), -1) << "the label is per thread";
}

}  // namespace
}  // namespace gradsync
