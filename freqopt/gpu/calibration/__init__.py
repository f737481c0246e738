"""The simulated GPU's constants fitted to measurements (the scripts in experiments/ run the fits): the power model on
the V100 and derived for other types (v100), the H100's kernels at default settings (h100) and its whole training
steps (h100_steps), and the DVFS power model on Perseus's measured stage sweeps of the A100 and A40 (dvfs).
"""
