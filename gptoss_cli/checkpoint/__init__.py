"""Checkpoints: what each format is (formats/, megatron/), how bytes are read and written (storage/), and convert.

- formats/    the registry: one module and one row per format (HF, OpenAI original/, Hybrid, training run,
              Megatron torch_dist, PEFT adapter): detection, architecture, opener, writer plan, --force policy
- storage/    byte-level I/O, format-agnostic: safetensors streaming, O_DIRECT, DCP, the reader Protocol,
              convert's thread pipeline, finiteness checks
- megatron/   Megatron-LM's torch_dist format (names, args, common.pt, reader, writer, plan)
- mapping.py, layouts.py, hf_config.py   the HF <-> Hybrid table, stored expert forms, config.json <-> architecture
- hybrid_format.py, training_format.py, peft_format.py   those formats' files and records
- sources.py, convert.py, convert_plan.py, load.py   opening a SRC, `gptoss convert`, its plans, loading a model
- lora_merge.py, make_tiny.py   a LoRA checkpoint read as merged weights; `gptoss make-tiny`
"""
