"""MkDocs hook: the repository's screenshots/ (written by scripts/screenshots.py, shown by
the README too) become site files, so the pages show the same SVGs without a copy in docs/."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

SCREENSHOTS = Path(__file__).resolve().parents[2] / "screenshots"


def on_files(files, config):
    for svg in sorted(SCREENSHOTS.glob("*.svg")):
        files.append(File.generated(config, f"screenshots/{svg.name}", abs_src_path=str(svg)))
    return files
