"""Pipeline schedules against hand-written tables; deadlocks; bubble and memory against the papers;
one pipelined step over gloo against one process.

The gold tables below are written out by hand, not generated: GPipe (Huang et
al. 2019) as drawn in Narayanan et al. 2021, figure 3, all forwards then the
backwards in forward order (as torch's ScheduleGPipe); 1F1B as in their
figure 4 (top): p-1-k warm-up forwards on stage k.
"""

import dataclasses
import json

import pytest
import torch
from torch.nn.functional import cross_entropy

from ddp_course import pipeline
from ddp_course.harness import launch
from ddp_course.models import LayerStack
from ddp_course.pipeline import Action, DeadlockError


def table(*rows: str) -> list[list[Action]]:
    """'F0 F1 B0' -> [Action('F', 0), ...], one string per rank (the test's own parser)."""
    return [[Action(tok[0], int(tok[1:])) for tok in row.split()] for row in rows]


GOLD = {
    ("naive", 2, 3): table("F0 B0 F1 B1 F2 B2", "F0 B0 F1 B1 F2 B2"),
    ("gpipe", 2, 3): table("F0 F1 F2 B0 B1 B2", "F0 F1 F2 B0 B1 B2"),
    ("1f1b", 2, 3): table("F0 F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"),
    ("naive", 3, 4): table(
        "F0 B0 F1 B1 F2 B2 F3 B3", "F0 B0 F1 B1 F2 B2 F3 B3", "F0 B0 F1 B1 F2 B2 F3 B3"
    ),
    ("gpipe", 3, 4): table(
        "F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3"
    ),
    ("1f1b", 3, 4): table(
        "F0 F1 F2 B0 F3 B1 B2 B3", "F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"
    ),
    ("naive", 2, 1): table("F0 B0", "F0 B0"),
    ("gpipe", 1, 2): table("F0 F1 B0 B1"),
    ("1f1b", 4, 4): table(
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ),
}


@pytest.mark.parametrize("name,p,m", list(GOLD))
def test_schedules_equal_the_hand_written_tables(name, p, m):
    got = pipeline.schedule(name, p, m)
    assert got == GOLD[(name, p, m)], "\n" + pipeline.format_schedule(got)
    pipeline.check_schedule(got, m)


def test_action_notation_and_formatting():
    assert str(Action("B", 12)) == "B12"
    assert pipeline.format_schedule(table("F0 B0", "F0 B0")) == "rank 0: F0 B0\nrank 1: F0 B0"
    with pytest.raises(ValueError, match="'F' or 'B'"):
        Action("W", 0)
    with pytest.raises(ValueError, match=">= 0"):
        Action("F", -1)


@pytest.mark.parametrize("name", pipeline.SCHEDULES)
def test_bad_sizes_are_refused(name):
    with pytest.raises(ValueError, match="at least 1 stage"):
        pipeline.schedule(name, 0, 4)
    with pytest.raises(ValueError, match="at least 1 micro-batch"):
        pipeline.schedule(name, 2, 0)


def test_1f1b_needs_as_many_microbatches_as_stages():
    with pytest.raises(ValueError, match="microbatches=2 < stages=3"):
        pipeline.one_f_one_b_schedule(3, 2)
    with pytest.raises(ValueError, match="unknown schedule 'interleaved'"):
        pipeline.schedule("interleaved", 2, 2)


def test_check_schedule_names_what_is_wrong():
    with pytest.raises(ValueError, match=r"rank 1 .* missing: \['B1'\]"):
        pipeline.check_schedule(table("F0 F1 B0 B1", "F0 F1 B0"), 2)
    with pytest.raises(ValueError, match="rank 0 runs F1 more than once"):
        pipeline.check_schedule(table("F0 F1 F1 B0 B1", "F0 F1 B0 B1"), 2)
    with pytest.raises(ValueError, match="rank 0 runs B1 before F1"):
        pipeline.check_schedule(table("F0 B1 F1 B0", "F0 F1 B0 B1"), 2)
    # Forwards swapped on one rank: it would receive micro-batch 1's activations as 0's.
    with pytest.raises(ValueError, match=r"rank 0 sends .* \[0, 1\] but rank 1 .* \[1, 0\]"):
        pipeline.check_schedule(table("F0 F1 B0 B1", "F1 F0 B0 B1"), 2)


