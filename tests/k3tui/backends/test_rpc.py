"""The RPC handshake k3tui speaks to pool workers, against workers of other builds and
workers that misbehave (a fake server: the one build installed here cannot be another),
the addresses a worker may listen on, and what a head's log and sockets say."""

from __future__ import annotations

import socket

import pytest
from llama_helpers import FakeWorker, refused_port

from k3tui.backends.llama import rpc
from k3tui.errors import K3Error
from k3tui.units import GiB


@pytest.fixture
def fake():
    made = []

    def make(**kw):
        made.append(FakeWorker(**kw))
        return made[-1]

    yield make
    for worker in made:
        worker.close()


def test_rpc_probe_reads_the_version_and_the_memory(fake):
    worker = fake()
    status = rpc.probe(worker.endpoint)
    assert status.ok and status.version == (5, 0, 0)
    assert (status.devices, status.free_bytes, status.total_bytes) == (1, 32 * GiB, 64 * GiB)
    assert status.mismatch((5, 0, 0)) is None


def test_rpc_worker_of_an_older_protocol_answers_the_second_hello(fake):
    worker = fake(version=(3, 0, 0), hello_size=0)
    status = rpc.probe(worker.endpoint)
    assert worker.hellos == [24, 0]  # it hung up on protocol 5's hello, answered the old one
    assert status.ok and status.version == (3, 0, 0)
    assert "speaks RPC protocol 3.0.0 but the head speaks 5.0.0" in status.mismatch((5, 0, 0))


def test_rpc_worker_of_another_build_is_refused_before_any_weights_move(fake):
    same, other = fake(), fake(version=(5, 1, 0))
    with pytest.raises(K3Error) as exc:
        rpc.check_pool([same.endpoint, other.endpoint], head_protocol=(5, 0, 0),
                       model_bytes=GiB, ctx=4096, n_layers=8, head_free_bytes=None)
    assert f"worker {other.endpoint} speaks RPC protocol 5.1.0" in exc.value.message
    assert same.endpoint not in exc.value.message
    # the check only asked: one hello, one device count and memory, per worker
    assert (same.hellos, other.hellos) == ([24], [24])


def test_rpc_silent_worker_is_busy_within_the_timeout(fake):
    worker = fake(silent=True)
    status = rpc.probe(worker.endpoint, timeout_s=0.3)
    assert status.state == "busy" and "within 0.3 s" in status.detail
    assert "serving another head" in status.detail


def test_rpc_refused_garbage_and_unresolvable_each_say_why(fake):
    with refused_port() as port:
        refused = rpc.probe(f"127.0.0.1:{port}")
    assert refused.state == "refused" and "no worker listens" in refused.detail
    garbage = rpc.probe(fake(garbage=True).endpoint)
    assert garbage.state == "not-rpc"
    assert rpc.probe("no-such-host.invalid:50052").state == "unresolved"


def test_rpc_pool_check_names_every_missing_worker_at_once(fake):
    worker = fake()
    with refused_port() as a, refused_port() as b:
        with pytest.raises(K3Error) as exc:
            rpc.check_pool([f"127.0.0.1:{a}", worker.endpoint, f"127.0.0.1:{b}"],
                           head_protocol=(5, 0, 0), model_bytes=GiB, ctx=4096, n_layers=8,
                           head_free_bytes=None)
    message = exc.value.message
    assert f"127.0.0.1:{a} refused" in message and f"127.0.0.1:{b} refused" in message
    assert worker.endpoint not in message
    assert "`k3tui worker`" in exc.value.next_step


def test_rpc_pool_check_splits_the_layers_as_llama_cpp_deals_them(fake):
    a, b = fake(memory=64 * GiB), fake(memory=64 * GiB)
    checked = rpc.check_pool([a.endpoint, b.endpoint], head_protocol=(5, 0, 0),
                             model_bytes=GiB, ctx=4096, n_layers=8, head_free_bytes=None)
    # equal workers, 8 layers + the output layer dealt in order: 5 and 3 (the real head's
    # log with two equal workers: 75.02 and 45.74 MiB of a 15 MiB-a-layer model)
    assert f"{a.endpoint}: 5 of 8 layers" in "\n".join(checked.lines)
    assert f"{b.endpoint}: 3 of 8 layers" in "\n".join(checked.lines)


@pytest.mark.parametrize("host,refused", [
    ("0.0.0.0", "every address of this machine"),
    ("::", "every address of this machine"),
    ("8.8.8.8", "a public address"),
    ("224.0.0.1", "a public address"),
])
def test_rpc_worker_refuses_public_and_wildcard_addresses_saying_why(host, refused):
    why = rpc.bind_refusal(host)
    assert why == (f"A worker must not listen on {host} ({refused}): the RPC protocol has no "
                   "authentication, so anyone who reaches that port could fill the worker's "
                   "memory and run code on its devices")


@pytest.mark.parametrize("host,refused", [
    ("example.com", "is not an IP address"),
    ("::1", "IPv6"),
    ("10.254.253.252", "is not an address of this machine"),
])
def test_rpc_worker_refuses_names_ipv6_and_foreign_addresses(host, refused):
    assert refused in rpc.bind_refusal(host)


def test_rpc_worker_may_listen_on_loopback_and_its_own_private_address():
    assert rpc.bind_refusal("127.0.0.1") is None
    assert rpc.bind_refusal("localhost") is None
    private = [a for a in rpc.own_addresses() if not a.startswith("127.")]
    for address in private:
        assert rpc.bind_refusal(address) is None


LOADED = """\
0.00.105.865 I llama_prepare_model_devices: using device RPC0 (127.0.0.1:51031) (unknown id)
0.00.129.084 I load_tensors: RPC0[127.0.0.1:51031] model buffer size =    75.02 MiB
0.00.129.098 I load_tensors: RPC0[127.0.0.1:51032] model buffer size =    45.74 MiB
0.01.148.398 I llama_kv_cache: RPC0[127.0.0.1:51031] KV buffer size =    40.00 MiB
0.01.340.621 I llama_kv_cache: RPC0[127.0.0.1:51032] KV buffer size =    24.00 MiB
0.01.457.046 I sched_reserve: RPC0[127.0.0.1:51031] compute buffer size =    23.01 MiB
0.01.457.049 I sched_reserve:        CPU compute buffer size =     6.01 MiB
"""


def test_rpc_placement_and_dropped_workers_are_read_from_the_heads_log():
    held = rpc.placement(LOADED)
    assert held == {"127.0.0.1:51031": int(75.02 * 2**20) + 40 * 2**20 + int(23.01 * 2**20),
                    "127.0.0.1:51032": int(45.74 * 2**20) + 24 * 2**20}
    log = "0.00.045.570 E Failed to connect to 127.0.0.1:51001\n" + LOADED
    assert rpc.dropped(log, ["127.0.0.1:51001", "127.0.0.1:51031"]) == ["127.0.0.1:51001"]


def test_rpc_connected_sees_the_connections_this_process_holds(fake):
    up, down = fake(), fake()
    with socket.create_connection(("127.0.0.1", int(up.endpoint.split(":")[1]))):
        import os

        assert rpc.connected(os.getpid(), [up.endpoint, down.endpoint]) == {up.endpoint}


def test_rpc_pool_story_names_the_worker_that_is_gone(fake):
    alive = fake()
    with refused_port() as port:
        story = rpc.pool_story([alive.endpoint, f"127.0.0.1:{port}"])
    assert story.startswith(f"; worker 127.0.0.1:{port} is gone: it refused the connection")
    assert alive.endpoint not in story
