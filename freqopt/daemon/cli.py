"""The ``freqoptd`` command: serve a node's GPUs under a policy, or check a policy file.

    freqoptd --policy /etc/freqoptd.toml             # serve until SIGTERM (systemd's stop), SIGINT or SIGHUP
    freqoptd --check-policy /etc/freqoptd.toml       # parse it and say what it allows, then exit

Errors print as one line (``freqoptd: error: ...``) and exit 2.
"""

from __future__ import annotations

import click

from freqopt.errors import FreqoptError

__all__ = ["main", "describe_policy"]


def describe_policy(policy) -> list[str]:
    """What ``policy`` allows, a line per rule (for --check-policy)."""

    def span(r, unit):
        return f"{r[0]:g}-{r[1]:g} {unit}" if r else "what the GPU supports"

    lines = [f"{policy.source}: socket {policy.socket} (mode {policy.socket_mode:04o}"
             + (f", group {policy.socket_group}" if policy.socket_group else "") + f"), state in {policy.state_dir}"
             + (f", TCP on {policy.tcp[0]}:{policy.tcp[1]} as user {policy.tcp_user}" if policy.tcp else "")]
    if not policy.rules:
        lines.append("no [[gpus]] rule: nobody may set any GPU")
    for r in policy.rules:
        who = ", ".join([f"user {u}" for u in r.users] + [f"group {g}" for g in r.groups]) or "nobody"
        mem = f"memory clocks {span(r.mem_clock_mhz, 'MHz')}" if r.mem_clock_changes else "memory clocks fixed"
        lines.append(f"GPU {r.match}: {who}; SM clocks {span(r.sm_clock_mhz, 'MHz')}; power limits "
                     f"{span(r.power_limit_w, 'W')}; {mem}")
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--policy", "policy_path", default=None, help="The TOML policy file (freqopt.daemon.policy).")
@click.option("--socket", "socket_path", default=None, help="The Unix socket to listen on, in place of the policy's.")
@click.option("--check-policy", "check_path", default=None, help="Check this policy file, say what it allows, exit.")
def freqoptd(policy_path, socket_path, check_path) -> None:
    """Set this node's GPUs for users without root, within a policy; put each back when its client is gone."""
    from freqopt.daemon.policy import load_policy

    if check_path:
        for line in describe_policy(load_policy(check_path)):
            click.echo(line)
        return
    if not policy_path:
        raise click.UsageError("give --policy FILE (or --check-policy FILE)")
    from freqopt.daemon.server import Daemon

    daemon = Daemon(load_policy(policy_path), socket_path=socket_path)
    daemon.serve(ready=lambda: click.echo(f"freqoptd: serving {len(daemon.gpus)} GPU(s) on {daemon.socket_path}"
                                          + (f" and TCP {daemon.tcp_address[0]}:{daemon.tcp_address[1]}"
                                             if daemon.tcp_address else ""), err=True))  # fmt: skip
    click.echo("freqoptd: stopped; every GPU it set is back as it found it", err=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``freqoptd``: errors as one line, exit 2."""
    try:
        freqoptd.main(args=argv, prog_name="freqoptd", standalone_mode=False)
    except FreqoptError as e:
        click.echo(f"freqoptd: error: {e}", err=True)
        return e.exit_code
    except click.UsageError as e:
        click.echo(f"freqoptd: error: {e.format_message()} (see `freqoptd --help`)", err=True)
        return 2
    return 0
