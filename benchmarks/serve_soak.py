"""A soak of ``numatp serve``: many requests of random lengths from concurrent clients, some of which hang up
mid-stream; every completed response checked against the model's solo greedy output, the server's memory
followed.

Starts ``numatp serve MODEL`` (a preset, ``--tiny`` by default so that a thousand requests take minutes)
on a free port, then ``--clients`` threads send ``--requests`` streamed completions in all, each a random
prompt of token ids (1 to ``--max-prompt``) and a random ``max_tokens`` (1 to ``--max-new``), greedy, EOS
ignored; a ``--disconnect`` share of them closes its stream after its first chunk or few. Checked:

- every request that was not cut off completes (``finish_reason`` "length"), with exactly the tokens the
  same preset (same seeded weights, built here) generates for that prompt alone with transformers'
  ``generate`` (computed here, after the load);
- no request is lost or errs (a cut-off one is counted as such, not checked);
- the server process's resident memory (``VmRSS``) after warm-up (the first ``--clients`` requests) and
  every ``--every`` requests after: printed, with its growth from warm-up to the end.

Exit status 1 when a completed response differs, a request is lost or errs, or the server dies.

    python benchmarks/serve_soak.py gpt2 --requests 1000 --clients 16 --disconnect 0.1
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import subprocess
import sys
import threading
import time

from serve import SRC, _free_port, _wait_up


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _one(url: str, model: str, job: dict) -> dict:
    """Stream one completion; ``job["cut"]``: close the stream after that many chunks."""
    import httpx

    body = dict(model=model, prompt=job["prompt"], max_tokens=job["new"], temperature=0, stream=True,
                ignore_eos=True)
    tokens: list[int] = []
    finish = None
    chunks = 0
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                return {"status": r.status_code, "error": r.read().decode()[:200]}
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                tokens += choice.get("token_ids", [])
                finish = choice.get("finish_reason") or finish
                chunks += 1
                if job["cut"] is not None and chunks >= job["cut"]:
                    return {"status": 200, "cut": True, "tokens": tokens}
    except httpx.HTTPError as e:
        return {"status": None, "error": f"{type(e).__name__}: {e}"}
    return {"status": 200, "cut": False, "tokens": tokens, "finish": finish}


def _cache_kwargs(model, out) -> dict:
    """The cache of ``out`` as the model's forward names it (``cache`` from transformers 5.x on, else
    ``past_key_values``)."""
    import inspect

    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


def _greedy(model, prompt: list[int], new: int) -> list[int]:
    """``new`` greedy tokens after ``prompt``, EOS ignored (as the server's ``ignore_eos``)."""
    import torch

    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < new:
        out = model(torch.tensor([[tokens[-1]]]), use_cache=True, **_cache_kwargs(model, out))
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="gpt2", help="zoo preset (default gpt2)")
    p.add_argument("--full-size", action="store_true", help="the preset at full size (default: its --tiny twin)")
    p.add_argument("--sockets", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--disconnect", type=float, default=0.1, help="share of requests cut off mid-stream")
    p.add_argument("--max-prompt", type=int, default=60)
    p.add_argument("--max-new", type=int, default=60)
    p.add_argument("--every", type=int, default=100, help="sample the server's memory every this many requests")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.max_prompt + a.max_new > a.max_len:
        p.error(f"--max-prompt {a.max_prompt} + --max-new {a.max_new} exceeds --max-len {a.max_len}")

    import torch

    from numatp import zoo

    model = zoo.build(a.model, tiny=not a.full_size, dtype=getattr(torch, a.dtype))
    vocab = model.config.vocab_size
    rng = random.Random(a.seed)
    jobs = []
    for k in range(a.requests):
        n, new = rng.randint(1, a.max_prompt), rng.randint(1, a.max_new)
        cut = rng.randint(1, max(1, new - 1)) if new > 1 and rng.random() < a.disconnect else None
        jobs.append({"k": k, "prompt": [rng.randrange(2, vocab) for _ in range(n)], "new": new, "cut": cut})

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "numatp", "serve", a.model, "--dtype", a.dtype, "--sockets", str(a.sockets),
           "--max-batch", str(a.max_batch), "--max-len", str(a.max_len), "--port", str(port)]
    if not a.full_size:
        cmd.append("--tiny")
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": SRC})
    results: dict[int, dict] = {}
    memory: list[tuple[int, float]] = []
    try:
        _wait_up(url, server, 900)
        todo: queue.Queue = queue.Queue()
        for job in jobs:
            todo.put(job)
        lock = threading.Lock()
        t0 = time.perf_counter()

        def client() -> None:
            while True:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    return
                out = _one(url, a.model, job)
                with lock:
                    results[job["k"]] = out
                    done = len(results)
                    if done == a.clients or (done > a.clients and done % a.every == 0) or done == len(jobs):
                        memory.append((done, _rss_mb(server.pid)))
                        print(f"[soak] {done}/{len(jobs)} requests, server RSS {memory[-1][1]:.0f} MB",
                              file=sys.stderr, flush=True)

        threads = [threading.Thread(target=client) for _ in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        alive = server.poll() is None
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()

    print("[soak] checking the completed responses against solo greedy generation", file=sys.stderr, flush=True)
    wrong, errors, cut, complete = [], [], 0, 0
    with torch.inference_mode():
        for job in jobs:
            out = results.get(job["k"])
            if out is None or out.get("status") != 200:
                errors.append((job["k"], out))
                continue
            if out["cut"]:
                cut += 1
                continue
            if out["tokens"] != _greedy(model, job["prompt"], job["new"]) or out["finish"] != "length":
                wrong.append(job["k"])
            else:
                complete += 1
    grown = memory[-1][1] - memory[0][1] if len(memory) > 1 else float("nan")
    summary = {"requests": len(jobs), "clients": a.clients, "seconds": round(seconds, 1), "completed_equal": complete,
               "cut_off": cut, "wrong": len(wrong), "errors": len(errors), "server_alive": alive,
               "rss_mb": [(n, round(m)) for n, m in memory], "rss_growth_mb": round(grown, 1)}
    print(json.dumps(summary))
    for k, out in errors[:5]:
        print(f"[soak] request {k}: {out}", file=sys.stderr)
    if wrong:
        print(f"[soak] requests whose tokens differ from solo generation: {wrong[:20]}", file=sys.stderr)
    return 0 if not wrong and not errors and alive else 1


if __name__ == "__main__":
    sys.exit(main())
