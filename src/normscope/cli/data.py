"""Text for a scan: a file, a folder, or (by default) the Python standard library's own source,
cut into token windows with the model's tokenizer.

The default corpus is the demo's (``examples/data.py``): the running Python's standard
library ``.py`` files sorted by relative path, installed packages and the stdlib's own test
suite left out, read at run time. The same bytes on every machine with the same Python, no
download. ``examples/data.py`` imports :func:`stdlib_root` and :func:`stdlib_files` from
here, so the two corpora cannot drift apart.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from normscope.cli.errors import CLIError

__all__ = [
    "TokenData",
    "byte_tokenizer",
    "iter_text",
    "make_batches",
    "stdlib_files",
    "stdlib_root",
]

# Installed packages and the standard library's own test suite are skipped: both differ between
# machines with the same Python (Debian strips test/, pyenv keeps site-packages under lib/).
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})
_CHUNK_CHARS = 32_768  # text handed to the tokenizer at a time (cut at a line end)


def stdlib_root() -> Path:
    """The directory of the running Python's standard library."""
    return Path(sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__))


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative path (deterministic order)."""
    root = root or stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]  # prune before descending
        found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _folder_files(root: Path) -> list[Path]:
    """Every regular file under ``root`` (hidden folders and files left out), sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        found += [Path(dirpath, f) for f in filenames if not f.startswith(".")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_text(path: Path) -> str | None:
    """A file's text (UTF-8, bad bytes replaced), or None for binary or unreadable files."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\x00" in data[:8192]:  # binary: a NUL byte never appears in text
        return None
    return data.decode("utf-8", errors="replace")


def iter_text(data: str | Path | None) -> tuple[Iterator[str], str]:
    """The text to scan, as an iterator of documents, and a description of where it is from.

    Args:
        data: a text file, a folder (every non-hidden text file in it, sorted by path;
            binary files are skipped), or None for the standard library's source.

    Raises:
        CLIError: the path does not exist.
    """
    if data is None:
        files, what = stdlib_files(), f"the Python standard library's source ({stdlib_root()})"
    else:
        path = Path(data)
        if path.is_file():
            files, what = [path], f"text file {path}"
        elif path.is_dir():
            files, what = _folder_files(path), f"text files under {path}"
        else:
            raise CLIError(f"--data {path}: no such file or folder")
    return (t for t in map(_read_text, files) if t), what


def _chunks(texts: Iterator[str]) -> Iterator[str]:
    """Documents cut into pieces of about ``_CHUNK_CHARS`` characters, at line ends."""
    for text in texts:
        start = 0
        while start < len(text):
            end = min(len(text), start + _CHUNK_CHARS)
            if end < len(text):
                cut = text.rfind("\n", start, end)
                end = cut + 1 if cut > start else end
            yield text[start:end]
            start = end


def byte_tokenizer(vocab_size: int | None) -> Callable[[str], list[int]]:
    """UTF-8 bytes as token ids (the demo GPT's tokens), folded ``mod vocab_size`` when the
    vocabulary is smaller than 256: for models that ship no tokenizer.

    Example::

        >>> byte_tokenizer(256)("hi")
        [104, 105]
        >>> byte_tokenizer(64)("hi")
        [40, 41]
    """
    modulus = vocab_size if vocab_size and vocab_size < 256 else None

    def encode(text: str) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [i % modulus for i in ids] if modulus else ids

    return encode


@dataclass(frozen=True)
class TokenData:
    """The scan's inputs: ``batches`` (dicts or id tensors), ``tokens`` (rows per tap),
    ``windows`` x ``seq_len``, and ``source`` (a sentence for the report)."""

    batches: list[Any]
    tokens: int
    windows: int
    seq_len: int
    source: str


def _hf_encoder(
    tokenizer: Any,
) -> tuple[Callable[[str], list[int]], Callable[[list[int]], list[int]], int]:
    """``(encode, add_special, n_special)`` of a Hugging Face tokenizer."""

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    try:
        n_special = int(tokenizer.num_special_tokens_to_add(pair=False))
        add = tokenizer.build_inputs_with_special_tokens
    except (AttributeError, NotImplementedError, TypeError):
        n_special, add = 0, list
    return encode, (lambda ids: list(add(ids))), n_special


def make_batches(
    tokenizer: Any,
    data: str | Path | None,
    *,
    tokens: int,
    seq_len: int,
    batch_size: int,
    as_dict: bool,
    device: torch.device | str = "cpu",
) -> TokenData:
    """Tokenise text until ``tokens`` token rows are gathered, in windows of ``seq_len``.

    Each window is a run of consecutive tokens; a Hugging Face tokenizer adds its special
    tokens (BERT's ``[CLS] ... [SEP]``, Llama's BOS) to each window, counted in ``seq_len``.
    Nothing is padded: only windows of one length share a batch (the last window is shorter
    when ``tokens`` is no multiple of ``seq_len``), so every row is text.

    Args:
        tokenizer: a Hugging Face tokenizer, or a callable ``str -> list[int]``.
        data: see :func:`iter_text`.
        tokens: token rows wanted (the last window is shorter to make it exact).
        seq_len: tokens per window.
        batch_size: windows per batch (the first batch holds one window: it is also the
            residual-discovery forward's).
        as_dict: batches as ``{"input_ids", "attention_mask"}`` (Hugging Face models), else
            ``(batch, seq)`` id tensors.
        device: where the batches live.

    Returns:
        :class:`TokenData`; ``tokens`` is below the request when the text ran out first.

    Raises:
        CLIError: the text holds no token at all.
    """
    texts, what = iter_text(data)
    if callable(tokenizer) and not hasattr(tokenizer, "convert_ids_to_tokens"):
        encode, add_special, n_special = tokenizer, list, 0
    else:
        encode, add_special, n_special = _hf_encoder(tokenizer)
    windows: list[list[int]] = []
    have, pending = 0, []
    chunks = _chunks(texts)
    while have < tokens:
        need = min(seq_len, tokens - have)
        take = max(1, need - n_special)  # the window's text; its special tokens fill the rest
        while len(pending) < take:
            chunk = next(chunks, None)
            if chunk is None:
                break
            pending += encode(chunk)
        if not pending:
            break  # the text ran out
        windows.append(add_special(pending[:take]))
        pending = pending[take:]
        have += len(windows[-1])
    if have == 0:
        raise CLIError(f"no text to scan in {what}")
    # scan_model runs its residual-discovery forward on the first batch, which compares every
    # module's output with the stream (far dearer per row than a scan forward): one window.
    batches = [_batch(windows[:1], as_dict, device)]
    batches += [_batch(group, as_dict, device) for group in _groups(windows[1:], batch_size)]
    return TokenData(batches, have, len(windows), seq_len, what)


def _groups(windows: Sequence[list[int]], batch_size: int) -> Iterator[Sequence[list[int]]]:
    """Consecutive windows of one length, ``batch_size`` at a time: the short last window gets
    a batch of its own, so no batch needs padding (plain models take no mask)."""
    start = 0
    while start < len(windows):
        end = start + 1
        while end < len(windows) and end - start < batch_size:
            if len(windows[end]) != len(windows[start]):
                break
            end += 1
        yield windows[start:end]
        start = end


def _batch(windows: Sequence[list[int]], as_dict: bool, device: torch.device | str) -> Any:
    ids = torch.tensor(windows, dtype=torch.long, device=device)  # (batch, seq), equal lengths
    if as_dict:
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return ids
