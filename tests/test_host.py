"""The host in every GPU type's step (issue 49, item 2): a property of the machine, not of the GPU, named by each GPU
file (default h100-node), replaceable per run, readable from a file of one's own."""

from __future__ import annotations

import pytest

from freqopt.errors import InvalidSettingError, UnknownNameError
from freqopt.gpu.backends.simulated import SimulatedGPU
from freqopt.gpu.host import DEFAULT_HOST, HostSpec, get_host, hosts_dir, list_hosts
from freqopt.gpu.specs import get_gpu, list_gpus
from freqopt.workload.kernels import Kernel

# A launch-bound kernel: 1 MB of traffic, a few us on any GPU.
SMALL = Kernel("aten.add", "elementwise", "forward", 0.0, 1e6, "bfloat16", ((1000, 250),))


def test_every_gpu_type_has_a_host_and_the_default_is_the_measured_h100_node():
    assert {"h100-node", "h200-node"} <= set(list_hosts())
    for name in list_gpus():
        spec = get_gpu(name)
        assert spec.host in list_hosts()
        host = get_host(spec.host)
        assert spec.host_issue_s == pytest.approx(host.issue_us * 1e-6)
        assert spec.step_host_s == pytest.approx({p: us * 1e-6 for p, us in host.step_us.items()})
    assert get_gpu("v100-pcie").host == DEFAULT_HOST == "h100-node"
    assert get_gpu("h200-sxm").host == "h200-node"  # the machine its own steps were measured in


def test_a_slower_host_lengthens_a_launch_bound_step_and_not_a_gpu_bound_one():
    h100 = get_gpu("h100-sxm")
    slow = h100.with_host(get_host("h100-node").scaled(2.0))
    kernels = [SMALL] * 200
    fast_t, slow_t = (SimulatedGPU(s, noise=False).step(kernels).time_s for s in (h100, slow))
    assert slow_t == pytest.approx(2 * fast_t, rel=0.05)  # the host is the whole step
    big = Kernel("aten.mm", "gemm", "forward", 2.0 * 8192**3, 3 * 2 * 8192**2, "bfloat16", ((8192, 8192), (8192, 8192)), True)
    fast_t, slow_t = (SimulatedGPU(s, noise=False).step([big] * 4).time_s for s in (h100, slow))
    assert slow_t == pytest.approx(fast_t, rel=0.01)


def test_a_host_of_ones_own_from_a_file(tmp_path):
    path = tmp_path / "my-node.toml"
    path.write_text('[host]\ndescription = "a laptop"\nissue_us = 20\ngemm_issue_us = 30\n[step_us]\nforward = 50\n'
                    'backward = 30\noptimizer = 10\n')
    host = get_host(str(path))
    assert (host.name, host.issue_us, host.step_us["backward"]) == ("my-node", 20.0, 30.0)
    spec = get_gpu("a100-sxm4-80gb").with_host(str(path))
    assert spec.host == "my-node" and spec.host_gemm_issue_s == pytest.approx(30e-6)
    assert spec.name == "a100-sxm4-80gb"


def test_bad_hosts_are_one_line_errors(tmp_path):
    with pytest.raises(UnknownNameError, match=r"^unknown host 'nope'; known hosts: .*h100-node"):
        get_host("nope")
    bad = tmp_path / "bad.toml"
    bad.write_text("[host\n")
    with pytest.raises(InvalidSettingError, match=r"bad.toml is not valid TOML .*copy a host file"):
        get_host(str(bad))
    missing = tmp_path / "missing.toml"
    missing.write_text("[host]\nissue_us = 3\n")
    with pytest.raises(InvalidSettingError, match=r"missing.toml is not a host file freqopt can read: it lacks 'gemm_issue_us'"):
        get_host(str(missing))
    negative = tmp_path / "negative.toml"
    negative.write_text("[host]\nissue_us = -3\ngemm_issue_us = 4\n")
    with pytest.raises(InvalidSettingError, match="finite numbers of us >= 0"):
        get_host(str(negative))
    with pytest.raises(InvalidSettingError, match="scale factor must be a finite number > 0"):
        get_host("h100-node").scaled(0)


def test_the_h200_node_is_the_h100_node_scaled_by_its_fitted_factor():
    """search_spaces/hosts/h200-node.toml is written by experiments/h200_check.py as one factor on h100-node's figures."""
    h100, h200 = get_host("h100-node"), get_host("h200-node")
    factor = h200.issue_us / h100.issue_us
    assert 1.0 < factor < 2.0
    assert h200.gemm_issue_us == pytest.approx(factor * h100.gemm_issue_us, rel=1e-4)
    assert h200.step_us == pytest.approx({p: factor * v for p, v in h100.step_us.items()}, rel=1e-4)
    assert (hosts_dir() / "h200-node.toml").read_text().count("BEGIN") == 2


def test_hostspec_scaled():
    host = HostSpec("x", 10.0, 20.0, {"forward": 1.0})
    twice = host.scaled(2)
    assert (twice.issue_us, twice.gemm_issue_us, twice.step_us) == (20.0, 40.0, {"forward": 2.0})
    assert twice.name == "x x2"
