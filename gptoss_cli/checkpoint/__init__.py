"""Checkpoint formats: safetensors streaming I/O, the MXFP4 codec, the HF<->Hybrid mapping table, conversion."""
