"""``python -m scape_train.generate checkpoint=PATH prompt="ROMEO:" [key=value ...]``: text from a model.

PATH is a run directory (its newest valid checkpoint), a checkpoint directory, a Hugging Face
``save_pretrained`` directory (e.g. from ``python -m scape_train.export``), or ``hf:<dir|hub id>``.
The tokenizer comes with the model: the run's saved ``tokenizer/`` (checked against the
checkpoint's fingerprint), or the one in the HF directory. Text streams to the console as it is
generated; decoding uses a KV cache (``models/cache.py``).

Keys (``key=value``; values are taken literally, so quote a prompt with spaces for the shell only):
    checkpoint=PATH        required
    prompt=TEXT            default "" (start a new document)
    prompts_file=FILE      one prompt per line, generated in batches (``batch_size``); overrides prompt
    max_new_tokens=100     temperature=0.8 (0 = greedy)   top_k=50 (0 = off)   top_p=1.0
    seed=0                 device=auto|cpu|cuda   precision=auto|fp32|bf16   batch_size=16
    prefix=auto|eos|bos|none   what precedes the prompt: auto = EOS for our checkpoints (training
                           joins documents with EOS), BOS (else EOS) for Hugging Face models
    stop_at_eos=true       use_cache=true

Examples:
    python -m scape_train.generate checkpoint=outputs/default/20260101-120000 prompt="ROMEO:"
    python -m scape_train.generate checkpoint=exports/my_model prompts_file=prompts.txt temperature=0
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

log = logging.getLogger("scape_train.generate")

HF_PREFIX = "hf:"


@dataclass
class GenerateConfig:
    checkpoint: Optional[str] = None
    prompt: str = ""
    prompts_file: Optional[str] = None
    max_new_tokens: int = 100
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 1.0
    seed: int = 0
    device: str = "auto"
    precision: str = "auto"
    batch_size: int = 16
    prefix: str = "auto"
    stop_at_eos: bool = True
    use_cache: bool = True


def parse_args(argv: Sequence[str]) -> GenerateConfig:
    """``key=value`` arguments onto the typed config; an unknown key or a bad value fails."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    node = OmegaConf.structured(GenerateConfig)
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+")
        if not sep or not key:
            raise ValueError(f"expected key=value, got {arg!r}; see --help")
        try:
            setattr(node, key, None if value in ("null", "None") and key in ("checkpoint", "prompts_file")
                    else value)
        except OmegaConfBaseException as exc:
            names = ", ".join(f.name for f in dataclasses.fields(GenerateConfig))
            raise ValueError(f"{key}={value!r}: {str(exc).splitlines()[0]} (keys: {names})") from exc
    cfg: GenerateConfig = OmegaConf.to_object(node)  # type: ignore[assignment]
    if not cfg.checkpoint:
        raise ValueError("checkpoint=<run dir | checkpoint dir | HF dir | hf:hub_id> is required")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto|cpu|cuda, got {cfg.device!r}")
    if cfg.precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"precision must be auto|fp32|bf16, got {cfg.precision!r}")
    if cfg.prefix not in ("auto", "eos", "bos", "none"):
        raise ValueError(f"prefix must be auto|eos|bos|none, got {cfg.prefix!r}")
    if cfg.batch_size <= 0 or cfg.max_new_tokens < 0:
        raise ValueError("batch_size must be > 0 and max_new_tokens >= 0")
    return cfg


# -- loading ---------------------------------------------------------------------------------


def is_hf_dir(path: Path) -> bool:
    """A transformers directory (config.json), not one of our run or checkpoint directories."""
    return ((path / "config.json").is_file() and not (path / "manifest.json").exists()
            and not (path / "checkpoints").is_dir())


def load_hf_model(source: str, device: torch.device):
    """(model, tokenizer) from a transformers directory or hub id, through ``models/hf.py``; the
    same checks as ``init_from=hf:`` (a saved tokenizer, no more tokens than embedding rows)."""
    from scape_train.data import build_tokenizer
    from scape_train.data.config import DataConfig
    from scape_train.init_from import resolve_source, tokenizer_config
    from scape_train.models import load_hf

    source = resolve_source(source)
    tokenizer = build_tokenizer(DataConfig(tokenizer=tokenizer_config(source)))
    model, cfg = load_hf(source, device=device)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer at {source} has {tokenizer.vocab_size} tokens but the model "
                         f"only {cfg.vocab_size} embedding rows")
    return model.eval(), tokenizer


def load_for_generation(path: str, device: torch.device):
    """(model, tokenizer, kind) with kind "checkpoint" or "hf"."""
    if path.startswith(HF_PREFIX):
        model, tokenizer = load_hf_model(path[len(HF_PREFIX):], device)
        return model, tokenizer, "hf"
    p = Path(path).expanduser()
    if p.is_dir() and is_hf_dir(p):
        model, tokenizer = load_hf_model(str(p), device)
        return model, tokenizer, "hf"
    from scape_train.eval.loading import load_checkpoint

    model, tokenizer, ckpt, manifest = load_checkpoint(p, device)
    log.info("loaded %s (step %s)", ckpt, manifest.get("step"))
    return model, tokenizer, "checkpoint"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is available; use device=cpu")
    return torch.device(device)


