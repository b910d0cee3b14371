"""``DeadDirectionMonitor(async_reads=True)``: the eigensolves on a worker thread, the report
published at the first optimiser step end after it is ready, under the step it belongs to."""

from __future__ import annotations

import math
import threading
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from normscope import DeadDirectionMonitor
from normscope.alerts import CallableRule
from normscope.families.dead_direction import read as read_window
from tests.support.fits import fit, read_csv, rows_with
from tests.support.tiny_models import LitTiny, TinyLM, token_loader


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("normscope-read")]


def _recorder(seen: list) -> CallableRule:
    return CallableRule("record", lambda m, step: seen.append((step, dict(m))) and None)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def _slow_worker(monkeypatch, seconds: float) -> None:
    """Solves that take ``seconds`` more: the reads are published steps after their own."""
    import time

    from normscope.families.dead_direction import family as dead_direction_family

    real = dead_direction_family.solve_window

    def slow(*args, **kw):
        time.sleep(seconds)
        return real(*args, **kw)

    monkeypatch.setattr(dead_direction_family, "solve_window", slow)


def _run(tmp_path, async_reads, steps=12, every=2, **kw):
    torch.manual_seed(0)
    seen: list = []
    monitor = DeadDirectionMonitor(
        every_n_steps=every, verbose=False, async_reads=async_reads, rules=[_recorder(seen)], **kw
    )
    trainer = fit(tmp_path / str(async_reads), LitTiny(), monitor, steps=steps)
    return monitor, trainer, seen


@pytest.mark.parametrize("slow", [0.0, 0.3])
def test_async_reads_equal_the_synchronous_reads_exactly(tmp_path, monkeypatch, slow):
    """A real fit both ways: the same reads, at the same steps, every metric bit for bit, in
    the rules and in the CSV logger (each read under its own step); with slow solves too (each
    published some steps after its own)."""
    sync, t_sync, seen_sync = _run(tmp_path, False)
    _slow_worker(monkeypatch, slow)
    asyn, t_async, seen_async = _run(tmp_path, True)
    assert sync._async is False and asyn._async is True
    assert [s for s, _ in seen_sync] == [s for s, _ in seen_async] == [2, 4, 6, 8, 10, 12]
    for (step, a), (_, b) in zip(seen_sync, seen_async):
        assert set(a) == set(b)
        assert all(_same(a[k], b[k]) for k in a), step
    assert asyn.reads == sync.reads == len(seen_sync)
    assert asyn.last_read_step == sync.last_read_step == 12  # the last read is not lost
    rows_s = rows_with(read_csv(t_sync), "dd/sigma_min_ratio_min")
    rows_a = rows_with(read_csv(t_async), "dd/sigma_min_ratio_min")
    by_step = {r["step"]: r for r in rows_a}
    assert sorted(by_step) == sorted(r["step"] for r in rows_s)
    for row in rows_s:
        other = by_step[row["step"]]
        assert {k: v for k, v in row.items() if k.startswith("dd/")} == {
            k: v for k, v in other.items() if k.startswith("dd/")
        }
    assert not _workers()


def test_every_step_reads_wait_for_the_previous_one(tmp_path):
    """``every_n_steps=1``: a read step waits for the read in flight and publishes it first
    (at most one in flight); the reads are those of the synchronous run."""
    sync, _, seen_sync = _run(tmp_path, False, steps=6, every=1)
    asyn, _, seen_async = _run(tmp_path, True, steps=6, every=1)
    assert [s for s, _ in seen_async] == [s for s, _ in seen_sync] == [2, 3, 4, 5, 6]
    for (_, a), (_, b) in zip(seen_sync, seen_async):
        assert all(_same(a[k], b[k]) for k in a)


def test_stop_on_alert_acts_at_the_publish(tmp_path):
    """An alert stops the fit when its read is published: one step (at least) after the
    synchronous run stops."""
    always = CallableRule("always", lambda m, step: "stop" if step >= 4 else None)
    torch.manual_seed(0)
    sync = DeadDirectionMonitor(every_n_steps=2, verbose=False, rules=[always], stop_on_alert=True,
                                async_reads=False)  # fmt: skip
    t_sync = fit(tmp_path / "s", LitTiny(), sync, steps=20)
    torch.manual_seed(0)
    asyn = DeadDirectionMonitor(every_n_steps=2, verbose=False, rules=[always], stop_on_alert=True,
                                async_reads=True)  # fmt: skip
    t_async = fit(tmp_path / "a", LitTiny(), asyn, steps=20)
    assert t_sync.global_step == 4
    assert 4 < t_async.global_step < 20
    assert [a.step for a in asyn.alerts_fired][:1] == [a.step for a in sync.alerts_fired] == [4]
    assert not _workers()


