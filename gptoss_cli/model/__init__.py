"""The GPT-OSS architecture and the Hybrid model in pure PyTorch.

No I/O and no process groups of its own: the layers that communicate (the token dispatcher's
all-to-alls, context parallelism's around attention) run collectives over the groups, or the
communication object, handed to them; creating those is parallel/'s job."""
