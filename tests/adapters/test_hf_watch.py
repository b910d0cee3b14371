"""One call for the Hugging Face ``Trainer``: ``normscope.adapters.transformers.watch(trainer)``
builds the callback, adds it and binds it; every read reaches TensorBoard and W&B (offline)
through the Trainer's own integrations, and ``normscope report`` reads them all back, for both
families, on tiny GPT-2, Llama and GPT-NeoX configs (2 layers, width 32, vocabulary 64). A
callback passed as ``Trainer(callbacks=[...])`` alone binds itself at ``on_train_begin``."""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from pathlib import Path

import pytest
import transformers

from normscope import ConfigurationError, DeadDirectionConfig
from normscope.adapters.transformers import DeadDirectionCallback, watch
from normscope.families.sign_magnitude import SignMagnitudeConfig
from normscope.runs import read_run
from tests.support.cli import run_cli
from tests.support.hf_models import TokenSamples, build_hf_model

STEPS, EVERY = 6, 2
BATCH, SEQ = 4, 16  # 64 rows a step: enough for every dead-direction read of width 32
RUN_KEY = {"dd": "dd/rows_rejected", "sm": "sm/sign_alignment_mean"}


def _trainer(
    tmp: Path, arch: str, report_to: list[str], callbacks=(), **options
) -> transformers.Trainer:
    model, _ = build_hf_model(arch)
    args = transformers.TrainingArguments(
        **{
            "output_dir": str(tmp / "hf"),
            "max_steps": STEPS,
            "per_device_train_batch_size": BATCH,
            "learning_rate": 1e-2,
            "logging_steps": 2,
            "save_strategy": "no",
            "report_to": report_to,
            "use_cpu": True,
            "disable_tqdm": True,
            "dataloader_num_workers": 0,
            "seed": 0,
        }
        | options
    )
    trainer = transformers.Trainer(
        model=model.train(), args=args, train_dataset=TokenSamples(SEQ), callbacks=list(callbacks)
    )
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    return trainer


def _same(a: float, b: float, rel: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rel, abs_tol=1e-30)


def _wait_for_rows(folder: Path, key: str, reads: int, timeout_s: float = 30.0) -> None:
    """W&B's ``finish()`` may return before the offline file holds the last rows."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sum(key in r for r in read_run(folder).history) < reads:
        time.sleep(0.25)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("family", ["dd", "sm"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt_neox_sequential"])
def test_one_call_logs_every_read_to_tensorboard_and_wandb(tmp_path, monkeypatch, arch, family):
    """``watch(trainer, ...)`` and nothing else: each read the callback logged comes back from
    the TensorBoard events and the offline W&B run, every key of every read at each step it
    was logged (W&B keeps the double, TensorBoard float32), and ``normscope report`` renders
    both runs."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    trainer = _trainer(tmp_path, arch, ["tensorboard", "wandb"])
    if family == "sm":
        callback = watch(trainer, SignMagnitudeConfig(probe_samples=2), every_n_steps=EVERY)
    else:  # tiny batches: read every row, so no read waits for more
        callback = watch(trainer, DeadDirectionConfig(rows_per_read="all"), every_n_steps=EVERY)
    assert callback in trainer.callback_handler.callbacks and callback.trainer is trainer
    trainer.train()
    assert wandb.run is not None, "the Trainer's W&B integration left no run open"
    wandb_folder = Path(wandb.run.dir).parent
    wandb.finish()
    reads = dict(callback.history)
    # sm: the first step and every 2nd; dd: step 0's forward is residual discovery's
    assert sorted(reads) == ([1, 2, 4, 6] if family == "sm" else [3, 5])
    _wait_for_rows(wandb_folder, RUN_KEY[family], len(reads))
    for folder, source, rel in ((tmp_path / "hf", "tensorboard", 1e-6), (wandb_folder, "wandb", 0)):
        run = read_run(folder)
        assert run.source == source and run.key_prefix == "train/"
        keys = {k for logged in reads.values() for k in logged}  # every read's, cheap or not
        assert all(k.startswith(f"{family}/") for k in keys)
        for key in sorted(keys):
            steps, values = run.series(key)
            want = [s for s in sorted(reads) if key in reads[s]]
            assert steps.tolist() == want, (source, key)
            assert all(_same(v, reads[s][key], rel) for s, v in zip(want, values)), (source, key)
        out = tmp_path / f"report_{source}"
        code, _, stderr = run_cli("report", folder, "--out", out)
        assert code == 0, stderr
        result = json.loads((out / "report.json").read_text())
        assert result["run"]["source"] == source
        assert [float(r["step"]) for r in result["reads"]] == [float(s) for s in sorted(reads)]


