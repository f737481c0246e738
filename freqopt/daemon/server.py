"""freqoptd, the daemon that alone holds a node's NVML (or, for AMD GPUs, AMD SMI) set calls, so that users without root can set the GPUs the
policy lets them set (freqopt.daemon.policy), and every GPU goes back to what the daemon found when its client is gone.

The protocol: one JSON object per line each way over a Unix stream socket (or TCP, where the policy opens it), each
request answered by one reply, in order. Requests:

- ``{"op": "hello"}``: who the daemon takes the client for, and per GPU (by NVML index and UUID) whether it may set
  it, the ranges it may ask for and who holds it now.
- ``{"op": "set", "gpu": UUID or NVML index, "call": C, "args": [...]}``: one NVML set call C of
  freqopt.gpu.nvml.NVMLDevice: ``lock_sm_clock`` [MHz], ``reset_sm_clock`` [], ``lock_mem_clock`` [MHz],
  ``reset_mem_clock`` [], ``set_power_limit_w`` [W], ``set_applications_clocks`` [SM MHz, memory MHz].
- ``{"op": "release", "gpu": UUID or index}``: put that GPU back now (``"gpu"`` left out: every GPU the client holds).

Replies: ``{"ok": true, ...}``; a set call's reply carries ``latency_s`` (the NVML call's own time on the GPU's worker)
and ``queued_s`` (the time it waited behind earlier calls to that GPU). ``{"ok": false, "kind": K, "error": E}``
otherwise, K one of ``policy`` (the policy does not allow it), ``busy`` (another client holds the GPU),
``invalid`` (a value the GPU does not support, or a malformed request), ``not_supported`` (NVML_ERROR_NOT_SUPPORTED),
``nvml`` (another NVML error). A line that is not a JSON object is answered ``invalid`` and the connection goes on; a
line longer than MAX_LINE_BYTES ends the connection.

Safety (the issue that asked for the daemon: zeusd passes values to NVML unclamped and leaves a GPU changed when its
client dies):

- every value is checked against what the GPU supports (NVML's supported clocks, its power-limit constraints) and
  the policy's ranges before it reaches NVML; putting a GPU back (unlocked clocks, the power limit it had) is always
  allowed;
- one client holds a GPU at a time, from its first set call to its release; another client's set call is refused;
- before a client's first change, the GPU's state is recorded (freqopt.gpu.nvml.GPUStateGuard, in memory and in a
  state file in the policy's ``state_dir``); when the client releases it, closes its connection (a killed process's
  socket is closed by the kernel) or its process is gone (checked every PID_POLL_S, for a connection a child
  process inherited), the GPU goes back to that state; on SIGTERM, SIGINT and SIGHUP the daemon puts every GPU back
  and exits; started after a SIGKILL, it first restores what the state files say its predecessor left;
- each GPU's calls run in order on one worker thread of their own (NVML's set calls on one GPU do not overlap: the
  actuation model freqopt.apply.runtime assumes).
"""

from __future__ import annotations

import grp
import json
import math
import os
import signal
import socket
import socketserver
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from freqopt.daemon.policy import Client, GPURule, Policy
from freqopt.errors import FreqoptError, GPUPermissionError, InvalidSettingError
from freqopt.gpu.nvml import (GPUStateGuard, NVMLDevice, NVMLError, NVMLNotSupportedError, device_count,
                              open_devices, reset_from_state_files)  # fmt: skip

__all__ = ["Daemon", "PROTOCOL_VERSION", "MAX_LINE_BYTES", "PID_POLL_S", "CALLS"]

PROTOCOL_VERSION = 1
MAX_LINE_BYTES = 65536  # a request is a few hundred bytes; a longer line is not a client of this protocol
PID_POLL_S = 0.2  # how often the daemon checks that each client's process is still there
# The set calls a client may ask for -> how many arguments each takes.
CALLS = {"lock_sm_clock": 1, "reset_sm_clock": 0, "lock_mem_clock": 1, "reset_mem_clock": 0,
         "set_power_limit_w": 1, "set_applications_clocks": 2}  # fmt: skip


