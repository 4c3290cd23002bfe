// CUDA kernel: one launch reduces every tensor of the table, however many there are.
//
// The flat index space of the ReduceTable (all tensors end to end, each padded to kGroup) is cut
// into chunks of kCudaChunk elements, one thread block per chunk. A thread handles kGroup
// consecutive elements at a time: it reads them from each replica in turn (16-byte loads when
// the pointers allow), adds in replica order in the accumulator type, and writes them once.
// Plain CUDA C++: nvcc compiles this file without torch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "reduce_add.h"

namespace minidp {
namespace {

constexpr int kThreads = 256;
static_assert(kCudaChunk % (kThreads * kGroup) == 0, "a chunk is whole block-wide steps");

// Accumulator type of each element type, and the conversions to and from it. Half types round
// to nearest even once, at the end, as torch's float32-to-half conversion does.
template <typename T>
struct Acc {
  using type = T;
  __device__ static T widen(T x) { return x; }
  __device__ static T narrow(T x) { return x; }
};
template <>
struct Acc<__half> {
  using type = float;
  __device__ static float widen(__half x) { return __half2float(x); }
  __device__ static __half narrow(float x) { return __float2half_rn(x); }
};
template <>
struct Acc<__nv_bfloat16> {
  using type = float;
  __device__ static float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 narrow(float x) { return __float2bfloat16_rn(x); }
};

// kGroup elements in registers; 16-byte aligned so it can be moved as uint4 words.
template <typename T>
struct alignas(16) Group {
  static constexpr int kWords = kGroup * sizeof(T) / 16;
  T v[kGroup];
};

// Loads n <= kGroup elements; `vector` means n == kGroup and p is 16-byte aligned.
template <typename T>
__device__ void load_group(const T* p, int n, bool vector, Group<T>& g) {
  if (vector) {
#pragma unroll
    for (int w = 0; w < Group<T>::kWords; ++w) {
      reinterpret_cast<uint4*>(g.v)[w] = reinterpret_cast<const uint4*>(p)[w];
    }
  } else {
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
      g.v[e] = e < n ? p[e] : T{};  // zero; not T(0): torch builds with -D__CUDA_NO_HALF_CONVERSIONS__
    }
  }
}

template <typename T>
__device__ void store_group(T* p, int n, bool vector, const Group<T>& g) {
  if (vector) {
#pragma unroll
    for (int w = 0; w < Group<T>::kWords; ++w) {
      reinterpret_cast<uint4*>(p)[w] = reinterpret_cast<const uint4*>(g.v)[w];
    }
  } else {
#pragma unroll
    for (int e = 0; e < kGroup; ++e) {
      if (e < n) p[e] = g.v[e];
    }
  }
}

// out[local + e] = in_0[local + e] + ... + in_{K-1}[local + e] for e < n, for one tensor.
template <typename T>
__device__ void sum_group(const int64_t* record, int64_t num_replicas, int64_t local, int n) {
  using A = Acc<T>;
  auto input = [&](int64_t k) { return reinterpret_cast<const T*>(record[3 + k]) + local; };
  T* out = reinterpret_cast<T*>(record[2]) + local;

  bool vector = n == kGroup && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  for (int64_t k = 0; k < num_replicas; ++k) {
    vector = vector && reinterpret_cast<uintptr_t>(input(k)) % 16 == 0;
  }

  Group<T> g;
  typename A::type acc[kGroup];
  load_group(input(0), n, vector, g);
#pragma unroll
  for (int e = 0; e < kGroup; ++e) acc[e] = A::widen(g.v[e]);
  for (int64_t k = 1; k < num_replicas; ++k) {
    load_group(input(k), n, vector, g);
#pragma unroll
    for (int e = 0; e < kGroup; ++e) acc[e] = acc[e] + A::widen(g.v[e]);
  }
#pragma unroll
  for (int e = 0; e < kGroup; ++e) g.v[e] = A::narrow(acc[e]);
  store_group(out, n, vector, g);
}

__global__ void reduce_add_kernel(ReduceTable table, const int64_t* chunk_first_tensor) {
  const int64_t chunk = blockIdx.x;
  const int64_t first = chunk_first_tensor[chunk];
  const int64_t last = chunk_first_tensor[chunk + 1];
  const int64_t chunk_end = min((chunk + 1) * kCudaChunk, table.total);

  for (int64_t pos = chunk * kCudaChunk + threadIdx.x * kGroup; pos < chunk_end;
       pos += kThreads * kGroup) {
    // The tensor holding pos: the last one in [first, last] that starts at or before it.
    int64_t t = first;
    for (int64_t hi = last; t < hi;) {
      const int64_t mid = (t + hi + 1) / 2;
      if (table.offsets[mid] <= pos) t = mid; else hi = mid - 1;
    }
    const int64_t* record = table.records + t * table.record_size();
    const int64_t local = pos - table.offsets[t];
    const int n = static_cast<int>(min(kGroup, record[0] - local));
    if (n <= 0) continue;  // padding after the tensor's last element
    switch (record[1]) {
      case kFloat32: sum_group<float>(record, table.num_replicas, local, n); break;
      case kFloat64: sum_group<double>(record, table.num_replicas, local, n); break;
      case kFloat16: sum_group<__half>(record, table.num_replicas, local, n); break;
      case kBFloat16: sum_group<__nv_bfloat16>(record, table.num_replicas, local, n); break;
    }
  }
}

}  // namespace

const char* reduce_add_cuda(const ReduceTable& table, const int64_t* chunk_first_tensor,
                            int64_t num_chunks, CUstream_st* stream) {
  reduce_add_kernel<<<static_cast<unsigned int>(num_chunks), kThreads, 0, stream>>>(
      table, chunk_first_tensor);
  const cudaError_t error = cudaGetLastError();
  return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace minidp
