"""Slurm for real: the recipe of docs/multi-host.md, word for word, on a two-node Slurm cluster
made on this machine (scripts/slurm.sh: network namespaces, munge, slurmctld, two slurmd).
One job trains to the end; one is preempted with `scancel --signal=TERM` and saves on every
rank; its resubmission resumes, survives a kill -9 on one node under --max-restarts, and ends
bit-identical to the first; one is preempted by `--signal=USR1@N` and saves.

Runs behind `make test-slurm` (and `make test-slow`); skips, saying why, where the cluster cannot
be made (not root, the Slurm packages missing, no network namespaces).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.audit import check_stream, read_trajectory
from tests.slurm_cluster import REPO, SlurmCluster, slurm_unavailable

DOC = REPO / "docs" / "multi-host.md"
SAMPLES = 64
STEPS = 24


def recipe(kind: str) -> str:
    """The batch script of docs/multi-host.md marked ``<!-- slurm-recipe: KIND -->``."""
    found = re.search(rf"<!-- slurm-recipe: {kind} -->\n```sh\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"docs/multi-host.md has no {kind} Slurm recipe"
    return found.group(1)


def test_the_gpu_recipe_is_the_cpu_recipe_with_gpus() -> None:
    cpu, gpu = recipe("cpu").splitlines(), recipe("gpu").splitlines()
    assert [line for line in gpu if line not in cpu] == [
        "#SBATCH --gpus-per-node=8",
        'export NPROC="${NPROC:-8}"         # workers per node: one per GPU',
    ]
    assert [line for line in cpu if line not in gpu] == [
        'export NPROC="${NPROC:-4}"         # workers per node'
    ]


def write_job(tmp_path: Path, name: str, steps: int = STEPS) -> tuple[Path, Path]:
    run_dir = tmp_path / f"{name}-run"
    lines = [
        "[run]",
        f'dir = "{run_dir}"',
        'task = "tests.tasks:tiny_gpt"',
        "[data]",
        "global_batch_size = 8",
        "[train]",
        f"steps = {steps}",
        "log_every = 1",
        "[eval]",
        "every = 0",
        "[checkpoint]",
        "every = 4",
        "[optim]",
        'name = "adamw"',
        "lr = 0.003",
        "[fault]",
        "audit_sample_ids = true",
        "preempt_grace_s = 30",
        "[dist]",
        "timeout_s = 20",
        "[task]",
        f"samples = {SAMPLES}",
        "slow_ms = 100",
    ]
    config = tmp_path / f"{name}.toml"
    config.write_text("\n".join(lines) + "\n")
    return config, run_dir


def trained_to(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines() if line]
    return max(steps, default=0)


def wait_for_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while trained_to(run_dir) < step:
        assert time.monotonic() < deadline, f"{run_dir} did not reach step {step}"
        time.sleep(0.1)


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / f"step-{STEPS:08d}" / "model.pt"
    return torch.load(path, weights_only=True)


def workers_on(slurm: SlurmCluster, node: int, run_dir: Path) -> list[int]:
    """The dtrain workers of ``run_dir``'s job running on ``node`` (each reads its launcher's
    config, ``RUN_DIR/.launch-HOST-PID.toml``)."""
    config = f"{run_dir}/.launch-".encode()
    found = []
    for pid in slurm.pids_on(node):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"dtrain.worker" in cmdline and config in cmdline:
            found.append(pid)
    return found


@pytest.mark.slow
def test_the_docs_recipe_trains_preempts_resumes_and_recovers_under_slurm(tmp_path: Path) -> None:
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    script = tmp_path / "job.sh"
    script.write_text(recipe("cpu"))
    outputs: dict[int, Path] = {}

    with SlurmCluster(tmp_path) as slurm:
        # The job's processes find `dtrain` and the tests' task as a user's would: on PATH, and
        # from the submission folder.
        slurm.env["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"

        def submit(config: Path, *options: str) -> int:
            output = tmp_path / f"{config.stem}-%j.out"
            job = slurm.sbatch(
                script,
                f"--chdir={REPO}",
                f"--export=ALL,JOB={config},NPROC=1",
                "--cpus-per-task=1",  # both jobs below share the two nodes' cores
                f"--output={output}",
                *options,
            )
            outputs[job] = Path(str(output).replace("%j", str(job)))
            return job

        def finished(job: int, timeout: float = 150) -> str:
            state = slurm.wait(job, {"COMPLETED", "FAILED"}, timeout)
            text = outputs[job].read_text()
            exit_code = slurm.job(job).get("ExitCode")
            assert (state, exit_code) == ("COMPLETED", "0:0"), text[-3000:]
            # A clean end leaves no traceback on any node (the C++ one of a failed shutdown of
            # the rendezvous included).
            assert "Traceback" not in text and "frame #" not in text, text[-3000:]
            return text

        # Preempted by --signal=USR1@N: Slurm sends it up to a minute early, so this job runs
        # beside the others (its own rendezvous port) and its signal may come at any point.
        usr1_config, usr1_run = write_job(tmp_path, "usr1", steps=100000)
        usr1 = submit(usr1_config, "--time=2", "--signal=USR1@40")

        # 1. Train to the end: the reference.
        ref_config, ref_run = write_job(tmp_path, "ref")
        finished(submit(ref_config))

        # 2. scancel --signal=TERM: every rank saves, the job ends COMPLETED.
        config, run_dir = write_job(tmp_path, "preempted")
        job = submit(config)
        wait_for_step(run_dir, 6)
        slurm.run("scancel", "--signal=TERM", str(job))
        text = finished(job)
        status = json.loads((run_dir / "status.json").read_text())
        assert status["state"] == "preempted" and status["signal"] == "SIGTERM", status
        saved = run_dir / "checkpoints" / f"step-{status['step']:08d}"
        assert (saved / "COMMITTED.json").exists()
        assert {p.name for p in saved.glob("rng-rank*.pt")} == {
            "rng-rank00000.pt",
            "rng-rank00001.pt",
        }  # every rank saved
        assert text.count("preempted by signal 15; saved at step") == 2  # one per node

        # 3. Resubmit: it resumes; a kill -9 on node 1 is recovered under --max-restarts; the
        # end is bit-identical to the uninterrupted job, every sample seen once.
        job = submit(config)
        wait_for_step(run_dir, status["step"] + 3)
        victims = workers_on(slurm, 1, run_dir)
        assert victims, "no worker of the job on node 1"
        os.kill(victims[0], signal.SIGKILL)
        text = finished(job)
        assert f"resumed from step-{status['step']:08d}" in text
        assert text.count("dtrain: training ddp on 2 rank(s)") == 2  # the restart
        expected, got = final_params(ref_run), final_params(run_dir)
        assert expected.keys() == got.keys()
        for key in expected:
            assert torch.equal(expected[key], got[key]), key
        audit = check_stream(read_trajectory(run_dir), SAMPLES)
        assert audit.exactly_once and not audit.gaps, audit

        # 4. The USR1 job saved at its signal.
        finished(usr1, timeout=150)
        status = json.loads((usr1_run / "status.json").read_text())
        assert status["state"] == "preempted" and status["signal"] == "SIGUSR1", status
        saved = usr1_run / "checkpoints" / f"step-{status['step']:08d}" / "COMMITTED.json"
        assert saved.exists()
