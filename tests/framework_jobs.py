"""Training jobs of real frameworks, each run twice under torchrun: with torch DDP (or FSDP2's ``fully_shard``), and
with ``minidp.distributed.DistributedDataParallel`` (or minidp's ``fully_shard``) in its place.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m tests.framework_jobs JOB WRAPPER OUT

``JOB``: one of :data:`JOBS`; ``WRAPPER``: ``torch`` or ``minidp``; every rank writes
``OUT/rank<r>.pt``: the class that wrapped the model, the loss of every forward, and the parameters
and buffers after training. ``tests/test_frameworks.py`` compares the two runs bitwise.

The swap: the frameworks construct ``torch.nn.parallel.DistributedDataParallel`` by that name
(accelerate, hence Hugging Face's ``Trainer``, and ignite look it up on ``torch.nn.parallel`` when
they wrap; Lightning imports it from ``torch.nn.parallel.distributed`` when it is imported, and
checks ``isinstance`` against it). :func:`swap_in_minidp` rebinds both names to minidp's class
before any framework is imported, so every construction and every ``isinstance`` check sees it.
Lightning's ``ModelParallelStrategy`` leaves ``fully_shard`` to the user's code (:func:`shard_blocks`), which
imports it from ``torch.distributed.fsdp``, where the swap puts minidp's; Lightning itself finds the sharded
modules by ``isinstance(module, FSDPModule)``. Everything else is the framework's own code.
"""

import importlib
import os
import sys
import tempfile
from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


def swap_in_minidp() -> None:
    """Put minidp's DistributedDataParallel where frameworks look for torch's, and minidp's ``fully_shard`` and
    ``replicate`` where the user's parallelisation (:func:`shard_blocks`, :func:`replicate_model`) imports torch's
    from: call it first."""
    import torch.distributed.fsdp
    import torch.nn.parallel.distributed

    import minidp.distributed

    torch.nn.parallel.DistributedDataParallel = minidp.distributed.DistributedDataParallel
    torch.nn.parallel.distributed.DistributedDataParallel = minidp.distributed.DistributedDataParallel
    torch.distributed.fsdp.fully_shard = minidp.distributed.fully_shard
    # (the package binds the name replicate to the function, which hides the module of the same name)
    importlib.import_module("torch.distributed._composable.replicate").replicate = minidp.distributed.replicate


class Regression(Dataset):
    """64 fixed samples: 8 features, one target; ``as_dict`` for Hugging Face's collator."""

    def __init__(self, as_dict: bool = False, n: int = 64) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = self.x @ torch.randn(8, 1, generator=generator) + 0.1 * torch.randn(n, 1, generator=generator)
        self.as_dict = as_dict

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        return {"x": self.x[i], "labels": self.y[i]} if self.as_dict else (self.x[i], self.y[i])


def mlp(batch_norm: bool = False) -> nn.Sequential:
    torch.manual_seed(0)  # every rank alike, as the frameworks' seeding does
    return nn.Sequential(nn.Linear(8, 16), *([nn.BatchNorm1d(16)] if batch_norm else []), nn.Tanh(), nn.Linear(16, 1))