def test_simulated_timeline_by_hand():
    # GPipe, p=2, m=2, t_f=1, t_b=2, worked out on paper.
    tl = pipeline.simulate(pipeline.gpipe_schedule(2, 2), forward_cost=1, backward_cost=2)
    got = [(e.rank, str(e.action), e.start, e.end) for e in tl.events]
    assert sorted(got) == sorted(
        [
            (0, "F0", 0, 1),
            (0, "F1", 1, 2),
            (0, "B0", 5, 7),
            (0, "B1", 7, 9),
            (1, "F0", 1, 2),
            (1, "F1", 2, 3),
            (1, "B0", 3, 5),
            (1, "B1", 5, 7),
        ]
    )
    assert tl.makespan == 9
    assert tl.bubbles() == [pytest.approx(1 - 6 / 9)] * 2
    # A message delay shifts every receive: rank 1's F0 starts at 1 + 0.5.
    delayed = pipeline.simulate(pipeline.gpipe_schedule(2, 2), 1, 2, comm_cost=0.5)
    assert delayed.of_rank(1)[0].start == 1.5
    assert tl.render() == ("rank 0: F0 F1 .  .  .  B0 B0 B1 B1\nrank 1: .  F0 F1 B0 B0 B1 B1 .  .")
    # Middles of the slots: 1.5, 4.5, 7.5.
    assert tl.render(unit=3) == "rank 0: F1 .  B1\nrank 1: F0 B0 ."
    with pytest.raises(ValueError, match="unit must be > 0"):
        tl.render(unit=0)
    again = pipeline.Timeline.from_records(json.loads(json.dumps(delayed.to_records())))
    assert again == delayed
    shifted = pipeline.Timeline(
        tuple(dataclasses.replace(e, start=e.start + 7, end=e.end + 7) for e in tl.events)
    ).relative()
    assert shifted == tl  # tl already starts at 0


def test_a_swap_on_one_rank_deadlocks_and_says_where():
    broken = pipeline.gpipe_schedule(2, 2)
    broken[0][1], broken[0][2] = broken[0][2], broken[0][1]  # rank 0: F0 B0 F1 B1
    pipeline.check_schedule(broken, 2)  # complete and in order: only the simulation sees it
    with pytest.raises(DeadlockError) as err:
        pipeline.simulate(broken)
    assert err.value.blocked == {
        0: (1, Action("B", 0), (1, Action("B", 0))),
        1: (1, Action("F", 1), (0, Action("F", 1))),
    }
    assert "rank 0 waits at B0" in str(err.value) and "rank 1 waits at F1" in str(err.value)


def test_deadlock_in_a_three_stage_1f1b():
    broken = pipeline.one_f_one_b_schedule(3, 4)
    broken[0].remove(Action("B", 0))
    broken[0].insert(1, Action("B", 0))  # rank 0 wants B0 before sending F1
    with pytest.raises(DeadlockError, match="rank 0 waits at B0"):
        pipeline.simulate(broken)


def test_simulate_refuses_bad_input():
    with pytest.raises(ValueError, match="one cost per stage"):
        pipeline.simulate(pipeline.gpipe_schedule(3, 3), forward_cost=[1, 1])
    with pytest.raises(ValueError, match="never runs"):
        pipeline.simulate(table("F0 B0", "F1 B1"))
    with pytest.raises(ValueError, match="before F0"):
        pipeline.simulate(table("B0 F0"))


COSTS = [(1.0, 2.0), (0.3, 0.7), (1.0, 1.0)]


def bubble_formula(p, m):
    # Huang et al. 2019, section 2.3; written here, not imported from the package.
    return (p - 1) / (m + p - 1)


