"""The kernels compile for every instruction set they have a path for, not only this CPU's.

They are built with ``-march=native``, so a machine compiles only its own paths: each source
whose code depends on the instruction set is compiled (syntax and template instantiation, no
code generated) for the other targets too, so a path that does not compile fails here on any
x86 machine (why: docs/design/kernels.md).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from kvcache.kernels import build

# -march targets, one per set of paths in csrc/: plain loops; AVX2 + FMA + F16C without VNNI
# (an AMD Zen 3); AVX-512 with AVX512-VNNI but no AVX-VNNI (Ice Lake); AVX-512 with AVX-VNNI
# and AMX (Sapphire Rapids)
TARGETS = ("x86-64", "x86-64-v3", "icelake-server", "sapphirerapids")
FEATURE = re.compile(r"\b__(?:AVX\w*|FMA|F16C)__\b")  # the instruction-set macros csrc/ tests
pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the targets are x86-64's")


def local_includes(path: Path, seen: set[Path]) -> set[Path]:
    """The file and every csrc/ header it includes, transitively."""
    if path in seen:
        return seen
    seen.add(path)
    for name in re.findall(r'#include "([^"]+)"', path.read_text()):
        local_includes(path.parent / name, seen)
    return seen


def features_tested_by(source: Path) -> set[str]:
    """The instruction-set macros the source or its csrc/ headers test."""
    return {m for f in local_includes(source, set()) for m in FEATURE.findall(f.read_text())}


def predefined(march: str) -> set[str]:
    """The macros g++ predefines for ``-march``."""
    out = subprocess.run(
        ["g++", f"-march={march}", "-dM", "-E", "-x", "c++", "/dev/null"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define ")}


def jobs() -> list[tuple[Path, str]]:
    """(source, target) for each source whose paths depend on the instruction set and each
    target that takes another set of its paths than the others listed before it and than this
    machine's own build (which the other tests already compile): two targets that define the
    same macros of those the source tests compile the same code."""
    defined = {m: predefined(m) for m in (build.march(), *TARGETS)}
    out = []
    for source in build.all_sources():
        tested = features_tested_by(source)
        if not tested:
            continue
        seen = {frozenset(tested & defined[build.march()])}
        for march in TARGETS:
            paths = frozenset(tested & defined[march])
            if paths not in seen:
                seen.add(paths)
                out.append((source, march))
    return out


def compile_errors(source: Path, march: str) -> str:
    """g++'s errors for ``source`` built as build.py builds it, for ``march``; "" if none."""
    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    cmd = [
        "g++",
        "-fsyntax-only",
        *build.flags(march),
        "-DTORCH_EXTENSION_NAME=kvcache_kernels_check",
    ]
    cmd += [arg for p in includes for arg in ("-isystem", p)]
    done = subprocess.run([*cmd, str(source)], capture_output=True, text=True, check=False)
    return "" if done.returncode == 0 else done.stderr


def test_the_kernels_compile_for_every_instruction_set_they_have_a_path_for():
    assert shutil.which("g++"), "the kernels need g++ (scripts/setup.sh installs it)"
    todo = jobs()
    # the detection finds the kernels' paths: the scalar target differs from any vector one
    assert {(s.name, m) for s, m in todo} >= {
        ("attention.cpp", "x86-64"),
        ("readers.cpp", "x86-64"),
        ("turbo.cpp", "x86-64"),
    }
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        errors = list(pool.map(lambda job: compile_errors(*job), todo))
    failed = [
        f"{s.name} -march={m}:\n{e[:2000]}" for (s, m), e in zip(todo, errors, strict=True) if e
    ]
    assert not failed, "\n".join(failed)


def test_targets_that_define_the_same_tested_macros_are_compiled_once():
    """readers.cpp tests the VNNI macros (Ice Lake and Sapphire Rapids differ there);
    dense.cpp does not (one AVX-512 target for it); none repeats this machine's own set."""
    todo = jobs()
    native = predefined(build.march())
    for source in {s for s, _ in todo}:
        keys = [
            frozenset(features_tested_by(source) & predefined(m)) for s, m in todo if s == source
        ]
        assert len(set(keys)) == len(keys)
        assert frozenset(features_tested_by(source) & native) not in keys
    readers = features_tested_by(Path(build.__file__).parent / "csrc" / "readers.cpp")
    dense = features_tested_by(Path(build.__file__).parent / "csrc" / "dense.cpp")
    assert "__AVXVNNI__" in readers and "__AVX512F__" in dense and "__AVXVNNI__" not in dense


def test_a_source_that_does_not_compile_is_reported(tmp_path: Path):
    """The check itself: a source with an error in one path fails for that target only."""
    bad = tmp_path / "bad.cpp"
    bad.write_text("#if defined(__AVX512F__)\nint f() { return undefined_name; }\n#endif\n")
    assert compile_errors(bad, "x86-64-v3") == ""
    assert "undefined_name" in compile_errors(bad, "sapphirerapids")


def test_a_build_for_another_target_is_named_apart(monkeypatch: pytest.MonkeyPatch):
    """``KVCACHE_KERNEL_MARCH`` builds for another CPU than this one, into a folder of its own
    (a build for plain loops never answers for the native one)."""
    monkeypatch.delenv("KVCACHE_KERNEL_MARCH", raising=False)
    native = build.build_dir()
    assert "-march=native" in build.flags()
    monkeypatch.setenv("KVCACHE_KERNEL_MARCH", "x86-64")
    assert "-march=x86-64" in build.flags() and "-march=native" not in build.flags()
    assert build.build_dir() != native
    monkeypatch.setenv("KVCACHE_KERNEL_MARCH", " ")
    assert build.build_dir() == native


def test_the_build_reports_the_paths_its_target_takes():
    """``isa()`` (which decides whether the tests' reference rounds the query as the vector
    paths do) says what the build's target has: AVX-512 with BW and VL, AVX2 with FMA and
    F16C, or neither (csrc/simd.h's KVK_AVX512 and KVK_AVX2)."""
    from kvcache.kernels.build import extension

    have = predefined(build.march())
    avx2 = {"__AVX2__", "__FMA__", "__F16C__"} <= have
    avx512 = avx2 and {"__AVX512F__", "__AVX512BW__", "__AVX512VL__"} <= have
    assert extension().isa() == ("avx512" if avx512 else "avx2" if avx2 else "none")
