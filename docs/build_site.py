"""Build the course's website from the committed notebooks; nothing is executed.

    python docs/build_site.py                  # into build/site, then open build/site/index.html
    python docs/build_site.py --out DIR

The sources are assembled in ``<out>-src``: the notebooks and scripts as in the
repository (so relative links between them still work) and a front page made
from the README's lesson table, whose notebook names become links.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def lessons(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """Every lesson notebook, ``notebooks/NN_*.ipynb``, in order."""
    return sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def readme_section(readme: str, heading: str) -> str:
    """The README's ``## heading`` section, up to the next ``## `` heading.

    Raises:
        ValueError: the README has no such heading (the front page would be empty).
    """
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if match is None:
        raise ValueError(f"README.md has no '## {heading}' section for the front page")
    return match.group(1).strip()


def front_page(readme: str, names: list[str]) -> str:
    """MyST Markdown of the front page: the README's title, opening and lesson table.

    Args:
        readme: text of README.md.
        names: lesson notebook stems (``00_course_setup``) that have a page; their
            backquoted mentions in the table become links to the pages.
    """
    title, _, rest = readme.partition("\n")
    opening = rest.strip().split("\n## ", 1)[0].strip()
    table = readme_section(readme, "The lessons")
    for name in names:
        table = table.replace(f"`{name}`", f"[`{name}`](notebooks/{name}.ipynb)")
    toctree = "\n".join(f"notebooks/{name}" for name in names)
    return (
        f"{title}\n\n{opening}\n\n## The lessons\n\n{table}\n\n"
        f"```{{toctree}}\n:hidden:\n:caption: Lessons\n\n{toctree}\n```\n"
    )


def assemble(src: pathlib.Path, root: pathlib.Path = ROOT) -> None:
    """Write the site's sources into ``src`` (emptied first)."""
    shutil.rmtree(src, ignore_errors=True)
    (src / "notebooks").mkdir(parents=True)
    notebooks = lessons(root)
    for path in notebooks:
        shutil.copy2(path, src / "notebooks" / path.name)
    shutil.copytree(root / "scripts", src / "scripts", ignore=shutil.ignore_patterns("__*"))
    readme = (root / "README.md").read_text()
    (src / "index.md").write_text(front_page(readme, [p.stem for p in notebooks]))


def build(out: pathlib.Path, root: pathlib.Path = ROOT, quiet: bool = True) -> int:
    """Assemble the sources and run Sphinx (HTML) into ``out``; Sphinx's exit code."""
    from sphinx.cmd.build import build_main

    out = out.resolve()
    src = out.with_name(out.name + "-src")
    assemble(src, root)
    args = ["-b", "html", "-c", str(DOCS), "-d", str(src / ".doctrees"), str(src), str(out)]
    return build_main((["-q"] if quiet else []) + args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "build" / "site")
    args = parser.parse_args(argv)
    code = build(args.out)
    if code == 0:
        print(f"site: {args.out.resolve() / 'index.html'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