class HFRegressor(nn.Module):
    """A model as ``Trainer`` takes it: keyword inputs, a dict with the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.net(x)
        return {"loss": nn.functional.mse_loss(logits, labels), "logits": logits}


def trainer_job(out: dict) -> None:
    """Hugging Face ``Trainer`` (through accelerate), 2 micro-batches accumulated per step."""
    from transformers import Trainer, TrainingArguments

    losses = out["losses"]

    class RecordingTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            result = super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)
            losses.append((result[0] if return_outputs else result).detach().clone())
            return result

    with tempfile.TemporaryDirectory() as directory:
        args = TrainingArguments(
            output_dir=directory, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
            learning_rate=0.05, lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
            use_cpu=True, seed=0, dataloader_num_workers=0, ddp_backend="gloo", disable_tqdm=True,
        )
        trainer = RecordingTrainer(model=HFRegressor(), args=args, train_dataset=Regression(as_dict=True))
        trainer.train()
    out["wrapper"] = type(trainer.model_wrapped)
    out["module"] = trainer.model


def accelerate_job(out: dict) -> None:
    """accelerate's own loop: ``accumulate`` (no_sync on the first micro-batch), then ``no_sync`` with
    ``trigger_sync_in_backward``, with the FP16 compression hook."""
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import DDPCommunicationHookType

    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=2,
        kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)],
    )
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(Regression(), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = list(loader)

    def loss_of(batch):
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        out["losses"].append(loss.detach().clone())
        return loss

    for batch in batches[:4]:
        with accelerator.accumulate(model):
            accelerator.backward(loss_of(batch))
            optimizer.step()
            optimizer.zero_grad()
    for first, second in zip(batches[4::2], batches[5::2]):
        with accelerator.no_sync(model):
            accelerator.backward(loss_of(first))  # accumulated locally
            loss = loss_of(second)
        with accelerator.trigger_sync_in_backward(model):
            accelerator.backward(loss)  # the sum of both reduced here
        optimizer.step()
        optimizer.zero_grad()
    out["wrapper"] = type(model)
    out["module"] = accelerator.unwrap_model(model)


def _recording_module(out: dict) -> type:
    """A ``LightningModule`` of ``self.net`` whose every forward's MSE loss, training and validation, is recorded."""
    import pytorch_lightning as pl

    class Recording(pl.LightningModule):
        def loss_of(self, batch: tuple) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            out["losses"].append(loss.detach().clone())
            return loss

        def validation_step(self, batch, index):
            self.log("val_loss", self.loss_of(batch), sync_dist=True)

    return Recording


# Lightning's Trainer as the jobs run it: validation on 2 batches, nothing written but what a job asks for
QUIET_TRAINER = dict(limit_val_batches=2, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, deterministic=True)


def _fit(module: Any, trainer: Any) -> None:
    trainer.fit(module, DataLoader(Regression(), batch_size=4), DataLoader(Regression(n=16), batch_size=4))


def _lightning_job(out: dict, manual: bool) -> None:
    import pytorch_lightning as pl

    class Module(_recording_module(out)):
        """BatchNorm (buffers broadcast from rank 0), validation after every 2 steps."""

        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(batch_norm=True)
            self.automatic_optimization = not manual

        def training_step(self, batch, index):
            out["wrapper"] = type(self.trainer.strategy.model)  # teardown unwraps it: look while training
            loss = self.loss_of(batch)
            if manual:  # two micro-batches accumulated per step, no_sync on the first (Lightning's docs)
                optimizer = self.optimizers()
                last = (index + 1) % 2 == 0
                with self.trainer.strategy.block_backward_sync() if not last else nullcontext():
                    self.manual_backward(loss)
                if last:
                    optimizer.step()
                    optimizer.zero_grad()
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    module = Module()
    _fit(module, pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4 if not manual else 8,
                            accumulate_grad_batches=1 if manual else 2, val_check_interval=2 if manual else 4,
                            **QUIET_TRAINER))
    out["module"] = module


def lightning_auto_job(out: dict) -> None:
    """PyTorch Lightning ``strategy="ddp"``, automatic optimization, 2 batches accumulated, validation."""
    _lightning_job(out, manual=False)


def lightning_manual_job(out: dict) -> None:
    """PyTorch Lightning ``strategy="ddp"``, manual optimization with ``manual_backward``."""
    _lightning_job(out, manual=True)


def _fabric_steps(fabric: Any, model: nn.Module, optimizer: Any, batches: list, out: dict) -> None:
    """Fabric's gradient accumulation: ``batches`` (index, batch) in pairs, the even one's backward under
    ``no_backward_sync``, a step after the odd one's; every loss recorded."""
    for index, (x, y) in batches:
        accumulating = index % 2 == 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = nn.functional.mse_loss(model(x), y)
            out["losses"].append(loss.detach().clone())
            fabric.backward(loss)
        if not accumulating:
            optimizer.step()
            optimizer.zero_grad()


