"""Attention over a sequence's cells straight from the stored codes.

``plan.py`` says which cells each batch row reads (its own sequence's, shared prefixes once);
``attend.py`` runs it (C++ kernels in ``csrc/``, built by ``build.py``; torch's fused kernel
for prompt chunks); ``reference.py`` is the plain-torch grouped attention tests compare with.
"""

from kvcache.kernels.plan import AttentionPlan, RowBounds
from kvcache.kernels.reference import grouped_attention

__all__ = ["AttentionPlan", "RowBounds", "grouped_attention"]
