"""The command line as a new user meets it: a bad model name or path is one line on stderr with exit code 2,
never a traceback (``--debug`` shows one), and it is refused before torch is imported or a model built;
``--help`` and ``numatp topo`` start without importing torch.

Each case runs ``numatp.cli.main`` in a fresh interpreter and reports whether torch was imported: an
argument refused before any model is built costs a fraction of a second, so these tests are fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from numatp import zoo

pytestmark = pytest.mark.integration   # the command line in subprocesses (no torch: fast)

SRC = str(Path(__file__).resolve().parents[1] / "src")

# Runs `numatp ARGS` through main and prints, after its exit code, whether torch was imported.
_PROBE = """
import json, sys
from numatp.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:          # argparse's own exits (--help, a bad option)
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules}))
"""


def _run(*args: str, cwd: Path | None = None, cache: Path | None = None) -> tuple[int, bool, str, str]:
    """(exit code, torch imported?, stdout without the probe line, stderr) of ``numatp ARGS``."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    if cache is not None:
        env["XDG_CACHE_HOME"] = str(cache)
        env.pop("NUMATP_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=300,
                       env=env, cwd=cwd)
    *out, probe = r.stdout.rstrip("\n").split("\n")
    state = json.loads(probe)
    return state["code"], state["torch"], "\n".join(out), r.stderr


def _refused(*args: str, cwd: Path | None = None) -> str:
    """Assert ``numatp ARGS`` fails with rc 2, one line, no traceback and without importing torch (nothing
    was built); returns that line."""
    code, torch_imported, _, err = _run(*args, cwd=cwd)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"numatp {next(a for a in args if not a.startswith('-'))}: "), err
    assert not torch_imported, f"torch was imported before {args} was refused"
    return err.strip()


# -- what is a preset and what is a path: zoo.resolve, the one place that decides -----------------------

def test_resolve_presets_folders_and_paths(tmp_path):
    assert zoo.resolve("gpt2") == zoo.ModelSource("gpt2", preset="gpt2")
    (tmp_path / "config.json").write_text("{}")
    assert zoo.resolve(str(tmp_path)) == zoo.ModelSource(str(tmp_path), folder=tmp_path)
    with pytest.raises(ValueError, match=r"unknown model 'gpt-2' \(did you mean 'gpt2'\?\).*llama-3.2-1b"):
        zoo.resolve("gpt-2")
    with pytest.raises(ValueError, match=r"did you mean 'llama'\?"):
        zoo.resolve("lama")
    with pytest.raises(ValueError, match=r"unknown model 'xyzzy': a model is one of the presets"):
        zoo.resolve("xyzzy")   # nothing close: no suggestion
    for path in ("./models/my-llama", "/no/such/folder", "~/no-such-numatp-model", "models/x"):
        with pytest.raises(ValueError, match=rf"^{path}: no such folder"):
            zoo.resolve(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="the folder holds no config.json"):
        zoo.resolve(str(empty))
    with pytest.raises(ValueError, match="is a file, not a folder"):
        zoo.resolve(str(tmp_path / "config.json"))


def test_build_uses_the_same_resolution():
    with pytest.raises(ValueError, match=r"/no/such/folder: no such folder"):
        zoo.build("/no/such/folder")
    with pytest.raises(ValueError, match=r"did you mean 'gpt2'"):
        zoo.describe("gpt-2")


# -- every bad name or path: one line, exit code 2, nothing built ----------------------------------------

