"""MXFP4 in the model: the codec (codec.py), frozen experts kept as MXFP4 blocks/scales
(experts.py), and quantisation-aware training of the experts (qat.py)."""
