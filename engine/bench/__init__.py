"""`python -m engine bench forward|stream`: benchmarks that print ratios measured in one run.

* forward — compute: one KDA layer and one MLA-MoE layer at the real widths, BF16 and
  MXFP4 matmul throughput as fractions of the memory bandwidth measured in the same run
  (engine/bench/forward.py).
* stream — I/O: the streaming source under memory budgets (engine/bench/stream.py).
* parts — this machine's disk and real-width compute, and the real model's forecast per
  preset from them (engine/bench/parts.py).
* slice — the real-width slice under a ladder of budgets, measured against the forecast
  (engine/bench/slice.py).
* serve — the HTTP server's cost per token against calling generate directly
  (engine/bench/serve.py).
* compact — the lossless compact trunk against the BF16 one (engine/bench/compact.py).
* chat — a 4-turn conversation, each turn cold vs resumed from the kept states
  (engine/bench/chat.py).
* prefill — the multi-token kernels against numpy's FP32 GEMM at real widths, and a prompt
  prefilled whole against token by token (engine/bench/prefill.py).
"""
