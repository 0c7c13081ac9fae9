"""What a short torchrun job costs before its work, with ranks forked from the agent
(the launcher's default on the CPU) and with each rank started as a new interpreter.

    python benchmarks/launch_floor.py --results benchmarks/cpu-2core/launch_floor.json

Each job runs ``--repeats`` times in each mode, the two modes alternating so that a
change of load hits both. CPU seconds are those of every process of the job (agent and
ranks, from ``getrusage(RUSAGE_CHILDREN)``), the measure that decides how long a test
suite takes on a machine whose cores are all busy; wall seconds are what one job waits.
Prints the medians and their ratios, and writes every run as JSON rows.
"""

import argparse
import os
import resource
import statistics
import time

from tqdm import tqdm

from ddp_course.harness import launch
from ddp_course.harness.notebook import markdown_table
from ddp_course.tools.records import write_results

JOBS = {
    "hello, 2 ranks": ("scripts/00_hello_ranks.py", [], 2),
    "DDP from scratch (timeline), 2 ranks": (
        "scripts/07_ddp_from_scratch.py", ["--parts", "timeline"], 2),
    "hello, 4 ranks": ("scripts/00_hello_ranks.py", [], 4),
}  # fmt: skip


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(script: str, args: list[str], nproc: int, fork: bool) -> dict[str, float]:
    """One job: ``{"cpu_s", "wall_s"}`` of all its processes."""
    cpu, start = _children_cpu_s(), time.perf_counter()
    launch.torchrun(script, args, nproc=nproc, echo=False, gpus=0, fork_ranks=fork)
    return {"cpu_s": _children_cpu_s() - cpu, "wall_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per job and mode")
    parser.add_argument("--results", help="write every run here as JSON (and CSV)")
    args = parser.parse_args()
    os.environ.setdefault("DDP_COURSE_HEARTBEAT_S", "0")
    rows = []
    runs = [(name, r, fork) for name in JOBS for r in range(args.repeats) for fork in (True, False)]
    for name, repeat, fork in tqdm(runs, desc="jobs"):
        script, script_args, nproc = JOBS[name]
        row = measure(script, script_args, nproc, fork)
        rows.append({"job": name, "repeat": repeat, "forked": fork, **row})
    summary = {}
    for name in JOBS:
        med = {
            (fork, key): statistics.median(
                r[key] for r in rows if r["job"] == name and r["forked"] == fork
            )
            for fork in (True, False)
            for key in ("cpu_s", "wall_s")
        }
        summary[name] = {
            "new_interpreter_cpu_s": med[False, "cpu_s"],
            "forked_cpu_s": med[True, "cpu_s"],
            "cpu_ratio": med[True, "cpu_s"] / med[False, "cpu_s"],
            "new_interpreter_wall_s": med[False, "wall_s"],
            "forked_wall_s": med[True, "wall_s"],
            "wall_ratio": med[True, "wall_s"] / med[False, "wall_s"],
        }
    header = ["job", *next(iter(summary.values()))]
    print(markdown_table(header, [[name, *(f"{v:.2f}" for v in s.values())]
                                  for name, s in summary.items()]))  # fmt: skip
    write_results(None, args.results, {"medians": summary}, rows=rows, args=vars(args))


if __name__ == "__main__":
    main()
