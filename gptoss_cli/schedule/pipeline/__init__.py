"""Pipeline parallelism on torch.distributed.pipelining (docs/pipeline-parallel.md).

layout.py (torch-free: the recipe rules and the memory estimate read it) splits the Hybrid layer
stack into pipeline stages and places them on ranks; stage.py builds a rank's stages (model chunks)
as `torch.distributed.pipelining.PipelineStage`s; schedule.py runs a training step through one of
torch's schedules with the same contract as the other microbatch schedules (gptoss_cli/schedule/).
"""