@pytest.mark.parametrize("args, expected", [
    (("generate", "gpt-2"), "unknown model 'gpt-2' (did you mean 'gpt2'?)"),
    (("demo", "--model", "lama"), "unknown model 'lama' (did you mean 'llama'?)"),
    (("explain", "gpt-2"), "did you mean 'gpt2'?"),
    (("bench", "--model", "lama", "--out", "/nonexistent"), "--model unknown model 'lama' (did you mean 'llama'?)"),
    (("predict", "--platform", "haswell-2s", "--model", "gpt-2", "--batch", "1", "--seq", "8"), "did you mean 'gpt2'?"),
    (("generate", "/no/such/folder"), "/no/such/folder: no such folder"),
    (("demo", "--model", "/no/such/folder"), "/no/such/folder: no such folder"),
    (("generate", "./models/my-llama", "--prompt", "hello"), "./models/my-llama: no such folder"),
    (("explain", "gpt2", "--sockets", "0"), "--sockets 0: must be >= 1"),
    (("generate", "gpt2", "--sockets", "0"), "--sockets 0: must be >= 1"),
    (("generate", "gpt2", "--new-tokens", "0"), "--new-tokens 0: must be >= 1"),
    (("generate", "gpt2", "--tiny", "--prompt", "hi"), "'gpt2' is a preset (random weights, no tokenizer)"),
])
def test_bad_name_or_value_is_one_line_before_anything_is_built(args, expected):
    assert expected in _refused(*args)


_FORMATS = "int8, int8:a8, int4, int4:g32, int4:g64, int4:g128, int4:a8, int4:g32:a8, int4:g64:a8, int4:g128:a8"


@pytest.mark.parametrize("args, expected", [
    (("explain", "gpt2", "--weights", "int3"), f"--weights int3: not a format numatp stores weights in; pass one of "
                                                f"{_FORMATS}"),
    (("generate", "gpt2", "--weights", "int4:g48"), f"--weights int4:g48: not a format numatp stores weights in; "
                                                     f"pass one of {_FORMATS}"),
    (("demo", "--weights", "fp8"), f"--weights fp8: not a format numatp stores weights in; pass one of {_FORMATS}"),
    (("bench", "--weights", "none", "q4_0", "--out", "/nonexistent"), f"--weights q4_0: not a format numatp stores "
                                                                       f"weights in; pass one of none, {_FORMATS}"),
    (("serve", "gpt2", "--weights", "int3"), f"--weights int3: not a format numatp stores weights in; pass one of "
                                              f"{_FORMATS}"),
    (("explain", "gpt2", "--keep-head"), "--keep-head keeps the LM head in the model's dtype when --weights"),
    (("bench", "--weights", "none", "--keep-head", "--out", "/nonexistent"), "--keep-head keeps the LM head"),
    (("bench", "--modes", "baseline", "--weights", "int8", "--out", "/nonexistent"),
     "--weights quantizes the weights of the numatp modes (numatp, numatp-auto), and --modes baseline has none"),
])
def test_a_bad_weights_format_is_one_line_naming_it_and_the_formats(args, expected):
    assert expected in _refused(*args)


def test_every_compiling_command_takes_weights_and_keep_head():
    from numatp.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    for command in ("demo", "generate", "bench", "explain", "serve"):
        text = " ".join(subparsers.choices[command].format_help().split())
        assert "--weights {" in text and "int8,int8:a8,int4,int4:g32,int4:g64,int4:g128,int4:a8,int4:g32:a8,int4:g64:a8,int4:g128:a8}" in text, command
        assert "--keep-head with --weights: keep the LM head and the embedding tables in the model's dtype" in text
    assert "--weights {none,int8," in " ".join(subparsers.choices["bench"].format_help().split())


def test_weights_are_taken_in_their_canonical_names():
    from numatp.cli import build_parser
    from numatp.cli._weights import check_weight_args

    args = build_parser().parse_args(["generate", "gpt2", "--weights", "int4", "--keep-head"])
    check_weight_args("generate", args)
    assert args.weights == "int4:g64" and args.keep_head
    args = build_parser().parse_args(["bench", "--weights", "none", "INT8", "int4", "int4:g64"])
    check_weight_args("bench", args)
    assert args.weights == [None, "int8", "int4:g64"]   # one configuration per format, however spelled
    args = build_parser().parse_args(["explain", "gpt2"])
    check_weight_args("explain", args)
    assert args.weights is None and not args.keep_head


