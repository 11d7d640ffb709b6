"""What the lmms-eval model logs (lightkv.integrations.session_log), without lmms-eval:
per-row reports add up to the session report, totals merge across ranks, and each
data-parallel process sits on its own device with its global rank."""

from __future__ import annotations

import pytest
import torch
from lightkv_lab.tasks import evaluate as ev
from lightkv_lab.tasks import model as dg

import lightkv
from lightkv.integrations.session_log import (
    PrefillTimer,
    ReportTotals,
    gather_totals,
    placement,
    row_reports,
    shard,
    uncompressed_rows,
)


@pytest.fixture(scope="module")
def bundled():
    return dg.load()


def _inputs(model, grid, n=6):
    from lightkv_lab.tasks.registry import task_for

    data = task_for(grid).data
    episodes = ev.heldout_episodes(n, seed=5, grid=grid)
    return data.collate_prompts(
        episodes, data.num_image_tokens(grid, model.config.vision_config.patch_size)
    )


@pytest.mark.parametrize("preset", ["lightkv-budget", "fastv"])
def test_rows_add_up_to_the_session_report(bundled, preset):
    model, _, grid = bundled
    inputs = _inputs(model, grid)
    session = lightkv.apply(preset, model)
    with torch.no_grad(), session, PrefillTimer(model) as timer:
        model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)
    rep = session.report()
    rows = row_reports(session, timer.seconds)
    assert len(rows) == rep.batch_size == 6
    assert sum(r["kv_bytes_vision"] for r in rows) == rep.kv_bytes_vision
    assert sum(r["kv_bytes_vision_baseline"] for r in rows) == rep.kv_bytes_vision_baseline
    weights = [r["vision_tokens"] for r in rows]  # the report weighs rows by their vision tokens
    kept = sum(w * r["kept_vision_fraction"] for w, r in zip(weights, rows)) / sum(weights)
    assert kept == pytest.approx(rep.kept_vision_fraction)
    assert all(0 < r["kept_vision_fraction"] < 1 for r in rows)
    assert [r["prompt_tokens"] for r in rows] == inputs["attention_mask"].sum(-1).tolist()
    assert timer.seconds is not None and timer.seconds > 0
    assert {r["pipeline"] for r in rows} == {preset}


def test_prefill_timer_times_the_first_forward_only(bundled):
    model, _, grid = bundled
    inputs = _inputs(model, grid, 2)
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        with torch.no_grad(), PrefillTimer(model) as timer:
            model.generate(
                **inputs, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0
            )
    finally:
        handle.remove()
    assert len(calls) == 3 and timer.seconds > 0
    assert not model._forward_hooks and not model._forward_pre_hooks  # its hooks are gone


def test_uncompressed_rows():
    rows = uncompressed_rows([True, False], [10, 7], 0.5)
    assert [r["kept_vision_fraction"] for r in rows] == [1.0, None]
    assert [r["prompt_tokens"] for r in rows] == [10, 7] and rows[0]["batch_size"] == 2


def _row(kept, kv, base, prefill=0.4, batch=2, out=3):
    return {
        "kept_vision_fraction": kept,
        "kv_bytes_vision": kv,
        "kv_bytes_vision_baseline": base,
        "prefill_s": prefill,
        "generate_s": 2 * prefill,
        "batch_size": batch,
        "output_tokens": out,
    }


def test_totals_merged_over_fake_ranks_equal_one_process():
    """Four fake ranks, each with its lmms-eval shard of ten rows: merged, their totals are
    those of all rows in one process."""
    rows = [_row(0.1 * (i % 7) + 0.2, 100 + i, 400) for i in range(10)]
    whole = ReportTotals()
    for r in rows:
        whole.add(r)
    parts = []
    for rank in range(4):
        t = ReportTotals()
        for i in shard(len(rows), rank, 4):
            t.add(rows[i])
        parts.append(t)
    merged = ReportTotals.merge(parts)
    assert merged.metrics() == pytest.approx(whole.metrics())
    m = whole.metrics()
    assert m["lightkv_samples"] == 10
    assert m["lightkv_kept_vision_fraction"] == pytest.approx(
        sum(r["kept_vision_fraction"] for r in rows) / 10
    )
    assert m["lightkv_prefill_s"] == pytest.approx(0.2)  # 0.4 s per batch of two
    assert (
        gather_totals({"": whole}, world_size=1)[""].metrics() == m
    )  # one process: its own totals


