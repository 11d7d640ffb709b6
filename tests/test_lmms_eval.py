"""lmms-eval's real entry point with the ``lightkv`` model, offline, on the bundled DigitGrid
model and a local task of held-out episodes (needs the ``lmms-eval`` extra: ``make
lmms-eval``; CI runs this file with it installed and fails if it is skipped).

Three runs of ``python -m lmms_eval`` (in parallel, about a minute on 2 cores): uncompressed,
an identity pipeline given as a YAML ``config``, and ``preset=lightkv-budget`` in two processes
(data parallel, two model copies, started the way ``accelerate launch --num_processes 2``
starts them). Only the
results and sample files count: ``python -m lmms_eval`` exits 0 even when it fails.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("LIGHTKV_REQUIRE_LMMS_EVAL"):  # `make test-lmms-eval` (CI): a skip would hide a broken install
    import lmms_eval  # noqa: F401
else:
    pytest.importorskip("lmms_eval", reason="lmms-eval is not installed (`make lmms-eval` installs the extra)")

from lightkv.integrations.digitgrid_task import TASK_NAME, task_episodes, write_task  # noqa: E402

N_EPISODES = 32
BATCH = 8


def _env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("LMMS_EVAL_PLUGINS", None)
    return env


def _command(task_dir: Path, out: Path, model_args: str, processes: int = 1) -> list[str]:
    args = ["-m", "lmms_eval", "--model", "lightkv", "--model_args", model_args, "--tasks", TASK_NAME,
            "--include_path", str(task_dir), "--batch_size", str(BATCH), "--output_path", str(out),
            "--log_samples", "--verbosity", "WARNING"]
    if processes == 1:
        return [sys.executable, *args]
    # `accelerate launch --num_processes N` starts its N processes through torch.distributed.run
    # (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT); `accelerate launch --cpu` would start
    # one, so the CPU stand-in calls torch.distributed.run itself (gloo process group)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                "--master_port", str(29500 + os.getpid() % 1000)]
    return launcher + args


def _read(out: Path, log: str) -> tuple[dict, list[dict]]:
    results = glob.glob(str(out / "**" / "*_results.json"), recursive=True)
    samples = glob.glob(str(out / "**" / f"*_samples_{TASK_NAME}.jsonl"), recursive=True)
    assert len(results) == 1 and len(samples) == 1, f"lmms-eval wrote no results; its output:\n{log[-4000:]}"
    rows = [json.loads(line) for line in Path(samples[0]).read_text().splitlines() if line.strip()]
    return json.loads(Path(results[0]).read_text()), sorted(rows, key=lambda r: r["doc_id"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Episodes, lightkv's own evaluation of them, and the three lmms-eval runs."""
    import lightkv
    from lightkv.digitgrid import evaluate as ev
    from lightkv.digitgrid import model as dg
    from lightkv.policies.schedulers import ExplicitSchedule

    tmp = tmp_path_factory.mktemp("lmms")
    model, processor, grid = dg.load()
    episodes = task_episodes(N_EPISODES, processor, grid)
    task_dir = write_task(tmp / "task", episodes, grid)
    identity = lightkv.load("lightkv").with_scheduler(ExplicitSchedule(layers=(), ratios=(), windows_per_side=None))
    lightkv.to_yaml(identity, tmp / "identity.yaml")
    specs = {
        "uncompressed": ("pretrained=digitgrid,dtype=float32", 1),
        "identity": (f"pretrained=digitgrid,dtype=float32,config={tmp / 'identity.yaml'}", 1),
        "budget": ("pretrained=digitgrid,dtype=float32,preset=lightkv-budget", 2),
    }
    procs = {}
    for name, (model_args, n) in specs.items():
        log = open(tmp / f"{name}.log", "w")
        procs[name] = (subprocess.Popen(_command(task_dir, tmp / name, model_args, n), stdout=log,
                                        stderr=subprocess.STDOUT, env=_env(), cwd=tmp), log)
    try:  # lightkv's own evaluator on the same episodes, meanwhile
        own = {"uncompressed": ev.evaluate(model, episodes, grid, None, batch=BATCH),
               "budget": ev.evaluate(model, episodes, grid, lightkv.load("lightkv-budget"), batch=BATCH)}
        for proc, _ in procs.values():
            proc.wait(timeout=240)
    finally:
        for proc, log in procs.values():
            if proc.poll() is None:
                proc.kill()
            log.close()
    got = {name: _read(tmp / name, (tmp / f"{name}.log").read_text()) for name in specs}
    return episodes, own, got


