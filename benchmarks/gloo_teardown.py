"""How often a gloo rank deadlocks at exit, with and without the GIL release that
``ddp_course.runtime.distributed`` makes before it destroys the process group.

    python benchmarks/gloo_teardown.py --results benchmarks/cpu-2core/gloo_teardown.json

Runs lesson 12's monitor job (2 ranks, forked from torchrun's agent) ``--runs`` times in
each mode, alternating: with the release (the course's default) and with
``DDP_COURSE_GLOO_RELEASE_S=0``. A job that has not finished after ``--timeout-s`` is a
hang (the job is killed). What deadlocks: rank 1 leaves ``main()`` right after its last
``gather_object``; DDP's reducer, freed then, holds the last reference to the gloo
group, whose destructor joins the worker threads while holding the GIL, and a worker
that is still freeing the gather's tensors waits for that GIL (py-spy ``--native``).
Prints hangs per mode and writes every run as JSON rows.
"""

import argparse
import os

from tqdm import tqdm

from ddp_course.harness import launch
from ddp_course.harness.notebook import markdown_table
from ddp_course.runtime import GLOO_RELEASE_ENV, GLOO_RELEASE_S
from ddp_course.tools.records import write_results

MODES = {"GIL released before teardown": None, "no release": "0"}


def one_run(release: str | None, timeout_s: float) -> dict[str, object]:
    """One monitor job: ``{"hung": bool, "wall_s": float | None}``."""
    env = {} if release is None else {GLOO_RELEASE_ENV: release}
    try:
        job = launch.torchrun(
            "scripts/12_monitor.py",
            ["--steps", "4"],
            nproc=2,
            echo=False,
            gpus=0,
            fork_ranks=True,
            timeout_s=timeout_s,
            env=env,
        )
    except launch.LaunchTimeout:
        return {"hung": True, "wall_s": None}
    return {"hung": False, "wall_s": job.wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40, help="jobs per mode")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="a job past it hung")
    parser.add_argument("--results", help="write every run here as JSON (and CSV)")
    args = parser.parse_args()
    os.environ.setdefault("DDP_COURSE_HEARTBEAT_S", "0")
    rows = []
    for run in tqdm(range(args.runs), desc="runs per mode"):
        for mode, release in MODES.items():
            rows.append({"mode": mode, "run": run, **one_run(release, args.timeout_s)})
    summary = {
        mode: {
            "runs": sum(r["mode"] == mode for r in rows),
            "hangs": sum(r["mode"] == mode and r["hung"] for r in rows),
        }
        for mode in MODES
    }
    print(
        markdown_table(
            ["mode", "runs", "hangs"], [[m, s["runs"], s["hangs"]] for m, s in summary.items()]
        )
    )
    write_results(
        None,
        args.results,
        {"release_s": GLOO_RELEASE_S, "summary": summary},
        rows=rows,
        args=vars(args),
    )


if __name__ == "__main__":
    main()
