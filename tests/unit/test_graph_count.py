"""The graph counter of lesson 16 (ddp_course.tools.graph_count) on one process."""

import logging

import torch

from ddp_course.models import MLP
from ddp_course.tools.graph_count import GraphCounter, recompile_reasons


def test_counts_graphs_runs_and_the_recompile_that_made_the_second():
    torch._dynamo.reset()
    model = MLP(16, 16, 1, 16).double()
    counter = GraphCounter("aot_eager")
    compiled = torch.compile(model, backend=counter)
    dynamo_log = logging.getLogger("torch._dynamo")
    before = dynamo_log.level
    dynamo_log.setLevel(logging.ERROR)
    with recompile_reasons() as reasons:
        for rows in (4, 4, 3, 3, 2):  # the third shape reuses the dynamic second graph
            compiled(torch.randn(rows, 16, dtype=torch.float64)).sum().backward()
    assert len(counter.graphs) == 2 and counter.runs == [2, 3]
    assert counter.parameter_bytes() == [2 * (16 * 16 + 16) * 8] * 2
    assert [kind for kind, _ in counter.aot] == ["forward", "backward"] * 2
    assert len(reasons) == 1 and "size mismatch at index 0. expected 4, actual 3" in reasons[0]
    assert " in models.py:" in reasons[0]  # the file, without its folders
    assert dynamo_log.level == logging.ERROR  # the caller's level survives set_logs()
    dynamo_log.setLevel(before)


def test_another_backend_keeps_no_aot_graphs():
    counter = GraphCounter("eager")
    torch._dynamo.reset()
    torch.compile(lambda x: x.sin() + 1, backend=counter)(torch.ones(3))
    assert len(counter.graphs) == 1 and counter.aot == [] and counter.collectives() == [[]]
    assert counter.aot_collectives() == {"forward": {}, "backward": {}}
