"""GEMM providers for weight matmuls, measured per shape and cached on disk per CPU.

The package splits along its seams:

- :mod:`~numatp.runtime.gemm.providers`: the registry (``PROVIDERS``), the shape a provider runs
  (``GemmShape``) and ``numatp::linear``'s codes for them (``NATIVE``);
- :mod:`~numatp.runtime.gemm.measurement`: timing providers at a shape on a socket's thread (``measure_all``);
  a measurement that fails or reads nothing is 0.0, never a rate;
- :mod:`~numatp.runtime.gemm.table`: the rate table, ``{shape key: {provider: GFLOP/s}}`` in
  ``gemm-<cpu signature>-v<format>.json``, written under a file lock by any number of processes;
- :mod:`~numatp.runtime.gemm.op`: the ``numatp::gemm`` op of rewritten programs, the executor's step for
  it, and ``PackInfo``, what a prepared operand is.

Choosing a provider per weight is planning (:mod:`numatp.plan.gemm_choice`, applied by
:mod:`numatp.plan.gemm_pass`). Rates are keyed by ``(dtype, M, K, N, layout, threads)``; the signature
hashes the CPU's model and flags and the torch version
(:class:`~numatp.topology.resources.MachineFacts`), so another CPU re-measures.
"""

from numatp.runtime.gemm.measurement import (CEILING_SHAPE, STREAM_MAX_BYTES, decode_shape, measure, measure_all,
                                         measure_ceilings, measure_missing, streamed_copies, streams)
from numatp.runtime.gemm.op import GEMM_OP, GemmStep, PackInfo, PreparedOperands, gemm, stand_in
from numatp.runtime.gemm.providers import (GEMV_MAX_ROWS, IN_PLACE, NATIVE, PROVIDERS, GemmShape, Provider,
                                           amx_usable, call_into, dot_usable, native_code)
from numatp.runtime.gemm.table import (TABLE_FORMAT, GemmTable, ceiling_table, ceilings, default_cache_dir,
                                       is_rate, usable_rates)
from numatp.topology.resources import MachineFacts, cpu_signature

__all__ = ["CEILING_SHAPE", "GEMM_OP", "GEMV_MAX_ROWS", "IN_PLACE", "NATIVE", "PROVIDERS", "STREAM_MAX_BYTES",
           "TABLE_FORMAT", "GemmShape", "GemmStep", "GemmTable", "MachineFacts", "PackInfo", "PreparedOperands",
           "Provider", "amx_usable", "call_into", "ceiling_table", "ceilings", "cpu_signature", "decode_shape",
           "default_cache_dir", "dot_usable", "gemm", "is_rate", "measure", "measure_all", "measure_ceilings",
           "measure_missing", "native_code", "stand_in", "streamed_copies", "streams", "usable_rates"]
