"""Whether a host is this machine: one rule for the reward server's warning and the vLLM servers' adapter path."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback IP address (127.0.0.0/8, ::1); a name that is not an address is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def on_this_machine(address: str) -> bool:
    """`host:port` (or a URL) names a loopback address: a server on the trainer's machine."""
    return is_loopback(address.strip().split("://")[-1].rpartition(":")[0].strip("[]"))
