"""The pinned environment with another torch: the requirements of pyproject.toml's
``pinned`` extra, less torch and torchvision, for ``make test TORCH=X.Y.Z`` (pip then
takes the newest torchvision of the supported range that admits that torch).

``python ddp_course/harness/pins.py`` prints them, one per line (a pip requirements
file). It runs as a plain script with the standard library only, before any environment
exists, so it imports nothing of the package.
"""

from __future__ import annotations

import pathlib
import re
import tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
REPLACED = ("torch", "torchvision")


def other_pins(pyproject: pathlib.Path = PYPROJECT) -> list[str]:
    """The ``pinned`` extra's requirements except torch's and torchvision's."""
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["pinned"]
    name = re.compile(r"[A-Za-z0-9_.\-]+")
    return [spec for spec in extra if name.match(spec).group().lower() not in REPLACED]


if __name__ == "__main__":
    print("\n".join(other_pins()))
