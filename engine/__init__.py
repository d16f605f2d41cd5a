"""The bundled Kimi-K3 streaming engine (numpy). Never imports k3tui or any UI library."""
