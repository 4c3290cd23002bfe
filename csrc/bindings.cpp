// Python binding: checks the inputs, gets every input where the destination's kernel can read
// it, builds the ReduceTable and runs the CPU or the CUDA kernel.
//
// The CUDA half is compiled only with -DMINIDP_WITH_CUDA, so a CPU build needs no CUDA headers.
#include <c10/core/CPUAllocator.h>
#include <torch/extension.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#ifdef MINIDP_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/PeerToPeerAccess.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include "reduce_add.h"

namespace minidp {
namespace {

using TensorList = std::vector<at::Tensor>;

// Error messages are joined as plain strings (numbers through std::to_string) and raised as Python's
// ValueError, TypeError or RuntimeError; never through TORCH_CHECK or any other std::ostream. A compiler
// that links its own copy of the C++ library into the extension (g++ -static-libstdc++, as the wrapper
// some CUDA images set as CXX does) gets streams that look up torch's shared locale facets by the wrong
// index: numbers written to them vanish from the message, or the process crashes (seen on such a
// machine: SIGSEGV inside std::ostream's number formatting, from the first check that failed).
std::string piece(const std::string& text) { return text; }
std::string piece(const char* text) { return text; }
template <typename Number, typename = std::enable_if_t<std::is_integral_v<Number>>>
std::string piece(Number number) {
  return std::to_string(number);
}
template <typename... Pieces>
std::string message(const Pieces&... pieces) {
  return (std::string() + ... + piece(pieces));
}

// Raises `error` (py::value_error, py::type_error or std::runtime_error) with the joined message when
// `condition` is false; the message is only built then.
#define MINIDP_REQUIRE(condition, error, ...)               \
  do {                                                    \
    if (!(condition)) throw error(message(__VA_ARGS__)); \
  } while (false)

// "(4, 5)", "(7,)", "()": shapes written the way Python prints them.
std::string shape_str(at::IntArrayRef shape) {
  std::string out = "(";
  for (size_t d = 0; d < shape.size(); ++d) {
    out += (d ? ", " : "") + std::to_string(shape[d]);
  }
  return out + (shape.size() == 1 ? ",)" : ")");
}

// "torch.float32": the dtype's Python name (needs the GIL).
std::string dtype_str(at::ScalarType dtype) {
  return py::str(py::cast(dtype)).cast<std::string>();
}

bool to_dtype(at::ScalarType dtype, DType* out) {
  switch (dtype) {
    case at::kFloat: *out = kFloat32; return true;
    case at::kDouble: *out = kFloat64; return true;
    case at::kHalf: *out = kFloat16; return true;
    case at::kBFloat16: *out = kBFloat16; return true;
    default: return false;
  }
}

// Every replica holds the same number of tensors, and tensor i has one shape and one supported
// dtype in all replicas. Errors name the tensor and the replica.
void check_inputs(const std::vector<TensorList>& inputs) {
  MINIDP_REQUIRE(!inputs.empty(), py::value_error, "reduce_add needs at least one replica, got none");
  const TensorList& first = inputs[0];
  for (size_t k = 1; k < inputs.size(); ++k) {
    MINIDP_REQUIRE(inputs[k].size() == first.size(), py::value_error, "replica ", k, " has ",
                   inputs[k].size(), " tensors but replica 0 has ", first.size());
  }
  for (size_t i = 0; i < first.size(); ++i) {
    DType unused;
    MINIDP_REQUIRE(to_dtype(first[i].scalar_type(), &unused), py::type_error, "tensor ", i,
                   " of replica 0 has dtype ", dtype_str(first[i].scalar_type()),
                   "; supported are torch.float32, torch.float64, torch.float16 and torch.bfloat16");
    for (size_t k = 0; k < inputs.size(); ++k) {
      const at::Tensor& t = inputs[k][i];
      MINIDP_REQUIRE(t.layout() == at::kStrided, py::value_error, "tensor ", i, " of replica ", k,
                     " is not dense (its layout is not torch.strided)");
      MINIDP_REQUIRE(t.scalar_type() == first[i].scalar_type(), py::type_error, "tensor ", i,
                     " of replica ", k, " has dtype ", dtype_str(t.scalar_type()),
                     " but replica 0's has ", dtype_str(first[i].scalar_type()));
      MINIDP_REQUIRE(t.sizes() == first[i].sizes(), py::value_error, "tensor ", i, " of replica ", k,
                     " has shape ", shape_str(t.sizes()), " but replica 0's has ",
                     shape_str(first[i].sizes()));
    }
  }
}

// Whether a kernel running on `reader` may dereference memory of `owner`.
bool can_read_directly(at::Device owner, at::Device reader) {
  if (owner == reader) {
    return true;
  }
#ifdef MINIDP_WITH_CUDA
  if (owner.is_cuda() && reader.is_cuda()) {
    // Enables peer access from `reader` to `owner` the first time, as torch's own copies do.
    return at::cuda::get_p2p_access(reader.index(), owner.index());
  }
#endif
  return false;
}

// A contiguous tensor with t's values that a kernel on `destination` can read: t itself when it
// already is one, otherwise a copy (torch's copy orders itself after both devices' streams).
at::Tensor readable_on(const at::Tensor& t, at::Device destination) {
  at::Tensor dense = t.contiguous();
  return can_read_directly(dense.device(), destination) ? dense : dense.to(destination);
}

// Host copy of a ReduceTable (see reduce_add.h), laid out in one buffer so it can be uploaded
// to the GPU in one copy: records, then offsets.
struct HostTable {
  std::vector<int64_t> data;
  int64_t num_tensors = 0;
  int64_t num_replicas = 0;

