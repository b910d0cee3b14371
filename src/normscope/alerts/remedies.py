"""What to try when a default rule fires: one or two sentences per rule, by rule name.

Each default rule carries its entry as ``remedy`` (a class attribute: set your own on an
instance) and sets it on every :class:`~normscope.alerts.Alert` it raises; the log line, the
W&B alert text and the end-of-fit summary show it. The evidence behind each entry (a paper, or
a run of the pathology zoo beside its healthy twin): docs/alerts.md, "What to do".

Example::

    >>> from normscope.alerts import GainDriftRule
    >>> GainDriftRule.remedy == REMEDIES["norm_gain_drift"]
    True
"""

from __future__ import annotations

__all__ = ["REMEDIES"]

REMEDIES: dict[str, str] = {
    "sigma_min_collapse": (
        "the named sublayer cancels the residual stream: check that block's initialisation, "
        "its residual scaling and its identity skip, or look for a bug in that block"
    ),
    "source_collapse": (
        "intrinsic: the named sublayer cancels the stream on every source (as "
        "sigma_min_collapse); distribution-dependent: only that source's batches drive it, so "
        "inspect them"
    ),
    "layernorm_kernel_lost": (
        "usually a consequence, not a cause: gains near or crossing zero in a diverging run "
        "(see the event's first alert); alone, inputs offset so far (~1e6) that the forward's "
        "float arithmetic loses the kernel"
    ),
    "non_finite_rows": (
        "find the first bad batch (the step named) and skip it or resume from a checkpoint "
        "before it; in float16, use dynamic loss scaling (or bfloat16)"
    ),
    "representation_collapse": (
        "in self-supervised training: add a stop-gradient with a predictor (SimSiam, BYOL), "
        "negatives (a contrastive loss) or a variance term (VICReg); otherwise check weight "
        "decay on the norm gains and the blocks' identity skips"
    ),
    "norm_gain_drift": (
        "gains shrinking: weight decay is probably applied to the norm gains: exclude norm "
        "weights and biases from decay; gains crossing zero or growing: lower the peak "
        "learning rate or lengthen the warm-up"
    ),
    "stream_scale_growth": (
        "the learning rate is too high for this model: lower the peak learning rate or "
        "lengthen the warm-up"
    ),
    "attention_logit_growth": (
        "normalise queries and keys (qk-layernorm), lower the peak learning rate or lengthen "
        "the warm-up"
    ),
    "outlier_feature": (
        "outlier features hurt quantisation: keep those input channels in higher precision, "
        "or rotate / smooth them before quantising (QuaRot, SmoothQuant)"
    ),
    "sign_churn_spike": (
        "the learning rate is likely too high for quantisation-aware training: lower it or "
        "decay it sooner; weights oscillating across the quantisation threshold can be frozen"
    ),
}
