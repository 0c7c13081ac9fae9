"""A rate-limited veth link (netns.limit_rate): bulk bytes cross it at about the rate."""

import subprocess
import sys
import time

import pytest

from ddp_course.harness import netns

pytestmark = pytest.mark.skipif(
    netns.unavailable() is not None, reason=f"network namespaces: {netns.unavailable()}"
)

SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 5601))
c, _ = s.accept()
while c.recv(1 << 16):
    pass
c.sendall(b"k")
"""
CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 5601), timeout=30)
start = time.perf_counter()
c.sendall(b"x" * int(sys.argv[2]))
c.shutdown(socket.SHUT_WR)
c.recv(1)
print(time.perf_counter() - start)
"""


def transfer_s(sender, receiver, nbytes):
    server = subprocess.Popen(
        ["ip", "netns", "exec", receiver.netns, sys.executable, "-c", SERVER, receiver.addr]
    )
    try:
        time.sleep(1.0)  # the server listens
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                sender.netns,
                sys.executable,
                "-c",
                CLIENT,
                receiver.addr,
                str(nbytes),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        return float(out.stdout)
    finally:
        server.wait(timeout=30)


def test_a_limited_link_carries_about_its_rate_and_an_open_one_more():
    nbytes, mbit = 2_500_000, 40
    with netns.veth_hosts(tag="rate") as (a, b):
        open_s = transfer_s(a, b, nbytes)
        netns.limit_rate(a, mbit)
        limited_s = transfer_s(a, b, nbytes)
    rate = nbytes * 8 / limited_s / 1e6
    assert 0.5 * mbit < rate < 1.1 * mbit, rate  # the limit, give or take the burst
    assert open_s < limited_s / 3


def test_bad_rates_are_refused():
    with pytest.raises(ValueError, match="positive"):
        netns.limit_rate(netns.Host("x", "y", "10.0.0.1"), 0)
