"""Mask-only eviction vs compaction after a press, on real SmolLM2-135M: decode quality
and the cost of pressing (measure both, keep the better as the default).

Protocol: the Debian license texts (``common.license_tokens``), ``--windows`` windows of
PREFILL + SCORED tokens. Each window's first PREFILL tokens are prefilled under
``press.observe``, the press evicts ``--ratio`` of the cells (mask only: survivors keep their
positions; compact: renumbered 0..k-1, keys re-rotated), then the next SCORED tokens are fed
one per forward (teacher forcing, as decode) and scored. Against the unpressed cache of the
same codec: ΔPPL, KL and top-1 agreement. Also the press's time against the prefill's (both
measured in the same run). Writes benchmarks/results/press_compact.json.

    python benchmarks/press_compact.py --quick
    python benchmarks/press_compact.py --presses snapkv streaming knorm --codecs fp32 kivi4
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from common import license_tokens
from harness import table, write_json
from kvcache import Batch
from kvcache.models.llama import Llama
from kvcache.press import make_press
from kvcache.text.tokenizer import Tokenizer

PREFILL, SCORED, CHUNK = 1024, 128, 256


def run(
    model: Llama, tokens: list[int], codec: str, spec: str | None
) -> tuple[torch.Tensor, float, float]:
    """Log-probs [SCORED, V] of the continuation, prefill seconds, press seconds."""
    cache = model.new_cache(PREFILL + SCORED + 8, codec=codec)
    press = make_press(spec) if spec else None
    t0 = time.perf_counter()
    with press.observe(cache) if press else _nothing():
        for a in range(0, PREFILL, CHUNK):
            b = min(PREFILL, a + CHUNK)
            model.forward(tokens[a:b], Batch(list(range(a, b)), [0] * (b - a)), cache, outputs=[])
    t1 = time.perf_counter()
    if press:
        press.compress(cache, 0)
    t2 = time.perf_counter()
    out = []
    for i in range(SCORED):
        p = cache.next_position(0)
        logits = model.forward([tokens[PREFILL + i]], Batch([p], [0]), cache)  # predicts +1
        out.append(torch.log_softmax(logits[0].double(), dim=-1))
    return torch.stack(out), t1 - t0, t2 - t1


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 window, snapkv and streaming")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--presses", nargs="+", default=["snapkv", "streaming", "knorm"])
    ap.add_argument("--codecs", nargs="+", default=["fp32", "kivi4"])
    args = ap.parse_args(argv)
    if args.quick:
        args.windows, args.presses, args.codecs = 1, ["snapkv", "streaming"], ["fp32"]
    model = Llama.from_gguf(weights="fp32")
    tokenizer = Tokenizer.from_gguf()
    span = PREFILL + SCORED + 1
    text = license_tokens(tokenizer, args.windows * span)
    rows = []
    for codec in args.codecs:
        for w in range(args.windows):
            toks = text[w * span : (w + 1) * span]
            base, _, _ = run(model, toks, codec, None)
            target = torch.tensor(toks[PREFILL + 1 : PREFILL + 1 + SCORED])
            base_nll = -base[torch.arange(SCORED), target].mean().item()
            for name in args.presses:
                for mode in ("mask", "compact"):
                    spec = f"{name}:{args.ratio}" + (",compact=1" if mode == "compact" else "")
                    lp, prefill_s, press_s = run(model, toks, codec, spec)
                    nll = -lp[torch.arange(SCORED), target].mean().item()
                    kl = (base.exp() * (base - lp)).sum(-1).mean().item()
                    top1 = (lp.argmax(-1) == base.argmax(-1)).double().mean().item()
                    rows.append(
                        {
                            "codec": codec,
                            "window": w,
                            "press": name,
                            "mode": mode,
                            "dppl_pct": 100 * (math.exp(nll - base_nll) - 1),
                            "kl": kl,
                            "top1": top1,
                            "press_ms": 1000 * press_s,
                            "press_vs_prefill": press_s / prefill_s,
                        }
                    )
                    print(table(rows[-1:], list(rows[-1])), flush=True)
                    write_json("press_compact", {"ratio": args.ratio, "rows": rows})  # so far
    cols = ["codec", "window", "press", "mode", "dppl_pct", "kl", "top1", "press_ms"]
    print(table(rows, [*cols, "press_vs_prefill"]))
    write_json("press_compact", {"ratio": args.ratio, "prefill": PREFILL, "rows": rows})


if __name__ == "__main__":
    main()
