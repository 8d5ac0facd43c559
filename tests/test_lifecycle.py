"""A compiled model's life beside a server: interrupts at any moment, callers on several threads, and release.

One tiny GPT-2 on 2 sockets (eager segments) per test; every generation is checked token for token
against a solo run of the same prompt.
"""

from __future__ import annotations

import _thread
import importlib
import signal
import threading
import time

import pytest
import torch

import numatp
from numatp import zoo
from numatp.backend import backend_of
from tests.helpers import fresh_dynamo, shared_cpu_topology

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _python_sigint_handler():
    """Python's own SIGINT handler (KeyboardInterrupt) during each test, whatever an earlier test or library
    in the process installed: these tests interrupt on purpose and expect the KeyboardInterrupt."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)

gen = importlib.import_module("numatp.generate")   # numatp.generate is also the function
NEW = 12


def _prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(5, 500, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def fast():
    fresh_dynamo()
    torch.manual_seed(0)
    model = zoo.build("gpt2", tiny=True)
    return numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")


def _stance() -> tuple[str, bool]:
    from torch._dynamo import eval_frame
    return eval_frame._stance.stance, eval_frame._stance.skip_guard_eval_unsafe


def _settled(fast) -> bool:
    shared = backend_of(fast).group._shared
    return all(f == shared.task[0] for f in shared.finished)


@pytest.mark.slow
def test_an_exception_in_the_token_loop_at_any_step_leaves_the_model_usable(fast, monkeypatch):
    # top_k=1 samples the greedy token; a warper raising after k tokens is a callback (a streamer, a
    # cancelled request) interrupting the loop: before the guard skip (k < 3) and while it is on
    ids = _prompt(7)
    expected = fast.generate(ids, max_new_tokens=NEW, pad_token_id=0)
    real = gen._warpers
    for k, exc in ((1, KeyboardInterrupt), (3, KeyboardInterrupt), (6, KeyboardInterrupt), (9, ValueError)):
        calls = []

        def raising(*a, k=k, exc=exc, calls=calls):
            def warp(_, logits):
                calls.append(1)
                if len(calls) == k:
                    raise exc(f"after {k} tokens")
                return logits
            return real(*a) + [warp]

        monkeypatch.setattr(gen, "_warpers", raising)
        with pytest.raises(exc, match=f"after {k} tokens"):
            fast.generate(ids, max_new_tokens=NEW, do_sample=True, top_k=1, pad_token_id=0)
        monkeypatch.setattr(gen, "_warpers", real)
        assert _stance() == ("default", False), k
        assert torch.equal(fast.generate(ids, max_new_tokens=NEW, pad_token_id=0), expected), k


@pytest.mark.parametrize("how", ["signal", pytest.param("interrupt_main", marks=pytest.mark.slow)])
def test_an_interrupt_at_any_moment_leaves_the_model_usable(fast, how):
    # Ctrl-C (SIGINT to the main thread, or _thread.interrupt_main) at moments spread over a generation:
    # inside forwards (the caller waiting for the socket workers), in the token loop, at a step boundary
    ids = _prompt(7)
    expected = fast.generate(ids, max_new_tokens=NEW, pad_token_id=0)
    t0 = time.perf_counter()
    fast.generate(ids, max_new_tokens=NEW, pad_token_id=0)
    span = time.perf_counter() - t0
    main = threading.main_thread().ident
    fire = (lambda: signal.pthread_kill(main, signal.SIGINT)) if how == "signal" else _thread.interrupt_main
    interrupted, threads = _interrupt_generations(fast, ids, expected, span, fire)
    assert interrupted >= 6 and threading.active_count() == threads


def _interrupt_generations(fast, ids, expected, span, fire):
    """12 generations, each with ``fire`` timed at i / 12 of one; each checked usable after. Returns how
    many were interrupted and the thread count before."""
    threads = threading.active_count()
    interrupted = 0
    for i in range(12):
        timer = threading.Timer(span * i / 12, fire)
        try:
            timer.start()
            fast.generate(ids, max_new_tokens=NEW, pad_token_id=0)
            timer.join()
            time.sleep(0.01)   # an interrupt after the generation lands here
        except KeyboardInterrupt:
            interrupted += 1
        timer.join()
        backend_of(fast).group.settle()   # returns at once where the call settled its workers itself
        assert _settled(fast) and _stance() == ("default", False), i
        assert torch.equal(fast.generate(ids, max_new_tokens=NEW, pad_token_id=0), expected), i
    return interrupted, threads


@pytest.mark.slow
def test_a_forward_cut_short_leaves_no_worker_on_a_barrier(fast):
    # the caller interrupted while the workers are inside a forward (one socket held back, so the other
    # waits on the all-reduce): the call stops them and returns, and the next generation is right
    ids = _prompt(7)
    expected = fast.generate(ids, max_new_tokens=NEW, pad_token_id=0)
    group = backend_of(fast).group
    gate = threading.Event()

    def slow_socket_then_interrupt(rank):
        if rank == 1:
            _thread.interrupt_main()
            gate.wait(5)
        return rank

    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        group.run(lambda rank: (slow_socket_then_interrupt(rank), group.barrier(rank)))
    gate.set()
    assert time.perf_counter() - t0 < 10 and _settled(fast)
    assert torch.equal(fast.generate(ids, max_new_tokens=NEW, pad_token_id=0), expected)


def test_callers_on_several_threads_each_get_their_own_tokens(fast):
    # one compiled model, three threads generating different prompts at once: each equals its solo run
    # (generations queue; the caches serve one at a time)
    prompts = [_prompt(n, seed=n) for n in (5, 8, 11)]
    solo = [fast.generate(p, max_new_tokens=NEW, pad_token_id=0) for p in prompts]
    got: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def caller(i: int) -> None:
        try:
            start.wait()
            for round_ in range(3):
                got[i, round_] = fast.generate(prompts[i], max_new_tokens=NEW, pad_token_id=0)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for (i, round_), tokens in got.items():
        assert torch.equal(tokens, solo[i]), (i, round_)
    assert len(got) == 3 * len(prompts)



@pytest.mark.slow
def test_forwards_from_several_threads_each_get_their_own_logits(fast):
    # plain forwards (no cache) on one compiled model from three threads: the socket group runs one call
    # at a time (the others wait); each thread's logits equal eager's for its own input
    inputs = [_prompt(6, seed=s) for s in range(3)]
    model = fast._orig_mod
    with torch.inference_mode():
        expected = [model(input_ids=i).logits for i in inputs]
        fast(input_ids=inputs[0])   # built once before the threads start
    got: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def caller(i: int) -> None:
        try:
            start.wait()
            with torch.inference_mode():
                for round_ in range(5):
                    got[i, round_] = fast(input_ids=inputs[i]).logits
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(got) == 15
    for (i, _), logits in got.items():
        torch.testing.assert_close(logits, expected[i], atol=2e-5, rtol=1e-4)

def test_a_generation_started_from_its_own_callback_is_an_error(fast, monkeypatch):
    ids = _prompt(7)
    real = gen._warpers
    monkeypatch.setattr(gen, "_warpers", lambda *a: real(*a) + [
        lambda _, logits: fast.generate(ids, max_new_tokens=2, pad_token_id=0)])
    with pytest.raises(RuntimeError, match="from inside a generation of the same model on the same thread"):
        fast.generate(ids, max_new_tokens=3, do_sample=True, top_k=1, pad_token_id=0)
    monkeypatch.setattr(gen, "_warpers", real)
    group = backend_of(fast).group
    with pytest.raises(RuntimeError, match="from inside one of its own calls"):
        group.run(lambda rank: group.run(lambda r: r) if rank == 0 else rank)


def test_guards_are_skipped_only_while_one_generation_is_in_progress():
    # the stance is process-wide: a second generation (another thread, another model) puts every guard
    # back; a stance an interrupt left behind is undone by the next generation's start
    first = gen._GuardSkip()
    with first:
        for step in range(4):
            first.step(step)
        assert first._context is not None and _stance() == ("default", True)
        with gen._GuardSkip() as second:
            assert first._context is None and _stance() == ("default", False)
            for step in range(6):
                second.step(step)
                assert second._context is None
    assert _stance() == ("default", False)
    left = gen._GuardSkip()
    left.__enter__()
    for step in range(4):
        left.step(step)
    assert _stance() == ("default", True)   # never left: as if an interrupt cut its exit short
    with gen._GuardSkip():
        assert _stance() == ("default", False)
    left.__exit__(None, None, None)
    assert not gen._GuardSkip._live and gen._GuardSkip._ours is None


def _numatp_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("numatp-")]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["numatp.compile", "torch.compile"])
def test_a_dropped_compiled_model_releases_its_threads_shards_and_caches(how):
    import gc
    import weakref

    fresh_dynamo()
    ids = _prompt(7)
    threads = _numatp_threads()

    def run_and_drop() -> tuple[list, list, list]:
        torch.manual_seed(0)
        model = zoo.build("gpt2", tiny=True)
        if how == "numatp.compile":
            fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
        else:
            fast = torch.compile(model, backend="numatp", options={"sockets": shared_cpu_topology(2), "mode": "eager"})
        numatp.generate(fast, ids, max_new_tokens=4, pad_token_id=0)
        backend = backend_of(fast)
        assert len(_numatp_threads()) == len(threads) + 2
        shards = [weakref.ref(t) for t in backend.weights._made.values()]
        states = [weakref.ref(t) for r in range(2) for t in backend.states.tensors(r)]
        params = [weakref.ref(p) for p in model.parameters()]
        assert shards and states
        return shards, states, params

    shards, states, params = run_and_drop()   # the model and its compiled model go out of scope here
    gc.collect()
    assert _numatp_threads() == threads
    assert all(r() is None for r in shards + states + params)
    # a model compiled after still runs, and equals eager
    torch.manual_seed(0)
    model = zoo.build("gpt2", tiny=True)
    fast = numatp.compile(model, sockets=shared_cpu_topology(2), mode="eager")
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(fast.generate(ids, max_new_tokens=4, pad_token_id=0), expected)


@pytest.mark.slow
def test_a_closed_backend_says_so_when_its_model_is_called(fast):
    ids = _prompt(7)
    fast.generate(ids, max_new_tokens=2, pad_token_id=0)
    group = backend_of(fast).group
    assert len(group.thread_names) == 2
    backend_of(fast).close()
    assert group.thread_names == []
    with pytest.raises(RuntimeError, match="was released"):
        fast(input_ids=ids)
