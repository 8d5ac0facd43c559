"""``numatp serve`` against a live server: the OpenAI client and plain HTTP, batching, streaming, errors.

The server runs in this process (uvicorn in a thread, on a free port) over the tiny GPT-2 compiled by numatp
on 2 virtual sockets (segments uneager: ``mode="eager"``; one test compiles through Inductor, slow). Two
apps serve the one engine: one without a tokenizer (prompts as token ids) and one with a tiny word-level
tokenizer that has a chat template (text, stop strings, chat).

What a request returns is compared, token for token, with the model's own eager ``generate`` of that
prompt alone (greedy, fp32): numatp's ``generate`` equals it exactly on these models (tests/test_generate.py),
and it is the one reference that runs no code of the server's, so batching, chunked prefill and the
recompute after a cache reset are all checked by it. The CLI end to end (a subprocess, SIGTERM) is slow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import numatp
from numatp import zoo
from numatp.backend import backend_of
from numatp.serve.engine import Engine, Request
from tests.helpers import fresh_dynamo, shared_cpu_topology

httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")   # noqa: F841 - fails below if absent

SRC = str(Path(__file__).resolve().parents[1] / "src")
MAX_LEN = 128   # the tiny GPT-2's positions
SLOTS = 4


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 500)}}
    for k, word in enumerate(["hello", "world", "user", "assistant", ":", "the", "a"]):
        vocab[word] = 500 + k
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    t.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                       "{% if add_generation_prompt %}assistant : {% endif %}")
    return t


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(app):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{server.config.port}"


class Served:
    def __init__(self):
        from numatp.serve.app import create_app

        fresh_dynamo()
        # the reference generates with a twin (the same seeded weights): transformers' generate sets
        # attributes on the model it runs, which the served model's guards would see
        self.model = zoo.build("gpt2", tiny=True)
        fast = numatp.compile(zoo.build("gpt2", tiny=True), sockets=shared_cpu_topology(2), mode="eager")
        self.engine = Engine(fast, max_batch=SLOTS, max_len=MAX_LEN, chunk=16, max_queue=16)
        self.engine.start()
        self.tokenizer = _tokenizer()
        self.ids_server = _serve(create_app(self.engine, model_name="tiny-gpt2"))
        self.text_server = _serve(create_app(self.engine, model_name="tiny-gpt2", tokenizer=self.tokenizer))
        self.url, self.text_url = self.ids_server[2], self.text_server[2]
        self._solo: dict[tuple, list[int]] = {}

    def solo(self, prompt: list[int], new: int) -> list[int]:
        """The eager model's greedy tokens for ``prompt`` alone."""
        key = (tuple(prompt), new)
        if key not in self._solo:
            ids = torch.tensor([prompt])
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                      pad_token_id=0)
            self._solo[key] = out[0, len(prompt):].tolist()
        return self._solo[key]

    def client(self, text: bool = False):
        import openai

        return openai.OpenAI(base_url=(self.text_url if text else self.url) + "/v1", api_key="none", max_retries=0)

    def close(self):
        for server, thread, _ in (self.ids_server, self.text_server):
            server.should_exit = True
            thread.join(30)
        self.engine.stop(timeout=30)


@pytest.fixture(scope="module")
def served():
    s = Served()
    yield s
    s.close()


def _prompt(seed: int, low: int = 3, high: int = 40) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(low, high, (1,), generator=g))
    return torch.randint(2, 500, (n,), generator=g).tolist()


def _sse(url: str, body: dict) -> tuple[list[dict], list[str]]:
    """The JSON chunks of a streamed response, and its raw data lines."""
    import httpx

    chunks, lines = [], []
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    return chunks, lines


@pytest.mark.integration
@pytest.mark.slow   # the live server's module fixture compiles and starts it (~20 s)
def test_completion_through_the_openai_client_equals_solo_generate(served):
    prompt = _prompt(1)
    out = served.client().completions.create(model="tiny-gpt2", prompt=prompt, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == served.solo(prompt, 12)
    assert choice.finish_reason == "length" and choice.text == ""
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 12)
    # sampling: a seed gives the same tokens again, another seed others
    kw = dict(model="tiny-gpt2", prompt=prompt, max_tokens=12, temperature=1.0, top_p=0.9)
    a, b, c = (served.client().completions.create(seed=s, **kw).choices[0].model_extra["token_ids"] for s in (5, 5, 6))
    assert a == b and a != c


