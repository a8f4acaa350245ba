"""The Markdown files' links to files of the repository name files that exist (Sphinx
cannot check them: links to source files are not pages of the site, so its check is off)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_SKIPPED = {".git", ".venv", ".venv-compat", "_build", "node_modules"}


def _markdown_files() -> list[Path]:
    return [
        path
        for path in ROOT.rglob("*.md")
        if not _SKIPPED.intersection(path.relative_to(ROOT).parts)
    ]


def test_every_relative_link_names_a_file_of_the_repository() -> None:
    broken = []
    files = _markdown_files()
    assert ROOT / "README.md" in files and ROOT / "docs" / "status.md" in files
    for path in files:
        for target in _LINK.findall(path.read_text()):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            name = target.split("#", 1)[0]
            resolved = (path.parent / name).resolve()
            if not (resolved.is_relative_to(ROOT) and resolved.exists()):
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links to no file of the repository:\n" + "\n".join(broken)
