"""Attention with learned sinks: the layer (layer.py), the entry points and the choice of kernel
(backends.py), the visibility rule as masks (masks.py), and the three kernels that compute the sink
softmax (sink_flash.py, sink_flex.py, sink_padded.py)."""
