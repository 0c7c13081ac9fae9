"""A one-node Slurm cluster on this machine, to run a batch script for real.

:class:`LocalSlurm` is a context manager that brings up MUNGE (Slurm's
authentication daemon), ``slurmctld`` (the controller) and one ``slurmd``
(the node daemon) with a configuration generated for this host, all of it in
a temporary folder; submits batch scripts with ``sbatch``; waits for a job
with ``scontrol show job``; and on exit cancels what is left, stops the
daemons and removes every file it made::

    with LocalSlurm() as cluster:
        job = cluster.sbatch("scripts/11_train.sbatch", ["--epochs", "1"],
                             options=["--nodes=1"])
        result = cluster.wait(job, timeout_s=60)   # raises SlurmJobError on failure
        print(result.state, result.output)

What it needs: Linux, Debian's ``slurm-wlm`` and ``munge`` packages (installed
with ``apt-get`` when missing and running as root) and root, because slurmd
starts every job as the user who submitted it (:mod:`ddp_course.harness.slurm_install`
checks and installs them). Each thing that is missing raises
:class:`~ddp_course.harness.slurm_install.SlurmUnavailable` with what to do; a test turns it
into a skip. A job's state and outcome are read as :mod:`ddp_course.harness.slurm_jobs` says.

The configuration follows the Slurm documentation (https://slurm.schedmd.com/
slurm.conf.html, https://slurm.schedmd.com/quickstart_admin.html) with the
choices a container allows: processes tracked through their parent
(``ProctrackType=proctrack/linuxproc``) and no CPU binding (``TaskPlugin=
task/none``), so no cgroup is needed; the node's CPUs and memory are what
``slurmd -C`` reports for this machine; no accounting database, so a job's
state comes from ``scontrol``, which keeps finished jobs for ``MinJobAge``
seconds.
"""

from __future__ import annotations

import contextlib
import math
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence

import psutil

from .ports import free_port
from .slurm_install import SlurmUnavailable, install_packages, missing_commands, tail
from .slurm_jobs import FINAL_STATES, JobResult, SlurmJobError, epoch_s, parse_record

__all__ = ["CRED_EXPIRE_S", "DAEMONS", "LocalSlurm"]

DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd", "slurmscriptd")
"""Names of the processes a cluster runs; none of ours is left after exit."""

_COMMAND_TIMEOUT_S = 30.0  # one client command (sbatch, scontrol, scancel); they answer in ms

CRED_EXPIRE_S = 5
"""Seconds a job credential lives (slurm.conf ``AuthInfo=cred_expire``); also the
wait before a requeued job may start again (https://slurm.schedmd.com/slurm.conf.html)."""


def _node_line() -> str:
    # slurmd -C prints this machine's node definition (CPUs, sockets, cores,
    # threads, RealMemory in MiB) exactly as slurmd will report it, so the
    # controller never drains the node for a mismatch.
    done = subprocess.run(
        ["slurmd", "-C"], capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S
    )
    line = done.stdout.splitlines()[0] if done.returncode == 0 and done.stdout else ""
    if not line.startswith("NodeName="):
        raise SlurmUnavailable(f"`slurmd -C` did not describe this node: {done.stderr.strip()}")
    return line


