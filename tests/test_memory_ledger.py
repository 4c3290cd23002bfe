"""The memory ledger (minidp/tracing/memory.py): what each device and replica held in a step, counted from allocations.

The cases are small enough to count by hand. An MLP ``Linear(D, H) -> ReLU -> Linear(H, O)`` in float64 (8 bytes
an element) on two CPU replicas, batch ``B`` cut into chunks ``b0 + b1``:

* parameters ``P = (D*H + H + H*O + O) * 8``, held by the module; the replicas' parameters on the CPU alias
  them (stock replicate's same-device rule), so the replicas hold none of their own;
* inputs: the batch ``B*D*8`` and the targets ``B*O*8``; replica 0's chunk is a view of the batch (0 bytes),
  replica 1's a copy of its own ``b1*D*8`` (minidp/comm.py, ``split_to_devices``);
* activations kept for the backward, per replica: the ReLU's output ``b*H*8`` (ReLU's backward keeps its
  result and the second Linear keeps it as its input); the first Linear's output dies inside the forward,
  and the replica's output dies once gathered: both are temporaries; except where the replicas' backwards run
  in parallel (``minidp.parallel_backward.applies``), whose node keeps each replica's output ``b*O*8`` as the
  root of that replica's backward;
* gathered outputs: ``B*O*8``; loss ``(output - target).pow(2).sum()``: the difference the square keeps for its
  backward ``B*O*8``, the scalar ``8``, and the gradient ``backward()`` starts from (``torch.ones_like(loss)``) ``8``;
* gradients: each replica's ``P`` handed to the reduction, and the sums (``P``), which become ``.grad``:
  ``3P`` on the device at once; where the extension sums them, the sums lie in one block of its output pool,
  each rounded up to 64 bytes (``kAlign`` in csrc/bindings.cpp), and the block is what is held;
* optimizer state: SGD with momentum keeps one buffer per parameter, ``P``, made by the first step.

On the CPU the bytes counted are the sizes torch's allocator is asked for, which it allocates exactly (the heap's
64-byte alignment is below torch), so the figures are compared with ``==``.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import minidp
from minidp.tracing.memory import CATEGORIES, measure_step
from minidp.zoo import SmallCNN

from .helpers import cpu_ids, fresh_python, requires_cuda

D, H, O = 16, 32, 4
BYTES = 8  # float64
N = 100_000  # float64 elements of a buffer released and refilled: 800 kB, far above any scratch an operator keeps


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, O)).double()


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.nbytes for p in module.parameters())


def summed_gradient_bytes(module: nn.Module) -> int:
    """The bytes of the reduction's sums: ``P``, or the extension's pool block where the extension sums them."""
    parameters = list(module.parameters())
    if minidp.comm.reduce_backends(parameters) != ["ext"] * len(parameters):
        return parameter_bytes(module)
    return sum(-(-p.nbytes // 64) * 64 for p in parameters)


def kept_output_bytes(rows: int) -> int:
    """The replicas' outputs the parallel backward's node keeps for the backward (``rows`` of them), or 0."""
    return rows * O * BYTES if minidp.parallel_backward.applies([torch.device("cpu")] * 2) else 0


def row(ledger: list, device: str = "cpu", replica=None):
    (found,) = [r for r in ledger if r.device == device and r.replica == replica]
    return found


def traced_mlp_step(generator, rows: int, gather_output: bool = True, measured: bool = False):
    """A warm SGD step (makes the momentum buffers), then one traced training step (``measured``: measured by
    ``measure_step`` instead, with the module's parameters); returns (ledger, module).

    The extension's pool of reduction outputs starts empty, as in a fresh process: a larger block an
    earlier test left free would hold these sums, and be counted whole."""
    minidp.ext.release_reduce_outputs()
    module = mlp()
    model = minidp.DataParallel(module, cpu_ids(2), gather_output=gather_output)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(rows, D, generator=generator, dtype=torch.float64)
    y = torch.randn(rows, O, generator=generator, dtype=torch.float64)

    def step() -> None:
        optimizer.zero_grad()
        output = model(x)
        loss = (output - y).pow(2).sum() if gather_output else minidp.parallel_criterion(nn.MSELoss(), output, y)
        loss.backward()
        optimizer.step()

    step()
    if measured:
        return measure_step(step, module.parameters())[1], module
    with minidp.trace(ledger=True) as traced:
        step()
    return traced.ledger(), module


@pytest.mark.parametrize("rows", [8, 7])  # even chunks [4, 4]; uneven [4, 3]
def test_an_mlp_step_on_two_cpu_replicas_holds_what_is_counted_by_hand(generator, rows):
    ledger, module = traced_mlp_step(generator, rows)
    P = parameter_bytes(module)
    chunks = [4, rows - 4]
    device = row(ledger)
    assert device.held["parameters"] == P
    # the batch and the targets, and replica 1's chunk: its own copy (replicas sharing a device share no chunk)
    assert device.held["inputs"] == rows * D * BYTES + rows * O * BYTES + chunks[1] * D * BYTES
    assert device.held["activations"] == rows * H * BYTES + kept_output_bytes(rows)
    assert device.held["gathered outputs"] == rows * O * BYTES
    assert device.held["loss"] == rows * O * BYTES + 2 * BYTES
    assert device.held["gradients"] == 2 * P + summed_gradient_bytes(module)
    assert device.held["optimizer state"] == P
    for replica, chunk in enumerate(chunks):
        own = row(ledger, replica=replica)
        # counted in its own thread, replica 1's too
        assert own.held["activations"] == chunk * H * BYTES + kept_output_bytes(chunk)
        assert own.held["gradients"] == P
        assert own.held["parameters"] == 0  # aliases of the module's
        assert own.held["inputs"] == (0 if replica == 0 else chunk * D * BYTES)  # a view of the batch, a copy


@pytest.mark.parametrize("parallel_backward", [False, True], ids=["serial_backward", "parallel_backward"])
def test_two_replicas_of_even_chunks_hold_the_same_in_either_backward(generator, parallel_backward, monkeypatch):
    # the replicas' backwards one after the other in this thread, or each in its worker, watched there as here: each
    # replica's gradients made by its backward (not found already held when the step began), its temporaries counted
    # (but for replica 1's input chunk: a copy of its own, held through the step, where replica 0's is a view)
    monkeypatch.setattr(minidp.parallel_backward, "_enabled", parallel_backward)
    ledger, _ = traced_mlp_step(generator, 8)
    first, second = row(ledger, replica=0), row(ledger, replica=1)
    chunk = 4 * D * BYTES
    assert (first.peak + chunk, {**first.held, "inputs": chunk}) == (second.peak, second.held)
    assert first.held["temporaries"] > 0


@pytest.mark.parametrize("parallel_backward", [False, True], ids=["serial_backward", "parallel_backward"])
def test_what_a_replicas_backward_makes_in_its_own_thread_is_that_replicas(generator, parallel_backward, monkeypatch):
    # The parallel backward runs replica i's nodes in its worker: the gradient of its hidden layer (the second Linear's
    # backward, chunk*H) and ReLU's backward of it (chunk*H), held at once, are replica i's temporaries, beside its
    # forward's (the first Linear's output, chunk*H). The serial backward interleaves the replicas' nodes in this
    # thread, where what they make is the device's.
    monkeypatch.setattr(minidp.parallel_backward, "_enabled", parallel_backward)
    ledger, _ = traced_mlp_step(generator, 8)
    hidden = 4 * H * BYTES
    for replica in (0, 1):
        assert row(ledger, replica=replica).held["temporaries"] == (2 * hidden if parallel_backward else hidden)


def test_counting_leaves_the_replicas_backwards_in_their_own_threads(generator, monkeypatch):
    # The ledger's mode is the calling thread's, where the parallel backward runs the replicas' backwards one after
    # the other under a mode it would otherwise miss (a FlopCounterMode); the ledger enters one in every replica's
    # thread itself, so the step runs as it does untraced: each replica's backward in a thread of its own.
    monkeypatch.setattr(minidp.parallel_backward, "_enabled", True)
    threads = set()
    module = mlp()
    module[2].register_full_backward_hook(lambda *_: threads.add(threading.get_ident()))
    model = minidp.DataParallel(module, cpu_ids(2))
    with minidp.trace(ledger=True):
        model(torch.randn(8, D, generator=generator, dtype=torch.float64)).sum().backward()
    assert len(threads) == 2


_FIRST_LEDGER_OF_A_PROCESS = """
import sys, torch, minidp
from torch import nn
model = minidp.DataParallel(nn.Linear(8, 4), ["cpu"] * 2)
with minidp.trace(ledger=True):
    before = set(sys.modules)
    model(torch.randn(6, 8)).sum().backward()
    print(sorted(name for name in set(sys.modules) - before if name.startswith("torch")))
"""


@pytest.mark.fresh_interpreter
def test_the_first_ledger_of_a_process_imports_nothing_of_torch_inside_the_step():
    # The first operator under any TorchDispatchMode imports torch._dynamo (torch/_compile.py): about a second, which
    # inside the step would be timed as its first stage's (a scatter of a second). The ledger imports it as it starts.
    done = fresh_python("-c", _FIRST_LEDGER_OF_A_PROCESS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_category_of_a_cpu_training_step_is_non_zero_on_the_device(generator):
    ledger, _ = traced_mlp_step(generator, 8)
    device = row(ledger)
    assert list(device.held) == list(CATEGORIES)
    assert all(device.held[category] > 0 for category in CATEGORIES), device.held


def test_the_peak_is_what_was_held_at_one_moment(generator):
    ledger, _ = traced_mlp_step(generator, 8)
    for r in ledger:
        assert r.peak == sum(r.at_peak.values())
        assert max(r.held.values()) <= r.peak <= sum(r.held.values())
        assert all(r.at_peak[c] <= r.held[c] for c in r.held)


def test_with_the_loss_on_the_replicas_only_the_loss_terms_are_gathered(generator):
    """Issue: GPU 0 runs out of memory first because it gathers every output; parallel_criterion does not."""
    ledger, module = traced_mlp_step(generator, 8, gather_output=False)
    device = row(ledger)
    assert device.held["gathered outputs"] == 2 * 2 * BYTES  # a numerator and a denominator per replica
    for replica in (0, 1):  # the output stays on its replica, kept for the loss's backward
        assert row(ledger, replica=replica).held["activations"] == 4 * H * BYTES + 4 * O * BYTES
    assert device.held["gradients"] == 2 * parameter_bytes(module) + summed_gradient_bytes(module)


def test_the_demo_cnn_with_adam_fills_every_category_both_ways(generator):
    images = torch.randn(16, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (16,), generator=generator)
    for gather_output in (True, False):
        module = SmallCNN()
        model = minidp.DataParallel(module, cpu_ids(2), gather_output=gather_output)
        optimizer = torch.optim.Adam(module.parameters())

        def step() -> None:
            optimizer.zero_grad()
            output = model(images)
            if gather_output:
                loss = nn.functional.cross_entropy(output, labels)
            else:
                loss = minidp.parallel_criterion(nn.CrossEntropyLoss(), output, labels)
            loss.backward()
            optimizer.step()

        step()
        with minidp.trace(ledger=True) as traced:
            step()
        device = row(traced.ledger())
        assert all(device.held[category] > 0 for category in CATEGORIES), (gather_output, device.held)
        P = parameter_bytes(module)
        steps = 4 * len(list(module.parameters()))  # Adam's step counters: one float32 scalar per parameter
        assert device.held["optimizer state"] == 2 * P + steps  # exp_avg and exp_avg_sq
        assert device.held["gathered outputs"] == (16 * 10 * 4 if gather_output else 2 * 2 * 4)
        if not gather_output:  # each replica's cross-entropy keeps its log-softmax, made in the replica's thread
            assert all(row(traced.ledger(), replica=r).held["loss"] >= 8 * 10 * 4 for r in (0, 1))


def accumulated_mlp_step(generator, micro_batches: list[int]) -> list:
    """One traced step of gradient accumulation: a forward and a backward per micro-batch of ``micro_batches`` rows,
    each freeing what its forward kept before the next forward; returns the ledger."""
    model = minidp.DataParallel(mlp(), cpu_ids(2))
    batches = [(torch.randn(rows, D, generator=generator, dtype=torch.float64),
                torch.randn(rows, O, generator=generator, dtype=torch.float64)) for rows in micro_batches]
    with minidp.trace(ledger=True) as traced:
        for x, y in batches:
            (model(x) - y).pow(2).sum().backward()
    return traced.ledger()


def test_with_gradient_accumulation_each_forward_keeps_activations_for_its_own_backward(generator):
    # a micro-batch of 2 rows, then one of 8: the second forward's were filed as temporaries, made after the first
    # backward had begun, and the step's activations read as the 2-row micro-batch's
    ledger = accumulated_mlp_step(generator, [2, 8])
    assert row(ledger).held["activations"] == 8 * H * BYTES + kept_output_bytes(8)
    for replica in (0, 1):
        assert row(ledger, replica=replica).held["activations"] == 4 * H * BYTES + kept_output_bytes(4)


def test_with_gradient_accumulation_each_micro_batchs_loss_is_the_loss(generator):
    ledger = accumulated_mlp_step(generator, [2, 8])
    assert row(ledger).held["loss"] == 8 * O * BYTES + 2 * BYTES  # the square's kept difference, scalar, its gradient


@pytest.mark.parametrize("micro_batches", [[8], [2, 8]], ids=["one_forward", "accumulated"])
@pytest.mark.parametrize("targets_made", ["before_the_forward", "after_the_forward"])
def test_targets_made_in_the_step_are_inputs_not_loss(generator, micro_batches, targets_made):
    # the ledger's table (minidp/tracing/memory.py): the loss is what the caller's code makes where autograd records
    # it; targets it makes in the step (as a loop that loads its batches does), before the forward or after, are inputs
    model = minidp.DataParallel(mlp(), cpu_ids(2))
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    with minidp.trace(ledger=True) as traced:
        for rows in micro_batches:
            if targets_made == "before_the_forward":
                y = torch.randn(rows, O, generator=generator, dtype=torch.float64)
                output = model(x[:rows])
            else:
                output = model(x[:rows])
                y = torch.randn(rows, O, generator=generator, dtype=torch.float64)
            (output - y).pow(2).sum().backward()
            del output, y  # a micro-batch's targets not held into the next one's
    device = row(traced.ledger())
    assert device.held["loss"] == 8 * O * BYTES + 2 * BYTES  # the square's kept difference, the scalar, its gradient
    assert device.held["inputs"] == 8 * D * BYTES + 8 * O * BYTES + 4 * D * BYTES  # batch, targets, replica 1's chunk


def test_a_penalty_on_the_weights_computed_before_the_forward_is_loss(generator):
    # the ledger's table: what the caller's code makes before the model ran is loss where autograd recorded it (a term
    # of the loss that back-propagates into the parameters), not an input
    module = mlp()
    model = minidp.DataParallel(module, cpu_ids(2))
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    with minidp.trace(ledger=True) as traced:
        weight = module[0].weight
        penalty = (weight @ weight.t()).pow(2).sum()  # pow keeps the H x H product for its backward
        (model(x).pow(2).sum() + penalty).backward()
    device = row(traced.ledger())
    assert device.held["loss"] >= H * H * BYTES
    assert device.held["inputs"] == 8 * D * BYTES + 4 * D * BYTES  # the batch, replica 1's chunk


def test_targets_made_after_a_forward_under_no_grad_are_inputs_of_the_forward_that_records(generator):
    # a forward under torch.no_grad() (a teacher's, an evaluation's) records no graph: the targets made after it, before
    # the forward the backward runs through, are that forward's inputs
    model = minidp.DataParallel(mlp(), cpu_ids(2))
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    with minidp.trace(ledger=True) as traced:
        with torch.no_grad():
            model(x)
        y = torch.randn(8, O, generator=generator, dtype=torch.float64)
        (model(x) - y).pow(2).sum().backward()
    device = row(traced.ledger())
    assert device.held["loss"] == 8 * O * BYTES + 2 * BYTES
    assert device.held["inputs"] == 8 * D * BYTES + 8 * O * BYTES + 4 * D * BYTES


@pytest.mark.parametrize("made_by", ["the_caller", "a_pack_hook"])
def test_what_a_backward_is_the_first_user_of_is_loss(generator, made_by):
    # the ledger's table: the caller's code made it with autograd recording nothing, but no operator took it before the
    # backward did: a gradient given to backward() (as the one it makes itself, torch.ones_like), or the copy of a
    # saved tensor that a saved_tensors_hooks pack hook makes (with grad off) and its unpack hook gives the backward
    model = minidp.DataParallel(mlp(), cpu_ids(2))
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    y = torch.randn(8, O, generator=generator, dtype=torch.float64)
    with minidp.trace(ledger=True) as traced:
        output = model(x)
        if made_by == "the_caller":
            output.backward(gradient=torch.ones(8, O, dtype=torch.float64))
        else:
            with torch.autograd.graph.saved_tensors_hooks(torch.clone, lambda kept: kept):
                loss = (output - y).pow(2).sum()  # pow's input, cloned by the pack hook
            loss.backward()
    device = row(traced.ledger())
    assert device.held["loss"] == 8 * O * BYTES + (0 if made_by == "the_caller" else 2 * BYTES)
    assert device.held["inputs"] == 8 * D * BYTES + 4 * D * BYTES + (0 if made_by == "the_caller" else 8 * O * BYTES)


class MaskedLinear(nn.Module):
    """A model that takes a keyword tensor beside its batch, as a transformer's attention mask."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(D, O)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.linear(x * mask)


def test_a_tensor_passed_by_keyword_is_each_replicas_input_as_its_chunk_of_the_batch_is(generator):
    # scatter_kwargs cuts a keyword tensor as it cuts the batch: replica 0's chunk of each is a view on the batch's
    # own device (no bytes of its own), replica 1's a copy; the whole tensors are the device's inputs, no replica's
    model = minidp.DataParallel(MaskedLinear().double(), cpu_ids(2))
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    mask = (torch.randn(8, D, generator=generator) > 0).double()
    with minidp.trace(ledger=True) as traced:
        model(x, mask=mask).sum().backward()
    ledger = traced.ledger()
    assert row(ledger).held["inputs"] == 2 * 8 * D * BYTES + 2 * 4 * D * BYTES
    assert row(ledger, replica=0).held["inputs"] == 0
    assert row(ledger, replica=1).held["inputs"] == 2 * 4 * D * BYTES


def test_the_ledger_leaves_the_step_exact(generator):
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    module = mlp()
    model = minidp.DataParallel(module, cpu_ids(2))
    model(x).pow(2).sum().backward()
    plain = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    with minidp.trace(ledger=True):
        model(x).pow(2).sum().backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(module.parameters(), plain))


