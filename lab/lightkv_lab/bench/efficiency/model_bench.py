"""One model's efficiency measurements (`bench_model`): the uncompressed prefill and every
variant, timed, with their KV bytes, FLOPs, overhead, peak memory and the attention that ran
(`check_attention`: every variant alike)."""

from __future__ import annotations

import contextlib
import gc
import statistics
from collections.abc import Callable
from typing import Any

import torch

from lightkv_lab.bench.efficiency.accounting import (
    kv_from_cache,
    reference_flops,
    reference_shape_flops,
)
from lightkv_lab.bench.efficiency.measure import (
    OverheadProbe,
    ReferenceScoring,
    Timer,
    cache_of,
    first_token,
    measure_peaks,
    measure_peaks_in_child,
    sync_device,
)
from lightkv_lab.bench.efficiency.shapes import (
    EAGER_REF,
    PRE_TEXT,
    PROJECTED,
    UNCOMPRESSED,
    BenchConfig,
    ModelSpec,
    build_model,
    scaled_pipeline,
    text_after_image,
    variant_placement,
)
from lightkv_lab.bench.efficiency.specs import HEAD_DIM

__all__ = ["bench_model", "check_attention"]


def bench_model(spec: ModelSpec, cfg: BenchConfig, tick: Callable[[str], None]) -> dict[str, Any]:
    from lightkv.adapters import apply
    from lightkv.adapters.attention import AttentionWatch, attention_modules, configured_attention
    from lightkv.policies import average_kept_fraction

    torch.manual_seed(0)
    device = torch.device(cfg.device)
    sync = lambda: sync_device(device)
    model, inputs, sizes = build_model(spec, cfg)
    ids = inputs["input_ids"]
    n0 = int(ids.shape[1])
    from lightkv.testing import IMAGE, VIDEO

    n_vis = int(((ids == IMAGE) | (ids == VIDEO)).sum())  # image and video placeholders
    pipes = {p: scaled_pipeline(p, spec, sizes["layers"]) for p in cfg.variants}
    refused = {}
    for variant in list(
        pipes
    ):  # e.g. tower relevance on a family whose adapter does not expose its tower
        try:
            apply(pipes[variant], model).close()
        except (NotImplementedError, ValueError) as e:
            refused[variant] = str(e)
            del pipes[variant]
    compressed = [*pipes, *([PROJECTED] if cfg.projection_baseline else [])]
    if cfg.projection_baseline:
        pipes[PROJECTED] = pipes["lightkv"]
    variants = [UNCOMPRESSED, *compressed]
    times: dict[str, list[float]] = {v: [] for v in variants}
    overhead: dict[str, list[dict[str, float]]] = {p: [] for p in compressed}
    last: dict[str, Any] = {}
    instrument_inline = device.type == "cpu"  # hooks cost microseconds on CPU; on CUDA they sync
    # what each variant's attention ran (a stage must never switch it, e.g. to eager), watched
    # on an untimed prefill: the watch costs a Python round trip per torch call in attention
    loaded, att_mods, attention = configured_attention(model), attention_modules(model), {}

    def prefill(variant: str, watch: bool = False):
        watcher = AttentionWatch(model, att_mods) if watch else contextlib.nullcontext()
        with torch.no_grad(), watcher:
            if variant == UNCOMPRESSED:
                with Timer(device) as t:
                    out, _tok = first_token(model, inputs)
                result = t.seconds, out, None, None
            else:
                with apply(
                    pipes[variant], model, reuse_projections=variant != PROJECTED
                ) as session:
                    probe = OverheadProbe(session, sync) if instrument_inline else None
                    try:
                        with Timer(device) as t:
                            out, _tok = first_token(model, inputs)
                    finally:
                        if probe is not None:
                            probe.close()
                    result = t.seconds, out, session, (dict(probe.totals) if probe else None)
        if watch:
            attention[variant] = {
                **watcher.summary(),
                "configured_after": configured_attention(model),
            }
        return result

    for i in range(cfg.warmup + cfg.repeats):
        for variant in variants:
            seconds, out, session, totals = prefill(variant, watch=i == 0 and cfg.warmup > 0)
            if i >= cfg.warmup:
                times[variant].append(seconds)
                if totals is not None:
                    overhead[variant].append({**totals, "prefill": seconds})
            last[variant] = (out, session)
            tick(f"{spec.name}/{variant}")
    for variant in variants if not attention else ():  # no warmup: one more, untimed prefill each
        prefill(variant, watch=True)
    check_attention(attention, loaded)
    if not instrument_inline:  # separate instrumented runs (the hooks synchronise the GPU)
        for variant in compressed:
            for _ in range(max(1, min(3, cfg.repeats))):
                with (
                    torch.no_grad(),
                    apply(pipes[variant], model, reuse_projections=variant != PROJECTED) as session,
                ):
                    probe = OverheadProbe(session, sync)
                    with Timer(device) as t:
                        first_token(model, inputs)
                    probe.close()
                overhead[variant].append({**probe.totals, "prefill": t.seconds})

    entry: dict[str, Any] = {
        "title": spec.title,
        "image": spec.image_note
        if spec.family != "internvl"
        else f"{cfg.internvl_tiles} tile(s) of 16x16 ({cfg.internvl_tiles * 256} tokens)",
        "prompt_tokens": n0,
        "vision_tokens": n_vis,
        "reference_decoder": dict(spec.ref, head_dim=HEAD_DIM),
        "reduced_decoder": dict(sizes, head_dim=HEAD_DIM),
        "variants": {},
        "refused": refused,
        "attention_implementation": cfg.attn_implementation,
        "attention_configured": loaded,
    }
    base_t = statistics.median(times[UNCOMPRESSED])
    base_flops = None
    for variant in variants:
        out, session = last[variant]
        report = session.report() if session is not None else None
        kv = kv_from_cache(cache_of(out), report)
        t = statistics.median(times[variant])
        rec: dict[str, Any] = {
            "ttft_ms_median": 1000 * t,
            "ttft_ms_min": 1000 * min(times[variant]),
            "ttft_ms_all": [1000 * x for x in times[variant]],
            **kv,
            "attention": attention[variant],
        }
        if variant != UNCOMPRESSED:
            # each round's ratio to the uncompressed prefill of the same round: their spread is
            # the noise the headline ratio (of medians) carries
            rec["ttft_ratio_rounds"] = [t / u for t, u in zip(times[variant], times[UNCOMPRESSED])]
            rec["placement"] = variant_placement(variant, spec, sizes["layers"])
        if report is None:
            rec["kv_bytes_vision"] = None  # filled from the first report below
        else:
            base_flops = report.prefill_flops_baseline
            sched = pipes[variant].plan(sizes["layers"])
            rec.update(
                pipeline=report.pipeline,
                schedule_layers=[s.layer for s in sched],
                stages=[f"{s.vision_in}->{s.vision_out}" for s in report.stages],
                flops=report.prefill_flops,
                relevance_flops=report.relevance_flops,
                kept_vision_fraction=report.kept_vision_fraction,
                kept_vision_fraction_analytic=average_kept_fraction(sched, sizes["layers"]),
                kv_bytes_report=report.kv_bytes,
                kv_bytes_vision_baseline=report.kv_bytes_vision_baseline,
            )
            rec.update(
                reference_shape_flops(
                    spec, "lightkv" if variant == PROJECTED else variant, report, n0
                )
            )
            if overhead[variant]:
                parts = {
                    k: statistics.median(o[k] for o in overhead[variant])
                    for k in overhead[variant][0]
                }
                prefill_s = parts.pop("prefill")
                total = sum(parts.values())
                rec["overhead_ms"] = {k: 1000 * v for k, v in parts.items()}
                rec["overhead_share"] = total / prefill_s
                rec["overhead_share_parts"] = {k: v / prefill_s for k, v in parts.items()}
                # the same at the full-size decoder, assuming this machine's FLOP rate: relevance
                # (projections) grows with width^2, the stage (hidden-state features) with width
                w = spec.ref["hidden"] / sizes["hidden"]
                est = (
                    parts["layout"]
                    + parts["bookkeeping"]
                    + parts["relevance"] * w * w
                    + parts["stage"] * w
                )
                flops_full = rec.get("flops_ratio_reference_shape")
                if flops_full is not None:
                    ref_prefill = (
                        base_t
                        * reference_flops(spec, n0)
                        / report.prefill_flops_baseline
                        * flops_full
                    )
                    rec["overhead_share_reference_estimate"] = est / ref_prefill
        entry["variants"][variant] = rec
    # the uncompressed variant's vision bytes and FLOPs (from the first compressed report)
    unc = entry["variants"][UNCOMPRESSED]
    for variant in pipes:
        rec = entry["variants"][variant]
        unc["kv_bytes_vision"] = rec["kv_bytes_vision_baseline"]
        break
    if base_flops is not None:
        unc["flops"] = base_flops
    for variant in compressed:
        rec = entry["variants"][variant]
        rec["ratios"] = {
            "flops": rec["flops"] / unc["flops"],
            "ttft": rec["ttft_ms_median"] / unc["ttft_ms_median"],
            "kv_bytes": rec["kv_bytes"] / unc["kv_bytes"],
            "kv_bytes_vision": rec["kv_bytes_vision"] / unc["kv_bytes_vision"]
            if unc["kv_bytes_vision"]
            else None,
        }
        rec["ttft_minus_flops_pp"] = 100 * (rec["ratios"]["ttft"] - rec["ratios"]["flops"])

    if cfg.compares_reference_scoring and "lightkv" in pipes:
        ref_s, ours = [], []
        with torch.no_grad():
            for _ in range(cfg.eager_repeats):
                with apply(pipes["lightkv"], model) as session:
                    probe = OverheadProbe(session, sync)
                    ref = ReferenceScoring(session, (PRE_TEXT, text_after_image(inputs)), sync)
                    first_token(model, inputs)
                    probe.close()
                    ref.close()
                ref_s.append(ref.seconds)
                ours.append(probe.totals["relevance"])
                tick(f"{spec.name}/{EAGER_REF}")
        r, o = statistics.median(ref_s), statistics.median(ours)
        entry["eager_reference"] = {
            "reference_scoring_ms": 1000 * r,
            "lightkv_relevance_ms": 1000 * o,
            "time_ratio": r / o if o else None,
            "share_of_lightkv_prefill": r / (entry["variants"]["lightkv"]["ttft_ms_median"] / 1000),
            "matrix_bytes": ref.matrix_bytes,
            "matrix_shape": f"[1, {sizes['heads']}, N, N] at each merge layer; largest N={n0}",
            "matrix_bytes_reference_decoder": 4
            * spec.ref["heads"]
            * n0
            * n0
            * (2 if cfg.dtype != "float32" else 1),
        }

    if cfg.memory:
        mem_variants = variants + ([EAGER_REF] if cfg.compares_reference_scoring else [])
        if device.type == "cuda":
            model = last = None
            gc.collect()
            peaks = measure_peaks(spec, cfg, mem_variants)
        else:
            peaks = measure_peaks_in_child(spec, cfg, mem_variants)
        tick(f"{spec.name}/memory")
        entry["memory_method"] = peaks["method"]
        for v, p in peaks["peak_bytes"].items():
            if v in entry["variants"]:
                entry["variants"][v]["peak_bytes"] = p
        up = peaks["peak_bytes"][UNCOMPRESSED]
        for v in compressed:
            entry["variants"][v]["ratios"]["peak_memory"] = (
                peaks["peak_bytes"][v] / up if up else None
            )
        if EAGER_REF in peaks["peak_bytes"]:
            er = entry.setdefault("eager_reference", {})
            er["peak_bytes_lightkv"] = peaks["peak_bytes"]["lightkv"]
            er["peak_bytes_with_reference_scoring"] = peaks["peak_bytes"][EAGER_REF]
            er["peak_ratio_vs_uncompressed"] = peaks["peak_bytes"][EAGER_REF] / up if up else None
    model = last = None
    gc.collect()
    return entry


def check_attention(attention: dict[str, dict[str, Any]], loaded: dict[str, Any]) -> None:
    """Raise `lightkv.adapters.attention.AttentionChanged`, naming the preset, when a variant
    ran other attention implementations than the uncompressed model or left the model's
    configs naming another one than it was loaded with."""
    from lightkv.adapters.attention import AttentionChanged, check_same_attention

    check_same_attention({v: a["ran"] for v, a in attention.items()}, UNCOMPRESSED)
    for variant, a in attention.items():
        if a["configured_after"] != loaded:
            raise AttentionChanged(
                f"preset {variant!r} left the model's attention configured as "
                f"{a['configured_after']} (loaded with {loaded}): a session must restore it"
            )
