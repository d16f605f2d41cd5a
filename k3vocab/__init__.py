"""The words and numbers k3tui and the engine must agree on, in one place.

The engine never imports k3tui and k3tui's TUI never imports the engine, so what both read
lives here, in a package that imports nothing (a contract in pyproject.toml): the memory
presets, the reasoning efforts, the checkpoint and backend kinds, the default context and the
byte units. The config's allowed values, the argparse choices, the wizard, the plan and the
engine all read these; tests/k3vocab/test_vocab.py fails if one of them disagrees.
"""

from __future__ import annotations

# Byte units. Decimal (GB, TB) for disks, downloads, checkpoints and the engine's budgets, as
# they are sold and listed; binary (GiB, MiB) for memory limits, as the kernel counts them.
KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KiB, MiB, GiB = 2**10, 2**20, 2**30

# The bundled engine's memory presets: (pinned trunk GB, expert cache GB), as the peer
# engine's `--list-presets` gives them for the real model, smallest first.
PRESETS: dict[str, tuple[float, float]] = {
    "laptop": (3.0, 1.0),
    "desktop": (16.0, 10.0),
    "workstation": (60.0, 30.0),
    "server": (110.0, 13.0),
    "max": (110.0, 109.0),
}
AUTO_PRESET = "auto"  # the biggest preset that fits the machine, chosen when planning
CUSTOM_PRESET = "custom"  # the config's own trunk_gb / cache_gb
PRESET_CHOICES = (*PRESETS, AUTO_PRESET)  # what `--preset` takes
CONFIG_PRESETS = (*PRESET_CHOICES, CUSTOM_PRESET)  # what config's engine.preset takes

# Reasoning efforts the chat template accepts. The template's own sentence names `medium`
# too, but the upstream renderer refuses it, so it is not one of ours.
EFFORTS = ("low", "high", "max")
DEFAULT_EFFORT = "max"

CHECKPOINT_KINDS = ("safetensors", "gguf", "remote")
BACKEND_KINDS = ("bundled", "llama-server", "remote")

DEFAULT_CONTEXT = 8192  # tokens per conversation, bundled engine and llama-server alike
