"""A worker's torch.distributed store takes a free port that is none of the server's own: the server's HTTP port is
free until the server binds it, which may be after the workers' ports are chosen (a clean-clone run once had a
worker's store and the HTTP listener pick the same port, and the server exited with EADDRINUSE)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tokenmill_service.front.router.spec import any_free_port, free_port


def test_a_port_the_os_hands_out_is_skipped_when_the_server_is_to_bind_it() -> None:
    handed_out: Iterator[int] = iter([8000, 8000, 41234])
    assert free_port(avoid={8000, 9090}, pick=lambda: next(handed_out)) == 41234


def test_with_nothing_to_avoid_the_first_free_port_is_taken() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free indeed


def test_a_port_source_that_only_offers_avoided_ports_is_an_error_not_a_hang() -> None:
    with pytest.raises(RuntimeError, match="no free port outside"):
        free_port(avoid={8000}, pick=lambda: 8000)


def test_the_os_source_gives_bindable_ports() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", any_free_port()))
