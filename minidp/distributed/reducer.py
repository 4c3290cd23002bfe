"""The reducer: gradients into buckets, each bucket all-reduced as soon as it is full, results into ``.grad``.

torch DDP does this in C++ (``torch/csrc/distributed/c10d/reducer.cpp``, class ``Reducer``); here it
is the same sequence in Python, function for function. One synchronised training step:

1. **Before the forward** (:meth:`Reducer.before_forward`): raise if a parameter's dtype changed since
   it was wrapped, or if the last backward left a bucket unreduced; install the rebuilt plan once there
   is one (``rebuild_buckets``).
2. **After the forward** (:meth:`Reducer.prepare_for_backward`): expect one gradient per
   parameter; with ``find_unused_parameters``, walk the autograd graph from the outputs and note
   the parameters it does not reach (``search_unused_parameters``).
3. **In the backward**, once per parameter, when autograd has accumulated its gradient into
   ``.grad`` (a ``register_post_accumulate_grad_hook``, kept after the user's own, :meth:`Reducer.autograd_hook`):
   copy the gradient into its bucket, multiplied by ``1 / world_size`` on the way in (``mark_variable_ready_dense``:
   ``at::mul_out(bucket_view, grad, 1. / div_factor)``, so that the all-reduce's *sum* is the mean).
   When a bucket's last gradient is in, launch the all-reduces of every full bucket from the next one
   due, in bucket order (``mark_bucket_ready``): all ranks issue the same collectives in the same
   order while the backward goes on computing the earlier layers' gradients.
4. **At the end of the backward** (a callback queued on the autograd engine when the gradient reaches an
   output, :meth:`_finish_backward`):
   wait for every bucket and copy the mean back into ``.grad``, or leave ``.grad`` a view of its
   bucket with ``gradient_as_bucket_view`` (``finalize_backward``, ``finalize_bucket_dense``). After
   the first such backward, make the rebuilt plan from the order the gradients arrived in, rank 0's
   order for everyone (:mod:`minidp.distributed.buckets`, rule 4).

With a communication hook (``register_comm_hook``) the gradients go into the bucket as they are and
the hook does the averaging and the communication (see "DDP Communication Hook" in reducer.cpp).

Variations, each where its step is: a sparse gradient is a bucket of its own (step 3,
``mark_variable_ready_sparse``); a complex parameter's bucket stays complex and is communicated viewed as
real (step 3, :func:`~minidp.distributed.buckets.as_real`); a static graph (:meth:`Reducer.set_static_graph`) counts hooks in its
first backward and reduces everything at its end; under ``Join`` the divisor may be the number of ranks
still training (:meth:`Reducer.set_forward_pass_work`) and a joined rank shadows the all-reduces
(:meth:`Reducer.shadow_backward`); ``backward(create_graph=True)`` reduces the values and leaves
``.grad``'s graph ending in the copy of the mean.

Every step is timed (:meth:`Reducer.timeline`): when the backward reached the outputs, when each
bucket filled, when its all-reduce was launched and done, when the last gradient arrived, and the
write-back at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
import warnings
import weakref
from operator import attrgetter
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from ..hooks import current_listener, observe_storage
from ..nested import tensors_in
from .buckets import Bucket, BucketCaps, GradBucket, as_real, initial_plan, rebuilt_plan, views_of
from .comm_hooks import ONLY_ONCE, ONLY_ONCE_BUILTIN, CommHook, future_result
from .groups import rank_in, size_of


# reducer.cpp warns once when a gradient arriving in a bucket requires grad; the same words.
CREATE_GRAPH_WARNING = (
    "Using DistributedDataParallel with create_graph=True  is not well-supported. The higher-order gradient will "
    " not be synchronized across ranks, and backpropagation  through all_reduce operations will not occur. If you "
    "require  DDP to work with higher-order gradients for your use case,  please ping "
    "https://github.com/pytorch/pytorch/issues/63929"
)

# reducer.cpp's error when a parameter a static graph's first backward did not use gets a gradient later.
STATIC_GRAPH_USED_LATER = (
    "Your training graph has changed in this iteration, e.g., one parameter is unused in first iteration, but then "
    "got used in the second iteration. this is not compatible with static_graph set to True."
)

# reducer.cpp's error when compiled autograd meets its hooks (the compiled_args of its post-hook refuses to be traced
# unless the Python reducer is on), the same words and type.
COMPILED_AUTOGRAD_REFUSED = (
    'Compiled autograd is not compatible with C++ DDP Reducer, please use torch._dynamo.config.optimize_ddp="python_reducer".'
)

# Timestamps: time.perf_counter() (monotonic, fine-grained), reported as seconds since the Unix
# epoch through one anchor per process, so that the timelines of ranks on one machine line up.
_ANCHOR_WALL, _ANCHOR_PERF = time.time(), time.perf_counter()


def to_epoch_seconds(perf_counter_time: float) -> float:
    return _ANCHOR_WALL + (perf_counter_time - _ANCHOR_PERF)


def sink_leaves(output: Any) -> tuple[list[Any], Any, list[int]]:
    """``output``'s leaves and spec in torch's pytree, and the positions of the tensors autograd recorded among them:
    what torch's ``_DDPSink`` passes. The sink (``ddp._through_sink``) and a static graph's count of the parameters
    its first backward reaches both take them from here."""
    leaves, spec = tree_flatten(output)
    recorded = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None]
    return leaves, spec, recorded


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# What a collective's error says when another rank left it: Gloo's "Timed out waiting 6000ms for recv" and "Connection
# closed by peer" (or reset), NCCL's watchdog timeout and aborted communicator. Only these mean a rank stopped taking
# part; any other error of a bucket's future (a comm hook's callback raised) is its own.
PEER_LEFT = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "abort")


def _peer_left(error: RuntimeError) -> bool:
    text = str(error).lower()
    return any(words in text for words in PEER_LEFT)



# torch's reducer (reducer.cpp, search_unused_parameters), once per process (TORCH_WARN_ONCE), as here: the search
# for unused parameters that found none, which costs a walk of the graph at every forward. Logged (to stderr, where
# no handler is configured), not warned: torch's C++ prints it, and a program that turns warnings into errors
# (`-W error`, pytest's filterwarnings = error) trains on there
LOG = logging.getLogger(__name__)
FOUND_NO_UNUSED_PARAMETERS = (
    "find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters in the "
    "forward pass. This flag results in an extra traversal of the autograd graph every iteration,  which can "
    "adversely affect performance. If your model indeed never has any unused parameters in the forward pass, "
    "consider turning this flag off. Note that this warning may be a false positive if your model has flow control "
    "causing later iterations to have unused parameters."
)
told_none_unused = threading.Event()  # set once FOUND_NO_UNUSED_PARAMETERS has been logged in this process

class Reducer:
    """Averages the gradients of ``params`` over the ranks of ``group`` during the backward.

    Args:
        params: the parameters that require grad, deduplicated, in registration order; their
            positions are the indices of the bucket plan.
        names: one name per parameter, for error messages.
        group: the process group to all-reduce over.
        caps: the bucket byte limits.
        find_unused_parameters, gradient_as_bucket_view: as in ``DistributedDataParallel``.
        bucket_dtype: the buckets' dtype, where it is not the parameters' (DDP's mixed precision: ``param_dtype``).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        group: dist.ProcessGroup,
        caps: BucketCaps,
        find_unused_parameters: bool,
        gradient_as_bucket_view: bool,
        static_graph: bool = False,
        sparse: Optional[Sequence[bool]] = None,
        batched_grad_copy: bool = False,
        skip_all_reduce_unused_params: bool = False,
        bucket_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.sparse = [False] * len(self.params) if sparse is None else list(sparse)  # gradients that are sparse
        self.group = group
        self.world_size = size_of(group)
        self.rank = rank_in(group)
        self.caps = caps
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.batched_grad_copy = batched_grad_copy  # copy a bucket's gradients when it is full, not one by one
        # launch no all-reduce for a bucket whose every parameter this rank found unused (the user promises every
        # rank finds the same: torch DDP's skip_all_reduce_unused_params)
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.bucket_dtype = bucket_dtype  # the buckets' dtype where the gradients' is not the parameters' (mixed precision)
        self._dtypes = [p.dtype for p in self.params]  # as wrapped: what the buckets were allocated for
        self.comm_hook: Optional[CommHook] = None
        self.comm_state: Any = None
        self._optimizer_in_backward = False  # the hook has stepped the optimizers: no write-back into .grad
        self._lock = threading.Lock()
        self._warned_create_graph = False

        # what gradients are divided by: the world size, or under Join with divide_by_initial_world_size=False
        # the number of ranks still training, the sum of an all-reduce launched before the forward
        self._divisor = self.world_size

        self._install_plan(initial_plan(self.params, caps, find_unused_parameters and not static_graph, self.sparse))
        # DDP rebuilds once, and never when it looks for unused parameters, unless the graph is static
        # (should_rebuild_buckets).
        self._will_rebuild = not find_unused_parameters
        self._rebuilt: Optional[list[list[int]]] = None
        self.iteration = 0  # synchronised forwards so far (num_iterations_)
        self.has_rebuilt_buckets = False
        # this synchronised iteration's time.perf_counter() stamps, and the last finished one's (runtime statistics)
        self._stamps: dict[str, float] = {}
        self.last_stamps: dict[str, float] = {}
        self._grad_ready_order: list[int] = []  # this backward's arrivals: the order a rebuild follows
        self._last_backward: Optional[tuple[int, list[int], list[int]]] = None  # buckets, unused, arrival order

        # static_graph (set_static_graph): the first backward counts each parameter's hooks and reduces
        # everything at its end; later ones reduce a parameter at its last hook of the count.
        self.static_graph = False
        self._static_counts: Optional[list[int]] = None  # hooks per parameter in the first backward
        self._reached: set[int] = set()  # parameters the first backward's outputs reach (counted once at least)
        self._remaining: list[int] = []  # this backward's hooks still to come, per parameter
        self._static_unused: Optional[set[int]] = None  # used by no rank in the first backward
        self._counted_elsewhere = False  # joined before the first backward: the other ranks counted it, not this one

        self._expect_hooks = False  # True from the end of a synchronised forward to the end of its backward
        self._require_finalize = False  # a gradient was marked ready and the backward has not finished
        self._arrived = False
        self._marked_unused = False  # this backward has marked its unused parameters ready
        self._finish_queued = False
        self._ready = [False] * len(self.params)
        self._next_bucket = 0
        self._unused: list[int] = []
        self._unused_set: set[int] = set()
        # Which parameters this rank used since the last reduction (no_sync steps count), summed over
        # the ranks after the last bucket: 0 means no rank used it, so its .grad is left alone. Kept on
        # the CPU (set once per gradient), all-reduced from a copy on the parameters' device.
        self._local_used = torch.zeros(len(self.params), dtype=torch.int32)
        self._used_future: Optional[torch.futures.Future] = None
        self._used_on_device = torch.zeros_like(self._local_used)  # the last sum, as all-reduced (local_used_map_dev_)
        self._used_reduced = False
        self._accumulators: dict[Any, int] = {}  # found where parameters' use is searched for (find_accumulators)
        if find_unused_parameters:
            self.find_accumulators()
        if static_graph:
            self.set_static_graph()

        self.log_error: Callable[[Exception], None] = lambda error: None  # the wrapper's logging data records them
        self.log_graph_not_static: Callable[[int], None] = lambda iteration: None  # and the graph seen not static
        self._graph_static = True  # the same unused parameters found at every search so far
        self._last_search: Optional[list[int]] = None
        self._post_backward_futures: list[torch.futures.Future] = []  # a buffer hook's, waited for at the end
        self._events: list[dict] = []  # this backward's, filled as it runs
        self._reduce_events: dict[int, dict] = {}  # bucket index -> its all-reduce event
        self._last_events: list[dict] = []  # the last finished backward's
        self._backward_start: Optional[float] = None
        self._last_gradient = 0.0
        self._handles = [p.register_post_accumulate_grad_hook(_hook(self, i)) for i, p in enumerate(self.params)]
        self._hook_dicts = [p._post_accumulate_grad_hooks for p in self.params]  # each parameter's, ours among them
        self._tensor_addresses = list(map(_tensor_address, self.params))  # the C++ tensors those hooks are on
        weakref.finalize(self, _remove, self._handles)

    def find_accumulators(self) -> None:
        """The gradient accumulator of each parameter: the graph node whose presence in a forward's graph says the
        parameter is used (``find_unused_parameters``). Found again whenever a parameter's data changes dtype
        (DDP's mixed precision), since autograd then gives the parameter a new accumulator. The wrapper that swaps the
        data says so: no check here could see it, since the swap and its undoing each backward keep the dtypes seen
        between forwards the same (a dtype check was tried: the stale accumulators made every parameter unused).

        A parameter frozen since it was wrapped (``requires_grad_(False)``) has no accumulator to find (its view has no
        ``grad_fn``): no graph reaches it, so it is unused, as torch's reducer finds the accumulator it took at
        construction unreached (:meth:`_unreached`)."""
        self._accumulators = {_accumulator_of(p): i for i, p in enumerate(self.params) if p.requires_grad}

    # ---- the plan ---------------------------------------------------------------------------

    def _install_plan(self, plan: list[list[int]]) -> None:
        """Allocate one flat buffer per bucket (``initialize_buckets``). With ``gradient_as_bucket_view``
        a gradient already there is copied into its new view and ``.grad`` becomes that view."""
        self.buckets = [Bucket.allocate(b, indices, self.params, self.sparse[indices[0]], self.bucket_dtype)
                        for b, indices in enumerate(plan)]
        self._locator = [(0, 0)] * len(self.params)
        for bucket in self.buckets:
            for position, index in enumerate(bucket.indices):
                self._locator[index] = (bucket.index, position)
                if self.gradient_as_bucket_view and not bucket.sparse:
                    param, view = bucket.params[position], bucket.views[position]
                    if param.grad is not None and not _shares_storage(param.grad, view):
                        view.copy_(param.grad)
                        param.grad = view

    def plan(self) -> list[list[int]]:
        """The buckets the next backward will use, in the order they are reduced."""
        return [list(b) for b in self._rebuilt] if self._rebuilt is not None else [b.indices for b in self.buckets]

    def _sync_plan(self, plan: list[list[int]]) -> list[list[int]]:
        """Rank 0's plan, on every rank (``sync_bucket_indices``): the ranks must agree on the buckets."""
        shared = [plan]
        dist.broadcast_object_list(shared, group=self.group, group_src=0)
        return shared[0]

    # ---- static graph -------------------------------------------------------------------------

    def set_static_graph(self) -> None:
        """The graph is the same at every iteration (``Reducer::set_static_graph``): what the first backward
        learns (how many hooks each parameter fires, which parameters no rank uses) holds for every later
        one. So unused parameters need no search, and a parameter whose hook fires several times per
        backward (a layer used twice under re-entrant checkpointing) is reduced after its last one."""
        if self.iteration != 0:
            raise RuntimeError(
                "set_static_graph() should be called before training loop starts and after "
                "DistributedDataParallel is constructed."
            )
        self.static_graph = True
        self._will_rebuild = True

    def _counting(self) -> bool:
        """The first backward of a static graph: hooks are counted, and everything is reduced at its end."""
        return self.static_graph and self._static_counts is None and not self._counted_elsewhere

    def _tracks_use(self) -> bool:
        """Whether this backward all-reduces which parameters each rank used (``local_used_map``)."""
        return (self.find_unused_parameters and not self.static_graph) or self._counting()

    # ---- steps 1 and 2: around the forward -------------------------------------------------

    def prepare_for_forward(self) -> None:
        """Called before every synchronised forward (``Reducer::prepare_for_forward``): count it, time it."""
        self.iteration += 1
        self._stamps = {"forward_compute_start": time.perf_counter()}

    def before_forward(self) -> None:
        """Called before every forward that records gradients."""
        if self._counted_elsewhere:
            # A later backward reduces each parameter at the last of the hooks the first one counted on this rank;
            # this rank counted none (it only shadowed that backward under Join), so it cannot take part. torch's
            # reducer fails earlier: its joined rank does not shadow the first backward's used-parameter map, and
            # the collectives stop matching (on Gloo the process aborts).
            raise self._logged(RuntimeError(
                f"DistributedDataParallel with static_graph=True on rank {self.rank}: this rank joined (ran out of "
                f"data under Join) before the first backward, which the other ranks used to learn the static graph, "
                f"so it cannot train with this wrapper. Give every rank at least one batch in the first iteration, "
                f"or wrap the model anew"
            ))
        self._check_dtypes()
        self._check_not_swapped()
        self._check_reducer_finalized()
        self._name_parameters_and_gradients()
        self._install_rebuilt_plan()

    def _name_parameters_and_gradients(self) -> None:
        """Tell a listener that counts memory (the ledger) that these are the model's parameters and their ``.grad`` its
        gradients, before a forward (those of the last step, which a ``zero_grad`` may free during this one) and after
        a backward (this one's): held before the step, they would count as its inputs, and made by its backward as its
        temporaries. Nothing listening: one read of the slot."""
        if current_listener() is not None:
            observe_storage("parameters", self.params)
            observe_storage("gradients", [p.grad for p in self.params if p.grad is not None])

    def _check_dtypes(self) -> None:
        """Raise if a parameter's dtype changed since it was wrapped (``ddp.double()``, ``ddp.to(torch.bfloat16)``):
        its bucket keeps the old dtype, so its gradients would be rounded through it (torch's reducer stops reducing
        them, silently: the new data gives the parameter a new gradient accumulator). One list of dtypes compared per
        forward, about 7 microseconds for a ResNet-50's 161 parameters (``python -m timeit -s "from minidp.zoo import
        resnet50; ps = list(resnet50(base=8).parameters())" "[p.dtype for p in ps]"``: 6.5 us, and the comparison).
        In mixed precision a parameter may also hold its bucket's dtype, left there by a backward under ``no_sync``."""
        dtypes = [p.dtype for p in self.params]
        if dtypes == self._dtypes:
            return
        for index, (now, wrapped) in enumerate(zip(dtypes, self._dtypes)):
            if now != wrapped and now != self.bucket_dtype:
                bucket = self.buckets[self._locator[index][0]]
                raise self._logged(RuntimeError(
                    f"DistributedDataParallel: parameter {index} ('{self.names[index]}') is {now} now, but was "
                    f"{wrapped} when it was wrapped, and its gradient bucket holds {bucket.buffer.dtype}. Convert "
                    f"the module before wrapping it in DistributedDataParallel (model.to({now}), then "
                    f"DistributedDataParallel(model)), not the wrapper after"
                ))

    def _check_not_swapped(self) -> None:
        """Raise if a parameter was swapped for another tensor since it was wrapped (``torch.utils.swap_tensors``:
        ``load_state_dict`` or ``.to()`` on the wrapper with ``torch.__future__.set_swap_module_params_on_conversion
        (True)``, as for parameters of a tensor subclass): the parameter object then holds another C++ tensor, and the
        hook that reduces its gradient went with the old one to the tensor it swapped with; every rank would step on
        its own gradients. torch's reducer holds references that make the swap itself fail. One list of addresses
        compared per forward, as the dtypes are: about 22 microseconds for a ResNet-50's 161 parameters (``python -m
        timeit -s "from operator import attrgetter; from minidp.zoo import resnet50; ps = list(resnet50(base=8)
        .parameters()); g = attrgetter('_cdata'); a = list(map(g, ps))" "list(map(g, ps)) == a"``: 21.8 us)."""
        if list(map(_tensor_address, self.params)) == self._tensor_addresses:
            return
        index = next(i for i, (p, address) in enumerate(zip(self.params, self._tensor_addresses))
                     if _tensor_address(p) != address)
        raise self._logged(RuntimeError(
            f"DistributedDataParallel: parameter {index} ('{self.names[index]}') was swapped for another tensor since "
            f"it was wrapped (torch.utils.swap_tensors: load_state_dict or .to() with "
            f"torch.__future__.set_swap_module_params_on_conversion(True)), which took the hook that reduces its "
            f"gradient with it. Load or convert the module before wrapping it in DistributedDataParallel, or wrap it "
            f"anew after"
        ))

    def rebuild_buckets(self) -> bool:
        """Install the rebuilt plan if one is waiting (``Reducer::rebuild_buckets``); whether it did. Raises first, as
        torch's does, if the last backward left gradients unreduced: Lightning's manual optimization calls it before
        each ``manual_backward``, and a backward of half the model would otherwise be dropped by the
        ``prepare_for_backward`` that follows, each rank stepping on its own gradients."""
        self._check_reducer_finalized()
        return self._install_rebuilt_plan()

    _rebuild_buckets = rebuild_buckets  # the name torch's Reducer has (Lightning calls it)

    def _install_rebuilt_plan(self) -> bool:
        """Install the rebuilt plan if one is waiting; whether it did."""
        if self._rebuilt is None:
            return False
        with torch.no_grad():
            self._install_plan(self._rebuilt)
        self._rebuilt = None
        self.has_rebuilt_buckets = True
        return True

    def set_forward_pass_work(self, work: Optional[dist.Work], divide_by_initial_world_size: bool) -> None:
        """Before each forward (``_set_forward_pass_work_handle``): under ``Join``, ``work`` is the all-reduce
        counting the ranks still training; with ``divide_by_initial_world_size=False`` this backward's
        gradients are divided by that count, read here (torch's reducer reads it at the first gradient)."""
        self._divisor = self.world_size
        if work is not None and not divide_by_initial_world_size:
            # Join's count is held by its all-reduce alone (Join.notify_join_context): read through the work's
            # future, whose value is the all-reduced tensors (Work.result(), which torch's C++ reducer reads, warns
            # from Python that it is deprecated)
            self._divisor = int(work.get_future().wait()[0].item())

    def prepare_for_backward(self, output: Any) -> None:
        """Called after a synchronised forward: the next backward reduces. ``output``: the forward's output,
        whose tensors are searched for unused parameters (torch's Reducer takes their list; accelerate and
        Lightning call it again from outside, with ``[]`` or the loss)."""
        self._stamps["backward_compute_start"] = time.perf_counter()
        self._hooks_last()
        self._grad_ready_order = []
        self._marked_unused = False
        self._expect_hooks = True
        self._arrived = False  # a gradient of this forward's backward has arrived (counted or not)
        self._ready = [False] * len(self.params)
        self._next_bucket = 0
        for bucket in self.buckets:
            bucket.pending = len(bucket.indices)
        self._events = []
        self._reduce_events = {}
        self._backward_start = None
        # the tensors in lists, tuples, dict values and dataclass fields: what DDP's _find_tensors finds
        outputs = [t for _, t in tensors_in(output) if t.requires_grad]
        for t in outputs:
            t.register_hook(self._note_backward_start)
        if self._counting():
            self._remaining = [0] * len(self.params)  # counted up in this backward
            # torch passes this forward's outputs through its _DDPSink, whose backward gives an output that the loss
            # did not use an undefined gradient: the hooks of the parameters it reaches run all the same, and count
            # them (reducer.cpp), so a later backward that uses that output is no change of the graph
            self.find_accumulators()  # now: the first backward of a static graph, whatever the parameters' dtype
            # the sink's outputs only (torch's pytree leaves a dataclass or a dict subclass of the user's as it is):
            # a parameter behind an unused tensor the sink does not pass runs no hook, and is a static unused one
            leaves, _, recorded = sink_leaves(output)
            self._reached = set(range(len(self.params))).difference(self._unreached([leaves[i] for i in recorded]))
        elif self.static_graph:
            self._remaining = list(self._static_counts)
            self._unused = [i for i, count in enumerate(self._static_counts) if count == 0]
            self._unused_set = set(self._unused)
        elif self.find_unused_parameters:
            with torch.autograd.profiler.record_function("torch.distributed.ddp.reducer::search_unused_parameters"):
                self._unused = self._unreached(outputs)
            if not self._unused and not told_none_unused.is_set():
                told_none_unused.set()
                LOG.warning(FOUND_NO_UNUSED_PARAMETERS)
            if self._graph_static and self._last_search is not None and self._unused != self._last_search:
                self._graph_static = False
                self.log_graph_not_static(self.iteration)
            self._last_search = self._unused
            self._unused_set = set(self._unused)

    def _hooks_last(self) -> None:
        """Each parameter's hook of this reducer after the other post-accumulate-grad hooks of that parameter.

        torch's reducer hook is a post-hook of the parameter's gradient accumulator, which autograd runs after every
        post-accumulate-grad hook of the tensor, whenever that was registered: a user's hook registered after the
        wrapper (a gradient scaled or clipped in place) changes what is averaged. Autograd runs the tensor's hooks in
        the order of their dict, so ours is moved to its end by taking it out and putting it back (``move_to_end``
        would reorder an OrderedDict's own list only, not the dict that autograd walks).
        """
        if max(map(len, self._hook_dicts), default=0) < 2:  # the usual case: ours are the only ones
            return
        for hooks, handle in zip(self._hook_dicts, self._handles):
            if len(hooks) > 1 and handle.id in hooks and next(reversed(hooks)) != handle.id:
                hooks[handle.id] = hooks.pop(handle.id)

    def _note_backward_start(self, grad: torch.Tensor) -> None:
        """The gradient reached an output: the backward of this forward started, in the outermost
        backward pass. The end-of-backward callback is queued here (as torch DDP's ``_DDPSink`` queues
        its own), so that it runs when that pass ends, not at the end of a re-entrant inner backward
        (``checkpoint(use_reentrant=True)``) in which some parameter's hook happens to fire first."""
        if self._backward_start is None:
            self._backward_start = time.perf_counter()
            self._hooks_last()  # after a hook the user registered since the forward, too: torch's runs after them all
        if self._expect_hooks:
            self._queue_finish()

    def _queue_finish(self) -> None:
        if not self._finish_queued:
            # Once a backward, before anything is reduced (from the output's hook, before autograd accumulates any
            # gradient; else from the first parameter's): the callback queued here is what compiled autograd never runs.
            refuse_compiled_autograd()
            self._finish_queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)

    def _unreached(self, outputs: list[torch.Tensor]) -> list[int]:
        """Indices of the parameters whose gradient accumulator the graph of ``outputs`` does not
        reach, or that have none (frozen): they will get no gradient in this backward (``search_unused_parameters``)."""
        seen = set()
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            for node, _ in stack.pop().next_functions:
                if node is not None and node not in seen:
                    seen.add(node)
                    stack.append(node)
        reached = {i for node, i in self._accumulators.items() if node in seen}
        return [i for i in range(len(self.params)) if i not in reached]

    # ---- step 3: in the backward ------------------------------------------------------------

    def autograd_hook(self, index: int) -> None:
        """Parameter ``index``'s gradient is in its ``.grad`` (``Reducer::autograd_hook``)."""
        with self._lock:
            self._last_gradient = time.perf_counter()
            if (self.find_unused_parameters or self.static_graph) and self._tracks_use():
                # also under no_sync: used once since the last reduction is used. An undefined gradient
                # (the hook runs, .grad stays None) is no use, as reducer.cpp checks grad.defined()
                if self.params[index].grad is not None:
                    self._local_used[index] = 1
            if not self._expect_hooks:  # no_sync, or a backward without a synchronised forward
                return
            self._arrived = True
            if not self._finish_queued:  # queued already, unless the backward did not start at an output
                self._queue_finish()
            if self.static_graph and self._counting():
                self._remaining[index] += 1  # the first backward only counts
                return
            if not self._marked_unused:  # at the first hook that does not only count, as reducer.cpp marks them
                self._marked_unused = True
                for unused in self._unused:  # nothing will arrive for these: their buckets need not wait
                    self._mark_ready(unused)
            if self.static_graph:
                if self._static_counts[index] == 0:
                    raise self._logged(RuntimeError(STATIC_GRAPH_USED_LATER))
                self._remaining[index] -= 1
                if self._remaining[index] > 0:
                    return  # more hooks of this parameter to come in this backward
            self._grad_ready_order.append(index)
            self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        if self._ready[index]:
            if self._accumulator_changed(index):
                raise RuntimeError(
                    f"parameter {index} ('{self.names[index]}') has another gradient accumulator than when it was "
                    f"wrapped, on rank {self.rank} (set_() on it, or torch.nn.utils.parametrize.register_parametrization, "
                    f"which calls it): the search for unused parameters no longer sees it used, and its gradient came "
                    f"after it was counted unused. Change the parameters before wrapping the module in "
                    f"DistributedDataParallel, or wrap it anew after"
                )
            if index in self._unused_set:
                raise RuntimeError(
                    f"parameter {index} ('{self.names[index]}') was counted unused, then got its gradient, in one "
                    f"backward on rank {self.rank}: with find_unused_parameters=True, DistributedDataParallel searches "
                    f"the graph from the forward's outputs for the parameters the backward will reach, and this one's "
                    f"gradient came through a tensor the outputs do not lead to (a loss kept on the module instead of "
                    f"returned, an output inside a container the search does not open, a reentrant checkpoint, whose "
                    f"recomputation it cannot see into). Return that tensor from forward, checkpoint with "
                    f"use_reentrant=False, or pass static_graph=True (torch's reducer says 'Expected to mark a "
                    f"variable ready only once' here)"
                )
            raise RuntimeError(
                f"parameter {index} ('{self.names[index]}') got its gradient twice in one backward on rank "
                f"{self.rank}: DistributedDataParallel reduces each gradient once per backward. This happens when "
                f"the parameter is used outside forward, or in several reentrant backward passes (checkpointing "
                f"the same layers twice). Use the parameter inside forward only, once per backward."
            )
        self._ready[index] = True
        self._require_finalize = True
        bucket_index, position = self._locator[index]
        bucket = self.buckets[bucket_index]
        batched = self.batched_grad_copy and not bucket.sparse
        if not batched:
            self._copy_into_bucket(bucket, position)
        bucket.pending -= 1
        if bucket.pending == 0:
            if batched:
                self._copy_bucket(bucket)
            now = time.perf_counter()
            self._events.append({"stage": "bucket ready", "bucket": bucket.index, "start": now, "end": now})
            self._launch_ready_buckets()

    def _accumulator_changed(self, index: int) -> bool:
        """Whether parameter ``index`` has another gradient accumulator than the one the search for unused parameters
        looks for (an error's diagnosis: finding it costs a view of the parameter)."""
        param = self.params[index]
        return bool(self._accumulators) and param.requires_grad and _accumulator_of(param) not in self._accumulators

    def _copy_into_bucket(self, bucket: Bucket, position: int) -> None:
        """``mark_variable_ready_dense``: the gradient into its view, divided by the world size unless a
        hook will do it; no gradient: zeros."""
        if bucket.sparse:
            self._take_sparse_gradient(bucket)
            return
        param, view = bucket.params[position], bucket.views[position]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif self.gradient_as_bucket_view and _shares_storage(grad, view):
            # autograd accumulated straight into the view: only the division is left
            if self.comm_hook is None:
                view.div_(self._divisor)
        else:
            if grad.requires_grad:  # backward(create_graph=True): the values go into the bucket, not the graph
                self._warn_create_graph()
                grad = grad.detach()
            if self.comm_hook is None:
                # times 1/world_size, as reducer.cpp (a double scalar): a division would round
                # differently wherever 1/world_size is inexact (3 ranks)
                torch.mul(grad, 1.0 / self._divisor, out=view)
            else:
                view.copy_(grad)
            if self.gradient_as_bucket_view:
                param.grad = view

    def _copy_bucket(self, bucket: Bucket) -> None:
        """``batched_grad_copy``: a full bucket's gradients into it at once (one ``_foreach_copy_``; no gradient:
        zeros), then the whole bucket divided by the world size (one ``div_``) unless a hook will do it, as
        torch's batched path does. A division, not the multiply of the gradient-by-gradient path: where
        1/world_size is inexact (3 ranks) the two give different bits, each torch's own."""
        views, grads, copied = [], [], []
        for param, view in zip(bucket.params, bucket.views):
            grad = param.grad
            if grad is None:
                view.zero_()
            elif not (self.gradient_as_bucket_view and _shares_storage(grad, view)):
                if grad.requires_grad:  # backward(create_graph=True): the values go into the bucket, not the graph
                    self._warn_create_graph()
                    grad = grad.detach()
                views.append(view)
                grads.append(grad)
                copied.append(param)
        if views:
            torch._foreach_copy_(views, grads)
        if self.comm_hook is None:
            bucket.buffer.div_(self._divisor)
        if self.gradient_as_bucket_view:
            for param, view in zip(copied, views):
                param.grad = view

    def _take_sparse_gradient(self, bucket: Bucket) -> None:
        """``mark_variable_ready_sparse``: the sparse gradient itself is the bucket, divided in place by the
        world size (unless a hook will), all-reduced alone (indices and values), copied back in place."""
        grad = bucket.params[0].grad
        if grad is None:
            raise RuntimeError(
                f"Expected sparse gradient to be defined: parameter {bucket.indices[0]} ('{self.names[bucket.indices[0]]}') "
                f"got none in this backward on rank {self.rank}; a sparse embedding must be used in every synchronised "
                f"forward"
            )
        if not grad.is_sparse:
            raise RuntimeError(f"Expected variable to have sparse gradient: '{self.names[bucket.indices[0]]}'")
        if self.comm_hook is None:
            grad.div_(self._divisor)
        bucket.buffer = grad

    def _launch_ready_buckets(self) -> None:
        """All-reduce every full bucket from the next one due, in order, stopping at the first that is not full."""
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            bucket = self.buckets[self._next_bucket]
            self._next_bucket += 1
            if self.skip_all_reduce_unused_params and not bucket.sparse and self._unused_set.issuperset(bucket.indices):
                bucket.future = None  # no parameter of it got a gradient here, nor, by the user's promise, anywhere
            else:
                self._launch(bucket)
            if self._next_bucket == len(self.buckets) and self._tracks_use():
                self._used_on_device = self._local_used.to(self.params[0].device, copy=True)
                self._used_future = dist.all_reduce(self._used_on_device, group=self.group, async_op=True).get_future()
                self._used_reduced = False

    def _launch(self, bucket: Bucket) -> None:
        """The bucket's all-reduce, or the communication hook's reduction, left running (``bucket.future``)."""
        event = {"stage": "all-reduce", "bucket": bucket.index, "start": time.perf_counter(), "end": None}
        self._stamps.setdefault("backward_comm_start", event["start"])
        # The bucket's buffer holds gradients, whenever it was made (a rebuilt plan's, in the forward) or first met
        # (the memory ledger; nothing listening, one read)
        observe_storage("gradients", [bucket.buffer])
        if self.comm_hook is None:
            bucket.future = dist.all_reduce(as_real(bucket.buffer), group=self.group, async_op=True).get_future()
        else:
            # A static graph's first backward reduces every bucket at its end, in torch's delay_all_reduce, whose loop
            # never moves the reducer's count of buckets launched: a hook is told index 0 for each (is_last only where
            # there is one bucket). PowerSGD counts its iterations by is_last: its compression starts when torch's does.
            told = 0 if self._counting() else None
            bucket.future = self.comm_hook(self.comm_state, GradBucket(bucket, len(self.buckets), told))
            future_result(bucket.future, bucket.index)
        bucket.future.add_done_callback(lambda _, event=event: _stamp_end(event))
        self._events.append(event)
        self._reduce_events[bucket.index] = event

    def shadow_backward(self) -> None:
        """A rank that has joined (:mod:`minidp.distributed.join`) takes part in the backward of the ranks
        still training: every bucket's all-reduce in bucket order, of zeros (through the comm hook if
        there is one), the used-parameter map, and, if their backward rebuilds the buckets, the
        rebuilt plan (``_match_all_reduce_for_bwd_pass``, ``_push_all_rebuilt_params``).

        Which backward the ranks still training run is this rank's to tell from its own state, since every
        synchronised backward is one on every rank, trained or shadowed: a static graph's first (counting) backward
        if this rank has not been through one, else the one that rebuilds while a rebuild is due (the first of a
        dynamic graph; a static graph's second, the first to note an arrival order)."""
        counting = self._counting()
        with torch.no_grad():
            if any(bucket.sparse for bucket in self.buckets):
                raise RuntimeError(
                    "DistributedDataParallel under Join: a joined rank cannot shadow the all-reduce of a sparse "
                    "gradient (its indices are not known); use sparse=False embeddings, or even inputs"
                )
            futures = []
            for bucket in self.buckets:
                zeros = torch.zeros_like(bucket.buffer)
                if self.comm_hook is None:
                    futures.append(dist.all_reduce(zeros, group=self.group, async_op=True).get_future())
                else:
                    shadow = dataclasses.replace(bucket, buffer=zeros, views=views_of(zeros, bucket.params))
                    futures.append(self.comm_hook(self.comm_state, GradBucket(shadow, len(self.buckets))))
            torch.futures.wait_all(futures)
            if self._tracks_use():
                # torch's joined rank offers the sum of its last reduction (``_get_local_used_map``), in place:
                # parameters used then count as used, and the others' gradients for them come out zero
                dist.all_reduce(self._used_on_device, group=self.group)
            if counting:
                # the ranks still training counted their hooks in that backward; this rank counted none, so it can
                # shadow on, but not train this graph itself (before_forward)
                self._counted_elsewhere = True
            elif self._will_rebuild:
                # torch's joined rank pushes every parameter (_push_all_rebuilt_params) and takes part in the
                # broadcast of rank 0's plan when the ranks still training rebuild (rebuild_buckets, sync_bucket_indices)
                self._rebuilt = self._sync_plan(
                    rebuilt_plan(self.params, list(range(len(self.params))), self.caps, self.sparse))
                self._will_rebuild = False

    # ---- step 4: the end of the backward ----------------------------------------------------

    def _finish_backward(self) -> None:
        """Queued on the autograd engine when the backward reaches an output (or at the first hook);
        runs when that backward is done."""
        with self._lock, torch.no_grad():
            self._finish_queued = False
            if not self._expect_hooks or not self._arrived:
                return  # no parameter's gradient in this pass (autograd.grad on the inputs): wait for the next
            # the static graph's first backward (delay_all_reduce): every parameter is reduced now
            counting = self._counting()
            missing = [i for i, ready in enumerate(self._ready) if not ready]
            if missing and not counting and (self.static_graph or not self.find_unused_parameters):
                # Left unreduced, as torch DDP leaves it: torch's reducer finishes when its last bucket is ready, in
                # whichever backward pass that is, so a later pass of the same forward may bring the rest (an
                # actor's loss back-propagated, then a critic's: two heads that share nothing); the hooks stay
                # expected. If none does, the next forward raises (before_forward), in torch's words, naming what got
                # no gradient.
                return
            end = time.perf_counter()
            self._stamps["backward_compute_end"] = end
            # the backward's computation: from the gradient reaching the outputs to the last parameter's
            start = self._backward_start if self._backward_start is not None else self._last_gradient
            self._events.append({"stage": "backward", "bucket": None, "start": start, "end": self._last_gradient})
            for index in missing:
                # Reached from an output that the loss did not use: DDP's hook fires for it with no
                # incoming gradient (its _DDPSink sees to that) and counts it used if .grad is set.
                if self.params[index].grad is not None and not counting:
                    self._local_used[index] = 1
                self._mark_ready(index)
            self._expect_hooks = False
            self._require_finalize = False
            # Every bucket's result checked before any is written back: a hook's bad result for one bucket must not
            # leave the earlier buckets' gradients averaged and the rest local (an optimizer step would apply both)
            results = [(bucket, self._result_of(bucket)) for bucket in self.buckets
                       if bucket.future is not None]  # None: skipped, its gradients left as they are
            for bucket, result in results:
                self._write_back(bucket, result)
            for future in self._post_backward_futures:
                future.wait()
            self._post_backward_futures = []
            self._name_parameters_and_gradients()
            if self._tracks_use():
                self._wait_for_use()
                if counting:  # what every later backward waits for, and leaves alone
                    reached = self._reached
                    self._static_counts = [max(n, 1) if i in reached else n for i, n in enumerate(self._remaining)]
                    self._static_unused = {i for i, used in enumerate(self._local_used.tolist()) if not used}
                self._local_used.zero_()
            if self._will_rebuild and self._grad_ready_order:
                # parameters that got no gradient close the order, in registration order
                arrived = set(self._grad_ready_order)
                order = self._grad_ready_order + [i for i in range(len(self.params)) if i not in arrived]
                self._rebuilt = self._sync_plan(rebuilt_plan(self.params, order, self.caps, self.sparse))
                self._will_rebuild = False
            self._events.append({"stage": "write-back", "bucket": None, "start": end, "end": time.perf_counter()})
            self._last_events = self._events
            self._stamps["backward_comm_end"] = self._events[-1]["end"]
            self.last_stamps = self._stamps
            # Kept as they are; the statistics are computed from them only when sampled (runtime_facts).
            if counting:
                # torch reduces a static graph's first backward in delay_all_reduce: every bucket outside its count of
                # buckets reduced, the parameters no hook of this rank reached as the unused, no arrival order noted
                unused = [i for i, count in enumerate(self._static_counts) if count == 0]
                self._last_backward = (0, unused, [])
            else:
                reduced = sum(bucket.future is not None for bucket in self.buckets)  # skip_all_reduce_unused_params
                self._last_backward = (reduced, list(self._unused), list(self._grad_ready_order))

    def runtime_facts(self) -> dict[str, Any]:
        """The last finished backward's facts for the runtime statistics (:mod:`.logging_data`)."""
        facts: dict[str, Any] = {"has_rebuilt_buckets": int(self.has_rebuilt_buckets)}
        if self._last_backward is not None:
            buckets, unused, ready_order = self._last_backward
            facts["num_buckets_reduced"] = buckets
            facts["unused_parameter_size"] = sum(self.params[i].numel() * self.params[i].element_size() for i in unused)
            if ready_order:  # else torch leaves the last one logged
                facts["prev_iteration_grad_ready_order_indices"] = ", ".join(map(str, ready_order))
        if self.has_rebuilt_buckets:
            facts["rebuilt_bucket_sizes"] = ", ".join(str(b.buffer.numel() * b.buffer.element_size()) for b in self.buckets)
            facts["rebuilt_per_bucket_param_indices"] = ", ".join(" ".join(map(str, b.indices)) for b in self.buckets)
        return facts

    # ---- what frameworks call on torch's Reducer ---------------------------------------------

    def _delay_all_reduce(self) -> None:
        """Reduce now what a static graph's first backward has gathered (Lightning calls it after a manual
        backward); here the end of the backward has done it already, unless it is still waiting."""
        if self._expect_hooks and self._arrived:
            self._finish_backward()

    def _check_reducer_finalized(self) -> None:
        """Raise if the last backward left gradients unreduced (``DistributedDataParallel._check_reducer_finalized``)."""
        if self._require_finalize:
            raise self._logged(RuntimeError(self._unreduced_message()))

    def _logged(self, error: Exception) -> Exception:
        """``error``, recorded first in the wrapper's logging data (torch's reducer logs its errors)."""
        self.log_error(error)
        return error

    def _get_local_used_map(self) -> torch.Tensor:
        """How many ranks used each parameter in the last reduced backward (``find_unused_parameters`` or a static graph)."""
        return self._used_on_device

    def _ddp_graph_static(self) -> bool:
        """Whether every search so far found the same unused parameters (``Reducer::ddp_graph_static``): the
        graph could have been declared static (logged as ``can_set_static_graph``)."""
        return self._graph_static

    def _run_allreduce_hook(self, bucket: GradBucket) -> torch.futures.Future:
        """The all-reduce the reducer runs without a hook (its sum, not divided), for a hook to call."""
        return dist.all_reduce(bucket.buffer(), group=self.group, async_op=True).get_future()

    def _set_optimizer_in_backward(self) -> None:
        """The registered hook steps the optimizers in the backward: the reduced buckets are not copied back."""
        self._optimizer_in_backward = True

    def _install_post_backward_futures(self, futures: Sequence[torch.futures.Future]) -> None:
        """Futures the next backward waits for once its gradients are written back (a buffer hook's
        collectives, ``DistributedDataParallel._register_buffer_comm_hook``)."""
        self._post_backward_futures.extend(futures)

    def _remove_autograd_hooks(self) -> None:
        """Stop reducing: the parameters' hooks removed (``_remove_autograd_hooks``)."""
        _remove(self._handles)

    def _wait_for_use(self) -> None:
        """The sum over ranks of which parameters they used, into ``_local_used``."""
        if not self._used_reduced:
            self._local_used.copy_(self._used_future.wait()[0])
            self._used_reduced = True

    def _result_of(self, bucket: Bucket) -> torch.Tensor:
        try:
            value = bucket.future.wait()
        except RuntimeError as error:
            if not _peer_left(error):  # a comm hook's own error (its future's callback raised): as torch raises it
                error.add_note(f"DistributedDataParallel on rank {self.rank}: raised by bucket {bucket.index}'s future")
                raise
            raise RuntimeError(
                f"DistributedDataParallel on rank {self.rank}: the all-reduce of bucket {bucket.index} did not "
                f"complete: another rank stopped taking part in this backward (it ran out of data, raised, or left "
                f"the training loop). With uneven inputs across ranks, wrap the loop in `with ddp.join():` (or "
                f"torch.distributed.algorithms.Join([ddp])); the cause: {error}"
            ) from error
        _stamp_end(self._reduce_events[bucket.index])  # in case the done-callback has not run yet
        # the all-reduce's future holds the list of its tensors; a hook's must hold the reduced tensor itself, as
        # torch's reducer requires (a list there fails an internal assert or a cast to Tensor)
        result = value[0] if self.comm_hook is None else value
        communicated = as_real(bucket.buffer)
        if not isinstance(result, torch.Tensor) or result.numel() < communicated.numel():
            raise RuntimeError(self._bad_hook_result(bucket, result, communicated.numel()))
        if result.numel() > communicated.numel():
            # torch views each gradient at its offset in the result (populate_bucket_views_out): a longer tensor's
            # first elements are the bucket, the rest is left unread
            result = result.flatten()[: communicated.numel()]
        if bucket.buffer.is_complex() and not result.is_complex():
            # complex gradients were communicated as real (as_real): the result read back as complex, in place
            # when it is the bucket itself
            same = result.data_ptr() == bucket.buffer.data_ptr() and result.dtype == communicated.dtype
            return bucket.buffer if same else torch.view_as_complex(result.reshape(-1, 2))
        return result

    def _bad_hook_result(self, bucket: Bucket, value: Any, numel: int) -> str:
        """What is wrong with ``value``, what the hook's future for ``bucket`` held, and how to mend the hook."""
        if isinstance(value, torch.Tensor):
            got = f"a tensor of {value.numel()} elements"
        elif isinstance(value, (list, tuple)):
            got = f"a {type(value).__name__} of length {len(value)}"
        else:
            got = f"a {type(value).__module__}.{type(value).__qualname__}"
        text = (f"DDP communication hook {getattr(self.comm_hook, '__qualname__', self.comm_hook)!r}: the future it "
                f"returned for bucket {bucket.index} holds {got}; it must hold one tensor of {numel} elements (or "
                f"more: the first are read), the reduced bucket.buffer()")
        if isinstance(value, (list, tuple)):
            text += (". A collective's future holds the list of its tensors: return "
                     "fut.then(lambda f: f.value()[0]), as torch's allreduce_hook does")
        return text

    def _globally_unused(self, index: int) -> bool:
        """Whether no rank used parameter ``index`` since the last reduction (in a static graph: in the
        first backward); waits for the sum only if this rank did not use it (DDP waits lazily too)."""
        if self._static_unused is not None:
            return index in self._static_unused
        if not self._tracks_use() or self._local_used[index]:
            return False
        self._wait_for_use()
        return not self._local_used[index]

    def _write_back(self, bucket: Bucket, result: torch.Tensor) -> None:
        """``finalize_bucket_dense``: the reduced gradients into ``.grad``; a gradient no rank used stays as it was."""
        if self._optimizer_in_backward and not self.gradient_as_bucket_view and not bucket.sparse:
            return  # the optimizers have used the gradients already, and they are cleared next
        if bucket.sparse:
            if result is not bucket.buffer:
                bucket.buffer.copy_(result)  # into the parameter's own .grad, as reducer.cpp does
            return
        views = bucket.views if result is bucket.buffer else views_of(result, bucket.params)
        into, values = [], []
        for position, (index, param) in enumerate(zip(bucket.indices, bucket.params)):
            if self.gradient_as_bucket_view:
                own = bucket.views[position]
                if views[position] is not own:  # a hook returned a new tensor: its values into the bucket
                    own.copy_(views[position])
                if self._globally_unused(index):
                    continue
                if param.grad is None:
                    param.grad = own
                elif not _shares_storage(param.grad, own):
                    raise RuntimeError(
                        f"parameter {index} ('{self.names[index]}'): with gradient_as_bucket_view=True its .grad "
                        f"must stay a view of its bucket, but it was replaced by another tensor during the backward"
                    )
            elif self._globally_unused(index):
                continue
            elif param.grad is None:
                param.grad = torch.empty_like(param).copy_(views[position])  # the parameter's layout
            elif param.grad.requires_grad:
                # backward(create_graph=True): the mean copied in while autograd records, as reducer.cpp
                # copies it (.grad keeps its graph, now ending in a CopyBackwards). The graph does not
                # reach the other ranks: a second backward through .grad differentiates this rank's part.
                with torch.enable_grad():
                    param.grad.copy_(views[position])
            else:
                into.append(param.grad)
                values.append(views[position])
        if into:
            torch._foreach_copy_(into, values)

    def _unreduced_message(self) -> str:
        """torch DDP's words (``Reducer::ensure_prior_reduction_finished``) for a backward that left gradients
        unreduced: the likely cause, and what got no gradient on this rank, by name unless the debug level is OFF."""
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        text = "Expected to have finished reduction in the prior iteration before starting a new one. "
        if self.static_graph:
            text += (
                "This error indicates that your training graph has changed in this iteration, e.g., one parameter is "
                "used in first iteration, but then got unused in the second iteration. this is not compatible with "
                "static_graph set to True."
            )
        else:
            text += "This error indicates that your module has parameters that were not used in producing loss. "
            if self.find_unused_parameters:  # so it found them: some outputs took no part in the loss
                text += ("Since `find_unused_parameters=True` is enabled, this likely  means that not all `forward` "
                         "outputs participate in computing loss. You can fix this by ")
            else:
                text += ("You can enable unused parameter detection by passing the keyword argument "
                         "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and by \n")
            text += (
                "making sure all `forward` function outputs participate in calculating loss. \nIf you already have "
                "done the above, then the distributed data parallel module wasn't able to locate the output tensors "
                "in the return value of your module's `forward` function. Please include the loss function and the "
                "structure of the return value of `forward` of your module when reporting this issue (e.g. list, "
                "dict, iterable)."
            )
        quiet = dist.get_debug_level() == dist.DebugLevel.OFF
        if not quiet:
            # names last-registered first, indices in order, as reducer.cpp lists them
            text += f"\nParameters which did not receive grad for rank {self.rank}: " + ", ".join(
                self.names[i] for i in reversed(missing))
        text += f"\nParameter indices which did not receive grad for rank {self.rank}: " + " ".join(map(str, missing))
        if quiet:
            text += (
                "\n In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO or DETAIL "
                "to print out information about which particular parameters did not receive gradient on this rank as "
                "part of this error"
            )
        return text

    def _warn_create_graph(self) -> None:
        if not self._warned_create_graph:
            self._warned_create_graph = True
            warnings.warn(CREATE_GRAPH_WARNING, stacklevel=2)

    # ---- hooks and timings ------------------------------------------------------------------

    def register_comm_hook(self, state: Any, hook: CommHook, builtin: bool = False) -> None:
        """Let ``hook(state, bucket)`` reduce each bucket (checked by the caller, :mod:`.comm_hooks`); once."""
        if self.comm_hook is not None:
            raise RuntimeError(ONLY_ONCE_BUILTIN if builtin else ONLY_ONCE)
        self.comm_hook, self.comm_state = hook, state

    def timeline(self) -> list[dict]:
        """The events of the last synchronised backward: one dict per event with ``stage``
        (``"backward"``, ``"bucket ready"``, ``"all-reduce"``, ``"write-back"``), ``bucket`` (its index,
        or None), ``rank``, and ``start``/``end`` in seconds since the Unix epoch."""
        return [
            {**event, "rank": self.rank, "start": to_epoch_seconds(event["start"]),
             "end": to_epoch_seconds(event["end"])}
            for event in self._last_events
        ]


