"""debug: repeated epoch orders, model digests, py-spy dumps, flight-recorder dumps."""

import os
import pickle
import subprocess
import sys
import uuid

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_course.tools import debug


def test_repeated_orders():
    assert debug.repeated_orders([[3, 1, 2], [3, 1, 2], [1, 2, 3]]) == [(0, 1)]
    assert debug.repeated_orders([[1, 2], [2, 1]]) == []
    with pytest.raises(ValueError, match="at least 2 epochs"):
        debug.repeated_orders([[1, 2]])


def test_digests_see_one_changed_bit_and_shapes():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    b = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    b.load_state_dict(a.state_dict())
    assert debug.tensor_digests(a) == debug.tensor_digests(b)
    with torch.no_grad():
        b[0].weight[0, 0] = torch.nextafter(b[0].weight[0, 0], torch.tensor(1.0))
    b[1].running_mean += 0  # unchanged buffer, same digest
    da, db = debug.tensor_digests(a), debug.tensor_digests(b)
    assert [n for n in da if da[n] != db[n]] == ["0.weight"]
    assert debug.tensor_digests(nn.Linear(3, 4))["weight"][0] == (4, 3)


def test_models_differ_without_a_group_is_empty():
    assert not dist.is_initialized()
    assert debug.models_differ(nn.Linear(2, 2)) == {}


def _entry(seq, op, sizes, line, p2p=False):
    return {
        "collective_seq_id": seq,
        "profiling_name": f"gloo:{op}",
        "input_sizes": sizes,
        "state": "scheduled",
        "is_p2p": p2p,
        "process_group": ("0", "default_pg"),
        "frames": [
            {"name": op, "filename": "/x/torch/distributed/c10d.py", "line": 1},
            {"name": "<module>", "filename": "/x/train.py", "line": line},
        ],
    }


def _write(folder, rank, entries):
    (folder / f"rank_{rank}").write_bytes(pickle.dumps({"entries": entries}))


def test_first_divergence_names_the_collective_and_the_missing_rank(tmp_path):
    _write(tmp_path, 0, [_entry(1, "all_reduce", [[4]], 10), _entry(2, "barrier", [[1]], 12)])
    _write(tmp_path, 1, [_entry(1, "all_reduce", [[4]], 10), _entry(0, "send", [[1]], 9, True)])
    traces = debug.read_flight_recorder(tmp_path)
    assert traces[0][1] == {
        "seq": 2,
        "op": "barrier",
        "sizes": [[1]],
        "state": "scheduled",
        "where": "train.py:12",
    }
    assert len(traces[1]) == 1  # point-to-point entries are left out
    assert debug.first_divergence(traces) == {
        "seq": 2,
        "calls": {0: "barrier [[1]] at train.py:12", 1: None},
    }
    _write(tmp_path, 1, [_entry(1, "all_reduce", [[5]], 10), _entry(2, "barrier", [[1]], 12)])
    assert debug.first_divergence(debug.read_flight_recorder(tmp_path))["seq"] == 1  # sizes
    _write(tmp_path, 1, [_entry(1, "all_reduce", [[4]], 10), _entry(2, "barrier", [[1]], 12)])
    assert debug.first_divergence(debug.read_flight_recorder(tmp_path)) is None
    with pytest.raises(FileNotFoundError, match="no flight-recorder dump"):
        debug.read_flight_recorder(tmp_path / "none")


def test_flight_recorder_dump_of_a_gloo_group(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")  # read when the group is created
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(3))
        dist.broadcast(torch.ones(2), src=0)
        debug.dump_flight_recorder(tmp_path, 0)
    finally:
        dist.destroy_process_group()
    ops = [(e["seq"], e["op"], e["sizes"]) for e in debug.read_flight_recorder(tmp_path)[0]]
    assert ops[-2:] == [(1, "all_reduce", [[3]]), (2, "broadcast", [[2]])]


def test_flight_recorder_off_is_a_clear_error(tmp_path, monkeypatch):
    # The recorder is process-wide and stays on once a group was made with it, so
    # an empty buffer (TORCH_FR_BUFFER_SIZE unset) is simulated.
    monkeypatch.setattr(debug, "_dump_fr", lambda: pickle.dumps({"entries": []}))
    with pytest.raises(RuntimeError, match="TORCH_FR_BUFFER_SIZE"):
        debug.dump_flight_recorder(tmp_path, 0)
    assert list(tmp_path.iterdir()) == []


