"""freqoptd (freqopt.daemon) as its own process on the stand-in NVML (tests/fake_pynvml.py): a client that is
SIGKILLed has its GPU put back within a second; a second client is refused while the first holds the GPU; every
request outside the policy is refused before it reaches NVML (the stand-in's log of set calls proves it); garbage does
not crash the daemon; a SIGKILLed daemon's successor restores what it left; SIGTERM restores; the socket's mode keeps
other users out; and freqopt apply and freqopt train --backend nvml set a GPU through the daemon without root."""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from fake_pynvml import FakeGPU, FakeNVML
from freqopt.daemon.cli import main as freqoptd_main
from freqopt.gpu.daemon_client import DaemonClient
from freqopt.daemon.policy import parse_policy
from freqopt.errors import DaemonError, DaemonRefusedError, InvalidSettingError

TESTS = Path(__file__).parent
ME = pwd.getpwuid(os.getuid()).pw_name

# The daemon's process: the stand-in NVML from GPU_FILE (as root), rewritten after every set call, and every set call
# it is asked to make appended to LOG before it is made (so that a refused value that reached NVML would show).
DAEMON = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from fake_pynvml import SETTERS, FakeNVML
    fake = FakeNVML.load({gpu_file!r}, persist={gpu_file!r})
    module = fake.module()
    for name in SETTERS:
        def logged(*args, _fn=getattr(module, name), _name=name):
            with open({log!r}, "a") as f:
                f.write(json.dumps([_name, *args]) + "\\n")
            return _fn(*args)
        setattr(module, name, logged)
    sys.modules["pynvml"] = module
    from freqopt.daemon.cli import main
    sys.exit(main(["--policy", {policy!r}]))
""")

POLICY = """
[daemon]
socket = "{socket}"
socket_mode = "{mode}"
state_dir = "{state}"

[[gpus]]
match = "*"
users = ["{me}"]
sm_clock_mhz = [900, 1980]
power_limit_w = [300, 650]
mem_clock_changes = false

[[gpus]]
match = "1"
users = ["someone-else-entirely"]
"""


class Node:
    """A stand-in node: two GPUs (GPU-a at index 0, GPU-b at 1), a policy, and freqoptd serving them."""

    daemon_script = DAEMON  # the daemon's process, formatted with tests, gpu_file, log and policy

    def __init__(self, folder: Path, mode: str = "0600", gpus: list[FakeGPU] | None = None):
        self.folder = folder
        self.gpu_file, self.log = folder / "gpus.json", folder / "set-calls.jsonl"
        self.socket = folder / "freqoptd.sock"
        self.state = folder / "daemon-state"
        gpus = gpus or [FakeGPU(uuid="GPU-a", power_limit_mw=600_000), FakeGPU(uuid="GPU-b", power_limit_mw=600_000)]
        FakeNVML(gpus=gpus, root=True).save(self.gpu_file)
        self.policy = folder / "policy.toml"
        self.policy.write_text(POLICY.format(socket=self.socket, mode=mode, state=self.state, me=ME))
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        script = self.daemon_script.format(tests=str(TESTS), gpu_file=str(self.gpu_file), log=str(self.log),
                                           policy=str(self.policy))  # fmt: skip
        self.process = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while True:
            assert self.process.poll() is None, self.process.stderr.read()
            if self.socket.is_socket():
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    probe.connect(str(self.socket))
                    break
                except OSError:
                    pass
                finally:
                    probe.close()
            assert time.monotonic() < deadline, "freqoptd never listened"
            time.sleep(0.05)

    def gpu(self, index: int = 0) -> tuple:
        """(locked SM MHz, power limit mW, locked memory MHz) of the stand-in GPU now."""
        g = json.loads(self.gpu_file.read_text())["gpus"][index]
        return g["locked_sm_mhz"], g["power_limit_mw"], g["locked_mem_mhz"]

    def set_calls(self) -> list[list]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    n.start()
    yield n
    n.stop()


def _wait_for(predicate, seconds: float) -> float:
    """Poll ``predicate`` until it holds; the seconds it took (fails after ``seconds``)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < seconds, f"not within {seconds} s"
        time.sleep(0.01)
    return time.monotonic() - start


def _set(client: DaemonClient, gpu, call: str, *args) -> dict:
    return client.request({"op": "set", "gpu": gpu, "call": call, "args": list(args)})


