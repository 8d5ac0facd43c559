"""Cost model: predict a block's time sharded (NUMA-TP), unsharded or on one socket, and choose.

::

    profile = load_profile("haswell-ex-4s")             # or a `numatp calibrate` JSON
    predict_model("gpt2", batch=1, seq=128, dtype="float32", profile=profile)["speedup"]
    decide(blocks_for("gpt2", 1, 128), profile, sockets=4)  # for policy="auto"
"""

from __future__ import annotations

from numatp.cost.decide import (Decision, choose, decide, default_profile, predict_decode, predict_hosts,
                                predict_model)
from numatp.cost.model import CHOICES, predict
from numatp.cost.profile import BUILTIN_PROFILES, MachineProfile, default_profile_path, load_profile, save_profile
from numatp.cost.shapes import BlockShape, blocks_for

__all__ = [
    "BUILTIN_PROFILES",
    "CHOICES",
    "BlockShape",
    "Decision",
    "MachineProfile",
    "blocks_for",
    "choose",
    "decide",
    "default_profile",
    "default_profile_path",
    "load_profile",
    "predict",
    "predict_decode", "predict_hosts",
    "predict_model",
    "save_profile",
]
