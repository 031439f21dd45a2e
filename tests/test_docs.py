"""The README and docs/: generated sections equal their rendering from the committed JSON, no
history of the work in prose or code comments, every link and referenced file exists, and every
command the README shows composes."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import doc_sections  # noqa: E402
from docs_registry import SECTIONS  # noqa: E402

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CODE = [p for d in ("scape_train", "scripts", "tests", "configs")
        for p in sorted((REPO / d).rglob("*"))
        if p.is_file() and p.suffix in (".py", ".yaml", ".yml", ".sh", ".sbatch", "")
        and "__pycache__" not in p.parts]
# the history of the work, not the work: issue numbers and which session did what
HISTORY = [re.compile(r"\bissue\s*#?\d+", re.I),
           re.compile(r"\b(this|previous|earlier|\d+(st|nd|rd|th)|first|second|third|fourth|fifth|"
                      r"sixth|seventh|eighth|ninth|tenth)\s+session\b", re.I)]
MARKER = re.compile(r"^<!-- ([\w.-]+):(begin|end) -->$", re.M)


def _text(path: Path) -> str:
    return path.read_text(errors="replace")


# -- generated sections ----------------------------------------------------------------------------

@pytest.mark.parametrize("section", SECTIONS, ids=[s.name for s in SECTIONS])
def test_a_generated_section_equals_its_rendering_from_the_committed_json(section):
    page = REPO / section.page
    text = page.read_text()
    body = doc_sections.render(section)
    assert body.strip(), f"{section.name} renders to nothing"
    assert doc_sections.replace_section(text, section.name, body, section.page) == text, (
        f"{section.page}: section {section.name} differs from what {section.script} renders from "
        f"{', '.join(section.data)}; run `python scripts/doc_sections.py {section.name}`")


def test_the_readme_reads_the_horizon_trend_from_the_study_summary():
    import readme_figures

    def g(steps, n, lo=None, hi=None):
        return {"steps": steps, "n": n, "mean": 0.1, "lo": lo, "hi": hi,
                "tokens_per_param": steps / 900}
    gaps = {"10000": g(10000, 3, 0.0, 0.2), "3000": g(3000, 3, 0.05, 0.15), "30000": g(30000, 1)}
    trend = readme_figures.horizon_trend({"summary": {"gaps": {"scape99": gaps}}})
    assert trend == ("+0.100 [+0.050, +0.150] at 3,000 steps (3.3 tokens/param, 3 seeds), "
                     "+0.100 [+0.000, +0.200] at 10,000 steps (11.1 tokens/param, 3 seeds), "
                     "+0.100 at 30,000 steps (33.3 tokens/param, 1 seed)")
    assert readme_figures.horizon_trend({"summary": {"gaps": {}}}) == "not run yet"
    # the best local-step run at the tuning horizon beside SCAPE-99, each against dense AdamS
    front = [{"candidate": c, "label": c, "family": f, "seed0": loss, "sent_bytes": mb * 1e6}
             for c, f, loss, mb in (("adams", "dense AdamS", 3.4, 55000),
                                    ("scape99", "SCAPE", 3.5, 1846),
                                    ("diloco_h30", "DiLoCo", 3.8, 1844),
                                    ("gasloc_h30", "GASLoC", 3.7, 2400))]
    summary = {"summary": {"tune_steps": 10000, "frontier": front}}
    assert readme_figures.local_step_point(summary) == (
        "; at 10,000 steps the best local-step run, gasloc_h30, ends +0.300 at 2,400 MB, "
        "SCAPE-99 +0.100 at 1,846 MB (seed 0)")
    assert readme_figures.local_step_point({"summary": {"tune_steps": 10000,
                                                        "frontier": front[:2]}}) == ""


def test_every_marked_section_is_registered_once():
    names = [s.name for s in SECTIONS]
    assert len(names) == len(set(names)) and len(names) >= 10
    marked = {(p.relative_to(REPO).as_posix(), m.group(1))
              for p in PAGES for m in MARKER.finditer(p.read_text())}
    registered = {(s.page, s.name) for s in SECTIONS}
    assert marked == registered, (f"marked, not registered: {sorted(marked - registered)}; "
                                  f"registered, not marked: {sorted(registered - marked)}")


def test_replace_section_keeps_the_page_around_it_and_refuses_a_missing_marker():
    page = "# T\n\nintro\n\n<!-- s:begin -->\nold\n<!-- s:end -->\n\nafter\n"
    new = doc_sections.replace_section(page, "s", "<!-- s:begin -->\n\nnew\n<!-- s:end -->\n")
    assert new == "# T\n\nintro\n\n<!-- s:begin -->\nnew\n<!-- s:end -->\n\nafter\n"
    assert doc_sections.replace_section(new, "s", "new") == new
    with pytest.raises(ValueError, match="<!-- t:begin -->"):
        doc_sections.replace_section(page, "t", "x")
    assert doc_sections.replace_section("# T\n", "t", "x", append=True) == \
        "# T\n\n<!-- t:begin -->\nx\n<!-- t:end -->\n"


# -- no history of the work ------------------------------------------------------------------------

def _history(path: Path) -> list[str]:
    out = []
    for i, line in enumerate(_text(path).splitlines(), 1):
        for pat in HISTORY:
            m = pat.search(line)
            if m:
                out.append(f"{path.relative_to(REPO)}:{i}: {m.group(0)!r}")
    return out


def test_docs_and_code_comments_carry_no_history_of_the_work():
    assert len(PAGES) >= 10 and len(CODE) >= 100
    hits = [h for p in PAGES + CODE for h in _history(p)]
    assert not hits, "say what is true now (git keeps the history):\n" + "\n".join(hits)


def test_the_history_patterns_catch_what_they_are_for():
    caught = [f"see {'issue'} 12", f"as in {'Issue'} #24", f"on the {'sixth'} session's code",
              f"{'this'} session", f"the {'3rd'} session", f"in an {'earlier'} session"]
    fine = ["a pytest scope of 'session'", "@pytest.fixture(scope=\"session\")",
            "the W&B session", "issues with the hub", "pytorch/pytorch#108158"]
    assert all(any(p.search(s) for p in HISTORY) for s in caught)
    assert not any(p.search(s) for p in HISTORY for s in fine)


# -- links and referenced files --------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\s]+)`")
ROOTS = ("scape_train/", "scripts/", "tests/", "configs/", "docs/", "figures/", ".ci/")


def _exists(ref: str, page: Path) -> bool:
    ref = ref.split("::")[0].split("#")[0].rstrip(",.;:")
    return any((base / ref).exists() for base in (page.parent, REPO, REPO / "scape_train"))


def _referenced(page: Path) -> tuple[list[str], list[str]]:
    text = _text(page)
    links = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:|#", t)]
    files = [t for t in CODE_SPAN.findall(text)
             if t.startswith(ROOTS) and not re.search(r"[<>*${}]|\.\.\.", t)]
    return links, files


def test_every_relative_link_and_referenced_file_exists():
    missing, seen = [], 0
    for page in PAGES:
        links, files = _referenced(page)
        seen += len(links) + len(files)
        missing += [f"{page.relative_to(REPO)}: {ref}" for ref in links + files
                    if not _exists(ref, page)]
    assert seen >= 100, seen
    assert not missing, "\n".join(missing)


# -- the README's commands -------------------------------------------------------------------------

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
LAUNCHERS = ("scripts/launch_torchrun.sh", "scripts/launch_slurm.sbatch")


def _commands(text: str) -> list[list[str]]:
    """Every command line of the fenced blocks, continuations joined, comments dropped."""
    out = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            while words and re.match(r"^[A-Z_]+=", words[0]):     # NPROC=4 ... (environment)
                words = words[1:]
            if words:
                out.append(words)
    return out


def _scape_commands() -> list[tuple[str, list[str]]]:
    """(module, arguments) of every `python -m scape_train...` and launcher line."""
    out = []
    for words in _commands((REPO / "README.md").read_text()):
        if "-m" in words and words[words.index("-m") + 1].startswith("scape_train"):
            i = words.index("-m")
            if words[i - 1].endswith("python"):
                out.append((words[i + 1], words[i + 2:]))
        else:
            for j, w in enumerate(words):
                if w in LAUNCHERS:
                    out.append(("scape_train", words[j + 1:]))
    return out


def _hydra_value(arg: str) -> str:
    """A shell word as Hydra's override grammar wants it: a value with glob characters quoted."""
    key, sep, value = arg.partition("=")
    return f"{key}='{value}'" if sep and re.search(r"[*?\[\]{}]", value) else arg