def fabric_ddp_job(out: dict) -> None:
    """Lightning Fabric ``strategy="ddp"``: 2 micro-batches accumulated under ``no_backward_sync`` (``no_sync``),
    SGD with momentum, ``fabric.save`` of the model and optimizer after 2 steps; after the 4th, ``fabric.load`` of
    that checkpoint into the same objects, and the last 2 steps again."""
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    model = fabric.setup_module(mlp(batch_norm=True))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(Regression(), batch_size=4))
    checkpoint = os.path.join(out["directory"], "checkpoint.ckpt")
    batches = list(enumerate(loader))
    _fabric_steps(fabric, model, optimizer, batches[:4], out)
    fabric.save(checkpoint, {"model": model, "optimizer": optimizer})
    _fabric_steps(fabric, model, optimizer, batches[4:], out)
    fabric.load(checkpoint, {"model": model, "optimizer": optimizer})  # back to the state after step 2
    _fabric_steps(fabric, model, optimizer, batches[4:], out)
    out["wrapper"] = type(model._forward_module)
    out["module"] = model.module


def shard_blocks(model: nn.Module, mesh: Any) -> nn.Module:
    """The user's parallelisation, as Lightning's docs write it: ``fully_shard`` on each block, then on the root
    (found where :func:`swap_in_minidp` may have put minidp's)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def replicate_model(model: nn.Module, mesh: Any) -> nn.Module:
    """The user's parallelisation as torchtitan writes data parallelism: the composable ``replicate`` on the data
    parallel mesh (found where :func:`swap_in_minidp` may have put minidp's)."""
    from torch.distributed._composable.replicate import replicate

    return replicate(model, device_mesh=mesh["data_parallel"], bucket_cap_mb=0.001)


class Blocks(nn.Module):
    """Two sharded blocks and a head: three groups."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # every rank alike, as fully_shard requires
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Sequential(nn.Linear(16, 16), nn.Tanh())])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def full_state(model: nn.Module) -> dict:
    """The whole parameters and buffers of a sharded model, gathered on every rank (as both libraries give them)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def lightning_fsdp2_job(out: dict) -> None:
    """PyTorch Lightning ``ModelParallelStrategy`` (FSDP2), ``fully_shard`` in ``configure_model``, AdamW, 2 batches
    accumulated, validation, and the distributed checkpoint Lightning saves at the end."""
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import ModelParallelStrategy

    class Module(_recording_module(out)):
        def __init__(self) -> None:
            super().__init__()
            self.net = Blocks()

        def configure_model(self) -> None:
            shard_blocks(self.net, self.device_mesh["data_parallel"])

        def training_step(self, batch, index):
            out["wrapper"] = type(self.net)
            return self.loss_of(batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=2,
                         strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                         max_steps=4, accumulate_grad_batches=2, val_check_interval=4, **QUIET_TRAINER)
    _fit(module, trainer)
    out["checkpoint"] = os.path.join(out["directory"], "checkpoint")
    trainer.save_checkpoint(out["checkpoint"])
    out["state"] = full_state(module.net)


def _fabric_model_parallel(parallelize: Callable[[nn.Module, Any], nn.Module], out: dict) -> nn.Module:
    """Lightning Fabric ``ModelParallelStrategy(parallelize)`` on 2 ranks (data parallel 2, tensor parallel 1):
    :class:`Blocks` set up with AdamW, trained by :func:`_fabric_steps`; the model Fabric parallelised."""
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import ModelParallelStrategy

    fabric = Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(parallelize, data_parallel_size=2,
                                                                                   tensor_parallel_size=1))
    fabric.launch()
    model = fabric.setup_module(Blocks())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
    loader = fabric.setup_dataloaders(DataLoader(Regression(), batch_size=4))
    _fabric_steps(fabric, model, optimizer, list(enumerate(loader)), out)
    out["wrapper"] = type(model.module)
    return model.module


