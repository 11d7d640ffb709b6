"""The ``lightkv`` model of lmms-eval: any supported Hugging Face LVLM, its prefill compressed
by a lightkv pipeline, on any lmms-eval task.

```bash
make lmms-eval                        # the extra, keeping the installed torch
python -m lmms_eval --model lightkv \\
    --model_args pretrained=llava-hf/llava-1.5-7b-hf,preset=lightkv,dtype=float16 \\
    --tasks mme --batch_size 8 --log_samples --output_path runs/lmms
accelerate launch --num_processes 8 -m lmms_eval --model lightkv ...   # one copy per GPU
```

Model arguments (``--model_args k=v,...``):

- ``pretrained``: a hub id, a local model directory, or a bundled model by name (``digitgrid``;
  the bundled models come with the laboratory, ``lightkv-lab``).
- ``preset`` (a shipped preset's name) or ``config`` (a pipeline YAML file); neither (or
  ``preset=none``): uncompressed, generated without any lightkv hook.
- ``dtype`` (``auto``, ``float16``, ``bfloat16``, ``float32``), ``device``, ``device_map``,
  ``attn_implementation`` (default ``sdpa``), ``max_new_tokens`` (when a task sets none;
  default 128). The batch size is lmms-eval's ``--batch_size`` (lmms-eval passes it to the
  model itself, so it cannot also be a model argument).
- ``likelihood``: what ``loglikelihood`` returns first, ``logprob`` (default: the summed
  log-probability, lmms-eval's API) or ``nll`` (its negative: lmms-eval 0.7.3 scores
  ``multiple_choice`` tasks by the smallest value, as its own models return a loss).

Every request type of an image task is answered. ``generate_until``: batched (prompts of
one task and one set of generation arguments, longest first, left padding), greedy unless
the task asks for sampling. ``loglikelihood`` (``loglikelihood`` and ``multiple_choice``
tasks): the context with its images prefilled once under compression, the continuation read
over that compressed cache; its summed log-probability and whether greedy decoding gives it,
batched. ``generate_until_multi_round``: one conversation at a time, its first round
prefilled under compression and the compressed cache carried to every later round inside
one session (a round that brings new images is refused). See
`lightkv.integrations.lmms_eval_requests`. Every sample's lightkv
report (`lightkv.integrations.session_log.row_reports`: kept vision fraction, vision KV
bytes with and without compression, prefill seconds of its batch) is written into
lmms-eval's sample log (``--log_samples``) as ``token_counts[0]["lightkv"]``; the means over
all samples of all ranks, overall and per task, go into the results file's ``throughput``
section as ``avg_lightkv_kept_vision_fraction``, ``avg_lightkv_<task>_kept_vision_fraction``,
and so on. Data parallel runs are described in `lightkv.integrations.session_log`.

lmms-eval registers the model through the entry point ``lightkv`` of the group
``lmms_eval.models`` (`manifest`). This module imports lmms-eval; nothing else in lightkv
imports this module.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from lmms_eval.api.instance import GenerationResult
from lmms_eval.api.model import lmms

from .lmms_eval_requests import LightKVTokenCounts, ScoringAndRounds, likelihood_kind
from .session_log import (
    PrefillTimer,
    ReportTotals,
    gather_totals,
    placement,
    row_reports,
    single_process_launch,
    uncompressed_rows,
    warn_lmms_eval_user,
)

__all__ = ["LightKV", "LightKVTokenCounts", "load_pipeline", "manifest"]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
GREEDY_KEYS = ("until", "max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "num_beams")


def manifest():
    """The entry point's payload: lmms-eval's ``ModelManifest`` naming `LightKV`."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id="lightkv", simple_class_path=f"{__name__}.LightKV")


def load_pipeline(preset: str | None = None, config: str | None = None):
    """The pipeline named by ``preset`` or stored in the YAML file ``config`` (None: none)."""
    import lightkv

    if preset is not None and config is not None:
        raise ValueError("give preset= or config=, not both")
    if config is not None:
        if not os.path.isfile(os.path.expanduser(config)):
            raise FileNotFoundError(f"config={config}: no such pipeline file")
        return lightkv.load(os.path.expanduser(config))
    if preset is None or str(preset).lower() in ("none", "uncompressed", ""):
        return None
    return lightkv.load(str(preset))


