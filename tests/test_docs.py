"""The Markdown files' links to files of the repository name files that exist (Sphinx
cannot check them: links to source files are not pages of the site, so its check is off)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCED = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _markdown_files() -> list[Path]:
    """The repository's Markdown files (tracked or to be added: not the ignored ones)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).exists()]


def test_every_relative_link_names_a_file_of_the_repository() -> None:
    broken = []
    files = _markdown_files()
    assert ROOT / "README.md" in files and ROOT / "docs" / "status.md" in files
    for path in files:
        prose = _FENCED.sub("", path.read_text())  # code blocks hold no links
        for target in _LINK.findall(prose):
            if target.startswith(("http://", "https://", "mailto:", "#")):
                continue
            name = target.split("#", 1)[0]
            resolved = (path.parent / name).resolve()
            if not (resolved.is_relative_to(ROOT) and resolved.exists()):
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links to no file of the repository:\n" + "\n".join(broken)
