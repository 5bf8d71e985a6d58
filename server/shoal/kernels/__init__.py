"""shoal's hand-written CPU kernels and the one entry that chooses them for a model.

A model declares what the kernels read (`shoal.kernels.interface`); `prepare` sets them up
(`shoal.kernels.preparation`). This package never imports `shoal.models`.
"""

from __future__ import annotations

from shoal.kernels.interface import KernelArgs, KernelModel, ModelKernels
from shoal.kernels.preparation import PreparedKernels, prepare

__all__ = ["KernelArgs", "KernelModel", "ModelKernels", "PreparedKernels", "prepare"]
