"""Per-source reads (``sources=``): the pooled read unchanged, the per-source accumulators an
exact split of it, the classification of a collapse, rows too few, memory, resume."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from examples import sources as example
from normscope import DeadDirectionConfig, DeadDirectionTracker, Monitor, scan_model
from normscope.alerts import (
    SigmaMinRatioRule,
    SourceCollapseRule,
    below_floor,
    classify_collapses,
)
from normscope.engine.publish import select_layers
from normscope.families.budget import tap_cost as _tap_cost
from normscope.functional import StreamingCovariance
from normscope.taps.hooks import call_model

torch.set_num_threads(1)


def mixture_batches(n=192, code_share=0.25, batch=32, seed=0):
    data = example.Mixture(n=n, code_share=code_share, seed=seed)
    out = []
    for i in range(0, n, batch):
        items = data.items[i : i + batch]
        out.append(
            {
                "input_ids": torch.stack([it["input_ids"] for it in items]),
                "source": [it["source"] for it in items],
            }
        )
    return out


def model(cancel: str | None):
    torch.manual_seed(0)
    m = example.SourceLM().eval()
    if cancel is not None:
        m.set_cancel(1, 0.95, gated=cancel == "source")
    return m


def run_tracker(m, batches, **kw):
    tracker = DeadDirectionTracker(DeadDirectionConfig(rows_per_read="all", **kw), m)
    tracker.attach(forward=lambda: call_model(m, batches[0]))
    with torch.no_grad():
        for b in batches:
            with tracker.gate.sampling(sources=tracker.label(b)):
                m(b["input_ids"])
    return tracker


def test_pooled_read_unchanged_and_sources_merge_to_it():
    batches = mixture_batches()
    m = model("source")
    plain = run_tracker(m, batches)
    split = run_tracker(m, batches, sources="source")
    # the per-source accumulators, Chan-merged, are the pooled ones
    assert sorted(split.split.accs) == ["code", "prose"]
    for k, tap in enumerate(split.point_taps):
        merged = StreamingCovariance(tap.dim)
        for name in ("code", "prose"):
            merged.merge_state(split.split.accs[name][k])
        assert merged.count == tap.accumulator.count == 192 * 16
        torch.testing.assert_close(
            merged.second_moment(), tap.accumulator.second_moment(), rtol=1e-12, atol=1e-12
        )
    a = plain.read(step=0, reduce=False).as_dict()
    b = split.read(step=0, reduce=False).as_dict()
    # every key of the plain read is in the split read with the identical value
    assert {k: b[k] for k in a} == pytest.approx(a, nan_ok=True, rel=0, abs=0)
    extra = set(b) - set(a)
    assert extra and all(
        k.startswith(("dd.code/", "dd.prose/"))
        or k.endswith(("collapse_class", "collapse_depth", "sources_read", "sources_collapsed"))
        for k in extra
    )
    counts = {s: b[f"dd.{s}/n_rows"] for s in ("code", "prose")}
    assert counts == {"code": 48 * 16, "prose": 144 * 16}


def test_classification_distribution_dependent_and_intrinsic():
    batches = mixture_batches()
    healthy = scan_model(model(None), batches, sources="source")
    gated = scan_model(model("source"), batches, sources="source")
    intrinsic = scan_model(model("intrinsic"), batches, sources="source")
    h, g, i = healthy.as_dict(), gated.as_dict(), intrinsic.as_dict()
    floor = SigmaMinRatioRule().threshold
    assert h["dd/collapse_class"] == 0.0 and healthy.collapses == []
    # source-only cancellation: code collapses at block 1's MLP, prose does not
    point = "h.2.ln_1"  # the point after block 1's MLP
    assert g[f"dd.code/{point}/sigma_min_step"] < 0.2
    assert g[f"dd.prose/{point}/sigma_min_step"] > floor
    assert g[f"dd/{point}/sigma_min_step"] > floor  # the pooled read stays above the floor
    assert g["dd/collapse_class"] == 2.0 and g[f"dd/{point}/collapse_class"] == 2.0
    c = gated.collapses[0]
    assert (c.point, c.kind, c.below, c.above) == (
        point,
        "distribution-dependent",
        ("code",),
        ("prose",),
    )
    assert g["dd/collapse_depth"] == float(c.depth)
    # cancellation on every row: every source collapses there
    assert i["dd/collapse_class"] == 1.0
    c = intrinsic.collapses[0]
    assert (c.point, c.kind, c.below) == (point, "intrinsic", ("code", "prose"))
    assert i[f"dd/{point}/sigma_min_step"] < floor
    # the rule names the source
    rule = SourceCollapseRule()
    rule.sublayers = {p.name: p.sublayer for p in gated.profile.points}
    msg = [a.message for a in rule.evaluate(g, 0)]
    sub = rule.sublayers[point]
    assert any(f"collapse at {point} after {sub} under source 'code' only" in s for s in msg), msg
    assert rule.evaluate(g, 1) == []  # once per point and class
    assert (
        "in every source ('code', 'prose'): intrinsic"
        in SourceCollapseRule().evaluate(i, 0)[0].message
    )


def test_threshold_read_from_the_rule_object():
    # rows enough for a narrow interval: the threshold alone decides
    values = {"sigma_min_ratio": 0.7, "sigma_min_step": 0.75, "n_rows": 1e6, "rows_per_dim": 1e4}
    assert below_floor(values, SigmaMinRatioRule(tolerance=0.2)) is True  # threshold 0.8
    assert below_floor(values) is False  # the default threshold, 0.6
    assert below_floor({"sigma_min_ratio": math.nan, "sigma_min_step": math.nan}) is None
    assert below_floor({**values, "n_rows": 0.0}) is None
    g = scan_model(model("source"), mixture_batches(), sources="source").as_dict()
    assert classify_collapses(g, SigmaMinRatioRule(tolerance=0.95)) == []  # floor 0.05


def test_source_with_too_few_rows_reads_nan_and_never_classifies():
    batches = mixture_batches()
    # one sample (16 rows < 2 d = 32) of a third source
    batches[0] = dict(batches[0], source=["rare"] + batches[0]["source"][1:])
    r = scan_model(model("source"), batches, sources="source")
    m = r.as_dict()
    assert m["dd.rare/n_rows"] == 16.0
    assert math.isnan(m["dd.rare/h.2.ln_1/sigma_min"])
    assert r.sources["rare"].points[0].reason == "insufficient_rows"
    c = r.collapses[0]
    assert c.kind == "distribution-dependent" and "rare" in c.undecided
    assert m["dd/sources_read"] == 2.0


def test_whole_batch_labels_equal_per_row_labels():
    rows = mixture_batches()
    # the same samples regrouped: each batch one source, labelled by fn(batch) -> str
    ids = torch.cat([b["input_ids"] for b in rows])
    src = [s for b in rows for s in b["source"]]
    by = {s: ids[[j for j, t in enumerate(src) if t == s]] for s in ("code", "prose")}
    whole = [
        {"input_ids": by[s][i : i + 32], "name": s} for s in by for i in range(0, len(by[s]), 32)
    ]
    a = scan_model(model("source"), rows, sources="source").as_dict()
    b = scan_model(model("source"), whole, sources=lambda batch: batch["name"]).as_dict()
    for s in ("code", "prose"):
        for key in (f"dd.{s}/h.2.ln_1/sigma_min", f"dd.{s}/sigma_min_ratio_min"):
            assert b[key] == pytest.approx(a[key], rel=1e-10)
    # a tensor of integer labels names sources "0", "1"
    t = [dict(b, code=torch.tensor([int(x == "code") for x in b["source"]])) for b in rows]
    c = scan_model(model("source"), t, sources="code").as_dict()
    assert c["dd.1/h.2.ln_1/sigma_min"] == pytest.approx(a["dd.code/h.2.ln_1/sigma_min"], rel=1e-12)


def test_max_memory_covers_the_per_source_accumulators():
    batches = mixture_batches(n=64)
    m = model(None)
    full = run_tracker(m, batches, sources="source", max_sources=2)
    need = full.memory_bytes()
    pooled = run_tracker(m, batches).memory_bytes()
    assert need == pooled + 2 * len(full.point_taps) * 8 * 16 * 16
    fits = run_tracker(m, batches, sources="source", max_sources=2, max_memory=need)
    assert fits.split is not None and fits.memory_bytes() <= need
    # the per-source accumulators come after the profile, before the norm layers: one byte
    # short of profile + sources, the per-source reads are left out
    points = full.layout.points
    short = _tap_cost([], points, 16, 2) - 1
    with pytest.warns(RuntimeWarning, match="the per-source reads"):
        tight = run_tracker(m, batches, sources="source", max_sources=2, max_memory=short)
    assert tight.split is None and tight.memory_bytes() <= short
    assert tight.label(batches[0]) is None and len(tight.layout.points) == len(points)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normless = run_tracker(m, batches, sources="source", max_sources=2, max_memory=short + 1)
    assert normless.split is not None and normless.memory_bytes() <= short + 1
    # a third source over max_sources: its rows stay in the pooled read only, with a warning
    batches[0] = dict(batches[0], source=["rare"] + batches[0]["source"][1:])
    with pytest.warns(RuntimeWarning, match="max_sources=2"):
        capped = run_tracker(m, batches, sources="source", max_sources=2)
    assert len(capped.split.accs) == 2 and capped.memory_bytes() == need


def test_state_dict_round_trip_and_bad_labels_fail_open():
    batches = mixture_batches(n=64)
    m = model("source")
    a = run_tracker(m, batches, sources="source")
    b = DeadDirectionTracker(DeadDirectionConfig(rows_per_read="all", sources="source"), m)
    b.attach(forward=lambda: call_model(m, batches[0]))
    b.load_state_dict(a.state_dict())
    assert a.read(reduce=False).as_dict() == pytest.approx(
        b.read(reduce=False).as_dict(), nan_ok=True
    )
    c = DeadDirectionTracker(DeadDirectionConfig(sources="missing_field"), m)
    c.attach(forward=lambda: call_model(m, batches[0]))
    with pytest.warns(RuntimeWarning, match="per-source reads are off"):
        assert c.label(batches[0]) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert c.label(batches[0]) is None  # warned once


def test_log_per_layer_keeps_the_worst_source_points():
    g = scan_model(model("source"), mixture_batches(), sources="source").as_dict()
    kept = select_layers(g, 1)
    assert "dd.code/h.2.ln_1/sigma_min_step" in kept
    assert "dd/collapse_class" in kept and "dd.code/sigma_min_ratio_min" in kept


def test_a_label_field_is_not_passed_to_the_model():
    from tests.support.tiny_models import TinyLM

    torch.manual_seed(0)
    m = TinyLM().eval()  # forward(idx): a "source" keyword would be a TypeError
    batches = [
        {"idx": torch.randint(32, (8, 16)), "source": ["x"] * 4 + ["y"] * 4} for _ in range(3)
    ]
    r = scan_model(m, batches, sources="source")
    assert sorted(r.sources) == ["x", "y"]
    assert r.as_dict()["dd.x/n_rows"] == 3 * 4 * 16


def test_plain_loop_step_with_sources():
    torch.manual_seed(0)
    m = example.SourceLM()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    logged = []
    reports = []
    # every row: at the default budget (8 d rows a read, pooled) the minority source holds
    # under 4 d of its own and its profile decides nothing (docs/sources.md)
    monitor = Monitor.of(
        DeadDirectionConfig(sources="source", rows_per_read="all"), m,
        every_n_steps=4, log=logged.append, alerts=(), verbose=False,
    )  # fmt: skip
    for step, batch in enumerate(mixture_batches(n=256) * 2):
        if step == 5:
            m.set_cancel(1, 0.95, gated=True)
        with monitor.step(batch) as result:
            logits = m(batch["input_ids"])
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten()
            )
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if result.report is not None:
            reports.append(result.report.as_dict())
    assert len(reports) >= 3 and all("dd.code/sigma_min_ratio_min" in r for r in reports)
    assert reports[0]["dd/collapse_class"] == 0.0
    assert reports[-1]["dd/collapse_class"] == 2.0
    assert any("dd.prose/n_rows" in m for m in logged)
    monitor.close()
    assert any(a.rule == "source_collapse" for a in monitor.alerts_fired)


def test_read_line_names_the_sources_and_the_class():
    from normscope.families.dead_direction.render import format_read_line

    r = scan_model(model("source"), mixture_batches(), sources="source")
    line = format_read_line(r)
    assert "by source: code " in line and "prose " in line
    assert "distribution-dependent collapse at h.2.ln_1" in line
    plain = format_read_line(scan_model(model("source"), mixture_batches()))
    assert "by source" not in plain
