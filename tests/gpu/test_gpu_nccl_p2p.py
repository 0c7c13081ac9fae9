"""Point-to-point exchanges on nccl with messages larger than NCCL's buffers.

An unbatched send may wait on nccl until its peer posts the matching receive, so
two ranks that each send first can wait for each other; small messages hide it
(NCCL buffers them). These runs send megabytes: lesson 08's pipeline executor
(1F1B on 2 GPUs, where both stages have a send at the head of their exchange) and
lesson 04's exercise 3 ring (groups of 2, 3 and 4 GPUs), both of which post every
send with its receive in one ``batch_isend_irecv``; ``tests/course/test_nccl_static.py``
checks the rule on CPU, this file checks the runs on GPUs.

Skipped, with the reason, without enough GPUs; each run takes a few seconds.
"""

import ast

import pytest
from gpu_support import keep, needs_2_gpus, needs_4_gpus, run
from notebook_cells import code_cell

from ddp_course.harness import launch

pytestmark = pytest.mark.serial

# 2048 samples x 2048 features x 4 bytes / 2 micro-batches: 8 MiB per message.
BIG_PIPELINE = [
    "--schedule",
    "1f1b",
    "gpipe",
    "--microbatches",
    "2",
    "--batch-size",
    "2048",
    "--hidden",
    "2048",
    "--layers",
    "2",
    "--stage-cost-s",
    "0",
    "--no-torch",
]


@needs_2_gpus
def test_pipeline_1f1b_with_large_messages_on_2_gpus(root):
    r = run(root, "08_pipeline.py", BIG_PIPELINE, nproc=2)
    keep("08_pipeline_large_messages", r)
    assert r["meta"]["backend"] == "nccl"
    assert {run_["schedule"] for run_ in r["runs"]} == {"1f1b", "gpipe"}
    for run_ in r["runs"]:  # the script asserted the gradients against one process
        assert run_["grad_diff"] <= 1e-4, run_


@needs_4_gpus
def test_exercise_3_naive_ring_on_4_gpus(tmp_path):
    cell = code_cell("04_allreduce.ipynb", "NAIVE_RING = ")
    tree = ast.parse(cell)
    text = next(
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["NAIVE_RING"]
    )
    # 4 MiB per message: above what NCCL buffers for an unmatched send.
    script = tmp_path / "04_naive_ring.py"
    script.write_text(text.replace("NUMEL = 12_000", "NUMEL = 2**20"))
    job = launch.torchrun(script, nproc=4, results=True, echo=False, timeout_s=120)
    r = job.results
    keep("04_naive_ring", r)
    assert r["meta"]["backend"] == "nccl"
    assert sorted(map(int, r["counted"])) == [2, 3, 4]
