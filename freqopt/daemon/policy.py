"""freqoptd's policy file: who may set which GPU, and within which clock and power-limit ranges.

A TOML file the administrator writes (``freqoptd --check-policy FILE`` checks one):

.. code-block:: toml

    [daemon]
    socket = "/run/freqoptd/freqoptd.sock"   # the Unix socket clients connect to
    socket_mode = "0660"                     # its permission bits (octal text)
    socket_group = "gpu"                     # optional: the group that owns it (with 0660: who may connect)
    state_dir = "/var/lib/freqoptd"          # what each GPU had before a change, for a restarted daemon
    # tcp = "127.0.0.1:4938"                 # optional: also listen on TCP, for containers without the socket
    # tcp_user = "containers"                # the user every TCP client counts as (TCP carries no credentials)
    # backend = "amdsmi"                     # the GPUs' library: "nvml" (NVIDIA, the default) or "amdsmi" (AMD)

    [[gpus]]
    match = "*"                              # "*", an index ("0") or a UUID ("GPU-..."; AMD SMI's as it prints it)
    users = ["alice"]                        # who may set it: user names and
    groups = ["ml"]                          # group names (primary or supplementary)
    sm_clock_mhz = [900, 1980]               # optional: the locked SM clocks allowed, MHz, inclusive
    power_limit_w = [300, 700]               # optional: the power limits allowed, W, inclusive
    mem_clock_changes = false                # may memory clocks be locked at all (default false)
    # mem_clock_mhz = [1593, 2619]           # optional, where they may: the memory clocks allowed, MHz

A GPU takes the most specific rule that matches it (its UUID, then its index, then ``"*"``); a GPU no rule matches
may be set by nobody. A range left out allows what the GPU supports. Whatever the ranges, a value the GPU does not
support is refused (NVML's supported clocks and power-limit constraints), and putting a GPU back to what it had
(unlocked clocks, the power limit found) is always allowed.
"""

from __future__ import annotations

import grp
import os
import pwd
from dataclasses import dataclass, field
from pathlib import Path

from freqopt.errors import InvalidSettingError
from freqopt.gpu.search_spaces import tomllib  # the standard library's, or tomli before Python 3.11

__all__ = ["GPURule", "Policy", "Client", "parse_policy", "load_policy", "DEFAULT_SOCKET"]

_DAEMON_KEYS = {"socket", "socket_mode", "socket_group", "state_dir", "tcp", "tcp_user", "backend"}
BACKENDS = ("nvml", "amdsmi")  # the GPU libraries the daemon can serve through
_RULE_KEYS = {"match", "users", "groups", "sm_clock_mhz", "mem_clock_mhz", "power_limit_w", "mem_clock_changes"}
DEFAULT_SOCKET = "/run/freqoptd/freqoptd.sock"
DEFAULT_STATE_DIR = "/var/lib/freqoptd"


@dataclass(frozen=True)
class Client:
    """Who is asking: a Unix-socket peer's credentials (SO_PEERCRED), or the policy's ``tcp_user`` over TCP.

    Attributes:
        uid, gid: the peer's user and primary group ids (None over TCP).
        pid: the peer's process id (None over TCP: a container's pid means nothing here).
        user: the user's name; groups: the names of its primary and supplementary groups.
    """

    uid: int | None
    gid: int | None
    pid: int | None
    user: str
    groups: tuple[str, ...]

    @classmethod
    def from_credentials(cls, pid: int, uid: int, gid: int) -> Client:
        """The client of a peer's (pid, uid, gid), its names from the password and group databases."""
        try:
            user = pwd.getpwuid(uid).pw_name
            ids = os.getgrouplist(user, gid)
        except KeyError:  # a uid with no name (a container's user): it is known by its number only
            user, ids = str(uid), [gid]
        names = []
        for i in ids:
            try:
                names.append(grp.getgrgid(i).gr_name)
            except KeyError:
                names.append(str(i))
        return cls(uid, gid, pid, user, tuple(dict.fromkeys(names)))

    def label(self) -> str:
        return f"user {self.user}" + (f" (pid {self.pid})" if self.pid is not None else " (TCP)")


def _range(where: str, key: str, value) -> tuple[float, float] | None:
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):  # fmt: skip
        raise InvalidSettingError(f"{where}: {key} must be two numbers [low, high], not {value!r}")
    lo, hi = float(value[0]), float(value[1])
    if not 0 < lo <= hi:
        raise InvalidSettingError(f"{where}: {key} [{value[0]}, {value[1]}] must have 0 < low <= high")
    return lo, hi