class _Boom(LitTiny):
    def __init__(self, at: int, error: type[BaseException]) -> None:
        super().__init__()
        self.at, self.error = at, error

    def training_step(self, batch, batch_idx):
        if self.global_step == self.at:
            monitor = next(c for c in self.trainer.callbacks if isinstance(c, DeadDirectionMonitor))
            self.in_flight = monitor.in_flight.pending is not None and bool(_workers())
            raise self.error("boom")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_no_thread_is_left_behind_on_an_exception(tmp_path, monkeypatch, error):
    """A read in flight when the fit raises (or is interrupted) is dropped and the worker
    joined (``on_exception``)."""
    _slow_worker(monkeypatch, 1.0)  # step 4's read is still in flight at step 4's forward
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False, async_reads=True)
    trainer = L.Trainer(max_steps=10, accelerator="cpu", logger=False, callbacks=[monitor],
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    # Lightning turns a KeyboardInterrupt into on_exception, then sys.exit(1)
    module = _Boom(4, error)
    with pytest.raises(SystemExit if error is KeyboardInterrupt else RuntimeError):
        trainer.fit(module, train_dataloaders=token_loader())
    assert module.in_flight
    assert monitor.in_flight.pending is None and not monitor.in_flight.worker.pending
    assert not _workers()


def test_a_failed_solve_warns_once_disables_and_the_fit_goes_on(tmp_path, monkeypatch):
    def broken(window, job, out):
        raise ValueError("no LAPACK today")

    monkeypatch.setattr(read_window, "_solve_job", broken)
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False, async_reads=True)
    with pytest.warns(UserWarning, match="no LAPACK today") as caught:
        trainer = fit(tmp_path, LitTiny(), monitor, steps=8)
    assert trainer.global_step == 8
    assert monitor.disabled and "no LAPACK today" in (monitor.failure or "")
    assert sum("disabled itself" in str(w.message) for w in caught) == 1
    assert monitor.reads == 0 and not _workers()


def test_a_layer_that_fails_in_the_worker_is_disabled_alone(tmp_path, monkeypatch):
    """A norm layer's read failing on the worker: that layer is disabled (one warning, from the
    main thread at the publish), the others are read, as in a synchronous read."""
    real = read_window._solve_norm

    def flaky(window, norm, out):
        if norm.name == "model.h.0.ln_1":
            out.norm_failures[norm.name] = "RuntimeError: eigh did not converge"
            return
        real(window, norm, out)

    monkeypatch.setattr(read_window, "_solve_norm", flaky)
    torch.manual_seed(0)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False, async_reads=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, LitTiny(), monitor, steps=6)
    assert sum("model.h.0.ln_1" in str(w.message) for w in caught) == 1
    assert not monitor.disabled
    assert "model.h.0.ln_1" not in monitor.last_report.norms
    assert "model.h.1.ln_1" in monitor.last_report.norms


def test_a_checkpoint_with_a_read_in_flight_holds_it(tmp_path):
    """``state_dict`` while a read is in flight publishes it first (one process): the
    checkpoint's counters include it."""
    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    monitor = DeadDirectionMonitor(every_n_steps=2, verbose=False, async_reads=True)
    fit(tmp_path, LitTiny(), [monitor, ckpt], steps=4, enable_checkpointing=True)
    saved = torch.load(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", weights_only=False)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("DeadDirection"))
    assert state["reads"] == monitor.reads == 2
    assert state["last_read_step"] == 4
    # the stream reads' baselines only (delta_gamma needs none): gains at the first batch,
    # each point's RMS at the last read
    assert set(state["family"]) == {"gain_baselines", "previous_rms", "reads_taken"}
    assert state["family"]["previous_rms"] == monitor.tracker.previous_rms


def test_the_default_is_off_in_plain_loops_and_reports_come_at_the_publish(tmp_path):
    """A plain loop (the engine alone) and a Lightning ``Trainer`` on the CPU read
    synchronously by default; with ``async_reads=True`` a step's :class:`StepResult` carries the
    report published at it."""
    from normscope import DeadDirectionConfig, Monitor

    torch.manual_seed(0)
    monitor, _, _ = _run(tmp_path, None, steps=4)
    assert monitor.engine._async is False  # CPU: measured, no gain
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    assert Monitor.of(DeadDirectionConfig(), TinyLM(), verbose=False)._async_default is False
    engine = Monitor.of(
        DeadDirectionConfig(), model, every_n_steps=2, async_reads=True, verbose=False
    )
    got = []
    for x, y in token_loader(n=128):
        with engine.step((x, y)) as result:
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
        got.append(result.report.step if result.report is not None else None)
    engine.close()
    published = [s for s in got if s is not None]
    # each report at or after the step it belongs to (step i + 1 after step i)
    assert published and all(s <= i + 1 for i, s in enumerate(got) if s is not None)
    assert published == sorted(published)
    assert engine._async is True and engine.last_read_step == 8
    assert not _workers()
