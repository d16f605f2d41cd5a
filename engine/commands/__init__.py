"""The engine's command line, one module per `python -m engine` command (engine/cli.py
dispatches): each exposes `add_arguments(parser)` and `main(args) -> int`, turns flags into
the library's typed settings, and prints; the library modules below have no `main`.
"""