def _load(pretrained: str, dtype: str, device_map: Any, attn_implementation: str | None):
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoProcessor,
    )

    from .. import lab
    from ..adapters.registry import MODEL_TYPES, SUPPORTED_FAMILIES
    from ..generate.hub import hub_access

    bundled = lab.bundled_model(pretrained) if pretrained in lab.bundled_models() else None
    if (
        bundled is None
        and pretrained in lab.LAB_MODELS
        and not os.path.isdir(os.path.expanduser(pretrained))
    ):
        raise ValueError(lab.needs_lab(f"pretrained={pretrained} (a bundled model)"))
    path = str(bundled.path) if bundled is not None else os.path.expanduser(pretrained)
    # a hub id that cannot be reached fails at once, naming HF_HUB_OFFLINE=1 (not after retries)
    local = {"local_files_only": True} if os.path.isdir(path) else hub_access(path)
    config = AutoConfig.from_pretrained(path, **local)
    if MODEL_TYPES.get(getattr(config, "model_type", "")) is None:
        raise ValueError(
            f"{pretrained}: model type {config.model_type!r} is not supported by lightkv; "
            f"supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    processor = AutoProcessor.from_pretrained(path, **local)
    kwargs = {"dtype": DTYPES.get(dtype, dtype), **local}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):
        try:
            model = auto.from_pretrained(path, config=config, **kwargs)
            break
        except ValueError as e:
            if "Unrecognized configuration class" not in str(e) or auto is AutoModelForCausalLM:
                raise
    return model.eval(), processor


