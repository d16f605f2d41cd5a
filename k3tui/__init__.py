"""k3tui: run Kimi-K3 on the machine you have."""

__version__ = "0.1.0"
