"""The parts of a GPU type that are types of their own: its power model (PowerModel), the power it draws while it
waits (WaitingPower) and its links to other GPUs (Interconnect). freqopt.gpu.specs reads them from a GPU type's
TOML file (search_spaces/*.toml) into a GPUSpec, and re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PowerModel", "WaitingPower", "WAITING_CLOCK_SCALES", "Interconnect"]


@dataclass(frozen=True)
class PowerModel:
    """Board power as a function of SM clock, memory clock and activity.

    ``P = p_const + p_leak * V/V_max + (p_sm_clock + p_sm_active * u_sm) * (V/V_max)^2 * f/f_max
    + (p_mem_clock + p_mem_active * u_mem) * m/m_max``, where V(f) is flat at ``v_min_rel * V_max`` up to
    ``f_knee_mhz`` and rises linearly to V_max at the highest SM clock. Every term is in watts at the highest
    clocks; the CMOS dynamic-power law P ~ C V^2 f gives the scaling.

    Operators whose SM work is not tensor-core FLOPs draw SM power of their own while busy, in watts at the
    highest clocks (scaled by V^2 f like the other SM terms; zero where a GPU type has no measurement):
    ``p_sfu_w`` for transcendental elementwise operators (GELU, softmax: special-function units),
    ``p_norm_w`` for layer norms (row reductions), ``p_attention_w`` for fused attention (softmax and rescaling
    besides its matmuls). ``p_sm_stream_w`` is the on-chip power of streaming data (L2, crossbar, load/store
    units) at full memory bandwidth, on the SM clock's voltage and frequency, beside the DRAM's own
    ``p_mem_active_w``.
    """

    p_const_w: float
    p_leak_w: float
    p_sm_clock_w: float
    p_sm_active_w: float
    p_mem_clock_w: float
    p_mem_active_w: float
    v_min_rel: float
    f_knee_mhz: float
    power_window_s: float
    p_sfu_w: float = 0.0
    p_sm_stream_w: float = 0.0
    p_norm_w: float = 0.0
    p_attention_w: float = 0.0


@dataclass(frozen=True)
class WaitingPower:
    """Board power while the GPU waits with a context open and nothing to run: between the host's kernel launches,
    and blocked in a collective or P2P receive (a NCCL kernel spinning on a flag), as a function of the SM clock
    it holds.

    With ``top_clocks_w`` given (a measurement at the highest clocks, the file's [waiting_power] table):
    ``P(f, m) = top_clocks_w * ((1 - clock_share) + clock_share * (V/V_max)^2 * f/f_max)
    - p_mem_clock_w * (1 - m/m_max)``: a share of it scales with the SM clock's V^2 f (the clock tree, the idle
    SMs' dynamic power, leakage falling with the voltage), the rest is fixed; below the highest memory clock the
    power model's memory-clock term falls away as in a loaded GPU. Without it (None) the GPU waits at the power
    model's baseline, ``p_const + p_leak V/V_max + p_sm_clock (V/V_max)^2 f/f_max + p_mem_clock m/m_max``
    (freqopt.gpu.backends.physics.KernelPhysics.baseline_power_w).

    How fast the waiting power falls with the clock is measured nowhere at a locked low clock with a context
    open, so it is a range: ``clock_scale`` 1 is the model above, 0 a waiting power that does not fall with the
    clock at all (every clock waits at the highest clock's figure), and values between interpolate
    (WAITING_CLOCK_SCALES names the two ends; GPUSpec.with_waiting_clock_scale). A host-bound step's saving is
    mostly this power, so a search prints its saving at both ends (SearchResult.waiting_statement).
    """

    top_clocks_w: float | None = None
    clock_share: float = 0.0
    clock_scale: float = 1.0


# The two ends of the waiting-power range (WaitingPower.clock_scale): the model, whose fall with the clock the H100's
# idle readings anchor (71.6 W at 405 MHz against 119-128 W with a context at 1980 MHz), and a waiting power that
# does not fall with the clock at all.
WAITING_CLOCK_SCALES = {"modelled": 1.0, "flat": 0.0}


@dataclass(frozen=True)
class Interconnect:
    """How a GPU of this type talks to the others: links within a node, the network between nodes.

    Attributes:
        kind: the link, for people ("NVLink 4 (18 links) + NVSwitch", "PCIe 4.0 x16").
        link_bandwidth_gbs: per GPU and direction within a node, GB/s (1e9 B/s).
        link_latency_us: per ring step within a node, us.
        gpus_per_node: GPUs that share the fast links; a group of ranks wider than this crosses nodes.
        inter_node_bandwidth_gbs: per GPU and direction between nodes, GB/s.
        inter_node_latency_us: per ring step between nodes, us.
        link_efficiency: fraction of the link bandwidth a large collective reaches.
        link_energy_pj_per_bit: energy the board draws per bit sent or received, pJ.
        nccl_sms: SMs that a collective's kernel occupies (one per NCCL channel).
    """

    kind: str
    link_bandwidth_gbs: float
    link_latency_us: float
    gpus_per_node: int
    inter_node_bandwidth_gbs: float
    inter_node_latency_us: float
    link_efficiency: float
    link_energy_pj_per_bit: float
    nccl_sms: int

    def spans_nodes(self, group_size: int, group_stride: int) -> bool:
        """Whether a group of ``group_size`` ranks, ``group_stride`` global ranks apart (tp innermost), crosses
        a node boundary."""
        return group_size > 1 and group_size * group_stride > self.gpus_per_node
