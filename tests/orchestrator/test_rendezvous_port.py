"""Rendezvous ports come from below the kernel's ephemeral range, where no outgoing connection can take them."""

from __future__ import annotations

import random
import socket

from moe_launch.orchestrator.backend import free_port, rendezvous_ports


def test_ports_lie_below_the_ephemeral_range():
    assert rendezvous_ports("32768\t60999") == range(22768, 32768)
    assert rendezvous_ports("10000 65000") == range(1024, 10000)
    assert rendezvous_ports("1024 65000") == range(1024, 2048)  # never the well-known ports
    assert rendezvous_ports(None) == range(22768, 32768)
    assert rendezvous_ports("garbage") == range(22768, 32768)


def _first_choice_held(ports: range) -> tuple[int, socket.socket]:
    """A seed whose first draw (what free_port(rng=Random(seed)) tries first) is bindable now, and that port held."""
    for seed in range(100):
        held = socket.socket()
        try:
            held.bind(("", random.Random(seed).choice(ports)))
        except OSError:  # in use on this shared host already: try the next seed
            held.close()
            continue
        held.listen()
        return seed, held
    raise AssertionError("no port of the rendezvous range binds")


def test_free_port_binds_and_skips_a_taken_port():
    text = open("/proc/sys/net/ipv4/ip_local_port_range").read()
    seed, held = _first_choice_held(rendezvous_ports(text))
    with held:
        port = free_port(rng=random.Random(seed))
        assert port != held.getsockname()[1] and port in rendezvous_ports(text)
    with socket.socket() as s:
        s.bind(("", port))
    assert len({free_port() for _ in range(10)}) > 1
