"""The engine used directly in a plain loop: stop decisions, fail-open, misuse; the Fabric
helper and the HF callback's stop."""

from __future__ import annotations

import pytest
import torch

from normscope import ConfigurationError, DeadDirectionConfig, Monitor
from tests.support import loops
from tests.support.fits import normscope_hooks


def _step(model, optimizer, batch):
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_stop_on_alert_reaches_the_loop():
    model = loops.gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = Monitor.of(
        DeadDirectionConfig(), model, every_n_steps=2, stop_on_alert=True, alerts=()
    )
    batch = next(iter(loops.loader()))
    with monitor.step(batch) as first:
        _step(model, optimizer, batch)  # residual discovery watches this step's forward
    assert first.report is None and not first.should_stop
    with monitor.step(batch) as read:  # the baseline window
        _step(model, optimizer, batch)
    assert read.should_stop and [a.rule for a in read.alerts] == ["sigma_min_collapse"]
    assert read.report.step == 2 and read.report.sigma_min_ratio_min < 0.2


def test_a_failing_read_disables_the_monitor_not_the_loop(monkeypatch):
    model = loops.gpt2(cancel=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = Monitor.of(DeadDirectionConfig(), model, every_n_steps=1, verbose=False, alerts=())
    batch = next(iter(loops.loader()))
    with watch.step(batch) as discovery:  # residual discovery watches this forward
        _step(model, optimizer, batch)
    assert discovery.report is None and watch.tracker.attached  # the taps, from the step's end
    assert normscope_hooks(model) == 0  # registered for the sampled windows only
    with watch.step(batch) as first:
        _step(model, optimizer, batch)
    assert first.report is not None

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(watch.tracker, "read", broken)
    with pytest.warns(UserWarning, match="disabled itself.*boom"):
        with watch.step(batch) as second:
            _step(model, optimizer, batch)
    assert second.report is None and watch.disabled
    with watch.step(batch) as third:  # the loop goes on; nothing more is read
        _step(model, optimizer, batch)
    assert third.report is None and watch.steps == 4
    assert normscope_hooks(model) == 0  # its hooks are gone


def test_misuse_is_a_clear_error():
    model = loops.gpt2(cancel=False)
    with pytest.raises(RuntimeError, match="needs a model"):
        with Monitor.of(DeadDirectionConfig(), verbose=False).step():
            pass
    with pytest.raises(ConfigurationError, match="every_n_steps"):
        Monitor.of(DeadDirectionConfig(), model, every_n_steps=0)
    with pytest.raises(TypeError, match="no_such_option"):
        Monitor.of(DeadDirectionConfig(), model, no_such_option=1)
    with pytest.raises(TypeError, match="no_such_option"):
        DeadDirectionConfig(no_such_option=1)
    with pytest.raises(TypeError, match="callable or a logger"):
        Monitor.of(DeadDirectionConfig(), model, log=42)


@pytest.mark.filterwarnings("ignore")
def test_hf_stop_on_alert_stops_the_trainer(tmp_path):
    _, (trainer, callback) = loops.run_hf(tmp_path, report_to="none", stop_on_alert=True)
    # the first read (baseline window 1: step 0's forward is discovery's) alerts and stops
    assert [a.step for a in callback.alerts_fired] == [2]
    assert trainer.state.global_step == 2  # max_steps was 5


@pytest.mark.filterwarnings("ignore")
def test_watch_fabric_helper_logs_the_plain_loops_reads(tmp_path):
    """The helper path (``watch_fabric``, ``with monitor.step(batch)``), logging through the
    Fabric's loggers: the same reads as the plain loop, bit for bit."""
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import CSVLogger

    from normscope.adapters.fabric import watch_fabric
    from normscope.runs import read_csv_run

    reference, _ = loops.run_plain("dd")
    fabric = Fabric(accelerator="cpu", devices=1, loggers=CSVLogger(tmp_path, name="helper"))
    model = loops.gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=loops.LR)
    model, optimizer = fabric.setup(model, optimizer)
    watch = watch_fabric(fabric, model, config=loops.dd_config(), **loops.ENGINE_ARGS)
    batch = next(iter(loops.loader()))
    for _ in range(loops.STEPS):
        with watch.step(batch):
            fabric.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()
    watch.close()
    fabric.logger.finalize("success")
    rows = read_csv_run(tmp_path / "helper").history
    got = {int(r["step"]): loops.family_only(r, "dd") for r in rows if loops.RUN_KEY["dd"] in r}
    assert loops.same_reads(got, reference)


def test_fabric_sharded_strategies_are_refused():
    """Fabric's FSDP runs on GPUs only, so the refusal is tested on the strategy classes (as the
    Lightning monitor's is): a loop whose strategy is one of them is refused with the reason."""
    from types import SimpleNamespace

    from lightning.fabric.strategies import DeepSpeedStrategy, FSDPStrategy

    from normscope.adapters.fabric import check_fabric_strategy

    for cls in (FSDPStrategy, DeepSpeedStrategy):
        strategy = cls.__new__(cls)  # DeepSpeed is not installed: no __init__
        with pytest.raises(ConfigurationError, match="not supported.*sharded"):
            check_fabric_strategy(SimpleNamespace(strategy=strategy), "DeadDirectionMonitor")


def test_fabric_refuses_what_the_trainer_refuses_for_the_same_family():
    """FSDP2 (Fabric's ``ModelParallelStrategy``) is refused for the sign-magnitude family and
    kept for the dead-direction one, as under the Trainer (``check_strategy``); tensor
    parallelism is refused for both. Through the callback path, the refusal is a
    ``MisconfigurationException`` at the first batch."""
    from types import SimpleNamespace

    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from normscope import SignMagnitudeMonitor
    from normscope.adapters.fabric import check_fabric_strategy

    def strategy(tp: int) -> ModelParallelStrategy:
        return ModelParallelStrategy(
            lambda m, mesh: m, data_parallel_size=2, tensor_parallel_size=tp
        )

    fsdp2 = SimpleNamespace(strategy=strategy(1))
    check_fabric_strategy(fsdp2, "DeadDirectionMonitor")  # accepted, as under the Trainer
    with pytest.raises(ConfigurationError, match="SignMagnitudeMonitor: .*whole nn.Linear"):
        check_fabric_strategy(fsdp2, "SignMagnitudeMonitor", fsdp2=False)
    with pytest.raises(ConfigurationError, match="tensor parallelism is untested"):
        check_fabric_strategy(SimpleNamespace(strategy=strategy(2)), "DeadDirectionMonitor")

    fabric = Fabric.__new__(Fabric)  # no launch: only its strategy is read before the refusal
    fabric._strategy = strategy(1)
    monitor = SignMagnitudeMonitor(verbose=False, alerts=())
    batch = next(iter(loops.loader()))
    with pytest.raises(MisconfigurationException, match="ModelParallelStrategy is not supported"):
        monitor.on_train_batch_start(fabric, loops.llama(), batch, 0)
    assert monitor.tracker is None
