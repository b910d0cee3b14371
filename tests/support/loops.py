"""One model, one data set, five training loops: plain PyTorch, Lightning Fabric, the Hugging
Face ``Trainer``, the Lightning ``Trainer`` and ``LightningCLI``. Each runner trains the same
tiny GPT-2 (built from a config, seeded) on the same batch with plain SGD and returns every read
it logged, as ``{step: {key: value}}`` with the keys spelled as on the bare model.

The model's block-1 MLP branch cancels part of the stream from the first step
(``f(x) = mlp(ln_2(x)) - 0.95 x P``, ``P`` a rank-4 projector, as ``examples/collapse_alert.py``
does to its GPT): every loop must alert at its first read.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402

VOCAB, SEQ, BATCH, WIDTH = 64, 18, 8, 32  # 136 real rows a step: N/d = 4.25, enough to decide
LR = 0.05
STEPS = 5
EVERY = 2
# the optimiser steps each family logs a read at: sign-magnitude after steps 1 (the baseline
# window is step 0), 2 and 4; dead-direction after 2 and 4 (its residual discovery watches
# step 0's training forward, so its baseline window is step 1)
READ_STEPS = {"dd": [2, 4], "sm": [1, 2, 4]}
CANCEL_LAYER, CANCEL_STRENGTH = 1, 0.95
#: the engine's options in every loop; MONITOR_ARGS: the Lightning monitors' flat arguments
ENGINE_ARGS: dict[str, Any] = dict(
    every_n_steps=EVERY, alerts=(), overhead_warn=None, verbose=False
)
MONITOR_ARGS: dict[str, Any] = dict(ENGINE_ARGS, rows_per_read="all")


def dd_config() -> Any:
    """The dead-direction options of every loop (every row read)."""
    from normscope import DeadDirectionConfig

    return DeadDirectionConfig(rows_per_read="all")


def gpt2(seed: int = 0, cancel: bool = True) -> transformers.GPT2LMHeadModel:
    """The tiny GPT-2, at the same random init for the same seed; with the cancelling branch."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=WIDTH,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    if cancel:
        cancel_branch(model, CANCEL_LAYER, CANCEL_STRENGTH)
    return model


def llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    """A tiny Llama (RMSNorm, ``nn.Linear`` projections), the sign-magnitude family's model in
    these loops (GPT-2's ``Conv1D`` projections are read too: tests/families)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def model_for(family: str, seed: int = 0) -> nn.Module:
    """The dead-direction loops train the GPT-2 with its cancelling branch; the sign-magnitude
    loops the Llama."""
    return gpt2(seed) if family == "dd" else llama(seed)


def cancel_branch(model: nn.Module, layer: int, strength: float, rank: int = 4) -> None:
    """Make block ``layer``'s MLP branch subtract ``strength`` times the stream's projection on
    ``rank`` fixed random directions (hooks: the stream is ``ln_2``'s input)."""
    block = model.transformer.h[layer]
    g = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(WIDTH, rank, generator=g))
    proj = q @ q.T
    seen: dict[str, torch.Tensor] = {}

    def keep_stream(module, args):
        seen["x"] = args[0]

    def cancel(module, args, out):
        return out - strength * (seen["x"] @ proj.to(out))

    block.ln_2.register_forward_pre_hook(keep_stream)
    block.mlp.register_forward_hook(cancel)


class Samples(Dataset):
    """``BATCH`` fixed samples (one batch: every step sees the same rows in every loop), the
    last two with padding (``attention_mask`` 0, labels -100)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        self.mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        self.mask[-2:, SEQ - 4 :] = 0
        self.labels = self.ids.masked_fill(self.mask == 0, -100)

    def __len__(self) -> int:
        return BATCH

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def loader() -> DataLoader:
    return DataLoader(Samples(), batch_size=BATCH, shuffle=False)


RUN_KEY = {"dd": "dd/sigma_min_ratio_min", "sm": "sm/sign_alignment_mean"}


def family_only(metrics: dict[str, Any], family: str, prefix: str = "") -> dict[str, float]:
    """The ``<family>/`` keys of a logged row, with a wrapper's module prefix removed."""
    out = {}
    head = f"{family}/"
    for key, value in metrics.items():
        if key.startswith(head):
            if prefix and key.startswith(head + prefix):
                key = head + key[len(head) + len(prefix) :]
            out[key] = float(value)
    return out