def test_the_commands_formats_are_the_librarys():
    from numatp.bench.spec import WEIGHTS, canonical_weights
    from numatp.runtime.gemm.quant import QuantFormat

    assert [canonical_weights(w) for w in WEIGHTS] == [QuantFormat.parse(w).name for w in WEIGHTS]


def test_a_missing_folder_is_never_called_a_preset(tmp_path):
    err = _refused("generate", "./models/my-llama", "--prompt", "hello", cwd=tmp_path)
    assert "no such folder" in err and "preset (random weights" not in err


def test_a_folder_with_no_checkpoint_or_no_tokenizer_says_what_is_missing(tmp_path):
    err = _refused("generate", str(tmp_path), "--prompt", "hello")
    assert "holds no config.json" in err and "sentencepiece" not in err and "tiktoken" not in err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    err = _refused("generate", str(tmp_path), "--prompt", "hello")
    assert "has no tokenizer files" in err and "tokenizer.json" in err and "--prompt-len" in err
    assert "--tiny shrinks presets only" in _refused("explain", str(tmp_path), "--tiny")


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback(where):
    args = ("--debug", "generate", "gpt-2") if where == "before" else ("generate", "gpt-2", "--debug")
    code, _, _, err = _run(*args)
    assert code == 2
    assert "Traceback (most recent call last)" in err and "ValueError: unknown model 'gpt-2'" in err
    assert err.strip().splitlines()[-1].startswith("numatp generate: unknown model 'gpt-2'")


# -- start-up: --help and commands without a model do not import torch -----------------------------------

COMMANDS = ("demo", "generate", "serve", "topo", "explain", "bench", "report", "calibrate", "predict")


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_does_not_import_torch(command):
    code, torch_imported, out, _ = _run(*([command] if command else []), "--help")
    assert code == 0 and "usage: numatp" in out
    assert not torch_imported, f"numatp {command or ''} --help imported torch"


def test_topo_without_a_gemm_table_does_not_import_torch(tmp_path):
    code, torch_imported, out, _ = _run("topo", cache=tmp_path)
    assert code == 0 and "Sockets numatp would use" in out and "none measured on this CPU yet" in out
    assert not torch_imported


def test_help_starts_fast():
    # A benchmark bounded far above the target (under 2 s on an idle machine) so that a loaded machine
    # does not fail it; the import checks above are the real guard.
    env = {**os.environ, "PYTHONPATH": SRC}
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "numatp", "--help"], capture_output=True, text=True, timeout=60, env=env)
    elapsed = time.perf_counter() - start
    assert r.returncode == 0 and "usage: numatp" in r.stdout
    assert elapsed < 10, f"numatp --help took {elapsed:.1f} s"


def test_a_warning_is_its_message_without_a_source_line():
    # a sysfs root without a node folder: Topology.detect warns and assumes one node
    code, _, _, err = _run("topo", "--sysfs-root", "/nonexistent")
    assert code == 0
    assert err.startswith("warning: /nonexistent/devices/system/node does not exist") and len(err.splitlines()) == 1
    code, _, _, err = _run("--debug", "topo", "--sysfs-root", "/nonexistent")
    assert code == 0 and "UserWarning" in err and "Topology.detect(" in err   # --debug keeps where it came from


def test_the_package_loads_its_names_on_first_use():
    # `import numatp` imports no torch; each public name is there on first use, and `numatp.generate` is the
    # function even when the submodule of that name was imported first
    code = ("import sys, types, numatp\n"
            "assert 'torch' not in sys.modules\n"
            "from numatp.generate import generate_timed\n"
            "assert callable(numatp.generate) and not isinstance(numatp.generate, types.ModuleType)\n"
            "assert numatp.generate.__module__ == 'numatp.generate'\n"
            "assert all(getattr(numatp, n) is not None for n in numatp.__all__)\n"
            "assert callable(numatp.backend.backend_of)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": SRC})
    assert r.returncode == 0, r.stderr
