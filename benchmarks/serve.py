"""``numatp serve`` under load: 1, 2, 4, 8 and 16 concurrent streams, beside ``numatp generate`` and llama-server.

Starts ``numatp serve MODEL`` (or uses ``--url``), then for each concurrency N runs N clients, each sending
``--requests`` streamed completions one after another (a closed loop; ``--arrival RATE`` instead spaces
each client's requests by exponential gaps of mean 1/RATE seconds): a random prompt of ``--prompt`` token
ids, ``--new-tokens`` tokens, greedy, EOS ignored. Reported per N: aggregate generated tokens/s (all
tokens over the level's wall time), time to first token and inter-token latency p50/p99 (the gaps between
streamed tokens). ``--generate`` also runs ``numatp generate`` for one stream (its decode tokens/s);
``--llama-server PATH --gguf FILE`` runs the same load against llama-server with as many slots as
``--max-batch`` and ``--threads`` threads. JSON lines on stdout, a table on stderr.

    python benchmarks/serve.py /work/gguf/hf-gpt2-medium --dtype bfloat16 --sockets 2 --max-batch 8 \\
        --prompt 128 --new-tokens 64 --generate --llama-server /work/llamacpp/build/bin/llama-server \\
        --gguf /work/gguf/gpt2-medium-bf16.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before serving")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url} did not come up in {timeout:.0f}s")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def _one(url: str, model: str, prompt: list[int], new: int, out: dict) -> None:
    """One streamed completion, read with the standard library's ``http.client`` line by line: the client
    shares the machine with the server, and httpx's streaming took about 1.3 ms of CPU per token here
    (13% of a core at 8 streams), time the server's threads then lack; this reader takes a fraction of it."""
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    t0 = time.perf_counter()
    stamps: list[tuple[float, int]] = []
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            out["error"] = f"{r.status} {r.read()[:200]!r}"
            return
        while True:
            line = r.readline()
            if not line:
                break
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            choices = chunk.get("choices") or []
            if not choices:
                continue
            n = len(choices[0].get("token_ids") or []) or (1 if choices[0].get("text") else 0)
            if n:
                stamps.append((time.perf_counter(), n))
    finally:
        conn.close()
    if not stamps:
        out["error"] = "no tokens"
        return
    out["ttft"] = stamps[0][0] - t0
    out["tokens"] = sum(n for _, n in stamps)
    out["itl"] = [(b - a) / n for (a, _), (b, n) in zip(stamps, stamps[1:])]


def run_level(url: str, model: str, streams: int, args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(streams)
    results: list[dict] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        crng = random.Random(1000 * streams + k)
        for _ in range(args.requests):
            if args.arrival:
                time.sleep(crng.expovariate(args.arrival))
            prompt = [crng.randrange(vocab) for _ in range(args.prompt)]
            out: dict = {}
            _one(url, model, prompt, args.new_tokens, out)
            with lock:
                results.append(out)

    _one(url, model, [rng.randrange(vocab) for _ in range(args.prompt)], 4, {})   # warm-up
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    return {"streams": streams, "requests": len(results), "errors": len(results) - len(ok),
            "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1e3 * _pct(ttft, 50), "ttft_p99_ms": 1e3 * _pct(ttft, 99),
            "itl_p50_ms": 1e3 * _pct(itl, 50), "itl_p99_ms": 1e3 * _pct(itl, 99)}


def _generate_baseline(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "numatp", "generate", args.model, "--prompt-len", str(args.prompt),
           "--new-tokens", str(args.new_tokens), "--dtype", args.dtype]
    if args.sockets:
        cmd += ["--sockets", str(args.sockets)]
    if args.tiny:
        cmd.append("--tiny")
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC})
    m = re.search(r"^numatp \d+ sockets\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", r.stdout, re.MULTILINE)
    if not m:
        return {"error": (r.stdout + r.stderr)[-500:]}
    return {"ttft_ms": float(m.group(1)), "decode_tokens_per_s": float(m.group(2)), "ms_per_token": float(m.group(3))}


def _levels(name: str, url: str, model: str, args: argparse.Namespace, vocab: int) -> list[dict]:
    rows = []
    for n in args.streams:
        row = {"server": name, **run_level(url, model, n, args, vocab)}
        print(json.dumps(row), flush=True)
        print(f"{name:<14} {n:>3} streams: {row['tokens_per_s']:8.1f} tok/s  TTFT p50 {row['ttft_p50_ms']:7.1f} "
              f"p99 {row['ttft_p99_ms']:7.1f} ms  ITL p50 {row['itl_p50_ms']:6.1f} p99 {row['itl_p99_ms']:6.1f} ms"
              f"{'  errors ' + str(row['errors']) if row['errors'] else ''}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="preset or checkpoint folder for numatp serve")
    p.add_argument("--url", default=None, help="an already running numatp serve (skips starting one)")
    p.add_argument("--sockets", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--weights", default=None)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--max-len", type=int, default=None, help="default: prompt + new tokens")
    p.add_argument("--cache-len", type=int, default=None, help="numatp serve --cache-len")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--mode", default=None, help="numatp serve --mode (eager: a quick check of this script)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=2, help="requests per client at each level (default 2)")
    p.add_argument("--arrival", type=float, default=None, help="random arrival: requests/s per client")
    p.add_argument("--generate", action="store_true", help="also time `numatp generate` for one stream")
    p.add_argument("--llama-server", default=None, help="llama-server binary: the same load against it")
    p.add_argument("--gguf", default=None, help="the GGUF llama-server loads")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server threads")
    args = p.parse_args()
    if args.max_len is None:
        args.max_len = args.prompt + args.new_tokens

    from numatp import zoo

    info = zoo.describe(args.model, tiny=args.tiny)
    vocab = min(info["vocab"], 50000)
    print(f"uptime: {os.popen('uptime').read().strip()}", file=sys.stderr)
    procs = []
    try:
        if args.generate:
            row = {"server": "numatp generate", "streams": 1, **_generate_baseline(args)}
            print(json.dumps(row), flush=True)
            print(f"numatp generate  1 stream: {row}", file=sys.stderr, flush=True)
        url = args.url
        if url is None:
            port = _free_port()
            cmd = [sys.executable, "-m", "numatp", "serve", args.model, "--dtype", args.dtype, "--port", str(port),
                   "--max-batch", str(args.max_batch), "--max-len", str(args.max_len),
                   "--max-queue", str(4 * max(args.streams))]
            for flag, value in (("--sockets", args.sockets), ("--weights", args.weights),
                                ("--cache-len", args.cache_len), ("--mode", args.mode)):
                if value is not None:
                    cmd += [flag, str(value)]
            if args.tiny:
                cmd.append("--tiny")
            procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": SRC}))
            url = f"http://127.0.0.1:{port}"
            _wait_up(url, procs[-1], 3600)
        import httpx

        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        _levels("numatp serve", url, model, args, vocab)
        if procs:
            procs[-1].terminate()
            procs[-1].wait(120)
        if args.llama_server:
            if not args.gguf:
                raise SystemExit("--llama-server needs --gguf FILE")
            port = _free_port()
            ctx = args.max_batch * (args.max_len + 16)
            procs.append(subprocess.Popen([args.llama_server, "-m", args.gguf, "--port", str(port), "-np",
                                           str(args.max_batch), "-c", str(ctx), "-t", str(args.threads),
                                           "--no-webui"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            url = f"http://127.0.0.1:{port}"
            _wait_up(url, procs[-1], 600)
            _levels("llama-server", url, httpx.get(url + "/v1/models").json()["data"][0]["id"], args, vocab)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
