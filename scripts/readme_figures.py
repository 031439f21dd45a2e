"""The README's figures, rendered from the benchmarks' committed JSON (pure: JSON in, markdown
out). ``scripts/doc_sections.py`` writes them into the README's ``readme_headline`` and
``readme_results`` sections; the scripts that measure write the JSON (``docs_registry.py``).
"""

from __future__ import annotations

RECOMMENDED = "s99_fp8_d10_now"      # the SCAPE-99 search's recommended setting
RECOMMENDED_POINT = "f_fp8_e4m3_d10"  # the same runs on the frontier
REFERENCE = "scape99"
BASELINE = "adams"

DENSE_ADAMS_CUDA = "dense AdamS + clip, Triton (CUDA's)"   # bench_cuda_bytes' row


def speedups(speed: dict) -> dict[str, float]:
    """SCAPE-99's step-time speed-up over dense AdamS per link rate, from bench_speed_summary."""
    def step(key: str) -> float:
        return speed[key]["step"]["median"]
    return {rate: step(f"{rate}/adams") / step(f"{rate}/scape99")
            for rate in ("1gbit", "100mbit") if f"{rate}/scape99" in speed}


def volume(rows: list, payload: str) -> float:
    """The 99% reduction vs dense fp32 of Llama-500M on 8 ranks, replicated with flat owners."""
    return next(r["reduction"] for r in rows
                if r["model"] == "Llama-500M" and r["world"] == 8 and r["sparsity"] == "99%"
                and r["mode"] == "replicated/flat" and r["mask_coding"] == "auto"
                and r["payload_dtype"] == payload)


def gap(study: dict, opt: str, steps: int) -> dict:
    return study["summary"]["gaps"][opt][str(steps)]


def recommended(search: dict) -> tuple[dict, float]:
    """The recommended setting's row and the fraction of dense AdamS's bytes it sends."""
    rows = {r["candidate"]: r for r in search["summary"]["rows"]}
    row = rows[RECOMMENDED]
    return row, rows[BASELINE]["sent_bytes"] / row["sent_bytes"]


def per_step(search: dict) -> dict:
    """The per-step view from the search's frontier: the recommended setting's steady bytes per
    step as a multiple of SCAPE-99's, and the best point (seed 0) that sends no more per step
    than SCAPE-99, with its gap to dense AdamS."""
    points = {p["candidate"]: p for p in search["frontier"]["points"]}
    ref, rec = points[REFERENCE], points[RECOMMENDED_POINT]
    best = points[ref["best_within_per_step"]]
    return {"ratio": rec["steady_step_bytes"] / ref["steady_step_bytes"],
            "ref_kb": ref["steady_step_bytes"] / 1e3, "best": best}


def horizon_trend(horizons: dict) -> str:
    """SCAPE-99's gap at each horizon of the horizon study (lr tuned at its tuning horizon)."""
    s = horizons["summary"]
    per = sorted(s["gaps"].get(REFERENCE, {}).values(), key=lambda g: g["steps"])
    parts = [f"{g['mean']:+.3f}" + (f" [{g['lo']:+.3f}, {g['hi']:+.3f}]" if g["lo"] is not None
                                     else "") + f" at {g['steps']:,} steps "
             f"({g['tokens_per_param']:.1f} tokens/param, {g['n']} seed{'s' * (g['n'] > 1)})"
             for g in per]
    return ", ".join(parts) or "not run yet"


def local_step_point(horizons: dict) -> str:
    """The horizon study's best local-step run at its tuning horizon (seed 0), beside SCAPE-99
    there: each with its gap to dense AdamS and its bytes over the run."""
    s = horizons["summary"]
    points = {p["candidate"]: p for p in s["frontier"]}
    local = [p for p in points.values() if p["family"] in ("DiLoCo", "GASLoC", "SparseLoCo")]
    if not local or BASELINE not in points or REFERENCE not in points:
        return ""
    best, base, ref = min(local, key=lambda p: p["seed0"]), points[BASELINE], points[REFERENCE]
    return (f"; at {s['tune_steps']:,} steps the best local-step run, {best['label']}, ends "
            f"{best['seed0'] - base['seed0']:+.3f} at {best['sent_bytes'] / 1e6:,.0f} MB, SCAPE-99 "
            f"{ref['seed0'] - base['seed0']:+.3f} at {ref['sent_bytes'] / 1e6:,.0f} MB (seed 0)")