@pytest.mark.parametrize("t_f,t_b", COSTS)
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_simulated_bubble_equals_the_gpipe_formula(p, m, t_f, t_b):
    names = ["gpipe", "1f1b"] if m >= p else ["gpipe"]
    for name in names:
        tl = pipeline.simulate(pipeline.schedule(name, p, m), t_f, t_b)
        assert tl.bubbles() == [pytest.approx(bubble_formula(p, m), abs=1e-12)] * p, name
    assert pipeline.gpipe_bubble(p, m) == pytest.approx(bubble_formula(p, m))
    # The naive split is GPipe with one micro-batch, however many it processes.
    naive = pipeline.simulate(pipeline.naive_schedule(p, m), t_f, t_b)
    assert naive.bubbles() == [pytest.approx(bubble_formula(p, 1), abs=1e-12)] * p


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 4), (4, 8)])
def test_peak_activations_m_for_gpipe_at_most_p_minus_k_for_1f1b(p, m):
    gpipe = pipeline.simulate(pipeline.gpipe_schedule(p, m))
    assert [gpipe.peak_in_flight(k) for k in range(p)] == [m] * p
    one_f_one_b = pipeline.simulate(pipeline.one_f_one_b_schedule(p, m))
    assert [one_f_one_b.peak_in_flight(k) for k in range(p)] == [p - k for k in range(p)]
    naive = pipeline.simulate(pipeline.naive_schedule(p, m))
    assert [naive.peak_in_flight(k) for k in range(p)] == [1] * p
    assert pipeline.in_flight(table("F0 F1 B0 F2 B1 B2")[0]) == [1, 2, 1, 2, 1, 0]


def test_broken_schedules_fail_the_bubble_and_memory_checks():
    p, m = 3, 6
    formula = bubble_formula(p, m)
    # 1F1B with one more warm-up forward on rank 1: still correct, but holds p - k + 1.
    longer = pipeline.one_f_one_b_schedule(p, m)
    longer[1].remove(Action("F", 2))
    longer[1].insert(2, Action("F", 2))  # F0 F1 F2 B0 B1 ...
    pipeline.check_schedule(longer, m)
    assert pipeline.simulate(longer).peak_in_flight(1) == p - 1 + 1
    # 1F1B with no warm-up on rank 0 (naive there): every rank waits, the bubble grows.
    shorter = pipeline.one_f_one_b_schedule(p, m)
    shorter[0] = pipeline.naive_schedule(p, m)[0]
    shorter[1] = pipeline.naive_schedule(p, m)[1]
    tl = pipeline.simulate(shorter)
    assert min(tl.bubbles()) > formula + 0.1
    # GPipe with the backwards reversed on one rank only: the stages wait for each other.
    reversed_b = pipeline.gpipe_schedule(p, m)
    reversed_b[2] = reversed_b[2][:m] + reversed_b[2][m:][::-1]
    assert min(pipeline.simulate(reversed_b).bubbles()) > formula + 0.1


def _stack():
    torch.manual_seed(0)
    return LayerStack(in_features=6, width=8, num_layers=2, num_classes=3)


def test_one_stage_accumulates_micro_batches_into_the_whole_batch_gradient():
    x, y = torch.randn(7, 6), torch.randint(0, 3, (7,))  # 7 = 3 + 2 + 2: uneven shares
    reference = _stack()
    loss = cross_entropy(reference(x), y)
    loss.backward()
    for name in ("naive", "gpipe"):
        model = _stack()
        table = pipeline.schedule(name, 1, 3)
        result = pipeline.run_schedule(
            table,
            model,
            0,
            pipeline.split_microbatches(x, 3),
            pipeline.split_microbatches(y, 3),
            cross_entropy,
        )
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        assert result.loss == pytest.approx(loss.item())
        assert result.peak_in_flight == (3 if name == "gpipe" else 1)
        assert [str(e.action) for e in result.events] == [str(a) for a in table[0]]


