"""The save stall: how long a training step that saves a checkpoint takes against an ordinary step, with
`checkpoint.async_save` off (DCP's synchronous save, what every run did before) and on (DCP's async_save: the
state staged to host memory, written while the next steps run), in one run.

Each side is `gptoss train` in a fresh process on one CPU process (world size 1, fp32, mock data) with a model
large enough for the save to matter on this host (--hidden, --experts, --layers; at the real vocabulary of
201,088 by default: about 1 GB of weights and 3 GB of checkpoint with the optimizer's moments), saving every
--every steps. The child records when each step's metrics are written (`Trainer.record_step`), so a step's wall
time is the time since the previous step's record: the save of step s (taken after its record) lands in step
s + 1's time, and with async_save the upload overlaps the steps after it. Per side the bench prints the median
ordinary step, the median step that carries a save, their ratio (the save stall: 1.0 is free), and the time the
training thread spent inside the save call, and of it the time waiting for the previous upload (one is in
flight at a time: saves more frequent than the disk can take wait for it, and the bench says so); the first save
(which allocates the host buffers) and the last (the run's end) are left out of the medians when --steps allows.
Sides run in interleaved rounds (sync, async, then async, sync...).

    python bench/async_save.py --rounds 3
    python bench/async_save.py --hidden 128 --vocab 4096 --steps 6 --every 3 --rounds 1   # a smoke run
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import harness  # noqa: E402

SIDES = {"sync": "false", "async": "true"}


def child(args: list[str], out: Path) -> None:
    """Run `gptoss train ARGS` here, recording each step's end and the training thread's time in each save."""
    import gptoss_cli.train.async_save as async_save
    import gptoss_cli.train.loop as loop
    from gptoss_cli.cli import app

    ends, saves, waited = [], [], [0.0]
    record, save = loop.Trainer.record_step, loop.Trainer.save_checkpoint
    wait = async_save.AsyncCheckpointer.wait

    def timed_wait(self):
        t0 = time.perf_counter()
        try:
            return wait(self)
        finally:
            waited[0] += time.perf_counter() - t0

    def timed_record(self, outcome, extra=None):
        result = record(self, outcome, extra)
        ends.append((outcome.step, time.perf_counter()))
        return result

    def timed_save(self, done, reason=None):
        t0, waited[0] = time.perf_counter(), 0.0
        try:
            return save(self, done, reason)
        finally:
            saves.append((done, time.perf_counter() - t0, waited[0]))

    loop.Trainer.record_step, loop.Trainer.save_checkpoint = timed_record, timed_save
    async_save.AsyncCheckpointer.wait = timed_wait
    try:
        code = app(args, standalone_mode=False)
        if code:
            raise SystemExit(code)
    finally:
        out.write_text(json.dumps({"ends": ends, "saves": saves}))


def run_side(side: str, opts, work: Path, env: dict) -> dict:
    ckpt, run_dir, out = work / f"ckpt-{side}", work / f"run-{side}", work / f"{side}.json"
    for p in (ckpt, run_dir):
        shutil.rmtree(p, ignore_errors=True)
    train = ["train", "--recipe", str(ROOT / "recipes" / "bases" / "tiny_cpu.yaml"), "parallelism.world_size=1", "parallelism.expert_model_parallel_size=1",
             "precision.params_dtype=fp32", f"model.architecture.hidden_size={opts.hidden}",
             f"model.architecture.intermediate_size={opts.hidden}", f"model.architecture.num_local_experts={opts.experts}",
             f"model.architecture.num_hidden_layers={opts.layers}", f"model.architecture.vocab_size={opts.vocab}",
             "model.architecture.num_attention_heads=8", "model.architecture.num_key_value_heads=2",
             "model.architecture.head_dim=64", "training.micro_batch_size=1", "training.global_batch_size=1",
             f"training.seq_length={opts.seq}", f"training.train_iters={opts.steps}", "training.warmup_iters=0",
             f"checkpoint.dir={ckpt}", f"checkpoint.save_interval={opts.every}", "checkpoint.keep_last=1",
             f"checkpoint.async_save={SIDES[side]}", f"logging.run_dir={run_dir}", "--quiet"]
    proc = subprocess.run([sys.executable, __file__, "--child", str(out), *train], cwd=work, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench: {side}: gptoss train exited {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}")
    rec = json.loads(out.read_text())
    ends = dict((int(s), t) for s, t in rec["ends"])
    saved = {int(s) for s, _, _ in rec["saves"]}
    # step s's time: since step s - 1's record (step 1 and the first step after it warm up: left out)
    times = {s: ends[s] - ends[s - 1] for s in ends if s - 1 in ends and s > 2}
    # the last save ends the run either way; the first allocates the host buffers (once per run): both left out
    # where enough saves remain
    kept = sorted((int(s), d, w) for s, d, w in rec["saves"] if int(s) < opts.steps)
    kept = kept[1:] if len(kept) > 1 else kept
    carrying = [t for s, t in times.items() if s - 1 in {k[0] for k in kept}]
    ordinary = [t for s, t in times.items() if s - 1 not in saved]
    in_save, waits = [d for _, d, _ in kept], [w for _, _, w in kept]
    if not carrying or not ordinary:
        raise SystemExit("bench: no step carried a save; raise --steps or lower --every")
    step, saving = statistics.median(ordinary), statistics.median(carrying)
    return {"step_s": step, "saving_step_s": saving, "stall_x": saving / step,
            "in_save_s": statistics.median(in_save), "waited_s": statistics.median(waits),
            "checkpoint_gb": _size(ckpt) / 1e9}


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[3:], Path(sys.argv[2]))
        return 0
    ap = harness.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=201088)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--every", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each training process")
    opts = ap.parse_args()
    env = harness.peer_env(opts.threads, {"COLUMNS": "120"})
    with harness.Run("async_save", opts, clock="wall") as run, \
            tempfile.TemporaryDirectory(prefix="gptoss-bench-async-save-") as tmp:
        work = Path(tmp)
        rounds = harness.Rounds(SIDES)
        for i in range(opts.rounds):
            for side in harness.rotating(list(SIDES), i):
                rounds.add(side, run_side(side, opts, work, env))
    metrics = ("step_s", "saving_step_s", "stall_x", "in_save_s", "waited_s", "checkpoint_gb")
    run.add_rounds("save every %d steps" % opts.every, rounds, metrics)
    case = "save every %d steps" % opts.every
    run.ratio(case, "async", "sync", "saving_step_s", name="saving step, async / sync")
    print(f"{opts.rounds} rounds, rotating order, medians [min, max]; {opts.threads} thread(s); "
          f"checkpoint {rounds.median('sync', 'checkpoint_gb'):.2f} GB")
    print(f"{'side':<6} {'ordinary step (s)':>22} {'saving step (s)':>22} {'stall (x)':>20} {'in save (s)':>20} "
          f"{'of it waiting (s)':>20}")
    for side in SIDES:
        cols = [f"{s['median']:6.2f} [{s['min']:5.2f}, {s['max']:5.2f}]"
                for s in (run.cases[case]["settings"][side][k] for k in metrics[:5])]
        print(f"{side:<6} {cols[0]:>22} {cols[1]:>22} {cols[2]:>20} {cols[3]:>20} {cols[4]:>20}")
    if rounds.median("async", "waited_s") > 0.01:
        print("note: async saves waited for the previous upload: the upload takes longer than --every steps "
              "(raise --every to measure the stall itself)")
    for label, r in run.cases[case]["ratios"].items():
        print(f"{label}: {r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]")
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
