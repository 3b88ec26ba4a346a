"""The public API is a contract: every name README.md and docs/ document is importable from
the module they name, and ``kvcache.__all__`` lists exactly the names of the API reference's
``kvcache`` page.

The documented names are read from the docs themselves, so a later doc change is covered:
the ``::: name`` identifiers of the reference pages (and their ``members:`` lists), the
``import`` / ``from ... import`` statements and ``kvcache.x.y`` attribute chains of every
Python block, and the backticked ``kvcache.x.y`` names of the prose. The results log is left
out: it records the API as it was when each figure was measured.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
from pytest_codeblocks import extract_from_file

import kvcache

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"
DIRECTIVE = re.compile(r"^::: *([\w.]+)\s*$", re.MULTILINE)
MEMBERS = re.compile(
    r"^::: *([\w.]+)\s*\n(?:[ \t]+.*\n)*?[ \t]+members: *\[([^\]]*)\]", re.MULTILINE
)
PROSE_NAME = re.compile(r"`(kvcache(?:\.\w+)+)")


def documented_pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    log = ROOT / "docs" / "results" / "log"
    return [p for p in pages if log not in p.parents]


def reference_names() -> set[str]:
    """Dotted names the API reference renders: ``::: name`` and each of its ``members``."""
    names: set[str] = set()
    for page in sorted(REFERENCE.glob("*.md")):
        text = page.read_text()
        names.update(DIRECTIVE.findall(text))
        for module, members in MEMBERS.findall(text):
            names.update(f"{module}.{m.strip()}" for m in members.split(",") if m.strip())
    return names


def _attribute_chain(node: ast.Attribute) -> str | None:
    parts: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        parts.append(current.attr)
        current = current.value
    if isinstance(current, ast.Name) and current.id == "kvcache":
        return ".".join(["kvcache", *reversed(parts)])
    return None


def code_names(code: str) -> set[str]:
    """Dotted kvcache names a block imports or reaches through ``kvcache.``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "kvcache":
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == "kvcache")
        elif isinstance(node, ast.Attribute) and (chain := _attribute_chain(node)):
            names.add(chain)
    return names


def documented_names() -> dict[str, str]:
    """Every documented dotted name -> where it is documented."""
    found: dict[str, str] = {}
    for page in documented_pages():
        where = str(page.relative_to(ROOT))
        for block in extract_from_file(page):
            if (block.syntax or "").split(" ")[0] in {"python", "py"}:
                for name in code_names(block.code):
                    found.setdefault(name, f"{where}:{block.lineno}")
        for name in PROSE_NAME.findall(page.read_text()):
            found.setdefault(name, where)
    for name in reference_names():
        found.setdefault(name, "docs/reference")
    return found


def resolve(name: str) -> object:
    """The object a dotted name documents: the longest importable module, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: object = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is not None and not module_name.startswith(e.name):
                raise  # the module exists but a dependency of it is missing
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


DOCUMENTED = documented_names()
# names an issue gave as a contract: documented in the guide, checked here even if a page moves
CONTRACT = {
    "kvcache.transcribe",
    "kvcache.hf.KVCacheForTransformers",
    "kvcache.compressed.MultiHeadKVCache",
    "kvcache.snapshot.Snapshot",
    "kvcache.press.make_press",
    "kvcache.models.whisper.WhisperConfig",
    "kvcache.models.whisper.Whisper",
    "kvcache.models.whisper.WhisperKVCache",
    "kvcache.models.whisper.forward_decoder_cached",
}


def test_the_docs_document_the_contract_names() -> None:
    missing = sorted(CONTRACT - set(DOCUMENTED))
    assert not missing, f"no page of README.md or docs/ documents {missing}"
    assert len(DOCUMENTED) >= 40, f"only {len(DOCUMENTED)} documented names found"


@pytest.mark.parametrize("name", sorted(DOCUMENTED), ids=sorted(DOCUMENTED))
def test_a_documented_name_imports_from_where_the_docs_say(name: str) -> None:
    try:
        resolve(name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"{name} (documented in {DOCUMENTED[name]}) does not import: {e}")


def test_from_imports_of_the_docs_work_as_written() -> None:
    """``from M import a`` also needs ``a`` as an attribute of M (not a submodule reached)."""
    failures = []
    for name, where in sorted(DOCUMENTED.items()):
        module, _, attr = name.rpartition(".")
        if not module:
            continue
        try:
            exec(f"from {module} import {attr}", {})
        except ImportError as e:
            failures.append(f"{where}: from {module} import {attr}: {e}")
    assert not failures, "\n".join(failures)


def test_all_lists_exactly_the_reference_page_of_kvcache() -> None:
    page = (REFERENCE / "kvcache.md").read_text()
    referenced = {name.split(".", 1)[1] for name in DIRECTIVE.findall(page) if "." in name}
    assert sorted(kvcache.__all__) == sorted(referenced), (
        f"kvcache.__all__ {sorted(kvcache.__all__)} != docs/reference/kvcache.md {sorted(referenced)}"
    )
    assert len(set(kvcache.__all__)) == len(kvcache.__all__), "a name twice in kvcache.__all__"


@pytest.mark.parametrize("name", kvcache.__all__)
def test_every_name_of_all_imports_from_kvcache(name: str) -> None:
    exec(f"from kvcache import {name}", {})
