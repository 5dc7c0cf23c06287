"""Checkpoints: what each format is (formats/), how bytes are read and written (storage/), and convert.

- formats/    the registry: one package and one row per format (hf/, original/, hybrid/, training/, megatron/,
              peft/): detection, architecture, opener, writer plan, --force policy, with the format's plan,
              record or config and readers beside its row; registry.py (what a row is), plan.py (what a
              writer plan is)
- storage/    byte-level I/O, format-agnostic: safetensors streaming, O_DIRECT, DCP, the reader Protocol,
              convert's thread pipeline, finiteness checks
- mapping.py  the HF <-> Hybrid table, which the HF, Hybrid, Megatron and PEFT formats, loading and parity share
- sources.py, convert.py, load.py   opening a SRC, `gptoss convert`, loading a model
- export_cost.py, make_tiny.py   what `--experts mxfp4` costs a model not trained in MXFP4; `gptoss make-tiny`
"""
