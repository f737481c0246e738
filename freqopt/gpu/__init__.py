"""The GPU: its types (specs), real GPUs through NVML (nvml), traced kernels replayed on a device (replay), where
measurements come from (backends/: the simulated GPU and the real one) and the simulated GPU's calibration against
published and lent-GPU measurements (calibration/). Reads the workload's kernels; imports nothing above.
"""
