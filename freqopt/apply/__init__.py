"""Applying a clock table: laid onto another workload or layout (transfer), applied to a running training job (the
DVFS runtime), training under it (train), and what a run used and a table saved (statement).
"""
