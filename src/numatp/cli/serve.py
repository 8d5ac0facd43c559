"""``numatp serve``: an OpenAI-compatible HTTP server over a model compiled by numatp (``numatp[serve]``).

Builds MODEL (a preset with random weights, served as token ids, or a checkpoint folder, with its
tokenizer where it has one), compiles it with numatp, compiles the engine's programs (a prefill chunk, a
long chunk and a decode step of ``--max-batch`` slots, and the same for one slot's row), then serves
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health`` and ``/metrics`` with uvicorn
until SIGTERM or Ctrl-C (requests in flight are finished, for up to ``--shutdown-timeout`` seconds, then
cancelled). See docs/serve.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any

from numatp.cli._weights import add_weight_args, check_weight_args

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with continuous batching (needs numatp[serve])",
        description="Serve MODEL over HTTP with OpenAI's API (/v1/completions, /v1/chat/completions, streaming, "
        "/v1/models, /health, /metrics). Up to --max-batch requests share every decode step, each in a slot "
        "of the sockets' static KV cache; more wait in a queue of --max-queue, beyond which requests get 429. "
        "Needs the serve extra: pip install 'numatp[serve]'.")
    p.add_argument("model", help="preset (random weights; prompts as token ids) or checkpoint folder")
    p.add_argument("--sockets", type=int, default=None,
                   help="socket count (default: the detected sockets, or 2 virtual ones on a one-node machine)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16", help="weight dtype (default bf16)")
    add_weight_args(p)
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (slots; default 8)")
    p.add_argument("--max-len", type=int, default=1024,
                   help="tokens per request, prompt + max_tokens (the context; default 1024, at most the model's)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait beyond the busy slots before 429 (default 64)")
    p.add_argument("--cache-len", type=int, default=None,
                   help="KV cache positions per slot (default --max-len + --chunk); more means fewer cache resets, "
                   "since every prompt that joins advances the shared position by its length")
    p.add_argument("--chunk", type=int, default=32, help="prefill chunk length in tokens (default 32)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the checkpoint's own, if any)")
    p.add_argument("--served-name", default=None, help="the model's name in the API (default: MODEL as given)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds to finish requests in flight after SIGTERM before cancelling them (default 30)")
    p.add_argument("--mode", choices=("inductor", "eager"), default="inductor",
                   help="numatp.compile's mode: eager skips Inductor (debugging, tests)")
    p.add_argument("--tiny", action="store_true", help="use the preset's shrunken test config")
    p.set_defaults(run=run)
    return p


def _say(msg: str) -> None:
    print(f"[numatp serve] {msg}", file=sys.stderr, flush=True)


def _check_args(args: argparse.Namespace) -> None:
    from numatp import zoo
    from numatp.serve import MISSING_EXTRA

    for flag, value, rule in (("--max-batch", args.max_batch, 1), ("--max-len", args.max_len, 2),
                              ("--chunk", args.chunk, 1), ("--sockets", args.sockets, 1),
                              ("--max-queue", args.max_queue, 0), ("--port", args.port, 1)):
        if value is not None and value < rule:
            raise SystemExit(f"numatp serve: {flag} {value}: must be >= {rule}")
    check_weight_args("serve", args)
    if args.port > 65535:
        raise SystemExit(f"numatp serve: --port {args.port}: must be at most 65535")
    source = zoo.resolve(args.model)
    if source.folder is not None and args.tiny:
        raise SystemExit(f"numatp serve: --tiny shrinks presets only, and {args.model!r} is a checkpoint folder; "
                         "drop --tiny")
    if not _installed("fastapi") or not _installed("uvicorn"):
        raise SystemExit(f"numatp serve: {MISSING_EXTRA.removeprefix('numatp serve ')}")


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:   # in sys.modules as None: blocked
        return False


def run(args: argparse.Namespace) -> int:
    _check_args(args)

    import logging
    import warnings

    import torch
    import uvicorn

    import numatp
    from numatp import zoo
    from numatp.bench.machine import resolve_ranks
    from numatp.serve.app import create_app
    from numatp.serve.engine import Engine
    from numatp.topology import Topology

    warnings.filterwarnings("ignore", message="numatp: virtual sockets")
    logging.getLogger("numatp").setLevel(logging.INFO)
    if not zoo.can_generate(args.model, tiny=args.tiny):
        raise SystemExit(f"numatp serve: {args.model!r} is an encoder (a masked LM), which does not generate text; "
                         "pass a decoder")
    source = zoo.resolve(args.model)
    tokenizer = None
    folder = args.tokenizer or (str(source.folder) if source.folder is not None else None)
    if folder is not None:
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as e:
            if args.tokenizer is not None:
                raise SystemExit(f"numatp serve: --tokenizer {args.tokenizer}: does not load: {e}") from e
            _say(f"{folder} has no tokenizer that loads ({type(e).__name__}); serving token ids only")
    topo = resolve_ranks(args.sockets, Topology.detect())
    _say(f"building {args.model} ({'tiny, ' if args.tiny else ''}{args.dtype})")
    model = zoo.build(args.model, tiny=args.tiny, dtype=getattr(torch, args.dtype))
    fast = numatp.compile(model, sockets=topo, weights=args.weights, keep_head=args.keep_head, mode=args.mode)
    pad = tokenizer.pad_token_id if tokenizer is not None else None
    # this process compiles this one model alone: the engine's forwards may skip Dynamo's guards after its
    # warm-up (measured, gpt2-medium bf16 on 2 virtual sockets, one stream: 1.9 ms a step with them)
    engine = Engine(fast, max_batch=args.max_batch, max_len=args.max_len, chunk=args.chunk,
                    cache_len=args.cache_len, max_queue=args.max_queue, pad_token_id=pad, skip_guards=True)
    widths = ", and the same at width 1 (one slot's row: a lone stream, a join of few)," if args.max_batch > 1 else ""
    _say(f"compiling the prefill {engine.chunks_said()} and the decode step ({args.max_batch}, 1){widths} on "
         f"{topo.num_sockets} sockets")
    engine.start()
    _say("Dynamo's guards: " + ("skipped after the warm-up (this process compiles nothing else)"
                                if engine.guards_skipped else
                                "checked at every step (the warm-up's second pass compiled again)"))
    name = args.served_name or args.model
    app = create_app(engine, model_name=name, tokenizer=tokenizer)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=int(args.shutdown_timeout))
    server = _server_class(uvicorn)(config)
    _say(f"serving {name!r} ({'text and token ids' if tokenizer is not None else 'token ids: no tokenizer'}) "
         f"on http://{args.host}:{args.port} with {args.max_batch} slots of {args.max_len} tokens")
    server.run()
    engine.stop(timeout=args.shutdown_timeout)
    _say(f"stopped after {engine.forwards} forwards, {engine.replayed} of them past Dynamo (numatp's graphs "
         "called directly)")
    return 0


def _server_class(uvicorn: Any) -> Any:
    """uvicorn's Server, except that SIGTERM and SIGINT end it without being raised again afterwards (uvicorn
    re-raises them once shut down, so the process would die by the signal): the engine is stopped after it,
    and a graceful stop exits 0."""
    import contextlib
    import signal
    import threading

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            saved = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in saved.items():
                    signal.signal(sig, handler)

    return Server
