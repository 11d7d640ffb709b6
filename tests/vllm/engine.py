"""Run one vLLM engine in this process on the tiny model and write what it did as JSON.

``python tests/vllm/engine.py REQUEST.json RESULT.json``. Each test starts engines through
this script in a subprocess of its own, so that engines with different settings never share
vLLM's process-wide state.

REQUEST: ``model`` (directory), ``arch`` (an architecture for ``hf_overrides``, or null for
stock vLLM), ``pipeline`` (the ``lightkv`` override, or null), ``prompts`` (each
``{"images": [[rows, cols], ...], "seed": s}``), ``max_tokens``, ``chunk`` (optional
``max_num_batched_tokens``: prefill in chunks of that many tokens), ``prefix_caching``
(vLLM's prefix caching on), ``sequential`` (one request after another), ``eager``
(``enforce_eager``, default true), ``logprobs`` (the top-k log-probabilities of each
generated token), ``multiprocessing`` (the engine core in its own
process, vLLM's default: no blocks, records or positions are captured), ``limits``
(``limit_mm_per_prompt``, default ``{"image": 2}``). A prompt may give ``image_seed`` (the
same image under another seed) and ``question`` (words after its one image): see
`tiny.request`. Each image's
encoder output, the embeddings handed to the language model (and the question the plugin
gave it), and the M-RoPE positions each prompt was run with are captured.

RESULT: ``outputs`` (per prompt: ``prompt_len``, ``prompt`` (token ids), ``tokens``,
``blocks``: KV blocks the request held when it finished, ``positions``: ``[3, N]``,
``cached``: prompt tokens served from the prefix cache), ``block_size``, ``records``,
``alone`` (with ``"alone": true``: each prompt's tokens generated on its own),
``video_error`` (with ``"video": true``: what a video prompt raised), or ``error`` (the
exception's type and message, when building the engine or generating failed).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import tiny

RECORDS: list[dict] = []
POSITIONS: dict[str, list] = {}  # prompt token ids (as text) -> the M-RoPE positions vLLM used last
BLOCK = 32  # vLLM's CPU attention takes multiples of 32


def _record(model) -> None:
    """Capture each image's encoder output and what `embed_multimodal` returns (same process)."""
    process, embed = model._process_image_input, model.embed_multimodal

    def process_image(image_input):
        out = process(image_input)
        grids = image_input["image_grid_thw"].tolist()
        for e, g in zip(out, grids):
            RECORDS.append({"grid": g, "encoder": e.float().tolist()})
        return out

    def embed_multimodal(**kwargs):
        question = kwargs.get("lightkv_question")
        out = embed(**kwargs)
        questions = [None] * len(out) if question is None else [q.tolist() for q in question]
        for rec, e, q in zip(RECORDS[-len(out) :], out, questions):
            rec["embeds"], rec["question"] = e.float().tolist(), q
        return out

    model._process_image_input = process_image
    model.embed_multimodal = embed_multimodal
    initial, recompute = model.get_mrope_input_positions, model.recompute_mrope_positions

    def get_mrope_input_positions(input_tokens, mm_features):
        positions, delta = initial(input_tokens, mm_features)
        POSITIONS[json.dumps(list(input_tokens))] = positions.tolist()
        return positions, delta

    def recompute_mrope_positions(
        input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens
    ):
        out = recompute(input_ids, multimodal_embeddings, mrope_positions, num_computed_tokens)
        ids = input_ids.tolist() if hasattr(input_ids, "tolist") else list(input_ids)
        POSITIONS[json.dumps(ids)] = out[1][:, : len(ids)].tolist()
        return out

    model.get_mrope_input_positions = get_mrope_input_positions
    model.recompute_mrope_positions = recompute_mrope_positions


def _blocks_of(blocks: dict[str, int], request_id: str) -> int | None:
    """vLLM's engine core names a request ``<id>-<8 random hex>``."""
    found = [
        n for rid, n in blocks.items() if rid == request_id or rid.startswith(request_id + "-")
    ]
    return found[0] if len(found) == 1 else None


def run(req: dict) -> dict:
    separate = bool(req.get("multiprocessing"))  # vLLM's default: the engine core in a process
    if separate:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    from vllm import LLM, SamplingParams

    overrides = {}
    if req.get("arch"):
        overrides["architectures"] = [req["arch"]]
    if req.get("pipeline") is not None:
        overrides["lightkv"] = req["pipeline"]
    llm = LLM(
        model=req["model"],
        tokenizer=req["model"],
        hf_overrides=overrides or None,
        dtype="float32",
        distributed_executor_backend="uni",
        enforce_eager=req.get("eager", True),
        max_model_len=1024,
        max_num_seqs=8,
        block_size=BLOCK,
        seed=0,
        enable_prefix_caching=bool(req.get("prefix_caching")),
        limit_mm_per_prompt=req.get("limits", {"image": 2}),
        **({"max_num_batched_tokens": req["chunk"]} if req.get("chunk") else {}),
    )
    blocks: dict[str, int] = {}
    if not separate:  # the engine core and the model are in this process: count and record
        core = llm.llm_engine.engine_core.engine_core
        manager = core.scheduler.kv_cache_manager
        free = manager.free

        def free_and_count(request):
            blocks[request.request_id] = sum(
                len(ids) for ids in manager.get_block_ids(request.request_id)
            )
            return free(request)

        manager.free = free_and_count
        llm.apply_model(_record)
    prompts = []
    for p in req["prompts"]:
        text, images = tiny.request(p)
        prompts.append(
            {"prompt": text, "multi_modal_data": {"image": images}} if images else {"prompt": text}
        )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=req.get("max_tokens", 6),
        ignore_eos=True,
        logprobs=req.get("logprobs"),
    )
    if req.get(
        "sequential"
    ):  # one request after another: a later one can hit an earlier one's prefix cache
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    records = list(RECORDS)  # the batch's images; the runs alone below add theirs
    alone = (
        [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
        if req.get("alone")
        else None
    )
    video_error = None
    if req.get("video"):
        import numpy as np

        frames = np.zeros((4, 32, 32, 3), dtype=np.uint8)
        text = "w1 <|vision_start|> <|video_pad|> <|vision_end|> w2"
        try:
            llm.generate(
                [{"prompt": text, "multi_modal_data": {"video": frames}}], params, use_tqdm=False
            )
        except Exception as e:
            video_error = {"type": type(e).__name__, "message": str(e)}
    if separate:  # stop the engine core process (it holds this process's output pipes)
        llm.llm_engine.engine_core.shutdown(timeout=60)
    return {
        "alone": alone,
        "video_error": video_error,
        "outputs": [
            {
                "prompt_len": len(o.prompt_token_ids),
                "tokens": list(o.outputs[0].token_ids),
                "blocks": _blocks_of(blocks, o.request_id),
                "prompt": list(o.prompt_token_ids),
                "positions": POSITIONS.get(json.dumps(list(o.prompt_token_ids))),
                "cached": getattr(o, "num_cached_tokens", None),
                "logprobs": [
                    {str(t): float(lp.logprob) for t, lp in step.items()}
                    for step in (o.outputs[0].logprobs or [])
                ],
            }
            for o in outs
        ],
        "block_size": BLOCK,
        "records": records,
    }


def main() -> None:
    req = json.loads(Path(sys.argv[1]).read_text())
    try:
        result = run(req)
    except Exception as e:  # the tests read the refusal's type and message
        result = {
            "error": {"type": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
        }
    Path(sys.argv[2]).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's teardown (seconds, and noisy in one-process mode)


if __name__ == "__main__":
    main()
