"""Launch recipes for serving Kimi-K3 on more than one machine, with the reasons.

k3tui does not run these clusters. It prints exactly how to start one with an existing
distributed engine, then connects to it as a remote backend. Three routes, as the DGX
Spark study recommends: pool the memory of several machines with llama.cpp RPC (GGUF),
or hold the safetensors checkpoint in data-centre GPUs with SGLang or vLLM.

Every flag printed here is checked by `tests/k3tui/planning/test_recipes.py`: llama.cpp's
against the `--help` of the llama-server and rpc-server binaries installed with the test
extras, SGLang's and vLLM's against flag lists recorded from the released wheels named
in `checked_against` (tests/k3tui/planning/data/, written by tests/k3tui/planning/record_flags.py).
"""

from __future__ import annotations

import math
import shlex
import textwrap
from dataclasses import dataclass
from k3tui.units import GiB
from k3vocab import DEFAULT_CONTEXT

ROUTES = ("rpc", "sglang", "vllm")

# Kimi-K3 facts (docs/spec/kimi-k3.md §1.5): 24 MLA layers keep a latent KV cache of
# 512 + 64 values per position per layer; 69 KDA layers keep a fixed 96 × 128 × 128 state.
MLA_LAYERS, KDA_LAYERS = 24, 69
KV_BYTES_PER_POS_F16 = MLA_LAYERS * (512 + 64) * 2
KDA_STATE_BYTES_F32 = KDA_LAYERS * 96 * 128 * 128 * 4
SAFETENSORS_GB = 1560.0
H200_GB = 141.0
KIMI_K3_LAYERS = MLA_LAYERS + KDA_LAYERS
RESERVE_GIB = 8.0  # what each pooled machine keeps for the OS and compute buffers


def cache_gib(ctx: int) -> float:
    """The KV cache (MLA latents) and the KDA recurrent state for `ctx` tokens."""
    return (ctx * KV_BYTES_PER_POS_F16 + KDA_STATE_BYTES_F32) / GiB


def split_layers(n_layers: int, shares: list[float]) -> list[int]:
    """How many of `n_layers` repeating layers each device gets, the way llama.cpp's layer
    split deals them: of the n + 1 layers (the output layer last), layer i goes to the first
    device whose cumulative share of the total exceeds i / (n + 1). The shares are what
    llama.cpp weighs the devices by: their free memory, unless --tensor-split is given."""
    total = sum(max(x, 0) for x in shares)
    counts = [0] * len(shares)
    if total <= 0:
        return counts
    bounds, running = [], 0.0
    for x in shares:
        running += max(x, 0) / total
        bounds.append(running)
    for i in range(n_layers):
        at = i / (n_layers + 1)
        counts[next((d for d, b in enumerate(bounds) if b > at), len(shares) - 1)] += 1
    return counts


@dataclass(frozen=True)
class Step:
    where: str  # which machine(s) run this command
    argv: tuple[str, ...]  # program first; placeholders in <angle brackets>
    env: tuple[str, ...] = ()  # NAME=value set before the command
    why: tuple[str, ...] = ()  # one line per flag group: what it does and why

    @property
    def program(self) -> str:
        return self.argv[0]

    def shell(self) -> str:
        words = [*self.env, *self.argv]
        out, line = [], "  "
        for word in words:
            # Placeholders and "$VARS" are for the reader to replace, so they stay unquoted.
            quoted = word if "<" in word or '"$' in word else shlex.quote(word)
            if len(line) + len(quoted) > 88 and line.strip():
                out.append(line + " \\")
                line = "    "
            line += ("" if not line.strip() else " ") + quoted
        out.append(line)
        return "\n".join(out)


@dataclass(frozen=True)
class Recipe:
    route: str
    title: str
    checked_against: str  # versions whose CLI the flags were checked against
    sources: tuple[str, ...]  # where the shape and flags come from
    fit: tuple[str, ...]  # the memory arithmetic, computed
    steps: tuple[Step, ...]
    notes: tuple[str, ...]
    connect: str  # how k3tui then talks to it


@dataclass(frozen=True)
class RpcSizing:
    nodes: int  # machines needed, head included
    weights_only_nodes: int  # the bare lower bound: ceil(gguf / node)
    need_gib: float  # weights + KV cache + recurrent state
    usable_gib_per_node: float  # node memory minus the reserve for OS and buffers


