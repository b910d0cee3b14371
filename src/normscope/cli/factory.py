"""``normscope scan package.module:factory``: a model from your own Python code.

``attr`` may be an ``nn.Module`` or a callable returning one, or a ``(model, tokenizer)`` pair;
the tokenizer a Hugging Face one or any ``str -> list[int]``. Without a tokenizer the text goes
in as UTF-8 byte ids (mod the vocabulary when it is smaller than 256), the demo GPT's tokens.
The current directory is importable, as with ``python -m``.

The random-init twin: a Hugging Face model's config built with ``from_config`` under the seed;
any other model, a deep copy whose every submodule's ``reset_parameters()`` is called under the
seed (torch's default init of each layer, not necessarily the model's own init).
"""

from __future__ import annotations

import copy
import importlib
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normscope.cli.data import byte_tokenizer
from normscope.cli.errors import CLIError
from normscope.cli.loaded import LoadedModel, max_positions, vocab_size

__all__ = ["load_factory", "reset_twin"]


def load_factory(spec: str) -> LoadedModel:
    """Import ``package.module:attr`` and build the model (see :func:`normscope.cli.loading.load_model`)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise CLIError(f"{spec}: expected package.module:factory")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # as `python -m` does: your own modules import
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - any import failure is the user's module
        raise CLIError(
            f"{spec}: could not import {module_name} ({type(err).__name__}: {err})"
        ) from err
    for part in attr.split("."):
        if not hasattr(target, part):
            raise CLIError(f"{spec}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    tokenizer = None
    if isinstance(target, nn.Module):
        built: Any = target
    elif callable(target):
        try:
            built = target()
        except Exception as err:  # noqa: BLE001 - the factory is the user's code
            raise CLIError(f"{spec}: the factory raised {type(err).__name__}: {err}") from err
    else:
        raise CLIError(f"{spec}: {attr} is neither an nn.Module nor a callable returning one")
    if isinstance(built, tuple) and len(built) == 2:
        built, tokenizer = built
    if not isinstance(built, nn.Module):
        raise CLIError(
            f"{spec}: the factory returned {type(built).__name__}, not an nn.Module "
            "(or a (model, tokenizer) pair)"
        )
    return _factory_model(spec, built, tokenizer)


def _factory_model(spec: str, model: nn.Module, tokenizer: Any) -> LoadedModel:
    is_hf = _is_hf_model(model)
    notes: list[str] = []
    if tokenizer is None:
        vocab = vocab_size(model)
        if vocab is None:
            raise CLIError(
                f"{spec}: the model has no token embedding (nn.Embedding) and the factory gave "
                "no tokenizer; normscope scan feeds token ids (return (model, tokenizer))"
            )
        tokenizer, tok_name = byte_tokenizer(vocab), f"UTF-8 bytes (vocab {vocab})"
        notes.append(
            "the factory gave no tokenizer: the text is fed as UTF-8 byte ids"
            + (f" mod vocab_size {vocab}" if vocab < 256 else "")
        )
    elif _is_hf_tokenizer(tokenizer):
        tok_name = type(tokenizer).__name__
    else:
        tok_name = f"{getattr(tokenizer, '__name__', type(tokenizer).__name__)} (the factory's)"
    if is_hf:
        config = model.config

        def make_twin(seed: int) -> nn.Module:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                return type(model)._from_config(copy.deepcopy(config)).float()

        how = f"{type(model).__name__} built from the same config (from_config)"
        positions = max_positions(config, tokenizer)
    else:

        def make_twin(seed: int) -> nn.Module:
            return reset_twin(model, seed, notes)

        how = "a copy of the model with every layer's reset_parameters() (torch's default init)"
        positions = max_positions(getattr(model, "config", None), tokenizer)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        tokenizer_name=tok_name,
        source="factory",
        name=spec,
        class_name=type(model).__name__,
        as_dict=is_hf,
        max_positions=positions,
        make_twin=make_twin,
        twin_how=how,
        notes=notes,
    )


def _is_hf_tokenizer(tokenizer: Any) -> bool:
    return hasattr(tokenizer, "convert_ids_to_tokens")


def _is_hf_model(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PreTrainedModel)


def reset_twin(model: nn.Module, seed: int, notes: list[str] | None = None) -> nn.Module:
    """A deep copy of ``model`` with every submodule's ``reset_parameters()`` called under
    ``torch.manual_seed(seed)``: the same architecture at torch's default init.

    Modules that own parameters but have no ``reset_parameters`` keep their values; they are
    named in ``notes``.

    Example::

        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        >>> with torch.no_grad():
        ...     _ = net[1].weight.fill_(3.0)
        >>> reset_twin(net, seed=0)[1].weight.tolist()
        [1.0, 1.0, 1.0, 1.0]
    """
    twin = copy.deepcopy(model)
    kept = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for name, module in twin.named_modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
            elif any(True for _ in module.parameters(recurse=False)):
                kept.append(name or type(module).__name__)
    if kept and notes is not None:
        notes.append(
            f"random-init twin: {len(kept)} module(s) without reset_parameters kept their "
            f"values ({', '.join(kept[:4])}{' ...' if len(kept) > 4 else ''})"
        )
    return twin
