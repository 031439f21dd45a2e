"""Which script renders which section of which page, from which committed JSON.

Every entry's ``render`` takes the loaded JSON files, in the order of ``data``, and returns the
section's markdown; it calls the owner script's own pure render functions, so a section never
needs a run to be rebuilt. Paths are relative to the repository root. ``scripts/doc_sections.py``
rewrites the pages from this list and ``tests/test_docs.py`` checks them against it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

F = "docs/figures/"


@dataclass(frozen=True)
class Section:
    name: str                       # the marker name: <!-- name:begin --> ... <!-- name:end -->
    page: str                       # the page that holds it
    script: str                     # the script that measures, writes the JSON and the section
    data: tuple[str, ...]           # the committed JSON it renders from
    render: Callable[..., str]      # the loaded JSON files -> markdown


def _mod(name: str):
    return importlib.import_module(name)


# -- quality.md ------------------------------------------------------------------------------------

def _study_quality(data: dict) -> str:
    sq = _mod("study_quality")
    settings = {k: tuple(v) if isinstance(v, list) else v
                for k, v in data["settings"].items() if k != "shape_overrides"}
    s = sq.Settings(**settings)
    results = {r["id"]: r for r in data["runs"]}
    summary = {**data["summary"], "gaps": {o: {int(k): g for k, g in per.items()}
                                           for o, per in data["summary"]["gaps"].items()}}
    planned = sq.plan(results, s)
    return sq.render(results, summary, s, planned, sq.plan_total(results, planned), "figures")


def _scape99(key: str, fn: str) -> Callable[[dict], str]:
    return lambda data: getattr(_mod("study_scape99"), fn)(data[key], "figures")


# -- performance.md --------------------------------------------------------------------------------

def _ttq(db: dict) -> str:
    t = _mod("bench_time_to_quality")
    return t.table(db, t.summarise(db, t.EXTRA_TARGETS))


def _volume(rows: list) -> str:
    """Every model and wire format at 8 ranks, replicated with flat owners (every layout and
    world size: bench_volume_summary.md)."""
    return _mod("bench_volume").summary([r for r in rows if r["world"] == 8
                                         and r["mode"] == "replicated/flat"])


def _cost(rows: list) -> str:
    """The Llama models' projection at 64 GPUs (every row: cost_model_table.md)."""
    return _mod("cost_model").table([r for r in rows if r["world"] == 64
                                     and r["model"].startswith("Llama")])


def _gasloc(results: dict) -> str:
    from types import SimpleNamespace
    return _mod("bench_gasloc").markdown(results, SimpleNamespace(**results["args"]))


def _checkpoint(res: dict) -> str:
    b = _mod("bench_checkpoint")
    return b.table(res) + "\nWhere the bytes are (all ranks together):\n\n" + b.kinds_table(res)


SECTIONS: list[Section] = [
    Section("study_quality", "docs/quality.md", "scripts/study_quality.py",
            (F + "quality_study.json",), _study_quality),
    Section("study_scape99", "docs/quality.md", "scripts/study_scape99.py",
            (F + "scape99_search.json",), _scape99("summary", "render")),
    Section("study_frontier", "docs/quality.md", "scripts/study_scape99.py",
            (F + "scape99_search.json",), _scape99("frontier", "render_frontier")),
    Section("study_scale", "docs/quality.md", "scripts/study_scape99.py",
            (F + "scape99_search.json",), _scape99("scale", "render_scale")),
    Section("bench_speed", "docs/performance.md", "scripts/bench_speed.py",
            (F + "bench_speed_summary.json",), lambda s: _mod("bench_speed").table(s)),
    Section("bench_ttq", "docs/performance.md", "scripts/bench_time_to_quality.py",
            (F + "bench_ttq_results.json",), _ttq),
    Section("bench_volume", "docs/performance.md", "scripts/bench_volume.py",
            (F + "bench_volume.json",), _volume),
    Section("bench_optim", "docs/performance.md", "scripts/bench_optim.py",
            (F + "bench_optim.json",), lambda r: _mod("bench_optim").table(r)),
    Section("bench_cuda_bytes", "docs/performance.md", "scripts/bench_cuda_bytes.py",
            (F + "bench_cuda_bytes.json",), lambda r: _mod("bench_cuda_bytes").table(r)),
    Section("bench_compile", "docs/performance.md", "scripts/bench_compile.py",
            (F + "bench_compile.json",), lambda r: _mod("bench_compile").render(r)),
    Section("cost_model", "docs/performance.md", "scripts/cost_model.py",
            (F + "cost_model.json",), _cost),
    Section("bench_trainer", "docs/performance.md", "scripts/bench_trainer.py",
            (F + "bench_trainer.json",), lambda r: _mod("bench_trainer").ratio_table(r)),
    Section("bench_device_ops", "docs/gpu.md", "scripts/bench_device_ops.py",
            (F + "bench_device_ops.json",), lambda r: _mod("bench_device_ops").render(r)),
    Section("bench_checkpoint", "docs/checkpoint.md", "scripts/bench_checkpoint.py",
            (F + "bench_checkpoint.json",), _checkpoint),
    Section("bench_gasloc", "docs/gasloc.md", "scripts/bench_gasloc.py",
            (F + "bench_gasloc_results.json",), _gasloc),
    # the README's figures: re-rendered by `scripts/doc_sections.py` after any of these JSON change
    Section("readme_headline", "README.md", "scripts/readme_figures.py",
            (F + "bench_speed_summary.json", F + "bench_volume.json", F + "quality_study.json",
             F + "scape99_search.json"), lambda *d: _mod("readme_figures").headline(*d)),
    Section("readme_results", "README.md", "scripts/readme_figures.py",
            (F + "bench_speed_summary.json", F + "bench_volume.json", F + "quality_study.json",
             F + "scape99_search.json", F + "bench_cuda_bytes.json", F + "bench_device_ops.json",
             F + "bench_checkpoint.json"), lambda *d: _mod("readme_figures").results(*d)),
]


def by_name(name: str) -> Section:
    for s in SECTIONS:
        if s.name == name:
            return s
    raise KeyError(f"no generated section named {name!r}; the registered ones: "
                   f"{', '.join(s.name for s in SECTIONS)} (scripts/docs_registry.py)")
