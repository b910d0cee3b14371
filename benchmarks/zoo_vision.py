"""The pathology zoo's vision arm (issue 41): a Hugging Face ViT (``ViTModel``, pre-norm
LayerNorm, bidirectional) trained on procedurally drawn images, each pathology beside its
healthy twin, watched by ``DeadDirectionMonitor(every_n_steps=10)`` with its default rules live
under a real ``lightning.Trainer``, judged against a ground truth from this file's own hooks.

    python benchmarks/zoo_vision.py --width 256 --seeds 2 --out /tmp/zoo41/vit_w256.jsonl
    python benchmarks/zoo_vision.py --width 512 --only ssl_collapse,gain_decay --out w512.jsonl
    python benchmarks/zoo_vision.py --only gain_decay --arms twin --steps 400 --out long.jsonl
    python benchmarks/zoo_vision.py --quick --out q.jsonl        # a test slice (seconds)
    python benchmarks/zoo_vision.py --table w256.jsonl           # judged per run (`today`)
    python benchmarks/pathology_zoo.py --judge w256.jsonl        # the zoo's table, unchanged

On the shared 2-core CPU, one thread: a width-256 run 20-80 s, a width-512 run 1.5-4 min (the
400-step healthy run 10 min), ``--quick`` about 15 s. Figures: ``benchmarks/RESULTS.md``.

The records are the zoo's (``benchmarks/pathology_zoo.py``: a ``{"type": "run"}`` line and one
``{"type": "read"}`` line per read) plus ``arch`` (``"vit"``), ``width`` and ``depth``, so the
zoo's ``--judge`` re-scores them without retraining. Pathology names and ground-truth lines are
the zoo's (``PATHOLOGIES``); only the task, the steps and the model differ.

**Images** (``images``): 32 x 32 RGB, eight classes drawn from a seeded generator (gratings at
four orientations, a checkerboard, a blob, a ring, a cross), random colours, positions, sizes,
frequencies and pixel noise; a bright pattern on a dark ground. **Model**: ``ViTModel`` with patch 4 (64 patches + CLS = 65 rows
an image), heads of 64, MLP 4 x width, no dropout; 16 images a step (1,040 rows). Supervised
arms: a zero-initialised linear head on the CLS row, 8-way cross-entropy. SSL arms: two augmented views (shift,
flip, colour jitter, noise) of each image, the mean over its rows projected; the pathology makes
them agree through a predictor with no stop-gradient and no negatives, the twin is InfoNCE with
the batch's other images as negatives. Optimiser as the zoo: AdamW (0.9, 0.95), weight decay
0.1 on matrices, ``gain_wd`` on the LayerNorm gains, a linear warm-up.

**Ground truth** (``VisionTruth``: hooks, never normscope), per step: the loss, its 10-step mean
and ``loss_jump``; ``z_std`` of the L2-normalised SSL embeddings (x sqrt(d)); ``nonfinite_rows``
of the final LayerNorm's input; the offset share of it and of every LayerNorm's input; RankMe of
the final LayerNorm's output; ``gamma_median_rel`` and ``gamma_sign_flips`` over every gain;
``max_logit`` (largest |q k^T| x scaling over layers, from the q/k projections).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import lightning as L  # noqa: E402
import transformers  # noqa: E402
from pathology_zoo import (  # noqa: E402
    PATHOLOGIES,
    Pathology,
    _clean,
    _fit_lightning,
    judge_run,
    load,
    offset_share,
    rankme,
)

BATCH, IMAGE, PATCH, CLASSES = 16, 32, 4, 8
IMAGES = 2  # the generator's version, in every run record
ARCH = "vit"

#: the zoo's pathologies that apply to a ViT: its names and ground-truth lines, this file's task
#: ("cls": 8-way classification; "ssl": two views) and steps
VISION: dict[str, Pathology] = {
    "ssl_collapse": replace(PATHOLOGIES["ssl_collapse"], task="ssl", steps=60),
    "lr_divergence_warmup": replace(
        PATHOLOGIES["lr_divergence_warmup"], task="cls", steps=100, common={"warmup": 60}
    ),
    "lr_divergence": replace(PATHOLOGIES["lr_divergence"], task="cls", steps=60),
    "gain_decay": replace(PATHOLOGIES["gain_decay"], task="cls", steps=100),
    "nonfinite": replace(PATHOLOGIES["nonfinite"], task="cls", steps=50),
}
QUICK_STEPS = {"ssl_collapse": 30, "nonfinite": 42}

# ----------------------------------------------------------------------------- images


def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images ``(n, 3, 32, 32)`` in about [-1, 1] and their classes ``(n,)``, seeded."""
    g = torch.Generator().manual_seed(30_000 + seed)

    def u(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(n, 1, 1, generator=g)

    ax = torch.linspace(-1, 1, IMAGE)
    y, x = torch.meshgrid(ax, ax, indexing="ij")
    cls = torch.randint(CLASSES, (n,), generator=g)
    theta = (cls.clamp(max=3).float() * math.pi / 4)[:, None, None] + u(-0.15, 0.15)
    cx, cy = u(-0.4, 0.4), u(-0.4, 0.4)
    dx, dy = x - cx, y - cy
    r = (dx.square() + dy.square()).sqrt()
    grating = 0.5 + 0.5 * torch.sin(
        2 * math.pi * u(1.5, 4.0) * (x * theta.cos() + y * theta.sin()) + u(0, 2 * math.pi)
    )
    k = u(2.0, 4.0)
    checker = ((torch.floor(dx * k) + torch.floor(dy * k)) % 2).float()
    blob = torch.exp(-r.square() / (2 * u(0.15, 0.4).square()))
    ring = torch.exp(-(r - u(0.3, 0.6)).square() / (2 * 0.06**2))
    w = u(0.05, 0.1)
    cross = torch.maximum(
        torch.exp(-dx.square() / (2 * w**2)), torch.exp(-dy.square() / (2 * w**2))
    )
    shapes = torch.stack([grating] * 4 + [checker, blob, ring, cross], 1)  # (n, 8, H, W)
    pattern = shapes[torch.arange(n), cls]
    # a bright pattern on a dark ground: with both colours uniform the contrast's sign and size
    # were random and the healthy ViT sat at chance for 400 steps (images v1)
    fg = 0.6 + 0.4 * torch.rand(n, 3, 1, 1, generator=g)
    bg = 0.4 * torch.rand(n, 3, 1, 1, generator=g)
    img = bg + (fg - bg) * pattern[:, None] + 0.05 * torch.randn(n, 3, IMAGE, IMAGE, generator=g)
    return (img - 0.5) / 0.5, cls


def batches(steps: int, seed: int, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` batches of ``batch`` (images, classes), seeded."""
    x, c = images(steps * batch, seed)
    return list(zip(x.split(batch), c.split(batch), strict=True))


def view(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """An augmented view: a shift of up to 4 pixels, a flip, colour jitter and noise."""
    n = len(x)
    out = torch.empty_like(x)
    shifts = torch.randint(-4, 5, (n, 2), generator=g)
    flips = torch.rand(n, generator=g) < 0.5
    for i in range(n):
        v = torch.roll(x[i], (int(shifts[i, 0]), int(shifts[i, 1])), dims=(1, 2))
        out[i] = v.flip(-1) if flips[i] else v
    scale = 0.7 + 0.6 * torch.rand(n, 3, 1, 1, generator=g)
    shift = 0.4 * (torch.rand(n, 3, 1, 1, generator=g) - 0.5)
    return out * scale + shift + 0.1 * torch.randn(x.shape, generator=g)


# ----------------------------------------------------------------------------- model


def vit(width: int, depth: int) -> transformers.ViTModel:
    """A ``ViTModel`` for 32 x 32 RGB images, patch 4, heads of 64, no dropout."""
    cfg = transformers.ViTConfig(
        hidden_size=width,
        num_hidden_layers=depth,
        num_attention_heads=max(1, width // 64),
        intermediate_size=4 * width,
        image_size=IMAGE,
        patch_size=PATCH,
        num_channels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.ViTModel(cfg, add_pooling_layer=False)


class VisionTruth:
    """Forward hooks on every LayerNorm's input and on each layer's q/k projections, gated by
    ``capture`` (one forward a step); ``read(out)`` returns the step's ground truth."""

    def __init__(self, model: transformers.ViTModel) -> None:
        self.model = model
        self.capture = False
        self.points: dict[str, torch.Tensor] = {}
        self.qk: dict[str, torch.Tensor] = {}
        self.norms = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)}
        for name, m in self.norms.items():
            m.register_forward_pre_hook(self._keep(self.points, name, pre=True))
        for i, layer in enumerate(model.layers):
            layer.attention.q_proj.register_forward_hook(self._keep(self.qk, f"q{i}"))
            layer.attention.k_proj.register_forward_hook(self._keep(self.qk, f"k{i}"))
        self.gains0 = self._gains().clone()
        self.median0 = float(self.gains0.abs().median())

    def _keep(self, into: dict[str, torch.Tensor], name: str, pre: bool = False):
        def hook(_module, args, out=None):
            if self.capture:
                into[name] = (args[0] if pre else out).detach()

        if pre:
            return lambda module, args: hook(module, args)
        return hook

    def _gains(self) -> torch.Tensor:
        return torch.cat([m.weight.detach().flatten() for m in self.norms.values()])

    def _max_logit(self) -> float:
        att = self.model.layers[0].attention
        best = -math.inf
        for i in range(len(self.model.layers)):
            q, k = self.qk.get(f"q{i}"), self.qk.get(f"k{i}")
            if q is None or k is None:
                return math.nan
            b, t, c = q.shape
            q = q.view(b, t, -1, att.head_dim).transpose(1, 2)
            k = k.view(b, t, -1, att.head_dim).transpose(1, 2)
            logits = (q @ k.transpose(-2, -1)) * att.scaling
            if not torch.isfinite(logits).all():
                return math.nan
            best = max(best, float(logits.abs().max()))
        return best

    def read(self, out: torch.Tensor) -> dict[str, float]:
        final = self.points["layernorm"].reshape(-1, out.shape[-1])
        gains = self._gains()
        gt: dict[str, float] = {
            "nonfinite_rows": float((~torch.isfinite(final).all(-1)).double().mean()),
            "offset_share": offset_share(final),
            "rankme": rankme(out.reshape(-1, out.shape[-1])),
            "max_logit": self._max_logit(),
            "gamma_median_rel": float(gains.abs().median()) / self.median0,
            "gamma_sign_flips": float((gains.sign() != self.gains0.sign()).double().mean()),
        }
        for name, rows in self.points.items():
            rows = rows.reshape(-1, rows.shape[-1])
            gt[f"offset_share/{name}"] = offset_share(rows)
            finite = rows[torch.isfinite(rows).all(-1)].double()
            gt[f"rms/{name}"] = float(finite.square().mean().sqrt()) if len(finite) else math.nan
        return gt


# ----------------------------------------------------------------------------- training


class VisionModule(L.LightningModule):
    """A Lightning wrapper holding ``self.model`` (the ``ViTModel``) and calling it in
    ``training_step``, as a user would; ``per_step`` holds the ground truth by step."""

    def __init__(
        self, width: int, depth: int, task: str, settings: dict[str, Any], seed: int
    ) -> None:
        super().__init__()
        self.model = vit(width, depth)
        self.task, self.s = task, settings
        self.truth = VisionTruth(self.model)
        self.per_step: dict[int, dict[str, float]] = {}
        self.best_loss = math.inf
        self.losses: list[float] = []
        self.noise = torch.Generator().manual_seed(20_000 + seed)
        self.poison = False
        self.model.embeddings.patch_embeddings.register_forward_hook(self._poison)
        if task == "ssl":
            self.projector = torch.nn.Linear(width, width)
            self.predictor = torch.nn.Sequential(
                torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width)
            )
        else:  # zero-initialised, as ViT's head (Dosovitskiy et al. 2021): no step-1 loss spike
            self.head = torch.nn.Linear(width, CLASSES)
            torch.nn.init.zeros_(self.head.weight)
            torch.nn.init.zeros_(self.head.bias)

    def _poison(self, _module, _args, out: torch.Tensor) -> torch.Tensor | None:
        if not self.poison:
            return None
        out = out.clone()
        out[0] = math.nan  # one image's patch embeddings: a bad batch
        return out

    def _forward(self, x: torch.Tensor, capture: bool) -> torch.Tensor:
        self.truth.capture = capture
        try:
            return self.model(pixel_values=x).last_hidden_state  # (B, 65, d)
        finally:
            self.truth.capture = False

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        step = self.global_step
        x, cls = batch
        self.poison = self.s.get("poison_at") is not None and step == self.s["poison_at"]
        z_std = math.nan
        if self.task == "ssl":
            v1, v2 = view(x, self.noise), view(x, self.noise)
            out = self._forward(v1, capture=True)
            out2 = self._forward(v2, capture=False)
            z1, z2 = self.projector(out.mean(1)), self.projector(out2.mean(1))  # (B, d)
            if self.s["negatives"]:  # the twin: InfoNCE, the batch's other images negatives
                a, b = F.normalize(z1, dim=-1), F.normalize(z2, dim=-1)
                logits = a @ b.T / 0.1
                target = torch.arange(len(a))
                loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
            else:  # a predictor, no stop-gradient, no negatives
                p1, p2 = self.predictor(z1), self.predictor(z2)
                cos = F.cosine_similarity(p1, z2, dim=-1).mean()
                loss = -(cos + F.cosine_similarity(p2, z1, dim=-1).mean()) / 2
            with torch.no_grad():
                zn = F.normalize(z1.detach().double(), dim=-1)
                z_std = float(zn.std(0).mean() * math.sqrt(zn.shape[-1]))
        else:
            out = self._forward(x, capture=True)
            loss = F.cross_entropy(self.head(out[:, 0]), cls)
        self.poison = False
        with torch.no_grad():
            gt = self.truth.read(out.detach())
        value = float(loss.detach())
        gt["loss"], gt["z_std"] = value, z_std
        self.losses.append(value)
        recent = self.losses[-10:]
        smooth = sum(recent) / len(recent)
        gt["loss_smooth"] = smooth
        if math.isfinite(smooth):
            self.best_loss = min(self.best_loss, smooth)
            gt["loss_jump"] = smooth - self.best_loss
        else:
            gt["loss_jump"] = math.nan
        gt["lr"] = float(self.trainer.optimizers[0].param_groups[0]["lr"])
        self.per_step[step] = gt
        return loss

    def configure_optimizers(self):
        gains_ = {id(m.weight) for m in self.truth.norms.values()}
        mats, gains, rest = [], [], []
        for p in self.parameters():
            (gains if id(p) in gains_ else mats if p.dim() >= 2 else rest).append(p)
        opt = torch.optim.AdamW(
            [
                {"params": mats, "weight_decay": 0.1},
                {"params": gains, "weight_decay": self.s.get("gain_wd", 0.0)},
                {"params": rest, "weight_decay": 0.0},
            ],
            lr=self.s.get("lr", 1e-3),
            betas=(0.9, 0.95),
        )
        warm = int(self.s.get("warmup", 0))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@dataclass(frozen=True)
class Run:
    """One arm of one pathology: what ``run_one`` trains."""

    pathology: Pathology
    arm: str  # "pathology" | "twin"
    seed: int
    steps: int
    width: int = 256
    depth: int = 4
    batch: int = BATCH

    @property
    def name(self) -> str:
        p = self.pathology
        extra = "" if self.steps == p.steps else f" {self.steps} steps"
        return f"{p.name} {self.arm} layernorm seed {self.seed} {ARCH} w{self.width} d{self.depth}{extra}"


def run_one(run: Run) -> list[dict[str, Any]]:
    """Train one arm under a ``Trainer`` with ``DeadDirectionMonitor(every_n_steps=10)`` and its
    default rules live; return the zoo's records (run line first, then one line per read)."""
    p = run.pathology
    settings = {**p.common, **(p.cause if run.arm == "pathology" else p.cure)}
    torch.manual_seed(run.seed)
    module = VisionModule(run.width, run.depth, p.task, settings, run.seed)
    data = batches(run.steps, run.seed, run.batch)
    t0 = time.perf_counter()
    objective = "embedding" if p.task == "ssl" else "tokens"  # the monitor's, for the collapse rule
    fit = _fit_lightning(module, data, objective)  # the zoo's Trainer, every 10 steps
    wall = time.perf_counter() - t0
    kernel = next((r for r in fit.rules if r.name == "layernorm_kernel_lost"), None)
    sigma_live = fit.sigma_rule in fit.rules
    shape = {"arch": ARCH, "width": run.width, "depth": run.depth}
    meta = {
        "type": "run",
        "run": run.name,
        "pathology": p.name,
        "arm": run.arm,
        "norm": "layernorm",
        "seed": run.seed,
        "steps": run.steps,
        **shape,
        "batch": run.batch,
        "images": IMAGES,
        "settings": settings,
        "task": p.task,
        "kinds": dict(kernel.kinds) if kernel is not None else {},
        "sublayers": dict(fit.sigma_rule.sublayers) if sigma_live else None,
        "live_rules": [r.name for r in fit.rules],
        "alerts_fired": [a.as_dict() for a in fit.alerts_fired],
        "wall_s": wall,
        "per_step": {
            str(s): {k: _clean(v) for k, v in g.items()} for s, g in module.per_step.items()
        },
    }
    fired = defaultdict(list)
    for a in fit.alerts_fired:
        fired[a.step].append(a.rule)
    reads = [(s, m) for s, m in fit.calls if any(k.startswith("dd/") for k in m)]
    records = []
    for i, (log_step, metrics) in enumerate(reads, 1):
        step = -1 if log_step is None else int(log_step) - 1  # the batch the read consumed
        records.append(
            {
                "type": "read",
                "run": run.name,
                "pathology": p.name,
                "arm": run.arm,
                "norm": "layernorm",
                "seed": run.seed,
                **shape,
                "read": i,
                "step": step,
                "log_step": log_step,
                "metrics": {k: _clean(v) for k, v in metrics.items() if k.startswith("dd")},
                "gt": {k: _clean(v) for k, v in module.per_step.get(step, {}).items()},
                "live_alerts": fired.get(log_step, []),
            }
        )
    meta["reads"] = len(records)
    return [meta, *records]


# ----------------------------------------------------------------------------- judging


def run_table(paths: list[str], rule_set: str = "today") -> list[list[str]]:
    """One row per (pathology, width, depth, seed): the zoo's ``judge_run`` on both arms --
    the ground truth's crossing, the first alert, the verdict (``caught`` at or before the
    crossing, ``late``, ``missed``), the lead in reads, the twin's alerts and reads."""
    runs, reads = load(paths)
    judged = {n: judge_run(m, reads.get(n, []), rule_set) for n, m in runs.items()}
    by: dict[tuple, dict[str, tuple]] = defaultdict(dict)
    for n, m in runs.items():
        key = (m["pathology"], m.get("width"), m.get("depth"), m["seed"], m["steps"])
        by[key][m["arm"]] = (m, judged[n])
    rows = []
    for key in sorted(
        by, key=lambda k: (list(VISION).index(k[0]) if k[0] in VISION else 99, *k[1:])
    ):
        arms = by[key]
        row = [key[0], f"{key[1]} x {key[2]}", str(key[3]), str(key[4])]
        if "pathology" in arms:
            _, j = arms["pathology"]
            gt, first = j["gt_cross"], j["first_alert"]
            gt_read = gt["read"] if gt else None
            al_read = first["read"] if first else None
            rules = sorted({a["rule"] for a in j["alerts"]})
            if gt_read is None:
                verdict = "GT never crossed"
            elif al_read is None:
                verdict = "missed"
            else:
                verdict = "caught" if al_read <= gt_read else "late"
            lead = gt_read - al_read if gt_read is not None and al_read is not None else None
            loss = j["loss_cross"]["read"] if j["loss_cross"] else None
            row += [
                f"step {gt['step']}, read {gt_read}" if gt else "-",
                f"step {first['step']}, read {al_read} ({', '.join(rules)})" if first else "-",
                verdict,
                "-" if lead is None else str(lead),
                "-" if loss is None else str(loss),
            ]
        else:
            row += ["(no pathology arm)", "-", "-", "-", "-"]
        if "twin" in arms:
            _, j = arms["twin"]
            rules = sorted({a["rule"] for a in j["alerts"]})
            gt = " (GT crossed)" if j["gt_cross"] and j["gt_cross"]["read"] else ""
            row.append(
                f"{len(j['alerts'])} in {j['reads']} reads{gt}"
                + (f" ({', '.join(rules)})" if rules else "")
            )
        else:
            row.append("-")
        rows.append(row)
    return rows


RUN_HEAD = [
    "pathology",
    "width x depth",
    "seed",
    "steps",
    "GT crossed",
    "first alert",
    "verdict",
    "lead (reads)",
    "loss jump read",
    "twin alerts",
]


def _md(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# ----------------------------------------------------------------------------- main


def plan(args: argparse.Namespace) -> list[Run]:
    """The runs, seed-major: every pathology (``--only``) x arms (``--arms``) x seeds."""
    only = args.only.split(",") if args.only else list(VISION)
    unknown = [o for o in only if o not in VISION]
    if unknown:
        raise SystemExit(f"--only: unknown pathologies {unknown}; known: {list(VISION)}")
    out = []
    for seed in range(args.seed_offset, args.seed_offset + (1 if args.quick else args.seeds)):
        for name in only:
            p = VISION[name]
            steps = args.steps or (QUICK_STEPS.get(name, 20) if args.quick else p.steps)
            for arm in args.arms.split(","):
                out.append(Run(p, arm, seed, steps, args.width, args.depth, args.batch))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=BATCH, help="images a step (65 rows each)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--seed-offset", type=int, default=0)
    ap.add_argument("--only", default=None, help=f"comma-separated, of {','.join(VISION)}")
    ap.add_argument("--arms", default="pathology,twin")
    ap.add_argument("--steps", type=int, default=None, help="override every run's steps")
    ap.add_argument(
        "--quick", action="store_true", help="test slice: width 64 x 2, ssl_collapse, nonfinite"
    )
    ap.add_argument("--out", default="zoo_vision.jsonl")
    ap.add_argument("--table", nargs="+", default=None, help="judge saved JSONL per run")
    ap.add_argument("--rules", default="today")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import logging

    for name in ("lightning", "lightning.pytorch", "normscope"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if args.table:
        print(_md(RUN_HEAD, run_table(args.table, args.rules)))
        return
    if args.quick:
        args.width, args.depth = 64, 2
        args.only = args.only or "ssl_collapse,nonfinite"
    with open(args.out, "w") as fh:
        todo = plan(args)
        for i, run in enumerate(todo, 1):
            recs = run_one(run)
            fh.writelines(json.dumps(r) + "\n" for r in recs)
            fh.flush()
            meta = recs[0]
            print(
                f"[{i}/{len(todo)}] {meta['run']}: {meta['reads']} reads, "
                f"{len(meta['alerts_fired'])} alerts, {meta['wall_s']:.1f} s",
                flush=True,
            )
    print(_md(RUN_HEAD, run_table([args.out], args.rules)))


if __name__ == "__main__":
    main()
