"""What a short torchrun job costs before its work, started three ways: every process a
new interpreter (plain torchrun), ranks forked from the agent, and the agent forked from
the launcher's agent server too (the launcher's default on the CPU); and what a plain
one-process run costs, a new interpreter or forked from the same server.

    python benchmarks/launch_floor.py --results benchmarks/cpu-2core/launch_floor.json

Each job runs ``--repeats`` times in each mode, the modes alternating so that a change
of load hits all three. CPU seconds are those of every process of the job (agent and
ranks: ``getrusage(RUSAGE_CHILDREN)``, or what the server's waiter reports for a served
agent), the measure that decides how long a test suite takes on a machine whose cores
are all busy; wall seconds are what one job waits. The server starts once, before the
first measured job. Prints the medians and their ratios to the first mode, and writes
every run as JSON rows.
"""

import argparse
import os
import resource
import statistics
import time

from tqdm import tqdm

from ddp_course.harness import agent_server, launch
from ddp_course.harness.notebook import markdown_table
from ddp_course.tools.records import write_results

JOBS = {
    "hello, 2 ranks": ("scripts/00_hello_ranks.py", [], 2),
    "DDP from scratch (timeline), 2 ranks": (
        "scripts/07_ddp_from_scratch.py",
        ["--parts", "timeline"],
        2,
    ),
    "hello, 4 ranks": ("scripts/00_hello_ranks.py", [], 4),
    # No torchrun: launch.python, as a lesson's one-process reference runs. Ranks are not
    # forked here, so "forked ranks" starts a new interpreter, as the first mode does.
    "hello, plain python": ("scripts/00_hello_ranks.py", [], 0),
}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


MODES = {  # name: (fork the ranks, fork the agent from the server)
    "new interpreters": (False, False),
    "forked ranks": (True, False),
    "forked agent and ranks": (True, True),
}


def measure(script: str, args: list[str], nproc: int, mode: str) -> dict[str, float]:
    """One job: ``{"cpu_s", "wall_s"}`` of all its processes."""
    fork, served = MODES[mode]
    os.environ[agent_server.SERVER_ENV] = "1" if served else "0"
    cpu, start = _children_cpu_s(), time.perf_counter()
    if nproc == 0:
        os.environ[agent_server.SERVER_ENV] = "1" if fork and served else "0"
        job = launch.python(script, args, echo=False, gpus=0)
    else:
        job = launch.torchrun(script, args, nproc=nproc, echo=False, gpus=0, fork_ranks=fork)
    wall = time.perf_counter() - start
    return {"cpu_s": job.cpu_s if served else _children_cpu_s() - cpu, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per job and mode")
    parser.add_argument("--results", help="write every run here as JSON (and CSV)")
    args = parser.parse_args()
    os.environ.setdefault("DDP_COURSE_HEARTBEAT_S", "0")
    rows = []
    measure(*JOBS["hello, 2 ranks"], "forked agent and ranks")  # starts the server
    runs = [(name, r, mode) for name in JOBS for r in range(args.repeats) for mode in MODES]
    for name, repeat, mode in tqdm(runs, desc="jobs"):
        script, script_args, nproc = JOBS[name]
        rows.append(
            {
                "job": name,
                "repeat": repeat,
                "mode": mode,
                **measure(script, script_args, nproc, mode),
            }
        )
    summary = {}
    for name in JOBS:
        med = {
            (mode, key): statistics.median(
                r[key] for r in rows if r["job"] == name and r["mode"] == mode
            )
            for mode in MODES
            for key in ("cpu_s", "wall_s")
        }
        summary[name] = {
            f"{mode}: {key}": med[mode, key] for key in ("cpu_s", "wall_s") for mode in MODES
        }
    first = next(iter(MODES))
    header = ["job", *(f"{mode}: {key} (ratio)" for key in ("cpu_s", "wall_s") for mode in MODES)]
    table = [
        [
            name,
            *(
                f"{s[f'{m}: {k}']:.2f} ({s[f'{m}: {k}'] / s[f'{first}: {k}']:.2f})"
                for k in ("cpu_s", "wall_s")
                for m in MODES
            ),
        ]
        for name, s in summary.items()
    ]
    print(markdown_table(header, table))
    write_results(None, args.results, {"medians": summary}, rows=rows, args=vars(args))


if __name__ == "__main__":
    main()
