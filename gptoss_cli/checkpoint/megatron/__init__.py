"""Megatron-LM's `torch_dist` checkpoint of a GPT-OSS hybrid model, one concern per module.

A Megatron checkpoint folder (docs/megatron-checkpoints.md):

    <dir>/latest_checkpointed_iteration.txt   "release" or an iteration number
    <dir>/release/ or <dir>/iter_0000100/
        metadata.json      {"sharded_backend": "torch_dist", ...}: how the rest is stored
        common.pt          torch.save of the non-sharded state: `args` (an argparse.Namespace with the
                           architecture), `iteration`, `checkpoint_version`
        .metadata          DCP's pickled Metadata: every key, its global shape and its chunks
        __<rank>_<n>.distcp  the chunks, each a torch.save'd tensor (or raw bytes for objects)
    <dir>/run_config.yaml  (Megatron-Bridge) the model provider's settings, read when `args` lack a field

- names.py   file names, the sharded keys (experts stacked or `singleton_local_shards`, `_extra_state`), vocabulary padding
- args.py    the architecture as Megatron-LM's `args` (and Megatron-Bridge's run_config.yaml) record it
- common.py  common.pt through a restricted unpickler (nothing from the file is imported or run); the folder's checks
- reader.py  `MegatronReader`: the weights under Hybrid names, chunk by chunk
- writer.py  `MegatronWriter` and the folder files: what `convert --to megatron` writes
- plan.py    `ToMegatron`: the conversion plan
The registry row (detection, opener, `--force` policy) is checkpoint/formats/megatron.py.
"""