def test_the_ledger_keeps_no_tensor_of_the_step_alive(generator):
    model = minidp.DataParallel(mlp(), cpu_ids(2))
    with minidp.trace(ledger=True) as traced:
        output = model(torch.randn(8, D, generator=generator, dtype=torch.float64))
        output.pow(2).sum().backward()
    gone = weakref.ref(output)
    del output
    gc.collect()
    assert gone() is None
    assert traced.ledger()  # still readable: it keeps numbers, not tensors


def test_a_storage_released_with_resize_stops_counting_when_released():
    # fully_shard releases a gathered parameter so (untyped_storage().resize_(0)), as FSDP2's free_storage does; no
    # operator shows it. Each round holds its buffer and the doubled temporary at once, then the sum (8 bytes).
    released = []

    def step() -> None:
        for _ in range(4):
            buffer = torch.ones(N, dtype=torch.float64)
            (buffer * 2).sum()
            buffer.untyped_storage().resize_(0)
            released.append(buffer)  # the tensor lives on, its memory does not

    _, ledger = measure_step(step)
    assert row(ledger).peak == 2 * N * BYTES + BYTES


def test_a_storage_refilled_with_resize_counts_from_its_refill():
    # held at the start, released, a temporary twice its size made and dropped, then refilled: the most held at once
    # is the temporary alone, not the temporary and the buffer
    buffer = torch.ones(N, dtype=torch.float64)

    def step() -> None:
        buffer.untyped_storage().resize_(0)
        temporary = torch.ones(2 * N, dtype=torch.float64)
        del temporary
        buffer.untyped_storage().resize_(N * BYTES)
        buffer.fill_(1.0)

    _, ledger = measure_step(step)
    assert row(ledger).peak == 2 * N * BYTES
    assert "resize_" not in vars(torch.UntypedStorage)  # torch's own method again once the measurement ends


