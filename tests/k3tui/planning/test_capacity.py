"""Cluster sizing: the DGX Spark study's Table 8 from its inputs, the CLI, --from-bench."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from k3tui.planning import capacity
from k3tui.errors import K3Error

# Table 8 of the study: 50 users at 0.37 tok/s, 8 h/day, 70 % utilisation.
TABLE_8 = [("light", 5, 300, 11), ("moderate", 20, 500, 68), ("heavy", 50, 800, 269)]


@pytest.mark.parametrize("name,requests,tokens,machines", TABLE_8)
def test_rmt_table_8_exactly(name, requests, tokens, machines):
    assert capacity.machines_needed(50, requests, tokens, 0.37) == machines
    s = capacity.size(50, requests, tokens, 0.37)
    assert s.machines == machines
    assert s.latency_s == pytest.approx(tokens / 0.37)
    # The fleet is the smallest one that meets the target: one fewer would overload it.
    assert s.utilisation_at_machines <= 0.7 < s.exact_machines * 0.7 / (machines - 1)


def test_rmt_rounding_is_exact_at_a_whole_multiple():
    # 20160 machine-seconds is exactly one machine at 8 h × 70 %: float division would
    # give 1.0000000000000002 and round up to 2.
    assert capacity.machines_needed(1, 1, 20160 * 0.37, 0.37) == 1
    assert capacity.machines_needed(1, 3, 0.1 * 20160, 0.1) == 3
    assert capacity.machines_needed(1, 1, 1, 1000.0) == 1  # never zero machines


def test_rmt_latency_does_not_depend_on_fleet_size():
    small = capacity.size(1, 1, 500, 0.37)
    large = capacity.size(500, 50, 500, 0.37)
    assert large.machines > 100 * small.machines
    assert large.latency_s == small.latency_s == pytest.approx(1351.35, abs=0.01)


def test_rmt_power_and_storage_follow_the_machine_count():
    s = capacity.size(50, 20, 500, 0.37, watts=240, checkpoint_gb=1560)
    assert s.peak_kw == pytest.approx(68 * 0.240)
    assert s.kwh_per_day_max == pytest.approx(68 * 0.240 * 8)
    assert s.wh_per_answer == pytest.approx(240 * 500 / 0.37 / 3600)
    assert s.storage_tb == pytest.approx(68 * 1.56)


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "k3tui", "plan", *argv],
                          capture_output=True, text=True, timeout=60, check=False)


def test_rmt_cli_text_states_numbers_assumptions_and_why():
    out = _run("--users", "50", "--requests-per-user-day", "20", "--tokens-per-answer", "500",
               "--tok-per-s", "0.37")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "machines needed     68" in text
    assert "22 min 31 s" in text                       # 500 / 0.37 s
    assert "68 × 240 W (assumed" in text              # the power assumption is stated
    assert "106.1 TB" in text                          # 68 × 1.56 TB
    assert "do not make an answer faster" in text
    assert "rpc" in text and "sglang" in text and "vllm" in text  # the routes section


def test_rmt_cli_json_has_machines_and_latency():
    out = _run("--users", "50", "--requests-per-user-day", "50", "--tokens-per-answer", "800",
               "--tok-per-s", "0.37", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["machines"] == 269
    assert data["latency_s"] == pytest.approx(800 / 0.37)
    assert data["watts_per_machine"] == 240


def test_rmt_cli_bad_input_is_one_sentence_not_a_traceback():
    out = _run("--users", "50", "--requests-per-user-day", "5", "--tokens-per-answer", "300")
    assert out.returncode == 2
    assert "throughput" in out.stderr and "Traceback" not in out.stderr
    out = _run("--users", "0", "--requests-per-user-day", "5", "--tokens-per-answer", "300",
               "--tok-per-s", "0.37")
    assert out.returncode == 2 and "--users must be a positive number" in out.stderr
    out = _run("--users", "5", "--requests-per-user-day", "5", "--tokens-per-answer", "300",
               "--tok-per-s", "0.37", "--from-bench", "x.json")
    assert out.returncode == 2 and "Traceback" not in out.stderr


def test_rmt_from_bench_engine_json(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"bench": "stream", "budget_gb": 128,
                                 "s_per_token": 2.7027027027, "runs": [{"s_per_token": 9.0}]}))
    rate, where = capacity.throughput_from_bench(bench)
    assert rate == pytest.approx(0.37)
    assert "s_per_token" in where and "runs" not in where  # the top-level summary wins
    out = _run("--users", "50", "--requests-per-user-day", "20", "--tokens-per-answer", "500",
               "--from-bench", str(bench), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["machines"] == 68


def test_rmt_from_bench_llama_server_timings(tmp_path):
    # The final chunk of a real llama-server stream (docs/reference/llama-server.md).
    chunk = {"choices": [], "usage": {"completion_tokens": 16},
             "timings": {"predicted_n": 16, "predicted_ms": 3.724,
                         "predicted_per_token_ms": 0.24826, "predicted_per_second": 4027.9}}
    path = tmp_path / "timings.json"
    path.write_text(json.dumps(chunk))
    rate, where = capacity.throughput_from_bench(path)
    assert rate == pytest.approx(4027.9)
    assert where.endswith("timings.predicted_per_second = 4027.9")


def test_rmt_from_bench_refuses_files_without_a_rate(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"s_per_token": None, "other": 3}))
    with pytest.raises(K3Error, match="no throughput"):
        capacity.throughput_from_bench(path)
    path.write_text("not json")
    with pytest.raises(K3Error, match="not a JSON file"):
        capacity.throughput_from_bench(path)


def test_rmt_cli_recipe_alone_with_sizing_and_as_json():
    out = _run("--recipe", "rpc", "--node-gib", "64")
    assert out.returncode == 0, out.stderr
    assert "10 machines" in out.stdout and "rpc-server --host" in out.stdout
    out = _run("--recipe", "vllm", "--json")
    assert out.returncode == 0, out.stderr
    steps = json.loads(out.stdout)["recipe"]["steps"]
    assert steps[0]["argv"][:2] == ["vllm", "serve"] and "--headless" in steps[1]["argv"]
    out = _run("--users", "50", "--requests-per-user-day", "5", "--tokens-per-answer", "300",
               "--tok-per-s", "0.37", "--recipe", "sglang")
    assert out.returncode == 0 and "machines needed     11" in out.stdout
    assert "sglang serve" in out.stdout and "--tp-size 16" in out.stdout
    out = _run("--recipe", "rpc", "--node-gib", "4")
    assert out.returncode == 2 and "--node-gib" in out.stderr and "Traceback" not in out.stderr


def test_rmt_from_bench_real_engine_bench_stream_output():
    # Recorded from `python -m engine bench stream --checkpoint-gb 0.4 --tokens 3
    # --ladder max --no-pack --json` on this machine (a small synthetic checkpoint).
    path = Path(__file__).parent / "data" / "engine-bench-stream.json"
    data = json.loads(path.read_text())
    rate, where = capacity.throughput_from_bench(path)
    assert rate == pytest.approx(1 / data["s_per_token"])  # the headline, not a rung's
    assert where.startswith("engine-bench-stream.json: s_per_token")
