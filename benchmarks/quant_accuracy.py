"""How much numatp's quantized weights change a model's output: per preset, int8 and int4 weights (and int8
with int8 activations, ``int8:a8``), float32 and bfloat16 activations, against the unquantized float32 model.

numatp quantizes each socket's shard of every weight matmul (and, in int8, the LM head and the embedding
tables: ``keep_head=False``); on one socket a shard is the whole weight, so the model numatp runs there
is the model with every such weight replaced by its dequantized values, which this script builds
eagerly (``tests/test_quant.py`` checks that numatp's programs equal exactly that, at 1, 2 and 4
sockets). With more sockets a row-parallel shard's int8 scales are its own; int4 groups never straddle
shards, so int4 values do not depend on the socket count.

Reported per (preset, activations, weights): the relative error of the last position's logits
(``||q - f|| / ||f||`` over the vocabulary, mean over ``--prompts`` random prompts of ``--prompt``
tokens), and the greedy agreement over ``--new-tokens`` tokens (the share of positions, up to the first
disagreement and after it, where the quantized model's greedy token equals the float32 model's, both fed
the float32 model's tokens: teacher-forced, so one early flip does not decide the rest).

Beside numatp's formats, one reference row: llama.cpp's Q8_0 (blocks of 32 weights along the input,
one float16 scale each: the block's largest magnitude over 127), applied to the same weights numatp
quantizes in int8 (every weight matmul, the LM head and the embedding tables) and run eagerly: the error
the format people run on CPUs today gives on the same random weights, to read numatp's rows against.

Presets carry random weights (no downloads here), whose logits are flatter than a trained model's:
greedy agreement on them is a lower bound of what trained weights give.

    python benchmarks/quant_accuracy.py --models gpt2 gpt2-medium qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import json
import sys


def q8_0(w):
    """``w`` (N, K) through llama.cpp's Q8_0 and back: per block of 32 along K, scale = max |w| / 127
    stored as float16, values round(w / scale) (K padded with zeros to a multiple of 32)."""
    import torch

    n, k = w.shape
    pad = -k % 32
    blocks = torch.nn.functional.pad(w.float(), (0, pad)).view(n, -1, 32)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks)).round().clamp(-127, 127)
    return (q * scale).view(n, -1)[:, :k].to(w.dtype)


def _quantized_copy(model, weights: str, dtype, keep_head: bool = False):
    """``model`` in ``dtype`` with every weight matmul's weight in ``weights`` and the LM head and
    embedding tables in int8 (unless ``keep_head``), each dequantized (what numatp runs on one socket).
    ``weights="q8_0"``: all of them in llama.cpp's Q8_0 instead (:func:`q8_0`)."""
    import copy

    import torch
    from transformers.pytorch_utils import Conv1D

    from numatp.runtime.gemm import quant

    def dequantize(x):
        return x if weights == "q8_0" else quant.dequantize(x)

    def quantize(w, fmt):
        return q8_0(w) if weights == "q8_0" else quant.quantize(w, fmt)

    q = copy.deepcopy(model)
    head = q.get_output_embeddings()
    tables = {id(m.weight) for m in q.modules() if isinstance(m, torch.nn.Embedding)}
    done: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for m in q.modules():
            w = getattr(m, "weight", None)
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or id(w) in done:
                continue
            if isinstance(m, torch.nn.Linear):
                if m is head or id(w) in tables:
                    if not keep_head:
                        done[id(w)] = dequantize(quantize(w, "int8"))
                    continue
                done[id(w)] = dequantize(quantize(w, weights))
            elif isinstance(m, Conv1D):   # GPT-2's (K, N) weight: quantized as (N, K)
                done[id(w)] = dequantize(quantize(w.t(), weights)).t()
            elif isinstance(m, torch.nn.Embedding) and not keep_head:
                done[id(w)] = dequantize(quantize(w, "int8"))
        for p in q.parameters():
            if id(p) in done:
                p.copy_(done[id(p)])
    if weights == "int8:a8":   # every weight matmul's input quantized as numatp's kernels read it
        def hook(module, args):
            return (quant.quantize_activations(args[0]).to(args[0].dtype), *args[1:])
        for m in q.modules():
            if isinstance(m, (torch.nn.Linear, Conv1D)):
                m.register_forward_pre_hook(hook)
    return q.to(dtype)


def measure(name: str, prompt: int, new_tokens: int, prompts: int) -> list[dict]:
    import copy

    import torch

    from numatp import zoo

    torch.manual_seed(0)
    base = zoo.build(name, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, base.config.vocab_size, (prompts, prompt), generator=gen)
    with torch.inference_mode():
        # the float32 model's greedy continuation: every model is then fed these tokens
        seq = ids
        for _ in range(new_tokens):
            nxt = base(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
        ref = base(seq).logits.float()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for weights in ("none", "int8", "int8:a8", "int8 keep_head", "int4:g64", "int4:g32", "q8_0"):
            fmt, _, keep = weights.partition(" ")
            model = copy.deepcopy(base).to(dtype) if fmt == "none" else \
                _quantized_copy(base, fmt, dtype, keep_head=bool(keep))
            with torch.inference_mode():
                out = model(seq).logits.float()
            last = prompt - 1
            err = ((out[:, last] - ref[:, last]).norm(dim=-1) / ref[:, last].norm(dim=-1)).mean().item()
            span = slice(prompt - 1, prompt - 1 + new_tokens)
            agree = (out[:, span].argmax(-1) == ref[:, span].argmax(-1)).float().mean().item()
            label = "llama.cpp Q8_0 (reference)" if weights == "q8_0" else weights
            rows.append({"model": name, "activations": str(dtype).removeprefix("torch."), "weights": label,
                         "logits_rel_error": err, "greedy_agreement": agree, "prompt": prompt,
                         "new_tokens": new_tokens, "prompts": prompts})
            print(json.dumps(rows[-1]), flush=True)
            del model, out
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gpt2", "gpt2-medium", "qwen2.5-0.5b"], help="zoo presets")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens compared (default 64)")
    p.add_argument("--prompts", type=int, default=2, help="random prompts per model (default 2)")
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    a = p.parse_args()
    rows = []
    for m in a.models:
        print(f"{m} ...", file=sys.stderr, flush=True)
        rows += measure(m, a.prompt, a.new_tokens, a.prompts)
    if a.out:
        with open(a.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"\n| model | activations | weights | logits rel. error | greedy agreement ({a.new_tokens} tokens) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['activations']} | {r['weights']} | {r['logits_rel_error']:.2e} | "
              f"{100 * r['greedy_agreement']:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
