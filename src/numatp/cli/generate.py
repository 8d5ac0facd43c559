"""``numatp generate``: generate tokens with a model compiled by numatp; time to first token, decode speed.

A preset is built with random weights and fed a random prompt of ``--prompt-len`` tokens; a checkpoint
folder with a tokenizer takes ``--prompt`` text and prints the generated text. ``--baseline`` also runs
``torch.compile`` (Inductor, the same static cache and the same loop) so that the two speeds sit side by
side; greedy tokens of both are checked against each other.
"""

from __future__ import annotations

import argparse
import sys
import time

from numatp.cli._launch import join_launcher, machine
from numatp.cli._weights import add_weight_args, check_weight_args, socket_bytes_line

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate", help="generate tokens through NUMA-TP: time to first token and decode tokens/s",
        description="Compile MODEL with numatp and generate: the prompt and every decode step run as socket "
        "programs, each socket holding its own heads of the KV cache. Prints the time to first token and "
        "the decode speed, and the text where MODEL is a checkpoint folder with a tokenizer.")
    p.add_argument("model", help="preset (random weights) or checkpoint folder")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs a checkpoint folder with a tokenizer)")
    src.add_argument("--prompt-len", type=int, default=None,
                     help="a random prompt of this many tokens (default 128 for a preset)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--prompt-bucket", type=int, default=None,
                   help="left-pad (masked) the prompt to a multiple of this many tokens, so that nearby "
                   "prompt lengths share one compiled program (default 32; 1 runs the prompt as given)")
    p.add_argument("--batch", type=int, default=1, help="prompts generated together (default 1)")
    p.add_argument("--sockets", type=int, default=None,
                   help="socket count (default: the detected sockets, or 2 virtual ones on a one-node machine)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weight dtype")
    add_weight_args(p)
    p.add_argument("--sample", action="store_true", help="sample (the model's generation config) instead of greedy")
    p.add_argument("--baseline", action="store_true",
                   help="also generate with torch.compile (same static cache and loop) and compare")
    p.add_argument("--first-token", action="store_true",
                   help="choose each weight's GEMM provider for the prompt alone (the fastest time to first "
                        "token) instead of for the prompt and the decode steps together (the least total time; "
                        "by default a weight may be held twice, packed for the prompt and as stored for the "
                        "steps, within a quarter of the available memory)")
    p.add_argument("--tiny", action="store_true", help="use the preset's shrunken test config (seconds, not minutes)")
    p.set_defaults(run=run)
    return p


_QUIET = [False]   # under torchrun, every process but the first


def _say(msg: str) -> None:
    if not _QUIET[0]:
        print(f"[numatp generate] {msg}", file=sys.stderr, flush=True)


# Files that carry a tokenizer's vocabulary: fast (tokenizer.json), sentencepiece, BPE and WordPiece ones.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                    "vocab.txt")


def _check_args(args: argparse.Namespace) -> str | None:
    """Refuse bad arguments before a model is built (names, paths and values before torch is even imported);
    returns the checkpoint folder that ``--prompt`` reads its tokenizer from (None without ``--prompt``)."""
    from numatp import zoo

    for flag, value, rule in (("--new-tokens", args.new_tokens, "must be >= 1"),
                              ("--batch", args.batch, "must be >= 1"),
                              ("--prompt-len", args.prompt_len, "must be >= 1"),
                              ("--prompt-bucket", args.prompt_bucket, "must be >= 1 (1 runs the prompt as given)"),
                              ("--sockets", args.sockets, "must be >= 1")):
        if value is not None and value < 1:
            raise SystemExit(f"numatp generate: {flag} {value}: {rule}")
    check_weight_args("generate", args)
    source = zoo.resolve(args.model)
    if source.folder is not None and args.tiny:
        raise SystemExit(f"numatp generate: --tiny shrinks presets only, and {args.model!r} is a checkpoint folder; "
                         "drop --tiny")
    if args.prompt is not None:
        if source.folder is None:
            raise SystemExit(f"numatp generate: --prompt needs a checkpoint folder with a tokenizer; {args.model!r} "
                             "is a preset (random weights, no tokenizer): use --prompt-len N")
        if not any((source.folder / f).is_file() for f in _TOKENIZER_FILES) and \
                not any(source.folder.glob("*.tiktoken")):
            raise SystemExit(f"numatp generate: --prompt needs a tokenizer, and {args.model} has no tokenizer files "
                             f"(none of {', '.join(_TOKENIZER_FILES)}); save one beside the model "
                             "(tokenizer.save_pretrained(folder)), or use --prompt-len N for a random prompt")
    if not zoo.can_generate(args.model, tiny=args.tiny):   # reads the config (imports transformers), builds nothing
        decoders = ", ".join(p for p in zoo.PRESETS if not p.startswith("bert"))
        raise SystemExit(f"numatp generate: {args.model!r} is an encoder (a masked LM), which does not generate "
                         f"text; pass a decoder ({decoders}) or use `numatp demo --model {args.model}` for its prefill")
    return None if args.prompt is None else str(source.folder)


