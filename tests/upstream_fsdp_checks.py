"""PyTorch's own FSDP2 tests, rank side: each upstream case, run inside every rank of a job of 2 Gloo processes
against ``minidp.distributed.fully_shard``.

Sources (PyTorch is BSD-licensed, 3-clause; the cases below are adapted from these files of the PyTorch repository,
https://github.com/pytorch/pytorch, copyright the PyTorch contributors):

* ``test/distributed/_composable/fsdp/test_fully_shard_training.py``;
* ``test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py``;
* ``test/distributed/_composable/fsdp/test_fully_shard_ignore_params.py``;
* ``test/distributed/_composable/fsdp/test_fully_shard_frozen.py``;
* ``test/distributed/_composable/fsdp/test_fully_shard_autograd.py``;
* ``test/distributed/_composable/fsdp/test_fully_shard_state_dict.py``;
* ``test/distributed/_composable/fsdp/test_fully_shard_grad_scaler.py``;
* ``test/distributed/_composable/fsdp/test_fully_shard_comm.py``;
* ``test/distributed/_composable/fsdp/test_fully_shard_clip_grad_norm_.py``;
* ``test/distributed/checkpoint/fsdp/test_fsdp_dsd.py``;
* ``test/distributed/_composable/fsdp/test_fully_shard_init.py``;
* ``test/distributed/_composable/fsdp/test_fully_shard_state.py``;
* the helpers they import from ``torch/testing/_internal/common_fsdp.py`` (``MLP``, ``DoubleLinear``,
  ``check_sharded_parity``),
  ``common_distributed.py`` (``SaveForwardInputsModel``) and ``distributed/_tensor/common_dtensor.py``
  (``ModelArgs``, ``Transformer``), written again below: those modules need test-only packages to import.

How the port reads. Each function is one upstream test, under its upstream name; upstream's ``run_subtests`` is a
plain loop over the same values. Upstream runs most of these on one GPU per rank (``skip_if_lt_x_gpu(2)``, some with
``allow_cpu=True``) and on 4 or 8 ranks; here every case runs on the CPU in 2 processes (``tests.helpers.run_upstream``
seeds both alike before each case). Upstream's ``assertEqual`` on tensors is ``torch.testing.assert_close`` (the
same default tolerances). Upstream's ``replicate`` reference is torch's ``DistributedDataParallel`` on the CPU
(:func:`replicate`). Upstream's ``reshard_after_forward=2`` is every rank on 2, ``True``: kept where it is cheap.
What stays out everywhere: meshes of more than 2 dimensions (TP, EP, PP), ``fully_shard([a, b])`` and the GPU
sleeps that only shift CUDA streams.

What differs in the assertions, because minidp's parameters are plain tensors where FSDP2's are DTensors:

* ``check_sharded_parity``: upstream compares ``param.to_local()`` with ``distribute_tensor(ref, mesh, [Shard(0)])``;
  here :func:`check_sharded_parity` compares :func:`local` of the parameter (and of its gradient) with rank r's chunk
  of the reference's, ``torch.chunk(ref, 2, dim=0)[r]``, which is the same tensor;
* "is a DTensor" / "is not a DTensor" (``_assert_dtensor_params``) is :func:`is_sharded_param`: the registered
  parameter is a DTensor (FSDP2) or the shard of one of minidp's groups;
* ``full_tensor()`` is :func:`full_tensor`, an all-gather of the rows by hand for a plain shard;
* ``isinstance(module, FSDPModule)`` is :func:`is_sharded_module`;
* a parameter's DTensor attributes (global size and stride, ``device_mesh``, placements, ``_local_tensor``) are read
  from the DTensor minidp's ``state_dict()`` gives for it (:func:`_state_dict_dtensor`), over the very shard;
* ``assertRaisesRegex`` and ``assertNotEqual`` are ``raises`` and ``assert_not_close`` of the DDP port's checks;
* upstream patches ``dist.reduce_scatter_single`` to see the reduce-scatter's dtype or size and counts collectives
  with ``CommDebugMode``; here :class:`CollectiveLog`, a dispatch mode, sees the c10d operators either implementation
  calls (minidp holds its own reference to the collective functions, so patching ``dist`` would not see it);
* Gloo has no ``ReduceOp.AVG`` for ``all_reduce``: a reference's ``all_reduce(AVG)`` is a SUM and a division;
* a loss scaler must see an inf or NaN that is in any rank's shard: FSDP2's plain ``GradScaler`` does, since its check
  of DTensor gradients is all-reduced by DTensor; on minidp's plain shards the scaler that does is torch's
  ``ShardedGradScaler`` (FSDP1's), :func:`grad_scaler`.

With ``MINIDP_UPSTREAM_FSDP=torch`` in the environment, :data:`FULLY_SHARD` is torch's own
``torch.distributed.fsdp.fully_shard`` and every case runs on it: that is how each port was validated.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import itertools
import os
import sys
from collections import Counter
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import minidp.distributed as md

from .helpers import assert_equal_as_upstream
from .upstream_ddp_checks import assert_not_close, raises

ON_TORCH = os.environ.get("MINIDP_UPSTREAM_FSDP") == "torch"

if ON_TORCH:
    from torch.distributed.fsdp import FSDPModule as SHARDED_MODULE
    from torch.distributed.fsdp import fully_shard as FULLY_SHARD
    from torch.distributed.fsdp import register_fsdp_forward_method
else:
    FULLY_SHARD = md.fully_shard
    register_fsdp_forward_method = md.register_fsdp_forward_method
    SHARDED_MODULE = sys.modules["minidp.distributed.fully_shard"].ShardedModule

fully_shard = FULLY_SHARD
assert_close = torch.testing.assert_close

# torch 2.13 names them all_gather_single and reduce_scatter_single (the older names warn); the same calls.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- adapters: DTensor parameters (FSDP2) and plain shards (minidp) read alike ----------------------------------


def local(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This rank's part: ``to_local()`` of a DTensor, a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def is_sharded_module(module: nn.Module) -> bool:
    """Upstream's ``isinstance(module, FSDPModule)``: ``fully_shard`` was applied to ``module``."""
    return isinstance(module, SHARDED_MODULE)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def is_sharded_param(model: nn.Module, param: torch.Tensor) -> bool:
    """Upstream's ``isinstance(param, DTensor)`` for a registered parameter: it is the shard, not the gathered whole."""
    if ON_TORCH:
        return _is_dtensor(param)
    groups = sys.modules["minidp.distributed.fully_shard"].sharded_groups(model)
    return any(param is p.shard for group in groups for p in group.params)


def shard_of(full: torch.Tensor, dim: int = 0, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Rank r's slice of ``full`` among the ranks of ``group`` (default: all): ``torch.chunk(full, W, dim)[r]``, empty
    past the last chunk (FSDP2's ``Shard(dim)``; upstream's ``distribute_tensor``)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = torch.chunk(full, world, dim=dim)
    return chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)


def shard_dim(model: nn.Module, param: torch.Tensor) -> int:
    """The dimension ``param`` is cut along: its ``Shard`` placement (FSDP2), its group's record of it (minidp)."""
    if ON_TORCH:
        return param.placements[-1].dim
    groups = sys.modules["minidp.distributed.fully_shard"].sharded_groups(model)
    return next(p.dim for group in groups for p in group.params if param is p.shard)


def full_tensor(param: torch.Tensor, full_shape: torch.Size, dim: int = 0) -> torch.Tensor:
    """Upstream's ``param.full_tensor()`` (a collective when sharded): the whole parameter on every rank, from the
    slices cut along ``dim``."""
    if _is_dtensor(param):
        return param.full_tensor()
    if param.shape == full_shape:
        return param.detach()
    world = dist.get_world_size()
    padded_shape = list(full_shape)
    padded_shape[dim] = -(-full_shape[dim] // world)  # chunk 0's size: every rank's padded slice
    padded = param.detach().new_zeros(padded_shape)
    padded.narrow(dim, 0, param.shape[dim]).copy_(param.detach())
    gathered = padded.new_empty(world * padded.numel())
    _all_gather(gathered, padded.view(-1))
    gathered = gathered.view(world, *padded_shape)
    # rank r's slice is chunk r of torch.chunk, whose sizes are chunk 0's, ..., then what is left
    sizes = [c.shape[0] for c in torch.chunk(torch.empty(full_shape[dim]), world)] + [0] * world
    return torch.cat([gathered[r].narrow(dim, 0, sizes[r]) for r in range(world)], dim=dim)


def check_sharded_parity(ref_module: nn.Module, sharded_module: nn.Module, prefixes_to_ignore: tuple = (),
                         group: Optional[dist.ProcessGroup] = None) -> None:
    """``common_fsdp.check_sharded_parity``: the same names; each parameter's local slice, and its gradient's, are
    this rank's chunk of the reference's among the ranks of ``group`` (those that shard: all by default), along the
    dimension the parameter is cut (a reference gradient of None: None here too)."""
    if isinstance(ref_module, DDP):
        ref_module = ref_module.module
    for (ref_name, ref), (name, param) in zip(ref_module.named_parameters(), sharded_module.named_parameters(),
                                              strict=True):
        for prefix in prefixes_to_ignore:
            name = name.replace(prefix, "")
        assert ref_name == name, (ref_name, name)
        assert is_sharded_param(sharded_module, param), f"{name} is not sharded"
        dim = shard_dim(sharded_module, param)
        assert_close(local(param), shard_of(ref, dim, group), msg=lambda m: f"{name}: {m}")
        if ref.grad is None:
            assert param.grad is None, f"{name}: the reference has no gradient, but this has one"
            continue
        assert param.grad is not None, f"{name}: no gradient"
        assert_close(local(param.grad), shard_of(ref.grad, dim, group), msg=lambda m: f"{name}.grad: {m}")


def _backward_beside_reference(ref_model: nn.Module, model: nn.Module, inp: torch.Tensor) -> None:
    """Upstream's pair of passes: the losses (``sum()``) equal, both backward, then the reference's gradients
    averaged by hand (the sharded model's are reduced by its backward)."""
    ref_loss = ref_model(inp).sum()
    loss = model(inp).sum()
    assert_close(ref_loss, loss)
    ref_loss.backward()
    loss.backward()
    average_gradients(ref_model)


def replicate(module: nn.Module, **options: Any) -> DDP:
    """Upstream's ``replicate(module, ...)`` reference: torch's DDP on the CPU (every rank's gradient averaged), with
    upstream's options (``find_unused_parameters``)."""
    return DDP(module, **options)


def average_gradients(module: nn.Module) -> None:
    """Upstream's ``dist.all_reduce(param.grad, op=ReduceOp.AVG)``: Gloo's all-reduce lacks AVG, so SUM, then / W."""
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad.div_(dist.get_world_size())


class CollectiveLog(TorchDispatchMode):
    """The c10d operators called inside the block, by name (``_allgather_base_``, ``_reduce_scatter_base_``,
    ``allreduce_``), with the dtype and the number of elements of each one's first tensor (the reduce-scatter's
    output)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Optional[torch.dtype], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if first is None:
                first = next((t for a in args if isinstance(a, (list, tuple)) for t in a
                              if isinstance(t, torch.Tensor)), None)
            self.calls.append((func._overloadpacket.__name__, None if first is None else first.dtype,
                               0 if first is None else first.numel()))
        return func(*args, **(kwargs or {}))

    def counts(self) -> Counter:
        return Counter(name for name, _, _ in self.calls)

    def dtypes(self, name: str) -> set:
        return {dtype for called, dtype, _ in self.calls if called == name}

    def numels(self, name: str) -> set:
        return {numel for called, _, numel in self.calls if called == name}


REDUCE_SCATTER, ALL_GATHER, ALL_REDUCE = "_reduce_scatter_base_", "_allgather_base_", "allreduce_"


@contextlib.contextmanager
def swap_tensors_on_conversion():
    """Upstream's ``wrapSwapTensorsTest(True)``: ``module.to()`` swaps the parameters' tensors in place."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


# ---- upstream's models ----------------------------------------------------------------------------------------


class MLP(nn.Module):
    """``common_fsdp.MLP``: in_proj (dim -> multiplier * dim), relu, out_proj, relu, an optional buffer (which
    ``reset_parameters`` draws again)."""

    def __init__(self, dim: int, device: Optional[torch.device] = None, *, bias: bool = True,
                 with_buffer: bool = False, dim_multiplier: int = 4) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim_multiplier * dim, device=device, bias=bias)
        self.out_proj = nn.Linear(dim_multiplier * dim, dim, device=device, bias=bias)
        if with_buffer:
            self.register_buffer("buffer", torch.randn((dim,), device=device))
        else:
            self.buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = F.relu(self.out_proj(F.relu(self.in_proj(x))))
        return z if self.buffer is None else z + self.buffer

    def reset_parameters(self) -> None:
        if self.buffer is not None:
            torch.nn.init.normal_(self.buffer)


@dataclasses.dataclass
class ModelArgs:
    """``common_dtensor.ModelArgs``, the toy transformer's sizes (upstream's defaults)."""

    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.1
    use_attn_mask: bool = True
    weight_tying: bool = True
    checkpoint_activations: bool = False


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.head_dim = args.n_heads, args.dim // args.n_heads
        self.dropout_p, self.use_attn_mask = args.dropout_p, args.use_attn_mask
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(args.dim, args.dim, bias=False) for _ in range(4))
        self.resid_dropout = nn.Dropout(args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, None, self.dropout_p if self.training else 0,
                                             self.use_attn_mask)
        return self.resid_dropout(self.wo(out.transpose(1, 2).reshape(batch, seq, -1)))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout_p: float) -> None:
        super().__init__()
        self.w1, self.gelu, self.w2 = nn.Linear(dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(args.dim), Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, 4 * args.dim, args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """``common_dtensor.Transformer``: token and position embeddings, blocks, a norm, an output layer whose
    weight is the token embedding's with ``weight_tying``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.weight_tying:
            self.output.weight = self.tok_embeddings.weight
        self.checkpoint_activations = args.checkpoint_activations

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos_embeddings(torch.arange(tokens.shape[1]))
        h = self.dropout(h)
        for layer in self.layers:
            h = (torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False) if self.checkpoint_activations
                 else layer(h))
        return self.output(self.norm(h)).float()


def _train_in_lockstep(models, optims, inputs, set_to_none_every_other: bool = True) -> None:
    """Upstream's loop: each iteration, for the reference then the sharded model, zero the gradients (to None on
    even iterations), forward, ``sum()``, backward, step; both losses equal."""
    for iter_idx, inp in enumerate(inputs):
        losses = []
        for model, optim in zip(models, optims):
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0) if set_to_none_every_other else True)
            losses.append(model(*inp).sum())
            losses[-1].backward()
            optim.step()
        assert_close(losses[0], losses[1])


# ==================================================================================================
# test_fully_shard_training.py
# ==================================================================================================


def test_root_move_forward_input_to_device():
    """TestFullyShardForwardInputs: the root moves its forward inputs (nested in a tuple) to its device; a module
    without parameters can be the root. Upstream skips the device check on the CPU, as here."""

    class ParamlessModule(nn.Module):
        def forward(self, x: torch.Tensor, ys: tuple) -> torch.Tensor:
            return x + (ys[0] + ys[1]) + 1

    model = ParamlessModule()
    fully_shard(model).to("cpu")
    x, ys = torch.randn(3), (torch.randn(3), torch.randn(3))
    out = model(x, ys)
    assert x.device == ys[0].device == ys[1].device == torch.device("cpu")
    assert_close(out, x + (ys[0] + ys[1]) + 1)


def test_root_no_forward_inputs():
    """TestFullyShardForwardInputs: a root whose forward takes no input (only its parameter) runs forward and
    backward."""

    class ParameterOnlyModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))

        def forward(self) -> torch.Tensor:
            return self.weight @ self.weight

    model = ParameterOnlyModule()
    fully_shard(model)
    out = model()
    assert out.shape == (4, 4)
    out.sum().backward()


def _assert_registered(model: nn.Module, params, sharded: bool) -> None:
    params = list(params)
    assert params, "no parameters to check"
    for param in params:
        assert is_sharded_param(model, param) == sharded, f"expected {'sharded' if sharded else 'whole'} parameters"


def _assert_same_params(params, ref_params) -> None:
    params, ref_params = list(params), list(ref_params)
    assert len(params) == len(ref_params)
    for param, ref in zip(params, ref_params):
        whole = full_tensor(param, ref.shape)
        assert whole.shape == ref.shape
        assert_close(whole, ref)


def test_param_registration_after_forward():
    """TestFullyShardRegisteredParams: after the forward the module holds whole parameters unless it resharded
    (``reshard_after_forward=None``: the root keeps them; True: sharded again), the values equal the unsharded
    model's, and ``reshard()`` registers the shards again; for one group and for three. Upstream runs it on 4 ranks
    (threads), here 2, where its int 2 (resharding to groups of 2 ranks) is every rank that shards: ``True``."""
    for reshard_after_forward in (True, False, 2, None):
        torch.manual_seed(42)
        model = MLP(3)
        for param in model.parameters():
            dist.broadcast(param.detach(), src=0)
        ref_model = copy.deepcopy(model)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        inp = torch.randn((2, 3))
        _assert_registered(model, model.parameters(), sharded=True)
        _assert_same_params(model.parameters(), ref_model.parameters())
        model(inp)
        _assert_registered(model, model.parameters(), sharded=bool(reshard_after_forward))
        _assert_same_params(model.parameters(), ref_model.parameters())
        model.reshard()
        _assert_registered(model, model.parameters(), sharded=True)
        _assert_same_params(model.parameters(), ref_model.parameters())

    for reshard_after_forward in (True, False, 2, None):
        torch.manual_seed(42)
        model = nn.Sequential(MLP(3), MLP(3))
        for param in model.parameters():
            dist.broadcast(param.detach(), src=0)
        ref_model = copy.deepcopy(model)
        fully_shard(model[0].in_proj, reshard_after_forward=reshard_after_forward)
        fully_shard(model[0].out_proj, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        _assert_registered(model, model.parameters(), sharded=True)
        _assert_same_params(model.parameters(), ref_model.parameters())
        model(inp)
        non_root = [*model[0].in_proj.parameters(), *model[0].out_proj.parameters()]
        root = [p for p in model.parameters() if all(p is not q for q in non_root)]
        if reshard_after_forward is None:  # the root keeps its parameters, the others reshard
            _assert_registered(model, non_root, sharded=True)
            _assert_registered(model, root, sharded=False)
        else:
            _assert_registered(model, non_root, sharded=bool(reshard_after_forward))
            _assert_registered(model, root, sharded=bool(reshard_after_forward))
        _assert_same_params(model.parameters(), ref_model.parameters())
        for module in model.modules():
            if is_sharded_module(module):
                module.reshard()
        _assert_registered(model, model.parameters(), sharded=True)
        _assert_same_params(model.parameters(), ref_model.parameters())


def test_param_registration_after_backward():
    """TestFullyShardRegisteredParams: after the backward every registered parameter is the shard again, for one
    group and for three, whatever ``reshard_after_forward`` (True, False, 2: every rank here, as True)."""
    for reshard_after_forward in (True, False, 2):
        model = MLP(8)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        inp = torch.randn((2, 8))
        _assert_registered(model, model.parameters(), sharded=True)
        model(inp).sum().backward()
        _assert_registered(model, model.parameters(), sharded=True)
    for reshard_after_forward in (True, False, 2):
        model = MLP(8)
        fully_shard(model.in_proj, reshard_after_forward=reshard_after_forward)
        fully_shard(model.out_proj, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        _assert_registered(model, model.parameters(), sharded=True)
        model(inp).sum().backward()
        _assert_registered(model, model.parameters(), sharded=True)


def test_to_float64_after_init():
    """TestFullyShardCastAfterInit: ``model.to(float64)`` after ``fully_shard`` (with swap_tensors on conversion, as
    upstream's ``wrapSwapTensorsTest(True)``) makes the shards, their local tensors and their gradients float64,
    and training matches a float64 DDP reference. Upstream also reads the DTensor spec's dtype (not here)."""
    with swap_tensors_on_conversion():
        torch.manual_seed(42)
        mlp_dim, dtype = 4, torch.float64
        model = MLP(mlp_dim)
        for param in model.parameters():
            dist.broadcast(param.detach(), src=0)
        ref_model = replicate(copy.deepcopy(model).to(dtype))
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for module in (model.in_proj, model.out_proj, model):
            fully_shard(module)
        model.to(dtype)
        for param in model.parameters():
            assert param.dtype == dtype and local(param).dtype == dtype, param.dtype
        optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        check_sharded_parity(ref_model, model)
        torch.manual_seed(42 + dist.get_rank() + 1)
        inp = torch.randn((2, mlp_dim), dtype=dtype)
        for iter_idx in range(10):
            losses = []
            for _model in (ref_model, model):
                losses.append(_model(inp).sum())
                losses[-1].backward()
            assert_close(losses[0], losses[1])
            check_sharded_parity(ref_model, model)
            for param in model.parameters():
                assert param.dtype == local(param).dtype == dtype
                assert param.grad.dtype == local(param.grad).dtype == dtype
            for _optim in (ref_optim, optim):
                _optim.step()
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))


