"""``python -m kvcache.kernels``: build the C++ kernels now (scripts/setup.sh does)."""

from kvcache.kernels.build import extension

print(f"[setup] kvcache kernels: {extension().__file__}")