def _stamp_end(event: dict) -> None:
    if event["end"] is None:
        event["end"] = time.perf_counter()


def _accumulator_of(param: torch.Tensor) -> Any:
    """The node that accumulates ``param``'s gradient (``AccumulateGrad``), reached through a view of it."""
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]


_tensor_address = attrgetter("_cdata")  # the C++ tensor a Python tensor holds: another one after a swap_tensors


def _hook(reducer: Reducer, index: int) -> Callable[[torch.Tensor], None]:
    """Parameter ``index``'s post-accumulate-grad hook. It holds the reducer weakly, so that a
    dropped ``DistributedDataParallel`` stops reducing (and its finalizer removes the hooks)."""
    ref = weakref.ref(reducer)

    def hook(_: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            live.autograd_hook(index)

    return hook


def python_reducer_mode() -> bool:
    """Whether ``torch._dynamo.config.optimize_ddp`` is ``"python_reducer"`` (torch DDP reads it at construction,
    ``torch._dynamo.utils.get_optimize_ddp_mode()``). Dynamo not imported: nobody set it."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and dynamo.utils.get_optimize_ddp_mode() == "python_reducer"


def refuse_compiled_autograd() -> None:
    """Raise torch's error if this backward runs under compiled autograd (``torch._dynamo.config.compiled_autograd=True``
    around a compiled step, or ``torch._dynamo.compiled_autograd._enable(...)``).

    There the reducer cannot work: compiled autograd turns the backward into one graph and runs the parameters' hooks
    inside it, but not the callback queued on the autograd engine (:meth:`Reducer._queue_finish`), so the buckets
    would be filled and launched and never waited for nor written back: every rank left with its own gradients, and
    the next forward raising that the reduction did not finish. torch's C++ reducer refuses when compiled autograd
    collects its hook; in Python the first place to see it is the hook, which the compiled graph calls with this flag
    set (compiled_autograd.py's runtime wrapper sets it around the graph, while the graph is compiled and while it
    runs): asked once a backward, as the reducer queues that callback (the hook on the forward's outputs, which runs
    before any gradient is accumulated, or the first parameter's, for a backward that does not start there). Dynamo not
    imported: nothing is compiled."""
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    if compiled_autograd is not None and compiled_autograd.in_compiled_autograd_region:
        raise RuntimeError(COMPILED_AUTOGRAD_REFUSED)


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()
