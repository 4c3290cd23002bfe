// CPU kernel: one pass over all tensors, K reads and one write per element.
//
// ATen's SIMD types pick their instruction set from CPU_CAPABILITY_* macros, which the loader
// sets (with matching -m flags) for the machine it builds on.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "reduce_add.h"

namespace minidp {
namespace {

// out[0:n] = in_0[0:n] + ... + in_{K-1}[0:n] for one tensor's run of elements starting at
// `local`, added in replica order. Half types widen to float32 and round once when storing.
template <typename scalar_t>
void sum_run(const int64_t* record, int64_t num_replicas, int64_t local, int64_t n) {
  using Vec = at::vec::Vectorized<scalar_t>;
  auto input = [&](int64_t k) { return reinterpret_cast<const scalar_t*>(record[3 + k]) + local; };
  scalar_t* out = reinterpret_cast<scalar_t*>(record[2]) + local;

  for (int64_t i = 0; i < n; i += Vec::size()) {
    // The last step of a run is partial; loadu/store with a count touch only that many elements.
    const int count = static_cast<int>(std::min<int64_t>(Vec::size(), n - i));
    if constexpr (c10::is_reduced_floating_point_v<scalar_t>) {
      auto [acc_lo, acc_hi] = at::vec::convert_to_float<scalar_t>(Vec::loadu(input(0) + i, count));
      for (int64_t k = 1; k < num_replicas; ++k) {
        auto [lo, hi] = at::vec::convert_to_float<scalar_t>(Vec::loadu(input(k) + i, count));
        acc_lo = acc_lo + lo;
        acc_hi = acc_hi + hi;
      }
      at::vec::convert_from_float<scalar_t>(acc_lo, acc_hi).store(out + i, count);
    } else {
      Vec acc = Vec::loadu(input(0) + i, count);
      for (int64_t k = 1; k < num_replicas; ++k) {
        acc = acc + Vec::loadu(input(k) + i, count);
      }
      acc.store(out + i, count);
    }
  }
}

void sum_run_any(const int64_t* record, int64_t num_replicas, int64_t local, int64_t n) {
  switch (record[1]) {
    case kFloat32: return sum_run<float>(record, num_replicas, local, n);
    case kFloat64: return sum_run<double>(record, num_replicas, local, n);
    case kFloat16: return sum_run<c10::Half>(record, num_replicas, local, n);
    case kBFloat16: return sum_run<c10::BFloat16>(record, num_replicas, local, n);
  }
}

}  // namespace

void reduce_add_cpu(const ReduceTable& table) {
  const int64_t* offsets = table.offsets;
  // Threads split the flat index space (all tensors end to end), so one huge tensor and thousands
  // of tiny ones spread over the threads alike. Below one grain the work stays on this thread.
  constexpr int64_t kGrainGroups = 32768 / kGroup;  // ATen's grain for element-wise kernels
  at::parallel_for(0, table.total / kGroup, kGrainGroups, [&](int64_t group_begin, int64_t group_end) {
    int64_t pos = group_begin * kGroup;
    const int64_t end = group_end * kGroup;
    // The tensor holding `pos`: the last one starting at or before it (empty tensors share
    // their start with the next one, so upper_bound skips them).
    int64_t t = std::upper_bound(offsets, offsets + table.num_tensors + 1, pos) - offsets - 1;
    for (; pos < end; ++t) {
      const int64_t* record = table.records + t * table.record_size();
      const int64_t run_end = std::min(end, offsets[t + 1]);
      const int64_t local = pos - offsets[t];
      const int64_t n = std::min(run_end - pos, record[0] - local);  // stop before the padding
      if (n > 0) {
        sum_run_any(record, table.num_replicas, local, n);
      }
      pos = run_end;
    }
  });
}

}  // namespace minidp
