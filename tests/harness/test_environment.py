"""The environment: pins agree, torch and torchvision work together."""

import re

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11+")


def _pins_from_environment_yml(text: str) -> dict[str, str]:
    pins = {}
    in_pip = False
    for line in text.splitlines():
        if line.strip() == "- pip:":
            in_pip = True
            continue
        match = re.match(r"\s+- ([A-Za-z0-9_.\-]+)(===?)(\S+)$", line)
        if in_pip and match:
            pins[match.group(1).lower()] = match.group(2) + match.group(3)
    return pins


def test_environment_yml_pins_equal_pyproject(root):
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    pinned = {}
    for spec in project["optional-dependencies"]["pinned"]:
        req = Requirement(spec)
        (specifier,) = req.specifier
        pinned[req.name.lower()] = specifier.operator + specifier.version
    conda = _pins_from_environment_yml((root / "environment.yml").read_text())
    assert conda == pinned


def _exact_pins(specs) -> dict[str, str]:
    pins = {}
    for spec in specs:
        req = Requirement(spec)
        (specifier,) = req.specifier  # exactly one: a pin, not a range
        assert specifier.operator in ("==", "==="), spec
        pins[req.name.lower()] = specifier.operator + specifier.version
    return pins


@pytest.mark.parametrize("extra", ["lab", "site"])
def test_part_extras_pin_what_pinned_pins(root, extra):
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    part, pinned = _exact_pins(extras[extra]), _exact_pins(extras["pinned"])
    assert part and {name: pinned.get(name) for name in part} == part


def test_conda_environment_has_jupyterlab_and_the_site_tools(root):
    conda = _pins_from_environment_yml((root / "environment.yml").read_text())
    assert {"jupyterlab", "sphinx", "myst-nb"} <= set(conda)


def test_pins_fall_inside_the_supported_range(root):
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    ranges = {Requirement(s).name: Requirement(s).specifier for s in project["dependencies"]}
    for spec in project["optional-dependencies"]["pinned"]:
        req = Requirement(spec)
        (specifier,) = req.specifier
        if req.name in ranges:
            assert Version(specifier.version) in ranges[req.name], spec
    # The oldest and newest releases of the range (benchmarks/torch_versions.md says
    # what passed on them); the GPU machines have torch 2.11 / torchvision 0.26.
    assert Version("2.11.0") in ranges["torch"] and Version("2.15.0") in ranges["torch"]
    assert Version("0.26.0") in ranges["torchvision"]
    assert Version("0.29.2") in ranges["torchvision"]


def test_make_test_torch_installs_every_pin_but_torch_and_torchvision(root):
    import importlib.util

    spec = importlib.util.spec_from_file_location("pins", root / "ddp_course/harness/pins.py")
    pins = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pins)
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    pinned = {Requirement(s).name: s for s in project["optional-dependencies"]["pinned"]}
    others = pins.other_pins()
    assert sorted(others) == sorted(
        s for n, s in pinned.items() if n not in ("torch", "torchvision")
    )
    assert "pins.py > $(VENV)/pins.txt" in (root / "Makefile").read_text()


def test_torchvision_model_runs_forward_on_cpu():
    import torchvision  # noqa: F401  (fails here when the pair is broken)

    from ddp_course.models import resnet18_mnist

    model = resnet18_mnist().eval()
    with torch.no_grad():
        out = model(torch.randn(3, 1, 28, 28))
    assert out.shape == (3, 10)
    assert torch.isfinite(out).all()


def test_torchvision_compiled_operator_is_registered():
    # The broken pair imports partly and fails on its compiled operators.
    from torchvision.ops import nms

    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30]])
    keep = nms(boxes, torch.tensor([0.9, 0.8, 0.7]), iou_threshold=0.5)
    assert keep.tolist() == [0, 2]