class Refused(Exception):
    """A request the daemon will not carry out: ``kind`` (the protocol's), and a one-line reason."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Refused("invalid", f"{what} must be a number, not {value!r}")
    return value


def _clock(value, what: str) -> int:
    value = _number(value, what)
    if value != int(value):
        raise Refused("invalid", f"{what} must be a whole number of MHz, not {value!r}")
    return int(value)


class _Session:
    """One client connection: who it is, the GPUs it holds."""

    def __init__(self, client: Client, connection: socket.socket):
        self.client, self.connection = client, connection
        self.held: set[str] = set()  # GPU UUIDs
        self.released = False


class _GPU:
    """One GPU the daemon serves: its device, its policy rule, its state guard and its worker thread."""

    def __init__(self, device: NVMLDevice, rule: GPURule | None, state_dir: Path):
        self.device, self.rule = device, rule
        self.guard = GPUStateGuard(device, state_dir=state_dir)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"freqoptd-gpu{device.index}")
        self.owner: _Session | None = None
        mem = device.supported_mem_clocks_mhz()
        self.mem_clocks_mhz = set(mem)
        # An AMD GPU holds any MHz between its lowest and highest GFX level (freqopt.gpu.amdsmi): a range, not a list.
        self.sm_clock_range_mhz = device.sm_clock_range_mhz() if hasattr(device, "sm_clock_range_mhz") else None
        self.sm_clocks_mhz = (set() if self.sm_clock_range_mhz is not None or not mem
                              else set().union(*(device.supported_sm_clocks_mhz(m) for m in mem)))  # fmt: skip
        self.power_limit_range_w = device.power_limit_constraints_w()
        self.power_limit_default_w = device.power_limit_default_w()

    @property
    def label(self) -> str:
        return f"GPU {self.device.index}"

    # -- what may be asked ---------------------------------------------------------------------------------------
    def check(self, client: Client, call: str, args: list) -> list:
        """The call's arguments as NVML takes them, after the GPU's and the policy's checks.

        Raises:
            Refused: kind ``policy`` (the policy does not allow it for this client) or ``invalid`` (the GPU does
                not support the value).
        """
        who = self.rule.grantor(client) if self.rule else None
        if who is None:
            raise Refused("policy", f"{self.label}: {client.user} may not change it (no rule of the policy names the "
                                    "user or one of its groups for this GPU); ask your administrator")  # fmt: skip
        rule = self.rule
        if call == "lock_sm_clock":
            return [self._sm_clock(args[0], who)]
        if call == "lock_mem_clock":
            return [self._mem_clock(args[0], who)]
        if call == "set_applications_clocks":
            sm = self._sm_clock(args[0], who)
            current = self.device.applications_clocks_mhz()
            mem = _clock(args[1], "the memory clock")
            if current is None or mem != current[1]:
                mem = self._mem_clock(mem, who)
            return [sm, mem]
        if call == "set_power_limit_w":
            watts = _number(args[0], "the power limit")
            lo, hi = self.power_limit_range_w
            if not lo - 1e-3 <= watts <= hi + 1e-3:
                raise Refused("invalid", f"{self.label} ({self.device.name}) takes power limits from {lo:g} to {hi:g} "
                                         f"W, not {watts:g} W")  # fmt: skip
            found = self.guard.state.power_limit_w if self.guard.state else self.device.power_limit_w()
            restoring = min(abs(watts - found), abs(watts - self.power_limit_default_w)) < 1e-3
            if rule.power_limit_w and not restoring:
                low, high = rule.power_limit_w
                if watts < low - 1e-3:
                    raise Refused("policy", f"{self.label}: power limits below {low:g} W are not allowed for {who}; "
                                            "ask your administrator")  # fmt: skip
                if watts > high + 1e-3:
                    raise Refused("policy", f"{self.label}: power limits above {high:g} W are not allowed for {who}; "
                                            "ask your administrator")  # fmt: skip
            return [watts]
        return []  # the resets: always allowed, to the one who may set the GPU

    def _sm_clock(self, value, who: str) -> int:
        mhz = _clock(value, "the SM clock")
        if self.sm_clock_range_mhz is not None:
            lo, hi = self.sm_clock_range_mhz
            if not lo <= mhz <= hi:
                raise Refused("invalid", f"{self.label} ({self.device.name}) holds SM clocks from {lo} to {hi} MHz, "
                                         f"not {mhz} MHz")  # fmt: skip
        elif mhz not in self.sm_clocks_mhz:
            near = min(self.sm_clocks_mhz, key=lambda f: abs(f - mhz)) if self.sm_clocks_mhz else None
            raise Refused("invalid", f"{self.label} ({self.device.name}) does not support SM clock {mhz} MHz"
                                     + (f"; the nearest it supports is {near} MHz" if near is not None else ""))
        if self.rule.sm_clock_mhz:
            low, high = self.rule.sm_clock_mhz
            if mhz < low:
                raise Refused("policy", f"{self.label}: SM clocks below {low:g} MHz are not allowed for {who}; ask "
                                        "your administrator")  # fmt: skip
            if mhz > high:
                raise Refused("policy", f"{self.label}: SM clocks above {high:g} MHz are not allowed for {who}; ask "
                                        "your administrator")  # fmt: skip
        return mhz

    def _mem_clock(self, value, who: str) -> int:
        mhz = _clock(value, "the memory clock")
        if not self.rule.mem_clock_changes:
            raise Refused("policy", f"{self.label}: memory clocks may not be changed by {who}; ask your "
                                    "administrator")  # fmt: skip
        if mhz not in self.mem_clocks_mhz:
            raise Refused("invalid", f"{self.label} ({self.device.name}) does not support memory clock {mhz} MHz; it "
                                     f"supports {', '.join(map(str, sorted(self.mem_clocks_mhz)))} MHz")  # fmt: skip
        if self.rule.mem_clock_mhz:
            low, high = self.rule.mem_clock_mhz
            if not low <= mhz <= high:
                raise Refused("policy", f"{self.label}: memory clocks outside {low:g}-{high:g} MHz are not allowed "
                                        f"for {who}; ask your administrator")  # fmt: skip
        return mhz

    # -- on the GPU's worker -------------------------------------------------------------------------------------
    def run(self, call: str, args: list) -> tuple[float, float]:
        """Carry out one set call on the worker, in order: (queued_s, latency_s)."""
        submitted = time.monotonic()

        def work():
            started = time.monotonic()
            self.guard.before_change()  # records what the GPU had before the first change, and its state file
            getattr(self.device, call)(*args)
            return started - submitted, time.monotonic() - started

        return self.worker.submit(work).result()

    def restore(self) -> None:
        """Put the GPU back to what it had before the first change (nothing, if nothing changed), on the worker."""
        self.worker.submit(self.guard.restore).result()


class Daemon:
    """freqoptd on one node (module docstring: protocol and safety).

    Args:
        policy: the parsed policy (freqopt.daemon.policy.load_policy).
        devices: the GPUs to serve; default every GPU the policy's backend sees: NVML's (not
            CUDA_VISIBLE_DEVICES': the node's), or AMD SMI's where it says ``backend = "amdsmi"``.
        socket_path: the Unix socket's path, in place of the policy's.

    Use ``serve()`` (blocks until SIGTERM, SIGINT or SIGHUP), or ``start()`` and ``stop()``.
    """

    def __init__(self, policy: Policy, devices: list[NVMLDevice] | None = None, *, socket_path: str | None = None):
        self.policy = policy
        self.socket_path = Path(socket_path or policy.socket)
        self.state_dir = Path(policy.state_dir)
        self._devices = devices
        self.gpus: dict[str, _GPU] = {}
        self._by_index: dict[int, _GPU] = {}
        self._lock = threading.Lock()
        self._sessions: set[_Session] = set()
        self._servers: list[socketserver.BaseServer] = []
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self.tcp_address: tuple[str, int] | None = None

    # -- life --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Restore what a killed predecessor left (its state files), open the GPUs, listen and serve in threads.

        Raises:
            InvalidSettingError: the socket's path is taken by another running daemon, or is not a socket.
            NVMLError: NVML fails. GPUPermissionError: restoring what a predecessor left needs root.
        """
        devices = self._devices if self._devices is not None else _all_devices(self.policy.backend)
        restored = reset_from_state_files(devices, folder=self.state_dir)  # what a killed predecessor left
        self.restored_at_start = restored
        for device in devices:
            gpu = _GPU(device, self.policy.rule_for(device.index, device.uuid), self.state_dir)
            self.gpus[device.uuid], self._by_index[device.index] = gpu, gpu
        self._servers.append(self._unix_server())
        if self.policy.tcp:
            server = _TCPServer(self.policy.tcp, _Handler)
            server.daemon_ref = self
            self.tcp_address = server.server_address[:2]
            self._servers.append(server)
        for server in self._servers:
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
            thread.start()
            self._threads.append(thread)
        watcher = threading.Thread(target=self._watch_pids, daemon=True, name="freqoptd-pids")
        watcher.start()
        self._threads.append(watcher)

    def stop(self) -> None:
        """Stop serving and put every GPU back to what the daemon found; remove the socket."""
        self._stopping.set()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            self.release(session)
            try:
                session.connection.shutdown(socket.SHUT_RDWR)  # ends its handler's read
            except OSError:
                pass
        for gpu in self.gpus.values():
            gpu.restore()
            gpu.worker.shutdown()
        self.socket_path.unlink(missing_ok=True)

    def serve(self, ready=None) -> None:
        """Start, call ``ready()`` (if given), then serve until SIGTERM, SIGINT or SIGHUP, and stop."""
        self.start()
        if ready is not None:
            ready()
        done = threading.Event()
        previous = {s: signal.signal(s, lambda *_: done.set()) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            while not done.is_set() and not self._stopping.is_set():
                done.wait(0.2)
        finally:
            self.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _unix_server(self) -> socketserver.UnixStreamServer:
        path = self.socket_path
        if path.exists() or path.is_symlink():
            if not path.is_socket():
                raise InvalidSettingError(f"socket path {path} exists and is not a socket; remove it or choose another "
                                          "socket in the policy's [daemon] table")  # fmt: skip
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # a socket nobody listens on: a killed predecessor's
            else:
                raise InvalidSettingError(f"another freqoptd already listens on {path}; stop it first (systemctl "
                                          "stop freqoptd) or give another socket")  # fmt: skip
            finally:
                probe.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        umask = os.umask(0o777 & ~self.policy.socket_mode)  # no moment with wider permissions than the policy's
        try:
            server = _UnixServer(str(path), _Handler)
        finally:
            os.umask(umask)
        os.chmod(path, self.policy.socket_mode)
        if self.policy.socket_group:
            try:
                os.chown(path, -1, grp.getgrnam(self.policy.socket_group).gr_gid)
            except KeyError as e:
                server.server_close()
                path.unlink(missing_ok=True)
                raise InvalidSettingError(f"{self.policy.source}: socket_group {self.policy.socket_group!r} is not a "
                                          "group of this system") from e  # fmt: skip
        server.daemon_ref = self
        return server

    # -- sessions ------------------------------------------------------------------------------------------------
    def open_session(self, client: Client, connection: socket.socket) -> _Session:
        session = _Session(client, connection)
        with self._lock:
            self._sessions.add(session)
        return session

    def release(self, session: _Session, uuid: str | None = None) -> None:
        """Put back the GPUs ``session`` holds (only ``uuid``, if given); with no ``uuid``, end the session."""
        with self._lock:
            uuids = [uuid] if uuid is not None else list(session.held)
            if uuid is None:
                if session.released:
                    return
                session.released = True
                self._sessions.discard(session)
        for u in uuids:
            gpu = self.gpus[u]
            if gpu.owner is not session:
                continue
            try:
                gpu.restore()
            finally:
                with self._lock:
                    gpu.owner = None
                    session.held.discard(u)

    def _watch_pids(self) -> None:
        while not self._stopping.wait(PID_POLL_S):
            with self._lock:
                gone = [s for s in self._sessions if s.client.pid is not None and not _pid_alive(s.client.pid)]
            for session in gone:
                self.release(session)
                try:
                    session.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    # -- requests ------------------------------------------------------------------------------------------------
    def _gpu(self, which) -> _GPU:
        if isinstance(which, str) and which in self.gpus:
            return self.gpus[which]
        if isinstance(which, int) and not isinstance(which, bool) and which in self._by_index:
            return self._by_index[which]
        raise Refused("invalid", f"no GPU {which!r} on this node; freqoptd serves "
                                 f"{', '.join(f'{g.device.index} ({u})' for u, g in self.gpus.items()) or 'none'}")

    def handle(self, session: _Session, request) -> dict:
        """The reply to one request (a parsed JSON value)."""
        try:
            if not isinstance(request, dict):
                raise Refused("invalid", "a request is a JSON object with an \"op\"")
            op = request.get("op")
            if op == "hello":
                return {"ok": True, **self._hello(session)}
            if op == "release":
                if request.get("gpu") is None:
                    for uuid in list(session.held):
                        self.release(session, uuid)
                else:
                    self.release(session, self._gpu(request["gpu"]).device.uuid)
                return {"ok": True}
            if op == "set":
                return {"ok": True, **self._set(session, request)}
            raise Refused("invalid", f"unknown op {op!r}; freqoptd knows hello, set and release")
        except Refused as e:
            return {"ok": False, "kind": e.kind, "error": str(e)}
        except NVMLNotSupportedError as e:
            return {"ok": False, "kind": "not_supported", "error": str(e)}
        except (NVMLError, GPUPermissionError) as e:
            return {"ok": False, "kind": "nvml", "error": str(e)}
        except FreqoptError as e:
            return {"ok": False, "kind": "invalid", "error": str(e)}

    def _hello(self, session: _Session) -> dict:
        c = session.client
        gpus = []
        for uuid, gpu in self.gpus.items():
            rule = gpu.rule
            gpus.append({"index": gpu.device.index, "uuid": uuid, "name": gpu.device.name,
                         "allowed_by": rule.grantor(c) if rule else None,
                         "sm_clock_mhz": list(rule.sm_clock_mhz) if rule and rule.sm_clock_mhz else None,
                         "power_limit_w": list(rule.power_limit_w) if rule and rule.power_limit_w else None,
                         "mem_clock_changes": bool(rule and rule.mem_clock_changes),
                         "held_by": gpu.owner.client.label() if gpu.owner else None})  # fmt: skip
        return {"protocol": PROTOCOL_VERSION, "client": {"user": c.user, "uid": c.uid, "pid": c.pid,
                                                         "groups": list(c.groups)}, "gpus": gpus}  # fmt: skip

    def _set(self, session: _Session, request: dict) -> dict:
        gpu = self._gpu(request.get("gpu"))
        call, args = request.get("call"), request.get("args", [])
        if call not in CALLS:
            raise Refused("invalid", f"unknown call {call!r}; freqoptd carries out {', '.join(CALLS)}")
        if not isinstance(args, list) or len(args) != CALLS[call]:
            raise Refused("invalid", f"{call} takes {CALLS[call]} argument(s), not {args!r}")
        args = gpu.check(session.client, call, args)
        with self._lock:
            if session.released:
                raise Refused("invalid", "this connection has been released")
            if gpu.owner is not None and gpu.owner is not session:
                raise Refused("busy", f"{gpu.label} is held by {gpu.owner.client.label()} until that client releases "
                                      "it or exits; try again then")  # fmt: skip
            gpu.owner = session
            session.held.add(gpu.device.uuid)
        queued_s, latency_s = gpu.run(call, args)
        return {"queued_s": queued_s, "latency_s": latency_s}


def _all_devices(backend: str = "nvml") -> list[NVMLDevice]:
    """Every GPU the backend's library sees on the node, by its index: NVML's, or AMD SMI's ("amdsmi")."""
    if backend == "amdsmi":
        from freqopt.gpu.amdsmi import amd_device_count, open_amd_devices

        count = amd_device_count()
        return open_amd_devices(visible=",".join(str(i) for i in range(count)), daemon="") if count else []
    count = device_count()
    return open_devices(visible=",".join(str(i) for i in range(count)), daemon="") if count else []


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Handler(socketserver.StreamRequestHandler):
    """One connection: requests read line by line, each answered in order; the session released at the end."""

    def handle(self) -> None:
        daemon: Daemon = self.server.daemon_ref
        if isinstance(self.server, _UnixServer):
            raw = self.request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            client = Client.from_credentials(*struct.unpack("3i", raw))
        else:
            client = daemon.policy.tcp_client()
        session = daemon.open_session(client, self.request)
        try:
            while not daemon._stopping.is_set():
                line = self.rfile.readline(MAX_LINE_BYTES + 1)
                if not line:
                    break
                if len(line) > MAX_LINE_BYTES:
                    self._send({"ok": False, "kind": "invalid", "error": f"request longer than {MAX_LINE_BYTES} "
                                                                         "bytes; closing the connection"})
                    break
                try:
                    request = json.loads(line)
                except (ValueError, UnicodeDecodeError):
                    reply = {"ok": False, "kind": "invalid", "error": "not a JSON request (one JSON object per line)"}
                else:
                    reply = daemon.handle(session, request)
                self._send(reply)
        except OSError:
            pass  # the client went away mid-reply
        finally:
            daemon.release(session)

    def _send(self, reply: dict) -> None:
        self.wfile.write((json.dumps(reply) + "\n").encode())
        self.wfile.flush()


class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 128  # the listen backlog: socketserver's 5 refuses a burst of clients (every rank at once)


class _TCPServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    request_queue_size = 128
    allow_reuse_address = True