@pytest.mark.filterwarnings("ignore:.*LeafSpec")
def test_a_callback_in_the_trainers_list_binds_itself(tmp_path):
    """``Trainer(..., callbacks=[DeadDirectionCallback()])`` without ``bind``: the callback finds
    the Trainer calling it, and the reads land in ``trainer.state.log_history``."""
    callback = DeadDirectionCallback(
        DeadDirectionConfig(rows_per_read="all"), every_n_steps=EVERY, alerts=()
    )
    trainer = _trainer(tmp_path, "gpt2", [], callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="transformers")
        trainer.train()
    assert callback.trainer is trainer
    rows = [r for r in trainer.state.log_history if RUN_KEY["dd"] in r]
    assert [int(r["step"]) for r in rows] == sorted(dict(callback.history)) and rows


def test_a_callback_no_trainer_calls_says_where_the_reads_go(tmp_path):
    """Hooks called by a loop of one's own (no Trainer on the stack): one warning saying the
    reads stay in ``callback.history`` and how to log them."""
    callback = DeadDirectionCallback(every_n_steps=EVERY, alerts=())
    trainer = _trainer(tmp_path, "gpt2", [])
    args, state = trainer.args, transformers.TrainerState()
    with pytest.warns(RuntimeWarning, match=r"callback\.history.*watch\(trainer\)"):
        callback.on_train_begin(args, state, transformers.TrainerControl(), model=trainer.model)
    assert callback.trainer is None
    callback.on_train_end(args, state, transformers.TrainerControl())


def test_watch_refuses_an_unknown_config(tmp_path):
    trainer = _trainer(tmp_path, "gpt2", [])
    with pytest.raises(
        ConfigurationError,
        match="config must be None, a DeadDirectionConfig or a SignMagnitudeConfig",
    ):
        watch(trainer, {"every_n_steps": 3})


@pytest.mark.filterwarnings("ignore")
def test_the_end_of_fit_summary_names_every_alert_with_its_step_and_remedy(tmp_path, caplog):
    """One call, its defaults (``verbose`` off: no read lines), a GPT-2 diverging under plain
    SGD at learning rate 10: the alerts page, and at the end of the fit one summary names every
    alert with its step and what to try for its rule (the count line points to it)."""
    trainer = _trainer(tmp_path, "gpt2", [], max_steps=12, learning_rate=10.0, optim="sgd")
    callback = watch(trainer, DeadDirectionConfig(rows_per_read="all"), every_n_steps=EVERY)
    with caplog.at_level(logging.INFO, logger="normscope"):
        trainer.train()
    fired = callback.alerts_fired
    assert fired and all(a.remedy for a in fired), fired
    said = [r.getMessage() for r in caplog.records if r.name == "normscope"]
    [summary] = [m for m in said if m.startswith("normscope alerts:")]
    assert summary.startswith(f"normscope alerts: {len(fired)} (")
    for a in fired:
        assert f"step {a.step}: {a.rule}" in summary and f"{a.rule}: {a.remedy}" in summary
    assert not any(m.startswith("normscope summary:") for m in said)  # no family table: quiet
    counted = [a for a in fired if a.paged is False]
    assert any("see the summary" in m for m in said) == bool(counted)
