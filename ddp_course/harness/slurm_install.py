"""What this host needs to run a local Slurm cluster (:mod:`ddp_course.harness.slurm`):
Debian's ``slurm-wlm`` and ``munge`` packages, installed with ``apt-get`` as root when
missing, and the error that says what is missing and what to do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

__all__ = ["PACKAGES", "SlurmUnavailable", "install_packages", "missing_commands", "tail"]

PACKAGES = ("slurm-wlm", "munge")
"""Debian packages that provide the daemons and the client commands."""

_COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here; the message says what is missing and what to do."""


def missing_commands() -> list[str]:
    """The Slurm and MUNGE commands not found on ``PATH`` (with ``/usr/sbin``)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [name for name in _COMMANDS if shutil.which(name, path=path) is None]


def tail(text: str, lines: int = 30) -> str:
    """The last ``lines`` lines of ``text`` (a command's output, a log), stripped: the part
    an error message shows."""
    return "\n".join(text.strip().splitlines()[-lines:])


def install_packages(timeout_s: float = 600.0) -> float:
    """Install :data:`PACKAGES` with ``apt-get`` (as root, no prompts).

    Returns:
        Seconds the install took (``apt-get update`` included).

    Raises:
        SlurmUnavailable: not root, no ``apt-get`` (not Debian or Ubuntu), or
            ``apt-get`` failed or ran past ``timeout_s`` seconds; the message
            holds the command to run by hand and the end of apt's output.
    """
    by_hand = "apt-get install -y " + " ".join(PACKAGES)
    if os.name != "posix" or os.geteuid() != 0:
        raise SlurmUnavailable(f"Slurm is not installed and this is not root: run `sudo {by_hand}`")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(
            "Slurm is not installed and there is no apt-get here (not Debian or Ubuntu): "
            "install slurm-wlm and munge with this system's package manager"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    start = time.perf_counter()
    for cmd in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
    ):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` ran past {timeout_s:.0f} s") from None
        if done.returncode != 0:
            raise SlurmUnavailable(
                f"`{' '.join(cmd)}` failed (exit {done.returncode}); run `{by_hand}` by hand.\n"
                + tail(done.stdout + done.stderr, 15)
            )
    return time.perf_counter() - start