  HostTable(const std::vector<TensorList>& inputs, const TensorList& outputs)
      : num_tensors(static_cast<int64_t>(outputs.size())),
        num_replicas(static_cast<int64_t>(inputs.size())) {
    const int64_t record_size = num_replicas + 3;
    data.resize(num_tensors * record_size + num_tensors + 1);
    int64_t* offsets = data.data() + num_tensors * record_size;
    offsets[0] = 0;
    for (int64_t i = 0; i < num_tensors; ++i) {
      int64_t* record = data.data() + i * record_size;
      DType dtype;
      to_dtype(outputs[i].scalar_type(), &dtype);
      record[0] = outputs[i].numel();
      record[1] = dtype;
      record[2] = reinterpret_cast<int64_t>(outputs[i].data_ptr());
      for (int64_t k = 0; k < num_replicas; ++k) {
        record[3 + k] = reinterpret_cast<int64_t>(inputs[k][i].data_ptr());
      }
      const int64_t padded = (record[0] + kGroup - 1) / kGroup * kGroup;
      offsets[i + 1] = offsets[i] + padded;
    }
  }

  // The same table seen through `base`, a copy of `data` (on the host or on the GPU).
  ReduceTable view(const int64_t* base) const {
    const int64_t records_size = num_tensors * (num_replicas + 3);
    return ReduceTable{base, base + records_size, num_tensors, num_replicas,
                       data[records_size + num_tensors]};
  }
};

#ifdef MINIDP_WITH_CUDA
// Runs the CUDA kernel on the destination's current stream.
void reduce_add_on_gpu(const std::vector<TensorList>& inputs, const TensorList& outputs,
                       const HostTable& host) {
  const at::Device destination = outputs[0].device();
  c10::cuda::CUDAGuard guard(destination);
  const at::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream(destination.index());

  // Inputs read in place from another GPU: start after the work already queued on that GPU's
  // current stream, and keep its allocator from reusing the memory before our kernel is done.
  std::vector<bool> waited(at::cuda::device_count(), false);
  for (const TensorList& replica : inputs) {
    for (const at::Tensor& t : replica) {
      if (t.device() == destination || t.numel() == 0) {
        continue;
      }
      if (!waited[t.device().index()]) {
        at::cuda::CUDAEvent ready;
        ready.record(at::cuda::getCurrentCUDAStream(t.device().index()));
        ready.block(stream);
        waited[t.device().index()] = true;
      }
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
    }
  }

  // Chunk c covers flat elements [c * kCudaChunk, (c + 1) * kCudaChunk); record the tensor that
  // holds its first element so a GPU block searches only the few tensors inside its chunk.
  const ReduceTable on_host = host.view(host.data.data());
  const int64_t num_chunks = (on_host.total + kCudaChunk - 1) / kCudaChunk;
  if (num_chunks == 0) {
    return;
  }
  std::vector<int64_t> upload = host.data;
  const int64_t chunk_table_start = static_cast<int64_t>(upload.size());
  for (int64_t c = 0, t = 0; c <= num_chunks; ++c) {
    const int64_t start = std::min(c * kCudaChunk, on_host.total - 1);
    while (on_host.offsets[t + 1] <= start) {
      ++t;
    }
    upload.push_back(t);
  }

  // One pinned buffer, one asynchronous copy; torch keeps the pinned block alive until the
  // copy has run, and the device copy is freed in stream order after the kernel.
  at::Tensor staging = at::empty({static_cast<int64_t>(upload.size())},
                                 at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::copy(upload.begin(), upload.end(), staging.data_ptr<int64_t>());
  at::Tensor on_device = staging.to(destination, /*non_blocking=*/true);
  const int64_t* base = on_device.const_data_ptr<int64_t>();

  const char* error = reduce_add_cuda(host.view(base), base + chunk_table_start, num_chunks,
                                      stream.stream());
  MINIDP_REQUIRE(error == nullptr, std::runtime_error, "reduce_add: CUDA kernel launch failed: ", error);
}
#endif

// Writes outputs[i] = inputs[0][i] + ... + inputs[K-1][i]. Inputs are already checked; outputs
// are contiguous, on one device, and match replica 0's tensors.
void reduce_add_checked(const std::vector<TensorList>& inputs, const TensorList& outputs) {
  if (outputs.empty()) {
    return;
  }
  const at::Device destination = outputs[0].device();
  std::vector<TensorList> readable(inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    for (const at::Tensor& t : inputs[k]) {
      readable[k].push_back(readable_on(t, destination));
    }
  }
  const HostTable host(readable, outputs);
  if (destination.is_cpu()) {
    reduce_add_cpu(host.view(host.data.data()));
    return;
  }
#ifdef MINIDP_WITH_CUDA
  if (destination.is_cuda()) {
    reduce_add_on_gpu(readable, outputs, host);
    return;
  }
#endif
  throw py::value_error(message("reduce_add: this build cannot reduce onto ", destination.str()));
}

// outputs[i] = sum over replicas k of inputs[k][i], written into existing tensors.
void reduce_add_into(const std::vector<TensorList>& inputs, const TensorList& outputs) {
  check_inputs(inputs);
  MINIDP_REQUIRE(outputs.size() == inputs[0].size(), py::value_error, "got ", outputs.size(),
                 " outputs for ", inputs[0].size(), " tensors per replica");
  for (size_t i = 0; i < outputs.size(); ++i) {
    const at::Tensor& out = outputs[i];
    const at::Tensor& like = inputs[0][i];
    MINIDP_REQUIRE(out.device() == outputs[0].device(), py::value_error, "output ", i, " is on ",
                   out.device().str(), " but output 0 is on ", outputs[0].device().str());
    MINIDP_REQUIRE(out.scalar_type() == like.scalar_type(), py::type_error, "output ", i,
                   " has dtype ", dtype_str(out.scalar_type()), " but tensor ", i, " has ",
                   dtype_str(like.scalar_type()));
    MINIDP_REQUIRE(out.sizes() == like.sizes(), py::value_error, "output ", i, " has shape ",
                   shape_str(out.sizes()), " but tensor ", i, " has ", shape_str(like.sizes()));
    MINIDP_REQUIRE(out.is_contiguous(), py::value_error, "output ", i, " is not contiguous");
  }
  py::gil_scoped_release no_gil;
  reduce_add_checked(inputs, outputs);
}

// A fresh output's pages are mapped on its first write, inside the kernel, and for a big tensor
// those 4 KiB page faults cost as much as the sums. Asking for transparent huge pages first
// (the hint torch gives itself under THP_MEM_ALLOC_ENABLE=1) makes them 512 times fewer. Only
// whole 2 MiB pages inside the memory are advised; it does nothing where THP is off.
void prefer_huge_pages(void* data, size_t nbytes) {
#ifdef __linux__
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const auto start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (start + nbytes) & ~(kHugePage - 1);
  if (end > begin) {
    madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }
#endif
}

// Where the sums of a CPU reduction are written: memory that stays mapped from one step to the
// next, as DDP's gradient buckets do, handed out again only once nobody can see it any more.
//
// A step's sums are all carved out of one block of memory (a Storage). Each sum is a tensor of
// its own over that Storage (its own TensorImpl and version counter, not a view of another
// tensor), so the Storage's use count is 1 (the pool) plus one per tensor still alive anywhere:
// a sum the user keeps as .grad, a view of one, a graph that saved one. A block is reused only
// when that count is back to 1, so nothing the user still holds is ever written again; otherwise
// the call takes another block (a fresh one, mapped by the kernel on first write). Freshly
// allocated memory costs a page fault and a zero-fill per page inside the reduction, about one
// more write of every sum: reusing a block is what brings a reduction to the copy-bandwidth floor.
//
// At most `max_blocks` blocks are kept; a new one beyond that drops the least recently used
// (its memory is freed when the last tensor over it goes). GPU sums are fresh tensors: the CUDA
// caching allocator already hands out memory that is mapped.
class OutputPool {
 public:
  explicit OutputPool(int64_t max_blocks) : max_blocks_(max_blocks) {
    MINIDP_REQUIRE(max_blocks >= 1, py::value_error, "OutputPool needs max_blocks >= 1, got ", max_blocks);
  }

  // Fresh tensors on `destination` holding the sums, one per position, shaped like replica 0's.
  TensorList reduce_add(const std::vector<TensorList>& inputs, at::Device destination) {
    check_inputs(inputs);
    last_block_ = 0;
    TensorList outputs = destination.is_cpu() ? carve(inputs[0]) : fresh(inputs[0], destination);
    py::gil_scoped_release no_gil;
    reduce_add_checked(inputs, outputs);
    return outputs;
  }

  // Bytes of the blocks the pool holds, whether in use or free.
  int64_t held_bytes() const {
    int64_t total = 0;
    for (const c10::Storage& block : blocks_) {
      total += static_cast<int64_t>(block.nbytes());
    }
    return total;
  }

  // Drops every block: a block still in use is freed when its last tensor goes.
  void clear() { blocks_.clear(); }

  // The address of the block the last call wrote its CPU sums into (0 for sums on a GPU, fresh tensors), and
  // whether an earlier call made it: memory held between the calls, not allocated by this one (what a memory
  // ledger needs to know of the sums).
  std::pair<int64_t, bool> last_block() const { return {last_block_, last_block_taken_again_}; }
  void forget_last_block() {
    last_block_ = 0;
    last_block_taken_again_ = false;
  }

 private:
  // Each sum starts on a cache line of its own (as at::empty's allocations do).
  static constexpr int64_t kAlign = 64;

  static TensorList fresh(const TensorList& like, at::Device destination) {
    TensorList outputs;
    outputs.reserve(like.size());
    for (const at::Tensor& t : like) {
      outputs.push_back(at::empty(t.sizes(), t.options().device(destination)));
    }
    return outputs;
  }

  // The sums as tensors over one free block of the pool (taken, or allocated and kept).
  TensorList carve(const TensorList& like) {
    std::vector<int64_t> offsets(like.size());
    int64_t nbytes = 0;
    for (size_t i = 0; i < like.size(); ++i) {
      offsets[i] = nbytes;
      nbytes += (static_cast<int64_t>(like[i].numel()) * like[i].element_size() + kAlign - 1) / kAlign * kAlign;
    }
    c10::Storage block = take(nbytes);
    TensorList outputs;
    outputs.reserve(like.size());
    for (size_t i = 0; i < like.size(); ++i) {
      const at::Tensor& t = like[i];
      at::Tensor out = at::empty({0}, t.options().device(at::kCPU));
      out.set_(block, offsets[i] / t.element_size(), t.sizes());
      outputs.push_back(std::move(out));
    }
    return outputs;
  }

  // The smallest free block of at least `nbytes`, made most recently used; else a new one.
  c10::Storage take(int64_t nbytes) {
    auto best = blocks_.end();
    for (auto it = blocks_.begin(); it != blocks_.end(); ++it) {
      const bool free = unused(*it) && static_cast<int64_t>(it->nbytes()) >= nbytes;
      if (free && (best == blocks_.end() || it->nbytes() < best->nbytes())) {
        best = it;
      }
    }
    c10::Storage block;
    if (best != blocks_.end()) {
      block = *best;
      blocks_.erase(best);
      last_block_taken_again_ = true;
    } else {
      block = c10::Storage(c10::Storage::use_byte_size_t(), nbytes, c10::GetCPUAllocator(),
                           /*resizable=*/false);
      prefer_huge_pages(block.mutable_data(), block.nbytes());
      if (static_cast<int64_t>(blocks_.size()) == max_blocks_) {
        blocks_.erase(blocks_.begin());
      }
      last_block_taken_again_ = false;
    }
    last_block_ = reinterpret_cast<int64_t>(block.mutable_data());
    blocks_.push_back(block);
    return block;
  }

  // Whether no tensor over `block` is alive anywhere: only the pool holds it. A Python storage
  // object made for it (tensor.untyped_storage()) holds it too, and is itself kept alive by torch
  // for as long as C++ holds the block (c10/util/intrusive_ptr.h, "PyObject preservation"): that
  // object, referenced by nothing but the block, counts as unused. Called with the GIL held.
  static bool unused(const c10::Storage& block) {
    const size_t holders = block.use_count();
    return holders == 1 || (holders == 2 && block.unsafeGetStorageImpl()->pyobj_slot()->has_unique_reference());
  }

  int64_t max_blocks_;
  int64_t last_block_ = 0;
  bool last_block_taken_again_ = false;
  std::vector<c10::Storage> blocks_;  // least recently used first
};

}  // namespace
}  // namespace minidp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Fused gradient reduction: out[i] = sum over replicas k of inputs[k][i].";
  py::class_<minidp::OutputPool>(m, "OutputPool",
                                 "Reductions whose CPU sums are written into memory kept mapped between "
                                 "calls, reused only once no tensor over it is alive.")
      .def(py::init<int64_t>(), py::arg("max_blocks"))
      .def("reduce_add", &minidp::OutputPool::reduce_add, py::arg("inputs"), py::arg("destination"),
           "Sums inputs[k][i] over replicas k into new tensors on `destination`, adding in replica "
           "order (half types accumulate in float32).")
      .def("held_bytes", &minidp::OutputPool::held_bytes)
      .def("last_block", &minidp::OutputPool::last_block)
      .def("forget_last_block", &minidp::OutputPool::forget_last_block)
      .def("clear", &minidp::OutputPool::clear);
  m.def("reduce_add_into", &minidp::reduce_add_into, py::arg("inputs"), py::arg("outputs"),
        "Like reduce_add, but writes into existing contiguous `outputs`.");
  m.attr("has_cuda") = py::bool_(
#ifdef MINIDP_WITH_CUDA
      true
#else
      false
#endif
  );
}
