"""More than one host: processes joined by torch.distributed (gloo, loopback), one socket each.

Each test starts 2 processes of ``tests/hosts_child.py`` (each pinned to one CPU, so never more busy
threads than cores) and asserts on what they report.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import numatp
from numatp.backend.core import NumaTPBackend
from numatp.plan.localize import Binding, LocalProgram, for_process
from numatp.plan.schema import Colwise, IndexSet, Replicate, Rowwise
from tests.helpers import shared_cpu_topology

pytestmark = pytest.mark.integration

CHILD = Path(__file__).with_name("hosts_child.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hosts(scenario: str, tmp_path: Path, mode: str = "eager", wait: float = 240.0, **env_vars: str) -> dict[int, dict]:
    """Run ``scenario`` in 2 processes; each rank's report (a rank that was killed has none)."""
    port = str(_port())
    # gloo picks its interface from the host name, which a minimal machine (the guest) may not resolve: loopback
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHILD.parent.parent / "src"), str(CHILD.parent.parent)]),
               GLOO_SOCKET_IFNAME="lo", **env_vars)
    procs = [subprocess.Popen([sys.executable, str(CHILD), scenario, str(r), "2", port, str(tmp_path), mode],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = []
    try:
        for r, p in enumerate(procs):
            try:
                logs.append(p.communicate(timeout=wait)[0])
            except subprocess.TimeoutExpired:
                if scenario != "hang" or r != 1:
                    raise
                p.send_signal(signal.SIGKILL)   # stopped on purpose; its peer has reported
                logs.append(p.communicate()[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = {}
    for r in range(2):
        f = tmp_path / f"{r}.json"
        if f.exists():
            out[r] = json.loads(f.read_text())
    assert out, "no process reported:\n" + "\n".join(log[-3000:] for log in logs)
    return out


def _equal(got: dict[int, dict]) -> None:
    assert set(got) == {0, 1}, got
    for r, d in got.items():
        assert "error" not in d, d.get("traceback")
        assert d["plan_sockets"] == 2   # the plan covers both processes' sockets
        assert d["max_diff"] < 1e-4, d["max_diff"]
        assert d["repeat_equal"]
        assert d["tokens"] == d["eager_tokens"], (r, d["tokens"], d["eager_tokens"])
        # one cross-host sum per reduction of the plan (2 per layer, 1 for the lookup) and one per gather
        assert d["plan_reductions"] == 2 * d["layers"] + 1 and d["plan_gathers"] == 1
        assert d["collectives_per_call"] == d["plan_reductions"] + d["plan_gathers"]
    # one process with both sockets holds every shard and a copy of the replicated weights per socket; each
    # of two is given its own socket's (what its store then holds depends on the GEMM providers measured:
    # a packed operand beside or in place of a shard; the bytes each process reads are asserted by
    # test_each_process_reads_only_its_slices_of_a_checkpoint)
    single = got[0]["model_bytes"] + got[0]["replicated_bytes"]
    assert got[0]["plan_bytes"] + got[1]["plan_bytes"] == single
    for d in got.values():
        assert d["plan_bytes"] <= 0.55 * single, (d["plan_bytes"], single)
    assert got[0]["sampled"] == got[1]["sampled"]   # each drew with its own seed; process 0's draw is used


def test_two_processes_match_eager_hold_half_the_weights_and_sample_alike(tmp_path):
    _equal(_hosts("equal", tmp_path))


@pytest.mark.slow
def test_two_processes_compiled_with_inductor_match_eager(tmp_path):
    _equal(_hosts("equal", tmp_path, mode="inductor"))


def test_cross_host_sums_are_the_same_bits_everywhere_by_exchange_and_by_all_reduce(tmp_path):
    got = _hosts("sums", tmp_path)
    assert set(got) == {0, 1}, got
    cases = [k for k in got[0] if "-" in k]
    assert len(cases) == 8   # fp32 and bf16: 3 sizes gathered, 1 all-reduced by gloo
    for k in cases:
        for d in got.values():
            assert d[k]["equal"], (k, d[k]["max_diff"])   # the sum in process order, to the bit
        assert got[0][k]["digest"] == got[1][k]["digest"], k
    for d in got.values():
        assert len(d["run"]) == 40 and all(d["run"]), d["run"]
        # the group's transport threads run only on an otherwise idle CPU (the default group's keep theirs),
        # and so does the thread that keeps the CPU awake while a sum waits
        assert d["demoted"] >= 1 and sum(d["loops"].values()) == d["demoted"], d["loops"]
        assert list(d["awake"].values()) == [True], d["awake"]


def test_each_process_reads_only_its_slices_of_a_checkpoint(tmp_path):
    from tests.hosts_child import tiny_llama
    tiny_llama().save_pretrained(tmp_path / "ckpt")   # the model the processes build, for them to read
    got = _hosts("shards", tmp_path, NUMATP_TEST_CHECKPOINT=str(tmp_path / "ckpt"))
    _equal(got)
    for d in got.values():
        # its shards and the replicated norms: about half of the checkpoint's elements, never all of it
        assert d["read_elements"] <= 0.55 * d["model_elements"], (d["read_elements"], d["model_elements"])
    assert got[0]["read_elements"] + got[1]["read_elements"] >= got[0]["model_elements"]


def test_a_killed_process_is_named_by_its_peer_within_the_timeout(tmp_path):
    got = _hosts("kill", tmp_path)
    assert 1 not in got   # killed before it could report
    d = got[0]
    assert d["calls"] == 3 and d["error_type"] == "HostFailure", d
    assert d["ranks"] == [1] and "process 1" in d["error"], d["error"]
    assert d["seconds_to_error"] <= 10 + 5   # host_timeout=10 in the child


@pytest.mark.slow
def test_a_process_that_stops_answering_is_named_after_the_timeout(tmp_path):
    got = _hosts("hang", tmp_path, wait=60)
    d = got[0]
    assert d["error_type"] == "HostFailure" and d["ranks"] == [1], d
    assert 4 <= d["seconds_to_error"] <= 4 + 5   # host_timeout=4 in the child


def test_processes_that_compile_different_models_fail_naming_the_difference(tmp_path):
    got = _hosts("mismatch", tmp_path)
    assert set(got) == {0, 1}
    for d in got.values():
        assert d["error_type"] == "HostMismatch", d
        assert "parameters" in d["error"] and "model.layers.2" in d["error"], d["error"]


def test_a_process_keeps_only_its_ranks_index_sets():
    halves = (IndexSet.range(0, 2), IndexSet.range(2, 4), IndexSet.range(4, 6), IndexSet.range(6, 8))
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    prog = LocalProgram(3, gm, [Binding(0, None), Binding(1, Replicate()), Binding(2, Colwise(0, halves)),
                                Binding(3, Rowwise(1, halves), state=True)])
    local = for_process(prog, 2, 2)
    assert local.rank == 1
    assert local.bindings[0].placement is None and local.bindings[1].placement == Replicate()
    assert local.bindings[2].placement == Colwise(0, halves[2:])
    assert local.bindings[3].placement == Rowwise(1, halves[2:]) and local.bindings[3].state
    with pytest.raises(ValueError, match="plan rank 3 is not one of this process's ranks 0 to 1"):
        for_process(prog, 0, 2)


@pytest.mark.parametrize("size,rank", [(2, 0), (2, 1), (3, 1), (3, 2)])
def test_a_cross_host_sum_posts_the_next_receives_before_it_waits_and_adds_in_process_order(size, rank):
    """The exchange's protocol, against a stand-in process group: each sum sends to every peer, posts the
    next sum's receives (into the other buffer) before it waits for its own (posted one sum ahead), and
    adds every process's part in process order; a sum over ``GATHER_BYTES`` goes to the all-reduce and
    leaves the posted receives for the next exchange. Peer ``p`` sends ``p + 1`` times what this process
    sends (in its dtype), so the sum is ``t`` times the sum of the factors, each part in its place."""
    from numatp.runtime.hosts import GATHER_BYTES, Hosts, _Awake, exchange_bytes

    events: list[tuple] = []
    sent: dict[int, torch.Tensor] = {}
    dtype = [torch.float32]

    class Work:
        def __init__(self, fill=None):
            self.fill = fill

        def wait(self):
            if self.fill is not None:
                self.fill()
                events.append(("waited", self.peer, self.row.data_ptr()))
            return True

    class Group:
        def send(self, ts, peer, tag):
            events.append(("send", peer))
            sent[peer] = ts[0].clone()
            return Work()

        def recv(self, ts, peer, tag):
            row = ts[0]
            events.append(("recv", peer, row.data_ptr()))

            def fill():   # the peer's message: (p + 1) times this process's last one, in the sum's dtype
                mine = sent[peer].view(dtype[0])
                theirs = ((peer + 1) * mine).view(torch.uint8)
                row[:theirs.numel()].copy_(theirs)
            w = Work(fill)
            w.peer, w.row = peer, row
            return w

        def allreduce(self, ts):
            events.append(("allreduce",))
            ts[0].mul_(sum(p + 1 if p != rank else 1 for p in range(size)))
            return Work()

    hosts = Hosts.__new__(Hosts)   # the collective's state only: no torch.distributed here
    hosts.size, hosts.rank, hosts.group = size, rank, Group()
    row = exchange_bytes(size)   # whole cache lines, as many as GATHER_BYTES gathered holds
    assert row % 64 == 0 and row * size <= GATHER_BYTES < (row + 64) * size
    hosts._rows = [torch.empty((size, row), dtype=torch.uint8) for _ in range(2)]
    hosts._turn, hosts._posted, hosts._exchange_lock = 0, None, threading.Lock()
    hosts.awake = _Awake(None)
    peers = [p for p in range(size) if p != rank]
    factor = 1 + sum(p + 1 for p in peers)
    # the last: as large as an exchange gets (a row, whole cache lines, of GATHER_BYTES / processes)
    for i, (n, dt) in enumerate([(4, torch.float32), (1024, torch.bfloat16), (3, torch.float32),
                                 (row // 4, torch.float32)]):
        dtype[0] = dt
        t = (torch.arange(n, dtype=torch.float32) + i).to(dt).reshape(1, 1, n)
        x = t.clone()
        del events[:]
        hosts._sum(x)
        parts = [t if p == rank else (p + 1) * t for p in range(size)]   # each in the sum's dtype
        want = parts[0] + parts[1]
        for part in parts[2:]:
            want = want + part   # rounded after each add, in process order
        assert torch.equal(x, want), (i, x, want)
        # send, post the next sum's receives, then wait for this sum's (the first sum posts its own first)
        P = len(peers)
        want = (["recv"] * P if i == 0 else []) + ["send"] * P + ["recv"] * P + ["waited"] * P
        assert [e[0] for e in events] == want
        posted = [e for e in events if e[0] == "recv"]
        waited = [e for e in events if e[0] == "waited"]
        this, other = hosts._rows[i % 2], hosts._rows[1 - i % 2]
        assert {e[2] for e in waited} == {this[p].data_ptr() for p in peers}
        assert {e[2] for e in posted[-len(peers):]} == {other[p].data_ptr() for p in peers}
    big = torch.ones(row // 4 + 1)   # one element more: gloo's all-reduce
    del events[:]
    hosts._sum(big)
    assert events == [("allreduce",)] and torch.equal(big, torch.full_like(big, float(factor)))
    posted_before = hosts._posted
    assert posted_before is not None and len(posted_before) == len(peers)   # still waiting for the next exchange


def test_bad_host_options_are_named():
    with pytest.raises(ValueError, match="process_group='world'"):
        numatp.compile(torch.nn.Linear(2, 2), process_group="world")
    with pytest.raises(ValueError, match="host_timeout=0"):
        numatp.compile(torch.nn.Linear(2, 2), host_timeout=0)

    class TwoHosts:
        size, sockets = 2, (1, 1)

        def agree(self, what, facts):
            pass

    with pytest.raises(ValueError, match="policy='auto' across 2 processes"):
        NumaTPBackend(shared_cpu_topology(1), policy="auto", hosts=TwoHosts())


@pytest.mark.slow
def test_numatp_generate_under_torchrun_matches_torch_compile_and_prints_once(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(CHILD.parent.parent / "src"), GLOO_SOCKET_IFNAME="lo")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "numatp", "generate", "llama", "--tiny", "--new-tokens", "6", "--prompt-len", "16",
                           "--baseline"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("processes: 2 (torch.distributed, gloo)") == 1, out   # process 1 prints nothing
    assert "numatp 2 processes x 1 sockets" in out, out
    assert "greedy tokens identical" in out, out
