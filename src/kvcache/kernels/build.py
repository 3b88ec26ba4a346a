"""Build and load the C++ kernels (``csrc/``: attention over the cache, dense attention,
decode-sized linear layers, row ops of a decode step) with torch's extension builder.

The extension is compiled once per machine (``-O3 -march=native``: AVX-512 or AVX2/FMA/F16C
where the CPU has them, plain loops otherwise; ``$KVCACHE_KERNEL_MARCH`` names another target)
into ``$KVCACHE_KERNEL_DIR`` (default ``~/.cache/kvcache/kernels``), under a name that hashes
the sources, their folder, the flags, the torch version and the CPU (``-march=native`` code
built on one CPU may use instructions another lacks: a home folder shared by two machines must
not hand one the other's build), so a changed source, another checkout, another torch or
another CPU builds anew.
``scripts/setup.sh`` builds it (``python -m kvcache.kernels``, on every setup: a no-op when
built); otherwise a cache made for the CPU does (``CausalCache``: a few minutes, said on
stderr), before the first forward, so that no timed step (a prefill's tokens/s) includes it.
It runs on torch's intra-op thread pool (``at::parallel_for``): ``torch.set_num_threads``
sets its threads too. That needs ``-fopenmp`` (compile and link): ATen's ``parallel_for`` is a
header whose ``omp parallel`` pragma a build without it ignores, running every item on one
thread (``parallel_threads`` in the extension reports what a build really gets). The OpenMP
runtime linked is ``libgomp.so.1``, the soname torch's wheel loads first: one runtime per
process.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from kvcache.errors import NotSupportedError

# One extension per unit, folders of csrc/ each ("" = csrc/ itself): a unit's sources are the
# .cpp files of its folders, and its build hashes them with every header of csrc/ and of its
# folders, so a unit rebuilds alone when its own files change and never breaks another's load.
# The attention unit is csrc/ with one source per codec family in codecs/.
UNITS = {"attention": ("", "codecs"), "weights": ("weights",)}
FLAGS = ("-O3", "-march=native", "-std=c++17", "-fno-math-errno", "-fno-trapping-math", "-fopenmp")


def march() -> str:
    """The ``-march`` target of the build: ``$KVCACHE_KERNEL_MARCH`` where it is set, for
    another CPU than this one (``x86-64-v3`` for any AVX2 CPU, ``x86-64`` for plain loops), as
    for a folder of kernels shared by several machines, or to run the tests through another
    instruction set's paths; else ``native``."""
    return os.environ.get("KVCACHE_KERNEL_MARCH", "").strip() or "native"


def flags(target: str | None = None) -> list[str]:
    """FLAGS for ``target`` (default ``march()``) in place of ``-march=native``."""
    target = target or march()
    return [f"-march={target}" if f == "-march=native" else f for f in FLAGS]


def cpu_float32(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is float32 on the CPU, outside autograd: what the kernels that
    stand in for torch ops take (anything else goes to those ops)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return not grad and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def _source_dir() -> Path:
    return Path(__file__).resolve().parent / "csrc"


def unit_sources(unit: str = "attention") -> list[Path]:
    """The .cpp files of ``unit`` (a key of UNITS)."""
    if unit not in UNITS:
        raise NotSupportedError(f"no kernel unit {unit!r}; units: {sorted(UNITS)}")
    return sorted(s for folder in UNITS[unit] for s in (_source_dir() / folder).glob("*.cpp"))


def all_sources() -> list[Path]:
    """Every unit's .cpp files."""
    return [s for unit in UNITS for s in unit_sources(unit)]


def _unit_files(unit: str) -> list[Path]:
    """What a unit's build depends on: its sources, csrc/'s headers and its folders'."""
    folders = [_source_dir() / f for f in ("", *UNITS[unit])]
    headers = {h for folder in folders for h in folder.glob("*.h")}
    return unit_sources(unit) + sorted(headers)


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags (Linux), else
    what the platform module knows."""
    model = flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value.strip()
                if model and flags:
                    break
    except OSError:
        pass
    return "|".join((platform.machine(), platform.processor(), model, flags))


def _build_name(unit: str = "attention") -> str:
    h = hashlib.sha256()
    for path in _unit_files(unit):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(" ".join(flags()).encode())
    # torch's build.ninja names the sources by absolute path: a folder per checkout, or two
    # checkouts of the same sources would rebuild each other's kernels on every load
    h.update(str(_source_dir()).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_identity().encode())
    prefix = "kvcache_kernels" if unit == "attention" else f"kvcache_{unit}"
    return f"{prefix}_{h.hexdigest()[:12]}"


def build_dir(unit: str = "attention") -> Path:
    root = os.environ.get("KVCACHE_KERNEL_DIR") or Path.home() / ".cache" / "kvcache" / "kernels"
    return Path(root) / _build_name(unit)


@functools.cache
def extension(unit: str = "attention") -> ModuleType:
    """The compiled kernels of ``unit`` (built on first use; NotSupportedError if that fails)."""
    from torch.utils.cpp_extension import load

    where = build_dir(unit)
    where.mkdir(parents=True, exist_ok=True)
    if not (where / f"{where.name}.so").exists():  # minutes of silence otherwise
        print(
            f"kvcache: compiling the C++ kernels for this CPU into {where} "
            "(once for these sources; a few minutes)",
            file=sys.stderr,
            flush=True,
        )
    # ninja's default of cores + 2 jobs runs ~1.5 GB compilers beyond the cores: one a core
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    # torch runs `ninja` from PATH: the pip-installed one sits beside this interpreter
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        with _exclusive(where):
            return load(
                name=where.name,
                sources=[str(s) for s in unit_sources(unit)],
                extra_cflags=flags(),
                extra_ldflags=["-fopenmp"],
                build_directory=str(where),
                verbose=bool(os.environ.get("KVCACHE_KERNEL_VERBOSE")),
            )
    except (RuntimeError, OSError, ImportError) as e:
        raise NotSupportedError(
            f"the kvcache kernels did not build in {where} ({e}); they need g++ "
            "and ninja (bash scripts/setup.sh installs them)"
        ) from e


@contextlib.contextmanager
def _exclusive(where: Path) -> Iterator[None]:
    """One builder at a time, through an OS lock the kernel drops when its holder dies.

    torch's own ``lock`` file is a plain file: a build killed mid-way (a timeout, ^C) leaves
    it behind and every later ``load`` waits for it forever. Under this lock nobody else is
    building, so a ``lock`` file found here is stale and is removed."""
    with open(where / "kvcache.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (where / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