class LocalSlurm:
    """A one-node Slurm cluster in a temporary folder, as a context manager.

    Args:
        install: install :data:`~ddp_course.harness.slurm_install.PACKAGES` with apt-get
            when commands are missing (root only); otherwise raise.
        start_timeout_s: seconds to wait for each daemon and for the node to
            become idle.

    Attributes (set on entry):
        root: the temporary folder holding configuration, keys, state and logs.
        conf: path of the generated ``slurm.conf``.
        node: the node's name (this host's short name).
        install_s: seconds spent installing packages (0.0 when none were).

    Raises (on entry):
        SlurmUnavailable: packages missing and not installable, not root, or a
            daemon did not start (the message holds the end of its log).
    """

    def __init__(self, install: bool = True, start_timeout_s: float = 30.0):
        self.install, self.start_timeout_s = install, start_timeout_s
        self.root: pathlib.Path | None = None
        self.conf: pathlib.Path | None = None
        self.node = socket.gethostname().split(".")[0]
        self.install_s = 0.0
        self._procs: dict[str, subprocess.Popen] = {}
        self._submitted: dict[int, float] = {}
        self._up = False  # the controller answered and the node is idle

    # --- bring-up -------------------------------------------------------------

    def __enter__(self) -> LocalSlurm:
        if os.name != "posix" or not pathlib.Path("/proc").is_dir():
            raise SlurmUnavailable("the local Slurm cluster needs Linux")
        if os.geteuid() != 0:
            raise SlurmUnavailable(
                "the local Slurm cluster needs root: slurmd starts every job as the user "
                "who submitted it (run the tests as root, e.g. in a container)"
            )
        missing = missing_commands()
        if missing and not self.install:
            raise SlurmUnavailable(f"missing {', '.join(missing)}: apt-get install slurm-wlm munge")
        if missing:
            self.install_s = install_packages()
            if missing_commands():
                raise SlurmUnavailable(f"still missing after apt-get: {missing_commands()}")
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="ddp_course_slurm_"))
        try:
            self._write_config()
            self._start_munge()
            self._start_daemon(
                "slurmctld",
                ["slurmctld", "-D", "-c", "-f", str(self.conf)],
                self.root / "slurmctld.log",
                self._controller_up,
            )
            self._start_daemon(
                "slurmd",
                ["slurmd", "-D", "-f", str(self.conf)],
                self.root / "slurmd.log",
                self._node_idle,
            )
            self._up = True
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def env(self) -> dict[str, str]:
        """Environment for Slurm's client commands: this cluster's ``SLURM_CONF``."""
        path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
        return {**os.environ, "PATH": path, "SLURM_CONF": str(self.conf)}

    def _write_config(self) -> None:
        root = self.root
        for sub in ("munge", "state", "spool", "jobs"):
            (root / sub).mkdir(mode=0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))  # MUNGE wants at least 32 random bytes, mode 0400
        key.chmod(0o400)
        words = _node_line().split()  # NodeName=<host> CPUs=... RealMemory=...
        node = " ".join([f"NodeName={self.node}", "NodeAddr=127.0.0.1", *words[1:]])
        ctl_port, node_port = free_port(), free_port()
        while node_port == ctl_port:
            node_port = free_port()
        lines = [
            "# Generated by ddp_course.harness.slurm for a one-node test cluster (slurm.conf(5)).",
            "ClusterName=ddpcourse",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctl_port}",
            f"SlurmdPort={node_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also sets how long a requeued job must wait: the node
            # refuses a job id whose credential it revoked less than that ago.
            f"AuthInfo=socket={root / 'munge' / 'munge.socket'},cred_expire={CRED_EXPIRE_S}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'slurmd.log'}",
            # A container has no systemd-delegated cgroups: track a job's
            # processes through their parents and do not bind CPUs.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "MailProg=/bin/true",  # no mail on a test cluster
            "SchedulerType=sched/builtin",
            # Start a submitted job within 0.1 s, not 2 s; and look at pending jobs every
            # second, not every 60: a requeued job waits for its start time, which no
            # event announces, so only this loop starts it.
            "SchedulerParameters=sched_min_interval=100000,sched_interval=1",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            # Job ids differ from one cluster to the next, as on a long-lived cluster:
            # a batch script may derive ports and file names from them.
            f"FirstJobId={random.randrange(1000, 1_000_000)}",
            # Finished jobs stay visible to scontrol, and can be requeued, this many seconds.
            "MinJobAge=3600",
            "KillWait=5",  # seconds between SIGTERM and SIGKILL when a job is cancelled
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            node + " State=UNKNOWN",
            f"PartitionName=local Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf = root / "slurm.conf"
        self.conf.write_text("\n".join(lines) + "\n")
        # Read only when a cgroup plugin is configured; written so that a
        # learner who switches plugins sees where it goes (cgroup.conf(5)).
        (root / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")

    def _run(
        self, cmd: Sequence[str], check: bool = True, timeout_s: float = _COMMAND_TIMEOUT_S, **kw
    ) -> subprocess.CompletedProcess:
        # A controller that accepts but never answers must not hang the caller:
        # every client command has a deadline, and a missed one reads as a failure.
        try:
            done = subprocess.run(
                list(cmd),
                env=kw.pop("env", self.env),
                capture_output=True,
                text=True,
                timeout=timeout_s,
                **kw,
            )
        except subprocess.TimeoutExpired:
            done = subprocess.CompletedProcess(cmd, 124, "", f"no answer in {timeout_s:.0f} s")
        if check and done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()}")
        return done

    def _start_munge(self) -> None:
        munge = self.root / "munge"
        cmd = [
            "munged",
            "--foreground",
            "--force",
            f"--key-file={munge / 'munge.key'}",
            f"--socket={munge / 'munge.socket'}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        ]

        def ready() -> bool:
            return (munge / "munge.socket").exists()

        self._start_daemon("munged", cmd, munge / "munged.log", ready)

    def _start_daemon(self, name, cmd, log: pathlib.Path, ready) -> None:
        out = open(self.root / f"{name}.stdout", "wb")
        with out:
            # Its own session: a terminal's Ctrl-C reaches Python, which stops it.
            self._procs[name] = subprocess.Popen(
                cmd,
                env=self.env,
                stdout=out,
                stderr=out,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._procs[name].poll() is not None:
                break
            if ready():
                return
            time.sleep(0.2)
        why = "exited" if self._procs[name].poll() is not None else "did not become ready"
        text = "".join(
            p.read_text(errors="replace") for p in (log, self.root / f"{name}.stdout") if p.exists()
        )
        raise SlurmUnavailable(
            f"{name} {why} within {self.start_timeout_s:.0f} s; the end of its log:\n"
            + (tail(text, 20) or "(empty)")
        )

    def _controller_up(self) -> bool:
        return "is UP" in self._run(["scontrol", "ping"], check=False, timeout_s=3).stdout

    def _node_idle(self) -> bool:
        done = self._run(["scontrol", "-o", "show", "node", self.node], check=False, timeout_s=3)
        return parse_record(done.stdout).get("State", "").startswith("IDLE")

    # --- jobs -------------------------------------------------------------------

    def sbatch(
        self,
        script: str | os.PathLike,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        options: Sequence[str] = (),
        cwd: str | os.PathLike | None = None,
    ) -> int:
        """Submit ``script`` with ``sbatch`` and return its job id.

        Args:
            script: the batch script.
            args: the script's own arguments (``$@`` inside it).
            env: variables added to this process's environment; sbatch hands
                the whole environment to the job (``--export=ALL``).
            options: sbatch options; they override the script's ``#SBATCH``
                lines (``--nodes=1`` on this one-node cluster).
            cwd: the submit directory (``$SLURM_SUBMIT_DIR``), default the
                current folder.

        Raises:
            RuntimeError: sbatch refused the job; the message holds its reason.
        """
        output = self.root / "jobs" / "job-%j.out"  # one file, appended to if requeued
        cmd = ["sbatch", "--parsable", f"--output={output}", *options, str(script), *args]
        done = self._run(cmd, env={**self.env, **(env or {})}, cwd=cwd)
        job_id = int(done.stdout.strip().split(";")[0])
        self._submitted[job_id] = time.perf_counter()
        return job_id

    def job_state(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` of one job as ``{Key: Value}`` (``JobState``,
        ``ExitCode``, ``Restarts``, ...); empty once Slurm forgot the job."""
        return parse_record(
            self._run(["scontrol", "-o", "show", "job", str(job_id)], check=False).stdout
        )

    def output(self, job_id: int) -> str:
        """The text of a job's output file so far ('' before it starts)."""
        path = self.root / "jobs" / f"job-{job_id}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, job_id: int, timeout_s: float = 120.0) -> JobResult:
        """Wait until the job is over; return it if it completed with exit code 0.

        Polls ``scontrol show job`` every 0.2 s. A requeued job (``--requeue``)
        goes back to pending and is waited for again.

        Raises:
            SlurmJobError: the job ended in another state or with a non-zero
                exit code, or was still running after ``timeout_s`` seconds
                (it is then cancelled); the message holds the end of its output.
        """
        deadline = time.monotonic() + timeout_s
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job_state(job_id) or fields
            state = fields.get("JobState", "UNKNOWN")
            if state in FINAL_STATES:
                break
            time.sleep(0.2)
        else:
            self._run(["scancel", str(job_id)], check=False)
            state = "WAIT_TIMEOUT"
        output = self.output(job_id)
        if state != "COMPLETED" or fields.get("ExitCode", "0:0") != "0:0":
            # A job that fails before its first line leaves nothing in its output;
            # the daemons' view of it is then the only clue.
            daemons = "".join(
                f"\nthe end of {name}.log about job {job_id}:\n" + (tail(lines, 8) or "(none)")
                for name in ("slurmctld", "slurmd")
                for lines in [self._log_lines(name, str(job_id))]
            )
            raise SlurmJobError(
                f"job {job_id} ended {state} (exit code {fields.get('ExitCode', '?')}, "
                f"reason {fields.get('Reason', '?')}); the end of its output:\n"
                + (tail(output) or "(empty)")
                + daemons,
                job_id,
                state,
                output,
            )
        wall_s = time.perf_counter() - self._submitted.get(job_id, time.perf_counter())
        return JobResult(job_id, state, output, wall_s, int(fields.get("Restarts", "0")))

    def _log_lines(self, daemon: str, needle: str) -> str:
        """The lines of a daemon's log in this cluster's folder that contain ``needle``."""
        path = self.root / f"{daemon}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(line for line in text.splitlines() if needle in line)

    def requeue(self, job_id: int) -> None:
        """Requeue a running or finished batch job and let it start again when Slurm allows.

        ``scontrol requeue`` is what Slurm does to a ``--requeue`` job after a
        node failure or a preemption: the job goes back to pending with the
        same job id and ``SLURM_RESTART_COUNT`` one higher. Slurm then holds it
        for ``cred_expire`` seconds (``Reason=BeginTime``), 120 by default; this
        cluster sets it to :data:`CRED_EXPIRE_S` and starts the job as soon as the
        node has forgotten the last run's credential: that long after the run
        ended, so at once for a job that ended longer ago
        (https://slurm.schedmd.com/scontrol.html).

        Raises:
            RuntimeError: scontrol refused (unknown job, not requeueable).
        """
        # A job step that is still cleaning up on the node would meet the requeued
        # run's launch (seen once: the requeued run failed before its first line).
        deadline = time.monotonic() + _COMMAND_TIMEOUT_S
        while any(True for _ in self._steps()) or not self._node_idle():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the node did not become idle to requeue job {job_id}")
            time.sleep(0.1)
        fields = self.job_state(job_id)
        ended = (
            epoch_s(fields.get("EndTime", "")) if fields.get("JobState") in FINAL_STATES else None
        )
        self._run(["scontrol", "requeue", str(job_id)])
        deadline = time.monotonic() + _COMMAND_TIMEOUT_S
        while self.job_state(job_id).get("JobState") != "PENDING":
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} did not go back to PENDING after requeue")
            time.sleep(0.1)
        # Started before the node forgot the last run's credential, the job is killed
        # at once ("Job credential revoked"). The node revokes it when the run ends:
        # now for a running job, at EndTime (whole seconds, so one more) for a finished one.
        forget_at = (ended + 1 if ended is not None else time.time()) + CRED_EXPIRE_S + 1
        wait_s = math.ceil(forget_at - time.time())
        start = f"now+{wait_s}" if wait_s > 0 else "now"
        self._run(["scontrol", "update", f"JobId={job_id}", f"StartTime={start}"])

    # --- tear-down ----------------------------------------------------------------

    def leftover_processes(self) -> list[psutil.Process]:
        """Processes of this cluster still alive: the daemons started here and
        job steps (``slurmstepd``, which slurmd detaches and which keep this
        cluster's log open). Empty after exit."""
        mine = {p.pid for p in self._procs.values() if p.poll() is None}
        found = [psutil.Process(pid) for pid in mine if psutil.pid_exists(pid)]
        return found + list(self._steps())

    def __exit__(self, *exc) -> None:
        if self._up:
            with contextlib.suppress(Exception):  # cancel every job left; ours alone run here
                self._run(["scancel", "--full", "--user=root"], check=False, timeout_s=10)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and any(True for _ in self._steps()):
                time.sleep(0.2)
        # Stop in reverse order of start: slurmd, slurmctld, munged.
        for name in reversed(list(self._procs)):
            proc = self._procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        leftover = self.leftover_processes()  # job steps that outlived slurmd
        for step in list(leftover):  # with what they run (torchrun and its ranks)
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover += step.children(recursive=True)
        for proc in leftover:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(leftover, timeout=10)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def _steps(self) -> Iterator[psutil.Process]:
        # slurmstepd runs with an empty environment and init as its parent; what
        # ties it to this cluster is the slurmd log it inherited, open in our folder.
        if self.root is None:
            return
        tag = str(self.root)
        for proc in psutil.process_iter(["name"]):
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if proc.info["name"] == "slurmstepd" and any(
                    f.path.startswith(tag) for f in proc.open_files()
                ):
                    yield proc
