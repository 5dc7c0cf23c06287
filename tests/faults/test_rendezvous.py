"""A rank started the torchrun way (RANK, WORLD_SIZE, MASTER_ADDR set, no launcher of ours) whose peers never
join: SIGTERM and Ctrl-C end it at once and its heartbeat timeout ends it, instead of the 10-minute rendezvous."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import pytest

from tests.faults.conftest import TRAIN_FAST, assert_one_line, child_env, gptoss_cmd, wait_for
from tests.train.dist_helpers import free_port


def start_rank0_alone(tmp_path, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = dict(child_env(), RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cmd = gptoss_cmd("train", "--recipe", "tiny_cpu_ep2", f"logging.run_dir={tmp_path / 'run'}",
                     f"checkpoint.dir={tmp_path / 'ckpt'}", *TRAIN_FAST, *extra)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True), port


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("sig, code, label", [(signal.SIGTERM, 143, "terminated:"), (signal.SIGINT, 130, "interrupted:")])
def test_a_signal_ends_a_rank_waiting_for_peers_that_never_join(tmp_path, sig, code, label):
    proc, port = start_rank0_alone(tmp_path)
    try:
        wait_for(lambda: listening(port) or proc.poll() is not None, 120, "rank 0 to host the rendezvous")
        assert proc.poll() is None, proc.communicate()
        time.sleep(1)  # inside init_process_group now
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert_one_line((proc.returncode, err), code, "rank 0 was waiting for the other ranks (world size 2) to join at "
                    f"127.0.0.1:{port}", "nothing was left half-written", prefix=label)


def test_the_heartbeat_timeout_ends_a_rank_whose_peers_never_join(tmp_path):
    proc, port = start_rank0_alone(tmp_path, "system.heartbeat_timeout_s=2")
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert_one_line((proc.returncode, err), 1, f"to join at 127.0.0.1:{port}: not all of them joined within 2 s "
                    "(system.heartbeat_timeout_s)")
