"""Fixtures of the transformers-adapter tests: the real SmolLM2 and Gemma 3 session fixtures
are reused from ``tests/models/conftest.py`` (loaded by path: the test folders are not
packages), so each GGUF -> transformers conversion is done once and cached under pytest's
cache dir."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_MODELS_CONFTEST = Path(__file__).resolve().parent.parent / "models" / "conftest.py"
_spec = importlib.util.spec_from_file_location("kvcache_tests_models_conftest", _MODELS_CONFTEST)
assert _spec is not None and _spec.loader is not None, f"cannot load {_MODELS_CONFTEST}"
_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_models)

smollm2_file = _models.smollm2_file
tokenizer = _models.tokenizer
hf_model = _models.hf_model
gemma3_file = _models.gemma3_file
gemma3_tokenizer = _models.gemma3_tokenizer
gemma3_hf_dir = _models.gemma3_hf_dir
gemma3_hf = _models.gemma3_hf