def autocast_for(precision: str, device: torch.device) -> Callable:
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


# -- text in, text out -----------------------------------------------------------------------


def prefix_ids(tokenizer, prefix: str, kind: str) -> list[int]:
    if prefix == "auto":
        prefix = "eos" if kind == "checkpoint" or tokenizer.bos_id is None else "bos"
    if prefix == "bos":
        if tokenizer.bos_id is None:
            raise ValueError("prefix=bos but the tokenizer has no BOS token; use prefix=eos")
        return [tokenizer.bos_id]
    return [tokenizer.eos_id] if prefix == "eos" else []


class _Streamer:
    """Prints the text of one row as tokens arrive (held back while a character is incomplete)."""

    def __init__(self, tokenizer, out=None, stop_id: int | None = None):
        self.tokenizer, self.out, self.stop_id = tokenizer, out or sys.stdout, stop_id
        self.ids: list[int] = []
        self.printed = 0
        self.done = False

    def __call__(self, next_ids: torch.Tensor) -> None:
        if self.done:
            return
        token = int(next_ids[0])
        if token == self.stop_id:
            self.done = True
            return
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):   # a multi-byte character split across tokens
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def finish(self) -> None:
        text = self.tokenizer.decode(self.ids)
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()


def complete(model, tokenizer, prompts: Sequence[str], *, max_new_tokens: int, temperature: float,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, prefix: Sequence[int] = (),
             stop_at_eos: bool = True, use_cache: bool = True, autocast: Callable | None = None,
             stream=None) -> list[str]:
    """The completion (new text only) of each prompt. ``stream`` (a file) prints the first
    prompt's completion as it is generated (meant for a single prompt)."""
    from scape_train.models.generation import generate

    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    ids = [list(prefix) + tokenizer.encode(p) for p in prompts]
    if any(not i for i in ids):
        raise ValueError("an empty prompt with prefix=none has no token to start from")
    eos = tokenizer.eos_id if stop_at_eos else None
    streamer = _Streamer(tokenizer, stream, eos) if stream is not None else None
    rows = generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                    eos_id=eos, pad_id=tokenizer.eos_id,
                    use_cache=use_cache, generator=generator, autocast=autocast, on_tokens=streamer)
    if streamer is not None:
        streamer.finish()
    return [tokenizer.decode(r) for r in rows]


def training_sample(model, tokenizer, n_tokens: int, prompt: str = "", seed: int = 0,
                    autocast: Callable | None = None) -> str:
    """The short text the trainer prints at the end of a run (rank 0 only; no collectives):
    ``n_tokens`` sampled at temperature 0.8, top-k 50, from ``prompt`` after an EOS."""
    was_training = model.training
    try:
        text = complete(model, tokenizer, [prompt], max_new_tokens=n_tokens, temperature=0.8,
                        top_k=50, seed=seed, prefix=[tokenizer.eos_id], autocast=autocast)[0]
    finally:
        model.train(was_training)
    return prompt + text


def read_prompts(path: str) -> list[str]:
    lines = Path(path).expanduser().read_text(encoding="utf-8").splitlines()
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"prompts_file={path} holds no prompt (one per line)")
    return prompts


def run(cfg: GenerateConfig, out=None) -> list[str]:
    """Load, generate, print; returns the completions (new text only)."""
    out = out or sys.stdout
    device = resolve_device(cfg.device)
    model, tokenizer, kind = load_for_generation(cfg.checkpoint, device)
    autocast = autocast_for(cfg.precision, device)
    prefix = prefix_ids(tokenizer, cfg.prefix, kind)
    common = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                  top_p=cfg.top_p, prefix=prefix, stop_at_eos=cfg.stop_at_eos,
                  use_cache=cfg.use_cache, autocast=autocast)
    if cfg.prompts_file is None:
        out.write(cfg.prompt)
        out.flush()
        return complete(model, tokenizer, [cfg.prompt], seed=cfg.seed, stream=out, **common)
    prompts = read_prompts(cfg.prompts_file)
    results: list[str] = []
    for start in range(0, len(prompts), cfg.batch_size):
        batch = prompts[start:start + cfg.batch_size]
        # one seed per batch, derived from seed: the same file and seed give the same text
        texts = complete(model, tokenizer, batch, seed=cfg.seed + start, **common)
        for i, (prompt, text) in enumerate(zip(batch, texts)):
            out.write(f"--- [{start + i + 1}/{len(prompts)}]\n{prompt}{text}\n")
        out.flush()
        results.extend(texts)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(Exception):
        import transformers

        transformers.utils.logging.disable_progress_bar()
    from scape_train.checkpoint import CheckpointError

    try:
        run(parse_args(argv))
    except (CheckpointError, ValueError, FileNotFoundError, ConnectionError) as exc:
        if os.environ.get("SCAPE_TRACEBACK") == "1":
            raise
        print(f"\nscape_train.generate: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
