"""Several monitors in one Trainer (``name=``, ``state_key``), in real CPU fits of the tiny LM:
each named monitor logs its own key family (``dd[name]/...``) on its own steps, monitors that
differ only in a threshold coexist, a checkpoint resumes each with its own state, rules see the
canonical ``dd/`` keys, W&B gets both families (and their summaries), ``normscope report
--name`` reads one."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from normscope import DeadDirectionMonitor, SignMagnitudeMonitor
from normscope.alerts import CallableRule
from normscope.engine.keys import canonical_metrics, named_metrics, parse_family
from tests.support.fits import read_csv
from tests.support.tiny_models import LitTiny, cpu_trainer, token_loader

torch.set_num_threads(1)

FAST_LAYERS = ["model.h.0.ln_1", "model.h.1.ln_2"]


def steps_of(rows: list[dict[str, str]], key: str) -> list[int]:
    return [int(r["step"]) for r in rows if r.get(key) not in (None, "")]


def quiet_fit(trainer, module, **kw) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, train_dataloaders=token_loader(), **kw)


@pytest.fixture(scope="module")
def two_monitor_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("two")
    torch.manual_seed(0)
    fast = DeadDirectionMonitor(every_n_steps=2, layers=FAST_LAYERS, name="fast", verbose=False)
    full = DeadDirectionMonitor(every_n_steps=4, name="all", verbose=False)
    trainer = cpu_trainer(8, [fast, full], logger=CSVLogger(root, name="csv"))
    quiet_fit(trainer, LitTiny())
    return root / "csv", fast, full, trainer


def test_two_named_monitors_log_their_own_keys_on_their_own_steps(two_monitor_run):
    folder, fast, full, trainer = two_monitor_run
    rows = read_csv(folder)
    keys = set(rows[0])
    assert not any(k.startswith(("dd/", "dd.")) for k in keys), "no unnamed dd/ key"
    # the baseline window is step 1 (step 0's forward finds the stream), logged at 2
    assert steps_of(rows, "dd[fast]/sigma_min_ratio_min") == [2, 4, 6, 8]
    assert steps_of(rows, "dd[all]/sigma_min_ratio_min") == [2, 4, 8]
    # each family one row per read: no step twice, no row holding both families
    for row in rows:
        families = {parse_family(k.split("/", 1)[0])[1] for k in row if row[k] not in ("", None)}
        assert not {"fast", "all"} <= families
    # its own layers: the fast one reads two norms, the full one every norm
    assert "dd[fast]/model.h.0.ln_1/gamma_alignment" in keys
    assert "dd[fast]/model.ln_f/gamma_alignment" not in keys
    assert "dd[all]/model.ln_f/gamma_alignment" in keys
    assert fast.reads == 4 and full.reads == 3
    assert "dd[fast]/sigma_min_ratio_min" in trainer.callback_metrics
    assert "dd[all]/sigma_min_ratio_min" in trainer.callback_metrics
    assert fast.state_key != full.state_key
    assert fast.state_key == "DeadDirectionMonitor[fast]"


def test_the_state_key_is_the_family_and_the_name():
    """A checkpoint keys a monitor's state by its family and ``name``, nothing else: the same
    key in every process, whatever else the arguments say."""
    assert DeadDirectionMonitor().state_key == "DeadDirectionMonitor"
    assert DeadDirectionMonitor(every_n_steps=5, tolerance=0.1).state_key == "DeadDirectionMonitor"
    assert SignMagnitudeMonitor(name="probe").state_key == "SignMagnitudeMonitor[probe]"


def test_two_unnamed_monitors_of_one_family_are_refused_and_names_fix_it(tmp_path):
    """Each monitor's checkpoint state is keyed by its family and name: two unnamed
    dead-direction monitors in one Trainer are refused (Lightning names the state key), and a
    name each makes them coexist."""
    torch.manual_seed(0)
    loose = DeadDirectionMonitor(every_n_steps=2, verbose=False)
    strict = DeadDirectionMonitor(every_n_steps=2, tolerance=0.05, verbose=False)
    assert loose.state_key == strict.state_key
    with pytest.raises(RuntimeError, match="state_key"):
        cpu_trainer(4, [loose, strict]).fit(LitTiny(), train_dataloaders=token_loader())
    loose = DeadDirectionMonitor(every_n_steps=2, verbose=False, name="loose")
    strict = DeadDirectionMonitor(every_n_steps=2, tolerance=0.05, verbose=False, name="strict")
    quiet_fit(cpu_trainer(4, [loose, strict]), LitTiny())
    assert loose.reads == strict.reads == 2
    assert strict.sigma_rule.threshold == pytest.approx(0.95)


def test_checkpoint_resumes_each_monitor_with_its_own_state(tmp_path):
    def monitors():
        return [
            DeadDirectionMonitor(every_n_steps=2, name="fast", verbose=False, alerts=()),
            DeadDirectionMonitor(every_n_steps=3, name="slow", verbose=False, alerts=()),
        ]

    torch.manual_seed(0)
    first = monitors()
    trainer = cpu_trainer(6, first)
    quiet_fit(trainer, LitTiny())
    assert [m.reads for m in first] == [3, 3]  # logged at fast: 2, 4, 6; slow: 2, 3, 6
    ckpt = tmp_path / "six.ckpt"
    trainer.save_checkpoint(ckpt)
    states = torch.load(ckpt, weights_only=False)["callbacks"]
    assert {m.state_key for m in first} <= set(states)
    assert [states[m.state_key]["reads"] for m in first] == [3, 3]

    second = monitors()
    trainer = cpu_trainer(10, second)
    quiet_fit(trainer, LitTiny(), ckpt_path=str(ckpt))
    # each restored its own counters, then read on: fast at 8 and 10, slow at 9
    assert [m.reads for m in second] == [5, 4]
    assert [m.last_read_step for m in second] == [10, 9]


def test_rules_see_canonical_keys_and_alerts_name_the_monitor(tmp_path):
    """The cancelling branch (``examples/collapse_alert.py``'s collapse) switched on at step 4:
    a named monitor's default rule fires on the canonical ``dd/`` keys; the alert names it."""
    seen: list[set[str]] = []
    spy = CallableRule("spy", lambda metrics, step: seen.append(set(metrics)))
    caught = []
    monitor = DeadDirectionMonitor(
        every_n_steps=2, name="watch", rules=[spy], alerts=(caught.append,), verbose=False
    )
    torch.manual_seed(0)
    trainer = cpu_trainer(12, [monitor], logger=CSVLogger(tmp_path, name="csv"))
    quiet_fit(trainer, LitTiny(cancel_at_step=4, cancel_layer=1))
    assert seen and all("dd/sigma_min_ratio_min" in keys for keys in seen)
    assert not any(k.startswith("dd[") for keys in seen for k in keys)
    assert caught, "the cancelling branch must raise an alert"
    alert = caught[0]
    assert alert.rule == "sigma_min_collapse" and alert.sublayer == "mlp"
    assert alert.monitor == "DeadDirectionMonitor[watch]"
    assert alert.message.startswith("DeadDirectionMonitor[watch]: residual stream sigma_min")
    assert alert.key.startswith("dd[watch]/") and alert.title.startswith("normscope[watch]: ")
    assert alert.as_dict()["monitor"] == "DeadDirectionMonitor[watch]"
    assert monitor.alerts_fired[0] == alert
    assert steps_of(read_csv(tmp_path / "csv"), alert.key)  # the alert's key is a logged key


@pytest.mark.parametrize("bad", ["", "a/b", "a[b", "b]", "a b", "tab\t", 3])
@pytest.mark.parametrize("cls", [DeadDirectionMonitor, SignMagnitudeMonitor])
def test_invalid_names_are_refused(cls, bad):
    with pytest.raises(MisconfigurationException, match=r"name must be None or a non-empty"):
        cls(name=bad)


def test_name_helpers_round_trip():
    m = {"dd/sigma_min_ratio_min": 1.0, "dd/h.0/sigma_min_step": 0.5, "dd.code/n_rows": 8.0}
    named = named_metrics(m, "fast")
    assert set(named) == {
        "dd[fast]/sigma_min_ratio_min",
        "dd[fast]/h.0/sigma_min_step",
        "dd[fast].code/n_rows",
    }
    assert canonical_metrics({**named, "dd/x": 2.0, "train/loss": 1.0}, "fast") == m
    assert canonical_metrics({**named, "dd/x": 2.0}, None) == {"dd/x": 2.0}
    assert named_metrics({"sm/a/max_leverage": 3.0}, "p") == {"sm[p]/a/max_leverage": 3.0}
    assert parse_family("train") == (None, None, None)


def test_report_reads_a_named_family(two_monitor_run, tmp_path):
    from tests.support.cli import load_json, run_cli

    folder = two_monitor_run[0] / "version_0"
    code, stdout, stderr = run_cli("report", folder, "--out", tmp_path / "none")
    assert code == 2 and "fast" in stderr and "--name" in stderr, stderr
    code, stdout, stderr = run_cli("report", folder, "--out", tmp_path / "fast", "--name", "fast")
    assert code == 0, stderr
    result = load_json(tmp_path / "fast" / "report.json")
    assert [r["step"] for r in result["reads"]] == ["2", "4", "6", "8"]
    assert result["monitor"] == "fast" and result["monitors"] == ["all", "fast"]
    assert "model.ln_f" not in result["norms"]
    assert any("other monitors in this run: all" in n for n in result["notes"])
    code, _, stderr = run_cli("report", folder, "--out", tmp_path / "all", "--name", "all")
    assert code == 0, stderr
    assert [r["step"] for r in load_json(tmp_path / "all" / "report.json")["reads"]] == [
        "2",
        "4",
        "8",
    ]


def test_wandb_run_holds_both_families_and_their_summaries(tmp_path, wandb_offline):
    """Two named DeadDirectionMonitors and an unnamed SignMagnitudeMonitor on one offline W&B
    run: every family's keys, and each family's run-level summaries declared (min / max; the
    second monitor's declarations once went missing behind a once-per-run flag)."""
    from lightning.pytorch.loggers import WandbLogger

    from normscope.runs import read_wandb_run

    torch.manual_seed(0)
    fast = DeadDirectionMonitor(every_n_steps=1, layers=FAST_LAYERS, name="fast", verbose=False)
    full = DeadDirectionMonitor(every_n_steps=2, name="all", verbose=False, alerts=())
    sm = SignMagnitudeMonitor(every_n_steps=2, verbose=False, alerts=(), probe_layers=())
    logger = WandbLogger(project="normscope-test", save_dir=str(tmp_path))
    trainer = cpu_trainer(4, [fast, full, sm], logger=logger)
    quiet_fit(trainer, LitTiny())
    logger.experiment.finish()
    wanted = ("dd[fast]/sigma_min_ratio_min", "dd[all]/sigma_min_ratio_min", "sm/reads_disabled")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # W&B's finish() may return before the last flush
        run = read_wandb_run(tmp_path)
        summaries = all(isinstance(run.summary.get(k), dict) for k in wanted)
        flushed = len(run.series("dd[fast]/sigma_min_ratio_min")[0]) == fast.reads
        flushed = flushed and len(run.series("dd[all]/sigma_min_ratio_min")[0]) == full.reads
        if summaries and flushed:  # both monitors' last reads (more keys: a slower flush)
            break
        time.sleep(0.25)
    steps, _ = run.series("dd[fast]/sigma_min_ratio_min")
    assert steps.tolist() == [2, 3, 4]
    assert run.series("dd[all]/sigma_min_ratio_min")[0].tolist() == [2, 4]
    assert not any(k.startswith("dd/") for k in run.keys())
    assert any(k.startswith("sm/") for k in run.keys())
    ratios = run.series("dd[all]/sigma_min_ratio_min")[1]
    assert run.summary["dd[all]/sigma_min_ratio_min"] == {"min": ratios.min()}
    assert "min" in run.summary["dd[fast]/sigma_min_ratio_min"]
    assert run.summary["dd[all]/rows_rejected"] == {"max": 0}
    assert "max" in run.summary["sm/reads_disabled"]
    assert "dd[fast]/worst_point" in run.summary and "dd[all]/worst_point" in run.summary


def test_named_per_source_and_sign_magnitude_families(tmp_path):
    """``sources=`` in a named monitor: ``dd[src].<source>/...`` and ``dd[src]/collapse_class``;
    a named SignMagnitudeMonitor in the same fit: ``sm[p]/...``."""

    def halves(batch):
        return ["even" if i % 2 == 0 else "odd" for i in range(len(batch[0]))]

    torch.manual_seed(0)
    dd = DeadDirectionMonitor(every_n_steps=2, name="src", sources=halves, verbose=False)
    sm = SignMagnitudeMonitor(every_n_steps=2, name="p", probe_layers=(), verbose=False)
    trainer = cpu_trainer(4, [dd, sm], logger=CSVLogger(tmp_path, name="csv"))
    quiet_fit(trainer, LitTiny())
    keys = set(read_csv(tmp_path / "csv")[0])
    for source in ("even", "odd"):
        assert f"dd[src].{source}/sigma_min_ratio_min" in keys
        assert f"dd[src].{source}/n_rows" in keys
    assert "dd[src]/collapse_class" in keys and "dd[src]/sigma_min_ratio_min" in keys
    assert "sm[p]/sign_alignment_mean" in keys
    assert not any(k.startswith(("dd/", "dd.", "sm/")) for k in keys)
    assert steps_of(read_csv(tmp_path / "csv"), "sm[p]/sign_alignment_mean") == [1, 2, 4]
