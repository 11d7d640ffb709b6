"""``loglikelihood`` and ``generate_until_multi_round`` of lightkv's lmms-eval model, called
with lmms-eval's own ``Instance`` objects on the bundled Scenes model (needs the
``lmms-eval`` extra: ``make lmms-eval``; CI's ``make test-lmms-eval`` runs this file with it
installed and fails if it is skipped).

At kept fraction 1 (no pipeline, or a pipeline that removes nothing) the values equal the
uncompressed model's, computed here without lightkv (a plain forward of the whole sequence,
a fresh ``generate`` over the whole conversation); under compression they are finite and
every sample logs its kept vision fraction.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if os.environ.get("LIGHTKV_REQUIRE_LMMS_EVAL"):  # `make test-lmms-eval` (CI): no silent skip
    import lmms_eval  # noqa: F401
else:
    pytest.importorskip(
        "lmms_eval", reason="lmms-eval is not installed (`make lmms-eval` installs the extra)"
    )
pytest.importorskip("lightkv_lab")

from lmms_eval.api.instance import Instance, unwrap_generation_output

import lightkv
from lightkv.policies.schedulers import ExplicitSchedule

TASK, SPLIT = "scenes_requests", "test"
CHOICES = ("checked", "striped", "plain")


@pytest.fixture(scope="module")
def docs():
    """Two held-out Scenes images, each with a first question and a follow-up about it."""
    from lightkv_lab.tasks.digitgrid.images import to_pil
    from lightkv_lab.tasks.model import read_grid_config
    from lightkv_lab.tasks.scoring import conversations

    from lightkv.lab import bundled_model

    grid = read_grid_config(bundled_model("scenes").path)
    return [
        {
            "image": to_pil(c.first.image),
            "question": " ".join(c.first.question),
            "answer": " ".join(c.first.answer),
            "followup": " ".join(c.followup.question),
        }
        for c in conversations(2, grid, seed=3)
    ]


@pytest.fixture(scope="module")
def models(tmp_path_factory, docs):
    from lightkv.integrations.lmms_eval import LightKV

    identity = lightkv.load("lightkv").with_scheduler(
        ExplicitSchedule(layers=(), removal_ratios=(), windows_per_side=None)
    )
    path = tmp_path_factory.mktemp("requests") / "identity.yaml"
    lightkv.to_yaml(identity, path)
    extra = {"batch_size": "4", "max_batch_size": None, "device": "cpu"}
    base = "pretrained=scenes,dtype=float32,max_new_tokens=4"
    out = {}
    variants = {"none": "", "identity": f",config={path}", "budget": ",preset=lightkv-budget"}
    for name, more in variants.items():
        lm = LightKV.create_from_arg_string(base + more, extra)
        lm.task_dict = {TASK: {SPLIT: docs}}
        out[name] = lm
    return out


def _visual(doc):
    return [doc["image"]]


def _meta(doc_id: int) -> dict:
    return {"task": TASK, "doc_id": doc_id, "repeats": 1}


def _likelihood_requests(docs) -> list[Instance]:
    reqs = [
        Instance(
            "loglikelihood",
            (doc["question"], f" {choice}", _visual, d, TASK, SPLIT),
            idx=i,
            metadata=_meta(d),
        )
        for d, doc in enumerate(docs)
        for i, choice in enumerate((doc["answer"], *CHOICES))
    ]
    # the unconditional form acc_mutual_info sends: (context, continuation), no image
    reqs.append(Instance("loglikelihood", ("", " checked"), idx=0, metadata=_meta(0)))
    return reqs


def _oracle(lm, doc, continuation: str) -> tuple[float, bool]:
    """Without lightkv: the prompt and the continuation in one plain forward."""
    proc = lm.processor
    content = [{"type": "image"}, {"type": "text", "text": doc["question"]}]
    prompt = proc.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = proc(text=[prompt + continuation], images=[doc["image"]], return_tensors="pt")
    n = len(proc.tokenizer(continuation, add_special_tokens=False)["input_ids"])
    ids = inputs["input_ids"]
    with torch.no_grad():
        logits = lm.model(**inputs).logits[0, -n - 1 : -1].double().log_softmax(-1)
    target = ids[0, -n:]
    return float(logits[torch.arange(n), target].sum()), bool((logits.argmax(-1) == target).all())


def test_loglikelihood_at_kept_fraction_one_equals_the_uncompressed_model(models, docs):
    reqs = _likelihood_requests(docs)
    plain = models["none"].loglikelihood(reqs)
    same = models["identity"].loglikelihood(reqs)
    assert len(plain) == len(same) == len(reqs)
    for req, a, b in zip(reqs[:-1], plain, same):
        lp, greedy = a  # unpacks as lmms-eval's (logprob, is_greedy)
        want_lp, want_greedy = _oracle(models["none"], docs[req.doc_id], req.args[1])
        assert lp == pytest.approx(want_lp, abs=1e-4, rel=1e-5) and greedy == want_greedy
        assert b[0] == pytest.approx(lp, abs=1e-5, rel=1e-6) and b[1] == greedy
    assert all(plain[4 * d][1] for d in range(len(docs)))  # the model's own answers are greedy
    assert sum(p[1] for p in plain[:-1]) < len(plain) - 1  # and not every choice is
    assert math.isfinite(plain[-1][0]) and plain[-1][0] == pytest.approx(same[-1][0], abs=1e-5)
    rows = [r.token_counts.lightkv for r in same]
    assert all(r["kept_vision_fraction"] == 1.0 for r in rows[:-1])
    assert rows[-1]["kept_vision_fraction"] is None  # no image: nothing to keep


def test_loglikelihood_under_compression_is_finite_and_logs_the_kept_fraction(models, docs):
    reqs = _likelihood_requests(docs)
    lm = models["budget"]
    got = lm.loglikelihood(reqs)
    assert all(math.isfinite(lp) and lp < 0 and isinstance(g, bool) for lp, g in got)
    for r in got[:-1]:
        row = r.token_counts.lightkv
        assert row["pipeline"] == "lightkv-budget" and 0 < row["kept_vision_fraction"] < 1
        assert row["kv_bytes_vision"] < row["kv_bytes_vision_baseline"]
        assert row["task"] == TASK and row["prompt_tokens"] > row["vision_tokens"]
    # what lmms-eval's evaluator hands the task: the pair itself (a bare tuple would reach
    # it as its string), and the token counts with the report for the sample log
    pair, counts = unwrap_generation_output(got[0])
    assert pair == (got[0][0], got[0][1]) and counts.to_dict()["lightkv"]["pipeline"]
    assert lm.totals == {}  # logged and reset


def _rounds(doc, previous_output=None, round_idx=None, previous_round_info=None):
    """Round 1 asks the follow-up; round 2 ends (lmms-eval's multi-round ``doc_to_text``)."""
    if round_idx == 1:
        return None, doc["followup"], False, previous_output, {"asked": 1}
    assert previous_round_info == {"asked": 1} and len(previous_output) == 2
    return None, None, True, previous_output, None


def _multi_round_requests(docs, doc_to_text=_rounds) -> list[Instance]:
    return [
        Instance(
            "generate_until_multi_round",
            (doc["question"], {"max_new_tokens": 4}, _visual, doc_to_text, d, TASK, SPLIT),
            idx=0,
            metadata=_meta(d),
        )
        for d, doc in enumerate(docs)
    ]


def _fresh_conversation(lm, doc) -> list[str]:
    """Without lightkv or a carried cache: round 0 generated, then the whole conversation
    (prompt, reply, follow-up) generated from scratch."""
    proc, tok = lm.processor, lm.processor.tokenizer
    content = [{"type": "image"}, {"type": "text", "text": doc["question"]}]
    prompt = proc.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = proc(text=[prompt], images=[doc["image"]], return_tensors="pt")
    args = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": tok.pad_token_id}
    with torch.no_grad():
        first = lm.model.generate(**inputs, **args)
        ids = torch.cat(
            [first, tok(" " + doc["followup"], add_special_tokens=False, return_tensors="pt")[
                "input_ids"]], 1,
        )  # fmt: skip
        second = lm.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=inputs["pixel_values"],
            **args,
        )
    n = inputs["input_ids"].shape[1]
    return [
        tok.decode(first[0, n:], skip_special_tokens=True),
        tok.decode(second[0, ids.shape[1] :], skip_special_tokens=True),
    ]