def _names(where: str, key: str, value) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise InvalidSettingError(f"{where}: {key} must be a list of names, not {value!r}")
    return tuple(value)


@dataclass(frozen=True)
class GPURule:
    """What the policy allows on the GPUs one ``[[gpus]]`` table matches.

    Attributes:
        match: ``"*"``, an NVML index as text, or a GPU UUID.
        users, groups: who may set the GPU (by name).
        sm_clock_mhz, mem_clock_mhz: (low, high) locked clocks allowed, MHz, inclusive; None: what the GPU supports.
        power_limit_w: (low, high) power limits allowed, W, inclusive; None: the GPU's constraints.
        mem_clock_changes: whether memory clocks may be locked (or set as application clocks) at all.
    """

    match: str
    users: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    sm_clock_mhz: tuple[float, float] | None = None
    mem_clock_mhz: tuple[float, float] | None = None
    power_limit_w: tuple[float, float] | None = None
    mem_clock_changes: bool = False

    def grantor(self, client: Client) -> str | None:
        """The principal that lets ``client`` set the GPU ("user alice", "group ml"), or None if none does."""
        if client.user in self.users:
            return f"user {client.user}"
        group = next((g for g in client.groups if g in self.groups), None)
        return None if group is None else f"group {group}"


@dataclass(frozen=True)
class Policy:
    """A parsed policy file (module docstring: the format).

    Attributes:
        source: the file's path (or ``<text>``).
        socket, socket_mode, socket_group: the Unix socket's path, permission bits and group (None: the daemon's).
        state_dir: where the daemon records what each GPU had before a change.
        tcp: ``host:port`` to listen on as well, or None; tcp_user: whom TCP clients count as.
        rules: the ``[[gpus]]`` rules, in file order.
        backend: the GPUs' library, "nvml" (NVIDIA) or "amdsmi" (AMD GPUs through AMD SMI).
    """

    source: str
    socket: str = DEFAULT_SOCKET
    socket_mode: int = 0o660
    socket_group: str | None = None
    state_dir: str = DEFAULT_STATE_DIR
    tcp: tuple[str, int] | None = None
    tcp_user: str | None = None
    rules: tuple[GPURule, ...] = field(default_factory=tuple)
    backend: str = "nvml"

    def rule_for(self, index: int, uuid: str) -> GPURule | None:
        """The rule of the GPU at NVML index ``index`` with ``uuid``: by UUID, else by index, else ``"*"``."""
        for wanted in (uuid, str(index), "*"):
            rule = next((r for r in self.rules if r.match == wanted), None)
            if rule is not None:
                return rule
        return None

    def tcp_client(self) -> Client:
        """The client a TCP connection counts as: ``tcp_user``, with that user's groups where the system knows it."""
        user = self.tcp_user or ""
        try:
            entry = pwd.getpwnam(user)
        except KeyError:  # a name the system does not know: its users' rules apply, no group's
            return Client(None, None, None, user, ())
        known = Client.from_credentials(0, entry.pw_uid, entry.pw_gid)
        return Client(None, None, None, user, known.groups)


