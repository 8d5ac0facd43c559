"""Smoke test of an installed numatp (a wheel in a fresh environment): run by scripts/wheel-smoke.sh.

A tiny 2-layer GPT-2 compiled with ``numatp.compile(model, sockets=2)`` (2 virtual sockets) equals eager,
numatp is imported from the installed files (not a source tree), and its C++ library was built from the
installed sources into the empty ``$NUMATP_CACHE_DIR`` and ran the sockets' all-reduces.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch

import numatp
from numatp import zoo
from numatp.backend import backend_of
from numatp.runtime import native


def main(source_tree: Path) -> None:
    installed = Path(numatp.__file__).resolve().parent
    if installed.is_relative_to(source_tree.resolve()):
        sys.exit(f"wheel smoke: numatp was imported from the source tree ({installed}), not the installed wheel; "
                 f"run this script with a working directory outside {source_tree} and no PYTHONPATH")
    cache = Path(os.environ.get("NUMATP_CACHE_DIR", ""))
    if not str(cache) or any(cache.iterdir()):
        sys.exit("wheel smoke: set NUMATP_CACHE_DIR to an empty folder, so the C++ library is built from the "
                 "installed sources")
    for name in native.SOURCES:
        if not (installed / "runtime" / name).is_file():
            sys.exit(f"wheel smoke: the installed package lacks runtime/{name}; add it to pyproject's package-data")

    torch.manual_seed(0)
    model = zoo.build("gpt2", tiny=True)
    layers = model.config.n_layer
    inputs = zoo.example_inputs(model, batch=2, seq=16)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="numatp. virtual sockets")
        expected = model(**inputs).logits
        compiled = numatp.compile(model, sockets=2)
        actual = compiled(**inputs).logits
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=1e-4)

    library = native.library_path()
    if not library.is_relative_to(cache):
        sys.exit(f"wheel smoke: the C++ library {library} is not the one built into {cache}")
    performed = backend_of(compiled).performed
    # one all-reduce per attention and MLP block at least, each run by the C++ collective
    if performed["all_reduce"] < 2 * layers:
        sys.exit(f"wheel smoke: {performed['all_reduce']} all-reduces ran; a {layers}-layer model on 2 sockets "
                 f"performs at least {2 * layers}")
    print(f"wheel smoke: numatp {numatp.__version__} from {installed}, torch {torch.__version__}, "
          f"library {library.name}, {layers} layers on 2 sockets equal eager, performed {performed}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
