"""``python -m ddp_course``: the course's command line (:mod:`ddp_course.harness.cli`)."""

import sys

from .harness.cli import main

if __name__ == "__main__":
    sys.exit(main())
