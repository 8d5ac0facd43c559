"""One process of ``tests/test_hosts.py``: a host of a compile across processes, joined over loopback.

``python tests/hosts_child.py SCENARIO RANK WORLD PORT OUT MODE``: pins itself to one CPU (one socket per
process, never more busy threads than cores), joins the gloo group, compiles a tiny Llama with numatp on
its one socket and writes what it saw as JSON to ``OUT/RANK.json``. Scenarios:

- ``equal``: a forward and 8 greedy tokens, beside the eager model's; the cross-host collectives of one
  forward; the weight bytes this process holds (``placement_report``) and the plan's model bytes;
- ``kill``: process 1 kills itself (SIGKILL) after 3 forwards; process 0 calls until one fails and
  records the error and how long after its last good call it came;
- ``hang``: the same with SIGSTOP (a host that stops answering): the failure comes after ``host_timeout``;
- ``mismatch``: process 1 builds one layer more; both record the compile's error;
- ``shards``: ``equal`` on a model built with ``shards_only=True`` from the checkpoint the test saved
  (``NUMATP_TEST_CHECKPOINT``), reporting the elements this process read from it;
- ``sums``: :class:`numatp.runtime.hosts.Hosts` alone: each process's own tensors (small ones, summed by
  an exchange, and one over ``GATHER_BYTES``, by gloo's all-reduce) summed across the 2, with the expected
  sums and a digest of the results' bytes; then 40 sums whose sizes and dtypes change from one to the
  next; gloo's transport threads and numatp's waiting thread, and their scheduling policy;
- ``node`` (the multi-node guest): process R takes NUMA node R's socket (its CPUs, its memory, shards
  bound there strictly) instead of one CPU, and reports ``equal``'s facts with the pages per node.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback


def tiny_llama(layers: int = 2):
    """The model every process builds (seeded: the same weights in each), and the one the test saves."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=layers, vocab_size=256,
                                   max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval()


def main() -> None:
    scenario, rank, world, port, out, mode = sys.argv[1:7]
    rank, world = int(rank), int(world)
    topology = None
    if scenario == "node":
        from numatp.topology import Topology
        machine = Topology.detect()
        topology = Topology.detect(allowed_cpus=machine.sockets[rank].cpus)
        os.sched_setaffinity(0, topology.sockets[0].cpus)
    else:
        os.sched_setaffinity(0, {rank % os.cpu_count()})
    import torch
    import torch.distributed as dist
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    import numatp
    from numatp.backend import backend_of

    if scenario == "sums":
        _sums(rank, world, out)
    layers = 3 if scenario == "mismatch" and rank == 1 else 2
    model = tiny_llama(layers)
    compiled = model
    if scenario == "shards":   # the test saved `model` here: read this process's slices of it
        from numatp import zoo
        compiled = zoo.build(os.environ["NUMATP_TEST_CHECKPOINT"], shards_only=True)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    timeout = {"kill": 10.0, "hang": 4.0}.get(scenario, 60.0)
    fast = numatp.compile(compiled, sockets=topology or 1, mode=mode, host_timeout=timeout,
                          strict_placement=topology is not None)
    result: dict = {"rank": rank}
    try:
        if scenario in ("equal", "node", "shards"):
            with torch.no_grad():
                expected = model(ids, use_cache=False).logits
                got = fast(ids, use_cache=False).logits
                hosts = backend_of(fast).hosts
                before = hosts.performed
                again = fast(ids, use_cache=False).logits
                result["collectives_per_call"] = hosts.performed - before
            result["max_diff"] = float((got - expected).abs().max())
            result["repeat_equal"] = bool(torch.equal(got, again))
            plan = numatp.plans(fast)[0]
            result["plan_sockets"] = plan.sockets
            result["plan_reductions"] = plan.reductions
            result["plan_gathers"] = plan.gathers
            result["layers"] = layers
            result["model_bytes"] = plan.model_bytes
            result["replicated_bytes"] = plan.replicated_bytes
            report = numatp.placement_report(fast)
            result["held_bytes"] = sum(r["bytes"] for r in report["ranks"])
            first = sum(backend_of(fast).hosts.sockets[:rank])
            result["plan_bytes"] = sum(plan.socket_bytes(first + r) for r in range(len(report["ranks"])))
            result["pages"] = [{"node": r["node"], "pages": r["pages"]} for r in report["ranks"]]
            mask = torch.ones_like(ids)
            eager = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
            tokens = fast.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
            result["tokens"] = tokens.tolist()
            result["eager_tokens"] = eager.tolist()
            sources = getattr(compiled, "numatp_sources", None)
            if sources:
                result["read_elements"] = sum(src.read_elements for src in sources.values())
                result["model_elements"] = sum(p.numel() for p in model.parameters())
            sampled = fast.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, pad_token_id=0,
                                    generator=torch.Generator().manual_seed(100 + rank))
            result["sampled"] = sampled.tolist()
        elif scenario in ("kill", "hang"):
            with torch.no_grad():
                for call in range(1000):
                    if rank == 1 and call == 3:
                        os.kill(os.getpid(), signal.SIGKILL if scenario == "kill" else signal.SIGSTOP)
                    last = time.monotonic()
                    fast(ids, use_cache=False)
                    result["calls"] = call + 1
        else:
            with torch.no_grad():
                fast(ids, use_cache=False)
    except Exception as e:   # what the test asserts on
        result["error"] = f"{type(e).__name__}: {e}"
        result["error_type"] = type(e).__name__
        result["ranks"] = getattr(e, "ranks", None)
        if scenario in ("kill", "hang"):
            result["seconds_to_error"] = time.monotonic() - last
        result["traceback"] = traceback.format_exc()[-3000:]
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)   # a peer that died leaves the process group unable to shut down cleanly