@pytest.mark.parametrize("how", ["resize_", "an out= argument"])
def test_a_storage_grown_in_place_holds_its_old_block_and_its_new_one_at_once(how):
    # torch's allocator grows a storage by allocating a block of the new size, copying the old into it and freeing
    # the old one (resize_bytes_cpu in aten/src/ATen/native/Resize.cpp): for a moment it holds N and 2N elements,
    # beside the N of the source
    source, grown = torch.ones(N, dtype=torch.float64), torch.ones(N, dtype=torch.float64)

    def step() -> None:
        if how == "resize_":
            grown.resize_(2 * N)
            grown[N:].copy_(source)
        else:
            with warnings.catch_warnings():  # torch deprecates growing a non-empty out=, and still does it
                warnings.simplefilter("ignore", UserWarning)
                torch.cat([source, source], out=grown)

    _, ledger = measure_step(step)
    assert row(ledger).peak == 4 * N * BYTES


def test_sums_the_extension_writes_into_memory_kept_from_an_earlier_step_count_from_the_start(extension, generator):
    # The extension writes CPU sums into a block of memory it keeps between steps and takes again once no tensor over
    # it is alive (minidp/ext.py, reduce_add_coalesced): taken again, the block was held all along, so the step's
    # largest moment, a temporary made before any reduction, held it too; a block made at the reduction was not held
    module = mlp()
    model = minidp.DataParallel(module, cpu_ids(2), reduce_backend="ext")
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)

    def step(largest_moment: bool = True) -> None:
        module.zero_grad(set_to_none=True)  # the last step's sums let go of: their block is free to take again
        if largest_moment:
            torch.ones(4 * N, dtype=torch.float64).sum()  # the step's largest moment, before the reduction
        model(x).square().sum().backward()

    minidp.ext.release_reduce_outputs()
    step()
    block = minidp.ext.reduce_output_bytes()
    _, taken_again = measure_step(step)  # not told of the parameters: their .grad, over the block, is not met first
    minidp.ext.release_reduce_outputs()  # the block goes with the sums the next step lets go of
    _, made = measure_step(step)
    assert block > 0 and row(taken_again).peak == row(made).peak + block
    # made by the measurement's first step and taken again by a second one, whose work is small: counted from when it
    # was made, so the first step's largest moment, before its reduction, did not hold it
    minidp.ext.release_reduce_outputs()
    module.zero_grad(set_to_none=True)
    _, made_then_taken_again = measure_step(lambda: (step(), step(largest_moment=False)))
    assert row(made_then_taken_again).peak == row(made).peak
    # and it is one allocation held from then on, though its sums were let go of between the steps: the gradients held
    # at once, at most, are the block and the replicas' gradients handed to the reduction
    assert row(made_then_taken_again).held["gradients"] == row(made).held["gradients"]


