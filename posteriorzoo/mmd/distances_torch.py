"""The fast distance path of :mod:`posteriorzoo.mmd.distances_fast` in torch, on any device.

The same arithmetic as the numba/numpy engine, so that a GPU runs it and the CPU tests it:
each block is centred on a reference (the mean of X's rows over the block; Y's own mean
for Y's self-distances) and rounded to float32 on the device; L2 through
``torch.matmul`` (``N_i + N_j - 2 G_ij``) and L1 through ``torch.cdist(p=1)``, each over
chunks of at most :data:`~posteriorzoo.mmd.distances_fast.GRAM_CHUNK` /
:data:`~posteriorzoo.mmd.distances_fast.L1_CHUNK` features in float32, accumulated in
float64 on the device. The error bound of :mod:`~posteriorzoo.mmd.distances_fast` holds
as stated (it allows any order of summation within a chunk). Results come back to the
host as float64 numpy arrays in the layout of
:class:`~posteriorzoo.mmd.distances.Distances`.

torch is imported only when this engine is asked for (``device`` other than ``"cpu"``,
or directly).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from posteriorzoo.devices import check_device
from posteriorzoo.mmd.distances_fast import GRAM_CHUNK, L1_CHUNK


class TorchDistances:
    """The engine behind ``SharedTargetDistances(device=...)`` (see
    :class:`~posteriorzoo.mmd.distances_fast.FastDistances` for the interface)."""

    def __init__(self, m: int, ns: Sequence[int], within: bool = True,
                 device: str = "cpu") -> None:
        import torch

        self.torch = torch
        self.device = check_device(device)
        self.m, self.ns, self.within = int(m), [int(n) for n in ns], within

        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.float64, device=self.device)

        self.norms_x = zeros(m)
        self.norms_yx = [zeros(n) for n in self.ns]
        self.gram_xy = [zeros(m, n) for n in self.ns]
        self.l1_xy = [zeros(m, n) for n in self.ns]
        if within:
            self.gram_xx, self.l1_xx = zeros(m, m), zeros(m, m)
            self.norms_yy = [zeros(n) for n in self.ns]
            self.gram_yy = [zeros(n, n) for n in self.ns]
            self.l1_yy = [zeros(n, n) for n in self.ns]

    def _centred(self, block: np.ndarray, reference):
        """(rows, b) float32 on the device: ``block - reference`` rounded once."""
        values = self.torch.from_numpy(block).to(self.device, self.torch.float64)
        return (values - reference).to(self.torch.float32)

    def _add(self, a, b, gram, l1) -> None:
        """gram += a b^T and l1 += cdist_1(a, b), float32 per chunk, float64 sums."""
        torch = self.torch
        for start in range(0, a.shape[1], GRAM_CHUNK):
            part_a, part_b = a[:, start:start + GRAM_CHUNK], b[:, start:start + GRAM_CHUNK]
            gram += torch.matmul(part_a, part_b.T).to(torch.float64)
        for start in range(0, a.shape[1], L1_CHUNK):
            l1 += torch.cdist(a[:, start:start + L1_CHUNK], b[:, start:start + L1_CHUNK],
                              p=1).to(torch.float64)

    def _norms(self, values, out) -> None:
        out += (values.to(self.torch.float64) ** 2).sum(dim=1)

    def update(self, x_block: np.ndarray, y_blocks: Sequence[np.ndarray]) -> None:
        """Accumulate one block of features (shapes and dtypes already checked)."""
        torch = self.torch
        x64 = torch.from_numpy(x_block).to(self.device, torch.float64)
        reference = x64.mean(dim=0)
        x = (x64 - reference).to(torch.float32)
        del x64
        self._norms(x, self.norms_x)
        if self.within:
            self._add(x, x, self.gram_xx, self.l1_xx)
        for k, y_block in enumerate(y_blocks):
            y = self._centred(y_block, reference)
            self._norms(y, self.norms_yx[k])
            self._add(x, y, self.gram_xy[k], self.l1_xy[k])
            if self.within:
                y64 = torch.from_numpy(y_block).to(self.device, torch.float64)
                own = (y64 - y64.mean(dim=0)).to(torch.float32)
                self._norms(own, self.norms_yy[k])
                self._add(own, own, self.gram_yy[k], self.l1_yy[k])

    def _squared(self, norms_a, norms_b, gram):
        return (norms_a[:, None] + norms_b[None, :] - 2 * gram).clamp_(min=0.0)

    def _host_packed(self, matrix) -> np.ndarray:
        rows = matrix.shape[0]
        upper = self.torch.triu_indices(rows, rows, 1, device=self.device)
        return matrix[upper[0], upper[1]].cpu().numpy()

    def xx(self) -> tuple[np.ndarray, np.ndarray]:
        """X's self-distances, packed pairs i < j: (L1, squared L2)."""
        return (self._host_packed(self.l1_xx),
                self._host_packed(self._squared(self.norms_x, self.norms_x, self.gram_xx)))

    def xy(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The (m, n_k) X-Y_k block: (L1, squared L2)."""
        return (self.l1_xy[k].cpu().numpy(),
                self._squared(self.norms_x, self.norms_yx[k], self.gram_xy[k]).cpu().numpy())

    def yy(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Y_k's self-distances, packed pairs i < j."""
        return (self._host_packed(self.l1_yy[k]),
                self._host_packed(self._squared(self.norms_yy[k], self.norms_yy[k],
                                                self.gram_yy[k])))
