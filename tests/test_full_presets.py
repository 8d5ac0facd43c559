"""Full-size presets: the pass plans them and its reference executor equals eager (slow: outside CI).

    python -m pytest -m full tests/test_full_presets.py -s
"""

from __future__ import annotations

import pytest
import torch

from numatp import zoo
from numatp.plan import capture, localize, plan_graph, run_reference
from tests.helpers import assert_close_to_eager

pytestmark = [pytest.mark.slow, pytest.mark.full, pytest.mark.timeout(1800)]   # full-size models: minutes each here


@pytest.mark.parametrize("preset", ["gpt2", "gpt2-medium", "gpt2-large", "bert-small", "bert-large", "gemma3-270m"])
def test_full_preset_plan_and_reference(preset):
    model = zoo.build(preset)
    inputs = zoo.example_inputs(model, batch=1, seq=32)
    with torch.no_grad():
        expected = model(**inputs).logits
    (ag, real), = capture(model, **inputs)
    for sockets in (2, 4):
        plan = plan_graph(ag, sockets)
        assert plan.reductions == 2 * model.config.num_hidden_layers + 1
        share = (plan.model_bytes - plan.replicated_bytes) / plan.model_bytes
        (logits,) = run_reference([localize(ag, plan, r) for r in range(sockets)], real)
        diff = assert_close_to_eager(logits, expected, f"{preset} {sockets} sockets")
        print(f"\n{preset} sockets={sockets}: sharded weight bytes {100 * share:.1f}%, max |diff| {diff:.2e}")
