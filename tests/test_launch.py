"""grpo_patches.testing.free_port, the ports the tests and examples start worlds on: a world told to listen on one must still find it free when it starts."""

from __future__ import annotations

import socket

from grpo_patches import testing
from grpo_patches.testing import _ephemeral_low, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_free():
    # bind(0) ports are ephemeral: an outgoing connection could take one before its world listens (CI's
    # EADDRINUSE in a fault child)
    ports = [free_port() for _ in range(50)]
    assert all(10000 <= p < _ephemeral_low() for p in ports), ports
    with socket.socket() as s:  # and it really is free
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_handed_out_once_is_not_handed_out_again(monkeypatch):
    # free until its world listens: a second draw of it must be skipped, not promised to another world
    first = free_port()
    draws = iter([first, first, first + 1 if first + 1 < _ephemeral_low() else first - 1])

    class Scripted:
        def randrange(self, *_):
            return next(draws)

    monkeypatch.setattr(testing.random, "SystemRandom", Scripted)
    assert free_port() != first
    assert next(draws, None) is None  # it drew the repeat twice and took the third
