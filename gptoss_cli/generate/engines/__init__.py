"""Serving engines gptoss talks to: vLLM offline in its own interpreter (vllm_offline.py, which runs
vllm_worker.py there) and an OpenAI-compatible server that is already running (endpoint.py).

Both answer the interface of base.py: `score(prompts)` (prompt logprobs), `generate(prompts, sampling)`
(token ids and their logprobs), `load_weights(folder)` (a weight push, as RL rollouts need) and
`close()`. `serve-check` (gptoss_cli/parity/serve/check.py) uses them to compare the engine with gptoss.
"""