class _PassesTheGradientThrough(torch.autograd.Function):
    """Keeps its input for the backward, whose first act is to let go of it: it hands the gradient on and allocates
    nothing."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_what_a_backward_lets_go_of_before_it_allocates_anything_was_kept_for_it(generator):
    # A backward begins with its graph task's first event, an allocation or a free: the tensor a node frees first was
    # kept for the backward (an activation), not a temporary of the forward. Kept: the ReLU's output (its backward
    # reads it) and its double (the Function's); the Linear's output dies inside the forward, a temporary.
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(D, H, bias=False)

        def forward(self, x):
            hidden = torch.relu(self.linear(x))
            return _PassesTheGradientThrough.apply(hidden * 2)

    model = Model().double()
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    # the loss, the sum outside the model, and the gradient backward() starts from are the loss
    _, ledger = measure_step(lambda: model(x).sum().backward(), model.parameters(), kept_by_host="loss")
    assert row(ledger).held["activations"] == 2 * 8 * H * BYTES


def test_a_trace_without_the_ledger_says_how_to_get_one(generator):
    with minidp.trace() as traced:
        minidp.DataParallel(mlp(), cpu_ids(2))(torch.randn(4, D, generator=generator, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"minidp.trace\(ledger=True\)"):
        traced.ledger()


def test_measure_step_counts_a_plain_step_given_as_a_callable(generator):
    """The ledger without a trace: one module on one device, its forward run by the calling thread."""
    module = mlp()
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    _, ledger = measure_step(lambda: module(x).pow(2).sum().backward(), module.parameters())
    (device,) = ledger
    assert device.held["parameters"] == device.held["gradients"] == parameter_bytes(module)
    assert device.held["inputs"] == x.nbytes
    # kept for the backward: the ReLU's output, the output the square keeps, the loss and the gradient
    # backward() starts from
    assert device.held["activations"] == 8 * H * BYTES + 8 * O * BYTES + 2 * BYTES


def test_a_buffer_the_parallel_code_names_through_minidp_hooks_counts_in_that_category():
    """fully_shard and DDP's reducer name their buffers (gathered parameters, buckets) through minidp.hooks, which
    imports nothing of the ledger: a buffer held before the step, and met first inside it, would be an input."""
    bucket = torch.zeros(4, dtype=torch.float64)

    def step() -> None:
        bucket.add_(1.0)  # first met here, held since before the step
        minidp.hooks.observe_storage("gradients", [bucket])

    _, ledger = measure_step(step)
    (device,) = ledger
    assert device.held["gradients"] == 4 * BYTES
    assert device.held["inputs"] == 0


def test_measure_step_counts_a_data_parallel_step_in_every_replicas_thread(generator):
    # replicas 1.. run their forwards (and backwards) in worker threads, which measure_step did not watch
    ledger, _ = traced_mlp_step(generator, 8, measured=True)
    for replica in (0, 1):
        assert row(ledger, replica=replica).held["activations"] == 4 * H * BYTES + kept_output_bytes(4)
    assert row(ledger).held["activations"] == 8 * H * BYTES + kept_output_bytes(8)


def test_measure_step_names_what_a_data_parallel_step_holds_as_the_trace_does(generator):
    # the caller's code after the gather is the loss, not activations; the stages' tensors are named by their stage
    ledger, module = traced_mlp_step(generator, 8, measured=True)
    P = parameter_bytes(module)
    device = row(ledger)
    assert device.held["loss"] == 8 * O * BYTES + 2 * BYTES
    assert device.held["gathered outputs"] == 8 * O * BYTES
    assert device.held["gradients"] == 2 * P + summed_gradient_bytes(module)
    assert device.held["optimizer state"] == P


def test_measure_step_inside_a_trace_says_to_read_the_traces_ledger():
    with minidp.trace(ledger=True), pytest.raises(RuntimeError, match=r"step\.ledger\(\)"):
        measure_step(lambda: None)


def sparse_gradient_step(generator, coalesce: bool):
    """An ``nn.Embedding(sparse=True)`` step of 8 x 5 lookups, its ``.grad`` sparse, which has no storage of its own
    (the ledger counted it as 0 B); returns the device's row."""
    module = nn.Embedding(100, 4, sparse=True)
    lookups = torch.randint(0, 100, (8, 5), generator=generator)

    def step() -> None:
        module(lookups).sum().backward()
        if coalesce:
            module.weight.grad = module.weight.grad.coalesce()

    _, (device,) = measure_step(step, module.parameters())
    return device