def fabric_fsdp2_job(out: dict) -> None:
    """Lightning Fabric ``ModelParallelStrategy`` (FSDP2) with a ``parallelize_fn``, 2 micro-batches accumulated under
    ``no_backward_sync`` (which switches the sync off on each ``FSDPModule``), AdamW."""
    out["state"] = full_state(_fabric_model_parallel(shard_blocks, out))


def fabric_replicate_job(out: dict) -> None:
    """Lightning Fabric ``ModelParallelStrategy`` whose ``parallelize_fn`` applies the composable ``replicate``
    (torchtitan's data parallelism), small buckets, AdamW, 2 micro-batches a step (``no_backward_sync`` switches off
    FSDP2's modules only: both micro-batches are reduced)."""
    out["module"] = _fabric_model_parallel(replicate_model, out)


def ignite_job(out: dict) -> None:
    """ignite: ``idist.auto_model``, ``auto_optim``, ``auto_dataloader`` and a supervised trainer
    accumulating 2 micro-batches."""
    import ignite.distributed as idist
    from ignite.engine import Events, create_supervised_trainer

    idist.initialize("gloo")
    try:
        model = idist.auto_model(mlp())
        optimizer = idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        loader = idist.auto_dataloader(Regression(), batch_size=8, shuffle=False)  # 4 per rank
        trainer = create_supervised_trainer(model, optimizer, nn.functional.mse_loss, gradient_accumulation_steps=2)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: out["losses"].append(engine.state.output))
        trainer.run(loader, max_epochs=1)
        out["wrapper"] = type(model)
        out["module"] = model.module
        out["kept"] = model  # alive past finalize(), which destroys the group: see the end of main()
    finally:
        idist.finalize()


JOBS: dict[str, Callable[[dict], None]] = {
    "trainer": trainer_job,
    "accelerate": accelerate_job,
    "lightning_auto": lightning_auto_job,
    "lightning_manual": lightning_manual_job,
    "ignite": ignite_job,
    "fabric_ddp": fabric_ddp_job,
    "lightning_fsdp2": lightning_fsdp2_job,
    "fabric_fsdp2": fabric_fsdp2_job,
    "fabric_replicate": fabric_replicate_job,
}


def main(job: str, wrapper: str, directory: str) -> None:
    torch.set_num_threads(1)  # 2 processes share the cores; also one summation order per run
    if wrapper == "minidp":
        swap_in_minidp()
    elif wrapper != "torch":
        raise SystemExit(f"WRAPPER must be 'torch' or 'minidp', got {wrapper!r}")
    out: dict = {"losses": [], "directory": directory}
    JOBS[job](out)
    rank = int(os.environ["RANK"])
    module = out.get("module")
    state = out.get("state") or {name: t.detach().clone() for name, t in module.state_dict().items()}
    wrapper_class = out["wrapper"]
    result = {"wrapper": f"{wrapper_class.__module__}.{wrapper_class.__qualname__}",
              "losses": out["losses"], "state": state, "checkpoint": out.get("checkpoint"),
              "parameters": list(state) if module is None else [name for name, _ in module.named_parameters()]}
    torch.save(result, os.path.join(directory, f"rank{rank}.pt"))
    # Done: leave without freeing anything. Torch's ProcessGroupGloo destructor, run by the thread that frees the
    # last reference to a group (a DDP wrapper's reducer, freed once the group was destroyed; the group itself),
    # joins its worker thread while holding the GIL, and that thread may be freeing a finished work whose saved
    # thread-local state needs the GIL: a deadlock, seen with torch's own DDP under ignite (py-spy: the main
    # thread in ~ProcessGroupGloo -> std::thread::join, the worker in ~AsyncWork -> gil_scoped_acquire).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