def test_train_parity_single_group_shard_dim0():
    """TestFullyShard1DTrainingCore: one group (the whole model) trains as DDP does, 10 Adam steps, for three pairs
    of linear shapes (even and uneven dim 0). Upstream: 8 ranks; here 2."""
    for lin_shapes in ([(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]):
        _train_parity_single_group(lin_shapes, use_shard_placement_fn=False)


def test_train_parity_single_group_shard_largest_dim():
    """TestFullyShard1DTrainingCore: the same with each parameter cut along its largest dimension (the second
    layer's (8, 16) weight along dim 1), which the ranks divide evenly. Upstream: 8 ranks; here 2."""
    _train_parity_single_group([(32, 16), (16, 8)], use_shard_placement_fn=True)


def _largest_dim(param: nn.Parameter) -> Shard:
    """Upstream's ``_shard_placement_fn``: ``Shard`` on the parameter's largest dimension (the first, on a tie)."""
    return Shard(param.shape.index(max(param.shape)))


def _train_parity_single_group(lin_shapes: list[tuple[int, int]], use_shard_placement_fn: bool) -> None:
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(*lin_shapes[0]), nn.ReLU(), nn.Linear(*lin_shapes[1]))
    ref_model = replicate(copy.deepcopy(model))
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    fully_shard(model, shard_placement_fn=_largest_dim if use_shard_placement_fn else None)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = (torch.randn((4, lin_shapes[0][0])),)
    _train_in_lockstep((ref_model, model), (ref_optim, optim), [inp] * 10)


def _shard_blocks_then_root(model: nn.Module, reshard_after_forward: bool, checkpointed: bool = False,
                            **every_call: Any) -> None:
    """Upstream's usual sharding of its ``Transformer``: each ``TransformerBlock`` a group (under ``checkpoint`` first
    if ``checkpointed``), then the root; ``every_call``: more arguments of ``fully_shard`` (``mesh``...)."""
    from torch.distributed._composable import checkpoint

    for module in model.modules():
        if isinstance(module, TransformerBlock):
            if checkpointed:
                checkpoint(module)
            fully_shard(module, reshard_after_forward=reshard_after_forward, **every_call)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **every_call)


def test_train_parity_multi_group():
    """TestFullyShard1DTrainingCore: a 3-layer transformer, one group per block plus the root, trains as DDP does,
    with ``reshard_after_forward`` True and False. Adapted: upstream's delay subtests (CUDA sleeps before the
    collectives, to shift streams) and the int 2 are out; 5 iterations instead of 10."""
    _train_parity_multi_group((True, False))


