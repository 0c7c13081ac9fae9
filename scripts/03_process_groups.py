"""Lesson 03: how the ranks meet (env://, tcp://, file://) and what torchrun gives them.

python scripts/03_process_groups.py                       # a group of one rank
torchrun --nproc_per_node=2 scripts/03_process_groups.py
torchrun --nproc_per_node=2 scripts/03_process_groups.py --results build/03_groups.json

Every rank records the environment variables that torchrun added to its
parent's (read from the parent process with psutil), then creates the
default process group three times, once per init method, and checks an
all_reduce. There is no backend argument, except for a CPU job on a GPU
machine: there torch's default is nccl only, which cannot move CPU tensors,
so it names gloo. While the env:// group is up, rank 0 lists the TCP sockets
the job listens on. A fourth time it names the backend per device type, on
a tcp:// store of its own: "cpu:gloo" where the ranks run on the CPU, and
"cpu:gloo,cuda:nccl" with device_id= where every rank has a GPU of its own
(the launcher's device plan), a fourth entry under "init". Every store rank
0 serves listens on 127.0.0.1 only.
"""

import argparse
import os
import shutil
import socket
import tempfile
import time

import psutil
import torch
import torch.distributed as dist

from ddp_course.harness.ports import free_port
from ddp_course.runtime import gpu_count, pick_device
from ddp_course.tools.records import write_results


def added_by_launcher() -> dict[str, str] | None:
    """Variables this process has and its parent (torchrun's agent) had not at start.

    None when the parent's environment cannot be read (another user's process,
    or a platform where psutil cannot read it).
    """
    try:
        parent = psutil.Process(os.getppid()).environ()
    except (psutil.Error, OSError):
        return None
    return {k: v for k, v in sorted(os.environ.items()) if k not in parent}


def all_reduce_check(rank: int, world_size: int, device: torch.device) -> int:
    """all_reduce of rank + 1 over the current default group; returns the sum."""
    t = torch.tensor([rank + 1], device=device)
    dist.all_reduce(t)
    assert t.item() == world_size * (world_size + 1) // 2, t.item()
    return int(t.item())


def listening_sockets(pids: list[int]) -> list[dict]:
    """TCP sockets in LISTEN state owned by the job: torchrun's agent and the ranks.

    ``pids[r]`` is rank r's process id; the agent is this process's parent.
    """
    owners = {os.getppid(): "agent"} | {pid: f"rank {r}" for r, pid in enumerate(pids)}
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in owners:
            found.append({"process": owners[conn.pid], "address": conn.laddr.ip})
    return sorted(found, key=lambda s: (s["process"], s["address"]))


def listens_on(port: int) -> list[str]:
    """The addresses this process listens on at TCP ``port``, e.g. ``["127.0.0.1"]``."""
    return sorted({c.laddr.ip for c in psutil.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.pid == os.getpid()
                   and c.laddr.port == port})


