"""rl.save_rollouts: the rollout files of a real tiny GRPO run against what they record, computed independently;
`gptoss report`'s summary of them (torch-free); bad files as one line; a file whole or absent after a SIGKILL.

The run (tests/rl/helpers.py's toy task: the reward is the share of even token ids) trains 2 steps on gptoss's
own engine in fp32. Its file's columns are checked against: the reward recomputed from the completion ids; the
group-relative advantage recomputed from the rewards (TRL's formula); the prompt and completion text decoded by
the `tokenizers` library itself; the step's metrics.jsonl (reward_mean, mismatch_kl from the file's engine and
trainer log-probs); the importance weights TRL's own code makes of those log-probs (tests/rl/test_trl_parity.py);
the expert routes' shape and validity (their values against transformers' routers: tests/rl/test_routing_replay.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gptoss_cli.rl.rollout_file import META_KEY, file_name, rollout_files, summarise_rollouts, write_rollout_file
from gptoss_cli.run.worker import run_worker
from tests.rl.helpers import TINY, grpo_job, metrics
from tests.support.cli import exit_and_output

pq = pytest.importorskip("pyarrow.parquet")
pa = pytest.importorskip("pyarrow")

GROUP = 8


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    job = grpo_job(tmp_path_factory.mktemp("saved"), train_iters=2, save_rollouts=True, is_correction="icepop",
                   is_min=0.5, is_max=2.0)
    run_worker(job)
    return Path(job.run_dir)


def _table(run_dir: Path, rollout: int):
    return pq.read_table(run_dir / "rollouts" / file_name(rollout))


def test_one_file_per_rollout_with_every_completion_its_reward_advantage_and_text(saved_run):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(saved_run.parent / "inputs" / "tokenizer.json"))
    assert [p.name for p in rollout_files(saved_run)] == [file_name(1), file_name(2)]
    for rollout, record in zip((1, 2), metrics(saved_run)):
        rows = _table(saved_run, rollout).to_pylist()
        assert len(rows) == 16 and {r["step"] for r in rows} == {rollout} and {r["rank"] for r in rows} == {0}
        rewards = [sum(1 for t in r["completion_ids"] if t % 2 == 0) / len(r["completion_ids"]) for r in rows]
        assert [r["reward"] for r in rows] == pytest.approx(rewards, abs=1e-12)
        assert np.mean(rewards) == pytest.approx(record["reward_mean"], abs=1e-12)
        for start in range(0, 16, GROUP):  # TRL's group-relative advantage, torch.std's unbiased std
            group = np.array(rewards[start:start + GROUP])
            want = (group - group.mean()) / (group.std(ddof=1) + 1e-4)
            assert [r["advantage"] for r in rows[start:start + GROUP]] == pytest.approx(want, abs=1e-5)
        for r in rows:
            assert r["prompt_text"] == tok.decode(r["prompt_ids"], skip_special_tokens=False)
            assert r["completion_text"] == tok.decode(r["completion_ids"], skip_special_tokens=False)
            assert r["finish"] in ("stop", "length") and 1 <= len(r["completion_ids"]) <= 8


def test_the_files_logprobs_give_the_steps_mismatch_and_trls_importance_weights(saved_run):
    from tests.rl.test_trl_parity import trl_importance_ratio

    meta = json.loads(_table(saved_run, 1).schema.metadata[META_KEY])
    assert meta["is_correction"] == {"mode": "icepop", "is_min": 0.5, "is_max": 2.0, "sequence_ratio": "geometric"}
    for rollout, record in zip((1, 2), metrics(saved_run)):
        rows = _table(saved_run, rollout).to_pylist()
        n = max(len(r["completion_ids"]) for r in rows)

        def padded(name: str) -> torch.Tensor:
            return torch.tensor([r[name] + [0.0] * (n - len(r[name])) for r in rows], dtype=torch.float32)

        engine, trainer = padded("engine_logprobs"), padded("trainer_logprobs")
        mask = torch.tensor([[1.0] * len(r["completion_ids"]) + [0.0] * (n - len(r["completion_ids"])) for r in rows])
        d = (trainer - engine) * mask
        assert float(((torch.exp(d) - 1 - d) * mask).sum() / mask.sum()) == pytest.approx(record["mismatch_kl"],
                                                                                         rel=1e-4, abs=1e-12)
        assert 0 < d.abs().max() < 1e-4  # the fp32 decode against the full forward: rounding, not equality
        want = trl_importance_ratio("token_mask", trainer, engine, mask, 0.5, 2.0)
        assert torch.equal(padded("is_weights") * mask, want * mask)


def test_the_routes_are_every_fed_tokens_k_distinct_experts_per_moe_layer(saved_run):
    table = _table(saved_run, 1)
    meta = json.loads(table.schema.metadata[META_KEY])["routes"]
    layers, k = len(meta["moe_layers"]), meta["top_k"]
    assert (layers, k) == (TINY.hybrid_layer_pattern.count("E"), TINY.num_experts_per_tok)
    assert table.schema.field("routes").type == pa.list_(pa.binary(layers * k))
    for r in table.to_pylist():
        ids = np.frombuffer(b"".join(r["routes"]), dtype=np.uint8).reshape(-1, layers, k)
        assert ids.shape[0] == len(r["prompt_ids"]) + len(r["completion_ids"]) - 1
        assert ids.max() < TINY.num_local_experts
        assert all(len(set(token_layer)) == k for token_layer in ids.reshape(-1, k).tolist())


def test_routes_are_written_layer_major_and_null_without_a_capture(tmp_path):
    routes = [np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2), None]
    rows = [_row(step=1, ids=[5, 6, 7]), _row(step=1, ids=[8])]
    meta = {"routes": {"moe_layers": [0, 1, 2], "top_k": 2}}
    write_rollout_file(tmp_path, 1, rows, routes, meta)
    got = pq.read_table(tmp_path / file_name(1)).column("routes").to_pylist()
    assert [bytes(t) for t in got[0]] == [bytes(range(0, 6)), bytes(range(6, 12))] and got[1] is None


def _row(step: int, ids: list[int], reward: float | None = 1.0, weights: list[float] | None = None) -> dict:
    return {"step": step, "rank": 0, "prompt": 0, "prompt_source": "p.jsonl:1", "prompt_ids": [1, 2],
            "prompt_text": "prompt", "completion_ids": ids, "completion_text": "completion", "final_text": "final",
            "finish": "stop", "reward": reward, "advantage": 0.0, "engine_logprobs": [-1.0] * len(ids),
            "trainer_logprobs": [-1.0] * len(ids), "is_weights": weights if weights is not None else [1.0] * len(ids)}


def test_report_summarises_the_rollouts_without_torch(saved_run, tmp_path):
    """`gptoss report --json` in a child process where importing torch fails."""
    out = tmp_path / "summary.json"
    code = ("import sys; sys.modules['torch'] = None\n"
            "from gptoss_cli.cli import main\n"
            f"sys.argv = ['gptoss', 'report', {str(saved_run)!r}, '--no-plots', '--json', {str(out)!r}]\n"
            "main()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())["rollouts"]
    rewards = [x for n in (1, 2) for x in _table(saved_run, n).column("reward").to_pylist()]
    assert (r["files"], r["completions"], r["steps"]) == (2, 32, [1, 2])
    assert r["reward"]["mean"] == pytest.approx(np.mean(rewards)) and r["reward"]["median"] == np.median(rewards)
    assert r["masked_tokens"] == 0.0 and r["masked_completions"] == 0.0  # fp32: every ratio is 1 to 1e-4
    assert [e["which"] for e in r["examples"]] == ["first", "best of the last", "worst of the last"]
    assert "rollouts: 32 completions in 2 files" in proc.stdout


def test_the_summary_counts_masked_tokens_failed_rewards_and_truncated_completions(tmp_path):
    rows = [_row(3, [1, 2, 3, 4], 0.5, [0.0, 1.1, 0.0, 0.9]), _row(3, [5, 6], None, [0.0, 0.0]),
            _row(4, [7, 8], 1.5, [1.0, 1.0])]
    rows[2]["finish"] = "length"
    write_rollout_file(tmp_path / "rollouts", 2, rows, [None] * 3, {"is_correction": {"mode": "icepop"}})
    r = summarise_rollouts(tmp_path)
    assert r["masked_tokens"] == pytest.approx(4 / 8) and r["masked_completions"] == pytest.approx(1 / 3)
    assert r["reward"]["failed"] == 1 and r["reward"]["mean"] == pytest.approx(1.0) and r["steps"] == [3, 4]
    assert r["completion_length"] == {"mean": pytest.approx(8 / 3), "min": 2, "max": 4, "truncated": pytest.approx(1 / 3)}


BAD = {
    "not parquet": lambda path: path.write_bytes(b"PAR1 not really"),
    "no metadata": lambda path: pq.write_table(pa.table({"step": [1]}), path),
    "wrong type": lambda path: pq.write_table(pa.table({"step": ["1"]}).replace_schema_metadata(
        {META_KEY: json.dumps({"format": "gptoss-rollouts", "version": 1}).encode()}), path),
    "short logprobs": lambda path: _short_logprobs(path),
    "newer version": lambda path: pq.write_table(pa.table({"step": [1]}).replace_schema_metadata(
        {META_KEY: json.dumps({"format": "gptoss-rollouts", "version": 2}).encode()}), path),
}


def _short_logprobs(path: Path) -> None:
    row = _row(1, [1, 2, 3])
    row["engine_logprobs"] = [-1.0]
    write_rollout_file(path.parent, 1, [row], [None], {})


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_rollout_file_is_one_line_naming_it_exit_2(saved_run, tmp_path, case):
    run = tmp_path / "run"
    (run / "rollouts").mkdir(parents=True)
    (run / "metrics.jsonl").write_bytes((saved_run / "metrics.jsonl").read_bytes())
    BAD[case](run / "rollouts" / file_name(1))
    code, out = exit_and_output("report", run, "--no-plots")
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and file_name(1) in lines[0], out


# rows whose long texts make the Parquet write and its fsync most of each iteration (about 85%), so that most kills
# land while a file is being written under its temporary name
WRITER = """
import random, sys
from pathlib import Path
from gptoss_cli.rl.rollout_file import write_rollout_file
rng = random.Random(0)
rows = [{"step": 1, "rank": 0, "prompt": 0, "prompt_source": "p:1", "prompt_ids": [1, 2], "prompt_text": "x",
         "completion_ids": list(range(20)), "completion_text": rng.randbytes(25000).hex(),
         "final_text": "", "finish": "length", "reward": 0.5, "advantage": 0.0, "engine_logprobs": [-1.0] * 20,
         "trainer_logprobs": [-1.0] * 20, "is_weights": [1.0] * 20} for _ in range(ROWS)]
