"""ZeroRedundancyOptimizer: the optimizer's state split over the ranks (ZeRO stage 1).

Under DDP every rank holds the whole optimizer state (SGD's momentum: one tensor the size of each
parameter; AdamW's two moments: two) and every rank computes the same update. ZeRO-1 computes each
update once, on one rank, in three steps (torch's ``torch/distributed/optim/zero_redundancy_optimizer.py``):

1. **partition** (at construction, :func:`partition`): the parameters are dealt out to the ranks,
   group by group, largest first, each to the rank that holds the fewest elements so far. Each rank
   builds ``optimizer_class`` on its share only, so it allocates the state of about 1/W of the
   model's elements (at most 1/W plus the largest parameter's share).
2. **local step** (:meth:`ZeroRedundancyOptimizer.step`): each rank's optimizer updates its share.
   Its gradients were averaged over the ranks by DDP in the backward, so they are the same
   everywhere: the update is the one every rank would have computed.
3. **broadcast**: each rank sends its updated share to the others, one broadcast per parameter
   (or per bucket), all in flight at once, and every rank again holds the whole, updated model.

The state of a checkpoint lives on W ranks, so saving it is a collective too:
:meth:`~ZeroRedundancyOptimizer.consolidate_state_dict` gathers every rank's local state dict on
one rank, where :meth:`~ZeroRedundancyOptimizer.state_dict` renumbers them into the state dict a
plain optimizer over all the parameters would have written; :meth:`~ZeroRedundancyOptimizer.load_state_dict`,
on every rank, keeps its own share of such a dict.

Uneven inputs: the optimizer is a ``Joinable`` (``torch.distributed.algorithms.Join``). A rank out of data
runs the step's collectives for the ranks still training: its local step on its share, from the gradients it
holds (which it must be given: torch's contract, :class:`~minidp.distributed.join.ZeroJoinHook`), and every
share's broadcast.

Errors: every rank checks that the others were given the same parameters (shapes, dtypes, groups) and the same
optimizer (its class, defaults and group settings: torch's takes different ones, and trains silently with each),
and an error met on one rank only (a bad argument, a failing local step) is raised on every rank
(:func:`minidp.distributed.checks.raise_on_every_rank`) instead of leaving the others waiting in a
broadcast.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable
from torch.optim import Optimizer

from ..comm import storage_bytes
from ..nested import map_tensors, tensors_in
from .checks import (
    TensorSpec, check_same_everywhere, collectives_on, first_difference, first_setting_difference, raise_on_every_rank,
    start_failure_vote,
)
from .join import ZeroJoinHook

Shares = list[list[list[torch.Tensor]]]  # shares[rank][group]: the parameters of that group the rank updates


def partition(groups: Sequence[Sequence[torch.Tensor]], world_size: int) -> Shares:
    """Step 1: deal the parameters out to ``world_size`` ranks, as torch's ZeroRedundancyOptimizer does.

    Group by group, the parameters are sorted by size, largest first (a stable sort: equal sizes keep
    their order), and each goes to the rank with the fewest elements so far (the lowest such rank);
    the totals carry over from group to group. A parameter is never split between ranks. Adding a
    group later deals out its parameters only: the earlier shares are unchanged.
    """
    sizes = [0] * world_size
    shares: Shares = [[[] for _ in groups] for _ in range(world_size)]
    for g, params in enumerate(groups):
        for param in sorted(params, key=lambda t: t.numel(), reverse=True):
            rank = sizes.index(min(sizes))
            shares[rank][g].append(param)
            sizes[rank] += param.numel()
    return shares


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Each rank keeps the optimizer state of its share of the parameters; torch's signature and results.

    Args:
        params: the parameters, or parameter groups (dicts with ``"params"``), as for any optimizer;
            the same on every rank (checked), all of one dense type.
        optimizer_class: the optimizer each rank runs on its share (``torch.optim.AdamW``, ...).
        process_group: the ranks to share among (default: the default group).
        parameters_as_bucket_view: keep each rank's share in one flat tensor per device (the
            parameters' ``.data`` become views of it), so that one broadcast per rank and device sends
            it, instead of one per parameter.
        overlap_with_ddp: not supported (raises); torch's step inside DDP's communication hook.
        **defaults: the optimizer's arguments (``lr=...``), given to ``optimizer_class``.

    ``shares[r][g]`` lists the parameters of group ``g`` that rank ``r`` updates; ``optim`` is this
    rank's optimizer over its share. ``param_groups`` holds every parameter, as a plain optimizer's
    does: schedulers and ``zero_grad()`` work on it, and its settings reach ``optim`` at each step.
    Under ``torch.distributed.algorithms.Join`` (uneven inputs) a rank out of data keeps stepping with the
    others (:meth:`join_hook`).
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[Optimizer],
        process_group: Optional[dist.ProcessGroup] = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        **defaults: Any,
    ) -> None:
        if overlap_with_ddp:
            raise NotImplementedError(
                "overlap_with_ddp=True is not supported by minidp.distributed.ZeroRedundancyOptimizer: leave it False "
                "(the same updates, run after the backward rather than inside DDP's communication hook), or use "
                "torch.distributed.optim.ZeroRedundancyOptimizer"
            )
        if getattr(optimizer_class, "__module__", "").startswith("torch.distributed.optim.functional_"):
            # torch's functional optimizers (_FunctionalSGD, ...) serve overlap_with_ddp only; named by their
            # module, since importing torch's list of them compiles TorchScript
            raise ValueError(f"Passing in a functional optimizer {optimizer_class} when `overlap_with_ddp=False`")
        if not dist.is_initialized():  # a ValueError, as torch's (its _get_default_group's)
            raise ValueError(
                "ZeroRedundancyOptimizer needs a process group: call torch.distributed.init_process_group() first "
                "(torchrun sets the environment it reads), or start the processes with minidp.distributed.launch()"
            )
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        Joinable.__init__(self)  # not in a Join context until Join([..., optimizer]) says so
        self._shadowing = False  # whether step() runs for the ranks still training, on a rank that has joined
        self._constructed = False  # Optimizer.__init__ calls add_param_group: the plain one until then
        self._consolidated: list[dict[str, Any]] = []
        error = None
        try:  # nothing here talks to the other ranks: a rank that fails must still reach the meeting below
            Optimizer.__init__(self, _checked_params(params), defaults)
            self.shares = partition([g["params"] for g in self.param_groups], self.world_size)
            self.optim = optimizer_class(self._local_groups(), **defaults)
            _copy_settings(self.optim.param_groups, self.param_groups)  # the optimizer's own defaults, shown here
        except Exception as exc:
            error = exc
        built = getattr(self, "param_groups", ())  # none where the construction failed on this rank
        with collectives_on(p for group in built for p in group["params"]):
            raise_on_every_rank(error, self.process_group, "ZeroRedundancyOptimizer's construction")
            self._check_same_parameters()
        self._build_buckets()
        self._constructed = True

    # ---- step 2 and step 3 ------------------------------------------------------------------------

    def step(self, closure: Optional[Callable[[], float]] = None, **kwargs: Any) -> Optional[float]:
        """Update this rank's share (step 2), then send every share from its owner to all ranks (step 3)."""
        if not self._shadowing:  # a joined rank's hook steps too (ZeroJoinHook), but must not say that it still trains
            Join.notify_join_context(self)  # under Join, if this optimizer is its first Joinable: this rank still trains
        if self.parameters_as_bucket_view and self._trainable() != self._trainable_mask:
            self._build_buckets()  # a parameter was frozen or unfrozen: it leaves or joins its bucket
        _copy_settings(self.param_groups, self.optim.param_groups)  # a scheduler changed the lr here, say
        loss, error = None, None
        try:
            loss = self.optim.step(**kwargs) if closure is None else self.optim.step(closure=closure, **kwargs)
        except Exception as exc:  # kept until every rank knows: the others would wait for this one's share
            error = exc
        # The vote and any error go from the parameters' GPU (NCCL); the broadcasts between them from each tensor's own.
        with collectives_on(self._params()):
            vote = start_failure_vote(error, self.process_group)  # in flight beside the broadcasts
            _copy_settings(self.optim.param_groups, self.param_groups)
            # every share sent from its owner, in place: each parameter (or each bucket), all broadcasts in
            # flight at once, so that the backend can run them side by side, then waited for
            handles = []
            for owner in range(self.world_size):
                source = dist.get_global_rank(self.process_group, owner)
                tensors = (self._buckets[owner] if self.parameters_as_bucket_view
                           else chain.from_iterable(self.shares[owner]))
                handles += [dist.broadcast(t.detach(), src=source, group=self.process_group, async_op=True)
                            for t in tensors]
            for handle in handles:
                handle.wait()
            raise_on_every_rank(
                error, self.process_group, "ZeroRedundancyOptimizer.step (the local step)", vote=vote,
                advice="every share was still broadcast, so the ranks hold the same parameters, but the failing rank's "
                       "share took this step partly or not at all: load the last checkpoint on every rank to train on",
            )
        return loss

    # ---- uneven inputs: torch.distributed.algorithms.Join ----------------------------------------

    def join_hook(self, **kwargs: Any) -> ZeroJoinHook:
        """The hook ``Join`` runs on a rank that has joined: one :meth:`step` per iteration of the others."""
        return ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        """Where ``Join``'s all-reduces run: the first parameter's device, of whichever group holds it (torch's
        ``_default_device``): a group may be empty, the first one too."""
        return next(self._params()).device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group

    # ---- parameter groups -------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (a collective): its parameters are dealt out after the others'."""
        if not self._constructed:
            super().add_param_group(param_group)
            return
        error = None
        try:
            super().add_param_group(param_group)
        except Exception as exc:
            error = exc
        try:
            raise_on_every_rank(error, self.process_group, "ZeroRedundancyOptimizer.add_param_group")
            self._check_same_parameters()
        except Exception:
            if error is None:
                self.param_groups.pop()  # no rank keeps a group that another rank refused
            raise
        self.shares = partition([g["params"] for g in self.param_groups], self.world_size)
        self.optim.add_param_group(self._local_groups()[-1])
        # the new group's settings the local optimizer's defaults filled in, shown here; the other groups keep theirs,
        # which a scheduler may have changed since the last step (the local optimizer takes them at the next)
        _copy_settings(self.optim.param_groups[-1:], self.param_groups[-1:])
        self._build_buckets()

    def _params(self) -> Iterator[torch.Tensor]:
        """Every parameter, group after group."""
        return chain.from_iterable(g["params"] for g in self.param_groups)

    def _local_groups(self) -> list[dict[str, Any]]:
        """This rank's groups: each of ``param_groups``' settings with this rank's share of its parameters."""
        return [{**group, "params": share} for group, share in zip(self.param_groups, self.shares[self.rank])]

    def _trainable(self) -> list[bool]:
        return [p.requires_grad for p in self._params()]

    def _build_buckets(self) -> None:
        """``parameters_as_bucket_view``: each rank's trainable parameters, per device, copied into one flat
        tensor, and their ``.data`` made views of it. The local step updates the flat tensor through the
        views; the broadcast sends it as it is. A frozen parameter is given storage of its own (and is not
        broadcast), as in torch."""
        self._trainable_mask = self._trainable()
        self._buckets: list[list[torch.Tensor]] = [[] for _ in range(self.world_size)]
        if not self.parameters_as_bucket_view:
            return
        for owner, share in enumerate(self.shares):
            per_device: dict[torch.device, list[torch.Tensor]] = {}
            for param in chain.from_iterable(share):
                if param.requires_grad:
                    per_device.setdefault(param.device, []).append(param)
                else:
                    param.data = param.data.detach().clone()  # out of the bucket it may have been in
            for params in per_device.values():
                bucket = torch.cat([p.detach().reshape(-1) for p in params])
                for param, piece in zip(params, bucket.split([p.numel() for p in params])):
                    param.data = piece.view_as(param)
                self._buckets[owner].append(bucket)

    def _check_same_parameters(self) -> None:
        """Raise the same error on every rank unless all ranks hold parameters of the same groups, shapes,
        strides and dtypes, and run the same optimizer class with the same defaults and group settings (a
        collective): otherwise the broadcasts would not match, or each rank would update its share by another rule
        and the model trained would be one no single configuration gives (torch's ZRO checks none of these)."""
        optim = self.optim
        mine = (
            [len(g["params"]) for g in self.param_groups],
            [TensorSpec("parameter", f"param_groups[{g}]['params'][{i}]", tuple(p.shape), p.stride(), str(p.dtype))
             for g, group in enumerate(self.param_groups) for i, p in enumerate(group["params"])],
            {
                "optimizer_class": f"{type(optim).__module__}.{type(optim).__qualname__}",
                **{f"the optimizer's default {k}": _comparable(v) for k, v in optim.defaults.items()},
                **{f"param_groups[{g}]['{k}']": _comparable(v)
                   for g, group in enumerate(self.param_groups) for k, v in group.items() if k != "params"},
            },
        )

        def difference(everyone: list) -> Optional[str]:
            sizes = [s for s, _, _ in everyone]
            rank = next((r for r in range(len(sizes)) if sizes[r] != sizes[0]), None)
            if rank is not None:
                return f"rank {rank} has parameter groups of sizes {sizes[rank]} and rank 0 {sizes[0]}"
            found = first_difference([specs for _, specs, _ in everyone])
            if found is None and (found := first_setting_difference([s for _, _, s in everyone])) is not None:
                found += " (pass the same optimizer_class and the same optimizer arguments on every rank)"
            return found

        check_same_everywhere(
            mine, self.process_group, difference, "ZeroRedundancyOptimizer needs the same parameters and settings",
            "Build the model, the parameter groups and the optimizer the same way on every rank.",
        )

    # ---- checkpoints ------------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's local state dict on rank ``to`` (a collective; its tensors on the CPU)."""
        if not 0 <= to < self.world_size:
            raise ValueError(f"to={to} is not a rank of this group (0 to {self.world_size - 1})")
        _copy_settings(self.param_groups, self.optim.param_groups)
        local = map_tensors(lambda t: t.cpu(), self.optim.state_dict())
        gathered: Optional[list[Any]] = [None] * self.world_size if self.rank == to else None
        dist.gather_object(local, gathered, dst=dist.get_global_rank(self.process_group, to), group=self.process_group)
        self._consolidated = gathered if gathered is not None else []

    def state_dict(self) -> dict[str, Any]:
        """On the rank that :meth:`consolidate_state_dict` gathered on: the state dict of a plain optimizer
        over all the parameters (its indices count through ``param_groups``), as of that call."""
        if not self._consolidated:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. "
                f"Please call `consolidate_state_dict(to={self.rank})` on "
                "all ranks beforehand if you meant to save the global state."
            )
        state_dict = super().state_dict()  # the settings and the global indices; the wrapper keeps no state
        index_of = {p: i for i, p in enumerate(self._params())}
        for share, local in zip(self.shares, self._consolidated):
            # the local optimizer numbered its share's parameters in order, group after group
            for local_group, params in zip(local["param_groups"], share):
                for local_index, param in zip(local_group["params"], params):
                    if local_index in local["state"]:
                        state_dict["state"][index_of[param]] = local["state"][local_index]
        state_dict["state"] = dict(sorted(state_dict["state"].items()))
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict` on every rank: the settings everywhere, each rank's own share of the state."""
        params = list(self._params())
        # Checked before anything is loaded, so that a malformed dict leaves the settings and the state as they were,
        # with the errors torch's ZeroRedundancyOptimizer raises for it, which reads both before it loads anything.
        if "state" not in state_dict:
            raise KeyError(f"'state': the state dict to load has no 'state' (it has {list(state_dict)}); pass one "
                           f"that ZeroRedundancyOptimizer.state_dict() returned, after consolidate_state_dict()")
        for i in state_dict["state"]:
            if not (isinstance(i, int) and 0 <= i < len(params)):
                raise IndexError(f"the state dict to load has state for parameter {i!r}, but this optimizer has "
                                 f"{len(params)} parameters (0 to {len(params) - 1}); pass the state dict of an "
                                 f"optimizer over the same parameters")
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})  # settings, group sizes
        local_index = {p: i for i, p in enumerate(chain.from_iterable(self.shares[self.rank]))}
        self.optim.load_state_dict({
            "state": {},
            "param_groups": [{**group, "params": [local_index[p] for p in share]}
                             for group, share in zip(state_dict["param_groups"], self.shares[self.rank])],
        })
        # This rank's share of the state as the state dict holds it, moved to each parameter's device (a 0-dim tensor,
        # Adam's step, to the CPU), as torch's ZeroRedundancyOptimizer.load_state_dict loads it: not cast to the
        # parameter's dtype, as Optimizer.load_state_dict would cast it (an Adagrad sum saved in float32 stays so).
        for i, value in state_dict["state"].items():
            if params[i] in local_index:
                device = params[i].device
                self.optim.state[params[i]] = map_tensors(lambda t: t.cpu() if t.dim() == 0 else t.to(device), value)


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """The bytes of the tensors an optimizer keeps as state on this rank, each storage counted once.

    For a ZeroRedundancyOptimizer (minidp's or torch's: both keep their share in ``.optim``), the
    state of its local optimizer: about 1/W of what a plain optimizer over the same parameters holds.
    """
    states = [optimizer.state] + ([optimizer.optim.state] if isinstance(getattr(optimizer, "optim", None), Optimizer) else [])
    return storage_bytes(t for state in states for _, t in tensors_in(list(state.values())))


def _checked_params(params: Iterable[Any]) -> list[Any]:
    """``params`` as a list, with torch's ZeroRedundancyOptimizer's checks and errors
    (``_verify_and_init_params``, ``_verify_same_dense_param_type``)."""
    if isinstance(params, torch.Tensor):
        raise TypeError(f"`params` argument should be an iterable of Tensors, but got {torch.typename(params)}")
    if isinstance(params, (set, frozenset)):
        # torch's ZRO takes one, in the order of the tensors' addresses: another on every rank, so the ranks would
        # partition the parameters differently and broadcast each share into other parameters of the same shape
        raise TypeError(
            "ZeroRedundancyOptimizer: `params` is a set, whose order (the tensors' addresses) differs from rank to "
            "rank: the ranks would split and broadcast the parameters in different orders. Give them as a list, in "
            "the same order on every rank, e.g. list(model.parameters())"
        )
    try:
        items = list(params)
    except TypeError as error:
        raise TypeError(f"`params` argument should be an iterable of Tensors or dicts, but got {torch.typename(params)}") from error
    if not items:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(item, dict) for item in items):
        if any("params" not in group for group in items):
            raise ValueError(
                "Each parameter group passed-in via `params` must have a 'params' key mapping to the parameters in the group"
            )
        tensors = [p for group in items for p in ([group["params"]] if isinstance(group["params"], torch.Tensor) else group["params"])]
    elif all(isinstance(item, torch.Tensor) for item in items):
        tensors = items
    else:
        raise TypeError("`params` argument should be an iterable of Tensors or dicts")
    kinds = list(dict.fromkeys(torch.typename(p) for p in tensors))
    if tensors and tensors[0].is_sparse:
        raise ValueError(f"ZeroRedundancyOptimizer only supports using the same dense type for all parameters but got {kinds[0]}")
    if len(kinds) > 1:
        raise ValueError(
            f"ZeroRedundancyOptimizer only supports using the same dense type for all parameters but got both "
            f"{kinds[0]} and {kinds[1]}"
        )
    return items


def _comparable(value: Any) -> Any:
    """An optimizer setting as a value to send to the other ranks and compare there: a tensor (a tensor ``lr``) as
    its values, a number, string, bool or None as it is, a tuple or list item by item, anything else by its type
    (an object's identity differs between processes)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.detach().cpu().tolist())
    if isinstance(value, float) and value != value:
        return "nan"  # equal to itself, as NaN is not
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_comparable(v) for v in value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _copy_settings(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Copy every group's settings (``lr``, ``momentum``, ...; not ``params``) from ``source`` to ``target``."""
    for source_group, target_group in zip(source, target, strict=True):
        target_group.update({k: v for k, v in source_group.items() if k != "params"})