def rpc_sizing(
    gguf_gib: float = 539.0, node_gib: float = 121.0, reserve_gib: float = RESERVE_GIB,
    ctx: int = DEFAULT_CONTEXT
) -> RpcSizing:
    """How many `node_gib` machines hold a `gguf_gib` GGUF resident (weights + cache)."""
    if gguf_gib <= 0 or node_gib <= reserve_gib or reserve_gib < 0 or ctx <= 0:
        raise ValueError("need gguf_gib > 0, node_gib > reserve_gib >= 0 and ctx > 0")
    need = gguf_gib + cache_gib(ctx)
    usable = node_gib - reserve_gib
    return RpcSizing(
        nodes=math.ceil(need / usable),
        weights_only_nodes=math.ceil(gguf_gib / node_gib),
        need_gib=need,
        usable_gib_per_node=usable,
    )


def _rpc(
    gguf_gib: float = 539.0,
    node_gib: float = 121.0,
    reserve_gib: float = RESERVE_GIB,
    ctx: int = DEFAULT_CONTEXT,
    port: int = 50052,
) -> Recipe:
    s = rpc_sizing(gguf_gib, node_gib, reserve_gib, ctx)
    workers = s.nodes - 1
    rpc_list = ",".join(f"<node{i}-ip>:{port}" for i in range(1, workers + 1))
    return Recipe(
        route="rpc",
        title=f"llama.cpp RPC: pool the memory of {s.nodes} machines for the GGUF",
        checked_against="llama.cpp llama-server / rpc-server `--help` (the skulk-llama-server-"
        "vulkan 0.10434.0 build installed with k3tui's test extras); Kimi-K3 "
        "GGUFs need a build with the `kimi-k3` architecture (b11434 has it)",
        sources=(
            "ggml-org/llama.cpp tools/rpc/README.md (rpc-server, --rpc, -c local cache)",
            "docs/reference/llama-server.md in k3tui's repository (flags of b11434; kimi-k3 "
            "support)",
        ),
        fit=(
            (
                f"GGUF {gguf_gib:g} GiB + KV cache and recurrent state for {ctx} tokens = "
                f"{s.need_gib:.1f} GiB to keep resident"
            ),
            (
                f"each machine has {node_gib:g} GiB; keeping {reserve_gib:g} GiB for the OS and "
                f"compute buffers leaves {s.usable_gib_per_node:g} GiB"
            ),
            (
                f"→ ceil({s.need_gib:.1f} / {s.usable_gib_per_node:g}) = {s.nodes} machines "
                f"(the weights alone need at least ceil({gguf_gib:g} / {node_gib:g}) = "
                f"{s.weights_only_nodes}): the head plus {workers} rpc-server nodes"
            ),
        ),
        steps=(
            Step(
                where=f"on each of the {workers} other machines (node1 … node{workers})",
                argv=("rpc-server", "--host", "<this-node-private-ip>", "--port", str(port), "-c"),
                why=(
                    (
                        "--host/--port: listen on the private cluster network only; rpc-server "
                        "has no authentication and no encryption"
                    ),
                    (
                        "-c: cache the tensors on local disk, so a restart does not resend "
                        f"~{gguf_gib / s.nodes:.0f} GiB over the network to every node"
                    ),
                ),
            ),
            Step(
                where="on the head machine (node0), which holds its own share of the layers",
                argv=(
                    "llama-server",
                    "-m",
                    "<dir>/Kimi-K3-<quant>-00001-of-000NN.gguf",
                    "--rpc",
                    rpc_list,
                    "-ngl",
                    "all",
                    "-c",
                    str(ctx),
                    "--host",
                    "0.0.0.0",
                    "--port",
                    "8080",
                    "--api-key-file",
                    "<file with one key>",
                    "-a",
                    "kimi-k3",
                ),
                why=(
                    "-m: the first shard; llama.cpp finds the others beside it",
                    (
                        "--rpc: every rpc-server; weights and KV cache are spread over the local "
                        "and remote devices in proportion to their free memory (-ts overrides)"
                    ),
                    "-ngl all: put every layer on a device, none left on the head's CPU",
                    "-c: the context; more context costs KV memory on every node",
                    ("--host 0.0.0.0 with --api-key-file: reachable by k3tui, never without a key"),
                ),
            ),
        ),
        notes=(
            (
                "Each token still passes through every machine in turn, so one answer is "
                "not faster than on one large machine; pooling buys residency (no NVMe "
                "reads per token), which is where a single DGX Spark loses its time."
            ),
            (
                "Connect the machines with their fastest link (a DGX Spark's ConnectX-7 "
                "QSFP ports); per-token latency grows with every network hop."
            ),
            (
                "Build rpc-server with -DGGML_RPC=ON and the node's GPU backend (CUDA on a "
                "DGX Spark); the binary in some wheels is named ggml-rpc-server."
            ),
        ),
        connect="k3tui setup → remote → http://<node0>:8080 with that key",
    )