class _Posted:
    """Stands in for ``torch.distributed``'s point-to-point calls in one process.

    Records every ``batch_isend_irecv`` call as a list of ``(op, peer, shape)`` and
    fills each receive buffer with ones (a gradient of ones, or shapes for the
    header); any other point-to-point call fails the test.
    """

    def __init__(self, headers: torch.Tensor | None = None):
        self.calls, self.headers = [], headers

    def P2POp(self, op, tensor, peer, group=None):  # noqa: N802 (torch's name)
        return (op, tensor, peer)

    @staticmethod
    def isend(*args, **kwargs):
        raise AssertionError("a send outside batch_isend_irecv")

    @staticmethod
    def irecv(*args, **kwargs):
        raise AssertionError("a receive outside batch_isend_irecv")

    send, recv = isend, irecv

    def batch_isend_irecv(self, ops):
        self.calls.append([(op.__name__, peer, tuple(t.shape)) for op, t, peer in ops])
        for op, t, _ in ops:
            if op.__name__ == "irecv":
                t.copy_(self.headers if t.dtype == torch.int64 else torch.ones_like(t))
        return [_Done() for _ in ops]


class _Done:
    def wait(self):
        pass


@pytest.mark.parametrize("rank", [0, 1])
def test_each_send_goes_with_the_next_receive_from_the_same_rank(monkeypatch, rank):
    """1F1B on 2 stages: a send and the following receive from that rank in one call.

    Rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1. On nccl a send may wait until the
    peer posts its receive, so F1's output (rank 0) and B0's gradient (rank 1), both
    sent first, must each travel in one ``batch_isend_irecv`` with the receive that
    follows: one call runs both directions.
    """
    from torch import distributed as dist

    m, n = 2, 3
    headers = torch.tensor([[2, n, 8, 0, 0, 0, 0, 0]] * m)  # rank 0's outputs: [3, 8]
    fake = _Posted(headers)
    for name in ("P2POp", "isend", "irecv", "send", "recv", "batch_isend_irecv"):
        monkeypatch.setattr(dist, name, getattr(fake, name))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    stage = pipeline.split_model(_stack(), 2, rank)
    x, y = torch.randn(m * n, 6), torch.randint(0, 3, (m * n,))
    pipeline.run_schedule(
        pipeline.schedule("1f1b", 2, m),
        stage,
        rank,
        pipeline.split_microbatches(x, m),
        pipeline.split_microbatches(y, m),
        cross_entropy,
    )
    act = (n, 8)
    expected = {
        0: [  # shapes down the chain; F0 sends alone (F1 receives nothing); F1 + B0; B1
            [("isend", 1, (m, 8))],
            [("isend", 1, act)],
            [("isend", 1, act), ("irecv", 1, act)],
            [("irecv", 1, act)],
        ],
        1: [  # shapes; F0 receives; B0's gradient + F1's input; B1's gradient alone
            [("irecv", 0, (m, 8))],
            [("irecv", 0, act)],
            [("isend", 0, act), ("irecv", 0, act)],
            [("isend", 0, act)],
        ],
    }[rank]
    assert fake.calls == expected


def test_run_schedule_refuses_bad_input():
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    xs, ys = pipeline.split_microbatches(x, 2), pipeline.split_microbatches(y, 2)
    with pytest.raises(ValueError, match="2 stages but the world size is 1"):
        pipeline.run_schedule(pipeline.gpipe_schedule(2, 2), _stack(), 0, xs, ys, cross_entropy)
    with pytest.raises(ValueError, match="rank 1 has no stage in a 1-stage"):
        pipeline.run_schedule(pipeline.gpipe_schedule(1, 2), _stack(), 1, xs, ys, cross_entropy)
    with pytest.raises(ValueError, match="at least one rank"):
        pipeline.run_schedule([], _stack(), 0, xs, ys, cross_entropy)
    with pytest.raises(ValueError, match="rank 0 needs inputs"):
        pipeline.run_schedule(pipeline.gpipe_schedule(1, 2), _stack(), 0, None, ys, cross_entropy)
    with pytest.raises(ValueError, match="needs loss_fn"):
        pipeline.run_schedule(pipeline.gpipe_schedule(1, 2), _stack(), 0, xs, ys[:1], cross_entropy)
    with pytest.raises(ValueError, match="B0 before F0"):
        pipeline.run_schedule(table("B0 F0 F1 B1"), _stack(), 0, xs, ys, cross_entropy)
    # A schedule that would hang is refused before any message is sent.
    with pytest.raises(DeadlockError, match="rank 0 waits at B0"):
        pipeline.run_schedule(table("F0 B0 F1 B1", "F0 F1 B0 B1"), _stack(), 0, xs, ys, None)
    with pytest.raises(ValueError, match="into 5 micro-batches"):
        pipeline.split_microbatches(x, 5)
    with pytest.raises(ValueError, match="into 0 micro-batches"):
        pipeline.split_microbatches(x, 0)


