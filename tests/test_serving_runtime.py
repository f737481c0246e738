"""The serving runtime (freqopt.apply.serving_runtime) on the stand-in NVML: a small Hugging Face model's
``generate`` runs its prefill and decode steps at their settings, in order, one switch per change, and the GPU is put
back on exit and on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from freqopt.errors import InvalidSettingError  # noqa: E402
from freqopt.gpu.backends.base import ClockSetting  # noqa: E402

TESTS = Path(__file__).parent
LLAMA = TESTS / "data" / "hf" / "llama" / "config.json"
PREFILL, DECODE = ClockSetting(1500, 2619), ClockSetting(1200, 2619)


def _tiny_llama():
    config = transformers.AutoConfig.from_pretrained(str(LLAMA.parent))
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_generate_runs_prefill_and_decode_at_their_settings_and_the_gpu_is_put_back(fake_gpu):
    from freqopt.apply.serving_runtime import ServingRuntime
    from freqopt.gpu.backends.nvml import NVMLBackend
    from freqopt.gpu.nvml import open_devices

    model = _tiny_llama()
    backend = NVMLBackend(open_devices()[0], torch_device="cpu")
    ids = torch.randint(0, 1024, (2, 12))
    with ServingRuntime(backend, prefill=PREFILL, decode=DECODE) as runtime:
        runtime.attach(model)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, do_sample=False)  # a second request: prefill again, then decode
    assert [name for name, _ in runtime.requested] == ["prefill", "decode", "prefill", "decode"]
    locks = [c[2] for c in fake_gpu.set_calls() if c[0] == "nvmlDeviceSetGpuLockedClocks"]
    # A request the worker has not reached when a later one comes is superseded by it (on a CPU there is no CUDA
    # event to wait for), so which are applied depends on timing; the last, decode's, always is.
    assert locks and locks[-1] == 1200 and set(locks) <= {1500, 1200}
    assert all(a != b for a, b in zip(locks, locks[1:]))  # a set call only where the setting changes
    gpu = fake_gpu.gpus[0]
    assert (gpu.locked_sm_mhz, gpu.power_limit_mw) == (None, 650_000)  # as found
    assert not runtime._handles  # the hook is gone with the runtime


def test_one_setting_for_both_phases_and_bad_arguments(fake_gpu):
    from freqopt.apply.serving_runtime import ServingRuntime
    from freqopt.gpu.backends.simulated import SimulatedGPU
    from freqopt.gpu.specs import get_gpu

    sim = SimulatedGPU(get_gpu("h100-sxm"), noise=False)
    with ServingRuntime(sim, setting=DECODE) as runtime:
        for name in ("prefill", "decode", "decode", "prefill"):
            with runtime.phase(name):
                pass
    assert runtime.requested == [("prefill", DECODE)]  # one setting: one request
    with pytest.raises(InvalidSettingError, match="^setting holds both phases"):
        ServingRuntime(sim, setting=DECODE, prefill=PREFILL)
    with pytest.raises(InvalidSettingError, match="1234"):
        ServingRuntime(sim, decode=ClockSetting(1234, 2619))  # not a supported SM clock (15 MHz steps)
    with ServingRuntime(sim) as runtime, pytest.raises(InvalidSettingError, match="^phase must be prefill or decode"):
        runtime.phase("sampling")


CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from fake_pynvml import FakeNVML
    fake = FakeNVML.load({gpu_file!r}, persist={gpu_file!r})
    sys.modules["pynvml"] = fake.module()
    from freqopt.apply.serving_runtime import ServingRuntime
    from freqopt.gpu.backends.base import ClockSetting
    from freqopt.gpu.backends.nvml import NVMLBackend
    from freqopt.gpu.nvml import open_devices
    runtime = ServingRuntime(NVMLBackend(open_devices()[0], torch_device="cpu"), prefill=ClockSetting(1500, 2619),
                             decode=ClockSetting(1200, 2619))
    with runtime:
        runtime.enter("prefill")
        while fake.gpus[0].locked_sm_mhz != 1500:
            time.sleep(0.01)
        print("set", flush=True)
        time.sleep(120)
""")


@pytest.mark.slow
def test_sigterm_mid_serving_puts_the_gpu_back(tmp_path):
    sys.path.insert(0, str(TESTS))
    from fake_pynvml import FakeGPU, FakeNVML

    gpu_file = tmp_path / "gpus.json"
    FakeNVML(gpus=[FakeGPU(uuid="GPU-test", power_limit_mw=650_000)], root=True).save(gpu_file)
    script = CHILD.format(tests=str(TESTS), gpu_file=str(gpu_file))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "FREQOPT_STATE_DIR": str(tmp_path / "state")})  # fmt: skip
    try:
        assert child.stdout.readline() == "set\n", child.stderr.read()
        assert json.loads(gpu_file.read_text())["gpus"][0]["locked_sm_mhz"] == 1500
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
    state = json.loads(gpu_file.read_text())["gpus"][0]
    assert (state["locked_sm_mhz"], state["power_limit_mw"]) == (None, 650_000)
