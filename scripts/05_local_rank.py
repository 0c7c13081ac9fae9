"""Lesson 05: what a script receives from torchrun and from torch.distributed.launch.

    torchrun --nproc_per_node=2 scripts/05_local_rank.py
    python -m torch.distributed.launch --nproc_per_node=2 --use-env scripts/05_local_rank.py
    python -m torch.distributed.launch --nproc_per_node=2 scripts/05_local_rank.py  # fails
    python scripts/05_local_rank.py

Written for torchrun, like every script of the course: it has no --local-rank
option and reads LOCAL_RANK from the environment. Rank 0 prints the names of
the variables the launcher set and writes them to --results. It starts no
process group: what it looks at is the launcher. With --sleep-s S every rank
then waits S seconds before it exits: a job that outlives a launcher's timeout.
"""

import os
import time

from ddp_course.harness.script_args import script_parser

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


def main() -> None:
    parser = script_parser(__doc__, results=None)
    parser.add_argument("--sleep-s", type=float, default=0.0, help="seconds to wait at the end")
    args = parser.parse_args()  # an unknown argument such as --local-rank=0 exits here
    names = sorted(
        k for k in os.environ if k in LAUNCHER_VARIABLES or k.startswith("TORCHELASTIC_")
    )
    if os.environ.get("RANK", "0") == "0":
        # Imported here: it loads torch, which only the rank that writes needs, so that
        # the other ranks (and a rank that argparse stops) start and exit at once.
        from ddp_course.tools.records import write_results

        local_rank = os.environ.get("LOCAL_RANK")
        print(f"rank 0: LOCAL_RANK={local_rank}; launcher variables {names}")
        write_results(None, args.results, {"variables": names, "local_rank": local_rank})
    time.sleep(args.sleep_s)


if __name__ == "__main__":
    main()
