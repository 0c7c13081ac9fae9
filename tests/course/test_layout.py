"""The package's layout holds: what the lessons teach at the top level, ``tools/`` and
``harness/`` below it, no private name imported across modules, a docstring on every
public function and class."""

import ast
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ddp_course"
# A mechanism may use the harness only for what distributed() needs: the restart prefix
# under torchrun, and a store on loopback for a world started without torchrun.
MECHANISM_USES_OF_HARNESS = {
    ("runtime", "ddp_course.harness.restarts"),
    ("runtime", "ddp_course.harness.loopback"),
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, source: str) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every ``from X import names`` and ``import X``, resolved."""
    tree = ast.parse(source)
    here = _module_name(path).split(".") if path.is_relative_to(PACKAGE) else []
    if path.name != "__init__.py" and here:
        here = here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.append((module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
    return found


def _sources() -> list[tuple[pathlib.Path, str]]:
    files = [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "scripts").glob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
    ]
    out = [(p, p.read_text()) for p in files]
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        code = [
            "".join(c["source"])
            for c in cells
            if c["cell_type"] == "code" and not "".join(c["source"]).startswith("%%")
        ]
        # IPython's magics are not Python; the cells' imports are.
        text = "\n".join(
            line for cell in code for line in cell.splitlines() if not line.startswith("%")
        )
        out.append((nb, text))
    return out


def test_nothing_imports_a_private_name_of_the_package():
    private = []
    for path, source in _sources():
        for module, names in _imports(path, source):
            if module.startswith("ddp_course"):
                private += [
                    f"{path.relative_to(ROOT)}: {module}.{n}" for n in names if n.startswith("_")
                ]
                private += [
                    f"{path.relative_to(ROOT)}: {module}"
                    for part in module.split(".")
                    if part.startswith("_") and part != "__main__"
                ]
    assert not private, "make these public (with a docstring) or leave them alone:\n" + "\n".join(
        private
    )


def test_mechanisms_do_not_depend_on_tools_or_the_harness():
    wrong = []
    for path in PACKAGE.glob("*.py"):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        for module, names in _imports(path, path.read_text()):
            for full in [f"{module}.{n}" for n in names] or [module]:
                below = full.startswith(("ddp_course.tools", "ddp_course.harness"))
                if below and (path.stem, full) not in MECHANISM_USES_OF_HARNESS:
                    wrong.append(f"{path.name} imports {full}")
    assert not wrong, wrong


@pytest.mark.parametrize(
    "path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_every_public_function_and_class_has_a_docstring(path):
    tree = ast.parse(path.read_text())
    missing = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
        and not node.name.startswith("_")
        and ast.get_docstring(node) is None
    ]
    assert not missing, f"{path.name}: {missing}"
