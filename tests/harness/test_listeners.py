"""tests/listeners.py, the plugin that fails a test whose processes listen beyond loopback:
its reading of /proc/net/tcp, and a test run with it that fails, passes or is excused."""

import os
import socket
import textwrap

import pytest
from listeners import ListenerWatch, listening_inodes, socket_inodes

pytest_plugins = ["pytester"]

needs_proc = pytest.mark.skipif(
    not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp"
)


@needs_proc
@pytest.mark.listens_everywhere("opens an all-interfaces socket to see it found")
@pytest.mark.parametrize(("host", "family"), [("0.0.0.0", socket.AF_INET), ("::", socket.AF_INET6)])
def test_a_listener_on_every_interface_is_found_with_its_process(host, family):
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        sock.listen()
        port = sock.getsockname()[1]
        [inode] = [i for i, (a, p) in listening_inodes().items() if p == port]
        assert listening_inodes()[inode] == (host, port)
        assert inode in socket_inodes(os.getpid())
        watch = ListenerWatch()
        watch.sample()
        assert [(a, p, pid) for _, a, p, pid, _ in watch.seen] == [(host, port, os.getpid())]


@needs_proc
def test_a_loopback_listener_is_not_recorded():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert ("127.0.0.1", port) in listening_inodes().values()
        watch = ListenerWatch()
        watch.sample()
        assert all(p != port for _, _, p, _, _ in watch.seen)


@needs_proc
@pytest.mark.listens_everywhere("runs tests that open all-interfaces sockets")
def test_the_plugin_fails_a_test_that_listens_on_every_interface(pytester):
    pytester.makepyfile(
        textwrap.dedent(
            """
            import socket, time
            import pytest

            def listen(host):
                with socket.socket() as sock:
                    sock.bind((host, 0))
                    sock.listen()
                    time.sleep(0.6)  # three of the watch's periods

            def test_everywhere():
                listen("0.0.0.0")

            def test_loopback():
                listen("127.0.0.1")

            @pytest.mark.listens_everywhere("a demonstration")
            def test_excused():
                listen("0.0.0.0")
            """
        )
    )
    result = pytester.runpytest("-p", "listeners", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_everywhere*", "*0.0.0.0 port *"])