def test_py_spy_dumps_every_rank_of_a_running_job(monkeypatch):
    marker = f"debug_probe_{uuid.uuid4().hex}"
    code = "import time\ndef waiting_here():\n    time.sleep(60)\nwaiting_here()\n"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, marker], env={"RANK": str(r)})
        for r in range(2)
    ]
    try:
        import time

        time.sleep(1.0)
        assert sorted(debug.rank_processes(marker)) == [0, 1]
        dumps = debug.py_spy_dumps(marker)
        assert sorted(dumps) == [0, 1]
        assert all("waiting_here" in text for text in dumps.values())
    finally:
        for p in procs:
            p.kill()
            p.wait()
    with pytest.raises(LookupError, match="no running torchrun worker"):
        debug.py_spy_dumps(marker)
    monkeypatch.setattr(debug.shutil, "which", lambda name: None)
    monkeypatch.setattr(debug, "_next_to_python", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install py-spy"):
        debug.py_spy_dumps(marker)


def _sleeping_rank(marker):
    code = "import time\ndef waiting_here():\n    time.sleep(60)\nwaiting_here()\n"
    return subprocess.Popen([sys.executable, "-c", code, marker], env={"RANK": "0"})


def test_py_spy_refused_as_a_normal_user_says_why_and_what_to_do(tmp_path, monkeypatch):
    """What a learner without ptrace rights meets (Ubuntu: ptrace_scope 1).

    As root, py-spy runs as the user nobody (setpriv), which may not attach to
    root's process, as a normal user under ptrace_scope 1 may not attach to
    torchrun's children. As a normal user, py-spy runs as is, and the kernel's
    own rule decides.
    """
    real = debug.shutil.which("py-spy") or debug._next_to_python("py-spy")
    if real is None:
        pytest.skip("py-spy is not installed")
    if os.geteuid() == 0:
        setpriv = debug.shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv (util-linux): cannot drop to nobody")
        wrapper = tmp_path / "py-spy"
        wrapper.write_text(
            f'#!/bin/sh\nexec {setpriv} --reuid=nobody --regid=nogroup --clear-groups {real} "$@"\n'
        )
        wrapper.chmod(0o755)
        monkeypatch.setattr(debug.shutil, "which", lambda name: str(wrapper))
    elif debug.ptrace_scope() in (None, 0):
        pytest.skip(
            f"a normal user with ptrace_scope {debug.ptrace_scope()}: py-spy may attach to "
            "the user's own processes, nothing is refused"
        )
    marker = f"debug_probe_{uuid.uuid4().hex}"
    proc = _sleeping_rank(marker)
    try:
        import time

        time.sleep(1.0)
        with pytest.raises(PermissionError) as refused:
            debug.py_spy_dumps(marker)
    finally:
        proc.kill()
        proc.wait()
    message = str(refused.value)
    assert "cannot attach to rank 0" in message
    assert all(w in message for w in ("sudo", "ptrace_scope=0", "--cap-add SYS_PTRACE")), message


def test_ptrace_advice_names_the_kernel_rule(monkeypatch, tmp_path):
    scope_file = tmp_path / "ptrace_scope"
    monkeypatch.setattr(debug, "YAMA_PTRACE_SCOPE", scope_file)
    assert debug.ptrace_scope() is None and "no Yama" in debug.ptrace_advice()
    scope_file.write_text("1\n")
    assert debug.ptrace_scope() == 1
    assert "only to its own descendants" in debug.ptrace_advice()


@pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13),
    reason="the default checked here is torch 2.13's",
)
def test_flight_recorder_is_on_by_default_and_keeps_2000_collectives(tmp_path):
    # A process of its own: the recorder is process-wide and read at the first group.
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "from ddp_course.tools import debug\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "for _ in range(2010):\n"
        "    dist.all_reduce(torch.ones(1))\n"
        "debug.dump_flight_recorder(sys.argv[1], 0)\n"
        "dist.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_FR_")}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, check=True, timeout=120)
    seqs = [e["seq"] for e in debug.read_flight_recorder(tmp_path)[0]]
    assert len(seqs) == 2000 and seqs[-1] == 2010  # the newest 2000 of 2010


def test_rank_spread_without_a_process_group_is_zero():
    assert debug.rank_spread(torch.ones(3)) == 0.0
