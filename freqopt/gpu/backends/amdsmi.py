"""The real AMD GPU backend: NVMLBackend's measurements (kernels replayed on the GPU, ROCm's HIP answering to
torch's "cuda" devices; time by device events; energy by the counter's delta over a window of several counter
updates) on a GPU opened through AMD SMI (freqopt.gpu.amdsmi.AMDSMIDevice), its power cap and SM clock set and
restored as an NVIDIA GPU's are (freqopt.gpu.nvml.GPUStateGuard)."""

from __future__ import annotations

from freqopt.gpu.backends.nvml import NVMLBackend

__all__ = ["AMDSMIBackend"]


class AMDSMIBackend(NVMLBackend):
    """One real AMD GPU (``device``: freqopt.gpu.amdsmi.AMDSMIDevice); arguments and behaviour as NVMLBackend's."""

    name = "amdsmi"
