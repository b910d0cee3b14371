"""What ``normscope scan`` refuses, and how: every bad path, unreadable or unsafe model exits
with code 2 and a message that says what to change -- never a traceback.

Security, tested with real payloads rather than by inspecting calls:

* a pickle-only checkpoint (``pytorch_model.bin``) whose unpickling would create a marker
  folder: refused, the marker never appears;
* a model directory with its own code (``auto_map`` -> ``modeling_evil.py``, which creates a
  marker when imported): refused without ``--trust-remote-code`` (the message names the flag),
  the code never runs; with the flag it runs and the scan goes through.
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.support.cli import load_json, run_cli, save_tiny

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny("gpt2", tmp_path_factory.mktemp("models") / "gpt2")


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def assert_refused(code: int, stdout: str, stderr: str, *needles: str) -> None:
    assert code == 2, (stdout, stderr)
    assert stderr.startswith("normscope: error: "), stderr
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in stderr, (needle, stderr)


class _Payload:
    """Unpickling this creates a folder: proof that a pickle was (or was not) loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.mkdir, (str(self.marker),))


def test_missing_path(tmp_path: Path) -> None:
    assert_refused(*run_cli("scan", tmp_path / "nope"), "no such model directory")


def test_directory_without_config(tmp_path: Path) -> None:
    assert_refused(*run_cli("scan", tmp_path), "no config.json", "package.module:factory")


def test_file_instead_of_directory(gpt2_dir: Path) -> None:
    assert_refused(*run_cli("scan", gpt2_dir / "config.json"), "is a file")


def test_config_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    assert_refused(*run_cli("scan", tmp_path), "config.json", "not a readable JSON file")


def test_directory_without_weights(gpt2_dir: Path, tmp_path: Path) -> None:
    model = copy_model(gpt2_dir, tmp_path / "m")
    (model / "model.safetensors").unlink()
    assert_refused(*run_cli("scan", model), "no weights (*.safetensors)")


def test_corrupt_safetensors(gpt2_dir: Path, tmp_path: Path) -> None:
    model = copy_model(gpt2_dir, tmp_path / "m")
    (model / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    assert_refused(*run_cli("scan", model), "could not load the weights")


def test_pickle_only_checkpoint_is_refused_unopened(gpt2_dir: Path, tmp_path: Path) -> None:
    model = copy_model(gpt2_dir, tmp_path / "m")
    (model / "model.safetensors").unlink()
    marker = tmp_path / "pickle_was_loaded"
    with open(model / "pytorch_model.bin", "wb") as fh:
        pickle.dump(_Payload(marker), fh)
    assert_refused(
        *run_cli("scan", model), "pytorch_model.bin", "safetensors only", "arbitrary code"
    )
    assert not marker.exists(), "the pickle was unpickled"


def _with_remote_code(gpt2_dir: Path, model: Path, marker: Path, where: str) -> Path:
    copy_model(gpt2_dir, model)
    (model / "modeling_evil.py").write_text(
        "import pathlib\n"
        "from transformers import GPT2LMHeadModel\n"
        f"pathlib.Path({str(marker)!r}).mkdir()\n"
        "class EvilGPT2(GPT2LMHeadModel):\n"
        "    pass\n"
    )
    if where == "config":
        config = json.loads((model / "config.json").read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilGPT2"}
        (model / "config.json").write_text(json.dumps(config))
    else:
        (model / "tokenizer_config.json").write_text(
            json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}})
        )
    return model


@pytest.mark.parametrize("where", ["config", "tokenizer"])
def test_repository_code_needs_trust_remote_code(
    gpt2_dir: Path, tmp_path: Path, where: str
) -> None:
    marker = tmp_path / "remote_code_ran"
    model = _with_remote_code(gpt2_dir, tmp_path / "m", marker, where)
    assert_refused(*run_cli("scan", model), "--trust-remote-code", "auto_map")
    assert not marker.exists(), "the model's code ran without --trust-remote-code"


def test_trust_remote_code_runs_the_model_code(
    gpt2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers.dynamic_module_utils as dynamic

    # transformers copies repository code into its modules cache and imports it from there:
    # keep both inside tmp_path.
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    marker = tmp_path / "remote_code_ran"
    model = _with_remote_code(gpt2_dir, tmp_path / "m", marker, "config")
    code, stdout, stderr = run_cli(
        "scan", model, "--trust-remote-code", "--tokens", 256, "--seq-len", 32,
        "--baseline", "none", "--out", tmp_path / "out",
    )  # fmt: skip
    assert code == 0, stderr
    assert marker.exists(), "--trust-remote-code must let the model's own code run"
    assert load_json(tmp_path / "out" / "report.json")["model"]["class"] == "EvilGPT2"


def test_bad_data_path(gpt2_dir: Path, tmp_path: Path) -> None:
    assert_refused(
        *run_cli("scan", gpt2_dir, "--data", tmp_path / "missing.txt"), "--data", "no such file"
    )


def test_out_is_a_file(gpt2_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.write_text("x")
    assert_refused(
        *run_cli("scan", gpt2_dir, "--tokens", 128, "--seq-len", 32, "--out", target),
        "--out", "not a folder",
    )  # fmt: skip


def test_bad_numbers(gpt2_dir: Path) -> None:
    assert_refused(*run_cli("scan", gpt2_dir, "--tokens", 0), "--tokens must be >= 1")
    assert_refused(*run_cli("scan", gpt2_dir, "--device", "nosuchdevice"), "--device")


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("tests.support.no_such_module:f", "could not import tests.support.no_such_module"),
        ("tests.support.factories:missing", "has no attribute 'missing'"),
        ("tests.support.factories:broken_factory", "the factory raised RuntimeError"),
        ("tests.support.factories:not_a_model", "returned str, not an nn.Module"),
        ("tests.support.factories:no_norm_model", "nothing to scan"),
        ("tests.support.factories:VOCAB", "neither an nn.Module nor a callable"),
    ],
)
def test_bad_factories(spec: str, needle: str) -> None:
    assert_refused(*run_cli("scan", spec, "--tokens", 64, "--seq-len", 16), needle)


def test_forward_that_fails_on_the_batches(tmp_path: Path) -> None:
    # TinyLM has 64 positions: windows of 128 tokens make its own forward fail
    assert_refused(
        *run_cli("scan", "tests.support.factories:INSTANCE", "--tokens", 256, "--out", tmp_path),
        "forward failed", "seq 128", "--seq-len",
    )  # fmt: skip


def test_usage_errors_exit_2() -> None:
    code, _, stderr = run_cli("scan")
    assert code == 2 and "MODEL" in stderr
    code, _, stderr = run_cli("scan", "x", "--baseline", "trained")
    assert code == 2 and "invalid choice" in stderr
    code, _, _ = run_cli("frobnicate")
    assert code == 2
