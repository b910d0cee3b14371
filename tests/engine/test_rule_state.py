"""Rule state in a monitor's checkpoint is keyed by rule name; the old list form still loads."""

from __future__ import annotations

from normscope import DeadDirectionMonitor, SignMagnitudeMonitor


class CountRule:
    """A user rule whose state is one counter."""

    def __init__(self, name: str, count: int = 0) -> None:
        self.name = name
        self.count = count

    def evaluate(self, metrics, step):
        return []

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = int(state["count"])


def test_rules_are_saved_by_name_with_a_suffix_for_a_repeated_name():
    monitor = DeadDirectionMonitor(
        rules=[CountRule("a", 1), CountRule("b", 2), CountRule("a", 3)], verbose=False, alerts=()
    )
    rules = monitor.state_dict()["rules"]
    assert list(rules) == [
        "sigma_min_collapse",
        "layernorm_kernel_lost",
        "non_finite_rows",
        "representation_collapse",
        "norm_gain_drift",
        "stream_scale_growth",
        "attention_logit_growth",
        "a",
        "b",
        "a#2",
    ]
    assert [rules[k]["count"] for k in ("a", "b", "a#2")] == [1, 2, 3]


def test_reordered_rules_restore_by_name():
    saved = DeadDirectionMonitor(
        rules=[CountRule("a", 1), CountRule("b", 2)], verbose=False, alerts=()
    ).state_dict()
    a, b = CountRule("a"), CountRule("b")
    resumed = DeadDirectionMonitor(rules=[b, a], verbose=False, alerts=())
    resumed.load_state_dict(saved)
    assert (a.count, b.count) == (1, 2)
    # a rule the checkpoint does not know keeps its state
    c = CountRule("c", 7)
    SignMagnitudeMonitor(rules=[c], verbose=False, alerts=()).load_state_dict(
        SignMagnitudeMonitor(verbose=False, alerts=()).state_dict()
    )
    assert c.count == 7
