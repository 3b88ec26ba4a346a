"""kernels.dense: unmasked attention over dense windows (Whisper's cross-attention) against a
float64 softmax reference, for every way rows can share windows."""

from __future__ import annotations

import pytest
import torch

from kvcache.kernels import dense as Dn


def _float64(q, keys, values, windows, scale):  # type: ignore[no-untyped-def]
    out = torch.empty(q.shape, dtype=torch.float64)
    for t, a in enumerate(windows):
        s = torch.einsum("hd,hsd->hs", q[t].double(), keys[a].double()) * scale
        out[t] = torch.einsum("hs,hsd->hd", s.softmax(-1), values[a].double())
    return out


CASES = {
    "one row": (1, 1500, [0]),
    "beams of one window": (1, 1500, [0] * 5),
    "files, one row each": (8, 1500, list(range(8))),
    "files, mixed rows, unused window": (4, 37, [2, 0, 2, 2, 0, 3, 2, 0]),
    "short odd windows": (3, 7, [1, 1, 0, 2]),
    "one key": (2, 1, [1, 0, 1]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("d", [8, 64])
def test_kernel_equals_float64_softmax(case: str, d: int) -> None:
    a, s, windows = CASES[case]
    g = torch.Generator().manual_seed(len(windows) * 100 + s + d)
    keys, values = torch.randn(a, 3, s, d, generator=g), torch.randn(a, 3, s, d, generator=g)
    q = torch.randn(len(windows), 3, d, generator=g) * 2.0
    with torch.no_grad():
        assert Dn.served(q, keys)
        got = Dn.dense_attention(q, keys, values, windows, 0.3)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(
        got.double(), _float64(q, keys, values, windows, 0.3), rtol=1e-5, atol=1e-5
    )


def test_rows_do_not_depend_on_their_neighbours_or_threads() -> None:
    """A row's output is bit-identical alone and beside other rows, on 1 or 2 threads."""
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(3, 6, 300, 64, generator=g), torch.randn(3, 6, 300, 64, generator=g)
    windows = [0, 2, 2, 1, 2, 0, 2]
    q = torch.randn(len(windows), 6, 64, generator=g)
    previous = torch.get_num_threads()
    try:
        with torch.no_grad():
            alone = torch.cat(
                [
                    Dn.dense_attention(q[i : i + 1], keys, values, [w], 0.125)
                    for i, w in enumerate(windows)
                ]
            )
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(Dn.dense_attention(q, keys, values, windows, 0.125), alone)
    finally:
        torch.set_num_threads(previous)


def test_what_the_kernel_does_not_serve_runs_the_reference() -> None:
    g = torch.Generator().manual_seed(6)
    keys, values = torch.randn(2, 2, 9, 12, generator=g), torch.randn(2, 2, 9, 12, generator=g)
    q = torch.randn(3, 2, 12, generator=g)  # D = 12: not a multiple of 8
    assert not Dn.served(q, keys)
    got = Dn.dense_attention(q, keys, values, [1, 0, 1], 0.5)
    torch.testing.assert_close(
        got.double(), _float64(q, keys, values, [1, 0, 1], 0.5), rtol=0, atol=1e-6
    )
    assert not Dn.served(q.double(), keys.double())


def test_bad_windows_are_refused() -> None:
    keys = torch.randn(2, 1, 4, 8)
    q = torch.randn(2, 1, 8)
    ext = Dn.extension()
    with pytest.raises(RuntimeError, match="window out of range"):
        ext.dense_attention(q, keys, keys, torch.tensor([0, 2]), 1.0)
    with pytest.raises(RuntimeError, match="windows"):
        ext.dense_attention(q, keys, keys, torch.tensor([0]), 1.0)
