"""Nothing in normscope unpickles a file or runs a model's remote code: a static scan of every
module under src/normscope (the CLI included) for pickle and its cousins, ``torch.load``
without ``weights_only=True``, ``numpy.load(allow_pickle=True)``, unsafe YAML loading and
``trust_remote_code=True``. It reads the syntax tree, so docstrings and comments that *talk*
about pickle are not findings; the scanner itself is tested on code that does each thing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "normscope"

PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve"}
PICKLE_CALLS = {"read_pickle", "to_pickle", "unsafe_load", "full_load"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader"}


def _dotted(node: ast.AST) -> str:
    """``torch.serialization.load`` for an attribute chain, ``""`` for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def findings(source: str, filename: str = "<source>") -> list[str]:
    """Every unsafe-deserialisation or remote-code pattern in ``source``, as
    ``file:line: what``."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}  # local name -> module or ``module.attr`` it stands for
    out: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        out.append(f"{filename}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
                if a.name.split(".")[0] in PICKLE_MODULES or "pickle" in a.name:
                    flag(node, f"imports {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                if root in PICKLE_MODULES or "pickle" in node.module or "pickle" in a.name:
                    flag(node, f"imports {a.name} from {node.module}")
        elif isinstance(node, ast.Attribute) and node.attr in PICKLE_MODULES:
            flag(node, f"uses {_dotted(node) or node.attr}")  # torch.serialization.pickle, ...
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "trust_remote_code":
                    if _is_true(value):
                        flag(node, "trust_remote_code=True (in a dict)")
        if not isinstance(node, ast.Call):
            continue
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        if _is_true(kwargs.get("trust_remote_code")):
            flag(node, "trust_remote_code=True")
        dotted = _dotted(node.func)
        head, _, rest = dotted.partition(".")
        full = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
        leaf = full.rsplit(".", 1)[-1]
        if full in ("torch.load", "torch.serialization.load") and not _is_true(
            kwargs.get("weights_only")
        ):
            flag(node, f"{dotted}(...) without weights_only=True")
        if full in ("numpy.load", "np.load") and _is_true(kwargs.get("allow_pickle")):
            flag(node, f"{dotted}(..., allow_pickle=True)")
        if full == "torch.hub.load":
            flag(node, f"{dotted}(...) runs a repository's hubconf.py")
        if full == "torch.hub.load_state_dict_from_url" and not _is_true(
            kwargs.get("weights_only")
        ):
            flag(node, f"{dotted}(...) without weights_only=True")
        if full.startswith("yaml.") and leaf in ("load", "load_all"):
            loader = kwargs.get("Loader")
            loader_name = _dotted(loader).rsplit(".", 1)[-1] if loader is not None else ""
            if loader_name not in SAFE_YAML_LOADERS:
                flag(node, f"{dotted}(...) without a SafeLoader")
        if leaf in PICKLE_CALLS:
            flag(node, f"calls {dotted}")
    return out


UNSAFE = {
    "import pickle": "imports pickle",
    "import dill as d": "imports dill",
    "from joblib import load": "imports load from joblib",
    "import torch\ntorch.load('x.pt')": "without weights_only=True",
    "import torch\ntorch.load('x.pt', weights_only=False)": "without weights_only=True",
    "import torch as T\nT.load('x.pt', map_location='cpu')": "without weights_only=True",
    "from torch import load\nload('x.pt')": "without weights_only=True",
    "import torch\ntorch.serialization.load(f)": "without weights_only=True",
    "import numpy as np\nnp.load('a.npy', allow_pickle=True)": "allow_pickle=True",
    "import yaml\nyaml.load(text)": "without a SafeLoader",
    "import yaml\nyaml.load(text, Loader=yaml.FullLoader)": "without a SafeLoader",
    "import pandas as pd\npd.read_pickle('f')": "read_pickle",
    "AutoModel.from_pretrained(name, trust_remote_code=True)": "trust_remote_code=True",
    "kw = {'trust_remote_code': True}": "trust_remote_code=True (in a dict)",
    "import torch\ntorch.hub.load('owner/repo', 'model')": "hubconf.py",
    "import torch\nu = torch.serialization.pickle.Unpickler(f)": "torch.serialization.pickle",
    "import torch\ntorch.hub.load_state_dict_from_url(url)": "without weights_only=True",
}

SAFE = [
    "import torch\ntorch.load('x.pt', weights_only=True)",
    "import torch\ntorch.load('x.pt', map_location='cpu', weights_only=True)",
    "import numpy as np\nnp.load('a.npy')",
    "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)\nyaml.safe_load(text)",
    "AutoModel.from_pretrained(name, trust_remote_code=False)",
    '"""Nothing here is unpickled; we never call pickle.load."""\n# no pickle\nx = "pickle"',
    '_PICKLE_WEIGHTS = ("*.bin", "*.pt")\npickles = [p for p in _PICKLE_WEIGHTS]  # refused',
    "import torch\ntorch.save(state, path)",
    "model.load_state_dict(state)\nfetch = torch.hub.load_state_dict_from_url",
    "import torch\ntorch.hub.load_state_dict_from_url(url, weights_only=True)",
]


@pytest.mark.parametrize("code, expected", UNSAFE.items(), ids=list(UNSAFE))
def test_the_scanner_finds_each_unsafe_pattern(code, expected):
    found = findings(code)
    assert found and any(expected in f for f in found), found


@pytest.mark.parametrize("code", SAFE)
def test_the_scanner_passes_safe_code(code):
    assert findings(code) == []


def test_the_package_never_unpickles_or_trusts_remote_code():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) >= 20 and any(f.name == "__init__.py" for f in files)
    problems = [p for f in files for p in findings(f.read_text(), str(f.relative_to(PACKAGE)))]
    assert problems == [], "\n".join(problems)
