"""Checkpoint formats: safetensors headers and the index (safetensors.py), the tensors a config
implies (schema.py), the packed trunk (trunk.py, `python -m engine pack`; compact_pack.py the
lossless one; packing.py what the two packs share) and random-weight checkpoints of the real
architecture (synth.py, `python -m engine synth`)."""
