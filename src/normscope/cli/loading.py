"""Load what ``normscope scan MODEL`` names, safely: a Hugging Face model directory or a
``package.module:factory`` of your own.

Safety rules (a model directory is data, not code):

* weights are read from ``*.safetensors`` only (``use_safetensors=True``); a directory holding
  only pickle checkpoints (``pytorch_model.bin``, ``*.pt``, ``*.ckpt``) is refused, because
  unpickling can run arbitrary code;
* code shipped with a model (``auto_map`` in ``config.json`` or ``tokenizer_config.json``) is
  never run unless ``--trust-remote-code`` is given; ``trust_remote_code`` is passed to
  ``transformers`` explicitly, False by default;
* nothing is downloaded (``local_files_only=True``).

The random-init twin (scanned beside the checkpoint) of a Hugging Face model is the same config
built with ``from_config`` under ``torch.manual_seed(seed)``. Python factories:
:mod:`normscope.cli.factory`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normscope.cli.data import byte_tokenizer
from normscope.cli.errors import CLIError
from normscope.cli.factory import load_factory
from normscope.cli.loaded import LoadedModel, max_positions, vocab_size

__all__ = ["load_model"]

_PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
)


def load_model(
    spec: str, *, trust_remote_code: bool = False, device: str | torch.device = "cpu"
) -> LoadedModel:
    """Load ``spec``: a Hugging Face model directory, or ``package.module:factory``.

    Args:
        spec: a directory with ``config.json`` and ``*.safetensors`` weights, or
            ``package.module:attr`` naming an ``nn.Module``, or a callable returning one (or a
            ``(model, tokenizer)`` pair; the tokenizer a Hugging Face one or ``str -> ids``).
            The current directory is importable, as with ``python -m``.
        trust_remote_code: allow a model directory's own code (``auto_map``) to run.
        device: where to put the model.

    Raises:
        CLIError: a missing path, a directory that is no model, pickle-only weights, code that
            needs ``--trust-remote-code``, a model that fails to load.

    Example::

        >>> loaded = load_model("/models/all-MiniLM-L6-v2")  # doctest: +SKIP
        >>> loaded.class_name, loaded.source  # doctest: +SKIP
        ('BertModel', 'huggingface')
    """
    path = Path(spec)
    if path.exists():
        loaded = _load_hf_dir(path, trust_remote_code)
    elif ":" in spec and not spec.startswith((".", "/", "~")):
        loaded = load_factory(spec)
    else:
        raise CLIError(
            f"{spec}: no such model directory (pass a Hugging Face model directory with "
            "config.json and *.safetensors, or package.module:factory for a Python model)"
        )
    try:
        loaded.model.to(device=device, dtype=torch.float32).eval()
    except (RuntimeError, TypeError, ValueError) as err:
        raise CLIError(f"{spec}: could not move the model to {device} in float32: {err}") from err
    return loaded


# ---------------------------------------------------------------------------- Hugging Face
def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CLIError(f"{path}: not a readable JSON file ({err})") from err
    if not isinstance(data, dict):
        raise CLIError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _check_dir(path: Path, trust_remote_code: bool) -> dict[str, Any]:
    """The config, once the directory passed every safety check."""
    if not path.is_dir():
        raise CLIError(
            f"{path}: is a file; pass the model's directory (config.json + *.safetensors)"
        )
    if not (path / "config.json").is_file():
        raise CLIError(
            f"{path}: not a Hugging Face model directory (no config.json); pass a directory "
            "with config.json and *.safetensors, or package.module:factory"
        )
    config = _read_json(path / "config.json")
    tok_config = path / "tokenizer_config.json"
    code = [f"config.json auto_map {sorted(config['auto_map'])}"] if "auto_map" in config else []
    if tok_config.is_file() and "auto_map" in _read_json(tok_config):
        code.append("tokenizer_config.json auto_map")
    if code and not trust_remote_code:
        raise CLIError(
            f"{path}: this model ships its own Python code ({'; '.join(code)}); normscope never "
            "runs a model repository's code unless you pass --trust-remote-code (read the "
            "code first)"
        )
    if not list(path.glob("*.safetensors")):
        pickles = sorted({p.name for pat in _PICKLE_WEIGHTS for p in path.glob(pat)})
        if pickles:
            raise CLIError(
                f"{path}: only pickle weights ({', '.join(pickles[:4])}); normscope loads "
                "*.safetensors only, because unpickling a file can run arbitrary code. Convert "
                "a checkpoint you trust with transformers' save_pretrained (it writes "
                "model.safetensors)"
            )
        raise CLIError(f"{path}: no weights (*.safetensors) in this directory")
    return config


def _load_hf_dir(path: Path, trust_remote_code: bool) -> LoadedModel:
    config_json = _check_dir(path, trust_remote_code)
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(
            path, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as err:
        raise CLIError(f"{path}: could not read config.json with transformers: {err}") from err
    model_cls = _model_class(transformers, config, config_json, trust_remote_code)
    try:
        model, info = model_cls.from_pretrained(
            path,
            config=config,
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            local_files_only=True,
            output_loading_info=True,
        )
    except Exception as err:  # noqa: BLE001 - safetensors/transformers raise many kinds
        raise CLIError(f"{path}: could not load the weights ({type(err).__name__}: {err})") from err
    notes = []
    missing = list(info.get("missing_keys", [])) if isinstance(info, dict) else []
    if missing:
        notes.append(
            f"{len(missing)} weight(s) not in the checkpoint were randomly initialised "
            f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})"
        )
    tokenizer, tok_name = _hf_tokenizer(transformers, path, model, trust_remote_code, notes)

    def make_twin(seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return type(model)._from_config(copy.deepcopy(model.config)).float()

    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        tokenizer_name=tok_name,
        source="huggingface",
        name=str(path),
        class_name=type(model).__name__,
        as_dict=True,
        max_positions=max_positions(config, tokenizer),
        make_twin=make_twin,
        twin_how=f"{type(model).__name__} built from the same config (from_config)",
        notes=notes,
    )


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - main() checks the extra first
        raise CLIError("loading a model directory needs `pip install normscope[cli]`") from err
    transformers.logging.set_verbosity_error()  # the CLI reports what matters itself
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _model_class(
    transformers: Any, config: Any, config_json: dict[str, Any], trust_remote_code: bool
) -> Any:
    """The class the checkpoint was saved from (``architectures``), else ``AutoModel``."""
    auto_map = config_json.get("auto_map") or {}
    if trust_remote_code and auto_map:
        for name in ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModel"):
            if name in auto_map:
                return getattr(transformers, name)
    for arch in config_json.get("architectures") or ():
        cls = getattr(transformers, str(arch), None)
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    return transformers.AutoModel


def _hf_tokenizer(
    transformers: Any, path: Path, model: nn.Module, trust_remote_code: bool, notes: list[str]
) -> tuple[Any, str]:
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        vocab = vocab_size(model)
        notes.append(
            f"no tokenizer in {path}: the text is fed as UTF-8 byte ids"
            + (f" mod vocab_size {vocab}" if vocab and vocab < 256 else "")
        )
        return byte_tokenizer(vocab), "UTF-8 bytes (no tokenizer in the model directory)"
    try:
        tok = transformers.AutoTokenizer.from_pretrained(
            path, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except Exception as err:  # noqa: BLE001 - tokenizer back-ends raise many kinds
        raise CLIError(
            f"{path}: could not load the tokenizer ({type(err).__name__}: {err})"
        ) from err
    return tok, type(tok).__name__
