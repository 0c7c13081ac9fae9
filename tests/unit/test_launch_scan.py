"""The launch scan (ddp_course.harness.launch_scan) on small notebooks written here: each way a
notebook starts ranks or touches CUDA is found, with its ranks, device and GPU conditions."""

import json

import pytest

from ddp_course.harness import launch_scan, multinode, notebook_values


def notebook(tmp_path, *cells, name="05_x.ipynb"):
    """A notebook file of code cells (each a string) in ``tmp_path``; its path."""
    nb = {
        "cells": [{"cell_type": "code", "metadata": {}, "source": c, "outputs": []} for c in cells],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    path = tmp_path / name
    path.write_text(json.dumps(nb))
    return path


def only(path, kind=None):
    found = [x for x in launch_scan.notebook_launches(path) if kind is None or x.kind == kind]
    assert len(found) == 1, found
    return found[0]


def test_torchrun_ranks_come_from_numbers_and_names_anywhere_in_the_notebook(tmp_path):
    path = notebook(
        tmp_path,
        "NPROC = 3\nfrom ddp_course.harness import launch",
        "job = launch.torchrun('../scripts/x.py', nproc=NPROC, results=True)",
        "launch.torchrun('../scripts/x.py')",  # torchrun's default here: 2
    )
    first, default = launch_scan.notebook_launches(path)
    assert (first.kind, first.nproc, first.cell, first.line) == ("torchrun", (3,), 1, 1)
    assert default.nproc == (2,)
    assert first.device_types(2) == {"cpu"} and first.device_types(4) == {"cuda"}
    assert first.where() == "05_x.ipynb c1 line 1"


def test_a_launch_whose_ranks_cannot_be_read_is_an_error(tmp_path):
    path = notebook(tmp_path, "launch.torchrun('x.py', nproc=ranks_from_somewhere())")
    with pytest.raises(ValueError, match=r"05_x.ipynb cell 0 line 1: cannot read nproc"):
        launch_scan.notebook_launches(path)


def test_gpus_and_a_forced_device_override_the_machine(tmp_path):
    path = notebook(
        tmp_path,
        "launch.torchrun('x.py', nproc=2, gpus=0)",
        "launch.torchrun('x.py', nproc=1, env={'DDP_COURSE_DEVICE': 'cpu'})",
        "launch.torchrun('x.py', nproc=1, env={runtime.DEVICE_ENV: 'cuda'})",
    )
    no_gpus, cpu, cuda = launch_scan.notebook_launches(path)
    assert no_gpus.gpus == 0 and no_gpus.device_types(4) == {"cpu"}
    assert cpu.device == "cpu" and cpu.device_types(4) == {"cpu"}
    assert cuda.device == "cuda" and cuda.device_types(1) == {"cuda"}


def test_a_notebooks_own_plan_for_a_sweep_decides_its_launches(tmp_path):
    path = notebook(
        tmp_path,
        "SIZES = [2, 3, 4]\nplan = sweep_device_plan(SIZES, runtime.gpu_count())",
        "launch.torchrun('x.py', nproc=2, env={runtime.DEVICE_ENV: plan.device_type})",
    )
    x = only(path)
    assert x.plan_ranks == 4
    assert x.device_types(2) == {"cpu"} and x.device_types(4) == {"cuda"}


def test_one_rank_per_gpu_is_sized_from_the_machine(tmp_path):
    path = notebook(
        tmp_path,
        "gpus = torch.cuda.device_count()\n"
        "if gpus >= 2:\n"
        "    launch.torchrun('x.py', nproc=gpus)\n"
        "else:\n"
        "    print('SKIPPED: needs 2 GPUs')\n",
        "if gpus == 0:\n    pass\nelse:\n"
        "    launch.torchrun('x.py', nproc=gpus + 1, env={'DDP_COURSE_DEVICE': 'cuda'})\n",
    )
    sized, broken = launch_scan.notebook_launches(path)
    assert sized.per_gpu == 0 and sized.guards == (notebook_values.Guard(">=", 2),)
    assert [sized.ranks(g) for g in (0, 1, 2, 4)] == [[], [], [2], [4]]
    assert sized.device_types(4) == {"cuda"} and not sized.fails_on_purpose(4)
    assert broken.per_gpu == 1 and broken.guards == (notebook_values.Guard("==", 0, False),)
    assert broken.ranks(0) == [] and broken.ranks(1) == [2] and broken.fails_on_purpose(1)


def test_a_rank_count_read_from_the_gpus_must_be_one_per_gpu(tmp_path):
    path = notebook(
        tmp_path, "gpus = torch.cuda.device_count()\nlaunch.torchrun('x', nproc=2 * gpus)"
    )
    with pytest.raises(ValueError, match="is not one rank per GPU"):
        launch_scan.notebook_launches(path)


def test_simulated_nodes_count_every_nodes_ranks_and_run_on_their_device(tmp_path):
    path = notebook(
        tmp_path,
        "N = 2\nnodes = [multinode.Node(N, i) for i in range(2)]",
        "multinode.torchrun_nodes('x.py', [], nodes, results=True)",
        "grow = [multinode.Node(1, 0), multinode.Node(nproc=2, node_rank=0)]\n"
        "multinode.torchrun_nodes('x.py', ['--epochs', '1'], grow)",
        "multinode.torchrun_nodes('x.py', [], [multinode.Node(1, 0)] * 2)",
        "multinode.torchrun_nodes('x.py', nodes=[multinode.Node()])",
        "multinode.torchrun_nodes('x.py')",  # two nodes of one rank by default
    )
    found = launch_scan.notebook_launches(path)
    assert [x.kind for x in found] == ["torchrun_nodes"] * 5
    assert [x.nproc for x in found] == [(4,), (3,), (2,), (1,), (2,)]
    for x in found:
        assert x.device == multinode.SIMULATED_NODES_DEVICE
        assert x.device_types(4) == {multinode.SIMULATED_NODES_DEVICE}


def test_one_process_runs_plan_like_the_job_they_stand_for(tmp_path):
    path = notebook(
        tmp_path,
        "launch.python('../scripts/01.py', results=True)",
        "NPROC = 2\nlaunch.python('x.py', reference_for=NPROC)",
        "platform.python_version()",  # not a launch
    )
    plain, reference = launch_scan.notebook_launches(path)
    assert (plain.kind, plain.nproc) == ("python", (1,))
    assert plain.device_types(1) == {"cuda"} and plain.device_types(0) == {"cpu"}
    assert reference.nproc == (2,) and reference.device_types(1) == {"cpu"}


def test_cuda_in_the_notebooks_own_kernel_counts_once_a_cell_and_only_with_a_gpu(tmp_path):
    path = notebook(
        tmp_path,
        "gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0",  # queries only
        "if torch.cuda.is_available():\n"
        "    m = model.cuda()\n"
        "    used = torch.cuda.memory_allocated()\n"
        "else:\n"
        "    print('skipped: needs a GPU')",
        "if not torch.cuda.is_available():\n    pass\nelse:\n    torch.cuda.synchronize()",
    )
    first, second = launch_scan.notebook_launches(path)
    assert (first.kind, first.cell, first.line) == ("torch.cuda", 1, 2)
    assert first.guards == (notebook_values.Guard(">", 0),)
    assert second.guards == (notebook_values.Guard(">", 0),)  # the else of `if not ...`
    assert not second.runs_with(0) and second.device_types(1) == {"cuda"}
    assert first.device_types(0) == set() and first.device_types(1) == {"cuda"}


def test_scripts_and_shell_lines_are_not_notebook_code(tmp_path):
    path = notebook(
        tmp_path,
        "%%writefile ../scripts/05_x.py\nimport torch\ntorch.cuda.synchronize()\n",
        "!torchrun --nproc_per_node=2 x.py\n%time launch.torchrun('x.py', nproc=1)",
    )
    assert launch_scan.notebook_launches(path) == []


def test_the_notebooks_with_a_cuda_path_and_an_nccl_path(tmp_path):
    notebook(tmp_path, "launch.torchrun('x.py', nproc=2)", name="01_two.ipynb")
    notebook(tmp_path, "launch.python('x.py')", name="02_plain.ipynb")
    notebook(tmp_path, "multinode.torchrun_nodes('x.py')", name="03_nodes.ipynb")
    launches = launch_scan.scan(tmp_path)
    assert launch_scan.cuda_notebooks(launches, 0) == []
    assert launch_scan.cuda_notebooks(launches, 1) == ["02_plain.ipynb"]
    assert launch_scan.cuda_notebooks(launches, 2) == ["01_two.ipynb", "02_plain.ipynb"]
    assert launch_scan.nccl_notebooks(launches, 1) == []
    assert launch_scan.nccl_notebooks(launches, 2) == ["01_two.ipynb"]


def test_a_name_bound_in_the_launching_cell_means_that_binding(tmp_path):
    path = notebook(
        tmp_path,
        "n = 64\nWORLD_SIZES = (2, 3)",
        "for n in WORLD_SIZES:\n    launch.torchrun('x.py', nproc=n)",
        "launch.torchrun('x.py', nproc=n)",  # no binding here: every one in the notebook
    )
    in_loop, elsewhere = launch_scan.notebook_launches(path)
    assert in_loop.nproc == (2, 3)
    assert elsewhere.nproc == (2, 3, 64)
