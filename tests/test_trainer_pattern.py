"""DataParallel called the way Hugging Face transformers' ``Trainer`` calls ``nn.DataParallel``.

With more than one GPU, ``Trainer`` wraps the model in ``nn.DataParallel`` and, in one step
(``transformers/trainer.py``: ``_get_num_items_in_batch``, ``compute_loss``, ``training_step``):

1. counts the labels a causal LM scores (``labels[..., 1:] != -100``), divides the count by
   ``n_gpu`` and, for a model that takes loss keywords, passes it as ``num_items_in_batch``: a
   tensor of shape ``(n_gpu, 1)``, so that scatter hands each replica one row;
2. calls ``model(input_ids=..., attention_mask=..., labels=..., num_items_in_batch=...)``;
3. takes ``outputs["loss"]`` from the returned ``ModelOutput`` (an ``OrderedDict`` subclass): the
   replicas' losses gathered along dim 0 (docs/stock-behaviour.md B28), a vector when each is
   0-dim (B30);
4. ``loss = loss.mean()`` and ``loss.backward()``.

A causal LM's loss is ``sum of token losses / num_items_in_batch``, so the mean over replicas is
the full batch's ``sum / count`` whatever the chunk sizes: DataParallel must give exactly the
single-device loss and gradients. Without ``num_items_in_batch`` each replica averages over its own
tokens, and the mean is the mean of the chunks' means (what stock computes too).

Each behaviour runs on a stand-in written for the test (an embedding and a linear LM head, returning
an ``OrderedDict`` output and, with ``use_cache``, a cache object that is neither a tensor nor a
container, as transformers' ``DynamicCache``) and, where transformers is installed, on a tiny
randomly initialised GPT-2; through stock ``nn.DataParallel`` (under the CPU emulation) to show
what Trainer gets, and through minidp.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import minidp

from .helpers import RTOL_FLOAT64, LayerCache, cpu_ids, max_relative_error
from .stock_emulation import emulated_stock

# replicas -> rows: 4 rows on 2 replicas (2, 2); 7 rows on 3 replicas (3, 3, 1: uneven)
ROWS = {2: 4, 3: 7}
TOKENS = 8


class LMOutput(OrderedDict):
    """What a transformers ``ModelOutput`` is to DataParallel: an ``OrderedDict`` whose keys are attributes too."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


class TinyCausalLM(nn.Module):
    """Embedding, tanh, linear LM head; the loss of a causal LM: position t predicts token t + 1."""

    def __init__(self, vocab: int = 50, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.Tensor] = None,
        num_items_in_batch: Optional[torch.Tensor] = None,
        use_cache: bool = False,
    ) -> LMOutput:
        hidden = self.embed(input_ids)
        if attention_mask is not None:
            hidden = hidden * attention_mask.unsqueeze(-1).to(hidden.dtype)
        hidden = torch.tanh(hidden)
        output = LMOutput(logits=self.head(hidden))
        if labels is not None:
            logits, targets = output["logits"][:, :-1].flatten(0, 1), labels[:, 1:].flatten()
            if num_items_in_batch is None:
                loss = F.cross_entropy(logits, targets, ignore_index=-100)  # 0-dim: the mean over this batch
            else:  # as transformers' fixed_cross_entropy: the sum over the count Trainer passed
                loss = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum") / num_items_in_batch
            output = LMOutput(loss=loss, **output)
        if use_cache:
            output["cache"] = LayerCache([(hidden, output["logits"])])
        return output


def causal_lm_batch(n_gpu: int, generator: torch.Generator, vocab: int) -> dict[str, torch.Tensor]:
    """``ROWS[n_gpu]`` rows of token ids, the end of row 0 padded (mask 0, label -100).

    The padding leaves a count of scored labels that ``n_gpu`` divides: Trainer's ``count // n_gpu``
    is exact only then (its approximation, not DataParallel's).
    """
    rows = ROWS[n_gpu]
    input_ids = torch.randint(0, vocab, (rows, TOKENS), generator=generator)
    attention_mask, labels = torch.ones_like(input_ids), input_ids.clone()
    padded = rows * (TOKENS - 1) % n_gpu or n_gpu
    attention_mask[0, -padded:] = 0
    labels[0, -padded:] = -100
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def trainer_num_items_in_batch(labels: torch.Tensor, n_gpu: int) -> torch.Tensor:
    """``Trainer._get_num_items_in_batch`` for nn.DataParallel: the scored labels // n_gpu, one row per GPU."""
    count = labels[..., 1:].ne(-100).sum() // n_gpu
    # Trainer then divides by the tensor-parallel size, which makes it a float32: float64 here, for exact comparisons
    return count.unsqueeze(0).expand(n_gpu, -1).to(torch.float64)


def trainer_step_loss(outputs: Any, n_gpu: int) -> torch.Tensor:
    """``Trainer.compute_loss``'s loss out of the outputs, then ``training_step``'s ``loss.mean()`` for ``n_gpu > 1``; backward done."""
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
    if n_gpu > 1:
        loss = loss.mean()
    loss.backward()
    return loss


