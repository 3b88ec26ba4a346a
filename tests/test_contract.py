"""The codec-kernel contract: csrc/contract.h mirrors kernels/contract.py, and a Layout is
handed to the readers in the contract's order."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from kvcache.codecs.base import Layout
from kvcache.kernels import build, contract


def header_enum(text: str, name: str) -> dict[str, int]:
    """The members of C++ enum ``name`` in ``text`` and their values (implicit ones counted on)."""
    body = re.search(rf"enum {name}\b[^{{]*\{{([^}}]*)\}}", text)
    assert body is not None, f"enum {name} not in the header"
    out, value = {}, -1
    for item in body.group(1).split(","):
        member, _, given = item.strip().partition("=")
        if member:
            value = int(given) if given.strip() else value + 1
            out[member.strip()] = value
    return out


def test_the_header_mirrors_the_python_contract():
    """csrc/contract.h's kinds, slots, RoPE modes and limits are kernels/contract.py's."""
    text = (Path(build.__file__).parent / "csrc" / "contract.h").read_text()
    assert header_enum(text, "Kind") == {k.name: k.value for k in contract.Kind}
    assert header_enum(text, "RopeMode") == {m.name: m.value for m in contract.RopeMode}
    slots = header_enum(text, "Slot")
    assert slots.pop("NUM_SLOTS") == len(contract.SLOTS)
    assert slots == {name.upper(): i for i, name in enumerate(contract.SLOTS)}
    ints = header_enum(text, "IntSlot")
    assert ints.pop("NUM_INTS") == len(contract.INT_SLOTS)
    assert ints == {name.upper(): i for i, name in enumerate(contract.INT_SLOTS)}
    limits = dict(re.findall(r"constexpr int (\w+) = (\d+);", text))
    assert int(limits["kMaxDim"]) == contract.MAX_DIM and int(limits["kAlign"]) == contract.ALIGN


def test_a_layout_is_handed_over_in_the_contracts_order():
    """layout_args gives every SLOTS field of the Layout in order, and the ints by name."""
    layout = Layout(kind=contract.Kind.TURBO, data=torch.zeros(2), bits=5, group=32,
                    log_scale=True, rotated=True, centre_rope=True)  # fmt: skip
    for i, name in enumerate(contract.SLOTS):
        setattr(layout, name, torch.full((1,), float(i)))
    tensors, ints = contract.layout_args(layout, pre_rope=False)
    assert [int(t.item()) for t in tensors] == list(range(len(contract.SLOTS)))
    want = {"kind": 6, "bits": 5, "group": 32, "log_scale": 1, "rope_mode": 2, "rotated": 1}
    assert ints == [want[name] for name in contract.INT_SLOTS]
    layout.centre_rope = False
    assert contract.layout_args(layout, pre_rope=True)[1][4] == contract.RopeMode.BEFORE_ROPE
    assert contract.layout_args(layout, pre_rope=False)[1][4] == contract.RopeMode.AFTER_ROPE
