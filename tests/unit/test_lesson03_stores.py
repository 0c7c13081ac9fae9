"""``serve_on_loopback`` of ``scripts/03_process_groups.py``, in one process: the store rank 0
serves listens on 127.0.0.1 only, and the store ``init_process_group`` makes for a
``tcp://`` address at that port shares it (``multi_tenant=True``) instead of listening on
every interface, as a plain TCPStore does."""

import importlib.util
import os
import pathlib

import psutil
import pytest
import torch
import torch.distributed as dist

from ddp_course.harness.ports import free_port

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "03_process_groups.py"


@pytest.fixture(scope="module")
def groups_script():
    spec = importlib.util.spec_from_file_location("lesson03_process_groups", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def listening(port: int) -> list[str]:
    return sorted(
        {
            c.laddr.ip
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.pid == os.getpid() and c.laddr.port == port
        }
    )


@pytest.mark.listens_everywhere("shows that a plain TCPStore does")
def test_a_plain_store_listens_on_every_interface():
    # The control: what serve_on_loopback avoids.
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    try:
        addresses = listening(port)
        assert addresses and all(ip in ("::", "0.0.0.0") for ip in addresses), addresses
    finally:
        del store


def test_tcp_init_shares_the_loopback_store(groups_script):
    port = free_port()
    server = groups_script.serve_on_loopback(port)
    assert groups_script.listens_on(port) == listening(port) == ["127.0.0.1"]
    # torch's tcp:// store on rank 0 would fail to listen if it did not share the server.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert listening(port) == ["127.0.0.1"]  # while the group is up
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
        del server


def test_a_taken_port_raises(groups_script):
    port = free_port()
    first = groups_script.serve_on_loopback(port)
    try:
        with pytest.raises(OSError):
            groups_script.serve_on_loopback(port)
    finally:
        del first
