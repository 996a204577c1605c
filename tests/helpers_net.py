"""Network helpers shared by multi-process tests."""

from __future__ import annotations

from moe_launch.orchestrator.backend import free_port as _product_free_port


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, drawn where the supervisor draws its rendezvous ports (below the
    kernel's ephemeral range, so no outgoing connection takes it before the caller binds)."""
    return _product_free_port(host)