def test_shards_cover_every_document_once():
    for world in (1, 2, 3, 8):
        got = sorted(i for r in range(world) for i in shard(17, r, world))
        assert got == list(range(17))
    with pytest.raises(ValueError):
        shard(4, 2, 2)


def test_placement_of_a_data_parallel_process():
    """``accelerate launch --num_processes 4`` on two nodes of two GPUs: the process with
    global rank 3 is the second on its node."""
    p = placement(
        process_index=3, local_process_index=1, num_processes=4, accelerator_device="cuda:1"
    )
    assert (p.rank, p.world_size, p.device, p.device_map) == (
        3,
        4,
        torch.device("cuda:1"),
        {"": "cuda:1"},
    )
    p = placement(process_index=3, local_process_index=1, num_processes=4)
    assert p.device == torch.device("cuda:1")
    p = placement(process_index=1, local_process_index=1, num_processes=2, accelerator_device="cpu")
    assert p.device == torch.device("cpu") and p.device_map == {"": "cpu"}


def test_placement_of_one_process():
    p = placement(process_index=0, local_process_index=0, num_processes=1, device="cpu")
    assert (p.rank, p.world_size, p.device, p.device_map) == (0, 1, torch.device("cpu"), None)
    p = placement(process_index=0, local_process_index=0, num_processes=1, device_map="auto")
    assert p.device_map == "auto"


def test_a_single_process_accelerate_launch_is_detected():
    """Issue 27, item 18: ``accelerate launch --num_processes 2`` on CPU starts one process
    (its simple launcher: MASTER_ADDR and ACCELERATE_* set, no WORLD_SIZE); the lmms-eval
    model warns instead of silently evaluating everything in one process."""
    from lightkv.integrations.session_log import single_process_launch

    simple = {
        "ACCELERATE_MIXED_PRECISION": "no",
        "ACCELERATE_USE_CPU": "False",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    message = single_process_launch(simple, num_processes=1)
    assert message and "torch.distributed.run --nproc_per_node N" in message
    torchrun = dict(simple, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0")
    assert single_process_launch(torchrun, num_processes=2) is None  # really several processes
    one = {
        "ACCELERATE_MIXED_PRECISION": "no",
        "ACCELERATE_USE_CPU": "False",
    }  # --num_processes 1: no MASTER_ADDR
    assert single_process_launch(one, num_processes=1) is None
    assert single_process_launch({}, num_processes=1) is None  # plain python -m lmms_eval


def test_the_launch_warning_reaches_stderr_under_lmms_evals_filter(capsys):
    """Issue 40 item 8: the warning was a `warnings.warn`, and lmms-eval's entry point runs
    ``warnings.simplefilter("ignore")``: under that filter the line must still reach stderr."""
    import logging
    import warnings

    from lightkv.integrations.session_log import single_process_launch, warn_lmms_eval_user

    message = single_process_launch(
        {"ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1"}, 1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what lmms-eval does
        logging.disable(logging.CRITICAL)  # and silencing the standard loggers too
        try:
            warn_lmms_eval_user(message)
        finally:
            logging.disable(logging.NOTSET)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"lightkv: warning: {message}"]
    from pathlib import Path

    # the model calls it, not warnings.warn (read as text: lmms-eval may be absent)
    import lightkv.integrations

    source = (Path(lightkv.integrations.__file__).parent / "lmms_eval.py").read_text(
        encoding="utf-8"
    )
    assert (
        "warn_lmms_eval_user(alone)" in source and 'warnings.warn(f"lightkv: {alone}"' not in source
    )