def _sglang() -> Recipe:
    gpus = 16
    env = (
        "NCCL_MNNVL_ENABLE=1",
        "NCCL_CUMEM_ENABLE=1",
        "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0",
        "NCCL_SOCKET_IFNAME=<cluster-nic>",
        "GLOO_SOCKET_IFNAME=<cluster-nic>",
    )
    argv = (
        "sglang",
        "serve",
        "--model-path",
        "moonshotai/Kimi-K3",
        "--trust-remote-code",
        "--tp-size",
        "16",
        "--ep-size",
        "16",
        "--nnodes",
        "2",
        "--node-rank",
        "<0 on node0, 1 on node1>",
        "--dist-init-addr",
        "<node0-ip>:20000",
        "--moe-runner-backend",
        "marlin",
        "--decode-attention-backend",
        "flashmla",
        "--enable-symm-mem",
        "--mem-fraction-static",
        "0.85",
        "--reasoning-parser",
        "kimi_k3",
        "--tool-call-parser",
        "kimi_k3",
        "--host",
        "0.0.0.0",
        "--port",
        "30000",
        "--api-key",
        '"$KIMI_API_KEY"',
    )
    return Recipe(
        route="sglang",
        title="SGLang: the safetensors checkpoint on 2 nodes × 8 H200 (TP16 / EP16)",
        checked_against="sglang 0.5.23 (PyPI wheel; its server flags and the kimi_k3 "
        "parsers recorded in tests/k3tui/planning/data/sglang-0.5.23-flags.txt)",
        sources=(
            (
                "SGLang cookbook, Kimi-K3 page (docs/cookbook/autoregressive/Moonshotai/"
                "Kimi-K3.mdx) and its recipe table docs/src/snippets/configs/moonshotai/"
                "kimi-k3.jsx: the H200 2×8 Unified Low-Latency cell"
            ),
        ),
        fit=(
            (
                f"checkpoint {SAFETENSORS_GB / 1000:.2f} TB (MXFP4 experts) over {gpus} × "
                f"{H200_GB:g} GB = {gpus * H200_GB / 1000:.2f} TB of HBM: "
                f"{SAFETENSORS_GB / (gpus * H200_GB):.0%} for weights, the rest for the MLA KV "
                "pool and the KDA state pool"
            ),
        ),
        steps=(
            Step(
                where="on both nodes, the same command; only --node-rank differs",
                argv=argv,
                env=env,
                why=(
                    (
                        "--tp-size 16 --ep-size 16: one model over all 16 GPUs; attention "
                        "tensor-parallel, the 896 experts split 16 ways"
                    ),
                    (
                        "--nnodes/--node-rank/--dist-init-addr: the two nodes meet at "
                        "node0's address"
                    ),
                    (
                        "--moe-runner-backend marlin --decode-attention-backend flashmla: "
                        "the Hopper kernels the cookbook pins for H200"
                    ),
                    ("--mem-fraction-static 0.85: share of GPU memory for weights + caches"),
                    (
                        "--reasoning-parser/--tool-call-parser kimi_k3: thinking arrives "
                        "as reasoning_content, which k3tui's reasoning pane shows"
                    ),
                    (
                        "NCCL_*/GLOO_* variables: pin the cross-node NIC, as the cookbook "
                        "says for H200"
                    ),
                    (
                        "--api-key: the key clients must send (SGLang takes it only as a "
                        "flag, so it shows in the node's process list: keep the nodes "
                        "dedicated)"
                    ),
                ),
            ),
        ),
        notes=(
            (
                "The cookbook marks this cell 'final verification in progress'; B200/B300/"
                "GB200 recipes differ (PP2 × TP8, DCP) — take them from the same page."
            ),
            (
                "Throughput shapes (DP attention, EP32 over 4 nodes) raise the users per "
                "cluster, not the speed of one answer."
            ),
        ),
        connect="k3tui setup → remote → http://<node0>:30000 with $KIMI_API_KEY",
    )