# -- a client that dies ----------------------------------------------------------------------------------------
CLIENT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from fake_pynvml import FakeNVML
    fake = FakeNVML.load({gpu_file!r})
    fake.root = False  # this user is not root: NVML refuses its set calls
    sys.modules["pynvml"] = fake.module()
    from freqopt.gpu.nvml import GPUStateGuard, open_devices
    device = open_devices(daemon={socket!r})[0]
    guard = GPUStateGuard(device)
    guard.before_change()
    device.lock_sm_clock(1200)
    device.set_power_limit_w(400)
    print("set", flush=True)
    time.sleep(120)
""")


def test_a_sigkilled_client_has_its_gpu_put_back_within_a_second(node):
    script = CLIENT.format(tests=str(TESTS), gpu_file=str(node.gpu_file), socket=str(node.socket))
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "set\n", child.stderr.read()
        assert node.gpu() == (1200, 400_000, None)
        assert list(node.state.glob("gpu-*.json"))  # the daemon recorded what GPU-a had
    finally:
        child.kill()
        child.wait()
    took = _wait_for(lambda: node.gpu() == (None, 600_000, None) and not list(node.state.glob("gpu-*.json")), 5.0)
    assert took < 1.0  # restored, and its state file gone
    assert node.gpu(1) == (None, 600_000, None)  # the other GPU never touched


def test_a_second_client_is_refused_while_the_first_holds_the_gpu(node):
    first, second = DaemonClient(str(node.socket)), DaemonClient(str(node.socket))
    _set(first, "GPU-a", "lock_sm_clock", 1500)
    with pytest.raises(DaemonRefusedError, match=rf"^GPU 0 is held by user {ME} \(pid {os.getpid()}\) until that "
                                                 "client releases it or exits; try again then$"):  # fmt: skip
        _set(second, "GPU-a", "lock_sm_clock", 1005)
    hello = second.hello()
    assert hello["client"]["user"] == ME and hello["client"]["pid"] == os.getpid()
    assert [g["held_by"] for g in hello["gpus"]] == [f"user {ME} (pid {os.getpid()})", None]
    first.request({"op": "release"})
    assert node.gpu() == (None, 600_000, None)
    _set(second, "GPU-a", "lock_sm_clock", 1005)  # free again
    assert node.gpu() == (1005, 600_000, None)
    second.close()
    _wait_for(lambda: node.gpu() == (None, 600_000, None), 5.0)
    first.close()


# Every kind of request the daemon must not carry out: (request, kind of refusal, the reply's words).
OUTSIDE = [
    ({"gpu": "GPU-a", "call": "lock_sm_clock", "args": [885]}, "policy",
     f"^GPU 0: SM clocks below 900 MHz are not allowed for user {ME}; ask your administrator$"),
    ({"gpu": 0, "call": "lock_sm_clock", "args": [345]}, "policy", "below 900 MHz"),
    ({"gpu": "GPU-a", "call": "lock_sm_clock", "args": [1000]}, "invalid",
     "does not support SM clock 1000 MHz; the nearest it supports is 1005 MHz"),
    ({"gpu": "GPU-a", "call": "lock_sm_clock", "args": [2100]}, "invalid", "does not support SM clock 2100"),
    ({"gpu": "GPU-a", "call": "lock_sm_clock", "args": [1200.5]}, "invalid", "whole number of MHz"),
    ({"gpu": "GPU-a", "call": "lock_sm_clock", "args": [True]}, "invalid", "must be a number"),
    ({"gpu": "GPU-a", "call": "lock_sm_clock", "args": ["1200"]}, "invalid", "must be a number"),
    ({"gpu": "GPU-a", "call": "lock_mem_clock", "args": [2619]}, "policy",
     f"^GPU 0: memory clocks may not be changed by user {ME}; ask your administrator$"),
    ({"gpu": "GPU-a", "call": "set_applications_clocks", "args": [1200, 1593]}, "policy",
     "memory clocks may not be changed"),
    ({"gpu": "GPU-a", "call": "set_applications_clocks", "args": [600, 2619]}, "policy", "below 900 MHz"),
    ({"gpu": "GPU-a", "call": "set_power_limit_w", "args": [250]}, "policy",
     f"^GPU 0: power limits below 300 W are not allowed for user {ME}; ask your administrator$"),
    ({"gpu": "GPU-a", "call": "set_power_limit_w", "args": [680]}, "policy", "above 650 W"),
    ({"gpu": "GPU-a", "call": "set_power_limit_w", "args": [750]}, "invalid",
     r"takes power limits from 200 to 700 W, not 750 W"),
    ({"gpu": "GPU-a", "call": "set_power_limit_w", "args": [float("nan")]}, "invalid", "not a JSON|number"),
    ({"gpu": 1, "call": "lock_sm_clock", "args": [1200]}, "policy",
     f"^GPU 1: {ME} may not change it .*; ask your administrator$"),
    ({"gpu": "GPU-b", "call": "reset_sm_clock", "args": []}, "policy", "may not change it"),
    ({"gpu": 7, "call": "lock_sm_clock", "args": [1200]}, "invalid", "^no GPU 7 on this node"),
    ({"gpu": "GPU-a", "call": "nvmlDeviceSetGpuLockedClocks", "args": [1200, 1200]}, "invalid",
     "unknown call"),
    ({"gpu": "GPU-a", "call": "lock_sm_clock", "args": []}, "invalid", "takes 1 argument"),
    ({"gpu": "GPU-a", "call": "lock_sm_clock", "args": 1200}, "invalid", "takes 1 argument"),
]


def test_nothing_outside_the_policy_reaches_nvml(node):
    client = DaemonClient(str(node.socket))
    for request, kind, words in OUTSIDE:
        with pytest.raises(DaemonRefusedError, match=words) as refused:
            client.request({"op": "set", **request})
        assert refused.value.kind == kind, request
    assert node.set_calls() == []  # not one of them reached the GPU
    assert node.gpu() == node.gpu(1) == (None, 600_000, None)
    reply = _set(client, "GPU-a", "lock_sm_clock", 900)  # the policy's edge is inside it
    assert reply["latency_s"] >= 0 and reply["queued_s"] >= 0
    _set(client, "GPU-a", "set_power_limit_w", 700)  # the GPU's default limit: putting it back is always allowed
    _set(client, "GPU-a", "set_power_limit_w", 300)
    assert node.gpu() == (900, 300_000, None)
    client.close()
    _wait_for(lambda: node.gpu() == (None, 600_000, None), 5.0)
    calls = node.set_calls()
    assert calls[:3] == [["nvmlDeviceSetGpuLockedClocks", 0, 900, 900],
                         ["nvmlDeviceSetPowerManagementLimit", 0, 700_000],
                         ["nvmlDeviceSetPowerManagementLimit", 0, 300_000]]  # fmt: skip
    # then the restore: clocks unlocked, the limit found
    assert ["nvmlDeviceResetGpuLockedClocks", 0] in calls[3:] and calls[-1] == ["nvmlDeviceSetPowerManagementLimit",
                                                                                0, 600_000]  # fmt: skip
    assert all(c[1] == 0 for c in calls)  # GPU-b never set


def test_garbage_does_not_crash_the_daemon(node):
    def raw(payload: bytes) -> list[dict]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(node.socket))
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return [json.loads(line) for line in data.decode().splitlines()]

    replies = raw(b"\x00\xff\xfegarbage\n[1, 2]\n{\"op\": \"fly\"}\n\"hello\"\n{\"op\": \"set\"}\n{\"op\": \"hello\"}\n")
    assert [r["ok"] for r in replies] == [False, False, False, False, False, True]
    assert {r["kind"] for r in replies[:-1]} == {"invalid"}
    assert "unknown op 'fly'" in replies[2]["error"]
    long = raw(b"{" + b" " * 70_000 + b"}\n{\"op\": \"hello\"}\n")
    assert len(long) == 1 and "longer than 65536 bytes" in long[0]["error"]  # that connection ended there
    for _ in range(20):  # connections opened and dropped at once
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).connect(str(node.socket))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # a request cut off mid-line, then the client dies
        s.connect(str(node.socket))
        s.sendall(b'{"op": "set", "gpu": "GPU-a", "call": "lock_sm')
    client = DaemonClient(str(node.socket))
    assert client.hello()["protocol"] == 1 and node.process.poll() is None
    _set(client, "GPU-a", "lock_sm_clock", 1200)
    assert node.gpu() == (1200, 600_000, None)
    client.close()


def test_a_sigkilled_daemon_is_restored_from_by_its_successor(node):
    client = DaemonClient(str(node.socket))
    _set(client, "GPU-a", "lock_sm_clock", 1200)
    _set(client, "GPU-a", "set_power_limit_w", 450)
    node.process.kill()
    node.process.wait()
    assert node.gpu() == (1200, 450_000, None)  # a GPU keeps its settings when its daemon dies
    assert len(list(node.state.glob("gpu-*.json"))) == 1
    with pytest.raises(DaemonError, match="closed the connection|stopped answering"):
        client.hello()
    node.start()  # the stale socket is replaced; the state file is restored before serving
    assert node.gpu() == (None, 600_000, None)
    assert not list(node.state.glob("gpu-*.json"))
    assert DaemonClient(str(node.socket)).hello()["gpus"][0]["held_by"] is None


def test_sigterm_puts_every_gpu_back_and_removes_the_socket(node):
    client = DaemonClient(str(node.socket))
    _set(client, "GPU-a", "lock_sm_clock", 1200)
    node.process.send_signal(signal.SIGTERM)
    assert node.process.wait(timeout=30) == 0
    assert "every GPU it set is back as it found it" in node.process.stderr.read()
    assert node.gpu() == (None, 600_000, None) and not node.socket.exists()
    assert not list(node.state.glob("gpu-*.json"))


def test_a_second_daemon_on_the_same_socket_is_refused(node):
    script = DAEMON.format(tests=str(TESTS), gpu_file=str(node.gpu_file), log=str(node.log), policy=str(node.policy))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"freqoptd: error: another freqoptd already listens on {node.socket}; stop it first (systemctl stop freqoptd) "
        "or give another socket"]
    assert DaemonClient(str(node.socket)).hello()["ok"]  # the first one still serves


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: a child process becomes user nobody to try the socket")
@pytest.mark.parametrize("mode, refused", [("0600", True), ("0666", False)])
def test_the_socket_mode_keeps_other_users_out(mode, refused):
    folder = Path(tempfile.mkdtemp(prefix="freqoptd-"))  # world-traversable, unlike pytest's folders
    os.chmod(folder, 0o755)
    n = Node(folder, mode=mode)
    n.start()
    try:
        assert n.socket.stat().st_mode & 0o777 == int(mode, 8)
        pid = os.fork()
        if pid == 0:  # the child: user nobody, asks to lock GPU-a's SM clock
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(str(n.socket))
                    s.sendall(b'{"op": "set", "gpu": "GPU-a", "call": "lock_sm_clock", "args": [1200]}\n')
                    reply = json.loads(s.makefile().readline())
                code = 4 if reply["ok"] else (5 if reply["kind"] == "policy" else 6)
            except PermissionError:
                code = 7
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        # 0600: the kernel refuses nobody's connect; 0666: it connects, and the policy (no rule names nobody) refuses
        assert os.waitstatus_to_exitcode(status) == (7 if refused else 5)
        assert n.gpu() == (None, 600_000, None) and n.set_calls() == []
    finally:
        n.stop()
        subprocess.run(["rm", "-rf", str(folder)], check=True)


def test_tcp_clients_count_as_the_policys_tcp_user(tmp_path):
    n = Node(tmp_path)
    n.policy.write_text(n.policy.read_text().replace('state_dir', f'tcp = "127.0.0.1:0"\ntcp_user = "{ME}"\nstate_dir'))
    n.start()
    try:
        line = n.process.stderr.readline()
        assert line.startswith("freqoptd: serving 2 GPU(s) on ") and " and TCP 127.0.0.1:" in line
        client = DaemonClient(f"tcp://127.0.0.1:{line.rsplit(':', 1)[1].strip()}")
        assert client.hello()["client"] == {"user": ME, "uid": None, "pid": None,
                                            "groups": client.hello()["client"]["groups"]}  # fmt: skip
        _set(client, 0, "lock_sm_clock", 1200)
        assert n.gpu() == (1200, 600_000, None)
        with pytest.raises(DaemonRefusedError, match="below 900 MHz"):  # the same policy over TCP
            _set(client, 0, "lock_sm_clock", 600)
        client.close()  # no pid to watch over TCP: the connection's end restores
        _wait_for(lambda: n.gpu() == (None, 600_000, None), 5.0)
    finally:
        n.stop()


def test_a_client_of_a_daemon_that_is_not_there_is_one_clear_error(tmp_path):
    with pytest.raises(DaemonError, match=rf"^freqoptd does not answer at {tmp_path}/none.sock \(No such file or "
                                          r"directory\); ask your administrator whether freqoptd runs there, or unset "
                                          "FREQOPT_DAEMON"):  # fmt: skip
        DaemonClient(str(tmp_path / "none.sock")).hello()


# -- the policy file -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, words", [
    ("[daemon\n", "is not a TOML file"),
    ("[server]\n", "unknown table 'server'"),
    ("[daemon]\nsocket_mode = 660\n", "socket_mode must be octal permission bits as text"),
    ("[daemon]\nsocket_mode = \"0999\"\n", "socket_mode must be octal"),
    ("[daemon]\nport = 1\n", "unknown key 'port'"),
    ("[daemon]\ntcp = \"127.0.0.1:4938\"\n", "tcp needs tcp_user"),
    ("[daemon]\ntcp = \"localhost\"\ntcp_user = \"u\"\n", "tcp must be host:port"),
    ("[[gpus]]\nusers = [\"a\"]\n", "match must be"),
    ("[[gpus]]\nmatch = \"gpu0\"\n", "match must be"),
    ("[[gpus]]\nmatch = \"*\"\n[[gpus]]\nmatch = \"*\"\n", "is given twice"),
    ("[[gpus]]\nmatch = \"0\"\nsm_clock_mhz = [1980, 900]\n", r"sm_clock_mhz \[1980, 900\] must have 0 < low <= high"),
    ("[[gpus]]\nmatch = \"0\"\npower_limit_w = [300]\n", "power_limit_w must be two numbers"),
    ("[[gpus]]\nmatch = \"0\"\nusers = \"alice\"\n", "users must be a list of names"),
    ("[[gpus]]\nmatch = \"0\"\nmem_clock_mhz = [1593, 2619]\n", "mem_clock_changes is false"),
    ("[[gpus]]\nmatch = \"0\"\nmem_clock_changes = \"yes\"\n", "mem_clock_changes must be true or false"),
    ("[[gpus]]\nmatch = \"0\"\nsm_clocks = [1, 2]\n", "unknown key 'sm_clocks'"),
])  # fmt: skip
def test_a_bad_policy_is_refused_with_what_to_fix(text, words):
    with pytest.raises(InvalidSettingError, match=words):
        parse_policy(text, "p.toml")


def test_check_policy_says_what_it_allows(tmp_path, capsys):
    n = Node(tmp_path)
    assert freqoptd_main(["--check-policy", str(n.policy)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{n.policy}: socket {n.socket} (mode 0600), state in {n.state}"
    assert out[1:] == [f"GPU *: user {ME}; SM clocks 900-1980 MHz; power limits 300-650 W; memory clocks fixed",
                       "GPU 1: user someone-else-entirely; SM clocks what the GPU supports; power limits what the GPU "
                       "supports; memory clocks fixed"]  # fmt: skip
    (tmp_path / "bad.toml").write_text("[[gpus]]\nmatch = 0\n")
    assert freqoptd_main(["--check-policy", str(tmp_path / "bad.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"freqoptd: error: {tmp_path}/bad.toml: [[gpus]] number 1: match must")
    assert freqoptd_main([]) == 2
    assert "give --policy FILE" in capsys.readouterr().err


# -- freqopt's own commands through the daemon, without root ----------------------------------------------------
USER_PROCESS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from fake_pynvml import FakeNVML
    fake = FakeNVML.load({gpu_file!r})
    fake.root = False  # this user is not root: NVML refuses its set calls
    sys.modules["pynvml"] = fake.module()
    from freqopt.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def _as_user(node: Node, args: list[str], extra_env: dict | None = None) -> subprocess.CompletedProcess:
    script = USER_PROCESS.format(tests=str(TESTS), gpu_file=str(node.gpu_file))
    env = {**os.environ, "FREQOPT_DAEMON": str(node.socket), "FREQOPT_STATE_DIR": str(node.folder / "user-state"),
           "CUDA_VISIBLE_DEVICES": "0", "COLUMNS": "200", **(extra_env or {})}  # fmt: skip
    return subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_freqopt_apply_sets_the_gpu_through_the_daemon_without_root(node, tmp_path):
    from test_apply_job import table_file

    table = table_file(tmp_path / "it.json", "iteration", [(1005, 2619, 400.0)])
    observe = tmp_path / "observed.json"
    command = [sys.executable, "-c", f"import shutil; shutil.copy({str(node.gpu_file)!r}, {str(observe)!r})"]
    done = _as_user(node, ["apply", str(table), "--", *command])
    assert done.returncode == 0, done.stderr
    assert "GPU 0 restored" in done.stderr
    held = json.loads(observe.read_text())["gpus"][0]
    assert (held["locked_sm_mhz"], held["power_limit_mw"]) == (1005, 400_000)  # while the command ran
    assert node.gpu() == (None, 600_000, None)  # and back after it
    assert not list((node.folder / "user-state").glob("*.json"))  # the daemon, not the user, kept the state
    assert ["nvmlDeviceSetGpuLockedClocks", 0, 1005, 1005] in node.set_calls()
    alone = _as_user(node, ["apply", str(table), "--", *command], extra_env={"FREQOPT_DAEMON": ""})
    assert alone.returncode == 2 and "NVML says no permission" in alone.stderr  # without the daemon: refused


def test_freqopt_apply_outside_the_policy_is_refused_in_the_policys_words(node, tmp_path):
    from test_apply_job import table_file

    table = table_file(tmp_path / "low.json", "iteration", [(600, 2619, None)])
    env = {"FREQOPT_DAEMON": ""}  # given as the command line's --daemon instead
    done = _as_user(node, ["--daemon", str(node.socket), "apply", str(table), "--", sys.executable, "-c", "pass"],
                    extra_env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"freqopt: error: GPU 0: SM clocks below 900 MHz are not allowed for user {ME}; ask your administrator"]
    assert node.gpu() == (None, 600_000, None)
    assert not any(c[0] == "nvmlDeviceSetGpuLockedClocks" for c in node.set_calls())


@pytest.mark.slow
def test_freqopt_train_on_nvml_runs_through_the_daemon_without_root(tmp_path):
    from test_apply_job import table_file

    gpus = [FakeGPU(uuid="GPU-a", power_limit_mw=600_000, realtime=True, counter_period_s=0.001),
            FakeGPU(uuid="GPU-b", power_limit_mw=600_000)]  # fmt: skip
    node = Node(tmp_path, gpus=gpus)
    node.start()
    try:
        table = table_file(tmp_path / "it.json", "iteration", [(1005, 2619, None)])
        done = _as_user(node, ["train", "--model", "gpt3-small", "--seq-len", "16", "--micro-batch-size", "1",
                               "--steps", "2", "--backend", "nvml", "--device", "cpu", "--table", str(table)])
        assert done.returncode == 0, done.stderr[-3000:]
        assert ["nvmlDeviceSetGpuLockedClocks", 0, 1005, 1005] in node.set_calls()
        assert node.gpu() == (None, 600_000, None)
        assert not list((tmp_path / "user-state").glob("*.json"))
    finally:
        node.stop()


# -- AMD GPUs: the daemon's amdsmi backend on the stand-in AMD SMI (tests/fake_amdsmi.py) ---------------------------
AMD_DAEMON = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from fake_amdsmi import SETTERS, FakeAMDSMI
    fake = FakeAMDSMI.load({gpu_file!r}, persist={gpu_file!r})
    module = fake.module()
    for name in SETTERS:
        def logged(*args, _fn=getattr(module, name), _name=name):
            with open({log!r}, "a") as f:
                f.write(json.dumps([_name, *map(str, args[1:])]) + "\\n")
            return _fn(*args)
        setattr(module, name, logged)
    sys.modules["amdsmi"] = module
    from freqopt.daemon.cli import main
    sys.exit(main(["--policy", {policy!r}]))
""")

