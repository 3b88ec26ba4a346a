"""Serving: continuous batching over one cell cache, prefix reuse, block stores, HTTP."""
