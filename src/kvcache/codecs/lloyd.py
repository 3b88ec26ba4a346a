"""Lloyd–Max fitting: the MSE-optimal scalar quantizer of one coordinate of a uniformly random
unit vector in R^P (what a rotated, normalised key or value coordinate is).

The coordinate has the density ``(1 - x^2)^a / B(1/2, a + 1)`` on [-1, 1], a = (P - 3) / 2
(for large P about N(0, 1/P): Max's 1960 Gaussian quantizer). Levels are fitted in numpy with
scipy's Beta functions and root finder, once per (P, bits); ``codebook.py`` turns them into
lookup tables. This is the only module that imports scipy, and nothing imports it until a
codebook is fitted (``import kvcache`` does not load scipy).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special, stats


class BetaCoordinate:
    """One coordinate x of a uniform unit vector in R^P: density (1-x^2)^a / B(1/2, a+1)."""

    def __init__(self, dim: int) -> None:
        self.a = (dim - 3) / 2.0
        self.log_norm = special.betaln(0.5, self.a + 1.0)
        # Second moments through the a+1 density: x^2 (1-x^2)^a = (1-x^2)^a - (1-x^2)^(a+1).
        self.ratio = math.exp(special.betaln(0.5, self.a + 2.0) - self.log_norm)

    def cdf(self, x: np.ndarray, extra: float = 0.0) -> np.ndarray:
        a = self.a + extra
        return np.asarray(stats.beta.cdf((x + 1.0) / 2.0, a + 1.0, a + 1.0))

    def first_moment(self, x: np.ndarray) -> np.ndarray:
        """Integral of t g(t) dt from -1 to x (closed form)."""
        base = np.clip(1.0 - x * x, 0.0, 1.0)
        return -np.power(base, self.a + 1.0) / (2.0 * (self.a + 1.0) * math.exp(self.log_norm))

    def centroids(self, c: np.ndarray) -> np.ndarray:
        """One Lloyd step: conditional means of the cells whose edges are midpoints of ``c``."""
        b = _edges(c)
        mass = np.diff(self.cdf(b))
        mean = np.diff(self.first_moment(b)) / np.where(mass > 0, mass, 1.0)
        return np.where(mass > 0, mean, c)

    def mse(self, c: np.ndarray) -> float:
        """Expected (x - Q(x))^2 of the nearest-centroid quantizer with levels ``c``."""
        b = _edges(c)
        mass = np.diff(self.cdf(b))
        m1 = np.diff(self.first_moment(b))
        m2 = mass - self.ratio * np.diff(self.cdf(b, extra=1.0))
        return float(np.sum(m2 - 2.0 * c * m1 + c * c * mass))


def _edges(c: np.ndarray) -> np.ndarray:
    return np.concatenate(([-1.0], (c[1:] + c[:-1]) / 2.0, [1.0]))


def lloyd_levels(dim: int, bits: int) -> tuple[np.ndarray, float]:
    """Optimal levels (unit-vector units, ascending) and their MSE for ``bits`` bits in R^dim."""
    dist = BetaCoordinate(dim)
    levels = 1 << bits
    # Panter–Dite start (point density ~ g^(1/3)), a few Lloyd steps, then a root finder on
    # the fixed point c = centroids(c): plain Lloyd needs > 20k steps to converge at 8 bits.
    u = (np.arange(levels) + 0.5) / levels
    a3 = dist.a / 3.0 + 1.0
    c = 2.0 * np.asarray(stats.beta.ppf(u, a3, a3)) - 1.0
    for _ in range(30):
        c = dist.centroids(c)
    sol = optimize.root(lambda v: dist.centroids(v) - v, c, method="hybr", options={"xtol": 1e-14})
    if np.all(np.diff(sol.x) > 0) and dist.mse(sol.x) <= dist.mse(c):
        c = sol.x
    return c, dist.mse(c)
