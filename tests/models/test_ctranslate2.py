"""The CTranslate2 model.bin reader: the bundled tiny.en, files written by ctranslate2 itself, bad files."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from ctranslate2.specs import common_spec, model_spec

from kvcache.errors import InvalidArgumentError, KVCacheError
from kvcache.weights.ctranslate2 import ModelFileError, bundled_whisper_dir, read_model_bin


def _expected_tiny_en_shapes() -> dict[str, tuple[int, ...]]:
    """Every variable of a CTranslate2 WhisperSpec for tiny.en, from the model's dimensions."""
    n, f, v, mels = 384, 1536, 51864, 80
    shapes: dict[str, tuple[int, ...]] = {
        "encoder/conv1/weight": (n, mels, 3), "encoder/conv1/bias": (n,),
        "encoder/conv2/weight": (n, n, 3), "encoder/conv2/bias": (n,),
        "encoder/position_encodings/encodings": (1500, n),
        "encoder/layer_norm/gamma": (n,), "encoder/layer_norm/beta": (n,),
        "encoder/num_heads": (),
        "decoder/embeddings/weight": (v, n),
        "decoder/position_encodings/encodings": (448, n),
        "decoder/layer_norm/gamma": (n,), "decoder/layer_norm/beta": (n,),
        "decoder/num_heads": (), "decoder/activation": (), "decoder/alibi": (),
        "decoder/alignment_heads": (), "decoder/alignment_layer": (), "decoder/pre_norm": (),
        "decoder/scale_embeddings": (), "decoder/start_from_zero_embedding": (),
    }  # fmt: skip

    def ln(p: str) -> None:
        shapes[f"{p}/gamma"] = (n,)
        shapes[f"{p}/beta"] = (n,)

    def lin(p: str, out: int, inp: int) -> None:
        shapes[f"{p}/weight"] = (out, inp)
        shapes[f"{p}/bias"] = (out,)

    for side in ("encoder", "decoder"):
        for i in range(4):
            p = f"{side}/layer_{i}"
            ln(f"{p}/self_attention/layer_norm")
            lin(f"{p}/self_attention/linear_0", 3 * n, n)  # fused Q|K|V
            lin(f"{p}/self_attention/linear_1", n, n)
            ln(f"{p}/ffn/layer_norm")
            lin(f"{p}/ffn/linear_0", f, n)
            lin(f"{p}/ffn/linear_1", n, f)
            if side == "decoder":
                ln(f"{p}/attention/layer_norm")
                lin(f"{p}/attention/linear_0", n, n)
                lin(f"{p}/attention/linear_1", 2 * n, n)  # fused cross K|V
                lin(f"{p}/attention/linear_2", n, n)
    return shapes


def test_bundled_tiny_en_loads_every_variable_with_its_shape() -> None:
    m = read_model_bin(bundled_whisper_dir())
    assert (m.version, m.spec, m.revision) == (6, "WhisperSpec", 3)
    expected = _expected_tiny_en_shapes()
    got = {name: tuple(t.shape) for name, t in m.variables.items()}
    assert got == expected
    assert m.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    assert m.raw("decoder/embeddings/weight").dtype == torch.float16  # stored as float16
    proj = m.tensor("decoder/projection/weight")  # through the alias, upcast
    assert proj.dtype == torch.float32 and proj.shape == (51864, 384)
    assert torch.equal(proj, m.raw("decoder/embeddings/weight").float())
    assert m.scalar("decoder/num_heads") == 6 and m.scalar("encoder/num_heads") == 6
    for t in m.variables.values():
        assert torch.isfinite(t.float()).all()


