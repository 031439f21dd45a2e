"""Which script renders which section of which page, from which committed JSON.

Every entry's ``render`` takes the loaded JSON files, in the order of ``data``, and returns the
section's markdown; it calls the owner script's own pure render functions, so a section never
needs a run to be rebuilt. Paths are relative to the repository root. ``scripts/doc_sections.py``
rewrites the pages from this list and ``tests/test_docs.py`` checks them against it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
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


def _call(module: str, fn: str) -> Callable[..., str]:
    return lambda *data: getattr(_mod(module), fn)(*data)


def _page(name: str, page: str, module: str, data: str, render: Callable[..., str] | None = None,
          fn: str = "table") -> Section:
    """A section of docs/<page> that scripts/<module>.py renders from docs/figures/<data>, with
    the module's ``fn`` unless ``render`` adapts the JSON first."""
    return Section(name, f"docs/{page}", f"scripts/{module}.py", (F + data,),
                   render or _call(module, fn))


SECTIONS: list[Section] = [
    _page("study_quality", "quality.md", "study_quality", "quality_study.json", _study_quality),
    _page("study_scape99", "quality.md", "study_scape99", "scape99_search.json",
          _scape99("summary", "render")),
    _page("study_frontier", "quality.md", "study_scape99", "scape99_search.json",
          _scape99("frontier", "render_frontier")),
    _page("study_scale", "quality.md", "study_scape99", "scape99_search.json",
          _scape99("scale", "render_scale")),
    _page("study_horizons", "quality.md", "study_horizons", "scape99_horizons.json",
          lambda data: _mod("study_horizons").render_horizons(data["summary"], "figures")),
    _page("bench_speed", "performance.md", "bench_speed", "bench_speed_summary.json"),
    _page("bench_ttq", "performance.md", "bench_time_to_quality", "bench_ttq_results.json", _ttq),
    _page("bench_volume", "performance.md", "bench_volume", "bench_volume.json", _volume),
    _page("bench_optim", "performance.md", "bench_optim", "bench_optim.json"),
    _page("bench_cuda_bytes", "performance.md", "bench_cuda_bytes", "bench_cuda_bytes.json"),
    _page("bench_compile", "performance.md", "bench_compile", "bench_compile.json", fn="render"),
    _page("cost_model", "performance.md", "cost_model", "cost_model.json", _cost),
    _page("bench_trainer", "performance.md", "bench_trainer", "bench_trainer.json",
          fn="ratio_table"),
    _page("bench_trainer_host", "gpu.md", "bench_trainer", "bench_trainer_host.json",
          fn="host_table"),
    _page("bench_device_ops", "gpu.md", "bench_device_ops", "bench_device_ops.json", fn="render"),
    # a device run's targets: registered once its JSON is committed (scripts/gpu_targets.py)
    *([_page("gpu_targets", "gpu.md", "gpu_targets", "gpu_check.json", fn="render")]
      if (Path(__file__).resolve().parents[1] / F / "gpu_check.json").exists() else []),
    _page("bench_checkpoint", "checkpoint.md", "bench_checkpoint", "bench_checkpoint.json",
          _checkpoint),
    _page("bench_gasloc", "gasloc.md", "bench_gasloc", "bench_gasloc_results.json", _gasloc),
    _page("bench_overlap", "gasloc.md", "bench_overlap", "bench_overlap.json"),
    _page("bench_overlap_gasloc", "gasloc.md", "bench_overlap", "bench_overlap_gasloc.json"),
    _page("bench_overlap_gasloc_straggler", "gasloc.md", "bench_overlap",
          "bench_overlap_gasloc_straggler.json"),
    _page("bench_elastic", "reliability.md", "bench_elastic", "bench_elastic.json"),
    _page("bench_elastic_dp", "reliability.md", "bench_elastic", "bench_elastic_dp.json"),
    _page("bench_elastic_scape", "reliability.md", "bench_elastic", "bench_elastic_scape.json"),
    _page("bench_elastic_scape_fp8", "reliability.md", "bench_elastic",
          "bench_elastic_scape_fp8.json"),
    # the README's figures: re-rendered by `scripts/doc_sections.py` after any of these JSON change
    Section("readme_headline", "README.md", "scripts/readme_figures.py",
            (F + "bench_speed_summary.json", F + "bench_volume.json", F + "quality_study.json",
             F + "scape99_search.json"), _call("readme_figures", "headline")),
    Section("readme_results", "README.md", "scripts/readme_figures.py",
            (F + "bench_speed_summary.json", F + "bench_volume.json", F + "quality_study.json",
             F + "scape99_search.json", F + "bench_cuda_bytes.json", F + "bench_device_ops.json",
             F + "bench_checkpoint.json", F + "scape99_horizons.json"),
            _call("readme_figures", "results")),
]


def by_name(name: str) -> Section:
    for s in SECTIONS:
        if s.name == name:
            return s
    raise KeyError(f"no generated section named {name!r}; the registered ones: "
                   f"{', '.join(s.name for s in SECTIONS)} (scripts/docs_registry.py)")
