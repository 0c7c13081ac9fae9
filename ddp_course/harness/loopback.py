"""torchrun with every store on a loopback host bound to loopback only.

``python -m ddp_course.harness.loopback [--tmpdir DIR] [--fork-ranks] TORCHRUN_ARGS``
is torchrun whose TCPStore servers listen on 127.0.0.1 (or ::1) when their host is a
loopback address, instead of on every interface; :func:`ddp_course.harness.launch.torchrun`
starts every job this way. ``--fork-ranks`` forks the ranks from the agent
(:mod:`.forked_ranks`) instead of starting each as a new interpreter.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

_TCPSTORE_ARGS = (
    "world_size",
    "is_master",
    "timeout",
    "wait_for_workers",
    "multi_tenant",
    "master_listen_fd",
    "use_libuv",
)


def _loopback_family(host: str) -> int | None:
    if host == "localhost":
        return socket.AF_INET
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not address.is_loopback:
        return None
    return socket.AF_INET if address.version == 4 else socket.AF_INET6


def _loopback_tcpstore(base: type) -> type:
    """A subclass of ``torch.distributed.TCPStore`` whose server listens on
    loopback only when its host is a loopback address.

    TCPStore's server binds every interface (``::``) whatever its host name;
    the one way to narrow it is ``master_listen_fd``, a socket already bound
    (https://pytorch.org/docs/stable/distributed.html#torch.distributed.TCPStore).
    """

    class LoopbackTCPStore(base):
        torch_class = base  # what a forked rank puts back (see .forked_ranks)

        def __init__(self, host_name: str, port: int, *args: Any, **kwargs: Any) -> None:
            kwargs.update(zip(_TCPSTORE_ARGS, args))
            family = _loopback_family(host_name)
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None and family:
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind((host_name, port))
                except OSError as exc:
                    sock.close()
                    # RuntimeError is what torch's rendezvous expects from a
                    # store that cannot start (it then retries as a client).
                    raise RuntimeError(f"cannot listen on {host_name}:{port}: {exc}") from exc
                port = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()  # the store owns it now
            super().__init__(host_name, port, **kwargs)

    return LoopbackTCPStore


def serve_on_loopback(host: str, port: int) -> Any | None:
    """A ``torch.distributed.TCPStore`` server at ``host:port`` listening on loopback
    only, or None when ``host`` is not a loopback address.

    Made with ``multi_tenant=True``, so the store that ``init_process_group``'s
    ``env://`` or ``tcp://`` rendezvous then creates in this process at the same port
    shares this server instead of starting one on every interface. The server lives as
    long as the returned store.

    Raises:
        RuntimeError: ``port`` cannot be bound on ``host`` (another process holds it);
            the message says so.
    """
    import torch.distributed as dist

    if _loopback_family(host) is None:
        return None
    return _loopback_tcpstore(dist.TCPStore)(
        host, port, is_master=True, wait_for_workers=False, multi_tenant=True
    )


def agent_command(tmpdir: str | os.PathLike, fork_ranks: bool) -> list[str]:
    """The start of an agent's command line: ``python -m ddp_course.harness.loopback
    --tmpdir TMPDIR [--fork-ranks]``, to which the launchers add torchrun's arguments."""
    return [
        sys.executable,
        "-m",
        "ddp_course.harness.loopback",
        "--tmpdir",
        str(tmpdir),
        *(["--fork-ranks"] if fork_ranks else []),
    ]


def main(argv: Sequence[str]) -> None:
    """torchrun's ``main`` with every TCPStore server on a loopback host bound
    to loopback, and the agent's temporary files in ``--tmpdir DIR``."""
    import torch.distributed as dist
    from torch.distributed import run
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    argv = list(argv)
    ranks_tempdir = tempfile.tempdir
    if argv[:1] == ["--tmpdir"]:
        # Only the agent's own files: the workers keep the usual temporary
        # folder (compile caches live there).
        tempfile.tempdir = argv[1]
        argv = argv[2:]
    if argv[:1] == ["--fork-ranks"]:
        from . import forked_ranks

        run.run_script_path = forked_ranks.prepare_agent(ranks_tempdir)
        argv = ["--run-path", "--start-method=fork", *argv[1:]]
    store = _loopback_tcpstore(dist.TCPStore)
    # The rendezvous backends bound the name at import; the agent's own store
    # is created through ``dist.TCPStore``.
    for module in (dist, c10d_rendezvous_backend, static_tcp_rendezvous):
        if hasattr(module, "TCPStore"):
            module.TCPStore = store
    run.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
