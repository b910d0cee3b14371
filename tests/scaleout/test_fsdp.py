"""FSDP2 and the strategies normscope refuses.

FSDP2 runs for real: Lightning's ``ModelParallelStrategy`` on 2 CPU processes (gloo), the model
built and sharded with ``fully_shard`` in ``configure_model`` (fit ``fsdp`` of
``tests/support/distributed_fits.py``). Lightning's ``FSDPStrategy`` (FSDP1) cannot run here:
Lightning refuses it on a CPU ("requires a GPU accelerator"); normscope refuses it too, at setup,
for its own reason (gamma lives in flat shards outside the forward), as it refuses DeepSpeed."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from normscope import DeadDirectionMonitor, SignMagnitudeMonitor
from normscope.adapters.lightning import check_strategy
from tests.support.distributed_fits import LitSharded
from tests.support.expected import single_process_reads
from tests.support.shards import LitDict
from tests.support.tiny_models import cpu_trainer


def test_fsdp2_reads_equal_the_single_process_reads(distributed_run):
    """Sharded parameters (each rank holds 8 of ln_f's 16 gammas), whole reads: with learning
    rate 0, every number equals a single-process tracker on both ranks' rows with the gathered
    weights, to 1e-10 (measured <= 5e-15, as under DDP)."""
    result = distributed_run["results"]["fsdp", 0]
    assert result["failure"] is None
    assert result["ln_f_weight_type"] == "DTensor" and result["ln_f_local_shape"] == [8]
    reads = result["reads"]
    assert [r["step"] for r in reads] == [1, 3, 6]
    assert reads == distributed_run["results"]["fsdp", 1]["reads"]
    module = LitDict(lr=0.0)
    module.model.load_state_dict(torch.load(distributed_run["out"] / "fsdp_weights.pt"))
    for read, expected in zip(reads, single_process_reads(module, reads)):
        got = {k: float(v) for k, v in read["metrics"].items()}
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert math.isfinite(value), key
            assert got[key] == pytest.approx(value, rel=1e-10, abs=1e-10), key


def test_fsdp2_gammas_are_read_whole(distributed_run):
    """The gammas were set to distinct values before sharding: the read's min/max are those of
    the full 16-vector (float32 -> float64 is exact), not of either rank's half."""
    weights = torch.load(distributed_run["out"] / "fsdp_weights.pt")
    last = distributed_run["results"]["fsdp", 0]["reads"][-1]["metrics"]
    for name in ("h.0.ln_1", "h.1.ln_2", "ln_f"):
        gamma = weights[f"{name}.weight"].double()
        halves = gamma[:8], gamma[8:]
        assert last[f"dd/model.{name}/gamma_min"] == gamma.min().item()
        assert last[f"dd/model.{name}/gamma_max"] == gamma.max().item()
        assert any(h.min() != gamma.min() or h.max() != gamma.max() for h in halves)
        assert last[f"dd/model.{name}/gamma_alignment"] >= 1 - 1e-9


@pytest.mark.parametrize(
    ("strategy", "why"),
    [
        (FSDPStrategy(), "FSDP1 .*flat shards"),
        # DeepSpeed is not installed here (its constructor refuses); the refusal is by class.
        (DeepSpeedStrategy.__new__(DeepSpeedStrategy), "ZeRO stage 3"),
        (ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), "tensor parallel"),
    ],
    ids=["fsdp1", "deepspeed", "tensor-parallel"],
)
def test_unsupported_strategies_are_refused_naming_what_is_supported(strategy, why):
    with pytest.raises(MisconfigurationException, match=why) as info:
        check_strategy(strategy, "DeadDirectionMonitor")
    message = str(info.value)
    assert message.startswith(f"DeadDirectionMonitor: {type(strategy).__name__} is not supported")
    for supported in ("a single device", "DDP", "FSDP2", "fully_shard"):
        assert supported in message


@pytest.mark.parametrize(
    "strategy",
    [
        SingleDeviceStrategy(torch.device("cpu")),
        DDPStrategy(),
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    ],
    ids=["single", "ddp", "fsdp2"],
)
def test_supported_strategies_pass(strategy):
    check_strategy(strategy, "DeadDirectionMonitor")


def test_sign_magnitude_monitor_refuses_fsdp2_in_a_real_fit(tmp_path):
    """SignMagnitudeMonitor's weight and probe reads need whole nn.Linear weights: under FSDP2
    they were DTensor shards (measured: every weight read NaN, every probe failing), so it
    refuses ModelParallelStrategy at setup, in a real (one-process) fit."""
    trainer = L.Trainer(
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        callbacks=[SignMagnitudeMonitor(verbose=False)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    try:
        with pytest.raises(MisconfigurationException, match="SignMagnitudeMonitor: Model.*DDP"):
            trainer.fit(LitSharded())
    finally:
        if dist.is_initialized():  # a one-process group Lightning leaves behind
            dist.destroy_process_group()
    with pytest.raises(MisconfigurationException, match="FSDP2 / tensor parallelism"):
        check_strategy(ModelParallelStrategy(), "SignMagnitudeMonitor", fsdp2=False)
    check_strategy(DDPStrategy(), "SignMagnitudeMonitor", fsdp2=False)


def test_layers_built_in_configure_model_are_found_at_fit_start(tmp_path):
    """A module that builds its layers in ``configure_model`` (Lightning's advice for large
    models) has none at ``setup``: the monitor finds them at ``on_fit_start`` instead of
    refusing the run for lack of norm layers."""

    class Built(LitDict):
        def __init__(self):
            super().__init__(lr=0.0)
            self.model = None

        def configure_model(self):
            if self.model is None:
                torch.manual_seed(0)
                from tests.support.tiny_models import TinyLM

                self.model = TinyLM()

    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False)
    trainer = cpu_trainer(2, [monitor])
    from tests.support.shards import DictTokens

    trainer.fit(Built(), train_dataloaders=torch.utils.data.DataLoader(DictTokens(), batch_size=16))
    # window 1 only: step 0's forward is residual discovery's
    assert monitor.failure is None and monitor.reads == 1
    assert monitor.last_report.as_dict()["dd/model.ln_f/gamma_alignment"] >= 1 - 1e-9