def run(args: argparse.Namespace) -> int:
    folder = _check_args(args)
    launch = join_launcher("generate")
    _QUIET[0] = launch is not None and launch.quiet

    import warnings

    import torch

    import numatp
    from numatp import zoo
    from numatp.generate import generate_timed
    from numatp.bench.machine import resolve_ranks

    warnings.filterwarnings("ignore", message="numatp: virtual sockets")
    tokenizer = None
    if folder is not None:
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as e:
            raise SystemExit(f"numatp generate: the tokenizer in {args.model} does not load: {e}; "
                             "use --prompt-len N for a random prompt") from e
    topo = resolve_ranks(args.sockets, machine(launch))
    dtype = getattr(torch, args.dtype)
    _say(f"building {args.model} ({'tiny, ' if args.tiny else ''}{args.dtype})")
    # across processes each reads only its own shards, unless the baseline needs the whole model
    shards_only = launch is not None and not args.baseline
    model = zoo.build(args.model, tiny=args.tiny, dtype=dtype, shards_only=shards_only)
    if shards_only:
        _say("each process reads only its own shards of the weights (--baseline builds them whole)")
    if tokenizer is not None:
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        enc = tokenizer([args.prompt] * args.batch, return_tensors="pt", padding=True)
        ids, mask = enc["input_ids"], enc["attention_mask"]
    else:
        length = args.prompt_len or 128
        ids = torch.randint(0, model.config.vocab_size, (args.batch, length),
                            generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=args.new_tokens, do_sample=args.sample)
    if args.prompt_bucket is not None:
        kw["prompt_bucket"] = args.prompt_bucket
    if not args.sample:
        kw["pad_token_id"] = tokenizer.pad_token_id if tokenizer is not None else 0
    runs = []
    if args.baseline:
        runs.append(("torch.compile", torch.compile(model)))
    gemm = numatp.GemmOptions(first_token=True) if args.first_token else None
    hosts = f"{launch.world} processes x " if launch is not None else ""
    name = f"numatp {hosts}{topo.num_sockets} sockets" + (f" {args.weights}" if args.weights else "")
    runs.append((name, numatp.compile(model, sockets=topo, gemm=gemm, weights=args.weights,
                                      keep_head=args.keep_head)))
    results = {}
    for name, compiled in runs:
        _say(f"{name}: compiling the prompt and the decode step (first generation, untimed)")
        t0 = time.perf_counter()
        generate_timed(compiled, ids, mask, **kw)
        _say(f"{name}: compiled in {time.perf_counter() - t0:.1f}s; timing a second generation")
        results[name] = generate_timed(compiled, ids, mask, **kw)
    print(f"model: {args.model}{' (tiny)' if args.tiny else ''}, {args.dtype}, batch {args.batch}, "
          f"prompt {ids.shape[1]} tokens, {args.new_tokens} new tokens")
    print(f"{'mode':<28} {'first token ms':>15} {'decode tok/s':>13} {'ms/token':>9}")
    for name, g in results.items():
        per = 1e3 / g.decode_tokens_per_second if g.new_tokens > 1 else float("nan")
        print(f"{name:<28} {1e3 * g.prefill_seconds:>15.1f} {g.decode_tokens_per_second:>13.2f} {per:>9.2f}")
    print(socket_bytes_line(numatp.placement_report(runs[-1][1]), args.weights, args.keep_head, args.dtype,
                            sum(p.nbytes for p in model.parameters())))
    if args.baseline and not args.sample:
        (a, ga), (b, gb) = results.items()
        same = torch.equal(ga.sequences, gb.sequences)
        why = ("expected with quantized weights: torch.compile runs the model's own" if args.weights
               else "expected only within rounding in bf16")
        print(f"decode speedup numatp / torch.compile: "
              f"{gb.decode_tokens_per_second / ga.decode_tokens_per_second:.2f}x; greedy tokens "
              + ("identical" if same else f"differ ({why})"))
    g = results[runs[-1][0]]
    if tokenizer is not None:
        for row in g.sequences:
            print("---")
            print(tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=True))
    return 0
