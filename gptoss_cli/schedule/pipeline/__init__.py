"""Pipeline parallelism on torch.distributed.pipelining (docs/pipeline-parallel.md).

layout.py (torch-free: the recipe rules and the memory estimate read it) splits the Hybrid layer
stack into pipeline stages and places them on ranks; stage.py builds a rank's stages (model chunks)
as `torch.distributed.pipelining.PipelineStage`s (`RankStage`); plan_stage.py runs them as
schedule-plan nodes for EP overlap under DualPipeV (`PlanStage`); schedule.py runs a training step
through one of torch's schedules with the same contract as the other microbatch schedules (the
parent package). Only layout.py is imported by a run without pipelining: the others import
torch.distributed.pipelining (seconds), and reach its private names through gptoss_cli/torch_private.py.
"""
