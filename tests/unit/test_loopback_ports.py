"""``protocol.loopback.free_port``: ports a child binds a moment later, out of the way of outgoing connections."""
from __future__ import annotations

import socket

from protocol import loopback


def test_a_free_port_is_below_the_ephemeral_range_and_bindable():
    low, _ = loopback.ephemeral_range()
    ports = {loopback.free_port() for _ in range(50)}
    assert len(ports) > 40  # picked at random, not the same few
    for port in ports:
        assert loopback.PORT_FLOOR <= port < low
        with socket.socket() as s:
            s.bind((loopback.LOOPBACK, port))


def test_a_port_in_use_is_never_returned(monkeypatch):
    with socket.socket() as held:
        held.bind((loopback.LOOPBACK, 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(loopback, "ephemeral_range", lambda: (taken + 1, 60999))
        monkeypatch.setattr(loopback, "PORT_FLOOR", taken - 7)  # 8 ports: the taken one among them
        monkeypatch.setattr(loopback, "MIN_SPAN", 1)
        for _ in range(200):
            assert loopback.free_port() != taken


def test_no_room_below_the_range_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(loopback, "ephemeral_range", lambda: (loopback.PORT_FLOOR + 10, 60999))
    port = loopback.free_port()
    assert port >= loopback.PORT_FLOOR + 10


def test_an_unreadable_range_reads_as_linuxs_default(tmp_path):
    assert loopback.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    bad = tmp_path / "bad"
    bad.write_text("not numbers")
    assert loopback.ephemeral_range(str(bad)) == (32768, 60999)
    good = tmp_path / "good"
    good.write_text("40000\t50000\n")
    assert loopback.ephemeral_range(str(good)) == (40000, 50000)
