"""benchmarks/wire_timing.py: the time inside a router, read from a loopback capture.

The capture here is written by hand (dpkt builds the frames), so every timestamp is known:
the router on port 8000, one replica on 9000."""

import sys
from pathlib import Path

import dpkt
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import wire_timing  # noqa: E402

ROUTER, REPLICA = 8000, 9000


def frame(sport: int, dport: int, payload: bytes) -> bytes:
    segment = dpkt.tcp.TCP(sport=sport, dport=dport, flags=dpkt.tcp.TH_ACK | dpkt.tcp.TH_PUSH,
                           data=payload)
    ip = dpkt.ip.IP(src=b"\x7f\x00\x00\x01", dst=b"\x7f\x00\x00\x01", p=dpkt.ip.IP_PROTO_TCP,
                    data=segment)
    ip.len = len(bytes(ip))
    return bytes(dpkt.ethernet.Ethernet(type=dpkt.ethernet.ETH_TYPE_IP, data=ip))


def write(path: Path, packets: list[tuple[float, int, int, bytes]]) -> None:
    with open(path, "wb") as fh:
        writer = dpkt.pcap.Writer(fh, nano=True)
        for ts, sport, dport, payload in packets:
            writer.writepkt(frame(sport, dport, payload), ts=ts)


REQUEST = b'POST /v1/completions HTTP/1.1\r\ncontent-length: 40\r\n\r\n{"user": "hop-abc123-7", "prompt": "hi"}'


def test_one_routed_request_is_timed_on_both_legs(tmp_path: Path) -> None:
    # Client 50001 -> router; router 50002 -> replica. The request reaches the router at
    # 10.0000 (its last segment), leaves at 10.0004; the first event arrives at 10.0500 and
    # leaves at 10.0502: 0.4 ms + 0.2 ms inside.
    packets = [
        (10.0000 - 0.0001, 50001, ROUTER, REQUEST[:30]),
        (10.0000, 50001, ROUTER, REQUEST[30:]),               # the tag is in the 2nd segment
        (10.0004, 50002, REPLICA, REQUEST.replace(b'": "', b'":"')),
        (10.0010, REPLICA, 50002, b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"),
        (10.0500, REPLICA, 50002, b'1a\r\ndata: {"choices": []}\n\n\r\n'),
        (10.0502, ROUTER, 50001, b'HTTP/1.1 200 OK\r\n\r\n1a\r\ndata: {"choices": []}\n\n\r\n'),
        (10.1000, REPLICA, 50002, b'1a\r\ndata: {"choices": []}\n\n\r\n'),  # later events
        (10.1003, ROUTER, 50001, b'1a\r\ndata: {"choices": []}\n\n\r\n'),
    ]
    path = tmp_path / "c.pcap"
    write(path, packets)
    times = wire_timing.router_times(path, ROUTER, {REPLICA})
    assert list(times) == ["hop-abc123-7"]
    req_in, req_out, event_in, event_out = times["hop-abc123-7"]
    assert req_out - req_in == pytest.approx(0.0004, abs=1e-6)
    assert event_out - event_in == pytest.approx(0.0002, abs=1e-6)
    summary = wire_timing.summarize(times, [["hop-abc123-7"], ["hop-abc123-9"]], dropped=0)
    assert summary["p50_s"] == pytest.approx(0.0006, abs=1e-6)
    assert (summary["joined"], summary["unjoined"]) == (1, 1)
    assert summary["halves"][1]["p50_s"] is None


def test_a_reused_connection_and_a_direct_request(tmp_path: Path) -> None:
    # Two requests one after the other on the same connections, and a direct request to the
    # replica (tag 9) that never passes the router: it must not join.
    second = REQUEST.replace(b"hop-abc123-7", b"hop-abc123-8")
    direct = REQUEST.replace(b"hop-abc123-7", b"hop-abc123-9")
    event = b'1a\r\ndata: {"choices": []}\n\n\r\n'
    packets = [
        (1.000, 50001, ROUTER, REQUEST), (1.001, 50002, REPLICA, REQUEST),
        (1.050, REPLICA, 50002, event), (1.0505, ROUTER, 50001, event),
        (1.060, 50003, REPLICA, direct), (1.110, REPLICA, 50003, event),
        (2.000, 50001, ROUTER, second), (2.003, 50002, REPLICA, second),
        (2.040, REPLICA, 50002, b"HTTP/1.1 200 OK\r\n\r\n" + event),
        (2.041, ROUTER, 50001, event),
    ]
    path = tmp_path / "c.pcap"
    write(path, packets)
    times = wire_timing.router_times(path, ROUTER, {REPLICA})
    assert sorted(times) == ["hop-abc123-7", "hop-abc123-8"]
    inside = {tag: (t[1] - t[0]) + (t[3] - t[2]) for tag, t in times.items()}
    assert inside["hop-abc123-7"] == pytest.approx(0.0015, abs=1e-6)
    assert inside["hop-abc123-8"] == pytest.approx(0.004, abs=1e-6)