for n in range(1, 10**6):
    write_rollout_file(Path(sys.argv[1]), n, rows, [None] * len(rows), {})
    print(n, flush=True)
"""
ROWS = 100


def test_a_sigkill_leaves_every_rollout_file_whole_or_absent(tmp_path):
    """A child writing rollout files back to back is SIGKILLed at several moments; every file then present reads
    whole, a temporary name is never read (and some kill left one: the case was exercised), and the next write
    of that rollout removes it."""
    folder = tmp_path / "run" / "rollouts"
    leftovers: set[str] = set()
    for delay in (0.1, 0.2, 0.3, 0.4, 0.5):
        proc = subprocess.Popen([sys.executable, "-c", WRITER.replace("ROWS", str(ROWS)), str(folder)],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "1"  # one file is whole before the kill
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        for path in rollout_files(tmp_path / "run"):
            assert pq.read_table(path).num_rows == ROWS, path
        leftovers |= {p.name for p in folder.iterdir() if p.name.startswith(".")}
    summary = summarise_rollouts(tmp_path / "run")
    assert summary["completions"] == ROWS * summary["files"]
    assert leftovers, "no kill landed inside a write"
    for p in [p for p in folder.iterdir() if p.name.startswith(".")]:  # the next write of its rollout removes it
        write_rollout_file(folder, int(p.name.split("_")[1].split(".")[0]), [_row(1, [1])], [None], {})
        assert not p.exists()