def test_train_parity_multi_group_cpu_offload_eager():
    """TestFullyShard1DTrainingCore: the same, sharded on a 1-D mesh with ``CPUOffloadPolicy(pin_memory=False)``
    (upstream skips its ``pin_memory=True`` subtest on the CPU, as here), ``reshard_after_forward=True``. Adapted as
    test_train_parity_multi_group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    _train_parity_multi_group((True,), mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                              offload_policy=CPUOffloadPolicy(pin_memory=False))


def _train_parity_multi_group(reshard_after_forward_values: tuple[bool, ...], **every_call: Any) -> None:
    for reshard_after_forward in reshard_after_forward_values:
        torch.manual_seed(42)
        vocab_size = 1024
        model = Transformer(ModelArgs(n_layers=3, n_heads=4, vocab_size=vocab_size, max_seq_len=64, dropout_p=0))
        ref_model = replicate(copy.deepcopy(model))
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        _shard_blocks_then_root(model, reshard_after_forward, **every_call)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + dist.get_rank() + 1)
        inputs = [(torch.randint(0, vocab_size, (3, 64)),) for _ in range(5)]
        _train_in_lockstep((ref_model, model), (ref_optim, optim), inputs)


def test_non_root_forward_backward():
    """TestFullyShard1DTrainingCore: forward and backward through the root, a step, then through a non-root
    (``model[0]``) alone, a step: the losses and the final output equal a reference averaged by hand. Upstream's
    GPU sleep after the backward (stream synchronisation) is left out."""
    torch.manual_seed(42)
    lin_dim = 32
    model = nn.Sequential(*[MLP(lin_dim) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randn((8, lin_dim))

    ref_root_loss = ref_model(inp).sum()
    ref_root_loss.backward()
    average_gradients(ref_model)
    ref_optim.step()
    ref_optim.zero_grad()
    ref_nonroot_loss = ref_model[0](inp).sum()
    ref_nonroot_loss.backward()
    average_gradients(ref_model)
    ref_optim.step()

    root_loss = model(inp).sum()
    root_loss.backward()
    optim.step()
    optim.zero_grad()
    nonroot_loss = model[0](inp).sum()
    nonroot_loss.backward()
    optim.step()

    assert_close(ref_root_loss, root_loss)
    assert_close(ref_nonroot_loss, nonroot_loss)
    assert_close(ref_model(inp).sum(), model(inp).sum())


def test_multi_forward_module():
    """TestFullyShard1DTrainingCore: a sharded module called twice in one forward trains as DDP does. Adapted:
    upstream's subtests over ``reshard_after_forward`` never pass the value to ``fully_shard``; here it is passed
    (True, False, and upstream's int 2: every rank here, as True)."""

    class MultiForwardModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.outer = nn.Linear(4, 4), nn.Linear(4, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.outer(self.inner(x) + self.inner(x))

    for reshard_after_forward in (True, False, 2):
        torch.manual_seed(42)
        model = MultiForwardModule()
        ref_model = replicate(copy.deepcopy(model))
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        fully_shard(model.inner, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + dist.get_rank())
        inp = (torch.randn((32, 4)),)
        _train_in_lockstep((ref_model, model), (ref_optim, optim), [inp] * 10)


def test_explicit_prefetching():
    """TestFullyShard1DTrainingCore: an 8-block transformer with each block prefetching the next two in the forward
    (``set_modules_to_forward_prefetch``) and the previous two in the backward (``set_modules_to_backward_prefetch``)
    trains as DDP does, 10 AdamW steps."""
    torch.manual_seed(42)
    model_args = ModelArgs(n_layers=8, dropout_p=0.0)
    model = Transformer(model_args)
    ref_model = replicate(copy.deepcopy(model))
    ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for layer in itertools.chain(model.layers, [model]):
        fully_shard(layer)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ahead = 2
    layers = list(model.layers)
    for i, layer in enumerate(layers[: len(layers) - ahead]):
        layer.set_modules_to_forward_prefetch([layers[i + j] for j in range(1, ahead + 1)])
    for i, layer in enumerate(layers):
        if i >= ahead:
            layer.set_modules_to_backward_prefetch([layers[i - j] for j in range(1, ahead + 1)])
    torch.manual_seed(42 + dist.get_rank())
    inp = (torch.randint(0, model_args.vocab_size, (2, 8)),)
    for _ in range(10):
        losses = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            _optim.zero_grad()
            losses.append(_model(*inp).sum())
            losses[-1].backward()
            _optim.step()
        assert_close(losses[0], losses[1])


def test_train_parity_with_activation_checkpointing():
    """TestFullyShard1DTrainingCompose: a weight-tied 3-block transformer, activation checkpointing three ways
    (torch.distributed._composable.checkpoint on each block, torch.utils.checkpoint in the model's forward, the
    checkpoint_wrapper), one group per block: sharded parameters and gradients equal DDP's (chunked) before
    training, after each backward and after each step. Adapted: only upstream's "block" grouping (its "mem_eff"
    groupings call ``fully_shard([a, b])``); 3 iterations instead of 10."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (_CHECKPOINT_PREFIX,
                                                                              apply_activation_checkpointing)

    for reshard_after_forward, checkpoint_impl in itertools.product((True, False), ("composable", "utils", "wrapper")):
        torch.manual_seed(42)
        vocab_size = 1024
        model = Transformer(ModelArgs(n_layers=3, n_heads=4, vocab_size=vocab_size, max_seq_len=64, dropout_p=0,
                                      checkpoint_activations=(checkpoint_impl == "utils")))
        ref_model = replicate(copy.deepcopy(model))
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        prefixes_to_ignore = ()
        if checkpoint_impl == "wrapper":
            prefixes_to_ignore = (_CHECKPOINT_PREFIX,)
            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, TransformerBlock))
        elif checkpoint_impl == "composable":
            for module in model.modules():
                if isinstance(module, TransformerBlock):
                    checkpoint(module)
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + dist.get_rank())
        inp = torch.randint(0, vocab_size, (3, 64))
        check_sharded_parity(ref_model, model, prefixes_to_ignore)
        for iter_idx in range(3):
            losses = []
            for _model in (ref_model, model):
                torch.manual_seed(iter_idx + 1)
                losses.append(_model(inp).sum())
                losses[-1].backward()
            check_sharded_parity(ref_model, model, prefixes_to_ignore)
            assert_close(losses[0], losses[1])
            for _optim in (ref_optim, optim):
                _optim.step()
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            check_sharded_parity(ref_model, model, prefixes_to_ignore)


def test_train_parity_shard_placement_fn_shard_largest_dim():
    """TestFullyShardShardPlacementFnMultiProcess: a 3-layer transformer, each block a group and the root, every
    parameter cut along its largest dimension: the whole parameters equal the reference's before and after 5 AdamW
    steps, and every loss equals the reference's (whose gradients are averaged by hand). Upstream: 8 ranks; here 2."""
    torch.manual_seed(42)
    model_args = ModelArgs(n_layers=3, dropout_p=0.0)
    model = Transformer(model_args)
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for layer in model.layers:
        fully_shard(layer, shard_placement_fn=_largest_dim)
    fully_shard(model, shard_placement_fn=_largest_dim)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def assert_whole_parameters_equal() -> None:
        for param, ref_param in zip(model.parameters(), ref_model.parameters()):
            assert_close(full_tensor(param, ref_param.shape, shard_dim(model, param)), ref_param)

    assert_whole_parameters_equal()
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randint(0, model_args.vocab_size, (2, 16))
    for _ in range(5):
        _backward_beside_reference(ref_model, model, inp)
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad()
        optim.zero_grad()
    assert_whole_parameters_equal()


def test_shard_placement_fn_contiguous_params_grads():
    """TestFullyShardShardPlacementFnMultiThread: matrices cut along dim 1, vectors along dim 0: the shards, the whole
    parameters each forward sees and the gradients are all contiguous. Upstream: 4 threads as ranks; here 2
    processes (MLP(4)'s 16 and 4 columns divide among 2 as among 4)."""
    dim = 4
    model = MLP(dim=dim)

    def shard_placement_fn(param: nn.Parameter) -> Optional[Shard]:
        return Shard(1) if param.ndim > 1 else Shard(0)

    fully_shard(model.in_proj, shard_placement_fn=shard_placement_fn)
    fully_shard(model.out_proj, shard_placement_fn=shard_placement_fn)
    fully_shard(model, shard_placement_fn=shard_placement_fn)

    def assert_contiguous_params(module: nn.Module, args: Any) -> None:
        for param in module.parameters():
            assert param.is_contiguous()

    model.in_proj.register_forward_pre_hook(assert_contiguous_params)
    model.out_proj.register_forward_pre_hook(assert_contiguous_params)
    for param in model.parameters():
        assert param.is_contiguous() and local(param).is_contiguous()
    model(torch.randn((2, dim))).sum().backward()
    for param in model.parameters():
        assert param.is_contiguous() and local(param).is_contiguous()
        assert param.grad.is_contiguous() and local(param.grad).is_contiguous()


def test_train_parity_with_shared_params():
    """TestFullyShardSharedParams: a transformer whose output layer shares the token embedding's weight (both in
    the root's group), with and without composable activation checkpointing per block, trains as DDP does.
    Upstream: 4 ranks, 10 iterations; here 2 ranks, 5 iterations."""
    for reshard_after_forward, use_activation_checkpointing in itertools.product((False, True), (False, True)):
        torch.manual_seed(42)
        model_args = ModelArgs(n_layers=3, dropout_p=0.0, weight_tying=True)
        model = Transformer(model_args)
        ref_model = replicate(copy.deepcopy(model))
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        _shard_blocks_then_root(model, reshard_after_forward, checkpointed=use_activation_checkpointing)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + dist.get_rank() + 1)
        inputs = [(torch.randint(0, model_args.vocab_size, (2, 16)),) for _ in range(5)]
        _train_in_lockstep((ref_model, model), (ref_optim, optim), inputs)


def test_train_shared_params_uneven_shard():
    """TestFullyShardSharedParams: an embedding tied to the output layer, both in one ``fully_shard([a, b])``
    group, with a vocabulary the ranks do not divide (the last rank's shard padded): after 10 AdamW steps every row
    of the weight has changed, the padded rank's included. Upstream: 4 ranks; here 2 (a vocabulary of 2 * 4 + 1)."""
    for reshard_after_forward in (True, False):
        hidden_size = 16
        vocab_size = dist.get_world_size() * 4 + 1

        class TiedModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.tok_embeddings = nn.Embedding(vocab_size, hidden_size)
                self.output = nn.Linear(hidden_size, vocab_size, bias=False)
                self.output.weight = self.tok_embeddings.weight

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return self.output(self.tok_embeddings(ids))

        torch.manual_seed(42)
        model = TiedModel()
        fully_shard([model.tok_embeddings, model.output], reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        model.tok_embeddings.unshard()
        initial_weight = model.tok_embeddings.weight.detach().clone()
        model.tok_embeddings.reshard()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + dist.get_rank())
        for _ in range(10):
            ids = torch.randint(0, vocab_size, (2, 8))
            logits = model(ids)
            F.cross_entropy(logits.view(-1, vocab_size).float(), ids.view(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()
        model.tok_embeddings.unshard()
        final_weight = model.tok_embeddings.weight
        for row in range(vocab_size):
            assert not torch.equal(initial_weight[row], final_weight[row]), f"Row {row} was not updated after training"
        model.tok_embeddings.reshard()


def test_layer_by_layer_shard_no_false_positive():
    """TestFullyShardSharedParams: sharding blocks one at a time as they are built (garbage collected between) does
    not make a later call mistake a new parameter for an already sharded one; forward and backward run."""
    dim, n_blocks = 16, 8

    class SimpleBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.linear = nn.LayerNorm(dim), nn.Linear(dim, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(self.norm(x))

    class LayerByLayerModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    import gc

    model = LayerByLayerModel()
    for _ in range(n_blocks):
        block = SimpleBlock()
        model.blocks.append(block)
        fully_shard(block)
        gc.collect()
    fully_shard(model)
    model(torch.randn(2, 4, dim)).sum().backward()


def test_gradient_accumulation():
    """TestFullyShardGradientAccumulation: 3 micro-batches with the gradient reduction (``set_requires_gradient_sync``)
    and the resharding after backward (``set_reshard_after_backward``) turned off but on the last, for every module
    ("all"), the root only ("root_only", ``recurse=False``) or 2 of the 3 MLPs ("some_mlps"): the losses equal a
    reference's, the sharded gradients its averaged ones, and the number of all-gathers and reduce-scatters is
    upstream's formula. Adapted: the 1-D mesh only, as upstream below 4 ranks (its HSDP mesh and
    ``reduce_scatter_only`` need 4); no CPU offload (upstream's ``CPUOffloadPolicy()`` pins memory: skipped on the
    CPU there too), no int 2; upstream's CommDebugMode is :class:`CollectiveLog`; 2 iterations, not 5."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for reshard_after_forward, mode, reshard_after_backward in itertools.product(
            (True, False), ("all", "root_only", "some_mlps"), (False, True)):
        if not reshard_after_backward and (reshard_after_forward is not False or mode == "some_mlps"):
            continue  # upstream skips these as uncommon
        torch.manual_seed(42)
        batch_size, lin_dim, num_mlps, num_microbatches = 2, 32, 3, 3
        num_mlps_to_disable_reduce_scatter = 2
        model = nn.Sequential(nn.Linear(lin_dim, lin_dim), *[MLP(lin_dim) for _ in range(num_mlps)])
        ref_model = copy.deepcopy(model)
        for mlp in model[1:]:
            fully_shard(mlp, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)  # the root gets the first linear
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)

        def set_backward_flags(is_last: bool) -> None:
            if mode == "all":
                model.set_requires_gradient_sync(is_last)
                if not reshard_after_backward:
                    model.set_reshard_after_backward(is_last)
            elif mode == "some_mlps":
                for mlp in model[1: 1 + num_mlps_to_disable_reduce_scatter]:
                    mlp.set_requires_gradient_sync(is_last)
                    if not reshard_after_backward:
                        mlp.set_reshard_after_backward(is_last)
            else:
                model.set_requires_gradient_sync(is_last, recurse=False)
                if not reshard_after_backward:
                    model.set_reshard_after_backward(is_last, recurse=False)

        torch.manual_seed(42 + dist.get_rank() + 1)
        for iter_idx in range(2):
            log = CollectiveLog()
            for microbatch_idx in range(num_microbatches):
                is_last = microbatch_idx == num_microbatches - 1
                set_backward_flags(is_last)
                inp = torch.randn(batch_size, lin_dim)
                losses = [ref_model(inp).sum()]
                losses[-1].backward()
                with log:
                    losses.append(model(inp).sum())
                    losses[-1].backward()
                assert_close(losses[0], losses[1])
            counts = log.counts()
            expected_reduce_scatters = num_mlps + 1
            if mode == "some_mlps":
                expected_reduce_scatters += (num_mlps - num_mlps_to_disable_reduce_scatter + 1) * (num_microbatches - 1)
            elif mode == "root_only":
                expected_reduce_scatters += num_mlps * (num_microbatches - 1)
            expected_all_gathers = num_mlps + 1
            if reshard_after_forward is not False:
                expected_all_gathers = 2 * (num_mlps + 1) * num_microbatches
            elif reshard_after_backward:
                expected_all_gathers *= num_microbatches
            elif mode == "root_only":
                expected_all_gathers += num_mlps * (num_microbatches - 1)
            where = f"reshard_after_forward={reshard_after_forward}, mode={mode}, " \
                    f"reshard_after_backward={reshard_after_backward}, iteration {iter_idx}"
            assert counts[REDUCE_SCATTER] == expected_reduce_scatters, (where, counts)
            assert counts[ALL_REDUCE] == 0, (where, counts)
            assert counts[ALL_GATHER] == expected_all_gathers, (where, counts)
            average_gradients(ref_model)
            check_sharded_parity(ref_model, model)
            for _optim in (optim, ref_optim):
                _optim.step()
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 1))


def test_1f1b_microbatching():
    """TestFullyShardGradientAccumulation: a 1F1B-like schedule, 3 micro-batches, the gradients reduced (and, without
    ``reshard_after_backward``, the parameters resharded) only on the last (``set_is_last_backward`` too), with and
    without every group's ``unshard(async_op=True)`` issued ahead: losses equal a reference's, and after the step the
    sharded parameters and gradients equal its. Upstream: 4 ranks."""
    for use_explicit_unshard, reshard_after_backward in itertools.product((False, True), (False, True)):
        torch.manual_seed(42)
        model_args = ModelArgs(dropout_p=0.0)
        model = Transformer(model_args)
        ref_model = copy.deepcopy(model)
        ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
        _shard_blocks_then_root(model, reshard_after_forward=False)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        num_microbatches = 3
        torch.manual_seed(42 + dist.get_rank() + 1)
        inps = [torch.randint(0, model_args.vocab_size, (2, 16)) for _ in range(num_microbatches)]
        if use_explicit_unshard:
            for module in model.modules():
                if is_sharded_module(module):
                    module.unshard(async_op=True)
        losses, ref_losses = [], []
        for inp_idx, inp in enumerate(inps):
            is_last = inp_idx == num_microbatches - 1
            model.set_requires_gradient_sync(is_last)
            model.set_is_last_backward(is_last)
            if not reshard_after_backward:
                model.set_reshard_after_backward(is_last)
            losses.append(model(inp).sum())
            losses[-1].backward()
            ref_losses.append(ref_model(inp).sum())
            ref_losses[-1].backward()
        average_gradients(ref_model)
        for loss, ref_loss in zip(losses, ref_losses):
            assert_close(loss, ref_loss)
        optim.step()
        ref_optim.step()
        check_sharded_parity(ref_model, model)


class ChunkedHeadModel(nn.Module):
    """Upstream's ``ChunkedHeadModel`` (test_fully_shard_training.py): an embedding, a body, an RMSNorm and a head
    whose forward can stop before the head (``skip_head``), the head's weight tied to the embedding's or not."""

    def __init__(self, dim: int, vocab_size: int, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, *, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def _chunked_head_model(dim: int, vocab_size: int, tie: bool, ac: bool = False) -> ChunkedHeadModel:
    """Upstream's ``_new_model``/``_setup``: seeded, rank 0's weights on every rank, the body checkpointed if ``ac``."""
    torch.manual_seed(42)
    model = ChunkedHeadModel(dim, vocab_size, tie)
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param, src=0)
    if ac:
        from torch.distributed._composable import checkpoint

        checkpoint(model.body)
    return model


def _whole_grad(model: nn.Module, param: torch.Tensor, full_shape: torch.Size) -> torch.Tensor:
    """Upstream's ``_snapshot_grad``: a copy of ``param``'s whole gradient (gathered where the model is sharded)."""
    if any(is_sharded_module(module) for module in model.modules()):
        return full_tensor(param.grad, full_shape, shard_dim(model, param)).clone()
    return param.grad.clone()


def _chunk_through_head(model: ChunkedHeadModel, tokens: torch.Tensor, n_chunks: int,
                        h_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Upstream's ``_run_chunked``: the forward without the head, then the head chunk by chunk on the detached output
    (in float32), each chunk's ``sum()`` backward at once, then the output's backward with the chunks' gradients;
    the summed loss, and the head's whole gradient after each chunk. ``h_dtype``: the dtype the output and every
    chunk's head output must have."""
    h = model(tokens, skip_head=True)
    if h_dtype is not None:
        assert h.dtype == h_dtype, (h.dtype, h_dtype)
    h_grads, head_grads = [], []
    total_loss = torch.tensor(0.0)
    for chunk in torch.chunk(h.detach().to(torch.float32), n_chunks, dim=1):
        chunk = chunk.contiguous().detach().requires_grad_(True)
        out = model.head(chunk)
        if h_dtype is not None:
            assert out.dtype == h_dtype, (out.dtype, h_dtype)
        loss = out.sum()
        total_loss += loss.detach()
        loss.backward()
        h_grads.append(chunk.grad.detach())
        head_grads.append(_whole_grad(model, model.head.weight, torch.Size((model.head.out_features,
                                                                             model.head.in_features))))
    h.backward(torch.cat(h_grads, dim=1).to(h.dtype))
    return total_loss, head_grads


def test_partial_group_forward_then_standalone():
    """TestFullyShard1DTrainingCompose: the chunked loss with ``fully_shard([norm, head])`` (or ``[embed, norm,
    head]`` with the head tied to the embedding): the model's forward skips the head, which then runs chunk by chunk
    on its own. Every chunk adds to the head's gradient; the grouped model trains as one sharded module by module
    (its gradients and parameters equal), and as an unsharded reference (losses, the head's gradient, every shard);
    the outputs have the policy's ``output_dtype`` (bfloat16 everywhere, or in the group only), ``reshard_after_forward``
    True, False, and upstream's int 1 (False, with FSDP2's warning); once with the body checkpointed. Adapted: 5
    iterations instead of 10; torch 2.13's FSDP2 behaviour (before it, FSDP2 reduced wrong gradients here)."""
    dim, vocab_size, n_chunks = 32, 128, 4
    subtests = [(r, tie, mode, False) for r, tie, mode in itertools.product(
        (True, False), (False, True), ("none", "bf16_everywhere", "bf16_inner_only"))]
    subtests += [(True, False, "none", True), (1, False, "none", False)]
    for reshard_after_forward, weight_tying, mp_policy_mode, ac in subtests:
        bf16_out = {"param_dtype": torch.float32, "output_dtype": torch.bfloat16}
        if mp_policy_mode == "bf16_everywhere":
            inner_mp = root_mp = MixedPrecisionPolicy(**bf16_out)
            expected_h_dtype = torch.bfloat16
        elif mp_policy_mode == "bf16_inner_only":
            inner_mp = MixedPrecisionPolicy(**bf16_out)
            root_mp = MixedPrecisionPolicy(param_dtype=torch.float32)
            expected_h_dtype = torch.bfloat16
        else:
            inner_mp = root_mp = MixedPrecisionPolicy()
            expected_h_dtype = torch.float32
        do_parity, do_grouping_parity = mp_policy_mode == "none", not weight_tying

        def _shard(m: nn.Module, grouped: bool) -> torch.optim.Optimizer:
            if grouped and weight_tying:
                fully_shard(m.body, mp_policy=root_mp, reshard_after_forward=reshard_after_forward)
                fully_shard([m.embed, m.norm, m.head], mp_policy=inner_mp, reshard_after_forward=reshard_after_forward)
            else:
                fully_shard(m.embed, mp_policy=root_mp, reshard_after_forward=reshard_after_forward)
                fully_shard(m.body, mp_policy=root_mp, reshard_after_forward=reshard_after_forward)
                if grouped:
                    fully_shard([m.norm, m.head], mp_policy=inner_mp, reshard_after_forward=reshard_after_forward)
                else:
                    fully_shard(m.norm, mp_policy=inner_mp, reshard_after_forward=reshard_after_forward)
                    fully_shard(m.head, mp_policy=inner_mp, reshard_after_forward=reshard_after_forward)
            fully_shard(m, mp_policy=root_mp, reshard_after_forward=reshard_after_forward)
            return torch.optim.Adam(m.parameters(), lr=1e-2)

        torch.manual_seed(42)
        tokens = torch.randint(0, vocab_size, (2, 16))
        ref_model = _chunked_head_model(dim, vocab_size, weight_tying, ac)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        model = _chunked_head_model(dim, vocab_size, weight_tying, ac)
        optim = _shard(model, grouped=True)
        if do_grouping_parity:
            ungrouped_model = _chunked_head_model(dim, vocab_size, weight_tying, ac)
            ungrouped_optim = _shard(ungrouped_model, grouped=False)
        for iter_idx in range(5):
            fsdp_loss, fsdp_head_grads = _chunk_through_head(model, tokens, n_chunks, expected_h_dtype)
            for i in range(1, len(fsdp_head_grads)):  # every chunk adds to the head's gradient
                assert (fsdp_head_grads[i] - fsdp_head_grads[i - 1]).norm().item() > 0, f"chunk {i} added nothing"
            if do_grouping_parity:
                ug_loss, ug_head_grads = _chunk_through_head(ungrouped_model, tokens, n_chunks, expected_h_dtype)
                assert_close(ug_loss, fsdp_loss)
                assert_close(ug_head_grads[-1], fsdp_head_grads[-1])
                for (name, ug_p), (_, fsdp_p) in zip(ungrouped_model.named_parameters(), model.named_parameters()):
                    assert_close(local(ug_p.grad), local(fsdp_p.grad), msg=lambda m: f"{name}.grad: {m}")
            if do_parity:
                ref_loss, ref_head_grads = _chunk_through_head(ref_model, tokens, n_chunks)
                average_gradients(ref_model)
                ref_head_grad = ref_head_grads[-1]
                dist.all_reduce(ref_head_grad)
                ref_head_grad.div_(dist.get_world_size())
                assert_close(fsdp_head_grads[-1], ref_head_grad)
                assert_close(ref_loss, fsdp_loss)
                check_sharded_parity(ref_model, model)
                ref_optim.step()
                ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            optim.step()
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            if do_grouping_parity:
                ungrouped_optim.step()
                ungrouped_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                for (name, ug_p), (_, fsdp_p) in zip(ungrouped_model.named_parameters(), model.named_parameters()):
                    assert_close(local(ug_p), local(fsdp_p), msg=lambda m: f"{name}: {m}")


def test_grouped_module_cast_forward_inputs():
    """TestFullyShard1DTrainingCompose: ``cast_forward_inputs`` casts the inputs of every module of a
    ``fully_shard([a, b])`` group (``b`` gets a float32 input from ``a``'s output: bfloat16 weights would refuse it
    uncast); every parameter gets a gradient."""
    dim = 32

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(dim, dim, bias=False)
            self.b = nn.Linear(dim, dim, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x).float())

    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    torch.manual_seed(42)
    model = Model()
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param, src=0)
    fully_shard([model.a, model.b], mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    out = model(torch.randn(2, dim, dtype=torch.float32))
    assert out.dtype == torch.bfloat16
    out.sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, f"grad None for {name}"


def test_partial_group_forward_grad_accum_chunked():
    """TestFullyShard1DTrainingCompose: the chunked loss over 3 micro-batches of gradient accumulation
    (``set_requires_gradient_sync`` and ``set_is_last_backward`` on the last only): ``fully_shard([norm, head])``
    accumulates the gradients that sharding the two one by one does, ``reshard_after_forward`` True and False."""
    dim, vocab_size, n_chunks, n_microbatches = 32, 128, 2, 3
    for reshard_after_forward in (True, False):
        def _setup(grouped: bool) -> nn.Module:
            m = _chunked_head_model(dim, vocab_size, tie=False)
            fully_shard(m.embed, reshard_after_forward=reshard_after_forward)
            fully_shard(m.body, reshard_after_forward=reshard_after_forward)
            if grouped:
                fully_shard([m.norm, m.head], reshard_after_forward=reshard_after_forward)
            else:
                fully_shard(m.norm, reshard_after_forward=reshard_after_forward)
                fully_shard(m.head, reshard_after_forward=reshard_after_forward)
            fully_shard(m, reshard_after_forward=reshard_after_forward)
            return m

        ref_model, model = _setup(grouped=False), _setup(grouped=True)
        tokens_list = [torch.randint(0, vocab_size, (2, 16)) for _ in range(n_microbatches)]
        for m in (ref_model, model):
            for i, tokens in enumerate(tokens_list):
                is_last = i == n_microbatches - 1
                m.set_requires_gradient_sync(is_last)
                m.set_is_last_backward(is_last)
                h = m(tokens, skip_head=True)
                h_grads = []
                for chunk in torch.chunk(h.detach(), n_chunks, dim=1):
                    chunk = chunk.contiguous().detach().requires_grad_(True)
                    m.head(chunk).sum().backward()
                    h_grads.append(chunk.grad.detach())
                h.backward(torch.cat(h_grads, dim=1))
        for (name, ref_p), (_, fsdp_p) in zip(ref_model.named_parameters(), model.named_parameters()):
            assert_close(local(ref_p.grad), local(fsdp_p.grad), msg=lambda m: f"{name}.grad: {m}")


def _is_unsharded(module: nn.Module) -> bool:
    """Upstream's ``module._get_fsdp_state()._fsdp_param_group.is_unsharded``: the group's parameters are gathered."""
    if ON_TORCH:
        return module._get_fsdp_state()._fsdp_param_group.is_unsharded
    return sys.modules["minidp.distributed.fully_shard"]._own_group(module).gathered


def test_partial_group_reshard_toggle():
    """TestFullyShard1DTrainingCompose: torchtitan's ``ChunkedCELoss`` toggle: resharding after forward and backward
    turned off on the head for the chunk loop (the group stays gathered through it), then on again and
    ``head.reshard()`` by hand (gathered no more), then the output's backward: every parameter gets a gradient;
    with and without the head tied to the embedding, the group kept or freed after the model's forward. Upstream
    reads FSDP2's private parameter group; here :func:`_is_unsharded`."""
    dim, vocab_size, n_chunks = 32, 128, 4
    for weight_tying, initial_reshard in itertools.product((False, True), (False, True)):
        model = _chunked_head_model(dim, vocab_size, weight_tying)
        if weight_tying:
            fully_shard(model.body)
            fully_shard([model.embed, model.norm, model.head], reshard_after_forward=initial_reshard)
        else:
            fully_shard(model.embed)
            fully_shard(model.body)
            fully_shard([model.norm, model.head], reshard_after_forward=initial_reshard)
        fully_shard(model)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        tokens = torch.randint(0, vocab_size, (2, 16))
        for iter_idx in range(5):
            h = model(tokens, skip_head=True)
            model.head.set_reshard_after_forward(False)
            model.head.set_reshard_after_backward(False)
            h_grads = []
            for chunk in torch.chunk(h.detach(), n_chunks, dim=1):
                chunk = chunk.contiguous().detach().requires_grad_(True)
                model.head(chunk).sum().backward()
                h_grads.append(chunk.grad.detach())
                assert _is_unsharded(model.head), f"head group resharded mid-chunk at iter {iter_idx}"
            model.head.set_reshard_after_forward(True)
            model.head.set_reshard_after_backward(True)
            model.head.reshard()
            assert not _is_unsharded(model.head), f"head.reshard() did not reshard at iter {iter_idx}"
            h.backward(torch.cat(h_grads, dim=1).to(h.dtype))
            for name, param in model.named_parameters():
                assert param.grad is not None, f"grad None for {name}"
            optim.step()
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))


def test_reset_iter_state_after_exception():
    """TestFullyShard1DTrainingCompose: ``reset_iter_state`` after a forward that raised midway through a partial
    pass (``fully_shard([norm, head])``, the model's forward skipping the head): the next forward and backward run
    and give every parameter a gradient."""
    dim, vocab_size = 32, 128

    class _Raiser(nn.Module):
        def __init__(self, wrapped: nn.Module) -> None:
            super().__init__()
            self.wrapped = wrapped
            self.armed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.armed:
                raise RuntimeError("boom")
            return self.wrapped(x)

    model = _chunked_head_model(dim, vocab_size, tie=False)
    model.body = _Raiser(model.body)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    tokens = torch.randint(0, vocab_size, (2, 16))
    model.body.armed = True
    try:
        model(tokens, skip_head=True)
        raise AssertionError("the armed body did not raise")
    except RuntimeError as error:
        assert str(error) == "boom", error
    model.body.armed = False
    model.reset_iter_state()
    model(tokens).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, f"grad None for {name} after reset"


def test_double_forward_with_nested_fsdp_and_checkpoint():
    """TestFullyShard1DTrainingCompose: two forwards before one backward (a DPO loss), with groups nested three deep
    (attention, feed-forward, block, root) and activation checkpointing (composable, or torch.utils.checkpoint in
    the model): every parameter gets a gradient."""
    from torch.distributed._composable import checkpoint

    for reshard_after_forward, checkpoint_impl in itertools.product((True, False), ("composable", "utils")):
        torch.manual_seed(42)
        vocab_size = 1024
        model = Transformer(ModelArgs(n_layers=3, n_heads=4, vocab_size=vocab_size, max_seq_len=64, dropout_p=0,
                                      checkpoint_activations=(checkpoint_impl == "utils")))
        if checkpoint_impl == "composable":
            for module in model.modules():
                if isinstance(module, TransformerBlock):
                    checkpoint(module)
        for layer in model.layers:
            fully_shard(layer.attention, reshard_after_forward=reshard_after_forward)
            fully_shard(layer.feed_forward, reshard_after_forward=reshard_after_forward)
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        torch.manual_seed(42 + dist.get_rank())
        inp1, inp2 = torch.randint(0, vocab_size, (2, 32)), torch.randint(0, vocab_size, (2, 32))
        out1, out2 = model(inp1), model(inp2)
        (out1.sum() - out2.sum()).pow(2).backward()
        for name, param in model.named_parameters():
            if param.requires_grad:
                assert param.grad is not None, f"{name} has no gradient"


def test_double_partial_forward_then_backward():
    """TestFullyShard1DTrainingCompose: two forwards that skip the head of ``fully_shard([norm, head])`` before one
    backward: each registers the group's reduction again (no hang), the embedding and the norm get finite
    gradients, the unused head none."""
    dim, vocab_size = 32, 128
    model = _chunked_head_model(dim, vocab_size, tie=False)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    tokens1, tokens2 = torch.randint(0, vocab_size, (2, 16)), torch.randint(0, vocab_size, (2, 16))
    h1 = model(tokens1, skip_head=True)
    h2 = model(tokens2, skip_head=True)
    (h1.sum() + h2.sum()).backward()
    for name in ("embed.weight", "norm.weight"):
        param = dict(model.named_parameters())[name]
        assert param.grad is not None, f"grad is None for {name}"
        assert torch.isfinite(local(param.grad)).all().item(), f"non-finite grad for {name}"
    assert model.head.weight.grad is None, "head.weight.grad should be None (head unused in partial forward)"


def test_train_parity_hsdp():
    """TestFullyShardHSDPTraining: HSDP on a 2-D mesh (``dp_replicate``, ``dp_shard``) with
    ``CPUOffloadPolicy(pin_memory=False)`` (upstream skips its ``pin_memory=True`` subtest on the CPU, as here): a
    LayerNorm and three MLPs, each a group (under ``checkpoint`` in half the subtests), then the root; 3 micro-batches
    a step, synchronised at the last one or at each; every loss, and the shards after every step, equal DDP's.
    Upstream's mesh is (world / 2, 2) above 2 ranks and (2, 1) on 2, as here: every rank holds whole parameters, and
    the reduced gradients are all-reduced over the 2 replicas (tests/test_fully_shard.py trains a 2 x 2 mesh bitwise
    against FSDP2's HSDP)."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy

    world = dist.get_world_size()
    shard_size = 2 if world > 2 else 1
    mesh = init_device_mesh("cpu", (world // shard_size, shard_size), mesh_dim_names=("dp_replicate", "dp_shard"))
    shards = mesh.get_group("dp_shard")
    for reshard_after_forward, use_activation_checkpointing, mlp_dim, sync_gradients_at_last_batch in itertools.product(
            (False, True), (False, True), (3, 16, 17), (True, False)):
        torch.manual_seed(42)
        model = nn.Sequential(nn.LayerNorm(mlp_dim, bias=False), MLP(mlp_dim, dim_multiplier=3), MLP(mlp_dim),
                              MLP(mlp_dim, dim_multiplier=3))
        ref_model = replicate(copy.deepcopy(model))
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        every_call = {"mesh": mesh, "reshard_after_forward": reshard_after_forward,
                      "offload_policy": CPUOffloadPolicy(pin_memory=False)}
        for mlp in model:
            if use_activation_checkpointing:
                checkpoint(mlp)
            fully_shard(mlp, **every_call)
        fully_shard(model, **every_call)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        check_sharded_parity(ref_model, model, group=shards)
        torch.manual_seed(42 + dist.get_rank() + 1)
        num_microbatches = 3
        for iter_idx in range(5):
            for microbatch_idx in range(num_microbatches):
                if sync_gradients_at_last_batch:
                    model.set_requires_gradient_sync(microbatch_idx == num_microbatches - 1)
                inp = torch.randn((8, mlp_dim))
                losses = []
                for _model in (ref_model, model):
                    losses.append(_model(inp).sum())
                    losses[-1].backward()
                assert_close(losses[0], losses[1])
            check_sharded_parity(ref_model, model, group=shards)
            for _optim in (ref_optim, optim):
                _optim.step()
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            check_sharded_parity(ref_model, model, group=shards)


def test_register_fsdp_forward_method():
    """TestFullyShardCustomForwardMethod: a sharded sub-module called through another method than ``forward``
    (``vit.forward_features``), made to gather its parameters with ``register_fsdp_forward_method``: the loss and
    the sharded gradients equal a reference's. Adapted: 2 images of 56x56 instead of 4 of 224x224 (CPU time)."""

    class VisionTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch_proj = nn.Conv2d(3, 1024, kernel_size=14, stride=14)

        def forward_features(self, imgs: torch.Tensor) -> torch.Tensor:
            return self.patch_proj(imgs).flatten(2).transpose(1, 2)

        def forward(self, imgs: torch.Tensor) -> torch.Tensor:
            return self.forward_features(imgs).sum(dim=1)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit, self.projector = VisionTransformer(), nn.Linear(1024, 256)

        def forward(self, imgs: torch.Tensor) -> torch.Tensor:
            return self.projector(self.vit.forward_features(imgs))  # not vit's forward

    torch.manual_seed(42)
    model = Model()
    ref_model = copy.deepcopy(model)
    fully_shard(model.vit)
    fully_shard(model.projector)
    fully_shard(model)
    register_fsdp_forward_method(model.vit, "forward_features")
    torch.manual_seed(42 + dist.get_rank() + 1)
    inp = torch.randn(2, 3, 56, 56)
    _backward_beside_reference(ref_model, model, inp)
    check_sharded_parity(ref_model, model)


# ==================================================================================================
# test_fully_shard_mixed_precision.py
# ==================================================================================================


def _divide_factors(reduce_dtype: torch.dtype, world_size: int) -> tuple[Optional[float], Optional[float]]:
    """FSDP2's division of the gradients around the reduce-scatter (upstream reads torch's private
    ``_get_gradient_divide_factors``): float32 and bfloat16 reduce with AVG, (None, None); other dtypes divide by p
    before a SUM (p doubling from 1 while W % p == 0 and W / p > p) and by W / p after."""
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return None, None
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


def _init_models_and_optims(reshard_after_forward, param_dtype, reduce_dtype):
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(16) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for mlp in model:
        fully_shard(mlp, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    return ref_model, ref_optim, model, optim


def _assert_reduce_scatters_in(log: CollectiveLog, dtype: torch.dtype) -> None:
    assert log.counts()[REDUCE_SCATTER] > 0, "no reduce-scatter ran"
    assert log.dtypes(REDUCE_SCATTER) == {dtype}, f"reduce-scatter in {log.dtypes(REDUCE_SCATTER)}, expected {dtype}"


def _sharded_step(model: nn.Module, optim: torch.optim.Optimizer, inp: torch.Tensor, iter_idx: int,
                  reduce_dtype: torch.dtype) -> torch.Tensor:
    """One step of the sharded model, its gradients set to None every other step as upstream does; checks that the
    backward's reduce-scatters ran in ``reduce_dtype``. Returns the loss."""
    optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
    loss = model(inp).sum()
    with CollectiveLog() as log:
        loss.backward()
    _assert_reduce_scatters_in(log, reduce_dtype)
    optim.step()
    return loss


def _step_reference(ref_model: nn.Module, ref_model_low: nn.Module, ref_optim: torch.optim.Optimizer) -> None:
    """The reference's step: the low-precision copy's gradients, in the float32 model's dtype, stepped there; the
    updated parameters copied back into the low-precision copy."""
    for param_fp32, param_low in zip(ref_model.parameters(), ref_model_low.parameters()):
        param_fp32.grad = param_low.grad.to(param_fp32.dtype)
        param_low.grad = None
    ref_optim.step()
    for param_fp32, param_low in zip(ref_model.parameters(), ref_model_low.parameters()):
        param_low.detach().copy_(param_fp32)


def _train_beside_reference(model: nn.Module, optim: torch.optim.Optimizer, reduce_dtype: torch.dtype,
                            ref_model: nn.Module, ref_compute: nn.Module, ref_optim: torch.optim.Optimizer,
                            inp: torch.Tensor, reduce: Callable[[nn.Parameter], None]) -> None:
    """Five steps of the sharded model (its reduce-scatters in ``reduce_dtype``) beside the reference's: the loss on
    ``ref_compute`` (``ref_model`` itself, or its low-precision copy), ``reduce(param)`` on each of its gradients (the
    collectives FSDP2 runs), then ``ref_optim``'s step on ``ref_model``; after each, the losses and the shards equal."""
    for iter_idx in range(5):
        fsdp_loss = _sharded_step(model, optim, inp, iter_idx, reduce_dtype)
        ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        ref_loss = ref_compute(inp).sum()
        ref_loss.backward()
        for param in ref_compute.parameters():
            reduce(param)
        if ref_compute is ref_model:
            ref_optim.step()
        else:
            _step_reference(ref_model, ref_compute, ref_optim)
        assert_close(fsdp_loss, ref_loss)
        check_sharded_parity(ref_model, model)


def test_compute_dtype():
    """TestFullyShardMixedPrecisionTraining: ``param_dtype`` bfloat16 and float16 (the reduce-scatter in it too):
    each step's loss equals a low-precision reference's whose gradients are reduced as FSDP2 reduces them
    (divided, reduce-scattered, all-gathered), and the float32 shards and gradients equal the reference's after a
    float32 step. Upstream needs NCCL (bfloat16 collectives) on GPUs; Gloo reduces bfloat16 and float16 on the CPU.
    Without the int 2 and shard_placement_fn; 5 iterations instead of 10."""
    world = dist.get_world_size()
    for param_dtype, reshard_after_forward in itertools.product((torch.bfloat16, torch.float16), (False, True)):
        ref_model, ref_optim, model, optim = _init_models_and_optims(reshard_after_forward, param_dtype, None)
        ref_model_low = copy.deepcopy(ref_model).to(param_dtype)
        predivide, postdivide = _divide_factors(param_dtype, world)
        torch.manual_seed(42 + dist.get_rank() + 1)
        inp = torch.randn((4, 16), dtype=param_dtype)
        def reduce(param: nn.Parameter) -> None:
            param.grad.div_(predivide if predivide is not None else world)
            output = torch.zeros_like(torch.chunk(param.grad, world)[0])
            _reduce_scatter(output, param.grad)
            _all_gather(param.grad, output)
            if postdivide is not None and postdivide > 1:
                param.grad.div_(postdivide)

        _train_beside_reference(model, optim, param_dtype, ref_model, ref_model_low, ref_optim, inp, reduce)


def test_reduce_dtype():
    """TestFullyShardMixedPrecisionTraining: bfloat16 compute with a float32 reduce-scatter (``reduce_dtype``), and
    float32 compute with a bfloat16 one: the reduce-scatter runs in ``reduce_dtype``, the losses and the sharded
    parameters and gradients equal a reference reduced that way. Upstream's functional collectives (funcol) are the
    plain ``dist`` ones here. Without the int 2 and shard_placement_fn; 5 iterations instead of 10."""
    world = dist.get_world_size()
    for reshard_after_forward in (False, True):  # float32 reduction of bfloat16 gradients
        param_dtype, reduce_dtype = torch.bfloat16, torch.float32
        ref_model, ref_optim, model, optim = _init_models_and_optims(reshard_after_forward, param_dtype, reduce_dtype)
        ref_model_bf16 = copy.deepcopy(ref_model).to(param_dtype)
        torch.manual_seed(42 + dist.get_rank() + 1)
        inp = torch.randn((4, 16), dtype=param_dtype)

        def reduce_in_float32(param: nn.Parameter) -> None:
            param.grad.data = param.grad.to(torch.float32)
            dist.all_reduce(param.grad)
            param.grad.div_(world)

        _train_beside_reference(model, optim, reduce_dtype, ref_model, ref_model_bf16, ref_optim, inp, reduce_in_float32)

    for reshard_after_forward in (False, True):  # bfloat16 reduction of float32 gradients
        param_dtype, reduce_dtype = torch.float32, torch.bfloat16
        ref_model, ref_optim, model, optim = _init_models_and_optims(reshard_after_forward, param_dtype, reduce_dtype)
        torch.manual_seed(42 + dist.get_rank() + 1)
        inp = torch.randn((4, 16), dtype=param_dtype)

        def reduce_in_bfloat16(param: nn.Parameter) -> None:
            low = param.grad.to(reduce_dtype)
            sharded = low.new_empty(torch.chunk(low, world)[0].shape)
            _reduce_scatter(sharded, low, op=dist.ReduceOp.AVG)
            gathered = low.new_empty(low.shape)
            _all_gather(gathered, sharded)
            param.grad = gathered.to(param.dtype)

        _train_beside_reference(model, optim, reduce_dtype, ref_model, ref_model, ref_optim, inp, reduce_in_bfloat16)


def test_grad_acc_with_reduce_dtype():
    """TestFullyShardMixedPrecisionTraining: gradient accumulation without the reduce-scatter (4 micro-batches,
    synchronised on the last) with bfloat16 compute and a float32 reduction accumulates the whole gradients in
    float32: losses, and the sharded gradients after the last micro-batch, equal a reference accumulating in float32.
    5 iterations instead of 10."""
    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        param_dtype, reduce_dtype = torch.bfloat16, torch.float32
        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        model = nn.Sequential(*[MLP(16) for _ in range(3)])
        ref_model = copy.deepcopy(model)
        ref_model_compute = copy.deepcopy(ref_model).to(param_dtype)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for mlp in model:
            fully_shard(mlp, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
        fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + dist.get_rank() + 1)
        num_microbatches = 4
        inp = torch.randn((2 * num_microbatches, 16), dtype=param_dtype)
        for iter_idx in range(5):
            microbatch_inps = torch.chunk(inp, num_microbatches)
            for microbatch_idx in range(num_microbatches):
                is_last = microbatch_idx == num_microbatches - 1
                model.set_requires_gradient_sync(is_last)
                model.set_reshard_after_backward(is_last or reshard_after_forward)
                losses = []
                for _model in (ref_model_compute, model):
                    losses.append(_model(microbatch_inps[microbatch_idx].detach()).sum())
                    assert losses[-1].dtype == param_dtype
                    with CollectiveLog() as log:
                        losses[-1].backward()
                    if _model is model and is_last:
                        _assert_reduce_scatters_in(log, reduce_dtype)
                assert_close(losses[0], losses[1])
                for ref_param, ref_param_compute in zip(ref_model.parameters(), ref_model_compute.parameters()):
                    assert ref_param_compute.grad is not None and ref_param.dtype == torch.float32
                    if ref_param.grad is not None:
                        ref_param.grad += ref_param_compute.grad
                    else:
                        ref_param.grad = ref_param_compute.grad.to(ref_param.dtype)
                    ref_param_compute.grad = None
                if is_last:
                    for ref_param in ref_model.parameters():
                        dist.all_reduce(ref_param.grad)
                        ref_param.grad /= dist.get_world_size()
            check_sharded_parity(ref_model, model)
            ref_optim.step()
            optim.step()
            ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            for ref_param, ref_param_compute in zip(ref_model.parameters(), ref_model_compute.parameters()):
                ref_param_compute.detach().copy_(ref_param)


@dataclasses.dataclass
class DC:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Inner:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Outer:
    inner: Inner
    z: torch.Tensor


class TensorPair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class ContainerModule(nn.Module):
    """One linear layer applied to every tensor of a dataclass, nested dataclass or NamedTuple."""

    def __init__(self, ctype: str, dim: int) -> None:
        super().__init__()
        self.ctype, self._layer = ctype, nn.Linear(dim, dim)

    def forward(self, inp: Any) -> Any:
        if self.ctype == "dataclass":
            return DC(x=self._layer(inp.x), y=self._layer(inp.y))
        if self.ctype == "nested_dataclass":
            return Outer(inner=Inner(x=self._layer(inp.inner.x), y=self._layer(inp.inner.y)), z=self._layer(inp.z))
        return TensorPair(x=self._layer(inp.x), y=self._layer(inp.y))


class ToContainer(nn.Module):
    def __init__(self, ctype: str) -> None:
        super().__init__()
        self.ctype = ctype

    def forward(self, x: torch.Tensor) -> Any:
        if self.ctype == "dataclass":
            return DC(x=x, y=x.clone())
        if self.ctype == "nested_dataclass":
            return Outer(inner=Inner(x=x, y=x.clone()), z=x.clone())
        return TensorPair(x=x, y=x.clone())


class FromContainer(nn.Module):
    def __init__(self, ctype: str) -> None:
        super().__init__()
        self.ctype = ctype

    def forward(self, inp: Any) -> torch.Tensor:
        return inp.inner.x + inp.inner.y + inp.z if self.ctype == "nested_dataclass" else inp.x + inp.y


def test_structured_input_output():
    """TestFullyShardMixedPrecisionTraining: activations passed between sharded modules as a dataclass, a nested
    dataclass or a NamedTuple, in float32, bfloat16 (compute and reduction) and bfloat16 compute with a float32
    reduction: each rank's summed loss equals a reference's on the global batch, and in float32 the sharded
    parameters and gradients too. 5 iterations instead of 10."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for container_type, (param_dtype, reduce_dtype) in itertools.product(
            ("dataclass", "nested_dataclass", "namedtuple"),
            ((None, None), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32))):
        torch.manual_seed(42)
        dim, local_batch_size = 16, 2
        model = nn.Sequential(ToContainer(container_type), ContainerModule(container_type, dim),
                              ContainerModule(container_type, dim), FromContainer(container_type))
        ref_model = copy.deepcopy(model)
        mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for module in model:
            fully_shard(module, mp_policy=mp_policy)
        fully_shard(model, mp_policy=mp_policy)
        if param_dtype is not None:
            ref_model_compute = copy.deepcopy(ref_model).to(param_dtype)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(1)  # the same global batch on every rank
        for iter_idx in range(5):
            global_inp = torch.rand((world * local_batch_size, dim))
            local_inp = global_inp[rank * local_batch_size: (rank + 1) * local_batch_size].detach()
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            fsdp_loss = model(local_inp).sum()
            fsdp_loss.backward()
            optim.step()

            ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            if param_dtype is not None:
                ref_loss = ref_model_compute(global_inp.to(param_dtype)).sum()
                ref_loss.backward()
                for p in ref_model_compute.parameters():
                    if reduce_dtype is not None and reduce_dtype != param_dtype:
                        p.grad.data = p.grad.to(reduce_dtype)
                        dist.all_reduce(p.grad)
                    p.grad.div_(world)
                for p_fp32, p_compute in zip(ref_model.parameters(), ref_model_compute.parameters()):
                    p_fp32.grad = p_compute.grad.to(p_fp32.dtype)
                    p_compute.grad = None
                ref_optim.step()
                for p_fp32, p_compute in zip(ref_model.parameters(), ref_model_compute.parameters()):
                    p_compute.detach().copy_(p_fp32)
            else:
                ref_loss = ref_model(global_inp).sum()
                ref_loss.backward()
                for p in ref_model.parameters():
                    p.grad.div_(world)
                ref_optim.step()
            dist.all_reduce(fsdp_loss)
            assert_close(fsdp_loss, ref_loss)
            if param_dtype is None:
                check_sharded_parity(ref_model, model)


class SaveForwardInputsModule(nn.Module):
    """``common_distributed.SaveForwardInputsModule``: records its input, optionally casts it to its weight's dtype."""

    def __init__(self, forward_inputs: dict, cast_forward_inputs: bool) -> None:
        super().__init__()
        self.l = nn.Linear(100, 100)
        self.forward_inputs, self.cast_forward_inputs = forward_inputs, cast_forward_inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_inputs[self] = x
        return self.l(x.to(self.l.weight.dtype) if self.cast_forward_inputs else x)


class SaveForwardInputsModel(nn.Module):
    def __init__(self, forward_inputs: dict, cast_forward_inputs: bool) -> None:
        super().__init__()
        self.c1 = SaveForwardInputsModule(forward_inputs, cast_forward_inputs)
        self.c2 = SaveForwardInputsModule(forward_inputs, cast_forward_inputs)
        self.forward_inputs = forward_inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forward_inputs[self] = x
        return self.c2(self.c1(x))


def test_float16_on_one_submodule():
    """TestFullyShardMixedPrecisionCasts: float16 on one child only: its input is cast (by its policy's
    ``cast_forward_inputs``, or not when the module casts itself), and with ``output_dtype=float32`` on the first
    child the second gets float32. Upstream: threads on one GPU; here 2 processes on the CPU."""
    x = torch.zeros(2, 100)
    forward_inputs: dict = {}
    model = SaveForwardInputsModel(forward_inputs, cast_forward_inputs=False)
    fully_shard(model.c2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    fully_shard(model)
    model(x).sum().backward()
    assert [forward_inputs[m].dtype for m in (model, model.c1, model.c2)] == [torch.float32, torch.float32,
                                                                              torch.float16]

    forward_inputs = {}
    model = SaveForwardInputsModel(forward_inputs, cast_forward_inputs=True)
    fully_shard(model.c2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, cast_forward_inputs=False))
    fully_shard(model)
    model(x).sum().backward()
    assert [forward_inputs[m].dtype for m in (model, model.c1, model.c2)] == [torch.float32] * 3

    forward_inputs = {}
    model = SaveForwardInputsModel(forward_inputs, cast_forward_inputs=False)
    fully_shard(model.c1, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, output_dtype=torch.float32))
    fully_shard(model)
    model(x).sum().backward()
    assert [forward_inputs[m].dtype for m in (model, model.c1, model.c2)] == [torch.float32, torch.float16,
                                                                              torch.float32]


def test_submodules_with_external_inputs():
    """TestFullyShardMixedPrecisionCasts: a child that also takes a tensor made inside the parent's forward casts it
    to float16 only when its own policy casts forward inputs."""

    class ToyModule(nn.Module):
        def __init__(self, forward_inputs: dict) -> None:
            super().__init__()
            self.l, self.forward_inputs = nn.Linear(100, 100), forward_inputs

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            self.forward_inputs["l2_input_x"], self.forward_inputs["l2_input_y"] = x, y
            return self.l(x)

    class ToyModel(nn.Module):
        def __init__(self, forward_inputs: dict) -> None:
            super().__init__()
            self.l1, self.l2, self.forward_inputs = nn.Linear(100, 100), ToyModule(forward_inputs), forward_inputs

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.forward_inputs["model_input_x"] = x
            return self.l2(self.l1(x), torch.ones(2, 100, dtype=torch.float32))  # an input from outside

    for enable_submodule_cast in (False, True):
        forward_inputs: dict = {}
        model = ToyModel(forward_inputs)
        fully_shard(model.l2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16,
                                                             cast_forward_inputs=enable_submodule_cast))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
        model(torch.zeros(2, 100)).sum().backward()
        assert forward_inputs["model_input_x"].dtype == torch.float16
        assert forward_inputs["l2_input_x"].dtype == torch.float16
        assert forward_inputs["l2_input_y"].dtype == (torch.float16 if enable_submodule_cast else torch.float32)


