"""torchft's Lighthouse and Manager with every listener on the loopback interface.

torchft (https://github.com/pytorch/torchft, pinned at 0.2.0) runs fault-tolerant
*replica groups*: each group trains a full copy of the model, a **Lighthouse** decides
which groups form the quorum of each step, and each group's **Manager** asks for that
quorum, all-reduces across the groups, votes on committing the step
(``should_commit``) and sends its state to a group that joins behind
(healing, over a *checkpoint transport*).

Its servers bind every interface unless told otherwise, and a course's job must be
reachable from this machine only:

* the Lighthouse takes a bind address: :func:`lighthouse` gives it 127.0.0.1;
* the Manager's own gRPC server binds ``[::]:<port>`` with no setting in 0.2.0:
  :func:`manager` builds the Manager while ``torchft.manager.ManagerServer`` is
  replaced by one bound to 127.0.0.1 (same port);
* the default checkpoint transport is an HTTP server on every interface:
  :func:`manager` uses ``PGTransport`` instead, which sends the state over the
  replica groups' own gloo process group and listens on nothing;
* the replica group's TCPStore is torchrun's (the course's launcher binds it to
  loopback), and gloo follows ``GLOO_SOCKET_IFNAME``.

torchft's Rust servers log about six lines a step at ``info``; ``RUST_LOG`` is read
once, when ``torchft`` is first imported, so this module sets it to ``warn`` (unless
set) before importing torchft, inside each function.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["LOOPBACK", "lighthouse", "manager"]

#: Where every torchft listener of the course binds.
LOOPBACK = "127.0.0.1"


def _torchft() -> Any:
    os.environ.setdefault("RUST_LOG", "warn")
    import torchft.manager

    return torchft


@contextlib.contextmanager
def lighthouse(
    min_replicas: int,
    heartbeat_timeout_ms: int = 5000,
    join_timeout_ms: int = 60000,
) -> Iterator[str]:
    """A torchft Lighthouse on a free loopback port, shut down on the way out.

    The Lighthouse forms each step's quorum from the replica groups that ask for one.
    It waits for every group still sending heartbeats (up to ``join_timeout_ms``), and
    counts a group as gone when its heartbeats stop for ``heartbeat_timeout_ms``: how
    long the survivors of a failure wait before they train on without it.

    Args:
        min_replicas: the fewest replica groups a quorum may have.
        heartbeat_timeout_ms: milliseconds without a heartbeat after which a group is
            dead (torchft's default 5000).
        join_timeout_ms: milliseconds a quorum waits for groups that send heartbeats but
            have not asked to join (torchft's default 60000).

    Yields:
        The address the replica groups' Managers need, ``http://127.0.0.1:PORT``
        (torchft's ``TORCHFT_LIGHTHOUSE``).

    Raises:
        ModuleNotFoundError: torchft is not installed (``make setup`` installs it on
            Python 3.11 and 3.12).
    """
    _torchft()
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=f"{LOOPBACK}:0",
        min_replicas=min_replicas,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
        join_timeout_ms=join_timeout_ms,
    )
    try:
        port = server.address().rsplit(":", 1)[1]  # it names the host name, not the bind
        yield f"http://{LOOPBACK}:{port}"
    finally:
        server.shutdown()


@contextlib.contextmanager
def _manager_server_on_loopback() -> Iterator[None]:
    ft = _torchft()
    original = ft.manager.ManagerServer

    def on_loopback(**kwargs: Any) -> Any:
        kwargs["bind"] = f"{LOOPBACK}:{kwargs['bind'].rsplit(':', 1)[1]}"
        return original(**kwargs)

    ft.manager.ManagerServer = on_loopback
    try:
        yield
    finally:
        ft.manager.ManagerServer = original


def manager(
    pg: Any,
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
    *,
    replica_id: str,
    lighthouse_addr: str,
    store_port: int,
    min_replica_size: int,
    timeout: datetime.timedelta = datetime.timedelta(seconds=30),
    **kwargs: Any,
) -> Any:
    """A ``torchft.Manager`` for a replica group of one process whose every listener is
    on loopback (see the module's docstring).

    Args:
        pg: the groups' reconfigurable process group, ``torchft.ProcessGroupGloo``; the
            checkpoint transport uses it too.
        state_dict: returns what a joining group must receive (model, optimizer, ...).
        load_state_dict: loads what ``state_dict`` returned, on the joining group.
        replica_id: this group's name; a restarted group keeps it.
        lighthouse_addr: :func:`lighthouse`'s address.
        store_port: the port of this group's TCPStore on 127.0.0.1 (torchrun's
            ``MASTER_PORT``).
        min_replica_size: the fewest groups a step may be committed with.
        timeout: limit of every collective, quorum and connection.
        kwargs: more ``torchft.Manager`` arguments (``init_sync``,
            ``use_async_quorum``, ...).

    Returns:
        The Manager; call ``shutdown()`` when done.
    """
    ft = _torchft()
    import torch
    from torchft.checkpointing.pg_transport import PGTransport

    transport = PGTransport(pg, timeout=timeout, device=torch.device("cpu"))
    with _manager_server_on_loopback():
        return ft.Manager(
            pg=pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=min_replica_size,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_addr=LOOPBACK,
            store_port=store_port,
            lighthouse_addr=lighthouse_addr,
            replica_id=replica_id,
            hostname=LOOPBACK,
            checkpoint_transport=transport,
            **kwargs,
        )
