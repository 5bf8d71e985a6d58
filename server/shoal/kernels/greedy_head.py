"""The LM head of a step whose requests read only each row's argmax (greedy, nothing else asked),
read in a quarter of the bytes and exact.

At a few decode rows the LM head is what streaming its weight costs (a small model's head is a
large share of what a one-row step reads). A greedy token needs only the largest logit, so the
head is first computed from an int8 copy of its weight (per-row scales, a quarter of the bytes),
and each row's logits are bounded: for every vocabulary row j,

    |z_j - a_j| <= eps_j = ||x|| * (||W_j - s_j Q_j|| + gamma * (||W_j|| + s_j ||Q_j||))
                           + 2u |a_j|

where z_j is the float32 logit (any order of summation), a_j the int8 copy's, x the row's
hidden state, u float32's unit roundoff and gamma = (n + 1) u / (1 - (n + 1) u) for n = hidden
size: the first term bounds the weights' rounding by Cauchy-Schwarz, the second both float32
sums' rounding, the third the scale's product. The largest z is then among the candidates
a_j + eps_j >= max_i (a_i - eps_i), whose logits are computed exactly from the float32 weight;
every other logit is left at -inf, which an argmax never picks. The token is the one the full
float32 head gives (its logits, up to the order float32 sums in). A row has a few candidates
(docs/perf-log.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from shoal.kernels.linear_kernels import int8_panels_run
from shoal.kernels.panel_products import Panels, by_panels
from shoal.kernels.quantization import quantize_per_channel

_UNIT_ROUNDOFF = 2.0 ** -24
# a decode step of up to this many rows takes the screened head: past it the head's products
# are bound by their multiply-adds, which an int8 copy does not reduce (docs/perf-log.md)
MAX_ROWS = 4
_BOUND_ROWS = 4096


@dataclass(frozen=True)
class GreedyHead:
    """An LM head weight [vocab, hidden] (float32), its int8 copy in panels, and each vocabulary
    row's error bound per unit of the hidden state's norm (float64)."""

    weight: torch.Tensor
    screen: Panels
    bound: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> GreedyHead:
        q, scale = quantize_per_channel(weight)
        steps = weight.shape[1] + 1
        gamma = steps * _UNIT_ROUNDOFF / (1 - steps * _UNIT_ROUNDOFF)
        bound = torch.empty(weight.shape[0], dtype=torch.float64)
        for start in range(0, weight.shape[0], _BOUND_ROWS):  # float64 copies of a slice at a time
            rows = slice(start, start + _BOUND_ROWS)
            exact, q64, scale64 = weight[rows].double(), q[rows].double(), scale[rows].double()
            bound[rows] = ((exact - q64 * scale64[:, None]).norm(dim=1)
                           + gamma * (exact.norm(dim=1) + scale64 * q64.norm(dim=1)))
        return cls(weight, Panels.of(q.numpy(), scale.numpy()), bound)

    @property
    def nbytes(self) -> int:
        return self.screen.nbytes + self.bound.numel() * self.bound.element_size()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] float32 for hidden [rows, hidden] float32: each row's exact logits where
        the largest can be, -inf elsewhere."""
        vocab = self.weight.shape[0]
        approx = by_panels(hidden, self.screen).numpy()
        norms = hidden.double().norm(dim=1).numpy()
        rows, columns = (torch.from_numpy(a) for a in _candidates(approx, vocab, norms,
                                                                  self.bound.numpy()))
        logits = torch.full((hidden.shape[0], vocab), float("-inf"), dtype=torch.float32)
        logits[rows, columns] = (self.weight[columns] * hidden[rows]).sum(dim=1)
        return logits


@numba.njit(cache=True)
def _candidates(approx: np.ndarray, vocab: int, norms: np.ndarray, bound: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of every logit that can be its row's largest: a_j + eps_j >= the row's
    max(a_i - eps_i), for the int8 copy's logits `approx` [rows, >= vocab] (float32), each
    row's hidden-state norm and each column's bound (float64)."""
    rows: list[int] = []
    columns: list[int] = []
    eps = np.empty(vocab)
    for r in range(approx.shape[0]):
        floor = -np.inf
        for j in range(vocab):
            eps[j] = norms[r] * bound[j] * (1 + 1e-6) + 2 * _UNIT_ROUNDOFF * abs(approx[r, j])
            floor = max(floor, approx[r, j] - eps[j])
        for j in range(vocab):
            if approx[r, j] + eps[j] >= floor:
                rows.append(r)
                columns.append(j)
    return np.array(rows, np.int64), np.array(columns, np.int64)


def enabled_for(device: torch.device, dtype: torch.dtype, tp_size: int, quantized: bool) -> bool:
    """Whether a model of these settings screens its greedy steps' LM head: float32 weights on
    the CPU (an int8 head reads no more than the screen would), one tensor-parallel rank (the
    whole vocabulary on it), and the int8 panels run here."""
    return (device.type == "cpu" and dtype == torch.float32 and tp_size == 1 and not quantized
            and int8_panels_run())
