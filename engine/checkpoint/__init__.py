"""Checkpoint formats: safetensors headers and the index (safetensors.py), the tensors a config
implies (schema.py), the packed trunk (trunk.py, `python -m engine pack`) and random-weight
checkpoints of the real architecture (synth.py, `python -m engine synth`)."""
