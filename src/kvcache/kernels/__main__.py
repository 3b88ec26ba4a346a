"""``python -m kvcache.kernels``: build the C++ kernels of every unit now (scripts/setup.sh does)."""

from kvcache.kernels.build import UNITS, extension, unit_sources

for unit in UNITS:
    if unit_sources(unit):
        print(f"[setup] kvcache kernels ({unit}): {extension(unit).__file__}")
