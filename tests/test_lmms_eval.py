"""lmms-eval's real entry point with the ``lightkv`` model, offline, on the bundled DigitGrid
model and a local task of held-out episodes (needs the ``lmms-eval`` extra: ``make
lmms-eval``; CI runs this file with it installed and fails if it is skipped).

Three runs of ``python -m lmms_eval`` (in parallel, about a minute on 2 cores): uncompressed,
an identity pipeline given as a YAML ``config``, and ``preset=lightkv-budget`` in two processes
(data parallel, two model copies, started the way ``accelerate launch --num_processes 2``
starts them). Only the results and sample files count: ``python -m lmms_eval`` exits 0 even
when it fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import pytest

if os.environ.get(
    "LIGHTKV_REQUIRE_LMMS_EVAL"
):  # `make test-lmms-eval` (CI): a skip would hide a broken install
    import lmms_eval  # noqa: F401
else:
    pytest.importorskip(
        "lmms_eval", reason="lmms-eval is not installed (`make lmms-eval` installs the extra)"
    )

from lightkv_lab.digitgrid_task import (
    TASK_NAME,
    lmms_eval_command,
    offline_env,
    read_run,
    task_episodes,
    write_task,
)

N_EPISODES = 32
BATCH = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Episodes, lightkv's own evaluation of them, and the three lmms-eval runs."""
    from lightkv_lab.tasks import evaluate as ev
    from lightkv_lab.tasks import model as dg

    import lightkv
    from lightkv.policies.schedulers import ExplicitSchedule

    tmp = tmp_path_factory.mktemp("lmms")
    model, processor, grid = dg.load()
    episodes = task_episodes(N_EPISODES, processor, grid)
    task_dir = write_task(tmp / "task", episodes, grid)
    identity = lightkv.load("lightkv").with_scheduler(
        ExplicitSchedule(layers=(), removal_ratios=(), windows_per_side=None)
    )
    lightkv.to_yaml(identity, tmp / "identity.yaml")
    specs = {
        "uncompressed": ("pretrained=digitgrid,dtype=float32", 1),
        "identity": (f"pretrained=digitgrid,dtype=float32,config={tmp / 'identity.yaml'}", 1),
        "budget": ("pretrained=digitgrid,dtype=float32,preset=lightkv-budget", 2),
    }
    with contextlib.ExitStack() as stack:
        procs = {}
        for name, (model_args, n) in specs.items():
            log = stack.enter_context(open(tmp / f"{name}.log", "w"))
            cmd = lmms_eval_command(
                task_dir, tmp / name, model_args, n, BATCH, port=29500 + os.getpid() % 1000
            )
            procs[name] = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=offline_env(),
                cwd=tmp,
                start_new_session=True,
            )  # its own process group (torchrun's workers)
        try:  # lightkv's own evaluator on the same episodes, meanwhile
            own = {
                "uncompressed": ev.evaluate(model, episodes, grid, None, batch=BATCH),
                "budget": ev.evaluate(
                    model, episodes, grid, lightkv.load("lightkv-budget"), batch=BATCH
                ),
            }
            for proc in procs.values():
                proc.wait(timeout=240)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    got = {name: read_run(tmp / name, log=(tmp / f"{name}.log").read_text()) for name in specs}
    return episodes, own, got


def _accuracy(results: dict) -> float:
    return results["results"][TASK_NAME]["exact_match,none"]


def _answers(samples: list[dict]) -> list[str]:
    return [
        s["filtered_resps"] if isinstance(s["filtered_resps"], str) else s["filtered_resps"][0]
        for s in samples
    ]


def test_uncompressed_accuracy_equals_lightkvs_evaluator(runs):
    _, own, got = runs
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
    assert all(
        r["pipeline"] == "lightkv-budget" and 0 < r["kept_vision_fraction"] < 1 for r in rows
    )
    assert all(r["kv_bytes_vision"] < r["kv_bytes_vision_baseline"] for r in rows)
    assert all(r["prefill_s"] > 0 for r in rows)
    kept = results["throughput"]["avg_lightkv_kept_vision_fraction"]
    assert kept == pytest.approx(sum(r["kept_vision_fraction"] for r in rows) / len(rows))
    assert kept == pytest.approx(own["budget"].kept_fraction, abs=1e-9)
    assert results["throughput"][f"avg_lightkv_{TASK_NAME}_kept_vision_fraction"] == pytest.approx(
        kept
    )
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
        assert [
            i for i, _ in create_iterator(enumerate(range(N_EPISODES)), rank=rank, world_size=2)
        ] == mine
    assert results["throughput"]["avg_lightkv_samples"] == N_EPISODES


@pytest.mark.parametrize("world", [1, 3, 4])
def test_lightkvs_shard_is_lmms_evals(world):
    from lmms_eval.utils import create_iterator

    from lightkv.integrations.session_log import shard

    for rank in range(world):
        assert shard(10, rank, world) == [
            i for i, _ in create_iterator(enumerate(range(10)), rank=rank, world_size=world)
        ]


def test_entry_point_registers_the_model():
    from lmms_eval.models import get_model

    from lightkv.integrations.lmms_eval import LightKV

    assert get_model("lightkv") is LightKV


def test_model_arguments_as_lmms_eval_passes_them(tmp_path):
    """lmms-eval builds the model with ``create_from_arg_string(model_args, {batch_size,
    max_batch_size, device})``."""
    import lightkv
    from lightkv.integrations.lmms_eval import LightKV, load_pipeline

    extra = {"batch_size": "4", "max_batch_size": None, "device": "cpu"}
    lm = LightKV.create_from_arg_string("pretrained=digitgrid,preset=fastv,dtype=float32", extra)
    assert (lm.batch_size, lm.rank, lm.world_size, lm.device.type) == (4, 0, 1, "cpu")
    assert lm.session is not None and lm.pipeline.name == "fastv"
    assert LightKV.create_from_arg_string("pretrained=digitgrid,preset=none", extra).session is None
    with pytest.raises(TypeError, match="unknown model_args.*bogus"):
        LightKV.create_from_arg_string("pretrained=digitgrid,bogus=1", extra)
    with pytest.raises(ValueError, match="not both"):
        load_pipeline("fastv", str(tmp_path / "x.yaml"))
    with pytest.raises(FileNotFoundError, match="no such pipeline file"):
        load_pipeline(config=str(tmp_path / "missing.yaml"))
    lightkv.to_yaml(lightkv.load("pool"), tmp_path / "mine.yaml")
    assert load_pipeline(config=str(tmp_path / "mine.yaml")).name == "pool"
