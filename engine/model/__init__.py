"""The Kimi-K3 text model (spec section 1): `transformer.Model` runs embed → layers → norm →
head over the mixers (kda.py, mla.py), the feed-forward blocks (moe.py) and the elementwise
math (ops.py); its hyperparameters are `engine.core.config.ModelConfig`. It holds no
weights: it asks a `engine.weights.source.WeightSource`."""
