"""GGUF reading: metadata, Q/K un-permutation (round trip through a GGUF we write), typed
errors, and the tokenizer + chat template rebuilt from the SmolLM2 file (checked against
transformers' own GGUF tokenizer)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from kvcache.errors import InvalidArgumentError, NotSupportedError
from kvcache.models.llama import Llama, LlamaConfig
from kvcache.text.tokenizer import Tokenizer
from kvcache.weights.gguf import GGUFFile, unpermute_rope_rows

SMALL = LlamaConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    rope_theta=5000.0,
    rms_eps=2.0**-17,  # exact in the float32 GGUF stores
    context_length=128,
)


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> interleaved pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_llama_gguf(
    path: Path, model: Llama, *, arch: str = "llama", bad_type: bool = False
) -> None:
    """A GGUF as llama.cpp's converter writes it (Q/K permuted, F32 tensors)."""
    c, w = model.config, model.weights
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.context_length)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_eps)
    writer.add_vocab_size(c.vocab_size)

    def put(name: str, t: torch.Tensor) -> None:
        writer.add_tensor(name, t.to(torch.float32).numpy())

    put("token_embd.weight", w.embed)
    put("output_norm.weight", w.norm)
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i, layer in enumerate(w.layers):
        q, k, v = layer.wqkv.split([q_rows, kv_rows, kv_rows])
        gate, up = layer.w_gate_up.split(c.intermediate_size)
        p = f"blk.{i}."
        put(p + "attn_norm.weight", layer.attn_norm)
        writer.add_tensor(
            p + "attn_q.weight", permute_like_llama_cpp(q.float().numpy(), c.num_heads)
        )
        writer.add_tensor(
            p + "attn_k.weight", permute_like_llama_cpp(k.float().numpy(), c.num_kv_heads)
        )
        if bad_type and i == 1:
            writer.add_tensor(p + "attn_v.weight", np.zeros(v.shape, dtype=np.int32))
        else:
            put(p + "attn_v.weight", v)
        put(p + "attn_output.weight", layer.wo)
        put(p + "ffn_norm.weight", layer.mlp_norm)
        put(p + "ffn_gate.weight", gate)
        put(p + "ffn_up.weight", up)
        put(p + "ffn_down.weight", layer.w_down)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def small() -> Llama:
    return Llama.random(SMALL, seed=3, dtype=torch.float32)


def test_round_trip_through_gguf_unpermutes_q_and_k(tmp_path: Path, small: Llama):
    path = tmp_path / "small.gguf"
    write_llama_gguf(path, small)
    loaded = Llama.from_gguf(path)
    assert loaded.config == SMALL
    for a, b in zip(loaded.weights.layers, small.weights.layers, strict=True):
        assert torch.equal(a.wqkv, b.wqkv)
        assert torch.equal(a.w_gate_up, b.w_gate_up)
    ids = [3, 14, 15, 9, 2, 6, 5, 35]
    assert torch.allclose(loaded.forward_full(ids), small.forward_full(ids), atol=1e-6)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    for heads in (1, 2, 3):
        back = unpermute_rope_rows(torch.from_numpy(permute_like_llama_cpp(w, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))


def test_missing_and_invalid_files(tmp_path: Path):
    with pytest.raises(InvalidArgumentError, match="path"):
        Llama.from_gguf(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(InvalidArgumentError, match="GGUF"):
        GGUFFile(junk)


def test_non_llama_architecture_is_refused(tmp_path: Path, small: Llama):
    path = tmp_path / "gpt2.gguf"
    write_llama_gguf(path, small, arch="gpt2")
    with pytest.raises(NotSupportedError, match="gpt2"):
        Llama.from_gguf(path)


def test_unsupported_tensor_type_is_named(tmp_path: Path, small: Llama):
    path = tmp_path / "int.gguf"
    write_llama_gguf(path, small, bad_type=True)
    with pytest.raises(NotSupportedError, match=r"blk\.1\.attn_v\.weight.*I32"):
        Llama.from_gguf(path)
    with GGUFFile(path) as f, pytest.raises(InvalidArgumentError, match="name"):
        f.tensor("no.such.tensor")


def test_smollm2_metadata_and_tensor_types(smollm2_file: Path):
    with GGUFFile(smollm2_file) as f:
        assert f.architecture == "llama"
        assert f.get("llama.block_count") == 30
        types = {f._tensors[n].tensor_type for n in f.tensor_names()}
        assert types == {
            GGMLQuantizationType.Q4_1,
            GGMLQuantizationType.Q8_0,
            GGMLQuantizationType.F32,
        }
        embed = f.tensor("token_embd.weight", torch.float64)
        assert embed.shape == (49152, 576) and embed.dtype == torch.float64


TEXTS = [
    "Hello world!",
    "  leading spaces,\ttabs\n\nand newlines",
    "The year 2024 had 366 days; pi = 3.14159",
    "Ünïcödé — emoji 🤖👍 and 中文字符",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "don't won't I'll we've",
    "def f(x):\n    return x**2  # comment",
]


def test_tokenizer_matches_transformers_gguf_tokenizer(tokenizer: Tokenizer, smollm2_file: Path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smollm2_file.parent), gguf_file=smollm2_file.name)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tokenizer.decode(ids, skip_special=False) == text
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    for conversation in (messages, messages[1:2]):
        assert tokenizer.apply_chat(conversation) == hf.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )


def test_tokenizer_special_tokens(tokenizer: Tokenizer):
    assert tokenizer.encode("<|im_start|>") == [tokenizer.token_id("<|im_start|>")]
    assert tokenizer.eos_id == tokenizer.token_id("<|im_end|>")
    assert tokenizer.token_id("<|endoftext|>") in tokenizer.stop_ids
    assert tokenizer.decode(tokenizer.encode("<|im_start|>hi")) == "hi"  # specials skipped
    with pytest.raises(InvalidArgumentError, match="messages"):
        tokenizer.apply_chat([{"role": "user"}])


def test_tokenizer_kinds_we_cannot_build_are_refused(tmp_path: Path):
    path = tmp_path / "wpm.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("bert")  # WordPiece: neither byte-level BPE nor SentencePiece
    writer.add_token_list(["<unk>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(NotSupportedError, match="tokenizer.ggml.model='bert'.*'gpt2', 'llama'"):
        Tokenizer.from_gguf(path)