def _vllm() -> Recipe:
    nodes, gpus = 4, 32
    common = (
        "--trust-remote-code",
        "--served-model-name",
        "kimi-k3",
        "--tensor-parallel-size",
        "8",
        "--pipeline-parallel-size",
        "4",
        "--distributed-executor-backend",
        "mp",
        "--nnodes",
        str(nodes),
    )
    def node(rank: str) -> tuple[str, ...]:
        """Every node runs the same serve command; only its rank differs."""
        return (
            "vllm",
            "serve",
            "moonshotai/Kimi-K3",
            *common,
            "--node-rank",
            rank,
            "--master-addr",
            "<node0-ip>",
            "--master-port",
            "29501",
            "--gpu-memory-utilization",
            "0.85",
        )

    head = (
        *node("0"),
        "--reasoning-parser",
        "kimi_k3",
        "--tool-call-parser",
        "kimi_k3",
        "--enable-auto-tool-choice",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    )
    worker = (*node("<1, 2 or 3>"), "--headless")
    return Recipe(
        route="vllm",
        title="vLLM: the safetensors checkpoint on 4 nodes × 8 H200 (TP8 × PP4)",
        checked_against="vllm 0.33.0 (PyPI wheel; registers KimiK3ForConditionalGeneration; "
        "flags and kimi_k3 parsers recorded in tests/k3tui/planning/data/"
        "vllm-0.33.0-flags.txt)",
        sources=(
            (
                "NVIDIA Dynamo recipe recipes/kimi-k3/vllm/agg-h200-agentic/deploy.yaml "
                "(TP8 × PP4 over 4 H200 nodes, mp executor, kimi_k3 parsers)"
            ),
            (
                "vLLM 0.33.0 `vllm serve`: --nnodes/--node-rank/--master-addr for multi-node "
                "without Ray; --headless runs the workers of nodes 1…N-1"
            ),
        ),
        fit=(
            (
                f"checkpoint {SAFETENSORS_GB / 1000:.2f} TB over {gpus} × {H200_GB:g} GB = "
                f"{gpus * H200_GB / 1000:.2f} TB of HBM ({SAFETENSORS_GB / (gpus * H200_GB):.0%}"
                " for weights); the Dynamo recipe spends the rest on a bf16 KV cache for up to "
                "256 sequences"
            ),
        ),
        steps=(
            Step(
                where="on node0 (serves the API)",
                argv=head,
                env=('VLLM_API_KEY="$KIMI_API_KEY"',),
                why=(
                    (
                        "VLLM_API_KEY: the key clients must send; from the environment, so it "
                        "does not show in the process list"
                    ),
                    (
                        "--tensor-parallel-size 8: one node's 8 GPUs split each layer "
                        "(NVLink inside the node)"
                    ),
                    (
                        "--pipeline-parallel-size 4: the 93 layers in 4 stages, one per node "
                        "(only activations cross the network)"
                    ),
                    (
                        "--distributed-executor-backend mp --nnodes 4 --node-rank "
                        "--master-addr/--master-port: multi-node without a Ray cluster"
                    ),
                    (
                        "--reasoning-parser/--tool-call-parser kimi_k3: reasoning_content "
                        "and tool calls split out of K3's output"
                    ),
                    "--gpu-memory-utilization 0.85: headroom as in the Dynamo recipe",
                ),
            ),
            Step(
                where="on node1, node2 and node3",
                argv=worker,
                why=("--headless: workers only; node0's API server drives them",),
            ),
        ),
        notes=(
            (
                "The Dynamo recipe was brought up on a vLLM nightly (0.26.1rc1.dev602); "
                "0.33.0 is the first release checked here that registers Kimi-K3."
            ),
            (
                "Pipeline stages add a hop per stage to every token; they buy memory and "
                "concurrency, not a faster single answer."
            ),
        ),
        connect="k3tui setup → remote → http://<node0>:8000 with $KIMI_API_KEY",
    )


_BUILDERS = {"rpc": _rpc, "sglang": _sglang, "vllm": _vllm}


def recipe(route: str, **params: float) -> Recipe:
    if route not in _BUILDERS:
        raise ValueError(f"unknown route {route!r}; choose one of {', '.join(ROUTES)}")
    return _BUILDERS[route](**params)


def summary(route: str) -> str:
    r = recipe(route)
    return r.title


def render(route: str, **params: float) -> str:
    """The recipe as text a person can follow: fit, commands, why each flag, how to connect."""
    r = recipe(route, **params)
    lines = [r.title, "=" * len(r.title), "", "Does it fit:"]
    for line in r.fit:
        lines += textwrap.wrap(line, 88, initial_indent="  ", subsequent_indent="    ")
    for n, step in enumerate(r.steps, 1):
        lines += ["", f"{n}. {step.where}:", step.shell(), "   why:"]
        for why in step.why:
            lines += textwrap.wrap(why, 88, initial_indent="   - ", subsequent_indent="     ")
    lines += ["", "Notes:"]
    for note in r.notes:
        lines += textwrap.wrap(note, 88, initial_indent="  - ", subsequent_indent="    ")
    lines += ["", f"Then connect: {r.connect}"]
    lines += textwrap.wrap(
        f"Flags checked against: {r.checked_against}", 88, subsequent_indent="  "
    )
    lines += textwrap.wrap("Sources: " + "; ".join(r.sources), 88, subsequent_indent="  ")
    return "\n".join(lines)
