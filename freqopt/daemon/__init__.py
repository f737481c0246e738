"""freqoptd: a daemon that alone holds a node's NVML set calls, so that users without root set the GPUs its policy
lets them set, and every GPU goes back to what the daemon found when its client is gone. The server:
freqopt.daemon.server; the policy file: freqopt.daemon.policy; the client side: freqopt.gpu.nvml.DaemonDevice and
freqopt.gpu.daemon_client; for administrators and users: docs/clusters.md."""

from freqopt.daemon.policy import Client, GPURule, Policy, load_policy, parse_policy

__all__ = ["Client", "GPURule", "Policy", "load_policy", "parse_policy"]