class LightKV(ScoringAndRounds, lmms):
    """lmms-eval model: a Hugging Face LVLM whose prefill a lightkv pipeline compresses."""

    is_simple = True

    def __init__(
        self,
        pretrained: str = "digitgrid",
        preset: str | None = None,
        config: str | None = None,
        dtype: str = "auto",
        device: str | None = None,
        device_map: str | None = None,
        attn_implementation: str | None = "sdpa",
        batch_size: int | str = 1,
        max_new_tokens: int | str = 128,
        max_batch_size: int | None = None,
        likelihood: str = "logprob",
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if kwargs:
            raise TypeError(f"unknown model_args for --model lightkv: {', '.join(sorted(kwargs))}")
        from accelerate import Accelerator

        self.pipeline = load_pipeline(preset, config)
        accelerator = Accelerator()
        alone = single_process_launch(os.environ, accelerator.num_processes)
        if alone:  # stderr, not warnings.warn: lmms-eval ignores every Python warning
            warn_lmms_eval_user(alone)
        where = placement(
            process_index=accelerator.process_index,
            local_process_index=accelerator.local_process_index,
            num_processes=accelerator.num_processes,
            accelerator_device=accelerator.device,
            device=device,
            device_map=device_map,
        )
        self.accelerator = accelerator
        self._rank, self._world_size, self._device = where.rank, where.world_size, where.device
        self._model, self.processor = _load(
            pretrained, dtype, where.device_map, attn_implementation
        )
        if where.device_map is None:
            self._model.to(self._device)
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        tokenizer.padding_side = "left"
        self.tokenizer = tokenizer
        self.pretrained = pretrained
        # lmms-eval's --batch_size (always passed; "auto" is not supported: one prompt a batch)
        self.batch_size_per_gpu = int(batch_size) if str(batch_size).isdigit() else 1
        self.max_new_tokens = int(max_new_tokens)
        self.likelihood = likelihood_kind(likelihood)
        self.session = None
        if self.pipeline is not None:
            import lightkv

            self.session = lightkv.apply(self.pipeline, self._model)  # entered around every batch
        self.totals: dict[str, ReportTotals] = {}

    # lmms-eval reads these
    @property
    def model(self):
        return self._model

    @property
    def device(self):
        return self._device

    @property
    def batch_size(self):
        return self.batch_size_per_gpu

    @property
    def rank(self):
        return self._rank

    @property
    def world_size(self):
        return self._world_size

    # ------------------------------------------------------------------ prompts
    def _prompt(self, context: str, n_images: int) -> str:
        proc = self.processor
        if getattr(proc, "chat_template", None):
            content = [{"type": "image"}] * n_images + [{"type": "text", "text": context}]
            return proc.apply_chat_template(
                [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
            )
        token = getattr(proc, "image_token", None) or "<image>"
        images = " ".join([token] * n_images)
        return (
            f"USER: {images}\n{context} ASSISTANT:"
            if n_images and token not in context
            else context
        )

    def _visuals(self, doc_to_visual, doc_id, task, split) -> list:
        if doc_to_visual is None:
            return []
        visuals = doc_to_visual(self.task_dict[task][split][doc_id])
        visuals = [
            v
            for v in (visuals if isinstance(visuals, (list, tuple)) else [visuals])
            if v is not None
        ]
        out = []
        for v in visuals:
            if isinstance(v, str) or not hasattr(v, "convert"):
                raise NotImplementedError(
                    f"lightkv's lmms-eval model reads images only, got {type(v).__name__} "
                    f"(task {task}); video tasks are not wired up yet"
                )
            out.append(v.convert("RGB"))
        return out

    # ------------------------------------------------------------------ generation
    def _inputs(self, prompts: list[str], images: list[list]) -> dict:
        """The processor's batch of ``prompts`` (left-padded) and their images, on the
        model's device (floating tensors in the model's dtype)."""
        flat = [im for ims in images for im in ims]
        inputs = self.processor(
            text=prompts, images=flat or None, padding=True, return_tensors="pt"
        )
        return {
            k: (
                v.to(self._device, self._model.dtype)
                if v.is_floating_point()
                else v.to(self._device)
            )
            if isinstance(v, torch.Tensor)
            else v
            for k, v in inputs.items()
        }

    def _generation_args(self, gen_kwargs: dict) -> tuple[dict, list[str]]:
        """``generate``'s arguments for a task's generation kwargs, and its stop strings."""
        kw = dict(gen_kwargs)
        until = kw.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        sample = bool(kw.pop("do_sample", False)) and float(kw.get("temperature") or 0) > 0
        args = {
            "max_new_tokens": int(kw.get("max_new_tokens") or self.max_new_tokens),
            "do_sample": sample,
            "num_beams": int(kw.get("num_beams") or 1),
            "pad_token_id": self.tokenizer.pad_token_id,
        }
        if sample:
            args.update(
                {k: kw[k] for k in ("temperature", "top_p", "top_k") if kw.get(k) is not None}
            )
        return args, until

    @staticmethod
    def _cut(text: str, until: list[str]) -> str:
        for stop in until:
            if stop and stop in text:
                text = text.split(stop)[0]
        return text

    def _generate(self, prompts: list[str], images: list[list], gen_kwargs: dict):
        inputs = self._inputs(prompts, images)
        args, until = self._generation_args(gen_kwargs)
        n_in = inputs["input_ids"].shape[1]
        t0 = time.perf_counter()
        with torch.inference_mode(), PrefillTimer(self._model) as timer:
            if self.session is not None:
                with self.session:
                    out = self._model.generate(**inputs, **args)
                rows = row_reports(self.session, timer.seconds)
            else:
                out = self._model.generate(**inputs, **args)
                prompt = (
                    inputs["attention_mask"].sum(-1).tolist()
                    if "attention_mask" in inputs
                    else [n_in] * len(prompts)
                )
                rows = uncompressed_rows(
                    [bool(ims) for ims in images], [int(p) for p in prompt], timer.seconds
                )
        elapsed = time.perf_counter() - t0
        new = out[:, n_in:]
        texts = self.tokenizer.batch_decode(new, skip_special_tokens=True)
        results = []
        pad = self.tokenizer.pad_token_id
        for text, ids, row in zip(texts, new.tolist(), rows):
            n_out = sum(1 for i in ids if i != pad) if pad is not None else len(ids)
            results.append(
                (self._cut(text, until), n_out, dict(row, generate_s=elapsed, output_tokens=n_out))
            )
        return results

    def generate_until(self, requests) -> list:
        """Batched generation for lmms-eval's ``generate_until`` requests."""
        from tqdm import tqdm

        args = [r.args for r in requests]
        padding = [bool((r.metadata or {}).get("__padding_only__")) for r in requests]

        def key(i):
            _, gen_kwargs, _, _, task, split = args[i]
            return (task, split, json.dumps(gen_kwargs, sort_keys=True, default=str))

        order = sorted(range(len(args)), key=lambda i: (key(i), -len(args[i][0])))
        current: list[int]  # request indices of the batch being filled
        batches, current = [], []
        for i in order:
            if current and (key(current[0]) != key(i) or len(current) == self.batch_size_per_gpu):
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
        out: list = [None] * len(args)
        for batch in tqdm(batches, disable=self.rank != 0, desc="lightkv responding"):
            _, gen_kwargs, _, _, task, _ = args[batch[0]]
            images = [self._visuals(args[i][2], args[i][3], args[i][4], args[i][5]) for i in batch]
            prompts = [self._prompt(args[i][0], len(ims)) for i, ims in zip(batch, images)]
            for i, (text, n_out, row) in zip(batch, self._generate(prompts, images, gen_kwargs)):
                row = dict(row, task=task, rank=self.rank)
                out[i] = GenerationResult(
                    text=text,
                    token_counts=LightKVTokenCounts(
                        input_tokens=row["prompt_tokens"], output_tokens=n_out, lightkv=row
                    ),
                )
                if not padding[i]:
                    for k in ("", task):
                        self.totals.setdefault(k, ReportTotals()).add(row)
        self._log_aggregate()
        return out

    def _log_aggregate(self) -> None:
        from lmms_eval.models.model_utils.gen_metrics import log_metrics

        totals = gather_totals(self.totals, self.world_size)
        self.totals = {}
        if self.rank != 0 or not totals:
            return
        metrics = {}
        for k, t in totals.items():
            metrics.update(t.metrics(f"lightkv_{k}_" if k else "lightkv_"))
        overall = totals.get("", ReportTotals())
        speed = overall.output_tokens / overall.generate_s if overall.generate_s > 0 else 0.0
        log_metrics(
            total_elapsed_time=overall.generate_s,
            total_gen_tokens=int(overall.output_tokens),
            avg_speed=speed,
            additional_metrics=metrics,
        )
