"""Measurements built on the wings below: one training iteration profiled (profile, with the torch.profiler
comparison in profiler_compare), the search against an exhaustive sweep (benchmark) and power capping alone
(powercap).
"""