def trainer_loss(model: nn.Module, inputs: dict[str, Any], n_gpu: int) -> torch.Tensor:
    """``model(**inputs)`` as ``Trainer.compute_loss`` calls it, then :func:`trainer_step_loss`."""
    return trainer_step_loss(model(**inputs), n_gpu)


def chunk_losses_mean(model: nn.Module, inputs: dict[str, Any], chunks: int, **options: Any) -> torch.Tensor:
    """On one device: the loss of each ``torch.chunk`` of the batch, as the replicas get them (B15), averaged; backward done."""
    pieces = zip(*(value.chunk(chunks) for value in inputs.values()))
    loss = torch.stack([model(**dict(zip(inputs, piece)), **options)["loss"] for piece in pieces]).mean()
    loss.backward()
    return loss


def assert_same_gradients(model: nn.Module, reference: nn.Module, rtol: float) -> None:
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        if expected.grad is None:
            assert param.grad is None, name
        else:
            assert max_relative_error(param.grad, expected.grad) <= rtol, name


def seeded(generator: torch.Generator, build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with its initial weights drawn from the test's seed, the global generator left as it was."""
    with torch.random.fork_rng(devices=[]):  # the CPU generator: the models are built there
        torch.manual_seed(generator.initial_seed())
        return build()


def tiny_lm(generator: torch.Generator) -> nn.Module:
    return seeded(generator, lambda: TinyCausalLM().double())


def tiny_gpt2(generator: torch.Generator) -> nn.Module:
    """A randomly initialised two-layer GPT-2 from transformers (nothing is downloaded); skips without it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=2 * TOKENS, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # Dropout draws differ between replicas and one device
    )
    return seeded(generator, lambda: transformers.GPT2LMHeadModel(config))


@dataclass
class LanguageModel:
    build: Callable[[torch.Generator], nn.Module]
    vocab: int
    rtol: float
    options: dict[str, Any] = field(default_factory=dict)  # Trainer's other keywords for this model


# transformers computes a causal LM's loss in float32 whatever the model's dtype (ForCausalLMLoss
# upcasts the logits), so GPT-2's numbers agree to float32 rounding.
MODELS = {
    "stand-in": LanguageModel(tiny_lm, 50, RTOL_FLOAT64),
    "gpt2": LanguageModel(tiny_gpt2, 100, 1e-5, {"use_cache": False}),
}


def stock_data_parallel(model: nn.Module, n_gpu: int) -> nn.Module:
    return nn.DataParallel(model, list(range(n_gpu)))  # inside emulated_stock(): ids 0.. stand for the CPU


def minidp_data_parallel(model: nn.Module, n_gpu: int) -> nn.Module:
    return minidp.DataParallel(model, cpu_ids(n_gpu))


# Stock ``nn.DataParallel`` under the CPU emulation (what Trainer gets), then minidp's.
WRAPPERS = pytest.mark.parametrize("wrap, context", [
    pytest.param(stock_data_parallel, emulated_stock, id="stock"),
    pytest.param(minidp_data_parallel, contextlib.nullcontext, id="minidp"),
])


@pytest.mark.parametrize("n_gpu", [2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_trainer_gets_a_vector_of_replica_losses_whose_mean_is_the_mean_of_the_chunk_losses(generator, name, n_gpu):
    lm = MODELS[name]
    model, inputs = lm.build(generator), causal_lm_batch(n_gpu, generator, lm.vocab)
    reference = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="all input tensors were scalars"):  # B30
        outputs = minidp_data_parallel(model, n_gpu)(**inputs, **lm.options)
    assert type(outputs) is type(reference(**inputs, **lm.options))  # B28: the type of the first replica's output
    assert outputs.loss.shape == (n_gpu,) and outputs.logits.shape == (ROWS[n_gpu], TOKENS, lm.vocab)
    loss = trainer_step_loss(outputs, n_gpu)
    expected = chunk_losses_mean(reference, inputs, n_gpu, **lm.options)
    assert max_relative_error(loss, expected) <= lm.rtol
    assert_same_gradients(model, reference, lm.rtol)


@WRAPPERS
@pytest.mark.parametrize("n_gpu", [2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_trainer_gets_the_full_batch_loss_with_num_items_in_batch_one_row_per_replica(generator, name, n_gpu, wrap, context):
    # ids cut into n_gpu chunks and num_items_in_batch into n_gpu rows: alike, so stock drops nothing (B14)
    lm = MODELS[name]
    model, inputs = lm.build(generator), {**causal_lm_batch(n_gpu, generator, lm.vocab), **lm.options}
    reference = copy.deepcopy(model)
    with context():
        loss = trainer_loss(wrap(model, n_gpu), {**inputs, "num_items_in_batch": trainer_num_items_in_batch(inputs["labels"], n_gpu)}, n_gpu)
    # one GPU: Trainer passes the whole count as a 0-dim tensor and takes the loss as it is
    expected = trainer_loss(reference, {**inputs, "num_items_in_batch": trainer_num_items_in_batch(inputs["labels"], 1)[0, 0]}, 1)
    assert max_relative_error(loss, expected) <= lm.rtol
    assert_same_gradients(model, reference, lm.rtol)


@WRAPPERS
@pytest.mark.parametrize("n_gpu", [2, 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_trainer_use_cache_gathers_one_cache_object_equal_to_the_full_batch(generator, name, n_gpu, wrap, context):
    # B28: an object that is neither a tensor nor a container is rebuilt as type(out)(map(gather_map, zip(*outputs)))
    lm = MODELS[name]
    model, inputs = lm.build(generator), causal_lm_batch(n_gpu, generator, lm.vocab)
    del inputs["labels"]
    with torch.no_grad():
        with context():
            outputs = wrap(model, n_gpu)(**inputs, use_cache=True)
        expected = model(**inputs, use_cache=True)
    key = "past_key_values" if "past_key_values" in expected else "cache"  # transformers 4, and 5 and the stand-in
    cache, expected_cache = outputs[key], expected[key]
    assert type(cache) is type(expected_cache), f"gathered into a {type(cache).__name__}"
    for layer, expected_layer in zip(cache, expected_cache, strict=True):
        for tensor, expected_tensor in zip(layer, expected_layer, strict=True):
            if expected_tensor is None:  # DynamicCache's sliding-window slot
                assert tensor is None
            else:
                assert max_relative_error(tensor, expected_tensor) <= lm.rtol


def test_gpt2s_hidden_states_through_data_parallel_equal_its_own_once_it_captured_them_alone(generator):
    """README, "Swapping in": transformers 5 registers the hooks that capture hidden states at a model's first such
    forward, on itself; replicas share the original's hook dicts and lose the flag that says so, so a model wrapped
    before its first call gets them again from every replica. Called once alone first, it has them in place: through
    DataParallel its hidden states are then the model's own, as many as its layers and one."""
    model = tiny_gpt2(generator).eval()
    tokens = torch.randint(0, 100, (6, TOKENS), generator=generator)
    expected = copy.deepcopy(model)(tokens, output_hidden_states=True).hidden_states  # a copy's own first call
    model(tokens[:1], output_hidden_states=True)  # the hooks installed, once, on the original
    got = minidp.DataParallel(model, cpu_ids(2))(tokens, output_hidden_states=True).hidden_states
    assert len(got) == len(expected) == 3
    assert all(max_relative_error(g, e) <= 1e-5 for g, e in zip(got, expected))
    assert len(model(tokens, output_hidden_states=True).hidden_states) == 3  # the model alone: as before


def test_a_model_accelerate_prepared_for_mixed_precision_runs_its_patch_on_each_replica(generator):
    """``Accelerator(mixed_precision=...).prepare(model)`` patches the model's forward on the instance, bound to it
    (accelerate's ``prepare_model``: ``model.forward = MethodType(convert_outputs_to_fp32(...), model)``), and
    ``Trainer`` with several GPUs wraps that model in ``nn.DataParallel``. Stock's replicas share the bound call and
    run the original (docs/stock-behaviour.md B38: under the emulation its BatchNorm counts both chunks); minidp's run
    the patch each on its own replica: outputs as the unpatched model's chunk by chunk under the same autocast, the
    statistics of chunk 0 alone."""
    accelerate = pytest.importorskip("accelerate")
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))
    chunks = [copy.deepcopy(model) for _ in range(2)]
    stock_model = copy.deepcopy(model)
    for module in (model, stock_model):
        accelerate.Accelerator(mixed_precision="bf16", cpu=True).prepare(module)
    x = torch.randn(8, 4, generator=generator)
    output = minidp.DataParallel(model, cpu_ids(2))(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = torch.cat([replica(chunk) for replica, chunk in zip(chunks, x.chunk(2))]).float()
    assert torch.equal(output, expected)
    assert model[1].num_batches_tracked.item() == 1
    with emulated_stock():
        nn.DataParallel(stock_model, [0, 1])(x)
    assert stock_model[1].num_batches_tracked.item() == 2


def test_a_module_accelerate_hooks_runs_the_hook_on_each_replica(generator):
    """accelerate's ``add_hook_to_module`` (the hooks of ``device_map`` loading and offloading) sets ``module.forward =
    partial(new_forward, module)`` and keeps the module's own as ``module._old_forward``, a method bound to it, which
    ``new_forward`` calls. Both are bound to each replica: every chunk runs on its own replica (statistics from chunk 0
    alone), where stock's replicas all run the original's forward (docs/stock-behaviour.md B38)."""
    hooks = pytest.importorskip("accelerate.hooks")
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double()
    chunks = [copy.deepcopy(model) for _ in range(2)]
    hooks.add_hook_to_module(model, hooks.ModelHook())
    hooks.add_hook_to_module(model[1], hooks.ModelHook())
    x = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    output = minidp.DataParallel(model, cpu_ids(2))(x)
    expected = torch.cat([replica(chunk) for replica, chunk in zip(chunks, x.chunk(2))])
    assert max_relative_error(output, expected) <= RTOL_FLOAT64
    assert model[1].num_batches_tracked.item() == 1
