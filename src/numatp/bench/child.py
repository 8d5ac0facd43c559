"""Second stage of a benchmark child: one measurement, after ``numatp.bench.bootstrap`` has put the
process policy in place.

The sweep writes JOB (a JSON object: the config, the process policy, how to apply it, the ranks
topology) and reads RESULT back. Here: build the model, compile, time the first (compiling) call
apart, warm up, and time ``iters`` calls under ``torch.inference_mode()`` (the numatp modes with the
config's quantized ``weights``, if any). With ``decode`` N, then
generate N tokens after the prompt (:func:`numatp.generate.generate_timed`, static cache; the
baseline modes through ``torch.compile`` with the same loop): one untimed generation compiles, then
the median of three gives the time to first token and the decode tokens/s. ``weight_storage`` records how
the weights were stored and their bytes (per socket, for the numatp modes: ``placement_report``'s, quantized
shards at their quantized size). A crash or a hang is the sweep's to record.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from numatp.bench.machine import resolve_ranks
from numatp.bench.spec import NUMATP_MODES, Config
from numatp.topology import Topology

__all__ = ["run", "summarize"]


def summarize(times: list[float]) -> dict[str, float]:
    """Mean, median, sample standard deviation, coefficient of variation (stdev / mean), min and max
    of the timed calls, in seconds."""
    mean = statistics.fmean(times)
    stdev = statistics.stdev(times) if len(times) > 1 else 0.0
    return {
        "mean_s": mean,
        "median_s": statistics.median(times),
        "stdev_s": stdev,
        "cv": stdev / mean if mean > 0 else 0.0,
        "min_s": min(times),
        "max_s": max(times),
    }


def _weight_pages(model: Any) -> dict[str, int]:
    """Pages per node of the eager model's parameters: where a process policy put the weights."""
    from numatp import pages_by_node

    total: dict[str, int] = {}
    seen: set[int] = set()
    for param in model.parameters():
        if id(param) in seen:  # tied weights are one tensor
            continue
        seen.add(id(param))
        for node, pages in pages_by_node(param).items():
            total[str(node)] = total.get(str(node), 0) + int(pages)
    return total


def _weight_storage(config: Config, model: Any, placement: dict[str, Any] | None) -> dict[str, Any]:
    """How the measured weights were stored: ``format`` (the quantized format, or the model's dtype),
    ``head`` (the LM head's and the embedding tables' storage), ``model_bytes`` (the eager model's
    parameters, each once) and, for the numatp modes, ``socket_bytes``: the bytes of weights each socket
    holds as the compiled model stores them."""
    quantized = config.weights is not None
    return {"format": config.weights or config.dtype,
            "head": config.dtype if config.keep_head or not quantized else "int8",
            "model_bytes": sum(p.nbytes for p in model.parameters()),   # tied ones once
            "socket_bytes": [r["bytes"] for r in placement["ranks"]] if placement is not None else None}


def _ranks(ranks: dict[str, Any]) -> Topology:
    """The parent's ranks topology (``Topology.to_dict`` form) rebuilt here: the same virtual
    split of the same CPUs, or the same number of the machine's sockets."""
    if ranks["is_virtual"]:
        return Topology.virtual(sockets=len(ranks["sockets"]), cpus=ranks["allowed_cpus"])
    return resolve_ranks(len(ranks["sockets"]), Topology.detect())


def _measure(config: Config, ranks_dict: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    import numatp
    from numatp import zoo

    started = time.perf_counter()
    model = zoo.build(config.model, tiny=config.tiny, dtype=getattr(torch, config.dtype))
    inputs = zoo.example_inputs(model, batch=config.batch, seq=config.seq)
    build_s = time.perf_counter() - started

    with torch.inference_mode():
        started = time.perf_counter()
        compiled: Any
        if config.mode in NUMATP_MODES:
            compiled = numatp.compile(model, sockets=_ranks(ranks_dict),
                                      policy="always" if config.mode == "numatp" else "auto",
                                      weights=config.weights, keep_head=config.keep_head)
        else:
            compiled = torch.compile(model)
        compiled(**inputs)  # the first call compiles: timed apart from the steady state
        compile_s = time.perf_counter() - started
        for _ in range(config.warmup):
            compiled(**inputs)
        times = []
        for _ in range(config.iters):
            started = time.perf_counter()
            compiled(**inputs)
            times.append(time.perf_counter() - started)
        generation = _decode(compiled, inputs, config.decode) if config.decode else None
    placement = numatp.placement_report(compiled) if config.mode in NUMATP_MODES else None

    return {
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numatp": numatp.__version__,
        },
        "timing": {"build_s": build_s, "compile_s": compile_s, **summarize(times), "times_s": times},
        "generation": generation,
        "torch_threads": torch.get_num_threads(),
        "placement": placement,
        "weight_storage": _weight_storage(config, model, placement),
        "weight_pages": _weight_pages(model),
        # ru_maxrss is in KiB on Linux; compile workers are other processes and not counted here.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


_DECODE_RUNS = 3


def _decode(compiled: Any, inputs: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """Time to first token and decode tokens/s of ``new_tokens`` greedy tokens after the prompt, medians
    of ``_DECODE_RUNS`` generations after an untimed one."""
    from numatp.generate import generate_timed

    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    # no EOS: every generation makes all its tokens
    kw: dict[str, Any] = dict(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    generate_timed(compiled, ids, mask, **kw)
    runs = [generate_timed(compiled, ids, mask, **kw) for _ in range(_DECODE_RUNS)]
    return {"new_tokens": new_tokens,
            "first_token_s": statistics.median(g.prefill_seconds for g in runs),
            "tokens_per_s": statistics.median(g.decode_tokens_per_second for g in runs),
            "runs": [{"first_token_s": g.prefill_seconds, "decode_s": g.decode_seconds} for g in runs]}


def run(job: dict[str, Any], result: Path, granted: dict[str, Any]) -> None:
    """Measure ``job["config"]`` and write the outcome, with ``granted`` (what the bootstrap saw
    the kernel grant), as one JSON object to ``result``."""
    outcome = {"child": granted, **_measure(Config.from_dict(job["config"]), job["ranks"])}
    result.write_text(json.dumps(outcome))
