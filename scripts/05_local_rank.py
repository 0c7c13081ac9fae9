"""Lesson 05: what a script receives from torchrun and from torch.distributed.launch.

    torchrun --nproc_per_node=2 scripts/05_local_rank.py
    python -m torch.distributed.launch --nproc_per_node=2 --use-env scripts/05_local_rank.py
    python -m torch.distributed.launch --nproc_per_node=2 scripts/05_local_rank.py  # fails
    python scripts/05_local_rank.py

Written for torchrun, like every script of the course: it has no --local-rank
option and reads LOCAL_RANK from the environment. Rank 0 prints the names of
the variables the launcher set and writes them to --results. It starts no
process group: what it looks at is the launcher.
"""

import argparse
import json
import os

LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--results", help="rank 0 writes a JSON summary here")
args = parser.parse_args()  # an unknown argument such as --local-rank=0 exits here

names = sorted(k for k in os.environ if k in LAUNCHER_VARIABLES or k.startswith("TORCHELASTIC_"))
if os.environ.get("RANK", "0") == "0":
    print(f"rank 0: LOCAL_RANK={os.environ.get('LOCAL_RANK')}; launcher variables {names}")
    if args.results:
        with open(args.results, "w") as f:
            json.dump({"variables": names, "local_rank": os.environ.get("LOCAL_RANK")}, f)