def _accuracy(results: dict) -> float:
    return results["results"][TASK_NAME]["exact_match,none"]


def _answers(samples: list[dict]) -> list[str]:
    return [s["filtered_resps"] if isinstance(s["filtered_resps"], str) else s["filtered_resps"][0] for s in samples]


def test_uncompressed_accuracy_equals_lightkvs_evaluator(runs):
    episodes, own, got = runs
    results, samples = got["uncompressed"]
    assert [s["doc_id"] for s in samples] == list(range(N_EPISODES))
    assert [a.split() for a in _answers(samples)] == own["uncompressed"].answers
    assert _accuracy(results) == pytest.approx(own["uncompressed"].overall, abs=1e-12)
    assert _accuracy(results) >= 0.8  # the bundled model answers most held-out questions
    lk = samples[0]["token_counts"][0]["lightkv"]
    assert lk["pipeline"] is None and lk["kept_vision_fraction"] == 1.0


def test_identity_pipeline_gives_the_uncompressed_answers(runs):
    _, _, got = runs
    assert _answers(got["identity"][1]) == _answers(got["uncompressed"][1])
    rows = [s["token_counts"][0]["lightkv"] for s in got["identity"][1]]
    assert all(r["kept_vision_fraction"] == 1.0 for r in rows)
    assert all(r["kv_bytes_vision"] == r["kv_bytes_vision_baseline"] > 0 for r in rows)


def test_compressed_run_reports_its_kept_fraction(runs):
    _, own, got = runs
    results, samples = got["budget"]
    rows = [s["token_counts"][0]["lightkv"] for s in samples]
    assert all(r["pipeline"] == "lightkv-budget" and 0 < r["kept_vision_fraction"] < 1 for r in rows)
    assert all(r["kv_bytes_vision"] < r["kv_bytes_vision_baseline"] for r in rows)
    assert all(r["prefill_s"] > 0 for r in rows)
    kept = results["throughput"]["avg_lightkv_kept_vision_fraction"]
    assert kept == pytest.approx(sum(r["kept_vision_fraction"] for r in rows) / len(rows))
    assert kept == pytest.approx(own["budget"].kept_fraction, abs=1e-9)
    assert results["throughput"][f"avg_lightkv_{TASK_NAME}_kept_vision_fraction"] == pytest.approx(kept)
    assert _accuracy(results) == pytest.approx(own["budget"].overall, abs=1e-12)


def test_data_parallel_run_shards_like_lmms_eval_and_aggregates_every_rank(runs):
    """The budget run had two processes: rank r answered documents r, r + 2, ... (lmms-eval's
    sharding), rank 0 wrote all of them, and the aggregate counts every rank's samples."""
    from lmms_eval.utils import create_iterator

    from lightkv.integrations.session_log import shard

    results, samples = got_budget = runs[2]["budget"]
    assert len(got_budget[1]) == N_EPISODES
    for rank in (0, 1):
        mine = [s["doc_id"] for s in samples if s["token_counts"][0]["lightkv"]["rank"] == rank]
        assert mine == shard(N_EPISODES, rank, 2)
        assert [i for i, _ in create_iterator(enumerate(range(N_EPISODES)), rank=rank, world_size=2)] == mine
    assert results["throughput"]["avg_lightkv_samples"] == N_EPISODES


@pytest.mark.parametrize("world", [1, 3, 4])
def test_lightkvs_shard_is_lmms_evals(world):
    from lmms_eval.utils import create_iterator

    from lightkv.integrations.session_log import shard

    for rank in range(world):
        assert shard(10, rank, world) == [i for i, _ in create_iterator(enumerate(range(10)), rank=rank,
                                                                         world_size=world)]


def test_entry_point_registers_the_model():
    from lmms_eval.models import get_model

    from lightkv.integrations.lmms_eval import LightKV

    assert get_model("lightkv") is LightKV