def test_multi_round_at_kept_fraction_one_equals_a_fresh_conversation(models, docs):
    reqs = _multi_round_requests(docs)
    plain = models["none"].generate_until_multi_round(reqs)
    same = models["identity"].generate_until_multi_round(reqs)
    for d, (a, b) in enumerate(zip(plain, same)):
        answers, _ = unwrap_generation_output(a)
        assert (
            answers
            == unwrap_generation_output(b)[0]
            == _fresh_conversation(models["none"], docs[d])
        )
        assert len(answers) == 2 and answers[0].split() == docs[d]["answer"].split()
        assert b.token_counts.lightkv["kept_vision_fraction"] == 1.0
        assert b.token_counts.lightkv["rounds"] == 2


def test_multi_round_under_compression_carries_one_compressed_prefill(models, docs):
    lm = models["budget"]
    before = lm.session.num_prefills
    got = lm.generate_until_multi_round(_multi_round_requests(docs))
    assert lm.session.num_prefills - before == len(docs)  # one prefill per conversation
    for r in got:
        assert len(r.text) == 2 and all(isinstance(t, str) for t in r.text)
        row = r.token_counts.lightkv
        assert row["pipeline"] == "lightkv-budget" and 0 < row["kept_vision_fraction"] < 1
        assert row["rounds"] == 2 and r.token_counts.output_tokens >= 2


