// Shared description of one fused reduction, used by the CPU kernel, the CUDA kernel and the
// binding that builds it. Plain C++ on purpose: no torch or CUDA headers, so nvcc can compile
// the CUDA kernel on its own.
#pragma once

#include <cstdint>

struct CUstream_st;  // cudaStream_t is a CUstream_st*; declared here to keep CUDA headers out.

#ifdef __CUDACC__
#define MINIDP_HOST_DEVICE __host__ __device__
#else
#define MINIDP_HOST_DEVICE
#endif

namespace minidp {

// Element types the kernels support. Half types accumulate in float32 and round once at the end.
enum DType : int64_t { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

// Every tensor starts at a multiple of kGroup in the flat index space (see ReduceTable), so a
// group of kGroup elements never straddles two tensors and, when the base pointers are 16-byte
// aligned, a group's start is too (8 elements >= 16 bytes for every type above except float16,
// whose group is exactly 16 bytes).
constexpr int64_t kGroup = 8;

// One reduction out[i] = in[0][i] + in[1][i] + ... + in[K-1][i] for N tensors i, flattened into
// int64 arrays so the same table works on the host and, copied as-is, on the GPU.
//   records: N records of (K + 3) int64: [numel, dtype, out_ptr, in_ptr_0, ..., in_ptr_{K-1}]
//   offsets: N + 1 int64; tensor i owns flat indices [offsets[i], offsets[i] + numel) and the
//            padding up to offsets[i + 1]. offsets[0] = 0, every offset is a multiple of kGroup.
struct ReduceTable {
  const int64_t* records;
  const int64_t* offsets;
  int64_t num_tensors;   // N
  int64_t num_replicas;  // K >= 1
  int64_t total;         // offsets[N], kept here because offsets may live on the GPU

  MINIDP_HOST_DEVICE int64_t record_size() const { return num_replicas + 3; }
};

// Sums on the calling CPU thread plus ATen's intra-op thread pool. All pointers are host pointers.
void reduce_add_cpu(const ReduceTable& table);

// The CUDA kernel works on blocks of kCudaChunk flat elements; chunk c starts in tensor
// chunk_first_tensor[c] (num_chunks + 1 entries, the last one is N - 1).
constexpr int64_t kCudaChunk = 8192;

// Launches the reduction on `stream`. Every pointer in `table` and `chunk_first_tensor` must be
// readable from the current device (device memory, or peer memory with peer access enabled).
// Returns nullptr on success, else the CUDA error string of the launch.
const char* reduce_add_cuda(const ReduceTable& table, const int64_t* chunk_first_tensor,
                            int64_t num_chunks, CUstream_st* stream);

}  // namespace minidp
