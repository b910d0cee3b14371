"""The pathology zoo's other shapes (issue 41): Hugging Face causal LMs built from configs, a BPE
tokenizer trained at run time, and the two trainers besides Lightning. Used by
``benchmarks/pathology_zoo.py`` (``--arch``, ``--tokenizer``, ``--trainer``); not part of the
package.

* ``HFNet(arch, width, depth, vocab, block)``: ``llama`` (``LlamaConfig``: RMSNorm, RoPE,
  SwiGLU, no biases), ``gpt2`` (``GPT2Config``: LayerNorm, ``Conv1D``, learned positions) or
  ``neox`` (``GPTNeoXConfig``: parallel residual, LayerNorm, partial RoPE); heads =
  ``width // 64`` (head size 64), no dropout, Hugging Face's own initialisation. The same face
  as ``zoo_model.ZooNet``: ``forward(idx) -> (final norm output, the stream entering it)``,
  ``head``, ``norms()``, ``attentions()`` (each with ``max_logit`` and ``entropy`` of its last
  forward) and ``poison``. The attention is Hugging Face's own eager function, wrapped: the
  wrapper (registered as ``zoo_eager`` in ``AttentionInterface``) also forms ``q k^T * scaling``
  once more on the causal pairs and keeps the largest |logit| (NaN when any is NaN) and the
  mean entropy of the returned weights: the ground truth, outside normscope.
* ``bpe_ids(vocab)``: a ByteLevel BPE (``tokenizers``) trained on ``examples/data.py``'s
  ``stdlib_text(2_000_000)``, the same text encoded; both cached under the temp dir.
* ``fit_hf`` / ``fit_plain``: train a zoo module (``step_loss(batch, step, lr)``,
  ``configure_optimizers()``) with ``transformers.Trainer`` and
  ``normscope.adapters.transformers.watch(trainer, ...)``, or with a plain loop and
  ``normscope.Monitor.of(DeadDirectionConfig(), ...)``; both return every logged read.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

ARCHS = ("zoo", "llama", "gpt2", "neox")
#: the norm class each Hugging Face architecture uses (the records' ``norm``)
ARCH_NORM = {"llama": "rmsnorm", "gpt2": "layernorm", "neox": "layernorm"}
#: pathologies that apply to the Hugging Face architectures (the rest need ``ZooNet``'s switches:
#: no skips, post-norm, every bias off)
HF_PATHOLOGIES = (
    "ssl_collapse",
    "lr_divergence_warmup",
    "lr_divergence",
    "gain_decay",
    "nonfinite",
    "logit_growth",
    "healthy",
)
#: the twin's settings where a Hugging Face config has no switch for the cause: Llama, GPT-2 and
#: GPT-NeoX have no qk-layernorm, so ``logit_growth``'s twin is the same model at lr 1e-3
HF_CURE = {"logit_growth": {"lr": 1e-3}}
BPE_VOCAB = 2048
HEAD_SIZE = 64


def applies(pathology: str, arch: str) -> bool:
    """Whether ``pathology`` runs on ``arch`` (``healthy``: the long healthy run, HF only)."""
    if arch == "zoo":
        return pathology != "healthy"
    return pathology in HF_PATHOLOGIES


# ----------------------------------------------------------------------------- tokenizer


def bpe_ids(vocab: int = BPE_VOCAB, chars: int = 2_000_000) -> torch.Tensor:
    """The stdlib text as ByteLevel BPE token ids (int64), the tokenizer trained on that text.
    Cached in ``<tempdir>/normscope_zoo_bpe/`` (a second call loads it: about 0.1 s)."""
    cache = Path(tempfile.gettempdir()) / "normscope_zoo_bpe"
    cache.mkdir(exist_ok=True)
    ids_path = cache / f"bpe{vocab}_{chars}.pt"
    if ids_path.exists():
        return torch.load(ids_path)
    from examples.data import stdlib_text
    from tokenizers import ByteLevelBPETokenizer

    text = stdlib_text(chars).decode("utf-8", errors="replace")
    chunks = [text[i : i + 20_000] for i in range(0, len(text), 20_000)]
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(chunks, vocab_size=vocab, min_frequency=2, show_progress=False)
    ids = torch.tensor([i for e in tok.encode_batch(chunks) for i in e.ids], dtype=torch.long)
    tmp = cache / f".{os.getpid()}.tmp"  # two processes may build it at once: rename is atomic
    tok.save(str(tmp))
    os.replace(tmp, cache / f"bpe{vocab}.json")
    torch.save(ids, tmp)
    os.replace(tmp, ids_path)
    return ids


# ----------------------------------------------------------------------------- HF models


def _zoo_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """Hugging Face's eager attention of ``module``'s own model file, and the ground truth:
    ``module.max_logit`` (largest |q k^T * scaling| over heads and causal pairs) and
    ``module.entropy`` (mean attention entropy per query, nats)."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    out, weights = eager(
        module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw
    )
    with torch.no_grad():
        k = key
        if k.shape[1] != query.shape[1]:  # grouped keys
            k = k.repeat_interleave(query.shape[1] // k.shape[1], dim=1)
        s = scaling if scaling is not None else query.shape[-1] ** -0.5
        logits = (query @ k.transpose(-1, -2)) * s
        t, T = logits.shape[-2:]
        causal = torch.ones(t, T, dtype=torch.bool, device=logits.device).tril(T - t)
        vals = logits[..., causal]
        if torch.isnan(vals).any():
            module.max_logit = math.nan
        else:
            finite = vals[torch.isfinite(vals)]
            module.max_logit = float(finite.abs().max()) if finite.numel() else math.nan
        w = weights.double()
        plogp = torch.where(w > 0, w * w.clamp_min(1e-30).log(), torch.zeros_like(w))
        module.entropy = float(-plogp.sum(-1).mean())
    return out, weights


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register("zoo_eager", _zoo_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register("zoo_eager", eager_mask)


def hf_config(arch: str, width: int, depth: int, vocab: int, block: int) -> Any:
    """The ``transformers`` config of a small causal LM: heads of size 64, no dropout."""
    if width % HEAD_SIZE:
        raise ValueError(f"--width must be a multiple of {HEAD_SIZE}, got {width}")
    heads = width // HEAD_SIZE
    if arch == "llama":
        from transformers import LlamaConfig

        ffn = -(-(8 * width // 3) // 32) * 32  # SwiGLU: 8/3 d, rounded up to 32
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=width,
            intermediate_size=ffn,
            num_hidden_layers=depth,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=block,
            tie_word_embeddings=False,
        )
    if arch == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=vocab,
            n_positions=block,
            n_embd=width,
            n_layer=depth,
            n_head=heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=None,  # GPT-2's 50256 is outside a small vocabulary
            eos_token_id=None,
        )
    if arch == "neox":
        from transformers import GPTNeoXConfig

        return GPTNeoXConfig(
            vocab_size=vocab,
            hidden_size=width,
            num_hidden_layers=depth,
            num_attention_heads=heads,
            intermediate_size=4 * width,
            max_position_embeddings=block,
            use_parallel_residual=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=False,
        )
    raise ValueError(f"--arch must be one of {ARCHS}, got {arch!r}")


class HFNet(nn.Module):
    """A Hugging Face causal LM with ``ZooNet``'s face (module docstring)."""

    def __init__(self, arch: str, width: int, depth: int, vocab: int, block: int) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        _register_attention()
        cfg = hf_config(arch, width, depth, vocab, block)
        self.lm = AutoModelForCausalLM.from_config(cfg, attn_implementation="zoo_eager")
        self.base = self.lm.base_model
        finals = {"llama": "norm", "gpt2": "ln_f", "neox": "final_layer_norm"}
        self._final = getattr(self.base, finals[arch])
        self._final.register_forward_pre_hook(self._grab)
        self._stream: torch.Tensor | None = None
        self.poison = False
        for a in self.attentions():
            a.max_logit, a.entropy = math.nan, math.nan

    def _grab(self, _module, args) -> None:
        self._stream = args[0]

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.lm.get_input_embeddings()(idx)
        if self.poison:
            x = x.clone()
            x[0] = float("nan")
        out = self.base(inputs_embeds=x, use_cache=False).last_hidden_state
        stream, self._stream = self._stream, None
        return out, stream

    def head(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm.get_output_embeddings()(out)

    def attentions(self) -> list[nn.Module]:
        return [m for m in self.modules() if type(m).__name__.endswith("Attention")]

    def norms(self) -> dict[str, nn.Module]:
        return {
            n: m
            for n, m in self.named_modules()
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith("RMSNorm")
        }


# ----------------------------------------------------------------------------- trainers


@dataclass
class Fit:
    """What a trainer loop left: every logged call ``(step, metrics)``, the monitor's rules,
    its sigma rule and the alerts it fired."""

    calls: list[tuple[int | None, dict[str, Any]]]
    rules: list[Any]
    sigma_rule: Any
    alerts_fired: list[Any]


def _optimisers(module: Any) -> tuple[Any, Any]:
    cfg = module.configure_optimizers()
    return cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]


def fit_plain(
    module: nn.Module, batches: list[torch.Tensor], every: int, objective: str = "tokens"
) -> Fit:
    """A plain loop: ``with monitor.step(batch):`` around each optimiser step (docs/integrations.md)."""
    from normscope import DeadDirectionConfig, Monitor

    opt, sched = _optimisers(module)
    calls: list[tuple[int | None, dict[str, Any]]] = []
    monitor = Monitor.of(
        DeadDirectionConfig(objective=objective),
        module,
        every_n_steps=every,
        alerts=(),
        verbose=False,
        log=lambda metrics, step: calls.append((step, dict(metrics))),
    )
    module.train()
    for step, batch in enumerate(batches):
        with monitor.step(batch):
            loss = module.step_loss(batch, step, opt.param_groups[0]["lr"])
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
    monitor.close()
    return Fit(calls, list(monitor.rules), monitor.family.sigma_rule, list(monitor.alerts_fired))


class _Task(nn.Module):
    """The zoo module as a ``transformers.Trainer`` model: ``forward(input_ids) -> {"loss"}``."""

    def __init__(self, core: nn.Module, opt: Any) -> None:
        super().__init__()
        self.core, self.opt, self.step = core, opt, 0

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.core.step_loss(input_ids, self.step, self.opt.param_groups[0]["lr"])}


class _Batches(torch.utils.data.Dataset):
    def __init__(self, batches: list[torch.Tensor]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.batches[i]


def fit_hf(
    module: nn.Module, batches: list[torch.Tensor], every: int, seed: int, objective: str = "tokens"
) -> Fit:
    """``transformers.Trainer`` (defaults but: one batch per step in the given order, no saves,
    no reports, the zoo's AdamW and schedule) with ``watch(trainer, every_n_steps=every)``.
    Its default gradient clipping (``max_grad_norm=1.0``) is kept: what people train with."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from normscope import DeadDirectionConfig
    from normscope.adapters.transformers import watch

    opt, sched = _optimisers(module)
    task = _Task(module, opt)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            task.step = state.global_step

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=len(batches),
            per_device_train_batch_size=1,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=seed,
            remove_unused_columns=False,
        )
        trainer = Trainer(
            model=task,
            args=args,
            train_dataset=_Batches(batches),
            data_collator=lambda items: {"input_ids": items[0]},
            optimizers=(opt, sched),
            callbacks=[Clock()],
        )
        # HF shuffles: keep the zoo's order, so a step's batch is the same under every trainer
        trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(
            trainer.train_dataset
        )
        trainer.remove_callback(PrinterCallback)  # it prints every trainer.log call
        callback = watch(
            trainer,
            config=DeadDirectionConfig(objective=objective),
            every_n_steps=every,
            alerts=(),
            verbose=False,
        )
        trainer.train()
    engine = callback.engine
    return Fit(
        [(s, dict(m)) for s, m in callback.history],
        list(engine.rules),
        engine.family.sigma_rule,
        list(engine.alerts_fired),
    )