def test_multi_round_returns_the_tasks_final_round_result(models, docs):
    def once(doc, previous_output=None, round_idx=None, previous_round_info=None):
        return None, None, True, ["kept", *previous_output], None

    got = models["none"].generate_until_multi_round(_multi_round_requests(docs[:1], once))
    assert got[0].text[0] == "kept" and len(got[0].text) == 2


def test_a_round_with_new_images_is_refused_in_one_line(models, docs):
    def new_image(doc, previous_output=None, round_idx=None, previous_round_info=None):
        return [doc["image"].rotate(90)], "and now", False, previous_output, None

    with pytest.raises(NotImplementedError, match="round 1 of scenes_requests brings new images"):
        models["budget"].generate_until_multi_round(_multi_round_requests(docs[:1], new_image))


def test_likelihood_argument_is_checked():
    from lightkv.integrations.lmms_eval_requests import likelihood_kind

    assert likelihood_kind("nll") == "nll"
    with pytest.raises(ValueError, match="likelihood=loss: give logprob .* or nll"):
        likelihood_kind("loss")


def test_lmms_evals_evaluator_scores_choices_and_rounds(tmp_path):
    """``python -m lmms_eval`` on a ``multiple_choice`` and a multi-round task (DigitGrid,
    compressed): its accuracy is the argmax of the log-probabilities this model returns in
    process (``likelihood=nll``: lmms-eval 0.7.3 picks the smallest), its rounds are the
    answers returned in process, and both tasks log their kept fraction."""
    import importlib.util
    import subprocess

    import datasets
    from lightkv_lab.digitgrid_task import (
        CHOICE_TASK,
        ROUNDS_TASK,
        lmms_eval_command,
        offline_env,
        read_run,
        task_episodes,
        write_choice_and_rounds_tasks,
    )
    from lightkv_lab.tasks import model as dg
    from lightkv_lab.tasks.registry import task_for

    from lightkv.integrations.lmms_eval import LightKV

    _, processor, grid = dg.load()
    task_dir = write_choice_and_rounds_tasks(
        tmp_path / "task", task_episodes(4, processor, grid), grid
    )
    model_args = "pretrained=digitgrid,dtype=float32,preset=lightkv-budget"
    cmd = lmms_eval_command(
        task_dir, tmp_path / "out", model_args + ",likelihood=nll", 1, 4,
        task=f"{CHOICE_TASK},{ROUNDS_TASK}",
    )  # fmt: skip
    run = subprocess.run(
        cmd, env=offline_env(), cwd=tmp_path, capture_output=True, text=True, timeout=480
    )
    results, choices = read_run(tmp_path / "out", CHOICE_TASK, log=run.stdout + run.stderr)
    _, rounds = read_run(tmp_path / "out", ROUNDS_TASK)

    docs = datasets.load_from_disk(str(task_dir / "data"))["test"]
    spec = importlib.util.spec_from_file_location("task_utils", task_dir / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    lm = LightKV.create_from_arg_string(model_args, {"batch_size": "4", "device": "cpu"})
    lm.task_dict = {CHOICE_TASK: {"test": docs}, ROUNDS_TASK: {"test": docs}}
    hits = []
    for d, doc in enumerate(docs):
        reqs = [
            Instance(
                "loglikelihood",
                (utils.doc_to_text(doc), f" {a}", utils.doc_to_visual, d, CHOICE_TASK, "test"),
                idx=i,
                metadata={"task": CHOICE_TASK, "doc_id": d, "repeats": 1},
            )
            for i, a in enumerate(utils.ANSWERS)
        ]
        lps = [lp for lp, _ in lm.loglikelihood(reqs)]
        logged = [float(v[0]) for v in choices[d]["filtered_resps"]]  # the log writes strings
        assert logged == pytest.approx([-lp for lp in lps], abs=1e-4, rel=1e-5)
        hits.append(float(max(range(len(lps)), key=lps.__getitem__) == utils.doc_to_target(doc)))
    assert results["results"][CHOICE_TASK]["acc,none"] == pytest.approx(sum(hits) / len(hits))
    new = task_for(grid).answer_length(grid) + 2  # the rounds task's max_new_tokens
    conv = [
        Instance(
            "generate_until_multi_round",
            (
                doc["question"],
                {"max_new_tokens": new},
                utils.doc_to_visual,
                utils.doc_to_round,
                d,
                ROUNDS_TASK,
                "test",
            ),
            idx=0,
            metadata={"task": ROUNDS_TASK, "doc_id": d, "repeats": 1},
        )  # fmt: skip
        for d, doc in enumerate(docs)
    ]
    want = [r.text for r in lm.generate_until_multi_round(conv)]
    assert [s["filtered_resps"] for s in rounds] == want  # each a list of the two rounds
    for task in (CHOICE_TASK, ROUNDS_TASK):
        kept = results["throughput"][f"avg_lightkv_{task}_kept_vision_fraction"]
        assert 0 < kept < 1
