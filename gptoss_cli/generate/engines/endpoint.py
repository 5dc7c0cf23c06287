"""An OpenAI-compatible server that is already running (vLLM's, SGLang's): the deployment itself.

Prompts go as token ids (`"prompt": [ids]` on /v1/completions, no tokenizer involved); prompt
logprobs come back through the `prompt_logprobs` extension vLLM and SGLang accept (-1 or a k);
`generate` asks for `logprobs` of the sampled tokens with `return_tokens_as_token_ids`. Only the
standard library is used (urllib). The served model is the server's: `load_weights` is not
something an endpoint offers here.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any, Sequence

import numpy as np

from gptoss_cli.generate.engines.base import Completion, EngineError, EngineInfo, PromptScores, SamplingParams, one_line

DEFAULT_TIMEOUT_S = 600.0


class EndpointEngine:
    """The Engine interface over HTTP (see the module docstring)."""

    def __init__(self, url: str, *, model: str | None = None, vocab_size: int, api_key: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if not url.startswith(("http://", "https://")):
            raise EngineError(f"--endpoint {url}: not an http(s) URL", hint="e.g. http://127.0.0.1:8000")
        self.url = url.rstrip("/").removesuffix("/v1")
        self.api_key, self.timeout_s, self.vocab_size = api_key, timeout_s, vocab_size
        models = self._request("GET", "/v1/models", None, "listing the served models")
        names = [m.get("id") for m in models.get("data", []) if isinstance(m, dict)]
        if model is None:
            if not names:
                raise EngineError(f"--endpoint {self.url}: /v1/models lists no model")
            model = names[0]
        elif model not in names:
            raise EngineError(f"--endpoint {self.url}: serves {names}, not {model!r}", hint="pass --served-model NAME")
        self.model = model
        version = self._version()
        self.info = EngineInfo(version[0], version[1], device="server", url=self.url)

    def _version(self) -> tuple[str, str]:
        try:
            data = self._request("GET", "/version", None, "asking the version")
            return "vllm", str(data.get("version", "unknown"))
        except EngineError:
            return "openai-compatible", "unknown"

    def _request(self, method: str, path: str, body: dict[str, Any] | None, what: str) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            try:
                detail = json.loads(detail).get("error", {}).get("message", detail)
            except (ValueError, AttributeError):
                pass
            raise EngineError(f"--endpoint {self.url}{path}: {what}: HTTP {exc.code}: {one_line(detail)}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise EngineError(f"--endpoint {self.url}: {what}: {one_line(str(reason))}",
                              hint="is the server running and reachable?") from None
        except ValueError as exc:
            raise EngineError(f"--endpoint {self.url}{path}: {what}: not JSON ({exc})") from None

    def _complete(self, prompt: Sequence[int], what: str, **fields: Any) -> dict[str, Any]:
        body = {"model": self.model, "prompt": [int(t) for t in prompt], **fields}
        data = self._request("POST", "/v1/completions", body, what)
        choices = data.get("choices") or []
        if not choices:
            raise EngineError(f"--endpoint {self.url}: {what}: the answer holds no choices")
        return choices[0]

    def score(self, prompts: Sequence[Sequence[int]], top_k: int | None = None) -> list[PromptScores]:
        out = []
        for i, prompt in enumerate(prompts):
            choice = self._complete(prompt, f"scoring prompt {i}", max_tokens=1, temperature=0.0,
                                    prompt_logprobs=-1 if top_k is None else int(top_k))
            rows = choice.get("prompt_logprobs")
            if not isinstance(rows, list) or len(rows) != len(prompt):
                raise EngineError(f"--endpoint {self.url}: the server returned no prompt logprobs for prompt {i}",
                                  hint="vLLM and SGLang accept `prompt_logprobs` on /v1/completions")
            out.append(_scores(list(prompt), rows[1:], top_k, self.vocab_size))
        return out

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Completion]:
        out = []
        for i, prompt in enumerate(prompts):
            choice = self._complete(prompt, f"generating for prompt {i}", max_tokens=sampling.max_tokens,
                                    temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                                    stop_token_ids=list(sampling.stop_token_ids), logprobs=max(sampling.logprobs, 1),
                                    return_tokens_as_token_ids=True)
            lp = choice.get("logprobs") or {}
            ids = [_token_id(t) for t in lp.get("tokens") or []]
            out.append(Completion(ids, [float(x) for x in lp.get("token_logprobs") or []], choice.get("finish_reason")))
        return out

    def load_weights(self, folder: str) -> None:
        raise EngineError(f"--endpoint {self.url}: weights cannot be pushed into a running server from here")

    def close(self) -> None:
        pass


def _token_id(key: Any) -> int:
    """A token as the server names it: an id, "123", or "token_id:123" (return_tokens_as_token_ids)."""
    text = str(key)
    try:
        return int(text.removeprefix("token_id:"))
    except ValueError:
        raise EngineError(f"the server named a token {text!r}, not an id",
                          hint="serve with token ids (vLLM: --skip-tokenizer-init or return_tokens_as_token_ids)") from None


def _scores(prompt: list[int], rows: list[Any], top_k: int | None, vocab: int) -> PromptScores:
    def value(v: Any) -> float:
        x = v.get("logprob") if isinstance(v, dict) else v
        x = float("-inf") if x is None else float(x)
        return x if not math.isnan(x) else float("-inf")

    if top_k is None:
        lp = np.full((len(rows), vocab), -np.inf, dtype=np.float32)
        for p, row in enumerate(rows):
            for k, v in (row or {}).items():
                lp[p, _token_id(k)] = value(v)
        return PromptScores(prompt, lp)
    width = int(top_k) + 1
    ids = np.full((len(rows), width), -1, dtype=np.int64)
    lp = np.full((len(rows), width), -np.inf, dtype=np.float32)
    for p, row in enumerate(rows):
        for j, (k, v) in enumerate(list((row or {}).items())[:width]):
            ids[p, j], lp[p, j] = _token_id(k), value(v)
    return PromptScores(prompt, lp, ids)


__all__ = ["EndpointEngine"]