def test_a_sparse_gradient_is_counted_as_its_indices_and_values(generator):
    device = sparse_gradient_step(generator, coalesce=False)
    assert device.held["gradients"] == 40 * 8 + 40 * 4 * 4  # one int64 index and 4 float32 values per lookup


def test_a_coalesced_sparse_gradient_is_counted_as_the_storages_of_its_indices_and_values(generator):
    # coalesce() sums repeated rows into new storages made for all 40 lookups, then narrows them to the distinct rows:
    # the storages are what is held; the uncoalesced gradient, the parameter's .grad until the coalesced one replaces
    # it, is held beside it while coalesce() runs
    device = sparse_gradient_step(generator, coalesce=True)
    assert device.held["gradients"] == 2 * (40 * 8 + 40 * 4 * 4)


@pytest.mark.parametrize("layout", ["csr", "csc"])
def test_a_compressed_sparse_tensor_is_counted_as_its_indices_and_values(layout):
    identity = torch.eye(8, dtype=torch.float64)
    sparse = identity.to_sparse_csr() if layout == "csr" else identity.to_sparse_csc()
    compressed, plain = (sparse.crow_indices(), sparse.col_indices()) if layout == "csr" else (
        sparse.ccol_indices(), sparse.row_indices())
    _, (device,) = measure_step(sparse.to_dense)
    # held before the step: the storages of 9 compressed and 8 plain int64 indices and of 8 float64 values (torch 2.13's
    # plain indices are a view of the 2 x 8 indices its conversion made on its way, through COO: 128 bytes)
    storages = [t.untyped_storage().nbytes() for t in (compressed, plain, sparse.values())]
    assert storages[0] >= 9 * 8 and storages[1] >= 8 * 8 and storages[2] >= 8 * 8
    assert device.held["inputs"] == sum(storages)


