"""The client's end of freqoptd's protocol (freqopt.daemon.server): one connection, requests and replies.

``freqopt.gpu.nvml.open_devices`` returns ``freqopt.gpu.nvml.DaemonDevice``s on one DaemonClient when
``$FREQOPT_DAEMON`` (or its ``daemon`` argument) names the daemon's socket, so every code path that sets GPUs (the
NVML backend, DVFSRuntime, ``freqopt train --backend nvml``, ``freqopt apply``, ``freqopt stage-profile``) goes
through the daemon unchanged, while reads stay in this process. If this process dies, the daemon sees its connection
close and puts back the GPUs it set for it.
"""

from __future__ import annotations

import json
import socket
import threading

from freqopt.errors import DaemonError, DaemonRefusedError

__all__ = ["DaemonClient", "CONNECT_TIMEOUT_S"]

CONNECT_TIMEOUT_S = 10.0  # a request a daemon has not answered by then is reported as not answered


class DaemonClient:
    """One connection to freqoptd, shared by this process's GPUs; requests are serialized on it.

    Args:
        address: the daemon's Unix socket path, or ``tcp://host:port``.
    """

    def __init__(self, address: str):
        self.address = address
        self._socket: socket.socket | None = None
        self._file = None
        self._lock = threading.Lock()

    def _connect(self) -> None:
        hint = ("ask your administrator whether freqoptd runs there, or unset FREQOPT_DAEMON to set the GPUs from "
                "this process (which needs root)")  # fmt: skip
        try:
            if self.address.startswith("tcp://"):
                host, _, port = self.address.removeprefix("tcp://").rpartition(":")
                if not port.isdigit():
                    raise DaemonError(f"daemon address {self.address!r} is not tcp://host:port")
                sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                # Blocking: with a timeout a Unix socket's connect fails at once (EAGAIN) while the daemon's backlog
                # is full, where a blocking one waits its turn.
                sock.connect(self.address)
                sock.settimeout(CONNECT_TIMEOUT_S)
        except PermissionError as e:
            raise DaemonError(f"freqoptd's socket {self.address} does not let this user connect ({e.strerror}); "
                              "ask your administrator to add you to the socket's group") from e  # fmt: skip
        except OSError as e:
            raise DaemonError(f"freqoptd does not answer at {self.address} ({e.strerror or e}); {hint}") from e
        self._socket, self._file = sock, sock.makefile("rwb")

    def request(self, message: dict) -> dict:
        """Send one request and return the daemon's reply (freqopt.daemon.server: the protocol).

        Raises:
            DaemonRefusedError: the daemon refused it; ``kind`` says why (the policy, another client holds the GPU,
                a value the GPU does not support, NVML's refusal), the message in the daemon's words.
            DaemonError: the daemon does not answer, or answers outside the protocol.
        """
        with self._lock:
            if self._socket is None:
                self._connect()
            try:
                self._file.write((json.dumps(message) + "\n").encode())
                self._file.flush()
                line = self._file.readline()
            except OSError as e:
                self.close()
                raise DaemonError(f"freqoptd at {self.address} stopped answering ({e}); the daemon puts back the "
                                  "GPUs it set for this process when the connection ends") from e  # fmt: skip
            if not line:
                self.close()
                raise DaemonError(f"freqoptd at {self.address} closed the connection; it puts back the GPUs it set "
                                  "for this process when the connection ends")  # fmt: skip
        try:
            reply = json.loads(line)
        except ValueError as e:
            raise DaemonError(f"freqoptd at {self.address} answered outside its protocol: {line[:80]!r}") from e
        if not isinstance(reply, dict) or "ok" not in reply:
            raise DaemonError(f"freqoptd at {self.address} answered outside its protocol: {line[:80]!r}")
        if not reply["ok"]:
            raise DaemonRefusedError(str(reply.get("kind")), str(reply.get("error", "freqoptd refused the request")))
        return reply

    def hello(self) -> dict:
        """Who the daemon takes this process for, and what it may set on each GPU (its ``hello`` reply)."""
        return self.request({"op": "hello"})

    def close(self) -> None:
        """Close the connection: the daemon puts back every GPU this connection set."""
        if self._socket is not None:
            try:
                self._file.close()
            except OSError:  # a connection already broken: nothing left to flush
                pass
            finally:
                self._socket.close()
                self._socket, self._file = None, None