@pytest.mark.integration
@pytest.mark.slow   # the live server's module fixture compiles and starts it (~20 s)
def test_16_concurrent_clients_each_equal_its_solo_output(served):
    jobs = [(_prompt(100 + k), 4 + (7 * k) % 21, k % 2 == 0) for k in range(16)]

    def one(job):
        prompt, new, stream = job
        if stream:
            chunks, _ = _sse(served.url + "/v1/completions", dict(model="tiny-gpt2", prompt=prompt, max_tokens=new,
                                                                 temperature=0, stream=True))
            return [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
        out = served.client().completions.create(model="tiny-gpt2", prompt=prompt, max_tokens=new, temperature=0)
        return out.choices[0].model_extra["token_ids"]

    forwards, resets = served.engine.forwards, served.engine.resets
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, jobs))
    for k, ((prompt, new, _), tokens) in enumerate(zip(jobs, got)):
        assert tokens == served.solo(prompt, new), f"request {k}: prompt of {len(prompt)}, {new} tokens"
    # they shared steps: fewer forwards than the requests' tokens one by one; and the clock passed the end of
    # the cache (144 positions), so that active sequences were re-prefilled on the way
    assert served.engine.forwards - forwards < sum(new for _, new, _ in jobs)
    assert served.engine.resets > resets