def test_a_tensor_on_the_meta_device_holds_no_memory():
    def step() -> None:
        shape_only = torch.empty(10**6, device="meta")
        del shape_only

    _, ledger = measure_step(step)
    assert [r.device for r in ledger] == []


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_last_steps_gradients_count_until_zero_grad_lets_go_of_them(generator, replicas):
    """``zero_grad()`` (set_to_none) frees the last step's ``.grad`` without any operator: known as the model's from
    the moment its parameters are (a replicate, or the module running alone), they count as gradients until then."""
    module = mlp()
    model = minidp.DataParallel(module, cpu_ids(replicas))
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    model(x).sum().backward()
    with minidp.trace(ledger=True) as traced:
        output = model(x)
        module.zero_grad()
        del output
    assert row(traced.ledger()).held["gradients"] == (summed_gradient_bytes(module) if replicas > 1
                                                      else parameter_bytes(module))


def test_a_steps_gradients_let_go_of_by_the_next_steps_zero_grad_are_gradients(generator):
    """Two steps of the module alone on its one device, updated by hand (no optimizer to name the ``.grad``): the
    first step's ``.grad``, let go of by the second's ``zero_grad``, was made in a backward and named by nothing,
    so it counted as temporaries; it is named as autograd accumulates it."""
    module = mlp()
    model = minidp.DataParallel(module, ["cpu"])
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)

    def step() -> None:
        module.zero_grad()
        model(x).pow(2).sum().backward()
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.sub_(parameter.grad)  # in place: the update makes no temporary

    with minidp.trace(ledger=True) as traced:
        step()
        step()
    device = row(traced.ledger())  # the peak: the second backward, the first step's .grad still held
    assert device.at_peak["gradients"] == device.held["gradients"] == parameter_bytes(module)


@pytest.mark.parametrize("replicas", [0, 2], ids=["plain_model", "two_replicas"])
def test_a_closure_the_optimizer_runs_keeps_its_activations_and_loss(generator, replicas):
    """``optimizer.step(closure)`` (LBFGS, three evaluations a step) runs the forward and the backward inside the step:
    what the closure makes is the step's, named as outside the optimizer, and what the optimizer makes between its
    calls of the closure is the optimizer's (it was all the optimizer's temporaries, or the optimizer's direction
    vectors counted as kept for the next backward)."""
    module = mlp()
    model = minidp.DataParallel(module, cpu_ids(replicas)) if replicas else module
    optimizer = torch.optim.LBFGS(module.parameters(), max_iter=3)
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    target = torch.zeros(8, O, dtype=torch.float64)
    criterion = nn.MSELoss()  # a loss module: what it keeps is the loss, not activations (LBFGS keeps a loss or two)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = criterion(model(x), target)
        loss.backward()
        return loss

    optimizer.step(closure)
    with minidp.trace(ledger=True) as alone:
        closure()
    with minidp.trace(ledger=True) as stepped:
        optimizer.step(closure)
    assert row(stepped.ledger()).held["activations"] == row(alone.ledger()).held["activations"] > 0
    assert row(stepped.ledger()).held["optimizer state"] > 0