def same_float(a: float, b: float) -> bool:
    """Bit-for-bit equality that counts NaN (a read with a reason) as equal to NaN."""
    return a == b or (math.isnan(a) and math.isnan(b))


def same_reads(a: dict[int, dict[str, float]], b: dict[int, dict[str, float]]) -> bool:
    """Two ``{step: {key: value}}`` logs equal key for key and bit for bit (NaN == NaN)."""
    return a.keys() == b.keys() and all(
        a[s].keys() == b[s].keys() and all(same_float(a[s][k], b[s][k]) for k in a[s]) for s in a
    )


def monitor_cls(family: str) -> type:
    from normscope import DeadDirectionMonitor, SignMagnitudeMonitor

    return {"dd": DeadDirectionMonitor, "sm": SignMagnitudeMonitor}[family]


def monitor_args(family: str) -> dict[str, Any]:
    args = dict(MONITOR_ARGS)
    if family == "sm":
        args.pop("rows_per_read")
    return args


# --------------------------------------------------------------------------- plain PyTorch
def run_plain(family: str = "dd") -> tuple[dict[int, dict[str, float]], list[Any]]:
    """``monitor.step(batch)`` (the engine, no adapter) around each optimiser step, ``log=`` a
    function."""
    from normscope import Monitor, SignMagnitudeConfig

    model = model_for(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    reads: dict[int, dict[str, float]] = {}
    log = lambda m, step: reads.__setitem__(step, family_only(m, family))  # noqa: E731
    if family == "dd":
        monitor = Monitor.of(dd_config(), model, log=log, **ENGINE_ARGS)
    else:
        monitor = Monitor.of(SignMagnitudeConfig(), model, log=log, **monitor_args(family))
    alerts: list[Any] = []
    for _, batch in zip(range(STEPS), _repeat(loader())):
        with monitor.step(batch) as result:
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        alerts += result.alerts
    monitor.close()
    return reads, alerts


def _repeat(dl: DataLoader):
    while True:
        yield from dl


# --------------------------------------------------------------------------- Fabric
def run_fabric(tmp: Path, family: str = "dd") -> tuple[dict[int, dict[str, float]], list[Any]]:
    """``Fabric(callbacks=[monitor])``, the hooks called as the Lightning signatures say, a
    Fabric CSV logger (what ``fabric.log_dict`` writes to)."""
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import CSVLogger

    from normscope.runs import read_csv_run

    monitor = monitor_cls(family)(**monitor_args(family))
    fabric = Fabric(
        accelerator="cpu", devices=1, callbacks=[monitor], loggers=CSVLogger(tmp, name="fabric")
    )
    model = model_for(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer = fabric.setup(model, optimizer)
    dl = fabric.setup_dataloaders(loader())
    for i, batch in zip(range(STEPS), _repeat(dl)):
        fabric.call("on_train_batch_start", fabric, model, batch, i)
        loss = model(**batch).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.call("on_train_batch_end", fabric, model, loss, batch, i)
    fabric.call("on_fit_end", fabric, model)
    fabric.logger.finalize("success")
    run = read_csv_run(tmp / "fabric")
    reads = {int(r["step"]): family_only(r, family) for r in run.history if RUN_KEY[family] in r}
    assert not monitor.disabled, monitor.failure
    return reads, list(monitor.alerts_fired)


# --------------------------------------------------------------------------- HF Trainer
def run_hf(
    tmp: Path, family: str = "dd", report_to: str = "tensorboard", **extra: Any
) -> tuple[dict[int, dict[str, float]], Any]:
    """A real ``transformers.Trainer`` (plain SGD, constant learning rate, no clipping)."""
    from normscope.adapters.transformers import DeadDirectionCallback, SignMagnitudeCallback

    if family == "dd":
        callback = DeadDirectionCallback(dd_config(), **ENGINE_ARGS, **extra)
    else:
        callback = SignMagnitudeCallback(**{**monitor_args(family), **extra})
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "hf"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        weight_decay=0.0,
        logging_steps=1000,
        save_strategy="no",
        report_to=report_to,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model_for(family), args=args, train_dataset=Samples(), callbacks=[callback]
    )
    # The model's own mean loss, as the other loops take it (HF would otherwise divide the summed
    # loss by its count of unshifted labels, a different scale: different SGD steps)
    callback.bind(trainer)
    trainer.model_accepts_loss_kwargs = False
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # no console rows
    trainer.train()
    reads = {
        int(row["step"]): family_only(row, family)
        for row in trainer.state.log_history
        if RUN_KEY[family] in row
    }
    return reads, (trainer, callback)


# --------------------------------------------------------------------------- Lightning
class LitGPT2(L.LightningModule):
    """The tiny GPT-2 as a LightningModule (``self.model``: keys ``dd/model.<path>/...``)."""

    def __init__(self, lr: float = LR, seed: int = 0, family: str = "dd") -> None:
        super().__init__()
        self.lr = lr
        self.model = model_for(family, seed)

    def forward(self, **batch: torch.Tensor) -> Any:
        return self.model(**batch)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class SamplesData(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return loader()


def run_lightning(tmp: Path, family: str = "dd") -> tuple[dict[int, dict[str, float]], list[Any]]:
    from lightning.pytorch.loggers import CSVLogger

    monitor = monitor_cls(family)(**monitor_args(family))
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        callbacks=[monitor],
        logger=CSVLogger(tmp, name="lightning"),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(LitGPT2(family=family), datamodule=SamplesData())
    return _csv_reads(tmp / "lightning", family), list(monitor.alerts_fired)


def _csv_reads(folder: Path, family: str = "dd") -> dict[int, dict[str, float]]:
    from normscope.runs import read_csv_run

    run = read_csv_run(folder)
    return {
        int(r["step"]): family_only(r, family, "model.")
        for r in run.history
        if RUN_KEY[family] in r
    }


CLI_YAML = f"""\
seed_everything: 0
trainer:
  max_steps: {STEPS}
  accelerator: cpu
  devices: 1
  enable_progress_bar: false
  enable_model_summary: false
  enable_checkpointing: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args:
      save_dir: SAVE_DIR
      name: cli
  callbacks:
    - class_path: normscope.DeadDirectionMonitor
      init_args:
        every_n_steps: {EVERY}
        rows_per_read: all
        alerts: []
        overhead_warn: null
        verbose: false
"""


def run_cli(tmp: Path, *, yaml_callback: bool) -> tuple[dict[int, dict[str, float]], Any]:
    """``LightningCLI`` from a YAML config: the monitor as a ``class_path`` entry, or (when
    ``yaml_callback`` is False) added with ``--trainer.callbacks+=`` on the command line."""
    from lightning.pytorch.cli import LightningCLI

    text = CLI_YAML.replace("SAVE_DIR", str(tmp))
    argv = ["fit", "--config", str(tmp / "config.yaml")]
    if not yaml_callback:
        text = text[: text.index("  callbacks:")]
        argv += [
            "--trainer.callbacks+=normscope.DeadDirectionMonitor",
            f"--trainer.callbacks.every_n_steps={EVERY}",
            "--trainer.callbacks.rows_per_read=all",
            "--trainer.callbacks.alerts=[]",
            "--trainer.callbacks.overhead_warn=null",
            "--trainer.callbacks.verbose=false",
        ]
    (tmp / "config.yaml").write_text(text)
    cli = LightningCLI(
        LitGPT2,
        SamplesData,
        args=argv,
        save_config_callback=None,
        parser_kwargs={"exit_on_error": False},
    )
    return _csv_reads(tmp / "cli"), cli