def _sums(rank: int, world: int, out: str) -> None:
    import hashlib

    import torch
    import torch.distributed as dist

    from numatp.runtime.hosts import GATHER_BYTES, Hosts

    hosts = Hosts(dist.group.WORLD, 1, timeout=60.0)
    result: dict = {"rank": rank, "demoted": hosts.demoted, "loops": {}}
    large = GATHER_BYTES // 2   # elements: over GATHER_BYTES in either dtype once gathered from 2 processes
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 1024, 4096, large):
            name = f"{str(dtype).split('.')[-1]}-{n}"
            mine = [torch.randn(n, generator=torch.Generator().manual_seed(1000 * r + n)).to(dtype)
                    for r in range(world)]   # every process's, drawn alike everywhere
            t = mine[rank].clone()
            hosts.all_reduce(t)
            expected = torch.stack(mine).sum(0)
            result[name] = {"equal": bool(torch.equal(t, expected)),
                            "max_diff": float((t.float() - expected.float()).abs().max()),
                            "digest": hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()}
    # a run of exchanges whose sizes and dtypes change from one to the next (the receives posted one sum
    # ahead are as large as any exchange), one of them gloo's all-reduce
    run = []
    for i in range(40):
        dtype = (torch.float32, torch.bfloat16)[i % 2]
        n = large if i == 17 else 1 + (i * 977) % 5000
        mine = [torch.randn(n, generator=torch.Generator().manual_seed(7 * i + r)).to(dtype) for r in range(world)]
        t = mine[rank].clone()
        hosts.all_reduce(t)
        run.append(bool(torch.equal(t, torch.stack(mine).sum(0))))
    result["run"] = run
    result["awake"] = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        if name.startswith("gloo_tcp_loop"):
            result["loops"][tid] = os.sched_getscheduler(int(tid)) == os.SCHED_IDLE
        if name == "numatp-awake":
            result["awake"][tid] = os.sched_getscheduler(int(tid)) == os.SCHED_IDLE
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