class _TinySpec(model_spec.ModelSpec):
    """A two-layer spec written by ctranslate2's own serializer (the reference writer)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = common_spec.LinearSpec()
        self.proj = common_spec.LinearSpec()
        self.emb = common_spec.EmbeddingsSpec()
        self.num_heads = np.dtype("int16").type(6)

    @property
    def name(self) -> str:
        return "TinySpec"

    @property
    def revision(self) -> int:
        return 7


def _write_spec(path: Path, quantization: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((5, 3)).astype(np.float32)
    ref = {
        "dense/weight": w.copy(),
        "dense/bias": rng.standard_normal(5).astype(np.float32),
        "emb/weight": rng.standard_normal((11, 3)).astype(np.float32),
    }
    spec = _TinySpec()
    spec.dense.weight = w.copy()  # ctranslate2 quantizes the arrays in place: give it copies
    spec.dense.bias = ref["dense/bias"].copy()
    spec.proj.weight = w.copy()  # equal to dense/weight: saved as an alias
    spec.emb.weight = ref["emb/weight"].copy()
    spec.validate()
    spec.optimize(quantization=quantization)
    spec._serialize(str(path))
    return ref


@pytest.mark.parametrize(
    ("quantization", "stored", "tol"),
    [("float32", torch.float32, 0.0), ("float16", torch.float16, 1e-3), ("int8", torch.int8, 0.02)],
)
def test_reads_what_ctranslate2_writes(
    tmp_path: Path, quantization: str, stored: torch.dtype, tol: float
) -> None:
    ref = _write_spec(tmp_path / "model.bin", quantization)
    m = read_model_bin(tmp_path)
    assert (m.spec, m.revision, m.version) == ("TinySpec", 7, 6)
    assert m.aliases == {"proj/weight": "dense/weight"}
    assert m.raw("dense/weight").dtype == stored
    assert ("dense/weight_scale" in m.variables) == (quantization == "int8")
    for name, want in ref.items():
        got = m.tensor(name).numpy()
        assert got.shape == want.shape
        # int8: per-row scale 127/amax, so the error is at most half a step of amax/127
        bound = tol * np.abs(want).max() if quantization == "int8" else tol
        assert np.abs(got - want).max() <= bound + 1e-7, name
    assert torch.equal(m.tensor("proj/weight"), m.tensor("dense/weight"))
    assert m.scalar("num_heads") == 6


def test_wrong_version_is_a_typed_error(tmp_path: Path) -> None:
    p = tmp_path / "model.bin"
    p.write_bytes(struct.pack("<I", 99) + b"\0" * 16)
    with pytest.raises(ModelFileError, match="format version 99") as e:
        read_model_bin(p)
    assert isinstance(e.value, KVCacheError) and isinstance(e.value, ValueError)
    assert e.value.name == "path" and e.value.offset == 0


def test_not_a_model_file(tmp_path: Path) -> None:
    p = tmp_path / "model.bin"
    p.write_bytes(b"RIFF....WAVEfmt this is not a model")
    with pytest.raises(ModelFileError):
        read_model_bin(p)


@pytest.mark.parametrize("cut", [2, 9, 30, 60, -200, -20, -1])
def test_truncated_file_names_the_offset(tmp_path: Path, cut: int) -> None:
    _write_spec(tmp_path / "full.bin", "float32")
    data = (tmp_path / "full.bin").read_bytes()
    p = tmp_path / "model.bin"
    p.write_bytes(data[:cut])
    with pytest.raises(ModelFileError, match="truncated") as e:
        read_model_bin(p)
    assert 0 <= e.value.offset <= len(data[:cut])


def test_trailing_bytes_and_bad_dtype(tmp_path: Path) -> None:
    _write_spec(tmp_path / "full.bin", "float32")
    data = (tmp_path / "full.bin").read_bytes()
    (tmp_path / "extra.bin").write_bytes(data + b"\0\0")
    with pytest.raises(ModelFileError, match="trailing"):
        read_model_bin(tmp_path / "extra.bin")
    # the first variable: u32 version, spec string, u32 revision, u32 count, then name...
    off = 4 + 2 + len(b"TinySpec\0") + 4 + 4
    name_len = struct.unpack_from("<H", data, off)[0]
    rank_at = off + 2 + name_len
    rank = data[rank_at]
    dtype_at = rank_at + 1 + 4 * rank
    bad = bytearray(data)
    bad[dtype_at] = 42
    (tmp_path / "dtype.bin").write_bytes(bytes(bad))
    with pytest.raises(ModelFileError, match="unknown dtype code 42"):
        read_model_bin(tmp_path / "dtype.bin")


def test_missing_file_and_unknown_variable(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="path"):
        read_model_bin(tmp_path / "nope.bin")
    _write_spec(tmp_path / "model.bin", "float32")
    m = read_model_bin(tmp_path / "model.bin")
    with pytest.raises(InvalidArgumentError, match="name"):
        m.tensor("decoder/nothing")
