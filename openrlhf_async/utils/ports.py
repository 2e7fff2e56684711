"""Ports for rendezvous servers that bind some seconds after the port is chosen."""

import random
import socket

_FLOOR = 20000  # above Ray's worker ports (10002-19999 by default) and the usual fixed service ports


def _ephemeral_range() -> tuple:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "") -> int:
    """A TCP port nothing listens on now, taken below the kernel's ephemeral range where it can.

    A port handed out by bind(0) comes from the range the kernel also uses for the source port of every outbound
    connection, so in the seconds before a TCPStore binds it (a rank's actor importing DeepSpeed) one of Ray's many
    connections may take it: the rendezvous then fails with EADDRINUSE (seen once in a CI run). Below that range a
    port is only taken by a process that binds that very number."""
    low, _ = _ephemeral_range()
    pick = random.SystemRandom()  # not the seeded module-level generator: two runs must not pick the same ports
    for port in pick.sample(range(_FLOOR, low), min(64, max(0, low - _FLOOR))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
