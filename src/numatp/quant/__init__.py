"""Quantized weights that arrive from outside numatp, read into numatp's own int8/int4 values.

:mod:`numatp.quant.torchao` reads the weights of a model quantized by torchao's weight-only configs
(``extract``) and turns such a model back into an ordinary float one (``dequantized``), so that the plan
traces it like any other and the quantized values, not a re-quantization, are what the sockets shard.
Nothing here imports torchao unless the model holds one of its tensors.
"""