def test_checkpoint_recompute_casts_forward_inputs():
    """TestFullyShardMixedPrecisionCasts: a sharded module under ``torch.utils.checkpoint`` gets its inputs cast to the
    policy's ``param_dtype`` in the forward and again when the backward recomputes it."""
    _test_checkpoint_recompute_casts(recompute_cast="input")


def test_checkpoint_recompute_casts_outputs():
    """TestFullyShardMixedPrecisionCasts: a sharded module under ``torch.utils.checkpoint`` with an ``output_dtype``
    gives outputs of that dtype in the forward and again in the recomputation."""
    _test_checkpoint_recompute_casts(recompute_cast="output")


class _RecordingLinear(nn.Linear):
    def __init__(self) -> None:
        super().__init__(1, 1)
        self.input_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input_dtypes.append(x.dtype)
        return super().forward(x)


class _CheckpointedLinearModel(nn.Module):
    def __init__(self, checkpoint_input_dtype: torch.dtype) -> None:
        super().__init__()
        self.linear1 = _RecordingLinear()
        self.checkpoint_input_dtype = checkpoint_input_dtype
        self.linear1_output_dtypes: list[torch.dtype] = []

    def checkpointed_linear1(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear1(x)
        self.linear1_output_dtypes.append(x.dtype)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = x.to(dtype=self.checkpoint_input_dtype)
        x = checkpoint(self.checkpointed_linear1, x, use_reentrant=False, early_stop=False)
        return x.float().sum()


def _test_checkpoint_recompute_casts(recompute_cast: str) -> None:
    if recompute_cast == "input":
        checkpoint_input_dtype = torch.float32
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    elif recompute_cast == "output":
        checkpoint_input_dtype = torch.bfloat16
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                         output_dtype=torch.float32, cast_forward_inputs=False)
    else:
        raise AssertionError(f"Unknown recompute_cast: {recompute_cast}")
    torch.manual_seed(42)
    model = _CheckpointedLinearModel(checkpoint_input_dtype)
    fully_shard(model.linear1, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    inp = torch.randn(8, 1)
    model(inp).backward()
    if recompute_cast == "input":
        assert model.linear1.input_dtypes == [torch.bfloat16, torch.bfloat16], model.linear1.input_dtypes
    else:
        assert model.linear1_output_dtypes == [torch.float32, torch.float32], model.linear1_output_dtypes


def test_norm_modules_bf16():
    """TestFullyShardMixedPrecisionCasts: LayerNorm and batch norm sharded with a bfloat16 ``param_dtype`` run
    forward and backward with bfloat16 outputs: the batch norm once its running statistics are cast down, or under a
    policy of its own that only sets ``output_dtype``. Adapted: with float32 statistics, the CPU's batch norm (1-D
    and 2-D) raises a dtype mismatch, which upstream expects of CUDA's for 2-D only and of other devices never; the
    port expects it for both. Upstream needs NCCL (its float16 twin does not); here Gloo."""
    _test_norm_modules(MixedPrecisionPolicy(param_dtype=torch.bfloat16))


def test_norm_modules_fp16():
    """TestFullyShardMixedPrecisionCasts: test_norm_modules_bf16 with a float16 ``param_dtype``, adapted alike."""
    _test_norm_modules(MixedPrecisionPolicy(param_dtype=torch.float16))


def _test_norm_modules(mp_policy: MixedPrecisionPolicy) -> None:
    def inner(model: nn.Module, x: torch.Tensor) -> None:
        z = model(x)
        assert z.dtype == mp_policy.param_dtype, z.dtype
        z.sum().backward()

    model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32))
    for module in (model[0], model[1], model[2], model):
        fully_shard(module, mp_policy=mp_policy)
    inner(model, torch.randn((4, 32)))

    # float32 running statistics with low-precision weights: the CPU's batch norm refuses them (as upstream expects of
    # CUDA's for BatchNorm2d), whether the module is sharded or not
    for model, x in ((nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 32)), torch.randn((4, 32))),
                     (nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3)),
                      torch.randn((3, 1, 9, 9)))):
        for module in (model[0], model[1], model[2], model):
            fully_shard(module, mp_policy=mp_policy)
        try:
            inner(model, x)
        except RuntimeError as error:
            assert "expected scalar type" in str(error) or "Expected running_mean" in str(error), error
        else:
            raise AssertionError(f"batch norm ran with float32 statistics and {mp_policy.param_dtype} weights on the CPU")

    model = nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3))
    for module in (model[0], model[1], model[2], model):
        fully_shard(module, mp_policy=mp_policy)
    model[1].running_mean = model[1].running_mean.to(mp_policy.param_dtype)
    model[1].running_var = model[1].running_var.to(mp_policy.param_dtype)
    inner(model, torch.randn((3, 1, 9, 9)))

    model = nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3))
    fully_shard(model[1], mp_policy=MixedPrecisionPolicy(output_dtype=mp_policy.param_dtype))
    for module in (model[0], model[2], model):
        fully_shard(module, mp_policy=mp_policy)
    inner(model, torch.randn((3, 1, 9, 9)))