def _compose(config_name: str, overrides: list[str]):
    from scape_train.config import register_configs
    from scape_train.eval.__main__ import register_configs as register_eval_app

    register_configs()
    register_eval_app()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides)


def test_every_readme_command_composes():
    """What `--cfg job` appended to each command does: the overrides compose onto the typed
    config (Hydra's compose API, in process), keys checked as the entry point checks them."""
    from omegaconf import OmegaConf

    from scape_train.config import override_key_problems, to_object
    from scape_train.generate import parse_args

    commands = _scape_commands()
    modules = {m for m, _ in commands}
    assert len(commands) >= 15 and {"scape_train", "scape_train.eval", "scape_train.plan",
                                     "scape_train.generate", "scape_train.export"} <= modules
    failed = []
    for module, args in commands:
        overrides = [_hydra_value(a) for a in args if not a.startswith("-")]
        try:
            if module in ("scape_train", "scape_train.plan"):
                problems = override_key_problems(overrides)
                assert not problems, problems
                to_object(_compose("config", overrides))
            elif module == "scape_train.eval":
                OmegaConf.to_object(_compose("eval_app", overrides))
            elif module == "scape_train.generate":
                parse_args(args)
            elif module == "scape_train.elastic":
                from scape_train.elastic.__main__ import build_parser
                build_parser().parse_args(args)
            else:   # scape_train.export: <checkpoint> <out dir>, argparse
                import importlib.util
                assert importlib.util.find_spec(module) and len(args) == 2, args
        except Exception as exc:   # noqa: BLE001 (each failure reported with its command)
            failed.append(f"python -m {module} {shlex.join(args)}: {type(exc).__name__}: {exc}")
    assert not failed, "\n".join(failed)


def test_every_script_the_readme_names_exists():
    text = (REPO / "README.md").read_text()
    named = set(re.findall(r"\bscripts/[\w./-]*\w", text))
    assert len(named) >= 4, named
    missing = sorted(n for n in named if not (REPO / n).exists())
    assert not missing, missing


def test_page_lengths():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
    assert len((REPO / "docs" / "performance.md").read_text().splitlines()) <= 300