@pytest.mark.integration
@pytest.mark.slow   # the live server's module fixture compiles and starts it (~20 s)
def test_streaming_is_openai_chunks_ending_with_done(served):
    prompt = _prompt(2)
    chunks, lines = _sse(served.url + "/v1/completions", dict(model="tiny-gpt2", prompt=prompt, max_tokens=6,
                                                              temperature=0, stream=True,
                                                              stream_options={"include_usage": True}))
    assert lines[-1] == "[DONE]"
    assert all(c["object"] == "text_completion" and c["model"] == "tiny-gpt2" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == served.solo(prompt, 6)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    # the openai client reads the same stream
    stream = served.client().completions.create(model="tiny-gpt2", prompt=prompt, max_tokens=6, temperature=0,
                                                stream=True)
    assert [t for c in stream for t in (c.choices[0].model_extra or {}).get("token_ids", [])] == served.solo(prompt, 6)


@pytest.mark.integration
@pytest.mark.slow   # the live server's module fixture compiles and starts it (~20 s)
def test_text_prompt_chat_and_stop_string_through_a_tokenizer(served):
    tok = served.tokenizer
    client = served.client(text=True)
    text = "hello world w7 w42 the a"
    ids = tok(text).input_ids
    expected = served.solo(ids, 10)
    out = client.completions.create(model="tiny-gpt2", prompt=text, max_tokens=10, temperature=0)
    assert out.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    # a stop string ends the text before it, finish_reason "stop"
    full = tok.decode(expected, skip_special_tokens=True)
    stop = full[3:7]   # across a token boundary (random tiny weights repeat one word: "w123 w123 ...")
    out = client.completions.create(model="tiny-gpt2", prompt=text, max_tokens=10, temperature=0, stop=["zzz", stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:full.index(stop)] and out.choices[0].text
    stream = client.completions.create(model="tiny-gpt2", prompt=text, max_tokens=10, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream) == out.choices[0].text
    # chat: the template's prompt, then the same tokens as a completion of it
    messages = [{"role": "user", "content": "hello w7"}]
    chat_ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False).input_ids
    reply = client.chat.completions.create(model="tiny-gpt2", messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == tok.decode(served.solo(chat_ids, 8), skip_special_tokens=True)
    streamed = client.chat.completions.create(model="tiny-gpt2", messages=messages, max_tokens=8, temperature=0,
                                              stream=True)
    parts = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(parts) == reply.choices[0].message.content


@pytest.mark.integration
@pytest.mark.slow   # the live server's module fixture compiles and starts it (~20 s)
def test_each_error_is_openai_json_naming_the_field(served):
    import httpx
    import openai

    def post(path, body, base=None, raw=None):
        r = httpx.post((base or served.url) + path, json=body if raw is None else None, content=raw, timeout=30)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        return r.status_code, err

    code, err = post("/v1/completions", None, raw=b"{not json")
    assert code == 400 and "not valid JSON" in err["message"]
    code, err = post("/v1/completions", {"model": "gpt-5", "prompt": [1]})
    assert (code, err["param"], err["code"]) == (404, "model", "model_not_found")
    code, err = post("/v1/completions", {"model": "tiny-gpt2", "prompt": [1], "temperature": "hot"})
    assert (code, err["param"]) == (400, "temperature")
    code, err = post("/v1/completions", {"model": "tiny-gpt2", "prompt": [1], "max_tokens": 0})
    assert (code, err["param"]) == (400, "max_tokens")
    code, err = post("/v1/completions", {"model": "tiny-gpt2", "prompt": [7] * MAX_LEN, "max_tokens": 1})
    assert (code, err["param"], err["code"]) == (400, "prompt", "context_length_exceeded")
    code, err = post("/v1/completions", {"model": "tiny-gpt2", "prompt": [1, 10**6]})
    assert (code, err["param"]) == (400, "prompt") and "vocabulary" in err["message"]
    code, err = post("/v1/completions", {"model": "tiny-gpt2", "prompt": "some text"})
    assert (code, err["param"]) == (400, "prompt") and "no tokenizer" in err["message"]
    code, err = post("/v1/chat/completions", {"model": "tiny-gpt2", "messages": [{"role": "user", "content": "x"}]})
    assert (code, err["param"]) == (400, "messages") and "no tokenizer" in err["message"]
    code, err = post("/v1/chat/completions", {"model": "tiny-gpt2", "messages": "hi"}, base=served.text_url)
    assert (code, err["param"]) == (400, "messages")
    with pytest.raises(openai.BadRequestError) as e:
        served.client().completions.create(model="tiny-gpt2", prompt=[1], max_tokens=4, top_p=5)
    assert e.value.body["param"] == "top_p"
    # and the server still serves
    assert served.client().completions.create(model="tiny-gpt2", prompt=[1, 2], max_tokens=2, temperature=0)


@pytest.mark.integration
@pytest.mark.slow   # the live server's module fixture compiles and starts it (~20 s)
def test_a_client_that_disconnects_frees_its_slot_and_a_full_queue_is_429(served):
    import httpx

    engine = served.engine
    engine.max_queue = 0
    forward = engine._forward

    def slowly(*args):   # 20 ms a step: the streams below last seconds, not a fraction of one
        time.sleep(0.02)
        return forward(*args)

    engine._forward = slowly
    body = dict(model="tiny-gpt2", max_tokens=MAX_LEN - 40, temperature=0, stream=True)
    clients = [httpx.Client(timeout=60) for _ in range(SLOTS)]
    streams = []
    try:
        for k, c in enumerate(clients):   # every slot busy with a long stream
            s = c.stream("POST", served.url + "/v1/completions", json={**body, "prompt": _prompt(200 + k)})
            lines = s.__enter__().iter_lines()
            next(lines)   # (the iterator is kept: dropping it closes the response)
            streams.append((s, lines))
        r = httpx.post(served.url + "/v1/completions", json={"model": "tiny-gpt2", "prompt": [1, 2], "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        cancelled = engine.metrics.finish.get("cancelled", 0)
        s, _ = streams.pop(0)   # one client goes away mid-stream
        s.__exit__(None, None, None)
        clients[0].close()
        deadline = time.time() + 20
        while engine.active == SLOTS:
            assert time.time() < deadline, "the disconnected client's slot was not freed"
            time.sleep(0.02)
        assert engine.metrics.finish.get("cancelled", 0) == cancelled + 1   # it left early, not at its end
        out = served.client().completions.create(model="tiny-gpt2", prompt=[3, 4, 5], max_tokens=3, temperature=0)
        assert out.choices[0].model_extra["token_ids"] == served.solo([3, 4, 5], 3)
        assert engine.active == SLOTS - 1   # the other streams are still going
    finally:
        for s, _ in streams:
            s.__exit__(None, None, None)
        for c in clients:
            c.close()
        engine.max_queue = 16
        del engine._forward
    deadline = time.time() + 20
    while engine.active:
        assert time.time() < deadline, "closed streams kept their slots"
        time.sleep(0.02)
    assert 'numatp_requests_total{finish_reason="cancelled"}' in httpx.get(served.url + "/metrics").text


@pytest.mark.integration
@pytest.mark.slow   # the live server's module fixture compiles and starts it (~20 s)
def test_models_health_and_metrics(served):
    import httpx

    assert served.client().models.list().data[0].id == "tiny-gpt2"
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    served.client().completions.create(model="tiny-gpt2", prompt=[5, 6], max_tokens=3, temperature=0)
    text = httpx.get(served.url + "/metrics").text
    for name in ("numatp_requests_total", "numatp_prompt_tokens_total", "numatp_generated_tokens_total",
                 "numatp_time_to_first_token_seconds_bucket", "numatp_inter_token_latency_seconds_count",
                 "numatp_batch_occupancy_bucket", "numatp_queue_length", "numatp_active_slots"):
        assert name in text, name
    generated = next(float(line.split()[-1]) for line in text.splitlines()
                     if line.startswith("numatp_generated_tokens_total "))
    assert generated >= 3


def _engine_run(fast, model, jobs, *, slots, max_len, chunk, skip_guards=False):
    engine = Engine(fast, max_batch=slots, max_len=max_len, chunk=chunk, skip_guards=skip_guards)
    engine.start()
    try:
        done = [threading.Event() for _ in jobs]
        reqs = []
        for k, (prompt, new) in enumerate(jobs):
            reqs.append(engine.submit(Request(prompt, new, lambda kind, v, k=k: kind != "token" and done[k].set(),
                                              temperature=0)))
            time.sleep(0.002 * (k % 3))   # joins at different step boundaries
        for d in done:
            assert d.wait(120)
    finally:
        engine.stop(timeout=30)
    return [r.generated for r in reqs], engine


@pytest.mark.parametrize("sockets", [1, 2, 4])
@pytest.mark.slow   # 2 sockets, joins and resets are in the default tier through the live server above
@pytest.mark.integration
def test_engine_batches_joins_and_resets_without_changing_greedy_tokens(sockets):
    # a short cache: the clock passes its end several times, and active sequences are re-prefilled
    fresh_dynamo()
    model = zoo.build("gpt2", tiny=True)
    fast = numatp.compile(model, sockets=shared_cpu_topology(sockets), mode="eager")
    jobs = [(_prompt(300 + k, 2, 50), 3 + (5 * k) % 30) for k in range(10)]
    got, engine = _engine_run(fast, model, jobs, slots=4, max_len=96, chunk=16)
    assert engine.resets >= 1
    for k, ((prompt, new), tokens) in enumerate(zip(jobs, got)):
        ids = torch.tensor([prompt])
        solo = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == solo, f"request {k} on {sockets} sockets"
    # the chunk, the long chunk and the step, at every slot's width and at slot 0's alone: six programs for
    # every request (a 50-token prompt of chunk 16 runs as 4 chunks, one long call)
    backend = backend_of(fast)
    assert engine.long_chunk == 64 and engine._pieces(4) == [(0, 64)] and engine._pieces(6) == [(0, 64), (64, 16),
                                                                                                 (80, 16)]
    assert sum(len(g.variants) for g in backend.graphs) == 6
    assert engine.widths[1] > 0 and engine.widths[4] > 0   # the first request ran alone, then others joined
    assert engine.lengths[64] > 0 and engine.lengths[16] > 0   # long calls and chunks (re-prefills of 64+)
    # joins of few requests prefill each alone, over its own row, other slots included
    assert engine.alone[0] > 0 and sum(engine.alone[i] for i in range(1, 4)) > 0, engine.alone


@pytest.mark.slow
@pytest.mark.integration
def test_engine_through_inductor_equals_solo_generate():
    fresh_dynamo()
    model = zoo.build("gpt2", tiny=True)
    fast = numatp.compile(model, sockets=shared_cpu_topology(2))
    jobs = [(_prompt(400 + k, 2, 50), 3 + (5 * k) % 30) for k in range(8)]
    got, _ = _engine_run(fast, model, jobs, slots=4, max_len=96, chunk=16)
    for (prompt, new), tokens in zip(jobs, got):
        ids = torch.tensor([prompt])
        assert tokens == model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                        do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()


_SKIPPING = """
import json
import torch
import numatp
from numatp import zoo
from tests.helpers import shared_cpu_topology
from tests.test_serve import _engine_run, _prompt
model = zoo.build("gpt2", tiny=True)
fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
jobs = [(_prompt(500 + k, 2, 50), 3 + (5 * k) % 30) for k in range(8)]
got, engine = _engine_run(fast, model, jobs, slots=4, max_len=96, chunk=16, skip_guards=True)
solo = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=n,
                       do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p, n in jobs]
print(json.dumps({"skipped": engine.guards_skipped, "equal": [g == w for g, w in zip(got, solo)],
                  "resets": engine.resets, "replayed": engine.replayed,
                  "steps_replayed": engine._replays[(4, 1, -1)].calls}))
"""


@pytest.mark.integration
def test_an_engine_that_skips_guards_in_a_process_of_its_own_equals_solo_generate():
    """What `numatp serve` runs: the engine's forwards skip Dynamo's guards after the warm-up, and then go
    past Dynamo (numatp's graphs called directly), in a process that compiles this one model (a fresh one
    here), through joins and cache resets."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, str(Path(SRC).parent)]), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _SKIPPING], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["skipped"], out   # skipped from the warm-up to the last forward (no fallback to guards)
    assert all(out["equal"]) and len(out["equal"]) == 8, out
    assert out["resets"] >= 1, out
    assert out["steps_replayed"] > 0 and out["replayed"] > out["steps_replayed"], out   # steps and prefills


@pytest.mark.unit
def test_replays_dropped_after_a_failure_keep_their_count():
    # a failed forward (or guards put back) drops every shape's replay; `numatp serve`'s last line still
    # counts the forwards they ran
    from numatp.generate import Replay

    engine = Engine.__new__(Engine)   # the bookkeeping alone, no model
    engine._replays, engine._replayed_before = {}, 0
    for key, calls in (((4, 1, -1), 5), ((1, 1, 0), 2)):
        engine._replays[key] = Replay()
        engine._replays[key].calls = calls
    engine._drop_replays()
    assert engine._replays == {} and engine.replayed == 7
    engine._replays[(4, 1, -1)] = Replay()
    engine._replays[(4, 1, -1)].calls = 3
    assert engine.replayed == 10


_PROBE = """
import json, sys
if sys.argv[1] == "hide":
    sys.modules["fastapi"] = None   # as if the serve extra were not installed
from numatp.cli import main
try:
    code = main(sys.argv[2:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "imported": sorted(m for m in ("torch", "fastapi", "uvicorn") if m in sys.modules)}))
"""


@pytest.mark.integration
def test_help_imports_nothing_heavy_and_a_missing_extra_is_one_line():
    env = {**os.environ, "PYTHONPATH": SRC}
    r = subprocess.run([sys.executable, "-c", _PROBE, "show", "serve", "--help"], capture_output=True, text=True,
                       env=env, timeout=120)
    state = json.loads(r.stdout.strip().splitlines()[-1])
    assert state == {"code": 0, "imported": []} and "--max-batch" in r.stdout
    r = subprocess.run([sys.executable, "-c", _PROBE, "hide", "serve", "gpt2", "--tiny"], capture_output=True,
                       text=True, env=env, timeout=120)
    state = json.loads(r.stdout.strip().splitlines()[-1])
    assert state["code"] == 2 and "torch" not in state["imported"]
    assert r.stderr.strip() == "numatp serve: needs FastAPI and uvicorn: pip install 'numatp[serve]'"


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(900)
def test_cli_serves_and_sigterm_finishes_the_stream_in_flight_then_exits():
    import httpx

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "numatp", "serve", "gpt2", "--tiny", "--dtype", "float32",
                             "--sockets", "2", "--max-batch", "2", "--max-len", "128", "--port", str(port)],
                            env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server did not come up"
            time.sleep(1)
        body = dict(model="gpt2", prompt=[5, 6, 7], max_tokens=120, temperature=0, stream=True)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [first] + [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        tokens = [t for line in rest[:-1] for c in json.loads(line[6:])["choices"] for t in c.get("token_ids", [])]
        # every token of the stream in flight arrives (a chunk may carry more than one)
        assert len(tokens) == 120
        assert proc.wait(60) == 0
        said = proc.stderr.read()
        assert "Dynamo's guards: skipped after the warm-up" in said
        # the 119 decode steps after the first token: all but the two observed call numatp's graph directly
        past = re.search(r"stopped after (\d+) forwards, (\d+) of them past Dynamo", said)
        assert past and int(past.group(2)) >= 117, said[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
