"""The test harness's ports: a world told to listen on one must still find it free when it starts."""

from __future__ import annotations

import socket

from tests.launch import _ephemeral_low, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_handed_out_twice():
    # bind(0) ports are ephemeral: an outgoing connection could take one before its world listens (CI's
    # EADDRINUSE in a fault child); and one world's port must not be promised to another
    ports = [free_port() for _ in range(50)]
    assert all(10000 <= p < _ephemeral_low() for p in ports), ports
    assert len(set(ports)) == len(ports), ports
    with socket.socket() as s:  # and it really is free
        s.bind(("127.0.0.1", ports[-1]))
