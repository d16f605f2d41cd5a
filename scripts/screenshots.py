#!/usr/bin/env python
"""Regenerate the README's screenshots (SVG) from the real app, driven by scripted scenes.

    python scripts/screenshots.py [OUT_DIR]      # default: screenshots/

Each scene is the real ChatApp with a scripted stream, a fake clock and fixed I/O samples
(tests/support/scenes.py), so the pictures are reproducible.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))  # the scenes and their fakes


async def shoot(app, path: Path, size: tuple[int, int], before) -> None:
    async with app.run_test(size=size) as pilot:
        await before(pilot)
        await pilot.pause()
        path.write_text(app.export_screenshot(), encoding="utf-8")
        print(f"wrote {path}")


async def main(out: Path) -> None:
    home = Path(tempfile.mkdtemp(prefix="k3shots-"))
    os.environ["K3TUI_HOME"] = str(home)
    from k3tui.paths import get_paths
    import scenes
    from k3tui.tui.screens.jobs import JobsScreen

    out.mkdir(parents=True, exist_ok=True)

    def fresh(name: str) -> Path:
        d = home / name
        d.mkdir()
        return d

    await shoot(scenes.chat_app(fresh("a")), out / "chat.svg", (120, 40),
                lambda p: scenes.run_turn(p, expand_reasoning=True))
    await shoot(scenes.chat_app(fresh("b")), out / "chat-80x24.svg", (80, 24), scenes.run_turn)
    await shoot(scenes.chat_app(fresh("c"), scenes.CJK_ANSWER, ""), out / "chat-cjk.svg",
                (100, 30), lambda p: scenes.run_turn(p, "日本語で答えて 🙂"))

    with scenes.write_jobs(get_paths().jobs_dir):
        for kind, name in (("download", "downloads.svg"), ("pack", "packing.svg")):
            async def open_jobs(pilot, kind=kind):
                await pilot.app.push_screen(JobsScreen(kind, refresh_hz=0))
                await pilot.pause()
            await shoot(scenes.chat_app(fresh(kind)), out / name, (100, 30), open_jobs)

    startup = scenes.StartupScene()
    app = scenes.chat_app(fresh("startup"))
    app.starter = startup

    async def loading(pilot):
        for _ in range(50):
            await pilot.pause(0.05)
            if "pinning" in getattr(pilot.app.screen, "last_line", ""):
                break

    try:
        await shoot(app, out / "startup.svg", (100, 30), loading)
    finally:
        startup.release.set()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "screenshots"))