def parse_policy(text: str, source: str = "<text>") -> Policy:
    """The policy in TOML ``text``.

    Raises:
        InvalidSettingError: not TOML, an unknown key, a range that is not [low, high], a rule without ``match``
            or two rules with the same one, TCP without ``tcp_user``; the message begins with ``source``.
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise InvalidSettingError(f"{source} is not a TOML file ({e}); fix it and run freqoptd --check-policy") from e
    unknown = set(raw) - {"daemon", "gpus"}
    if unknown:
        raise InvalidSettingError(f"{source}: unknown table {sorted(unknown)[0]!r}; a policy has [daemon] and [[gpus]]")
    daemon = raw.get("daemon", {})
    if not isinstance(daemon, dict):
        raise InvalidSettingError(f"{source}: [daemon] must be a table")
    unknown = set(daemon) - _DAEMON_KEYS
    if unknown:
        raise InvalidSettingError(f"{source}: [daemon] has unknown key {sorted(unknown)[0]!r}; known: "
                                  f"{', '.join(sorted(_DAEMON_KEYS))}")  # fmt: skip
    for key in ("socket", "socket_group", "state_dir", "tcp", "tcp_user", "backend"):
        if key in daemon and not (isinstance(daemon[key], str) and daemon[key]):
            raise InvalidSettingError(f"{source}: [daemon] {key} must be a non-empty string")
    backend = daemon.get("backend", "nvml")
    if backend not in BACKENDS:
        raise InvalidSettingError(f"{source}: [daemon] backend must be \"nvml\" (NVIDIA GPUs) or \"amdsmi\" (AMD "
                                  f"GPUs), not {backend!r}")  # fmt: skip
    mode_text = daemon.get("socket_mode", "0660")
    try:
        mode = int(mode_text, 8) if isinstance(mode_text, str) else None
    except ValueError:
        mode = None
    if mode is None or not 0 <= mode <= 0o777:
        raise InvalidSettingError(f"{source}: [daemon] socket_mode must be octal permission bits as text, like "
                                  f"\"0660\", not {mode_text!r}")  # fmt: skip
    tcp = None
    if "tcp" in daemon:
        host, _, port = daemon["tcp"].rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise InvalidSettingError(f"{source}: [daemon] tcp must be host:port, like \"127.0.0.1:4938\", not "
                                      f"{daemon['tcp']!r}")  # fmt: skip
        if "tcp_user" not in daemon:
            raise InvalidSettingError(f"{source}: [daemon] tcp needs tcp_user, the user whose rules TCP clients "
                                      "follow (TCP carries no peer credentials)")  # fmt: skip
        tcp = (host, int(port))
    rules = []
    gpus = raw.get("gpus", [])
    if not isinstance(gpus, list):
        raise InvalidSettingError(f"{source}: gpus must be an array of tables, [[gpus]]")
    for i, entry in enumerate(gpus):
        where = f"{source}: [[gpus]] number {i + 1}"
        if not isinstance(entry, dict):
            raise InvalidSettingError(f"{where} must be a table")
        unknown = set(entry) - _RULE_KEYS
        if unknown:
            raise InvalidSettingError(f"{where} has unknown key {sorted(unknown)[0]!r}; known: "
                                      f"{', '.join(sorted(_RULE_KEYS))}")  # fmt: skip
        match = entry.get("match")
        if not isinstance(match, str) or not (match == "*" or match.isdigit() or match.startswith(("GPU-", "MIG-"))
                                              or (backend == "amdsmi" and _is_amd_uuid(match))):
            raise InvalidSettingError(f"{where}: match must be \"*\", an index like \"0\" or a UUID like "
                                      f"\"GPU-...\" (AMD SMI's: hexadecimal groups), not {match!r}")  # fmt: skip
        where = f"{source}: [[gpus]] match = {match!r}"
        if any(r.match == match for r in rules):
            raise InvalidSettingError(f"{where} is given twice; merge the two rules")
        changes = entry.get("mem_clock_changes", False)
        if not isinstance(changes, bool):
            raise InvalidSettingError(f"{where}: mem_clock_changes must be true or false")
        if "mem_clock_mhz" in entry and not changes:
            raise InvalidSettingError(f"{where}: mem_clock_mhz is given but mem_clock_changes is false; set "
                                      "mem_clock_changes = true or drop the range")  # fmt: skip
        rules.append(GPURule(match, _names(where, "users", entry.get("users")),
                             _names(where, "groups", entry.get("groups")),
                             _range(where, "sm_clock_mhz", entry.get("sm_clock_mhz")),
                             _range(where, "mem_clock_mhz", entry.get("mem_clock_mhz")),
                             _range(where, "power_limit_w", entry.get("power_limit_w")), changes))  # fmt: skip
    return Policy(source, daemon.get("socket", DEFAULT_SOCKET), mode, daemon.get("socket_group"),
                  daemon.get("state_dir", DEFAULT_STATE_DIR), tcp, daemon.get("tcp_user"), tuple(rules),
                  backend)  # fmt: skip


def _is_amd_uuid(text: str) -> bool:
    """An AMD SMI device UUID as amdsmi_get_gpu_device_uuid gives it: hexadecimal groups joined by dashes."""
    groups = text.split("-")
    return len(groups) >= 2 and all(g and all(c in "0123456789abcdefABCDEF" for c in g) for g in groups)


def load_policy(path: str | Path) -> Policy:
    """The policy file at ``path`` (``parse_policy``).

    Raises:
        InvalidSettingError: the file cannot be read, or as parse_policy.
    """
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InvalidSettingError(f"policy file {path} cannot be read ({e.strerror}); give the path of freqoptd's "
                                  "TOML policy") from e  # fmt: skip
    except UnicodeDecodeError as e:
        raise InvalidSettingError(f"policy file {path} is not text; give freqoptd's TOML policy") from e
    return parse_policy(text, str(path))
