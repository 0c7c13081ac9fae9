"""Lesson 17's 17_replicas.py: two torchft replica groups (one process each) train TinyGPT;
group 1 kills itself with SIGKILL mid-step and torchrun starts it again. The survivor loses
only the step in flight and trains on alone, the newcomer heals from the survivor (it
starts from other weights and reads no file), and both end with the same model, optimizer
and schedule to the last bit. Broken on purpose: a schedule left out of the healing state
(the replicas part for good), and a survivor that stops on its peer's death (everything
trained is lost). Every listener is on loopback (the listeners plugin fails the test
otherwise) and no process is left."""

import importlib.util
import json
import pathlib

import pytest

from ddp_course import torchft_loopback
from ddp_course.harness import replica_groups
from ddp_course.harness.jobs import processes_running

if importlib.util.find_spec("torchft") is None:  # not imported here: see torchft_loopback
    pytest.skip(
        "torchft is in the pinned extra, for Python < 3.13 (no wheel for 3.13+)",
        allow_module_level=True,
    )

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts/17_replicas.py"
STEPS, DIE_AT = 800, 20  # the survivor must still train when the newcomer is back
ARGS = [
    "--steps",
    str(STEPS),
    "--warmup",
    "5",
    "--d-model",
    "16",
    "--n-heads",
    "2",
    "--n-layers",
    "1",
    "--seq-len",
    "16",
    "--batch-size",
    "4",
    "--rejoin-after",
    "1",
]


def run(tmp, lab="none"):
    with torchft_loopback.lighthouse(min_replicas=1, heartbeat_timeout_ms=500) as addr:
        results = replica_groups.torchrun_replica_groups(
            SCRIPT,
            [*ARGS, "--lab", lab, "--lighthouse", addr],
            [
                [
                    "--replica-id",
                    str(i),
                    "--timeline",
                    str(tmp / f"{lab}_{i}.jsonl"),
                    *(["--die-at-step", str(DIE_AT)] if i == 1 else []),
                ]
                for i in range(2)
            ],
            timeout_s=120,
        )
    lines = [[json.loads(x) for x in open(tmp / f"{lab}_{i}.jsonl")] for i in range(2)]
    return [r.results for r in results], lines


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("replicas")


@pytest.fixture(scope="module")
def clean(tmp):
    return run(tmp)


def steps(lines, attempt=None):
    return [
        x for x in lines if x["event"] == "step" and (attempt is None or x["attempt"] == attempt)
    ]


def test_the_survivor_loses_only_the_step_in_flight_and_trains_on_alone(clean):
    results, (survivor, _) = clean
    assert results[0]["attempt"] == 0 and results[0]["steps"] == STEPS
    lost = [x["step"] for x in steps(survivor) if not x["committed"]]
    assert lost == [DIE_AT]
    alone = [x for x in steps(survivor) if x["committed"] and x["participants"] == 1]
    assert alone and alone[0]["step"] == DIE_AT  # the same step, redone without the peer
    assert steps(survivor)[-1]["participants"] == 2  # the newcomer was back before the end


def test_the_newcomer_heals_from_the_survivor_and_both_end_bit_identical(clean, tmp):
    results, (survivor, killed) = clean
    assert any(x["event"] == "sigkill" and x["step"] == DIE_AT for x in killed)
    first = steps(killed, attempt=1)[0]
    assert first["healed"] and first["step"] > DIE_AT  # joined at the survivor's step
    by_step = {x["step"]: x["digest"] for x in steps(survivor) if x["committed"]}
    for x in steps(killed, attempt=1):
        assert x["digest"] == by_step[x["step"]], x  # equal after every step together
    assert results[0]["digest"] == results[1]["digest"]  # model, optimizer, schedule
    assert results[1]["attempt"] == 1
    # No checkpoint file anywhere: only the timelines are written.
    assert sorted(p.name for p in tmp.iterdir() if p.suffix != ".jsonl") == []


def test_a_schedule_left_out_of_the_healing_state_parts_the_replicas(tmp):
    results, (survivor, killed) = run(tmp, "stale-schedule")
    first = steps(killed, attempt=1)[0]
    assert first["healed"]
    lr = {x["step"]: x["lr"] for x in steps(survivor) if x["committed"]}
    assert first["lr"] != lr[first["step"]]  # its schedule restarted at step 0
    assert results[0]["parameters_digest"] != results[1]["parameters_digest"]


def test_a_survivor_that_stops_on_its_peers_death_loses_everything(tmp):
    results, lines = run(tmp, "stops-on-error")
    assert [r["attempt"] for r in results] == [1, 1]  # torchrun restarted the survivor too
    # Whichever came back first found no live group to heal from: step 0 again.
    first = min((x for group in lines for x in steps(group, attempt=1)), key=lambda x: x["t"])
    assert first["step"] == 0 and first["committed"]


def test_no_process_is_left(clean):
    assert processes_running(str(SCRIPT)) == []  # its absolute path: the jobs' command lines