class _LearnedStep(torch.optim.Optimizer):
    """An optimizer whose step runs a module of its own on each gradient (``through_module``; else the same
    arithmetic written out), and keeps the last update, outside its state, until the next step."""

    def __init__(self, parameters: Any, through_module: bool) -> None:
        super().__init__(parameters, {})
        self.net, self.through_module, self.last_update = nn.Linear(1, 1).double(), through_module, {}

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for parameter in self.param_groups[0]["params"]:
            flat = parameter.grad.reshape(-1, 1)
            update = self.net(flat) if self.through_module else flat * self.net.weight[0, 0] + self.net.bias[0]
            self.last_update[parameter] = update.reshape(parameter.shape) * 1e-3
            parameter.sub_(self.last_update[parameter])


def test_a_module_an_optimizer_runs_in_its_step_is_the_optimizers_work(generator):
    """A module's forward ends the phase of an optimizer step that raised, and only of one that is no longer running:
    a learned optimizer's module, run inside its step, ended it, and what the step kept until after the next backward
    counted as activations."""
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    held = {}
    for through_module in (False, True):
        torch.manual_seed(0)
        module = mlp()
        optimizer = _LearnedStep(module.parameters(), through_module)
        with minidp.trace(ledger=True) as traced:
            for _ in range(2):
                optimizer.zero_grad()
                module(x).pow(2).sum().backward()
                optimizer.step()
        held[through_module] = row(traced.ledger()).held
    assert held[True]["activations"] == held[False]["activations"] > 0


def test_a_step_whose_first_argument_is_no_closure_gets_it_as_given():
    """The ledger hands on a closure wrapped, so that it runs outside the optimizer's phase: only a step that takes a
    closure first (``step(self, closure=None)``, torch's) gets one; another callable first argument passes as given."""

    class TakesTheModel(torch.optim.SGD):
        def step(self, model: Any = None) -> None:  # a step that reads the model, not a closure
            assert model is None or isinstance(model, nn.Module), type(model)
            super().step()

    module = nn.Linear(4, 2)
    optimizer = TakesTheModel(module.parameters(), lr=0.1)
    module(torch.ones(1, 4)).sum().backward()
    with minidp.trace(ledger=True):
        optimizer.step(module)


def test_an_optimizer_stepping_in_a_post_accumulate_grad_hook_is_counted(generator):
    """torch's "optimizer in backward" pattern: a hook steps and lets go of each ``.grad`` as it is made, before the
    ledger's own hook names it (which then found ``None`` and raised)."""
    module = mlp()
    optimizers = {p: torch.optim.SGD([p], lr=0.01) for p in module.parameters()}

    def step_in_backward(parameter: torch.Tensor) -> None:
        optimizers[parameter].step()
        optimizers[parameter].zero_grad()

    for parameter in module.parameters():
        parameter.register_post_accumulate_grad_hook(step_in_backward)
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    with minidp.trace(ledger=True) as traced:
        module(x).pow(2).sum().backward()
    assert all(p.grad is None for p in module.parameters())
    assert row(traced.ledger()).held["gradients"] > 0


def test_a_module_that_defines_its_own_parameters_method_or_makes_them_lazily_is_counted(generator):
    """The ledger names a module's parameters from its own registries when its forward ends: a module whose
    ``parameters()`` takes no ``recurse`` (a wrapper's idiom) raised a TypeError, and a lazy module's uninitialized
    parameters, read before its own pre-hook made them, a ValueError."""

    class OwnParameters(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = mlp()

        def parameters(self):  # noqa: ANN201  (the idiom: no recurse argument)
            return self.inner.parameters()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    for model in (OwnParameters(), nn.Sequential(nn.LazyLinear(H, dtype=torch.float64), nn.ReLU(), nn.Linear(H, O).double())):
        with minidp.trace(ledger=True) as traced:
            model(x).pow(2).sum().backward()
        assert row(traced.ledger()).held["parameters"] == parameter_bytes(model)


@pytest.mark.parametrize("replicas", [0, 2], ids=["plain_model", "two_replicas"])
def test_an_optimizer_step_that_raised_leaves_the_next_steps_named_as_before(generator, replicas):
    """An optimizer step that raises never reaches the hook that ends its phase: the model's next call (a stage, or a
    module's forward) ends it, so the steps after it keep their activations and loss (they were the optimizer's
    temporaries)."""
    module = mlp()
    model = minidp.DataParallel(module, cpu_ids(replicas)) if replicas else module
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)

    def failing_closure() -> None:
        raise FloatingPointError("the loss is not finite: this step is skipped")

    def step() -> None:
        optimizer.zero_grad()
        model(x).pow(2).sum().backward()
        optimizer.step()

    step()
    held = {}
    for fails in (False, True):
        with minidp.trace(ledger=True) as traced:
            if fails:
                with pytest.raises(FloatingPointError):
                    optimizer.step(failing_closure)
            step()
        held[fails] = row(traced.ledger()).held
    assert (held[True]["activations"], held[True]["loss"]) == (held[False]["activations"], held[False]["loss"])
    assert held[True]["activations"] > 0