def headline(speed: dict, vol: list, study: dict, search: dict) -> str:
    s = speedups(speed)
    row, frac = recommended(search)
    p = row["paired"]
    step = per_step(search)
    return "\n".join([
        f"- **{s['1gbit']:.2f}x faster steps than dense AdamS at 1 Gbit/s, {s['100mbit']:.2f}x at "
        "100 Mbit/s** (SCAPE-99, 4 bandwidth-shaped ranks on CPU; "
        "[docs/performance.md](docs/performance.md))",
        f"- **{volume(vol, 'fp8_e4m3'):.1f}x fewer bytes per step than a dense fp32 all-reduce** "
        "at 99% sparsity with an fp8 payload (Llama-500M, 8 ranks, exact; "
        "[docs/wire_format.md](docs/wire_format.md))",
        f"- **Dense AdamS's quality at 1/{frac:.0f} of its bytes over a run**: SCAPE with a "
        f"0.1-dense mask and an fp8 payload, {p['mean']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}] "
        f"over {p['n']} paired seeds on a 0.9M-parameter model, at SCAPE-99's total bytes; per "
        f"step it sends {step['ratio']:.2f}x SCAPE-99's, and the best setting at SCAPE-99's "
        f"bytes per step ends {step['best']['gap_seed0']:+.3f} from dense AdamS (seed 0) "
        "([docs/quality.md](docs/quality.md))",
    ]) + "\n"


def results(speed: dict, vol: list, study: dict, search: dict, cuda: dict, ops: dict,
            ckpt: dict, horizons: dict) -> str:
    s = speedups(speed)
    g90, g99 = gap(study, "scape90", 3000), gap(study, "scape99", 3000)
    row, frac = recommended(search)
    p = row["paired"]
    step = per_step(search)
    b = cuda["rows"]
    syncs = max(r["syncs"] for r in ops["results"].values())
    big = next(r for r in ckpt["rows"] if r["strategy"].startswith("SCAPE sharded")
               and r["world"] == max(x["world"] for x in ckpt["rows"]))
    lines = [
        "| what | measured | details |", "|---|---|---|",
        f"| step time, SCAPE-99 vs dense AdamS, 4 ranks | {s['1gbit']:.2f}x at 1 Gbit/s, "
        f"{s['100mbit']:.2f}x at 100 Mbit/s | [performance.md](docs/performance.md) |",
        f"| bytes per step at 99%, Llama-500M, 8 ranks, vs dense fp32 | {volume(vol, 'fp32'):.1f}x "
        f"(fp32 payload), {volume(vol, 'bf16'):.1f}x (bf16), {volume(vol, 'fp8_e4m3'):.1f}x (fp8) "
        "| [wire_format.md](docs/wire_format.md) |",
        f"| final loss gap to dense AdamS, 3000 steps, {g90['n']} seeds | SCAPE-90 "
        f"{g90['mean']:+.3f}, SCAPE-99 {g99['mean']:+.3f} | [quality.md](docs/quality.md) |",
        f"| the same at SCAPE-99's total bytes: d 0.1, fp8 payload, no warm-up | {p['mean']:+.3f} "
        f"[{p['lo']:+.3f}, {p['hi']:+.3f}], 1/{frac:.0f} of dense AdamS's bytes over the run, "
        f"{step['ratio']:.2f}x SCAPE-99's per step | [quality.md](docs/quality.md) |",
        f"| the same at SCAPE-99's bytes per step ({step['ref_kb']:.1f} KB after its warm-up) | "
        f"best: {step['best']['label']}, {step['best']['gap_seed0']:+.3f} (seed 0) | "
        "[quality.md](docs/quality.md) |",
        f"| SCAPE-99's gap against the horizon, lr tuned at "
        f"{horizons['summary']['tune_steps']:,} steps | {horizon_trend(horizons)}"
        f"{local_step_point(horizons)} | "
        "[quality.md](docs/quality.md#the-gap-against-tokens-per-parameter) |",
        f"| bytes moved per parameter by the optimizer step (CUDA path, Triton, d 0.1) | "
        f"{b['CUDA path, Triton, replicated, d=0.1']['bytes_per_param']:.1f} (dense AdamS "
        f"{b[DENSE_ADAMS_CUDA]['bytes_per_param']:.0f}) | "
        "[performance.md](docs/performance.md) |",
        f"| host syncs per optimizer step, every optimizer, {ops['world']} ranks | {syncs:g} | "
        "[gpu.md](docs/gpu.md) |",
        f"| checkpoint of Llama-1.8B, SCAPE sharded, {big['world']} ranks | "
        f"{big['after']['total_bytes'] / 1e9:.1f} GB in all, "
        f"{big['after']['max_rank_bytes'] / 1e9:.2f} GB at most per rank | "
        "[checkpoint.md](docs/checkpoint.md) |",
    ]
    return "\n".join(lines) + "\n"