@pytest.mark.serial  # it measures the bubble: a neighbour on the cores would skew it
def test_pipelined_step_over_gloo_equals_one_process(workers):
    p, m = 3, 4
    job = launch.torchrun(
        workers / "pipeline_step.py",
        ["--microbatches", str(m)],
        nproc=p,
        results=True,
        echo=False,
        timeout_s=120,
    )
    r = job.results
    for name, ranks in r["equal"].items():
        # The worker asserted gradients and SGD parameters equal to the one-process step.
        assert all(rank["grad_diff"] < 1e-5 for rank in ranks), name
        assert ranks[-1]["loss_gap"] < 1e-5, name
        gold = pipeline.schedule(name, p, m)
        assert [rank["order"] for rank in ranks] == [[str(a) for a in row] for row in gold]
    # Activations held at once, counted by the executor.
    assert [rank["peak"] for rank in r["equal"]["gpipe"]] == [m] * p
    assert [rank["peak"] for rank in r["equal"]["1f1b"]] == [p - k for k in range(p)]
    assert [rank["peak"] for rank in r["equal"]["naive"]] == [1] * p
    # Bytes: the 10 samples' 16-float activations forward, the same size of gradient back.
    boundary = 10 * 16 * 4  # batch x width x float32, per stage boundary and direction
    for name, ranks in r["equal"].items():
        assert [rank["bytes"] for rank in ranks] == [boundary, 2 * boundary, boundary], name
    for name, rows in r["timelines"].items():
        tl = pipeline.Timeline.from_records(rows)
        ends = {(e.rank, e.action): e.end for e in tl.events}
        for e in tl.events:  # the clock agrees with the messages: nothing starts early
            peer = e.rank - 1 if e.action.kind == "F" else e.rank + 1
            if 0 <= peer < p:
                assert e.start >= ends[(peer, e.action)], (name, e)
        # Sleeping stages (backward 2x forward): the measured bubble is GPipe's formula.
        formula = bubble_formula(p, m)
        assert tl.bubbles() == [pytest.approx(formula, rel=0.1)] * p, (name, tl.bubbles())


def test_our_executor_equals_torch_distributed_pipelining(workers):
    job = launch.torchrun(
        workers / "pipeline_torch.py", nproc=3, results=True, echo=False, timeout_s=120
    )
    schedules = job.results["schedules"]
    assert set(schedules) == {"gpipe", "1f1b"}
    for name, ranks in schedules.items():
        # The worker asserted equal gradients on every stage (assert_close).
        assert all(rank["grad_diff"] < 1e-5 for rank in ranks), name
        assert ranks[-1]["loss_gap"] < 1e-5, name


def test_split_model_into_stages_and_refuse_more_stages_than_layers():
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(5)])
    sizes = [len(pipeline.split_model(model, 3, k)) for k in range(3)]
    assert sizes == [2, 1, 2]  # round(5k/3): 0, 2, 3, 5
    stages = [pipeline.split_model(model, 3, k) for k in range(3)]
    assert [m for s in stages for m in s] == list(model)  # every layer once, in order
    assert pipeline.split_model(model, 1, 0)[4] is model[4]  # shared, not copied
    with pytest.raises(ValueError, match="5 layers into 6 stages.*at most 5 ranks"):
        pipeline.split_model(model, 6, 0)
    with pytest.raises(ValueError, match=r"index must be in \[0, 3\)"):
        pipeline.split_model(model, 3, 3)
    with pytest.raises(ValueError, match="at least 1 stage"):
        pipeline.split_model(model, 0, 0)
