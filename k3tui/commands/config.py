"""`k3tui config`: where k3tui keeps its files, the effective config, and setting one value."""

from __future__ import annotations

import argparse
import json

from k3tui.errors import K3Error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    sub.add_parser("path", help="print where k3tui keeps each file (K3TUI_HOME moves them all)")
    show = sub.add_parser("show", help="print the effective config (defaults filled in)")
    show.add_argument("--json", action="store_true", help="print JSON")
    setp = sub.add_parser("set", help="set one value, e.g. `k3tui config set backend.port 8080`")
    setp.add_argument("key", help="section.key")
    setp.add_argument("value", help="a TOML value (strings may go unquoted)")
    sub.add_parser("clear-states", help="remove the bundled engine's kept conversation "
                   "states (a follow-up is then prefilled again)")


def run(args: argparse.Namespace) -> int:
    from k3tui.config import config_exists, load_config, save_config, set_in_file
    from k3tui.paths import get_paths

    paths = get_paths()
    action = args.action or "show"
    if action == "path":
        for name, value in paths.as_dict().items():
            print(f"{name:<17} {value}")
        return 0
    if action == "clear-states":
        return _clear_states(paths.states_dir)
    if action == "set":
        cfg = set_in_file(args.key, args.value)
        section, _, key = args.key.partition(".")
        switched = (section == "engine" and key in ("trunk_gb", "cache_gb")
                    and getattr(cfg.engine, key) > 0 and cfg.engine.preset != "custom")
        other = "cache_gb" if key == "trunk_gb" else "trunk_gb"
        if switched:  # explicit sizes are only used by the custom preset, which needs both
            from k3tui.planning.plan import PRESETS

            named = PRESETS.get(cfg.engine.preset)
            if named is not None and not getattr(cfg.engine, other):
                setattr(cfg.engine, other, getattr(named, other))
            cfg.engine.preset = "custom"
        path = save_config(cfg)
        print(f"{args.key} = {json.dumps(getattr(getattr(cfg, section), key))} saved in {path}")
        if switched:
            print(f"engine.preset = \"custom\" too (trunk_gb and cache_gb are used only by the "
                  f"custom preset); engine.{other} = {getattr(cfg.engine, other):g}.")
            if not getattr(cfg.engine, other):
                print(f"Set it too: `k3tui config set engine.{other} GB`.")
        return 0
    cfg = load_config()
    if action == "show":
        if getattr(args, "json", False):
            print(json.dumps(cfg.to_dict(), indent=2))
            return 0
        import tomlkit

        origin = str(paths.config_file) if config_exists() else "defaults (no config file yet: " \
                                                                 "`k3tui setup` writes one)"
        print(f"# effective config from {origin}")
        print(tomlkit.dumps(cfg.to_dict()), end="")
        return 0
    raise K3Error(f"unknown config action {action!r}.", "use path, show, set or clear-states", 2)


def _clear_states(root) -> int:
    """Remove the state files only (no symlink followed). Safe while the engine runs: it
    checks a state file each time it reads one, and one that is gone is prefilled again."""
    from k3tui.planning.states import NotAFolder, clear
    from k3tui.units import transfer_size

    try:
        freed = clear(root)
    except NotAFolder as exc:
        raise K3Error(f"{exc.strerror}; nothing was removed.",
                      f"look at {root} and remove it by hand if it is not yours") from None
    except OSError as exc:
        raise K3Error(f"The state folder {root} cannot be read ({exc.strerror or exc}).",
                      "check its owner and mode (0700)") from None
    if not freed.files:
        print(f"No kept conversation states in {root}.")
    else:
        print(f"Removed {freed.files} kept conversation state(s) from {root}: "
              f"{transfer_size(freed.bytes)} freed. A running engine prefills those "
              "conversations again on their next turn.")
    return 0
