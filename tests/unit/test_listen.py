"""Ports handed to servers that bind later, and what an "address in use" error says."""

import socket

import pytest
import zmq

from prefixroute.core.errors import ConfigError
from prefixroute.edges.kvevents.zmq import KVEventSubscriber
from prefixroute.edges.listen import (bind_socket, can_avoid_ephemeral_ports,
                                      ephemeral_port_range, free_port)

SPAN = ephemeral_port_range()
linux_range = pytest.mark.skipif(SPAN is None, reason="no /proc/sys/net/ipv4/ip_local_port_range")
outside_ports = pytest.mark.skipif(not can_avoid_ephemeral_ports(),
                                   reason="the ephemeral range leaves too few ports outside it")


@outside_ports
def test_free_ports_lie_outside_the_ephemeral_range_and_are_never_repeated():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(port >= 10_000 and not SPAN[0] <= port <= SPAN[1] for port in ports)
    for port in ports[:5]:  # free now: a plain bind (no SO_REUSEADDR) succeeds
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@linux_range
def test_the_kernel_chooses_ports_inside_the_range():
    # bind(0) takes ports from the ephemeral range only, where free_port() does not draw.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert SPAN[0] <= s.getsockname()[1] <= SPAN[1]


def held_ephemeral_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@linux_range
def test_listening_on_a_taken_ephemeral_port_says_why_and_what_to_do():
    with held_ephemeral_port() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as error:
            bind_socket("127.0.0.1", port)
    message = str(error.value)
    assert f"cannot listen on 127.0.0.1:{port}" in message
    assert f"ephemeral range {SPAN[0]}-{SPAN[1]}" in message
    assert "choose a port outside it" in message


@outside_ports
def test_a_taken_port_outside_the_range_gets_no_range_hint():
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(ConfigError) as error:
            bind_socket("127.0.0.1", port)
    assert "in use" in str(error.value) and "ephemeral" not in str(error.value)


@linux_range
def test_binding_a_taken_kv_event_endpoint_says_why_and_what_to_do():
    with held_ephemeral_port() as taken:
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(ConfigError) as error:
            KVEventSubscriber(endpoint, bind=True, context=zmq.Context.instance())
    message = str(error.value)
    assert f"cannot bind {endpoint}" in message and "Address already in use" in message
    assert "choose a port outside it" in message
