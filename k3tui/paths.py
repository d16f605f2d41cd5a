"""Every file k3tui keeps derives from one root, so `K3TUI_HOME` relocates all of it.

Default root: the platform's user data folder (``~/.local/share/k3tui`` on Linux).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paths:
    root: Path

    @property
    def config_file(self) -> Path:
        return self.root / "config.toml"

    @property
    def credentials_file(self) -> Path:
        """API keys and tokens, written 0600, never logged."""
        return self.root / "credentials.toml"

    @property
    def jobs_dir(self) -> Path:
        return self.root / "jobs"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def history_db(self) -> Path:
        return self.root / "history.sqlite3"

    @property
    def demo_dir(self) -> Path:
        return self.root / "demo"

    @property
    def models_dir(self) -> Path:
        """Default download target when the config names none."""
        return self.root / "models"

    @property
    def bench_dir(self) -> Path:
        return self.root / "bench"

    def as_dict(self) -> dict[str, str]:
        names = ["root", "config_file", "credentials_file", "jobs_dir", "logs_dir",
                 "history_db", "demo_dir", "models_dir", "bench_dir"]
        return {name: str(getattr(self, name)) for name in names}


def get_paths() -> Paths:
    """Resolve the root now (not at import), so tests and users can set K3TUI_HOME late."""
    home = os.environ.get("K3TUI_HOME")
    if home:
        return Paths(Path(home).expanduser().resolve())
    from platformdirs import user_data_path

    return Paths(user_data_path("k3tui", appauthor=False))