def test_clamp_reduce_dtype():
    """TestFullyShardMixedPrecisionCasts: a model built in bfloat16 with a bfloat16 policy, then cast to float32
    after ``fully_shard``: the reduce-scatter still runs in bfloat16 (the policy's ``reduce_dtype`` is not clamped
    away)."""
    model = nn.Sequential(nn.Linear(32, 32, dtype=torch.bfloat16), nn.Linear(32, 32, dtype=torch.bfloat16))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert mp_policy.reduce_dtype == torch.bfloat16
    for module in model:
        fully_shard(module, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    model.to(torch.float32)
    with CollectiveLog() as log:
        model(torch.randn((4, 32))).sum().backward()
    _assert_reduce_scatters_in(log, torch.bfloat16)


# ==================================================================================================
# test_fully_shard_ignore_params.py
# ==================================================================================================


class C(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin_c = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_c(x)


class B(nn.Module):
    def __init__(self, dim: int, subtrahend: torch.Tensor) -> None:
        super().__init__()
        self.lin_b, self.module_c, self.subtrahend = nn.Linear(dim, dim), C(dim), nn.Parameter(subtrahend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_b(self.module_c(x)) - self.subtrahend


class A(nn.Module):
    def __init__(self, dim: int, addend: torch.Tensor, subtrahend: torch.Tensor) -> None:
        super().__init__()
        self.module_b, self.addend = B(dim, subtrahend), nn.Parameter(addend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.module_b(x) + self.addend).sum()


def _generate_model_and_input() -> tuple[nn.Module, torch.Tensor]:
    dim = 8
    torch.manual_seed(42)
    addend = torch.randn((dim, dim))
    torch.manual_seed(70)
    subtrahend = torch.randn((dim, dim))
    model = A(dim, addend, subtrahend)
    torch.manual_seed(84)
    return model, torch.randn((dim, dim))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix + name


def _shard_post_order(module: nn.Module, path: str, ignored_path: str, ignored_params: set) -> None:
    """Upstream's ``_post_order_wrap_fsdp``: ``fully_shard`` every module under ``module`` but the ignored one,
    children first, each call told to leave ``ignored_params`` alone."""
    if path == ignored_path:
        return
    for name, child in list(module.named_children()):
        _shard_post_order(child, _join(path, name), ignored_path, ignored_params)
    fully_shard(module, ignored_params=ignored_params)


def _sharded_paths(module: nn.Module, path: str = "") -> set:
    found = set().union(*[_sharded_paths(child, _join(path, name)) for name, child in module.named_children()])
    return found | ({path} if is_sharded_module(module) else set())


def _ddp_ignored_names(module: nn.Module, prefix: str = "") -> list:
    """Upstream's ``_discover_ddp_ignored_params``: every parameter under the outermost sharded modules."""
    if is_sharded_module(module):
        return [name for name, _ in module.named_parameters(prefix)]
    return [name for child_name, child in module.named_children()
            for name in _ddp_ignored_names(child, _join(prefix, child_name))]


def test_ddp_A_fsdp_B_ddp_C():
    """TestFullyShardIgnoreParams: DDP around A, ``fully_shard`` on A's child B (and on B's lin_b) with B's child C
    ignored (``ignored_params``): DDP is told to ignore what fully_shard reduces (but not C, which only DDP
    reduces); 3 Adam steps match DDP over the unsharded model, whole parameter by parameter. Upstream runs it on
    CUDA; here on the CPU, without a mesh, under torch's DDP in both cases (minidp's DDP is not what is tested);
    ``implicit_replication`` (for DTensor gradients in the optimizer) only around torch's FSDP2."""
    ref_model, ref_inp = _generate_model_and_input()
    ref_model = DDP(ref_model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    ref_params = dict(ref_model.named_parameters())

    test_model, test_inp = _generate_model_and_input()
    names_before = dict(test_model.named_parameters())
    ignored_path = "module_b.module_c"
    fsdp_ignored_params = set(test_model.module_b.module_c.parameters())
    _shard_post_order(test_model.module_b, "module_b", ignored_path, fsdp_ignored_params)
    assert _sharded_paths(test_model) == {"module_b", "module_b.lin_b"}, _sharded_paths(test_model)
    ddp_ignored = _ddp_ignored_names(test_model)
    assert set(ddp_ignored) == {"module_b.subtrahend", "module_b.lin_b.weight", "module_b.lin_b.bias",
                                "module_b.module_c.lin_c.weight", "module_b.module_c.lin_c.bias"}, ddp_ignored
    ddp_ignored = [name for name in ddp_ignored if names_before[name] not in fsdp_ignored_params]
    assert set(ddp_ignored) == {"module_b.subtrahend", "module_b.lin_b.weight", "module_b.lin_b.bias"}, ddp_ignored
    DDP._set_params_and_buffers_to_ignore_for_model(module=test_model, params_and_buffers_to_ignore=ddp_ignored)
    test_model = DDP(test_model, broadcast_buffers=False)
    test_optim = torch.optim.Adam(test_model.parameters(), lr=1e-2)
    test_params = dict(test_model.named_parameters())

    def compare() -> None:
        assert set(ref_params) == set(test_params), (sorted(ref_params), sorted(test_params))
        for name, ref in ref_params.items():
            assert_close(full_tensor(ref, ref.shape), full_tensor(test_params[name], ref.shape),
                         msg=lambda m: f"{name}: {m}")

    compare()
    if ON_TORCH:
        try:
            from torch.distributed.tensor.experimental import implicit_replication
        except ImportError:
            from torch.distributed._tensor.experimental import implicit_replication
    else:
        implicit_replication = contextlib.nullcontext
    for _ in range(3):
        ref_loss, test_loss = ref_model(ref_inp), test_model(test_inp)
        assert_close(ref_loss, test_loss)
        ref_loss.backward()
        test_loss.backward()
        with implicit_replication():
            for optim in (ref_optim, test_optim):
                optim.step()
                optim.zero_grad()
            compare()


# ==================================================================================================
# test_fully_shard_frozen.py
# ==================================================================================================


def test_train_mixed_requires_grad_per_group():
    """TestFullyShardFrozen: frozen and trainable parameters in the same group (only the biases train, frozen before
    or after ``fully_shard``), each MLP a group, with and without activation checkpointing, ``reshard_after_forward``
    False, True and 2: sharded parameters and gradients equal DDP's after every step, the losses too, and every
    reduce-scatter carries the trainable parameters' shards only. Adapted: the count of FSDP2's post-backward
    autograd function (its private ``RegisterPostBackwardFunction``) is left out; the reduce-scatters are seen by
    :class:`CollectiveLog`."""
    from torch.distributed._composable import checkpoint

    for reshard_after_forward, use_activation_checkpointing, freeze_after_init in itertools.product(
            (False, True, 2), (False, True), (False, True)):
        torch.manual_seed(42)
        num_mlps, lin_dim = (3, 32)
        model = nn.Sequential(*[MLP(lin_dim, torch.device("cpu")) for _ in range(num_mlps)])
        # Train biases only (e.g. like BitFit)
        if not freeze_after_init:
            for param_name, param in model.named_parameters():
                if "bias" not in param_name:
                    param.requires_grad_(False)
        ref_model = replicate(copy.deepcopy(model), find_unused_parameters=freeze_after_init)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for mlp in model:
            if use_activation_checkpointing:
                checkpoint(mlp)
            fully_shard(mlp, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        if freeze_after_init:
            for param_name, param in itertools.chain(model.named_parameters(), ref_model.named_parameters()):
                if "bias" not in param_name:
                    param.requires_grad_(False)
        expected_numel = sum(local(p).numel() for n, p in model[0].named_parameters() if "bias" in n)
        torch.manual_seed(42 + dist.get_rank() + 1)
        for iter_idx in range(10):
            inp = torch.randn((8, lin_dim))
            losses: list[torch.Tensor] = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                if _model is model:
                    with CollectiveLog() as log:
                        losses[-1].backward()
                    assert log.numels(REDUCE_SCATTER) == {expected_numel}, log.numels(REDUCE_SCATTER)
                else:
                    losses[-1].backward()
                _optim.step()
            check_sharded_parity(ref_model, model)
            assert_close(losses[0], losses[1])


def test_train_mixed_requires_grad_across_groups():
    """TestFullyShardFrozen: frozen and trainable parameters in different groups (each Linear a group), an iteration
    under ``torch.no_grad()``, and the parameters unfrozen for the last iteration or not, ``reshard_after_forward``
    False, True and 2: the last losses equal DDP's (``find_unused_parameters=True``). Adapted: as
    test_train_mixed_requires_grad_per_group (no count of FSDP2's post-backward function)."""
    for reshard_after_forward, unfreeze_params in itertools.product((False, True, 2), (False, True)):
        torch.manual_seed(42)
        num_linears, lin_dim = (6, 32)
        modules: list[nn.Module] = []
        for _ in range(num_linears):
            modules += [nn.Linear(lin_dim, lin_dim), nn.ReLU()]
        model = nn.Sequential(*modules)
        ref_model = replicate(copy.deepcopy(model), find_unused_parameters=True)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, reshard_after_forward=reshard_after_forward)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)

        def _set_requires_grad(seq: nn.Module, requires_grad: bool) -> None:
            for i in range(num_linears):
                # Interleave frozen -> non-frozen -> ... linears (upstream's indexing, kept as written)
                if i % 2 == 0:
                    for param in seq[i % 2].parameters():
                        param.requires_grad_(requires_grad)

        _set_requires_grad(model, False)
        _set_requires_grad(ref_model.module, False)
        num_iters, no_grad_iter_idx = (3, 1)
        torch.manual_seed(42 + dist.get_rank())
        inp = torch.randn((8, lin_dim))
        for iter_idx in range(num_iters):
            losses: list[torch.Tensor] = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                # Unfreeze the parameters on the last step to emulate some kinds of fine-tuning
                if unfreeze_params and iter_idx == num_iters - 1:
                    _set_requires_grad(model, True)
                if iter_idx == no_grad_iter_idx:
                    with torch.no_grad():
                        losses.append(_model(inp).sum())
                else:
                    losses.append(_model(inp).sum())
                    losses[-1].backward()
                    _optim.step()
                    _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        assert_close(losses[0], losses[1])


class MultiForwardModule(nn.Module):
    """test_multi_forward_mixed_requires_grad's model: a trainable and a frozen layer run three times each, the
    trainable one once more per round under ``torch.no_grad()``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.layer_0 = nn.Linear(5, 5, device=device)
        self.layer_no_grad = nn.Linear(5, 5, device=device)
        self.layer_with_grad = nn.Linear(5, 5, device=device)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            # Make sure that calling the same layer multiple times works regardless whether gradient is enabled
            with torch.no_grad():
                x += F.relu(self.layer_with_grad(x))
        return x


def test_multi_forward_mixed_requires_grad():
    """TestFullyShardFrozen: trainable and frozen modules that take part several times in one forward, some of the
    times under ``torch.no_grad()``, each Linear a group, ``reshard_after_forward`` True, False and 2: the losses
    equal DDP's at every iteration."""
    for reshard_after_forward in (True, False, 2):
        torch.manual_seed(42)
        model = MultiForwardModule(torch.device("cpu"))
        ref_model = replicate(copy.deepcopy(model))
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                fully_shard(module, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        for iter_idx in range(10):
            inp = torch.randn((8, 5))
            losses: list[torch.Tensor] = []
            for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
                losses.append(_model(inp).sum())
                losses[-1].backward()
                _optim.step()
            assert_close(losses[0], losses[1])


# ==================================================================================================
# test_fully_shard_autograd.py
# ==================================================================================================


class DoubleLinear(nn.Module):
    """``common_fsdp.DoubleLinear``: two outputs from one module (``use_second_linear=True``), or a module left
    unused (``False``)."""

    def __init__(self, dim: int, use_second_linear: bool = True) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.relu = nn.ReLU()
        self.use_second_linear = use_second_linear

    def forward(self, x: torch.Tensor) -> Any:
        if self.use_second_linear:
            return self.relu(self.lin1(x)), self.relu(self.lin2(x))
        return self.relu(self.lin1(x))


def _reduce_1d_partial_grads(module: nn.Module) -> None:
    """TestFullyShardAutograd's helper: the reference ran the global batch, so its gradients are the sum of the
    ranks'; divided by their number, the mean the sharded model reduces."""
    for param in module.parameters():
        if param.grad is not None:
            param.grad.div_(dist.get_world_size())


def _global_and_local_inputs(global_batch_size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream's batch: the same global batch on every rank (seeded alike), each rank's rows of it."""
    local_batch_size = global_batch_size // dist.get_world_size()
    global_inp = torch.rand((global_batch_size, dim))
    rank = dist.get_rank()
    return global_inp, global_inp[rank * local_batch_size: (rank + 1) * local_batch_size].detach()


def _train_on_the_global_batch(ref_model: nn.Module, model: nn.Module, global_batch_size: int, dim: int) -> None:
    """The loop upstream's test_unused_forward_module and test_nontensor_activations share: 10 iterations of Adam, the
    reference on the global batch, the sharded model on this rank's rows; the losses, sharded parameters and gradients
    alike after every backward."""
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)  # same on all ranks
    for iter_idx in range(10):
        global_inp, local_inp = _global_and_local_inputs(global_batch_size, dim)
        losses: list[torch.Tensor] = []
        for _model, inp in ((ref_model, global_inp), (model, local_inp)):
            losses.append(_model(inp).sum())
            losses[-1].backward()
        _reduce_1d_partial_grads(ref_model)
        dist.all_reduce(losses[1])  # partial -> replicated
        assert_close(losses[0], losses[1])
        check_sharded_parity(ref_model, model)
        for _optim in (optim, ref_optim):
            _optim.step()
            _optim.zero_grad(set_to_none=bool(iter_idx % 2))


def test_unused_forward_output():
    """TestFullyShardAutograd: a backward where one forward output is not used in the loss (the second half of the
    iterations) still reduces every gradient: losses, sharded parameters and gradients as the single-process
    reference's on the global batch, ``reshard_after_forward`` True, False and 2."""
    for reshard_after_forward in (True, False, 2):
        torch.manual_seed(42)
        local_batch_size = 2
        global_batch_size, dim = (dist.get_world_size() * local_batch_size, 24)
        model = DoubleLinear(dim=dim, use_second_linear=True)
        ref_model = copy.deepcopy(model)
        fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(1)  # same on all ranks
        for iter_idx in range(10):
            # Use all forward outputs in the loss/backward for the first half of the iterations and only the 1st
            # forward output for the rest
            global_inp, local_inp = _global_and_local_inputs(global_batch_size, dim)
            out1, out2 = model(local_inp)
            loss = (out1 * out2).sum() if iter_idx < 3 else out1.sum()
            loss.backward()
            optim.step()
            ref_out1, ref_out2 = ref_model(global_inp)
            ref_loss = (ref_out1 * ref_out2).sum() if iter_idx < 3 else ref_out1.sum()
            ref_loss.backward()
            _reduce_1d_partial_grads(ref_model)
            ref_optim.step()
            dist.all_reduce(loss)  # partial -> replicated
            assert_close(loss, ref_loss)
            optim.zero_grad(set_to_none=bool(iter_idx % 2))
            ref_optim.zero_grad(set_to_none=bool(iter_idx % 2))
            check_sharded_parity(ref_model, model)


def test_unused_forward_module():
    """TestFullyShardAutograd: a sharded module the forward never runs (``lin2``) leaves its gradients None while the
    others train as the reference does, ``reshard_after_forward`` True, False and 2."""
    for reshard_after_forward in (True, False, 2):
        torch.manual_seed(42)
        local_batch_size, dim = (2, 24)
        global_batch_size = dist.get_world_size() * local_batch_size
        model = DoubleLinear(dim=dim, use_second_linear=False)
        ref_model = copy.deepcopy(model)
        fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
        fully_shard(model.lin2, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        _train_on_the_global_batch(ref_model, model, global_batch_size, dim)


class _ContainerModule(nn.Module):
    """test_nontensor_activations' ``Module``: runs on the first element of a list, namedtuple, tuple or dict and
    packs the result back into the same kind of container."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.relu = nn.ReLU()

    def forward(self, inp: Any) -> Any:
        from torch.nn.parallel.scatter_gather import _is_namedtuple

        if isinstance(inp, list):
            return [self._forward(inp[0])]
        elif _is_namedtuple(inp):
            return type(inp)(*([self._forward(inp[0])] + list(inp[1:])))
        elif isinstance(inp, tuple):
            return (self._forward(inp[0]),)
        elif isinstance(inp, dict):
            return {"x": self._forward(inp["x"])}
        raise NotImplementedError(f"Unsupported input type {type(inp)}: {inp}")

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.lin2(self.relu(self.lin1(x))))


class _ToContainerType(nn.Module):
    def __init__(self, container_type: type) -> None:
        super().__init__()
        self.container_type = container_type

    def forward(self, x: torch.Tensor) -> Any:
        if self.container_type is list:
            return [x]
        elif self.container_type is collections.namedtuple:
            nt = collections.namedtuple("NT", "x y")
            return nt(x, torch.ones_like(x))
        elif self.container_type is tuple:
            return (x,)
        elif self.container_type is dict:
            return {"x": x}
        raise NotImplementedError(f"Unsupported container type: {self.container_type}")


class _FromContainerType(nn.Module):
    def __init__(self, container_type: type) -> None:
        super().__init__()
        self.container_type = container_type

    def forward(self, x: Any) -> torch.Tensor:
        if self.container_type in (list, collections.namedtuple, tuple):
            return x[0]
        elif self.container_type is dict:
            return x["x"]
        raise NotImplementedError(f"Unsupported container type: {self.container_type}")


def test_nontensor_activations():
    """TestFullyShardAutograd: activations wrapped in a list, namedtuple, tuple or dict between sharded modules: the
    gradients still reach every group (the hooks find the tensors inside), as the reference's."""
    for container_type in (list, collections.namedtuple, tuple, dict):
        torch.manual_seed(42)
        local_batch_size, dim = (2, 24)
        global_batch_size = dist.get_world_size() * local_batch_size
        model = nn.Sequential(_ToContainerType(container_type), _ContainerModule(dim), _ContainerModule(dim),
                              _ContainerModule(dim), _FromContainerType(container_type))
        ref_model = copy.deepcopy(model)
        for module in model:
            fully_shard(module)
        fully_shard(model)
        _train_on_the_global_batch(ref_model, model, global_batch_size, dim)


def test_post_acc_grad_hook_runs():
    """TestFullyShardPostAccGradHookMultiThread: a post-accumulate-grad hook registered on each sharded parameter runs
    once per backward, for every parameter. Adapted: upstream runs it on CUDA in threads standing for 2 ranks; here the
    job's 2 processes on the CPU."""
    param_name_to_hook_count: Counter = Counter()

    def hook(param_name: str, param: torch.Tensor) -> None:
        param_name_to_hook_count[param_name] += 1

    model = MLP(8)
    for module in (model.in_proj, model.out_proj, model):
        fully_shard(module)
    for param_name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(functools.partial(hook, param_name))
    inp = torch.randn((2, 8))
    model(inp).sum().backward()
    param_names = {param_name for param_name, _ in model.named_parameters()}
    assert param_names == set(param_name_to_hook_count), (param_names, param_name_to_hook_count)
    for param_name, count in param_name_to_hook_count.items():
        assert count == 1, (param_name, count)


def test_post_acc_grad_hook_optim_parity():
    """TestFullyShardPostAccGradHookMultiProcess: AdamW and a StepLR run per parameter from its post-accumulate-grad
    hook give, bit for bit, the losses and parameters of the same sharded model stepped after the backward."""
    torch.manual_seed(42)
    model_args = ModelArgs(dropout_p=0.0)
    model = Transformer(model_args)
    ref_model = copy.deepcopy(model)
    for module in itertools.chain(ref_model.layers, [ref_model]):
        fully_shard(module)
    optim_kwargs = {"lr": 1e-2, "foreach": False}
    ref_optim = torch.optim.AdamW(ref_model.parameters(), **optim_kwargs)
    lr_scheduler_kwargs = {"step_size": 5}
    ref_lr_scheduler = torch.optim.lr_scheduler.StepLR(ref_optim, **lr_scheduler_kwargs)
    for module in itertools.chain(model.layers, [model]):
        fully_shard(module)
    param_to_optim = {}
    param_to_lr_scheduler = {}
    for param in model.parameters():
        param_to_optim[param] = torch.optim.AdamW([param], **optim_kwargs)
        param_to_lr_scheduler[param] = torch.optim.lr_scheduler.StepLR(param_to_optim[param], **lr_scheduler_kwargs)

    def optim_hook(param: nn.Parameter) -> None:
        param_to_optim[param].step()
        param_to_optim[param].zero_grad()
        param_to_lr_scheduler[param].step()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(optim_hook)
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randint(0, model_args.vocab_size, (2, 16))
    for _ in range(10):
        ref_loss = ref_model(inp).sum()
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        ref_lr_scheduler.step()
        loss = model(inp).sum()
        loss.backward()
        assert torch.equal(ref_loss, loss)
        for ref_param, param in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(ref_param, param)


# ==================================================================================================
# test_fully_shard_state_dict.py
# ==================================================================================================


def _largest_dim_placement(param: nn.Parameter) -> Shard:
    """test_dp_state_dict_save_load's ``_shard_placement_fn``: ``Shard`` along the largest dimension (the first of
    equals)."""
    largest_dim = largest_dim_size = -1
    for dim, dim_size in enumerate(param.shape):
        if dim_size > largest_dim_size:
            largest_dim, largest_dim_size = dim, dim_size
    return Shard(largest_dim)


def test_dp_state_dict_save_load():
    """TestFullyShardStateDictMultiProcess: state dicts of models sharded on a 1-D mesh and on an HSDP mesh (1 x 2
    here), of MLP widths 2 to 5 (uneven shards, empty ones) and 16 with shards along the largest dimension, kept whole
    after forward or not: the values are DTensors over the very storage of the shards, a state dict of new DTensors
    loads into the shards in place, and after a forward that left the parameters gathered the state dict is the
    same. Adapted: DTensor parameters read as plain shards (:func:`local`, :func:`is_sharded_param`); a parameter's
    global size is its state-dict DTensor's."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size()
    fsdp_mesh = init_device_mesh("cpu", (world_size,))
    subtests = [(mlp_dim, fsdp_mesh, False) for mlp_dim in (2, 3, 4, 5)]
    if 16 % world_size == 0:
        subtests.append((16, fsdp_mesh, True))
    if world_size % 2 == 0:
        hsdp_mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        subtests += [(mlp_dim, hsdp_mesh, False) for mlp_dim in (2, 3, 4, 5)] + [(16, hsdp_mesh, True)]
    for mlp_dim, mesh, use_shard_placement_fn in subtests:
        torch.manual_seed(42)
        base_model = nn.Sequential(MLP(mlp_dim), nn.Sequential(MLP(mlp_dim), nn.Linear(mlp_dim, mlp_dim)), MLP(mlp_dim))
        shard_placement_fn = _largest_dim_placement if use_shard_placement_fn else None
        fully_shard_fn = functools.partial(fully_shard, mesh=mesh, shard_placement_fn=shard_placement_fn)

        # Check basic `reshard_after_forward=True`
        model1 = copy.deepcopy(base_model)
        for module in model1:
            fully_shard_fn(module)
        fully_shard_fn(model1)
        _test_state_dict_save_load(model1)

        # Check `reshard_after_forward=False` before and after a forward
        model2 = copy.deepcopy(base_model)
        for module in model2:
            fully_shard_fn(module, reshard_after_forward=False)
        fully_shard_fn(model2, reshard_after_forward=False)
        _test_state_dict_save_load(model2)
        ref_sharded_sd = model2.state_dict()
        inp = torch.randn((2, mlp_dim))
        model2(inp)  # parameters are not resharded after this forward
        # Check that state dict hooks reshard
        sharded_sd = model2.state_dict()
        assert set(ref_sharded_sd.keys()) == set(sharded_sd.keys())
        for key, value in ref_sharded_sd.items():
            assert value.placements == sharded_sd[key].placements, key
            assert_close(value.to_local(), sharded_sd[key].to_local())


def _test_state_dict_save_load(model: nn.Module) -> None:
    from torch.distributed.tensor import DTensor

    for param_name, param in model.named_parameters():
        assert is_sharded_param(model, param), f"Expects parameters to be sharded but got {param_name}: {param}"
    old_fill_value = 1
    new_fill_value = 42 + dist.get_rank()
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(old_fill_value)
    # Use that the parameters are currently sharded, meaning that their data pointers correspond to the sharded
    # parameter data
    param_name_to_data_ptr = {n: local(p).data_ptr() for n, p in model.named_parameters()}
    ref_sharded_sizes = [p.size() for p in model.parameters()]
    state_dict = model.state_dict()
    for param, ref_sharded_size in zip(model.parameters(), ref_sharded_sizes):
        assert param.size() == ref_sharded_size
        assert isinstance(param, nn.Parameter)

    # Verify that keys match, values are DTensors, and values share the same storage as the existing sharded
    # parameter data
    assert set(state_dict.keys()) == set(param_name_to_data_ptr.keys())
    for param_name, tensor in state_dict.items():
        assert isinstance(tensor, DTensor), (param_name, type(tensor))
        if param_name_to_data_ptr[param_name] == 0:
            # Check that this is padding (added by DTensor)
            assert dist.get_rank() > 0
            assert torch.count_nonzero(tensor.to_local()).item() == 0
        else:
            assert tensor.to_local().data_ptr() == param_name_to_data_ptr[param_name], param_name

    # Verify that we can load a new state dict that contains DTensors with storages different from the current model
    # parameters
    new_state_dict: dict[str, DTensor] = {}
    for param_name, dtensor in state_dict.items():
        # Construct new DTensors to exercise load state dict writeback
        new_state_dict[param_name] = dtensor.detach().clone().fill_(new_fill_value)
    for param in model.parameters():
        assert_close(local(param), torch.ones_like(local(param)) * old_fill_value)
    model.load_state_dict(new_state_dict)
    for param_name, param in model.named_parameters():
        local_param = local(param)
        assert_close(local_param, torch.ones_like(local_param) * new_fill_value)
        # Only guarantee that the local tensor's data pointer does not change if the sharding was even (i.e. no
        # padding); otherwise, FSDP may re-pad the local tensor, changing its data pointer
        global_size = state_dict[param_name].size()
        dim = shard_dim(model, param)
        if local_param.size(dim) * dist.get_world_size() == global_size[dim]:
            assert local_param.data_ptr() == param_name_to_data_ptr[param_name], param_name


def test_cached_state_dict():
    """TestFullyShardStateDictMultiProcess: a state dict taken once keeps pointing at the shards' storage through
    training, unless the module was moved away and back after it. Adapted: the move, upstream's ``.cpu()`` then
    ``.cuda()``, is a cast to float64 and back here (each gives the shards new storage); DTensor parameters read as
    plain shards (:func:`local`)."""
    for mlp_dim, mutate_after_state_dict in itertools.product((2, 3, 4, 5), (True, False)):
        torch.manual_seed(42)
        model = nn.Linear(mlp_dim, mlp_dim, bias=False)
        fully_shard(model, reshard_after_forward=True)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

        # call .state_dict() once and use `sd` directly to reduce cpu overhead
        sd = model.state_dict()
        assert is_sharded_param(model, model.weight), type(model.weight)

        if not mutate_after_state_dict:
            assert (local(sd["weight"]).untyped_storage().data_ptr()
                    == local(model.weight).untyped_storage().data_ptr())
        else:
            model = model.to(torch.float64)
            model = model.to(torch.float32)
            assert (local(sd["weight"]).untyped_storage().data_ptr()
                    != local(model.weight).untyped_storage().data_ptr())
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the cast may have given new parameters

        torch.manual_seed(42 + dist.get_rank())
        inp = torch.rand(mlp_dim, mlp_dim)
        for _ in range(5):
            optim.zero_grad()
            loss = model(inp).sum()
            loss.backward()
            optim.step()
            if not mutate_after_state_dict:
                assert (local(sd["weight"]).untyped_storage().data_ptr()
                        == local(model.weight).untyped_storage().data_ptr())


def test_rank0_offload_full_state_dict():
    """TestFullyShardStateDictMultiThread: the sharded state dict's DTensors, each gathered whole
    (``full_tensor()``), rebuild on rank 0 a CPU state dict equal to the unsharded model's, keys in order. Adapted:
    upstream runs it in threads standing for 2 ranks, on a GPU; here the job's 2 processes on the CPU."""
    model_args = ModelArgs(dropout_p=0.0)
    torch.manual_seed(42)
    ref_model = Transformer(model_args)
    for param in ref_model.parameters():
        torch.distributed.broadcast(param.detach(), src=0)

    # Construct a sharded model and sharded state dict on all ranks
    model = copy.deepcopy(ref_model)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module)
    fully_shard(model)
    sharded_sd = model.state_dict()

    # Save a reference CPU full state dict on rank 0 and delete the reference model otherwise
    if dist.get_rank() != 0:
        del ref_model
    else:
        ref_gpu_full_sd = ref_model.state_dict()
        ref_full_sd = {k: v.cpu() for k, v in ref_gpu_full_sd.items()}
        del ref_gpu_full_sd

    # Reshard the sharded state dict to a CPU full state dict on rank 0
    full_sd = {}
    for param_name, sharded_param in sharded_sd.items():
        full_param = sharded_param.full_tensor()
        if dist.get_rank() == 0:
            full_sd[param_name] = full_param.cpu()
        else:
            del full_param

    # Check that we have a CPU full state dict only on rank 0
    if dist.get_rank() == 0:
        assert len(full_sd) == len(ref_full_sd)
        assert list(full_sd.keys()) == list(ref_full_sd.keys())
        for param, ref_param in zip(full_sd.values(), ref_full_sd.values(), strict=True):
            assert param.device == torch.device("cpu")
            assert param.device == ref_param.device
            assert_close(param, ref_param)
    else:
        assert len(full_sd) == 0


# ==================================================================================================
# test_fully_shard_grad_scaler.py
# ==================================================================================================


def grad_scaler(**kwargs: Any) -> torch.amp.GradScaler:
    """Upstream's ``GradScaler(...)`` on the CPU: torch's own for FSDP2, whose DTensor gradients all-reduce its check
    for infs; for minidp's plain shards, ``ShardedGradScaler``, which all-reduces it itself (the module docstring)."""
    if ON_TORCH:
        return torch.amp.GradScaler("cpu", **kwargs)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler("cpu", **kwargs)


def test_gradient_scaler():
    """TestFullyShardGradientScaler: an inf put into rank 1's shard of a gradient is seen by every rank's scaler: each
    skips the step and backs the scale off; without it, each steps and keeps the scale. Adapted: the scaler is
    :func:`grad_scaler`; the inf goes into rank 1's shard (upstream: the rank on device 1); upstream's 2-D (TP)
    subtests are out."""
    from torch.amp.grad_scaler import OptState

    for has_inf in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        input = torch.randn([4, 4])
        loss = model(input).sum()
        scaler = grad_scaler(init_scale=2.0, enabled=True)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        scaler.scale(loss).backward()
        inv_scale = scaler._scale.double().reciprocal().float()
        if has_inf is True and dist.get_rank() == 1:
            local(opt.param_groups[0]["params"][0].grad)[0, 0].fill_(float("inf"))
        inital_grad = local(opt.param_groups[0]["params"][0].grad).clone()

        scaler.unscale_(opt)
        for found_inf in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values():
            assert found_inf == has_inf, (found_inf, has_inf)
        assert scaler._per_optimizer_states[id(opt)]["stage"].value == OptState.UNSCALED.value
        unscaled_grad = local(opt.param_groups[0]["params"][0].grad).clone()
        assert_close(unscaled_grad, inital_grad * inv_scale)
        initial_scale = scaler.get_scale()
        initial_state = copy.copy(opt.state)

        scaler.step(opt)
        steped_state = copy.copy(opt.state)
        if has_inf:
            # assert parameters are the same before/after
            assert steped_state == initial_state
        else:
            # new parameters here if no inf found during .unscale_()
            assert steped_state.items() != initial_state.items()

        scaler.update()
        updated_scale = scaler.get_scale()
        if has_inf:
            # assert scale is updated
            backoff_factor = scaler.get_backoff_factor()
            assert updated_scale == initial_scale * backoff_factor
        else:
            # scale is not updated
            assert updated_scale == initial_scale


# ==================================================================================================
# test_fully_shard_comm.py
# ==================================================================================================


def _shard_blocks_and_root(model: nn.Module, fully_shard_fn: Callable[[nn.Module], Any]) -> int:
    """TestFullyShardCommunication's sharding: each ``TransformerBlock`` a group, then the root; the number of blocks."""
    num_blocks = 0
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard_fn(module)
            num_blocks += 1
    fully_shard_fn(model)
    return num_blocks


def _counted_forward(model: nn.Module, model_args: ModelArgs, all_gathers: int) -> torch.Tensor:
    """Upstream's forward under ``CommDebugMode`` (here :class:`CollectiveLog`): all-gathers only, ``all_gathers`` of
    them; the output."""
    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randint(0, model_args.vocab_size, (2, 16))
    with CollectiveLog() as fwd_comm_mode:
        loss = model(inp)
    fwd_comm_counts = fwd_comm_mode.counts()
    assert len(fwd_comm_counts) == 1, fwd_comm_counts
    assert fwd_comm_counts[ALL_GATHER] == all_gathers, fwd_comm_counts
    return loss


def _counted_backward(loss: torch.Tensor) -> Counter:
    """Upstream's backward under ``CommDebugMode``: the collectives it issued, by name."""
    with CollectiveLog() as bwd_comm_mode:
        loss.sum().backward()
    return bwd_comm_mode.counts()


def test_fully_shard_communication_count():
    """TestFullyShardCommunication: the forward all-gathers each group once; the backward all-gathers again the groups
    resharded after the forward (all of them, none, or all but the root by default) and reduce-scatters every group
    once, ``reshard_after_forward`` True, False, 2 and None. Adapted: :class:`CollectiveLog` counts the collectives
    (upstream: ``CommDebugMode``)."""
    for reshard_after_forward in (True, False, 2, None):
        torch.manual_seed(42)
        model_args = ModelArgs()
        model = Transformer(model_args)
        num_blocks = _shard_blocks_and_root(model, functools.partial(
            fully_shard, reshard_after_forward=reshard_after_forward))
        # We construct `num_blocks` plus 1 FSDP states/communication groups
        loss = _counted_forward(model, model_args, num_blocks + 1)
        bwd_comm_counts = _counted_backward(loss)
        if reshard_after_forward is None:
            # 2 means two types of collectives (all-gather, reduce-scatter)
            assert len(bwd_comm_counts) == 2, bwd_comm_counts
            # do not reshard root model
            assert bwd_comm_counts[ALL_GATHER] == num_blocks, bwd_comm_counts
        elif reshard_after_forward:
            assert len(bwd_comm_counts) == 2, bwd_comm_counts
            assert bwd_comm_counts[ALL_GATHER] == num_blocks + 1, bwd_comm_counts
        else:
            assert len(bwd_comm_counts) == 1, bwd_comm_counts
        assert bwd_comm_counts[REDUCE_SCATTER] == num_blocks + 1, bwd_comm_counts


def test_manual_reshard_with_reshard_after_forward_false():
    """TestFullyShardCommunication: groups kept whole after the forward (``reshard_after_forward=False``), then
    resharded by hand (``module.reshard()``), are all-gathered again by the backward. Adapted as
    test_fully_shard_communication_count."""
    torch.manual_seed(42)
    model_args = ModelArgs()
    model = Transformer(model_args)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, reshard_after_forward=False)
    model = fully_shard(model, reshard_after_forward=False)
    num_fsdp_modules = sum(is_sharded_module(module) for module in model.modules())
    loss = _counted_forward(model, model_args, num_fsdp_modules)
    for module in model.modules():
        if is_sharded_module(module):
            module.reshard()
    bwd_comm_counts = _counted_backward(loss)
    assert len(bwd_comm_counts) == 2, bwd_comm_counts
    assert bwd_comm_counts[ALL_GATHER] == num_fsdp_modules, bwd_comm_counts
    assert bwd_comm_counts[REDUCE_SCATTER] == num_fsdp_modules, bwd_comm_counts


def test_set_reshard_after_forward():
    """TestFullyShardCommunication: ``set_reshard_after_forward`` after ``fully_shard`` (on every group, or with
    ``recurse=False`` on the root only) gives the collectives of the same choice made at ``fully_shard``. Adapted as
    test_fully_shard_communication_count."""
    for set_reshard_after_forward, recurse in itertools.product((True, False, None), (True, False)):
        torch.manual_seed(42)
        model_args = ModelArgs()
        model = Transformer(model_args)
        if set_reshard_after_forward is None:
            fully_shard_fn = fully_shard
        else:
            fully_shard_fn = functools.partial(fully_shard, reshard_after_forward=not set_reshard_after_forward)
        num_blocks = _shard_blocks_and_root(model, fully_shard_fn)
        num_fsdp_modules = sum(is_sharded_module(module) for module in model.modules())
        if set_reshard_after_forward is not None:
            model.set_reshard_after_forward(reshard_after_forward=set_reshard_after_forward, recurse=recurse)
        loss = _counted_forward(model, model_args, num_fsdp_modules)
        bwd_comm_counts = _counted_backward(loss)
        # If recurse is False, set_reshard_after_forward only affects the root module
        if set_reshard_after_forward is None:
            assert len(bwd_comm_counts) == 2, bwd_comm_counts
            assert bwd_comm_counts[ALL_GATHER] == num_blocks, bwd_comm_counts
        elif set_reshard_after_forward:
            assert len(bwd_comm_counts) == 2, bwd_comm_counts
            assert bwd_comm_counts[ALL_GATHER] == (num_blocks + 1 if recurse else 1), bwd_comm_counts
        else:
            if recurse:
                assert len(bwd_comm_counts) == 1, bwd_comm_counts
            else:
                assert len(bwd_comm_counts) == 2, bwd_comm_counts
                assert bwd_comm_counts[ALL_GATHER] == num_blocks, bwd_comm_counts
        assert bwd_comm_counts[REDUCE_SCATTER] == num_blocks + 1, bwd_comm_counts


def test_set_reduce_scatter_divide_factor():
    """TestFullyShardCommunication: ``set_gradient_divide_factor`` on the root (a factor of twice the world size, or
    the world size) divides the root's gradients by it and the blocks' by the world size, on a 1-D mesh and on the
    HSDP meshes 1 x 2 and 2 x 1, and with a bfloat16 policy reducing in float32: losses, sharded parameters and
    gradients equal the reference's, averaged by hand with those factors."""
    from torch.distributed.device_mesh import init_device_mesh

    world_size = dist.get_world_size()
    for divide_factor, mesh_shape in itertools.product((world_size * 2, world_size),
                                                       ((world_size,), (world_size // 2, 2), (world_size, 1))):
        torch.manual_seed(42)
        model_args = ModelArgs(dropout_p=0.0, weight_tying=False)
        model = Transformer(model_args)
        ref_model = copy.deepcopy(model)
        ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
        mesh_dim_names = ("outer",) if len(mesh_shape) == 1 else ("outer", "inner")
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_dim_names)
        shards = mesh.get_group(mesh_dim_names[-1])
        for module in model.modules():
            if isinstance(module, TransformerBlock):
                fully_shard(module, reshard_after_forward=False, mesh=mesh)
        model = fully_shard(model, reshard_after_forward=False, mesh=mesh)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model.set_gradient_divide_factor(divide_factor)

        # Get ref_model params which should have the specific division factor applied
        block_params = set()
        for ref_mod in ref_model.modules():
            if isinstance(ref_mod, TransformerBlock):
                block_params.update(ref_mod.parameters())
        non_block_params = set(ref_model.parameters()) - block_params

        torch.manual_seed(42 + dist.get_rank())
        inp = torch.randint(0, model_args.vocab_size, (2, 16))
        for _ in range(10):
            ref_loss = ref_model(inp).sum()
            ref_loss.backward()
            for param in ref_model.parameters():
                factor = divide_factor if param in non_block_params else world_size
                param.grad.mul_(1.0 / factor)
                dist.all_reduce(param.grad)
            loss = model(inp).sum()
            loss.backward()
            ref_optim.step()
            optim.step()
            assert_close(ref_loss, loss)
            # Check parity before calling zero_grad so that grads are also checked
            check_sharded_parity(ref_model, model, group=shards)
            ref_optim.zero_grad()
            optim.zero_grad()

    # the mixed precision subtest
    divide_factor = world_size
    torch.manual_seed(42)
    param_dtype, reduce_dtype = torch.bfloat16, torch.float32
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = nn.Sequential(*[MLP(16) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    ref_model_bf16 = copy.deepcopy(ref_model).to(param_dtype)
    ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for mlp in model:
        fully_shard(mlp, mp_policy=mp_policy)
    model = fully_shard(model, mp_policy=mp_policy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.set_gradient_divide_factor(divide_factor)

    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randn((4, 16), dtype=param_dtype)
    for _ in range(10):
        loss = model(inp).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()

        ref_loss = ref_model_bf16(inp.to(param_dtype)).sum()
        ref_loss.backward()
        for param in ref_model_bf16.parameters():
            param.grad.data = param.grad.to(torch.float32)
            param.grad.mul_(1.0 / divide_factor)
            dist.all_reduce(param.grad)
        for param_fp32, param_bf16 in zip(ref_model.parameters(), ref_model_bf16.parameters()):
            param_fp32.grad = param_bf16.grad
            param_bf16.grad = None
        ref_optim.step()
        for param_fp32, param_bf16 in zip(ref_model.parameters(), ref_model_bf16.parameters()):
            param_bf16.detach().copy_(param_fp32)
        ref_optim.zero_grad()

        assert_close(ref_loss, loss)
        check_sharded_parity(ref_model, model)


# ==================================================================================================
# test_fully_shard_clip_grad_norm_.py
# ==================================================================================================


def clip_grad_norm_(parameters, max_norm: float, norm_type: float) -> torch.Tensor:
    """Upstream's ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``: on FSDP2's DTensor gradients torch's
    own reduces each norm over the ranks; minidp's plain shards take ``minidp.distributed.clip_grad_norm_``."""
    if ON_TORCH:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm=max_norm, norm_type=norm_type, foreach=True)
    return md.clip_grad_norm_(parameters, max_norm=max_norm, norm_type=norm_type, foreach=True)


def test_clip_grad_norm_1d():
    """TestClipGradNormWorldSize2: a transformer, each block a group and the root, beside a DDP reference, norms 2, 1
    and ``inf``, max norm 1: every whole gradient equals the reference's and is above the max norm before clipping
    (each rank's local part too), the total norm equals the reference's, and every clipped gradient is within the max
    norm and changed. Upstream: 2 GPUs, 10 iterations; here the CPU, 5. Upstream's check of one all-reduce
    (CommDebugMode on DTensor's functional collectives) is left out: minidp reduces with one all-reduce a group."""
    for norm_type in (2, 1, float("inf")):
        torch.manual_seed(42)
        model_args = ModelArgs(dropout_p=0.0)
        model = Transformer(model_args)
        ref_model = replicate(copy.deepcopy(model))
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        _shard_blocks_then_root(model, reshard_after_forward=True)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        max_norm = 1
        vector_norm_fn = functools.partial(torch.linalg.vector_norm, ord=norm_type)
        torch.manual_seed(42 + dist.get_rank() + 1)
        inp = torch.randint(0, model_args.vocab_size, (3, 16))
        for _ in range(5):
            ref_optim.zero_grad()
            ref_model(inp).sum().backward()
            optim.zero_grad()
            model(inp).sum().backward()
            ref_grads = [p.grad.detach().clone() for p in ref_model.parameters()]
            local_grads = [local(p.grad).detach().clone() for p in model.parameters()]
            for ref_grad, (name, param) in zip(ref_grads, model.named_parameters()):
                assert_close(ref_grad, full_tensor(param.grad, ref_grad.shape, shard_dim(model, param)),
                             msg=lambda m: f"{name}.grad: {m}")
            assert all(vector_norm_fn(g).item() > max_norm for g in ref_grads)
            assert all(vector_norm_fn(g).item() > max_norm for g in local_grads)
            ref_total_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=max_norm,
                                                            norm_type=norm_type)
            total_norm = clip_grad_norm_(model.parameters(), max_norm, norm_type)
            assert_close(ref_total_norm, total_norm.full_tensor() if _is_dtensor(total_norm) else total_norm)
            for param, grad in zip(ref_model.parameters(), ref_grads):
                assert vector_norm_fn(param.grad).item() <= max_norm
                if torch.count_nonzero(grad):
                    assert not torch.equal(param.grad, grad)
            for param, grad in zip(model.parameters(), local_grads):
                assert vector_norm_fn(local(param.grad)).item() <= max_norm
                if torch.count_nonzero(grad):
                    assert not torch.equal(local(param.grad), grad)
            ref_optim.step()
            optim.step()


# ==================================================================================================
# test/distributed/checkpoint/fsdp/test_fsdp_dsd.py (TestFullyShardWithDistributedStateDict)
# ==================================================================================================


def _dsd_base_model(mlp_dim: int = 2) -> nn.Module:
    return nn.Sequential(MLP(mlp_dim), nn.Sequential(MLP(mlp_dim), nn.Linear(mlp_dim, mlp_dim)), MLP(mlp_dim))


def test_1d_fsdp_get_model_state_dict():
    """``get_model_state_dict`` of a sharded model is its ``state_dict()``, widths 2 to 5 (uneven shards, empty
    ones), before any forward and after one that left the parameters gathered (``reshard_after_forward=False``: the
    state dict hooks reshard). Adapted: the input on the CPU."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    for mlp_dim in (2, 3, 4, 5):
        base_model = _dsd_base_model(mlp_dim)
        # Default is `reshard_after_forward=True`
        model1 = copy.deepcopy(base_model)
        for module in model1:
            fully_shard(module)
        fully_shard(model1)

        # osd: original state dict, dsd: distributed state dict
        osd = model1.state_dict()
        dsd = get_model_state_dict(model1)
        assert_equal_as_upstream(osd, dsd)

        # Check `reshard_after_forward=False` after a forward
        model2 = copy.deepcopy(base_model)
        for module in model2:
            fully_shard(module, reshard_after_forward=False)
        fully_shard(model2, reshard_after_forward=False)
        inp = torch.randn((2, mlp_dim))
        model2(inp)  # parameters are not resharded after this forward
        # Check that state dict hooks reshard
        osd_2 = model2.state_dict()
        dsd_2 = get_model_state_dict(model2)
        assert_equal_as_upstream(osd_2, dsd_2)


def test_1d_fsdp_cpu_offload_full_model_state_dict():
    """``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` gathers every parameter whole on rank 0 alone,
    on the CPU, equal to the unsharded model's state dict; the other ranks get an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_all_only

    orig_model = _dsd_base_model()
    fsdp_model = copy.deepcopy(orig_model)
    for module in fsdp_model:
        fully_shard(module)
    fully_shard(fsdp_model)

    osd = orig_model.state_dict()
    dsd = get_model_state_dict(fsdp_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    cpu_device = torch.device("cpu")

    def is_cpu(v):
        if isinstance(v, DTensor):
            return v.device == torch.device("cpu")
        else:
            return v.device == cpu_device

    if dist.get_rank() == 0:
        assert_equal_as_upstream(osd, dsd)
        assert tree_all_only((torch.Tensor, DTensor), is_cpu, osd)
    else:
        assert dsd == {}


def test_save_with_fsdp1_and_load_with_fsdp2():
    """A model and its AdamW state saved by ``torch.distributed.checkpoint`` from FSDP1 (``FullyShardedDataParallel``,
    full and sharded state dict types) load into the same model sharded by ``fully_shard`` and a fresh optimizer
    (``get_optimizer_state_dict`` as the template, ``dcp.load``, then the plain ``load_state_dict`` of each): both whole
    state dicts, the model's and the optimizer's, are FSDP1's. Adapted: FSDP1 on the CPU (upstream: ``.cuda()``), a
    temporary directory made by rank 0 and shared (upstream's ``with_temp_dir``); FSDP1's whole state dicts gathered
    on every rank and kept on rank 0 alone, since with ``cpu_offload=True`` (which keeps them on rank 0 alone) FSDP1 on
    the CPU crashes in torch 2.13 (a segmentation fault in ``get_model_state_dict``)."""
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.wrap import always_wrap_policy

    for state_dict_type in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
        temp_dir = [tempfile.mkdtemp(prefix="minidp-dsd-") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(temp_dir, src=0)
        try:
            # Save state dict with model wrapped with FSDP1
            fsdp1_model = FSDP(_dsd_base_model(), use_orig_params=True, auto_wrap_policy=always_wrap_policy,
                               device_id=torch.device("cpu"))

            fsdp1_optim = torch.optim.AdamW(fsdp1_model.parameters(), lr=0.1)

            fsdp1_model(torch.randn((2,))).sum().backward()
            fsdp1_optim.step()

            with FSDP.state_dict_type(fsdp1_model, state_dict_type):
                fsdp1_state_dict = {
                    "model": fsdp1_model.state_dict(),
                    "optim": FSDP.sharded_optim_state_dict(fsdp1_model, fsdp1_optim),
                }
                dcp.save(fsdp1_state_dict, checkpoint_id=temp_dir[0])

            # (cpu_offload=False, kept on rank 0 alone: what cpu_offload=True gives, which crashes FSDP1 on the CPU)
            fsdp1_full_msd = get_model_state_dict(fsdp1_model, options=StateDictOptions(full_state_dict=True))
            fsdp1_full_osd = get_optimizer_state_dict(
                fsdp1_model, fsdp1_optim, options=StateDictOptions(full_state_dict=True))
            if dist.get_rank() != 0:
                fsdp1_full_msd, fsdp1_full_osd = {}, {}

            # Load state dict into model with FSDP2 applied
            fsdp2_model = _dsd_base_model()
            for module in fsdp2_model:
                fully_shard(module)
            fully_shard(fsdp2_model)
            fsdp2_optim = torch.optim.AdamW(fsdp2_model.parameters(), lr=0.1)

            fsdp2_state_dict = {
                "model": get_model_state_dict(fsdp2_model),
                "optim": get_optimizer_state_dict(fsdp2_model, fsdp2_optim),
            }
            dcp.load(fsdp2_state_dict, checkpoint_id=temp_dir[0])
            fsdp2_model.load_state_dict(fsdp2_state_dict["model"])
            fsdp2_optim.load_state_dict(fsdp2_state_dict["optim"])

            fsdp2_full_msd = get_model_state_dict(
                fsdp2_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            fsdp2_full_osd = get_optimizer_state_dict(
                fsdp2_model, fsdp2_optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

            # Compare full state dict to make sure they are the same.
            assert_equal_as_upstream(fsdp2_full_msd, fsdp1_full_msd)
            assert_equal_as_upstream(fsdp1_full_osd, fsdp2_full_osd)
        finally:
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(temp_dir[0])


# ==================================================================================================
# test_fully_shard_init.py
# ==================================================================================================


def _state_dict_dtensor(model: nn.Module, name: str, param: torch.Tensor) -> Any:
    """A registered parameter as FSDP2's DTensor: the parameter itself (FSDP2), or its value in ``model.state_dict()``,
    the DTensor minidp gives over this rank's shard (with the global size, stride, mesh and placements)."""
    return param if ON_TORCH else model.state_dict()[name]


class DictWithForward(nn.ModuleDict):
    def __init__(self, in_features: int = 8, out_features: int = 8) -> None:
        super().__init__({"lin": nn.Linear(in_features, out_features)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self["lin"](x)


class ListWithForward(nn.ModuleList):
    def __init__(self, in_features: int = 8, out_features: int = 8) -> None:
        super().__init__([nn.Linear(in_features, out_features)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for m in self:
            out = m(out)
        return out


def test_moduledict_subclass_with_forward():
    """TestFullyShardContainerSubclasses: a ``ModuleDict`` subclass that implements ``forward`` is taken (a plain
    container is refused) and runs forward. Adapted: a CPU mesh of 2 ranks (upstream: 1 GPU)."""
    from torch.distributed.device_mesh import init_device_mesh

    model = DictWithForward(8, 8)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fsdp_model = fully_shard(model, mesh=mesh)
    fsdp_model(torch.randn(2, 8))


def test_modulelist_subclass_with_forward():
    """TestFullyShardContainerSubclasses: the same for a ``ModuleList`` subclass."""
    from torch.distributed.device_mesh import init_device_mesh

    model = ListWithForward(8, 8)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fsdp_model = fully_shard(model, mesh=mesh)
    fsdp_model(torch.randn(2, 8))


def test_invalid_mesh_ndim():
    """TestFullyShardMeshArg: a 3-D mesh is refused (``ValueError``). Adapted: (2, 1, 1) on 2 ranks (upstream:
    (4, 1, 1) on 4)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1, 1))
    model = MLP(8)
    with raises(ValueError, r"fully\_shard expects a 1D or 2D DeviceMesh but got DeviceMesh"):
        fully_shard(model, mesh=mesh)


def test_2d_mesh_without_mesh_dim_names():
    """TestFullyShardMeshArg: a 2-D mesh (HSDP) without ``mesh_dim_names`` is refused (``AssertionError``). Adapted:
    (1, 2) on 2 ranks (upstream: (2, 2) on 4)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2))
    model = MLP(8)
    with raises(AssertionError, "Please init the 2D mesh for HSDP with mesh_dim_names specified"):
        fully_shard(model, mesh=mesh)


def test_shard_tensor_parameters():
    """TestFullyShardShardedParameterTensor: odd sizes (uneven shards), with and without a shared sub-module: each
    parameter is a DTensor on the world's 1-D mesh, of the original's size and stride, ``Shard(0)``, whose local
    tensor is rank r's ``torch.chunk``. Adapted: the registered parameter is checked sharded
    (:func:`is_sharded_param`) and the DTensor read is minidp's state-dict value for it (:func:`_state_dict_dtensor`);
    on the CPU (upstream gates it on a GPU for the device only)."""
    from torch.distributed.device_mesh import init_device_mesh

    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
    orig_params = [param.detach().clone() for param in model.parameters()]
    fully_shard(model)
    _check_1d_sharded_parameters(model, orig_params, init_device_mesh("cpu", (dist.get_world_size(),)))

    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
    model[0].in_proj = model[1].in_proj
    orig_params = [param.detach().clone() for param in model.parameters()]
    fully_shard(model)
    _check_1d_sharded_parameters(model, orig_params, init_device_mesh("cpu", (dist.get_world_size(),)))


def _check_1d_sharded_parameters(model: nn.Module, orig_params: list[torch.Tensor], global_mesh: Any) -> None:
    sharded_params = list(model.named_parameters())
    assert len(orig_params) == len(sharded_params)
    for orig_param, (name, param) in zip(orig_params, sharded_params):
        assert is_sharded_param(model, param), f"{name} is not sharded"
        sharded_param = _state_dict_dtensor(model, name, param)
        assert _is_dtensor(sharded_param), name
        assert sharded_param.device_mesh == global_mesh, name
        assert sharded_param.size() == orig_param.size(), name
        assert sharded_param.stride() == orig_param.stride(), name
        assert sharded_param._spec.placements == (Shard(0),), name
        chunks = torch.chunk(orig_param, dist.get_world_size(), dim=0)
        assert_close(sharded_param._local_tensor, chunks[dist.get_rank()])


def test_raise_scalar_parameter():
    """TestFullyShardShardedParameterTensor: a scalar parameter is refused, with the way out (``ValueError``)."""
    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
    model.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    with raises(ValueError, "Change scalar_p to a 1D tensor with numel equal to 1."):
        fully_shard(model)


def test_raise_noncontiguous_parameter():
    """TestFullyShardShardedParameterTensor: a non-contiguous parameter (a ``channels_last`` convolution's weight) is
    refused (``NotImplementedError``)."""
    conv2d = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    with raises(NotImplementedError, "FSDP does not support non-contiguous parameters"):
        fully_shard(conv2d)


def test_reset_sharded_param_in_lazy_init():
    """TestFullyShardLazyInit: a model built on the meta device and sharded there, two of its groups materialised
    with ``to_empty``, and the root's own parameter replaced by one computed from their (sharded) weights, before
    the first forward: forward and backward run on it. Adapted: on 2 processes (upstream: 2 threads)."""

    class MyModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer1 = nn.Linear(3, 3, bias=False)
            self.layer2 = nn.Linear(3, 3, bias=False)
            self.weight_norm = nn.Parameter(torch.empty(3))

        def init_weight_norm(self) -> None:
            with torch.no_grad():
                weight_norm = torch.linalg.norm(self.layer1.weight, dim=1) + torch.linalg.norm(
                    self.layer2.weight, dim=1)
            model.weight_norm = nn.Parameter(weight_norm)

        def forward(self, inp: torch.Tensor) -> torch.Tensor:
            out = self.layer1(inp)
            out = self.layer2(out)
            return out.sum() + self.weight_norm.sum()

    with torch.device("meta"):
        model = MyModel()
    fully_shard(model.layer1)
    fully_shard(model.layer2)
    fully_shard(model)

    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    model.init_weight_norm()

    inp = torch.randn(3, 3)
    loss = model(inp).sum()
    loss.backward()


def test_meta_device_1d_init():
    """TestFullyShardMetaDeviceInit: models built on the meta device and sharded there (even shards, uneven ones and
    an empty one; with a bfloat16 compute dtype or not; and under ``torch.device("meta")`` without a mesh) stay on the
    meta device; ``to_empty`` materialises them, ``reset_parameters`` gives values to every local shard and buffer,
    and a step runs. Adapted: ``to_empty(device="cpu")`` on 2 ranks (upstream: the current GPU, 4 ranks; its mlp_dim
    of 1 leaves an empty shard on 2 ranks too)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape=(dist.get_world_size(),))
    # Test both even sharding (8), uneven sharding (3), and empty local tensor (1)
    for mlp_dim in (8, 3, 1):
        # cover foreach_copy code path for bf16
        for mp_policy in (MixedPrecisionPolicy(),
                          MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)):
            with torch.device("meta"):
                model = nn.Sequential(MLP(mlp_dim, dim_multiplier=1, with_buffer=True, bias=False),
                                      MLP(mlp_dim, dim_multiplier=1, bias=False))
                for param in model.parameters():
                    assert param.device == torch.device("meta")
                fully_shard(model[0], mesh=mesh, mp_policy=mp_policy)
                fully_shard(model[1], mesh=mesh, mp_policy=mp_policy)
                fully_shard(model, mesh=mesh, mp_policy=mp_policy)
            for param in model.parameters():
                assert param.device == torch.device("meta")
            _test_to_empty_and_reset_parameters(model, mlp_dim)

    # Test that we can call `fully_shard` under meta-device context and
    # that `init_device_mesh` call still works
    mlp_dim = 8
    with torch.device("meta"):
        model = nn.Sequential(MLP(mlp_dim, with_buffer=True), MLP(mlp_dim))
        for param in model.parameters():
            assert param.device == torch.device("meta")
        for module in (model[0], model[1], model):
            fully_shard(module)
    for param in model.parameters():
        assert param.device == torch.device("meta")
    _test_to_empty_and_reset_parameters(model, mlp_dim)


def _test_to_empty_and_reset_parameters(model: nn.Module, mlp_dim: int) -> None:
    # Check that we can materialize it on the CPU with empty values
    device = torch.device("cpu")
    model.to_empty(device=device)
    for param in model.parameters():
        assert param.device == device
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    # Check that `reset_parameters()` on each module initializes values
    const = 1337
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        tensor.detach().fill_(const)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for param in model.parameters():
        local_tensor = local(param)
        if local_tensor.numel() > 0:
            assert_not_close(local_tensor, torch.ones_like(local_tensor) * const)
    for buffer in model.buffers():
        assert_not_close(buffer, torch.ones_like(buffer) * const)

    # Check that we can run an iteration without erroring
    inp = torch.randn((4, mlp_dim))
    model(inp).sum().backward()
    optim.step()


def test_invalid_meta_device_init():
    """TestFullyShardMetaDeviceInit: a forward on parameters still on the meta device is refused, naming them (those
    of the first group to gather, by their names under the root). Adapted: a CPU mesh of 2 ranks, the input on the
    CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape=(dist.get_world_size(),))
    mlp_dim = 8
    with torch.device("meta"):
        model = nn.Sequential(MLP(mlp_dim, with_buffer=True), MLP(mlp_dim))
        for param in model.parameters():
            assert param.device == torch.device("meta")
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[1], mesh=mesh)
        fully_shard(model, mesh=mesh)
    inp = torch.randn((4, mlp_dim))
    error_regex = (
        "FSDP parameters should be materialized from meta device before training, "
        "but the following were still on meta device: "
        r"\['0.in_proj.weight', '0.in_proj.bias', '0.out_proj.weight', '0.out_proj.bias'\]"
    )
    with raises(RuntimeError, error_regex):
        model(inp)


def test_rank0_broadcast_meta_device_init():
    """TestFullyShardMetaDeviceInit: a Transformer built on the meta device and sharded there gets its weights from
    rank 0's whole state dict, broadcast and cut by ``distribute_tensor`` along the placements of the meta state
    dict's DTensors, loaded with ``assign=True``; it then equals a reference sharded from whole weights, in its
    parameters, its loss and its gradients. Adapted: the registered parameters are checked sharded
    (:func:`is_sharded_param`) and compared by their local tensors (:func:`local`); on the CPU, 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model_args = ModelArgs(dropout_p=0.0)
    # Assume we have a CPU full state dict on rank 0
    if rank == 0:
        torch.manual_seed(42)
        ref_model = Transformer(model_args)
        full_sd = ref_model.state_dict()
        for param in full_sd.values():
            assert param.device == torch.device("cpu")

    # Initialize the sharded model on meta device
    fsdp_mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = Transformer(model_args)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    for param in model.parameters():
        assert param.device == torch.device("meta")

    # Construct a sharded state dict from the rank 0 full state dict by
    # broadcasting and sharding
    meta_sharded_sd = model.state_dict()
    sharded_sd = {}
    if rank == 0:
        assert len(meta_sharded_sd) == len(full_sd)
        assert list(meta_sharded_sd.keys()) == list(full_sd.keys())
        for (param_name, full_param), sharded_meta_param in zip(full_sd.items(), meta_sharded_sd.values()):
            full_param = full_param.detach()
            mesh = sharded_meta_param.device_mesh
            dist.broadcast(full_param, src=0, group=mesh.get_group(0))
            sharded_tensor = distribute_tensor(full_param, mesh, sharded_meta_param.placements)
            sharded_sd[param_name] = nn.Parameter(sharded_tensor)
    else:
        for param_name, sharded_meta_param in meta_sharded_sd.items():
            full_tensor = torch.empty(sharded_meta_param.size(), dtype=sharded_meta_param.dtype)
            mesh = sharded_meta_param.device_mesh
            dist.broadcast(full_tensor, src=0, group=mesh.get_group(0))
            sharded_tensor = distribute_tensor(full_tensor, mesh, sharded_meta_param.placements)
            sharded_sd[param_name] = nn.Parameter(sharded_tensor)

    model.load_state_dict(sharded_sd, assign=True)
    for name, param in model.named_parameters():
        assert is_sharded_param(model, param), name
        assert param.device.type == "cpu"

    # Construct the reference model on nonzero ranks by broadcasting the
    # unsharded model from rank 0 and sharding on all ranks
    if rank != 0:
        ref_model = Transformer(model_args)
    for param in ref_model.parameters():
        torch.distributed.broadcast(param.detach(), src=0)
    for module in ref_model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, mesh=fsdp_mesh)
    fully_shard(ref_model, mesh=fsdp_mesh)

    for (param_name, param), (ref_param_name, ref_param) in zip(model.named_parameters(),
                                                                ref_model.named_parameters()):
        assert param_name == ref_param_name
        assert_close(local(param), local(ref_param))

    # Check one forward/backward for parity
    inp = torch.randint(0, model_args.vocab_size, (2, 16))
    loss = model(inp).sum()
    loss.backward()
    ref_loss = ref_model(inp).sum()
    ref_loss.backward()
    assert_close(loss, ref_loss)
    for param, ref_param in zip(model.parameters(), ref_model.parameters()):
        assert_close(local(param.grad), local(ref_param.grad))


def _mesh_of(model: nn.Module, name: str, param: torch.Tensor) -> torch.Tensor:
    """The ranks of the mesh a registered parameter is sharded over (FSDP2's ``param.device_mesh.mesh``; minidp's:
    that of the DTensor its state dict gives for it)."""
    return _state_dict_dtensor(model, name, param).device_mesh.mesh


def test_1d_process_group_init():
    """TestFullyShardProcessGroupInit: a 1-D mesh made by ``DeviceMesh.from_group`` from the data-parallel group of a
    (dp, tp) mesh equals that mesh's dp slice, and sharding over it gives the same loss, shards and gradients as over
    the slice. Adapted: a (2, 1) mesh on 2 ranks (upstream: (2, 2) on 4; its TP ranks only share the input); DTensors
    compared by their local tensors (:func:`local`), their meshes as :func:`_mesh_of` reads them (a gradient's mesh is
    its parameter's: minidp's is a plain tensor)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    # For convenience, use device mesh's infra to construct the DP PG
    # (in practice, the trainer would do it manually via `new_group()`)
    dp_size = 2
    global_mesh = init_device_mesh("cpu", (dp_size, dist.get_world_size() // dp_size), mesh_dim_names=("dp", "tp"))
    ref_dp_mesh, tp_mesh = global_mesh["dp"], global_mesh["tp"]
    dp_pg = ref_dp_mesh.get_group(0)

    # Check the `from_group()` API for correctness
    dp_mesh = DeviceMesh.from_group(dp_pg, "cpu", mesh_dim_names=("dp",))
    # Only compare the mesh tensors, not `DeviceMesh` objects themselves,
    # since the ref has a parent mesh, while the `from_group` one does not
    assert torch.equal(dp_mesh.mesh, ref_dp_mesh.mesh)
    assert dp_mesh._coordinate_on_dim == ref_dp_mesh._coordinate_on_dim
    assert dp_mesh._dim_group_names == ref_dp_mesh._dim_group_names

    # Check 1D FSDP forward/backward parity over the DP mesh
    torch.manual_seed(42)
    mlp_dim = 8
    ref_model = MLP(mlp_dim)
    for param in ref_model.parameters():
        dist.broadcast(param.detach(), src=0)
    model = copy.deepcopy(ref_model)

    # Parallelize the test model with the ref DP mesh
    for module in (ref_model.in_proj, ref_model.out_proj, ref_model):
        fully_shard(module, mesh=ref_dp_mesh)
    # Parallelize the test model with the new DP mesh from the PG
    for module in (model.in_proj, model.out_proj, model):
        fully_shard(module, mesh=dp_mesh)

    # Ensure that TP ranks have the same input
    inp = torch.randn((4, mlp_dim))
    dist.broadcast(inp, src=dist.get_process_group_ranks(tp_mesh.get_group(0))[0], group=tp_mesh.get_group(0))

    ref_loss = ref_model(inp).sum()
    ref_loss.backward()
    loss = model(inp).sum()
    loss.backward()
    assert_close(loss, ref_loss)
    for (name, param), ref_param in zip(model.named_parameters(), ref_model.parameters()):
        assert_close(local(param), local(ref_param))
        assert torch.equal(_mesh_of(model, name, param), _mesh_of(ref_model, name, ref_param))
        assert_close(local(param.grad), local(ref_param.grad))


def test_2d_process_group_init():
    """TestFullyShardProcessGroupInit: a 2-D mesh made by ``DeviceMesh.from_group`` from a replicate group and a shard
    group (FSDP1's helpers make them) equals ``init_device_mesh``'s, and HSDP over it gives the same loss, shards and
    gradients. Adapted: a (1, 2) mesh on 2 ranks (upstream: (2, 2) on 4), whose replicate groups are found by the ranks
    per node (the shard group's size); compared by local tensors (:func:`local`)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp._init_utils import _init_inter_node_process_group, _init_intra_node_process_group

    world_size = dist.get_world_size()
    shard_mesh_dim_size = 2
    assert world_size % shard_mesh_dim_size == 0
    replicate_mesh_dim_size = world_size // shard_mesh_dim_size
    mesh_dim_names = ("replicate", "shard")
    ref_mesh = init_device_mesh("cpu", (replicate_mesh_dim_size, shard_mesh_dim_size), mesh_dim_names=mesh_dim_names)

    # Use the global PG as the parent group (in practice, this could be a
    # subgroup of the global PG)
    dp_group = dist.distributed_c10d._get_default_group()
    dp_shard_group = _init_intra_node_process_group(shard_mesh_dim_size)
    # (the helper takes the ranks per node, the shard group's size: upstream passes replicate_mesh_dim_size, the same
    # number on its 2 x 2 mesh, not on 1 x 2)
    dp_replicate_group = _init_inter_node_process_group(dp_group, shard_mesh_dim_size)
    mesh_tensor = torch.tensor(dist.get_process_group_ranks(dp_group), dtype=torch.int).view(
        replicate_mesh_dim_size, shard_mesh_dim_size)

    # Check the `from_group()` API for correctness
    mesh = DeviceMesh.from_group([dp_replicate_group, dp_shard_group], "cpu", mesh_dim_names=mesh_dim_names,
                                 mesh=mesh_tensor)
    assert torch.equal(mesh.mesh, ref_mesh.mesh)
    assert mesh._coordinate_on_dim == ref_mesh._coordinate_on_dim
    for mesh_dim_name in mesh_dim_names:
        child_mesh = mesh[mesh_dim_name]
        ref_child_mesh = ref_mesh[mesh_dim_name]
        assert child_mesh == ref_child_mesh
        child_ranks = dist.distributed_c10d.get_process_group_ranks(child_mesh.get_group())
        ref_child_ranks = dist.distributed_c10d.get_process_group_ranks(ref_child_mesh.get_group())
        assert child_ranks == ref_child_ranks

    # Check HSDP forward/backward parity
    torch.manual_seed(42)
    mlp_dim = 8
    ref_model = MLP(mlp_dim)
    for param in ref_model.parameters():
        dist.broadcast(param.detach(), src=0)
    model = copy.deepcopy(ref_model)

    # Parallelize the test model with the ref mesh
    for module in (ref_model.in_proj, ref_model.out_proj, ref_model):
        fully_shard(module, mesh=ref_mesh)
    # Parallelize the test model with the new mesh from the PG
    for module in (model.in_proj, model.out_proj, model):
        fully_shard(module, mesh=mesh)

    inp = torch.randn((4, mlp_dim))
    ref_loss = ref_model(inp).sum()
    ref_loss.backward()
    loss = model(inp).sum()
    loss.backward()
    assert_close(loss, ref_loss)
    for param, ref_param in zip(model.parameters(), ref_model.parameters()):
        assert_close(local(param), local(ref_param))
        assert_close(local(param.grad), local(ref_param.grad))


def test_hsdp_broadcast_across_replicas():
    """TestFullyShardHSDPBroadcast: a Transformer (and a buffer) sharded by HSDP, whose states only the first replica
    keeps (the others' filled with 1337), is made equal across replicas by a broadcast of each local tensor over the
    replicate group; an iteration then runs. Adapted: 2 replicas of 1 shard on 2 ranks (upstream: 2 of 2 on 4); local
    tensors read by :func:`local`."""
    from torch.distributed.device_mesh import init_device_mesh

    shard_size, replicate_size = 1, 2
    mesh = init_device_mesh("cpu", (replicate_size, shard_size), mesh_dim_names=("replicate", "shard"))
    model_args = ModelArgs()
    model = Transformer(model_args)
    # Add a buffer to show that this flow works for buffers too
    model.buf = torch.nn.Buffer(torch.randn((model_args.dim,)))
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)

    # Only preserve the model states on the replicate mesh's rank 0
    if mesh.get_local_rank("replicate") > 0:
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            tensor.detach().fill_(1337)

    # Check that replicas are different
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        local_tensor = local(tensor)
        local_tensor_list = [torch.empty_like(local_tensor) for _ in range(mesh["replicate"].size())]
        dist.all_gather(local_tensor_list, local_tensor, group=mesh.get_group("replicate"))
        for other_local_tensor in local_tensor_list[1:]:
            assert other_local_tensor.shape == local_tensor_list[0].shape
            assert_not_close(other_local_tensor, local_tensor_list[0])

    # Broadcast from replicate mesh's rank 0
    replicate_group = mesh.get_group("replicate")
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        # E.g. for mesh [[0, 1, 2, 3], [4, 5, 6, 7]] sharding on dim-1 and
        # replicating on dim-0, broadcast with sources 0, 1, 2, 3
        src_rank = dist.get_process_group_ranks(replicate_group)[0]
        torch.distributed.broadcast(local(tensor), src=src_rank, group=replicate_group)

    # Check that replicas are the same
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        local_tensor = local(tensor)
        local_tensor_list = [torch.empty_like(local_tensor) for _ in range(mesh["replicate"].size())]
        dist.all_gather(local_tensor_list, local_tensor, group=mesh.get_group("replicate"))
        for other_local_tensor in local_tensor_list[1:]:
            assert_close(other_local_tensor, local_tensor_list[0])

    # Check that we can run an iteration without erroring
    inp = torch.randint(0, model_args.vocab_size, (2, 16))
    model(inp).sum().backward()


def test_custom_hsdp_all_reduce_hook():
    """TestHSDPWithCustomHook: HSDP by hand, ``fully_shard`` over a shard group and an all-reduce hook that averages
    the reduced shards over the replicas' group: the hook runs, and the gradients are the replicas' average (replica
    0's weights are zeros, so half of replica 1's). Adapted: shard groups of 1 rank and one replicate group of 2 on 2
    ranks (upstream: shard groups of 2 and replicate groups of 2 on 4), so each rank's gradient is the whole one
    (upstream's expected values, on all the rows); the average is a SUM and a division (Gloo's all-reduce has no
    AVG)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._init_utils import _init_inter_node_process_group, _init_intra_node_process_group

    shard_size = 1
    world_pg = dist.distributed_c10d._get_default_group()
    intra_pg = _init_intra_node_process_group(shard_size)
    inter_pg = _init_inter_node_process_group(world_pg, shard_size)
    mesh = DeviceMesh.from_group(intra_pg, "cpu", dist.get_process_group_ranks(intra_pg), mesh_dim_names=("shard",))
    model = MLP(10, bias=False)
    rank = dist.get_rank()
    rank_group = rank // shard_size

    # init the weights to be constant within each group
    # this is just to simplify the test numeric check when we do bwd
    torch.nn.init.constant_(model.in_proj.weight, 1.0 * rank_group)
    torch.nn.init.constant_(model.out_proj.weight, 2.0 * rank_group)

    model = fully_shard(model, mesh=mesh)

    hook_called: bool = False

    def _custom_hook(output: torch.Tensor) -> None:
        nonlocal hook_called
        dist.all_reduce(output, group=inter_pg)
        output.div_(dist.get_world_size(inter_pg))
        hook_called = True

    model.set_all_reduce_hook(_custom_hook)

    inp = torch.arange(10, dtype=torch.float32, requires_grad=True).view(1, 10)
    out = model(inp)
    out.sum().backward()
    # custom hook was fired
    assert hook_called
    out_proj_local_grad = local(model.out_proj.weight.grad)
    in_proj_local_grad = local(model.in_proj.weight.grad)

    # grad is halved in custom bwd all reduce hook during avg
    # as replica 0 weights are 0
    assert_close(out_proj_local_grad, torch.full((10 // shard_size, 40), 22.5, dtype=torch.float32))
    assert_close(in_proj_local_grad,
                 torch.arange(0, 100, 10, dtype=torch.float32).repeat(40 // shard_size, 1))


def _init_transformers() -> tuple[nn.Module, nn.Module]:
    """TestFullyShardShardPlacementFn's ``_init_models``: a Transformer of 3 layers, rank 0's weights on every rank,
    and a copy as the reference."""
    torch.manual_seed(42)
    model_args = ModelArgs(n_layers=3, dropout_p=0.0)
    model = Transformer(model_args)
    for param in model.parameters():
        dist.broadcast(param.detach(), src=0)
    ref_model = copy.deepcopy(model)
    return model, ref_model


def test_init_1d_transformer_shard_largest_dim():
    """TestFullyShardShardPlacementFn: each parameter of a Transformer cut along its largest dimension (some along
    dim 1): every placement is one ``Shard``, and each parameter gathered whole equals the reference's. Adapted: 2
    ranks (upstream: 8), the dimension read by :func:`shard_dim`, the whole by :func:`full_tensor`."""
    model, ref_model = _init_transformers()

    for layer in model.layers:
        fully_shard(layer, shard_placement_fn=_largest_dim_placement)
    fully_shard(model, shard_placement_fn=_largest_dim_placement)

    any_shard_dim1 = False
    for param in model.parameters():
        if ON_TORCH:
            assert len(param.placements) == 1
            assert isinstance(param.placements[0], Shard)
        any_shard_dim1 |= shard_dim(model, param) == 1
    assert any_shard_dim1

    for param, ref_param in zip(model.parameters(), ref_model.parameters()):
        full_param = full_tensor(param, ref_param.shape, shard_dim(model, param))
        assert_close(full_param, ref_param)


def test_init_1d_transformer_shard_dim_neg1():
    """TestFullyShardShardPlacementFn: ``Shard(-1)`` is taken as the last dimension: each parameter gathered whole
    equals the reference's. Adapted as test_init_1d_transformer_shard_largest_dim."""
    model, ref_model = _init_transformers()

    def shard_placement_fn(param: nn.Parameter) -> Optional[Shard]:
        # Check that FSDP will normalize this dim to non-negative
        return Shard(-1)

    for layer in model.layers:
        fully_shard(layer, shard_placement_fn=shard_placement_fn)
    fully_shard(model, shard_placement_fn=shard_placement_fn)

    for param, ref_param in zip(model.parameters(), ref_model.parameters()):
        full_param = full_tensor(param, ref_param.shape, shard_dim(model, param))
        assert_close(full_param, ref_param)


def test_init_1d_uneven_shard_largest_dim():
    """TestFullyShardShardPlacementFn: a dimension other than 0 that the ranks do not divide (17 columns) is refused
    (``NotImplementedError``). Adapted: 2 ranks (upstream: 8; 17 is odd, uneven either way)."""
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(16, 17), nn.Linear(17, 8))
    with raises(NotImplementedError, "FSDP does not support uneven sharding on dim 1"):
        fully_shard(model, shard_placement_fn=_largest_dim_placement)


def test_invalid_shard_dim():
    """TestFullyShardShardPlacementFn: ``Shard(1)`` for a 1-D bias is refused (``AssertionError``)."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))

    def shard_placement_fn(param: nn.Parameter) -> Optional[Shard]:
        return Shard(1)

    # Shard(1) is invalid for 1D bias parameters
    with raises(AssertionError, "Shard dim 1 is invalid for 1D tensor"):
        fully_shard(model, shard_placement_fn=shard_placement_fn)


def test_old_import_training():
    """TestFullyShardOldImport: two Linears and their parent sharded with a bfloat16 compute dtype are sharded modules
    (:func:`is_sharded_module`), and forward and backward run."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model[0], mp_policy=mp_policy)
    fully_shard(model[1], mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)

    assert is_sharded_module(model[0])
    assert is_sharded_module(model[1])
    assert is_sharded_module(model)

    inp = torch.randn((8, 16))
    model(inp).sum().backward()


def test_mixed_dtypes_no_grad_param():
    """TestFullyShardMixedDtypeParam: a frozen float8 parameter beside a float32 one in one group: the all-gather of
    the forward (a module that returns nothing) runs. Adapted: a CPU mesh of 2 ranks (upstream: 2 GPUs)."""
    from torch.distributed.device_mesh import init_device_mesh

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # no grad params with different dtypes
            self.w_fp8 = torch.nn.Parameter(torch.empty((256, 256), dtype=torch.float8_e4m3fn), requires_grad=False)
            self.w_fp32 = torch.nn.Parameter(torch.empty((256, 256), dtype=torch.float32))

        def forward(self, input):
            return

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Model()
    fully_shard(model, mesh=mesh)
    model(0)


# ---- test_fully_shard_state.py ----------------------------------------------------------------------------------
# Upstream runs these on one thread-rank (FSDPTestMultiThread, world size 1); each is about the module, not the
# collectives, and runs alike on each of the 2 ranks here.

def test_fully_shard_state():
    """TestFullyShardState: ``fully_shard.state(module)`` gives the state of a sharded module, a distinct one for
    each ``fully_shard`` call (three MLPs and the root: four). FSDP2's is its ``FSDPState``, minidp's the module's
    group."""
    num_mlps = 3
    model = nn.Sequential(*[MLP(8) for _ in range(num_mlps)])
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    root_state = fully_shard.state(model)
    assert root_state is not None
    all_states = [root_state] + [fully_shard.state(mlp) for mlp in model]
    # Check that each `fully_shard` call constructs a distinct state object
    assert len(set(all_states)) == num_mlps + 1


def test_fully_shard_reapply():
    """TestFullyShardState: ``fully_shard`` a second time on one module is refused, with the ``AssertionError`` of
    torch's composable ``contract``."""
    model = MLP(8)
    fully_shard(model)
    with raises(AssertionError, "Each distinct composable distributed API can only be applied to a module once."):
        fully_shard(model)


def test_fully_shard_cls():
    """TestFullyShardState: only the module given to ``fully_shard`` has its class swapped (still an instance of its
    own class, now of ``FSDPModule`` too, named with the prefix), and a slice of a sharded ``Sequential`` is a plain
    ``Sequential``."""
    # Check that we only swap class for the module passed to `fully_shard`
    model = MLP(8)
    fully_shard(model)
    assert isinstance(model, MLP)
    assert is_sharded_module(model)
    assert model.__class__.__name__ == "FSDPMLP"
    for module in model.modules():
        if module is model:
            continue
        assert not is_sharded_module(module)

    # Check that slicing into a `Sequential` does not preserve FSDP
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    fully_shard(model)
    assert isinstance(model, nn.Sequential)
    assert is_sharded_module(model)
    assert model.__class__.__name__ == "FSDPSequential"
    sliced_model = model[:2]
    assert isinstance(sliced_model, nn.Sequential)
    assert not is_sharded_module(sliced_model)


def test_fully_shard_unsupported_module_cls():
    """TestFullyShardState: a plain ``ModuleList`` or ``ModuleDict`` (a container without ``forward``) is refused
    (``ValueError``)."""
    regex = r"fully\_shard does not support containers that do not implement forward"
    model = nn.ModuleList([MLP(8) for _ in range(3)])
    with raises(ValueError, regex):
        fully_shard(model)
    model = nn.ModuleDict({"1": MLP(8), "2": MLP(8)})
    with raises(ValueError, regex):
        fully_shard(model)


def test_fully_shard_deepcopy():
    """TestFullyShardState: ``copy.deepcopy`` of a sharded module is refused (``AssertionError``)."""
    model = MLP(8)
    fully_shard(model)
    with raises(AssertionError, "FSDP does not support deepcopy"):
        copy.deepcopy(model)
