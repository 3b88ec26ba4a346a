"""benchmarks/seal_cost.py: decode steps with staggered and aligned lengths, both encoder
modes in turn, every codec against fp32 in the same run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import seal_cost
from kvcache.kernels import encode


def test_modes_take_turns_and_the_encoder_setting_is_put_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []
    served = encode.served

    def spy(x: torch.Tensor, *outputs: torch.Tensor) -> bool:
        seen.append(os.environ.get(encode.ENCODE_ENV, ""))
        return served(x, *outputs)

    monkeypatch.setattr(encode, "served", spy)
    monkeypatch.setenv(encode.ENCODE_ENV, "before")
    times = seal_cost.step_times(["fp32", "int8"], [61, 62, 63], steps=8)  # 29-31 rows wait
    assert [len(t) for c in ("fp32", "int8") for t in times[c].values()] == [4, 4, 4, 4]
    # the prompts seal under the setting found; the steps seal in both modes (steps 0-2)
    assert seen[0] == "before" and {"kernel", "reference"} <= set(seen)
    assert os.environ[encode.ENCODE_ENV] == "before"


def test_report_rows_and_files(tmp_path: Path) -> None:
    seal_cost.main(
        ["--codecs", "fp32", "int4", "--batch", "2", "--context", "140", "--steps", "4",
         "--out", str(tmp_path)]
    )  # fmt: skip
    rows = json.loads((tmp_path / "seal_cost.json").read_text())["rows"]
    assert [(r["layout"], r["codec"]) for r in rows] == [
        ("aligned", "fp32"), ("aligned", "int4"), ("staggered", "fp32"), ("staggered", "int4")
    ]  # fmt: skip
    for r in rows:
        assert r["kernel_ms"] > 0 and r["reference_ms"] > 0
        assert r["vs_fp32"] == pytest.approx(
            next(
                b["kernel_ms"] for b in rows if b["codec"] == "fp32" and b["layout"] == r["layout"]
            )
            / r["kernel_ms"]
        )
    assert (tmp_path / "seal_cost.png").stat().st_size > 1000