def serve_on_loopback(port: int) -> dist.TCPStore:
    """A TCPStore server at 127.0.0.1:``port`` that listens on loopback only.

    A TCPStore server listens on every interface whatever host name it is given,
    unless it is handed a socket already bound (``master_listen_fd``). With
    ``multi_tenant=True``, the store that ``init_process_group`` makes in this
    process for ``tcp://127.0.0.1:<port>`` (or env:// at that ``MASTER_PORT``)
    shares this server instead of starting one on every interface. The server
    lives as long as the returned store.

    Raises:
        OSError: ``port`` cannot be bound on 127.0.0.1 (it is in use).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         multi_tenant=True, master_listen_fd=sock.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", help="rank 0 writes its records here (JSON)")
    args = parser.parse_args()
    added = added_by_launcher()  # before this script sets anything itself
    servers: dict[str, dist.TCPStore] = {}  # rank 0's own stores, alive to the end
    if "WORLD_SIZE" not in os.environ:
        # Plain python: a group of one, so the init methods below still run. Its env://
        # store is this process's own: served on loopback only.
        port = free_port()
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        servers["env://"] = serve_on_loopback(port)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # The launcher's plan (DDP_COURSE_DEVICE): cuda:<local_rank> only when every
    # rank has a GPU of its own, else the CPU for the whole job.
    device = pick_device(local_rank)
    one_gpu_each = device.type == "cuda"
    if one_gpu_each:
        torch.cuda.set_device(device)
    # No backend argument: torch picks the backend of the machine's accelerator,
    # nccl where there is a GPU (and, in recent torch, no CPU backend beside it),
    # gloo otherwise. A CPU job on a GPU machine must name gloo.
    backend = "gloo" if device.type == "cpu" and gpu_count() > 0 else None
    record: dict = {"world_size": world_size, "added_by_launcher": added, "init": {},
                    "device": str(device), "backend_argument": backend}
    # The network interfaces gloo and nccl were told to use, if any.
    record["socket_ifname"] = {k: os.environ.get(k)
                               for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}

    # 1. env:// with no backend argument: torch picks the accelerator's backend.
    dist.init_process_group(backend=backend)
    record["init"]["env://"] = {"backend": dist.get_backend_config(),
                                "sum": all_reduce_check(rank, world_size, device)}
    if rank == 0:  # under torchrun the agent serves MASTER_PORT, not rank 0
        record["init"]["env://"]["store_listens_on"] = listens_on(int(os.environ["MASTER_PORT"]))
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    if rank == 0:
        record["listening"] = listening_sockets(pids)
        store_dir = tempfile.mkdtemp(prefix="ddp_course_store_")
        # Rank 0 serves the stores of steps 2 and 4 and a side store, before anyone
        # connects; a port is taken as soon as it is picked, so the three differ.
        ports = {}
        for name in ("tcp://", "per-device", "side"):
            ports[name] = free_port()
            servers[name] = serve_on_loopback(ports[name])
        rendezvous = [f"tcp://127.0.0.1:{ports['tcp://']}", f"file://{store_dir}/store",
                      f"tcp://127.0.0.1:{ports['per-device']}", ports["side"]]
    else:
        rendezvous = [None] * 4
    dist.broadcast_object_list(rendezvous, src=0)  # every rank needs the same addresses
    dist.destroy_process_group()

    # 2. and 3. tcp:// and file://: the address says where; rank and size are passed.
    # Under torchrun, TORCHELASTIC_USE_AGENT_STORE=True tells rank 0 not to start a
    # store of its own (the agent's serves env://); a tcp:// store must be rank 0's.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    tcp, file, per_device, side_port = rendezvous
    steps = [("tcp://", tcp, {"backend": backend}), ("file://", file, {"backend": backend})]
    # 4. The backend named per device type, on a fourth store. Not env:// again: under
    # torchrun MASTER_PORT is the agent's store, which rank 0 cannot serve (the port is
    # taken), and a new group must not read the keys an earlier one left in a store.
    if one_gpu_each:  # device_id= binds the group to this rank's GPU; nccl connects at once
        steps.append(("cpu:gloo,cuda:nccl + device_id", per_device,
                      {"backend": "cpu:gloo,cuda:nccl", "device_id": device}))
    else:
        steps.append(("cpu:gloo", per_device, {"backend": "cpu:gloo"}))
    # Rank 0 serves the stores, and a peer's teardown still talks to them: rank 0 tears
    # its group down last, once the side store (alive to the end) has counted the others.
    side = servers.get("side") or dist.TCPStore("127.0.0.1", side_port, is_master=False)
    for name, method, kwargs in steps:
        dist.init_process_group(init_method=method, rank=rank, world_size=world_size, **kwargs)
        record["init"][name] = {"backend": dist.get_backend_config(),
                                "sum": all_reduce_check(rank, world_size, device)}
        if rank == 0 and method.startswith("tcp://"):  # rank 0's store, shared with torch's
            record["init"][name]["store_listens_on"] = listens_on(int(method.rsplit(":", 1)[1]))
        dist.barrier()
        if rank != 0:
            dist.destroy_process_group()
            side.add(f"left {name}", 1)
        else:
            while side.add(f"left {name}", 0) < world_size - 1:
                time.sleep(0.01)
            dist.destroy_process_group()
    if rank == 0:
        shutil.rmtree(store_dir, ignore_errors=True)
        record["side_store_listens_on"] = listens_on(side_port)
        write_results(None, args.results, record)


if __name__ == "__main__":
    main()