AMD_POLICY = """
[daemon]
socket = "{socket}"
socket_mode = "0600"
state_dir = "{state}"
backend = "amdsmi"

[[gpus]]
match = "*"
users = ["{me}"]
sm_clock_mhz = [900, 2100]
power_limit_w = [300, 700]
"""

AMD_CLIENT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from fake_amdsmi import FakeAMDSMI
    fake = FakeAMDSMI.load({gpu_file!r})
    fake.root = False  # this user is not root: AMD SMI refuses its set calls
    sys.modules["amdsmi"] = fake.module()
    from freqopt.gpu.amdsmi import AMDSMIDaemonDevice, open_amd_devices
    from freqopt.gpu.nvml import GPUStateGuard
    device = open_amd_devices(daemon={socket!r})[0]
    assert isinstance(device, AMDSMIDaemonDevice)
    GPUStateGuard(device).before_change()
    device.lock_sm_clock(1234)  # any MHz in the GFX range: AMD GPUs hold a range, not a list of clocks
    device.set_power_limit_w(400)
    print("set", device.last_call[1] >= 0, flush=True)
    time.sleep(120)
""")


class AMDNode(Node):
    """A stand-in node of two AMD GPUs (UUIDs 0a-0 and 0b-0) and freqoptd serving them through AMD SMI."""

    daemon_script = AMD_DAEMON

    def __init__(self, folder: Path):
        from fake_amdsmi import FakeAMDGPU, FakeAMDSMI

        self.folder = folder
        self.gpu_file, self.log = folder / "gpus.json", folder / "set-calls.jsonl"
        self.socket, self.state = folder / "freqoptd.sock", folder / "daemon-state"
        FakeAMDSMI(gpus=[FakeAMDGPU(uuid="0a-0", power_cap_uw=600_000_000),
                         FakeAMDGPU(uuid="0b-0", power_cap_uw=600_000_000)], root=True).save(self.gpu_file)  # fmt: skip
        self.policy = folder / "policy.toml"
        self.policy.write_text(AMD_POLICY.format(socket=self.socket, state=self.state, me=ME))
        self.process = None

    def gpu(self, index: int = 0) -> tuple:
        """(GFX range held or None for the whole range, power cap uW, performance level) of the stand-in GPU now."""
        g = json.loads(self.gpu_file.read_text())["gpus"][index]
        whole = (g["gfx_levels_mhz"][0], g["gfx_levels_mhz"][-1])
        held = None if g["gfx_range_mhz"] is None or tuple(g["gfx_range_mhz"]) == whole else tuple(g["gfx_range_mhz"])
        return held, g["power_cap_uw"], g["perf_level"]


def test_the_daemon_serves_amd_gpus_and_puts_one_back_when_its_client_is_sigkilled(tmp_path):
    node = AMDNode(tmp_path)
    node.start()
    try:
        script = AMD_CLIENT.format(tests=str(TESTS), gpu_file=str(node.gpu_file), socket=str(node.socket))
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)  # fmt: skip
        try:
            assert child.stdout.readline() == "set True\n", child.stderr.read()
            assert node.gpu() == ((1234, 1234), 400_000_000, 3)  # held: the manual performance level
        finally:
            child.kill()
            child.wait()
        took = _wait_for(lambda: node.gpu() == (None, 600_000_000, 0) and not list(node.state.glob("gpu-*.json")),
                         5.0)  # fmt: skip
        assert took < 1.0
        # Nothing outside the policy or the GPU's range reaches AMD SMI.
        before = node.set_calls()
        client = DaemonClient(str(node.socket))
        for args, kind, words in [(("lock_sm_clock", 850), "policy", "SM clocks below 900 MHz are not allowed"),
                                  (("lock_sm_clock", 2200), "invalid", "holds SM clocks from 500 to 2100 MHz"),
                                  (("set_power_limit_w", 720), "policy", "power limits above 700 W"),
                                  (("lock_mem_clock", 1300), "policy", "memory clocks may not be changed")]:
            with pytest.raises(DaemonRefusedError, match=words) as refused:
                _set(client, "0a-0", *args)
            assert refused.value.kind == kind
        assert node.set_calls() == before
        assert node.gpu(1) == (None, 600_000_000, 0)  # the other GPU never touched
        client.close()
    finally:
        node.stop()


def test_a_policy_names_the_amd_backend_and_amd_uuids():
    policy = parse_policy('[daemon]\nbackend = "amdsmi"\n[[gpus]]\nmatch = "00ff74a1-0000-1000-8000-000000000000"\n'
                          'users = ["a"]\n')  # fmt: skip
    assert policy.backend == "amdsmi" and policy.rules[0].match.startswith("00ff74a1")
    with pytest.raises(InvalidSettingError, match=r'backend must be "nvml" \(NVIDIA GPUs\) or "amdsmi"'):
        parse_policy('[daemon]\nbackend = "rocm"\n')
    with pytest.raises(InvalidSettingError, match="match must be"):  # an AMD UUID means nothing to NVML's daemon
        parse_policy('[[gpus]]\nmatch = "00ff74a1-0000"\nusers = ["a"]\n')
