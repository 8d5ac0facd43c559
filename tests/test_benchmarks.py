"""Scripts of ``benchmarks/`` that reach into numatp's internals, run on tiny models so that they keep
working as those internals change (their numbers are not checked: a benchmark reports, a test asserts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_decode_split_replays_every_weight_matmul_of_the_decode_step():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_split.py"), "llama", "--tiny",
                        "--weights", "int8", "--rounds", "1", "--replays", "2", "--prompt", "8", "--new-tokens", "6"],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads(r.stdout.splitlines()[0])
    # the tiny llama's 2 layers of 7 projections and its LM head, every one on each of the 2 sockets
    assert row["matmuls_per_socket"] == [15, 15] and row["left_out"] == 0
    assert len(row["step_ms"]) == len(row["matmuls_ms"]) == 1
    assert all(t > 0 for t in row["step_ms"] + row["matmuls_ms"])
    assert "weight matmuls per socket alone" in r.stdout
    # the bytes it reads: each socket's int8 shards of the tiny llama's (N, K) weights at 2 sockets, q, k, v,
    # gate, up and the LM head split along N (output channels), o and down along K
    from numatp import zoo
    from numatp.runtime.gemm import quant

    c = zoo.build("llama", tiny=True).config
    h, inter, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    layer = [(h // 2, h), (kv // 2, h), (kv // 2, h), (h, h // 2), (inter // 2, h), (inter // 2, h), (h, inter // 2)]
    shards = layer * c.num_hidden_layers + [(c.vocab_size // 2, h)]
    assert row["weight_bytes_per_socket"] == [sum(quant.nbytes(n, k, "int8") for n, k in shards)] * 2
    assert re.search(r"weights read per socket: \d+\.\d MiB .* \d+\.\d GB/s in the matmuls alone", r.stdout)
