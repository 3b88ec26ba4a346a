"""The docs are tested as code: the site builds with ``mkdocs build --strict`` (a broken link,
a missing anchor or an API reference to a name that does not exist fails it), and every Python
block of README.md and docs/**.md runs.

A block runs as it is, in a fresh namespace, from the repository root. An HTML comment on the
line before a block marks it (pytest-codeblocks' syntax, read here by
``pytest_codeblocks.extract_from_file``):

    <!--pytest.mark.server-->  runs against a real ``kvcache serve`` on 127.0.0.1 (the block
                               names http://127.0.0.1:8000; the test's server URL replaces it)
    <!--pytest.mark.skip-->    compiled only (every block is compiled first, marked or not)
    <!--pytest-codeblocks:cont-->  the block continues the one before it

Shell blocks are not run (the CLI is tested in tests/models/ and tests/engine/); each
``kvcache ...`` line of them is parsed by the CLI's own parser, so a flag the docs show and the
CLI lacks fails here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pytest_codeblocks import extract_from_file

ROOT = Path(__file__).resolve().parent.parent
PYTHON = {"python", "py"}
MARKS = {"pytest.mark.server", "pytest.mark.skip"}  # what a docs block may be marked with
SERVER_URL = "http://127.0.0.1:8000"
LISTENING = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every page of the docs site."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def python_blocks(root: Path = ROOT) -> list[tuple[str, str, list[str]]]:
    """(id "file:line", code, marks) of every Python block in the docs."""
    blocks = []
    for path in doc_files(root):
        for block in extract_from_file(path):
            if (block.syntax or "").split(" ")[0] in PYTHON:
                ident = f"{path.relative_to(root)}:{block.lineno}"
                blocks.append((ident, block.code, list(block.marks)))
    return blocks


BLOCKS = python_blocks()
PLAIN = [b for b in BLOCKS if not b[2]]
SERVED = [b for b in BLOCKS if b[2] == ["pytest.mark.server"]]


def cli_lines(root: Path = ROOT) -> list[tuple[str, list[str]]]:
    """(id "file:line", argv after ``kvcache``) of every ``kvcache`` command in a shell block."""
    lines = []
    for path in doc_files(root):
        for block in extract_from_file(path):
            if (block.syntax or "").split(" ")[0] not in {"bash", "sh", "console"}:
                continue
            for i, line in enumerate(block.code.replace("\\\n", " ").splitlines()):
                words = shlex.split(line, comments=True)
                if words and words[0].split("/")[-1] == "kvcache":
                    lines.append((f"{path.relative_to(root)}:{block.lineno + 1 + i}", words[1:]))
    return lines


CLI = cli_lines()


def run_block(ident: str, code: str) -> None:
    """Execute a block as a script of its own, from the repository root."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(code, ident, "exec"), {"__name__": "__main__", "__file__": ident})
    finally:
        os.chdir(cwd)


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of ``config`` into ``site`` (not -q: quiet mode does not
    count the warnings that strict mode turns into a failure)."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config)]
    return subprocess.run(
        [*command, "-d", str(site)], capture_output=True, text=True, env=env, timeout=300
    )


def test_the_docs_have_python_blocks_to_run() -> None:
    files = {ident.split(":")[0] for ident, _, _ in PLAIN}
    assert "README.md" in files, "README.md's Python examples were not found"
    assert len(PLAIN) >= 10, f"only {len(PLAIN)} runnable blocks: {sorted(files)}"
    assert SERVED, "no block runs against the server"


@pytest.mark.parametrize(("ident", "code", "marks"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_every_block_compiles_and_has_known_marks(ident: str, code: str, marks: list[str]) -> None:
    unknown = sorted(set(marks) - MARKS)
    assert not unknown, f"{ident}: marks {unknown}; a docs block may carry {sorted(MARKS)}"
    assert len(marks) <= 1, f"{ident}: one mark at most, got {marks}"
    compile(code, ident, "exec")
    if "pytest.mark.server" in marks:
        assert SERVER_URL in code, f"{ident}: a server block must talk to {SERVER_URL}"


@pytest.mark.parametrize(("ident", "code"), [b[:2] for b in PLAIN], ids=[b[0] for b in PLAIN])
def test_block_runs(ident: str, code: str) -> None:
    run_block(ident, code)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``kvcache serve`` with the bundled SmolLM2 on 127.0.0.1 (a port the OS picks)."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [sys.executable, "-m", "kvcache.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", "0", "--log-level", "info", "--threads", "2"]
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        url, deadline = "", time.monotonic() + 240
        while not url:
            text = log.read_text(errors="replace")
            assert proc.poll() is None, f"kvcache serve exited:\n{text[-3000:]}"
            assert time.monotonic() < deadline, f"kvcache serve did not start:\n{text[-3000:]}"
            found = LISTENING.search(text)
            url = found.group(1) if found else ""
            time.sleep(0.2)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize(("ident", "code"), [b[:2] for b in SERVED], ids=[b[0] for b in SERVED])
def test_server_block_runs_against_a_real_server(server: str, ident: str, code: str) -> None:
    run_block(ident, code.replace(SERVER_URL, server))


@pytest.mark.parametrize(("ident", "argv"), CLI, ids=[c[0] for c in CLI])
def test_every_documented_command_line_parses(ident: str, argv: list[str]) -> None:
    from kvcache.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{ident}: kvcache {shlex.join(argv)} does not parse (exit {e.code})")


def test_the_readme_shows_the_three_commands() -> None:
    commands = {argv[0] for ident, argv in CLI if ident.startswith("README.md") and argv}
    assert {"generate", "transcribe", "serve"} <= commands, commands


def test_the_readmes_links_name_files_that_exist() -> None:
    """README.md is not part of the site, so its relative links are checked here."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert local, "README.md links to no docs page"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_site_builds_strict(tmp_path: Path) -> None:
    done = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "site" / "reference" / "kvcache" / "index.html").is_file()


@pytest.mark.parametrize(
    ("page", "text", "expected"),
    [
        ("guide/cache.md", "[gone](missing.md)", "missing.md"),
        ("guide/cache.md", "[gone](codecs.md#no-such-heading)", "no-such-heading"),
        ("reference/errors.md", "::: kvcache.errors.NoSuchError", "NoSuchError"),
    ],
)
def test_a_broken_link_or_a_missing_name_fails_the_build(
    tmp_path: Path, page: str, text: str, expected: str
) -> None:
    """The configuration itself is checked: strict mode must reject each kind of breakage."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    config = (tmp_path / "mkdocs.yml").read_text()
    (tmp_path / "mkdocs.yml").write_text(config.replace("paths: [src]", f"paths: [{ROOT / 'src'}]"))
    target = tmp_path / "docs" / page
    target.write_text(target.read_text() + f"\n\n{text}\n")
    done = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0, f"the build passed with {text!r} in {page}"
    assert expected in done.stdout + done.stderr
