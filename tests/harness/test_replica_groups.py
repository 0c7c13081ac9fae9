"""ddp_course.harness.replica_groups: one torchrun job per replica group, all at once; the
device rule, bad input, and a failing group raised only once every group has ended."""

import pathlib
import textwrap

import pytest

from ddp_course.harness import launch, replica_groups

SCRIPT = textwrap.dedent(
    """
    import argparse, os, pathlib, time
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int)
    p.add_argument("--out")
    args = p.parse_args()
    if args.group == 1:
        raise SystemExit("group 1 fails at once")
    time.sleep(1.0)  # still running when group 1 has failed
    pathlib.Path(args.out, f"done_{args.group}").write_text(os.environ["DDP_COURSE_DEVICE"])
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "groups.py"
    path.write_text(SCRIPT)
    return path


def test_no_group_is_a_value_error(script):
    with pytest.raises(ValueError, match="at least one replica group"):
        replica_groups.torchrun_replica_groups(script, [], [])


def test_a_gpu_is_refused_with_the_reason(script):
    with pytest.raises(ValueError, match="NCCL refuses two ranks"):
        replica_groups.torchrun_replica_groups(script, [], [[]], env={"DDP_COURSE_DEVICE": "cuda"})


def test_a_failing_group_is_raised_once_the_others_have_ended(script, tmp_path, capsys):
    groups = [["--group", str(i), "--out", str(tmp_path)] for i in range(2)]
    with pytest.raises(launch.LaunchError, match="group 1 fails at once"):
        replica_groups.torchrun_replica_groups(
            script, [], groups, max_restarts=0, results=False, timeout_s=60
        )
    assert pathlib.Path(tmp_path, "done_0").read_text() == "cpu"  # group 0 ran to its end
    shown = capsys.readouterr().out.splitlines()
    assert shown[1].startswith("[group 0] $ torchrun --nproc_per_node=1 --max-restarts=0")
    assert shown[2].endswith("--group 1 --out " + str(tmp_path))