class _Tutorial(nn.Module):
    """The tutorial's pattern: layers the model runs itself, and ``data_parallel`` over a block, in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(D, H), nn.ReLU()).double()
        self.block = nn.Linear(H, O).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return minidp.data_parallel(self.block, self.first(x), cpu_ids(2))


def test_the_layers_a_model_runs_around_data_parallel_are_named_as_the_models(generator):
    """With ``data_parallel`` inside a model's forward and no optimizer in the block, the layers the model runs itself
    were named by the thread alone: their parameters as inputs, their ``.grad`` as temporaries, and what they keep
    for the backward (the ReLU's output, which the block's chunks are cut from) as the loss or the inputs."""
    model = _Tutorial()
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    model.zero_grad()
    with minidp.trace(ledger=True) as traced:
        model(x).pow(2).sum().backward()
    device = row(traced.ledger())
    first, block = parameter_bytes(model.first), parameter_bytes(model.block)
    assert device.held["parameters"] == first + block
    assert device.held["activations"] == 8 * H * BYTES + kept_output_bytes(8)
    # every .grad the step made, at its end (and more where the replicas' gradients are still held beside them)
    assert device.held["gradients"] >= first + block
    # and only the batch and replica 1's copy of its chunk are inputs
    assert device.held["inputs"] == 8 * D * BYTES + 4 * H * BYTES


def test_under_the_ledger_compiled_code_runs_as_eager_code(generator):
    """README, "The memory ledger": torch's compiler steps aside while a ``TorchDispatchMode`` is active, so under the
    ledger a ``@torch.compile``d forward runs as eager code, counted as the eager module's; a plain trace leaves it
    compiled."""
    torch._dynamo.reset()  # the forward's code is compiled afresh, with this run's backend, in each parametrization
    runs = []

    def counting_backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> Any:
        def run(*args: Any) -> Any:
            runs.append(threading.current_thread().name)
            return graph_module(*args)

        return run

    class Compiled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = mlp()

        @torch.compile(backend=counting_backend)
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    model = minidp.DataParallel(Compiled(), cpu_ids(2))
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    with minidp.trace():
        model(x).pow(2).sum().backward()
    compiled_runs = len(runs)
    with minidp.trace(ledger=True) as traced:
        model(x).pow(2).sum().backward()
    assert compiled_runs >= 4 and len(runs) == compiled_runs  # both replicas, twice; then none
    assert row(traced.ledger()).held["activations"] == 8 * H * BYTES + kept_output_bytes(8)


def test_a_sparse_tensor_is_freed_with_its_indices_and_values():
    identity = torch.eye(8, dtype=torch.float64)

    def step() -> None:
        for _ in range(2):
            sparse = identity.to_sparse()  # 8 values: 2 x 8 int64 indices and 8 float64 values
            del sparse

    _, (device,) = measure_step(step)
    assert device.held["temporaries"] == 2 * 8 * 8 + 8 * 8  # the first freed before the second was made


def test_the_ledger_table_names_every_category_and_the_replicas(generator):
    module = mlp()
    model = minidp.DataParallel(module, cpu_ids(2))
    with minidp.trace(ledger=True) as traced:
        model(torch.randn(8, D, generator=generator, dtype=torch.float64)).pow(2).sum().backward()
    table = traced.ledger_table()
    assert all(category in table for category in CATEGORIES)
    assert "cpu replica 0" in table and "cpu replica 1" in table


def test_on_one_device_the_module_running_itself_is_the_model(generator):
    """With one device id the module itself runs (docs/stock-behaviour.md B9): nothing is replicated or gathered,
    and its parameters, what its forward keeps (the ReLU's output, and the output the loss keeps) and its gradients
    are still named, as replica 0's where a replica made them."""
    module = mlp()
    model = minidp.DataParallel(module, ["cpu"])
    x = torch.randn(8, D, generator=generator, dtype=torch.float64)
    with minidp.trace(ledger=True) as traced:
        model(x).pow(2).sum().backward()
    P = parameter_bytes(module)
    device, replica = row(traced.ledger()), row(traced.ledger(), replica=0)
    assert (device.held["parameters"], device.held["gradients"]) == (P, P)
    assert device.held["inputs"] == 8 * D * BYTES
    assert device.held["activations"] == replica.held["activations"] == 8 * H * BYTES + 8 * O * BYTES
    assert device.held["gathered outputs"] == 0


@pytest.mark.cuda
@requires_cuda
def test_on_a_gpu_the_allocators_peak_is_shown_beside_the_ledger(generator):
    module = mlp().cuda()
    model = minidp.DataParallel(module, [0])
    x = torch.randn(8, D, generator=generator, dtype=torch.float64).cuda()
    with minidp.trace(ledger=True) as traced:
        model(x).pow(2).sum().backward()
    gpu = row(traced.ledger(), "cuda:0")
    assert gpu.allocator_peak is not None and gpu.allocator_peak > 0
    assert gpu.held["activations"] == 8 * H * BYTES + 8 * O * BYTES  # as on the CPU, one device (the test above)
    assert gpu.held["gradients"] >= parameter_bytes(module)
