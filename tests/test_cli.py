"""The commands run as a user would: ``numatp demo`` in a fresh interpreter, the others through the
same ``main`` the ``numatp`` script calls, in this process (a fresh interpreter costs seconds of imports)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import numatp
from numatp import zoo
from tests.helpers import fresh_dynamo

pytestmark = pytest.mark.integration


def _numatp(*args: str, timeout: int = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "numatp", *args], capture_output=True, text=True, timeout=timeout,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"} | _keep_env() | (env or {}))


def _keep_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}



def test_explain_json_lists_blocks_and_reductions(cli):
    code, out, err = cli("explain", "gpt2", "--tiny", "--sockets", "2", "--json")
    assert code == 0, err
    info = json.loads(out)
    (g,) = info["graphs"]
    assert g["reductions"] == 5 and g["gathers"] == 1
    kinds = sorted(b["kind"] for b in g["blocks"] if b["sharded"])
    assert kinds == ["attention", "attention", "embedding", "lm_head", "mlp", "mlp"]
    # each block's reason comes as its kind and as the prose the table prints
    reasons = sorted((b["kind"], b["reason_kind"]) for b in g["blocks"])
    assert reasons == [("attention", "column_row")] * 2 + [("embedding", "small_table"), ("embedding", "vocab_rows"),
                                                           ("lm_head", "vocab_columns")] + [("mlp", "column_row")] * 2
    assert all(isinstance(b["reason"], str) and b["reason"] for b in g["blocks"])
    # in the model's order, each row named once: the tied table is traced under the head's name, and its
    # row names the input embedding instead of a second lm_head
    assert [b["module"] for b in g["blocks"]] == [
        "transformer.wte (tied to lm_head)", "transformer.wpe", "transformer.h.0.attn", "transformer.h.0.mlp",
        "transformer.h.1.attn", "transformer.h.1.mlp", "lm_head"]
    # the tied vocabulary table is split; norms, biases after reductions and positions are replicated
    assert 0.9 < g["sharded_fraction"] < 1.0
    assert sum(g["socket_bytes"]) > g["model_bytes"]  # replicated tensors are counted on each socket


def test_explain_gemm_shows_provider_and_rate_per_socket_shape(cli, tmp_path):
    code, out, err = cli("explain", "gpt2", "--tiny", "--sockets", "2", "--gemm", "--json")
    assert code == 0, err
    (g,) = json.loads(out)["graphs"]
    rows = g["gemm"]["rows"]
    assert g["gemm"]["cache"].startswith(str(tmp_path))
    # tiny GPT-2 (hidden 64, 2 layers, 2 sockets): each socket holds half of every sharded weight
    assert {r["rank"] for r in rows} == {0, 1}
    shapes = {(r["k"], r["n"]) for r in rows if r["rank"] == 0}
    assert {(64, 96), (32, 64), (64, 128), (128, 64)} <= shapes  # c_attn, attn c_proj, c_fc, mlp c_proj halves
    assert all(r["m"] == 128 and r["threads"] == 1 for r in rows)
    for row in rows:
        assert row["rates"]["aten"] > 0 and row["gflops"] == row["rates"][row["provider"]] > 0
    code, text, err = cli("explain", "gpt2", "--tiny", "--sockets", "2", "--gemm")
    assert code == 0, err
    assert "GEMM providers" in text and "128 x 64 x 96" in text
    code, out, err = cli("explain", "gpt2", "--tiny", "--sockets", "2", "--gemm", "--policy", "never", "--json")
    assert code == 0, err
    (graph,) = json.loads(out)["graphs"]
    # unsharded: one program on one socket of all CPUs, whole weights, measured providers as well
    assert graph["gemm"]["unsharded"] and {r["rank"] for r in graph["gemm"]["rows"]} == {0}
    assert {(r["k"], r["n"]) for r in graph["gemm"]["rows"]} >= {(64, 192), (64, 64), (64, 256), (256, 64)}
    assert all(r["threads"] == len(os.sched_getaffinity(0)) and r["gflops"] > 0 for r in graph["gemm"]["rows"])


def test_explain_runs_the_pipeline_compile_runs(cli):
    # explain runs numatp.compile's build pipeline (numatp.plan.pipeline) and stops before compiling: its
    # socket programs have the steps the compiled model's programs run, and its GEMM providers are the
    # ones they run (the table was written by explain, so both choose from the same rates)
    code, out, err = cli("explain", "gpt2", "--tiny", "--sockets", "2", "--gemm", "--check", "--json")
    assert code == 0, err
    (g,) = json.loads(out)["graphs"]
    assert g["checked"]
    shown = sorted((r["rank"], r["m"], r["k"], r["n"], r["provider"]) for r in g["gemm"]["rows"])
    model = zoo.build("gpt2", tiny=True)
    fresh_dynamo()
    with torch.inference_mode():
        compiled = numatp.compile(model, sockets=2, mode="eager")
        compiled(**zoo.example_inputs(model, batch=1, seq=128))
    backend = numatp.backend.backend_of(compiled)
    ran = sorted((r["rank"], r["m"], r["k"], r["n"], r["provider"]) for r in backend.gemm_report())
    assert ran == shown
    from numatp.runtime.segments import Collective

    (variant,) = [v for graph in backend.graphs for v in graph.variants.values()]
    steps = [[s.kind if isinstance(s, Collective) else type(s).__name__ for s in p.steps]
             for p in variant.executor.programs]
    assert [p["steps"] for p in g["programs"]] == steps
    assert steps[0].count("all_gather") == 1 and "Segment" in steps[0]


def test_explain_weights_shows_each_weights_storage_and_the_bytes_per_socket(cli):
    from numatp.runtime.gemm.quant import nbytes

    code, out, err = cli("explain", "gpt2", "--tiny", "--sockets", "2", "--seq", "16", "--weights", "int8", "--json")
    assert code == 0, err
    info = json.loads(out)
    (g,) = info["graphs"]
    assert (info["weights"], info["keep_head"]) == ("int8", False)
    rows = g["gemm"]["rows"]
    # tiny GPT-2 on 2 sockets: 4 matmuls a layer, the LM head, and the two tables looked up, on each socket;
    # all int8 (the head and the tables too, without --keep-head), each at its int8 size
    assert len(rows) == 2 * (4 * 2 + 1 + 2) and {r["rank"] for r in rows} == {0, 1}
    assert {r["storage"] for r in rows} == {"int8"}
    assert sorted(r["provider"] == "qembedding" for r in rows).count(True) == 4
    assert all(r["bytes"] == nbytes(r["n"], r["k"], "int8") for r in rows)
    # per socket: about a quarter of float32's (norms and biases stay float32)
    held = g["stored_bytes"]
    assert len(held) == 2 and held[0] == held[1] and 0.2 < held[0] / g["socket_bytes"][0] < 0.35
    # the table: a storage column, each shard's bytes, and the per-socket total line
    code, text, err = cli("explain", "gpt2", "--tiny", "--sockets", "2", "--seq", "16", "--weights", "int4:g32",
                          "--keep-head")
    assert code == 0, err
    assert "weights int4:g32, LM head and embeddings float32" in text.splitlines()[0]
    assert re.search(r"^16 x 64 x 96 +float32 +1 0,1 +2  int4:g32 +3\.88 KiB  (qgemv|qtile|q8_aten|q_dequant) ", text, re.MULTILINE), text
    # the LM head kept in float32 (a plain provider, whichever measured fastest)
    assert re.search(r"^16 x 64 x 256 +float32 +1 0,1 +1  float32 +64\.0 KiB  \w+", text, re.MULTILINE), text
    assert re.search(r"^weights as stored \(int4:g32, LM head and embeddings float32\) per socket: "
                     r"socket 0: [\d.]+ [KM]iB, socket 1: [\d.]+ [KM]iB \(\d+% of their float32 bytes\)$", text,
                     re.MULTILINE), text


@pytest.mark.slow   # a compile (~10 s) beside the explain
def test_explain_weights_bytes_per_socket_are_what_compile_holds(cli):
    code, out, err = cli("explain", "gpt2", "--tiny", "--sockets", "2", "--seq", "16", "--weights", "int8", "--json")
    assert code == 0, err
    (g,) = json.loads(out)["graphs"]
    model = zoo.build("gpt2", tiny=True)
    fresh_dynamo()
    with torch.inference_mode():
        compiled = numatp.compile(model, sockets=2, mode="eager", weights="int8")
        compiled(**zoo.example_inputs(model, batch=1, seq=16))
    assert [r["bytes"] for r in numatp.placement_report(compiled)["ranks"]] == g["stored_bytes"]


def test_explain_auto_says_whether_compile_will_measure_and_compile_does(cli):
    # no calibrated profile: the built-in estimate. Whatever explain says compile will do (measure both
    # plans, or trust the model), compile does: its plan's reasons say so
    code, out, err = cli("explain", "gpt2", "--tiny", "--sockets", "2", "--policy", "auto", "--json")
    assert code == 0, err
    (graph,) = json.loads(out)["graphs"]
    pred = graph["predicted"]
    assert pred["sharded"] > 0 and pred["unsharded"] > 0
    code, text, err = cli("explain", "gpt2", "--tiny", "--sockets", "2", "--policy", "auto")
    assert f"policy auto: predicted {1e3 * pred['sharded']:.1f} ms sharded" in text
    assert ("builds both" in text) == graph["measures_both"]
    model = zoo.build("gpt2", tiny=True)
    fresh_dynamo()
    with torch.inference_mode():
        compiled = numatp.compile(model, sockets=2, policy="auto", mode="eager")
        compiled(**zoo.example_inputs(model, batch=1, seq=128))
    (plan,) = numatp.plans(compiled)
    measured = any(b.reason.kind == "measured" for b in plan.blocks)
    assert measured == graph["measures_both"]
    assert plan.predicted == pytest.approx(pred, rel=1e-6)


def test_topo_shows_gemm_ceilings_of_this_cpu(cli, tmp_path):
    from numatp.runtime.gemm import GemmShape, GemmTable

    code, empty, _ = cli("topo")
    assert code == 0 and "none measured on this CPU yet" in empty
    GemmTable(tmp_path / "numatp").put({GemmShape(512, 1024, 4096, "float32", "kn", 2): {"aten": 61.5, "onednn": 70.5},
                                        GemmShape(128, 64, 64, "float32", "kn", 2): {"aten": 80.0, "onednn": 3.0}})
    code, out, _ = cli("topo", "--json")
    assert json.loads(out)["gemm_ceilings"] == {"float32": {"2": {"aten": 80.0, "onednn": 70.5}}}
    _, text, _ = cli("topo")
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("float32"))
    assert row == ["float32", "2", "80.0", "70.5", "aten"]


def test_explain_orders_layers_as_numbers():
    from numatp.cli.explain import _layer_order

    names = ["h.10.mlp", "h.2.attn", "h.1.mlp", "h.0.attn", "h.1.attn", "wte"]
    assert sorted(names, key=_layer_order) == ["h.0.attn", "h.1.attn", "h.1.mlp", "h.2.attn", "h.10.mlp", "wte"]


def test_demo_page_counts_have_a_unit():
    from numatp.cli.demo import _size

    assert (_size(4096), _size(2 << 20), _size(1 << 30), _size(1000)) == ("4 KiB", "2 MiB", "1 GiB", "1000 B")


def test_explain_bad_socket_count_is_a_clear_error(cli):
    code, _, err = cli("explain", "gpt2", "--tiny", "--sockets", "9")
    assert code == 2
    assert "cannot split over 9 sockets" in err and "fewer sockets" in err


def test_demo_runs_baseline_and_numatp_side_by_side():
    # the CLI end to end in the default run: a fresh interpreter, Inductor, and the demo's own check that
    # baseline, unsharded and sharded outputs equal eager (it exits non-zero where one does not)
    r = _numatp("demo", "--tiny", "--warmup", "0", "--iters", "1", "--seq", "32")
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"speedup numatp / baseline: \d+\.\d\dx", r.stdout)
    # the two sources of speed apart: GEMM providers alone, then sharding on top of them
    assert re.search(r"from GEMM providers \(numatp unsharded / baseline\): \d+\.\d\dx", r.stdout)
    assert re.search(r"from sharding over 2 sockets \(sharded / unsharded\): \d+\.\d\dx \(virtual sockets", r.stdout)
    rows = [line for line in r.stdout.splitlines() if line.startswith(("baseline", "numatp unsharded", "numatp sharded"))]
    assert len(rows) == 3, r.stdout
    assert re.search(r"socket 1 weights -> node 0: \d+ pages \(\d+ KiB\)", r.stdout)
    # a socket holding a packed GEMM operand beside its shard may pass 1 MiB (the provider is measured)
    assert re.search(r"^weights \(float32, not quantized\) per socket: socket 0: \d+\.\d+ [KM]iB, "
                     r"socket 1: \d+\.\d+ [KM]iB; the model in float32: \d+\.\d KiB$", r.stdout, re.MULTILINE), r.stdout


@pytest.mark.slow   # a fresh interpreter compiling three modes (~35 s)
def test_demo_weights_shows_the_quantization_error_and_the_bytes_per_socket():
    r = _numatp("demo", "--tiny", "--warmup", "0", "--iters", "1", "--seq", "32", "--weights", "int8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "float32; numatp's weights int8" in r.stdout
    assert re.search(r"from GEMM providers and int8 weights \(numatp unsharded / baseline\): \d+\.\d\dx", r.stdout)
    errors = re.search(r"int8 weights: logits' relative error against eager \(float32 weights\): numatp unsharded "
                       r"(\d+\.\d\d)%, numatp (\d+\.\d\d)%", r.stdout)
    assert errors and all(0 < float(e) < 5 for e in errors.groups()), r.stdout
    held = re.search(r"weights \(int8, LM head and embeddings int8\) per socket: socket 0: (\d+\.\d) KiB, socket 1: "
                     r"(\d+\.\d) KiB; the model in float32: (\d+\.\d) KiB", r.stdout)
    assert held and float(held[1]) < 0.2 * float(held[3]), r.stdout


@pytest.mark.slow   # a subprocess that compiles a prompt and a decode step (~30 s); demo covers the CLI
def test_generate_prints_first_token_and_decode_speed(cli):
    fresh_dynamo()
    code, out, err = cli("generate", "gpt2", "--tiny", "--prompt-len", "8", "--new-tokens", "4", "--sockets", "2")
    assert code == 0, err
    assert "prompt 8 tokens, 4 new tokens" in out
    row = next(line for line in out.splitlines() if line.startswith("numatp 2 sockets"))
    first_ms, tokens_per_s, ms_per_token = map(float, row.split()[-3:])
    assert first_ms > 0 and tokens_per_s > 0 and ms_per_token == pytest.approx(1e3 / tokens_per_s, rel=1e-2)


@pytest.mark.slow
def test_generate_first_token_chooses_gemm_providers_for_the_prompt_alone(cli, monkeypatch):
    import numatp

    fresh_dynamo()
    seen = []
    compile_ = numatp.compile
    monkeypatch.setattr(numatp, "compile", lambda *a, **kw: seen.append(kw.get("gemm")) or compile_(*a, **kw))
    code, out, err = cli("generate", "gpt2", "--tiny", "--prompt-len", "8", "--new-tokens", "2", "--sockets", "1",
                         "--first-token")
    assert code == 0, err
    assert [g.first_token for g in seen] == [True]
    assert any(line.startswith("numatp 1 sockets") for line in out.splitlines())


@pytest.mark.slow   # compiles a prompt and a decode step with quantized weights (~20 s)
def test_generate_weights_prints_the_format_and_bytes_per_socket(cli):
    fresh_dynamo()
    code, out, err = cli("generate", "gpt2", "--tiny", "--prompt-len", "8", "--new-tokens", "3", "--sockets", "2",
                         "--weights", "int4:g32")
    assert code == 0, err
    assert re.search(r"^numatp 2 sockets int4:g32 +\d+\.\d +\d+\.\d\d", out, re.MULTILINE), out
    held = re.search(r"^weights \(int4:g32, LM head and embeddings int8\) per socket: socket 0: (\d+\.\d) KiB, "
                     r"socket 1: (\d+\.\d) KiB; the model in float32: (\d+\.\d) KiB$", out, re.MULTILINE)
    assert held and float(held[1]) == float(held[2]) and float(held[1]) < float(held[3]) / 2, out


def test_generate_refuses_text_without_a_tokenizer(cli):
    code, _, err = cli("generate", "gpt2", "--tiny", "--prompt", "hello")
    assert code == 2 and "--prompt needs a checkpoint folder with a tokenizer" in err and "--prompt-len" in err
    code, _, err = cli("generate", "gpt2", "--tiny", "--prompt-bucket", "0")
    assert code == 2 and "--prompt-bucket 0: must be >= 1" in err


def test_predict_says_which_profile_and_kernels_its_times_assume(cli):
    code, out, err = cli("predict", "--platform", "haswell-2s", "--model", "gpt2", "--batch", "1", "--seq", "128")
    assert code == 0, err
    line = out.strip().splitlines()[-1]
    assert "built-in profile haswell-2s" in line and "Triton-CPU" in line and "arXiv:2611.07105" in line
    assert re.search(r"at 9\.2 GFLOP/s per socket in float32, 2% of the peak", line)


def test_calibrate_profiles_the_sockets_the_other_commands_run(cli, monkeypatch):
    from numatp.bench.machine import resolve_ranks
    from numatp.cost import calibrate
    from numatp.topology import Topology

    seen = []

    def measured(topo, **kw):
        seen.append(topo)
        raise ValueError("stop before measuring")

    monkeypatch.setattr(calibrate, "measure_profile", measured)
    code, _, err = cli("calibrate", "--quick")
    assert code == 2 and "stop before measuring" in err
    expected = resolve_ranks(None, Topology.detect())
    assert [s.cpus for s in seen[0].sockets] == [s.cpus for s in expected.sockets]


def test_the_weights_line_names_the_heads_format():
    from numatp.cli._weights import describe_weights

    assert describe_weights("int8", False, "bfloat16") == "int8, LM head and embeddings int8"
    # the head's int8 quantizes its activations where the body's do
    assert describe_weights("int4:g64:a8", False, "bfloat16") == "int4:g64:a8, LM head and embeddings int8:a8"
    assert describe_weights("int8:a8", True, "float32") == "int8:a8, LM head and embeddings float32"
    assert describe_weights(None, False, "float32") == "float32, not quantized"
