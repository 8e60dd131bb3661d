"""Every ``torch.a.b...`` name the package, its tools and benchmarks spell out exists in the installed torch.

GPU-only branches never run on CI's CPU machine, so a misspelt CUDA call there (``torch.cuda.is_current_stream_
capturing``) would only show on a GPU; torch's CPU build defines the ``torch.cuda`` and ``torch.distributed``
functions all the same, so the names are checked here. Names behind a version guard (``hasattr(torch, ...)`` or
``getattr(torch, ..., None)``) and torch's private ``torch._C`` bindings are left out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TREES = ("primus_fp8_plugin", "tools", "benchmarks", "scripts")


def dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "torch":
        return ".".join(["torch", *reversed(parts)])
    return None


def guarded(tree: ast.AST) -> set[str]:
    """Names tested for by ``hasattr(x, "name")`` / ``getattr(x, "name", default)`` in the file."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                names.add(node.args[1].value)
    return names


def names_used():
    for tree_name in TREES:
        for path in sorted((ROOT / tree_name).rglob("*.py")):
            tree = ast.parse(path.read_text())
            skip = guarded(tree)
            seen = set()
            for node in ast.walk(tree):
                name = dotted(node) if isinstance(node, ast.Attribute) else None
                if name is None or name in seen or name.startswith("torch._C") or set(name.split(".")) & skip:
                    continue
                seen.add(name)
                yield path.relative_to(ROOT), node.lineno, name


def resolves(name: str) -> bool:
    obj = torch
    for part in name.split(".")[1:]:
        try:
            obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            return False
    return True


def test_every_torch_name_exists():
    missing = [f"{path}:{line}: {name}" for path, line, name in names_used() if not resolves(name)]
    assert not missing, "names the installed torch does not have:\n" + "\n".join(missing)


def test_the_check_sees_a_misspelt_cuda_call():
    tree = ast.parse("torch.cuda.is_current_streamcapturing()")
    name = next(dotted(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute))
    assert name == "torch.cuda.is_current_streamcapturing" and not resolves(name)
    assert resolves("torch.cuda.is_current_stream_capturing")


if __name__ == "__main__":
    pytest.main([__file__])
