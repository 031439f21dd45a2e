"""Tokenizers: one small wrapper over a transformers tokenizer, and a builder per kind.

Every kind ends as a transformers tokenizer (``Tokenizer.hf``) so the same object serves training,
lm-eval and the Hugging Face export. Encoding goes through the Rust backend's ``encode_batch``,
which releases the GIL, so the loader's background thread does not slow the trainer.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

from scape_train.data.config import DataConfig, TokenizerConfig
from scape_train.data.hub import offline_mode, require_hub

log = logging.getLogger(__name__)

# Hub ids used when ``tokenizer.path`` is unset. The Llama-2 tokenizer is gated under meta-llama;
# NousResearch/Llama-2-7b-hf is an ungated copy of the same tokenizer.model (vocab 32000).
DEFAULT_HUB_IDS = {"gpt2": "openai-community/gpt2", "sentencepiece": "NousResearch/Llama-2-7b-hf"}
EOS_TOKEN = "<|endoftext|>"   # trained_bpe's only special token (GPT-2's spelling)


class Tokenizer:
    """The pipeline's view of a tokenizer: ids without special tokens, eos/bos, a vocab fingerprint."""

    def __init__(self, hf, name: str):
        self.hf = hf
        self.name = name
        if hf.eos_token_id is None:
            raise ValueError(f"tokenizer {name!r} has no EOS token; documents are joined with EOS")
        self.vocab_size: int = len(hf)
        self.eos_id: int = int(hf.eos_token_id)
        self.bos_id: Optional[int] = None if hf.bos_token_id is None else int(hf.bos_token_id)
        # The Rust tokenizer behind every transformers 5 tokenizer; encode_batch releases the GIL.
        self._backend = getattr(hf, "backend_tokenizer", None) or getattr(hf, "_tokenizer", None)
        self.fingerprint: str = _fingerprint(hf)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]
        return [self.hf.encode(t, add_special_tokens=False) for t in texts]

    @property
    def spec(self) -> Optional[str]:
        """The Rust tokenizer as JSON (``tokenizers.Tokenizer.to_str``), from which a worker
        process rebuilds the same tokenizer; ``None`` without a Rust backend."""
        return None if self._backend is None else self._backend.to_str()

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids))

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        self.hf.save_pretrained(str(directory))

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab={self.vocab_size}, eos={self.eos_id}, bos={self.bos_id})"


def _fingerprint(hf) -> str:
    """A stable hash of the vocabulary and the special ids: a resume with another tokenizer shows."""
    vocab = sorted(hf.get_vocab().items())
    blob = json.dumps([vocab, hf.eos_token_id, hf.bos_token_id], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer of ``cfg.tokenizer``; ``trained_bpe`` trains on cfg's corpus once, then caches."""
    t = cfg.tokenizer
    if t.kind == "trained_bpe":
        return _trained_bpe(cfg)
    if t.kind not in ("gpt2", "sentencepiece", "hf"):
        raise ValueError(f"data.tokenizer.kind must be gpt2|sentencepiece|hf|trained_bpe, got {t.kind!r}")
    path = t.path or DEFAULT_HUB_IDS.get(t.kind)
    if path is None:
        raise ValueError("data.tokenizer.kind=hf needs data.tokenizer.path (a directory or hub id)")
    return Tokenizer(_load_pretrained(t.kind, path), name=f"{t.kind}:{path}")


def _tokenizer_class(kind: str):
    from transformers import AutoTokenizer, GPT2Tokenizer, LlamaTokenizer

    # GPT2Tokenizer.from_pretrained(dir) reads vocab.json+merges.txt; note GPT2TokenizerFast(
    # vocab_file=...) silently builds an EMPTY tokenizer in transformers 5.
    return {"gpt2": GPT2Tokenizer, "sentencepiece": LlamaTokenizer, "hf": AutoTokenizer}[kind]


def _load_pretrained(kind: str, path: str):
    cls = _tokenizer_class(kind)
    local = Path(path).expanduser()
    if local.exists():
        directory = local.parent if local.is_file() else local   # accept .../tokenizer.model too
        hf = cls.from_pretrained(str(directory))
        if not _looks_loaded(hf):
            raise FileNotFoundError(f"no {kind} tokenizer files in {directory} (found an empty vocabulary)")
        return hf
    if path.startswith((".", "/", "~")):
        raise FileNotFoundError(f"data.tokenizer.path={path!r} does not exist")
    # A hub id: the local HF cache first (works offline once downloaded), then a quick probe so an
    # unreachable hub fails in seconds rather than after a minute of retries.
    try:
        hf = cls.from_pretrained(path, local_files_only=True)
        if _looks_loaded(hf):
            return hf
    except (OSError, ValueError):
        pass
    require_hub(f"tokenizer {path!r}",
                f"data.tokenizer.path=<local dir with the tokenizer files> (kind={kind})")
    hf = cls.from_pretrained(path)
    if not _looks_loaded(hf):
        raise FileNotFoundError(f"hub id {path!r} has no {kind} tokenizer files")
    return hf


def _looks_loaded(hf) -> bool:
    # transformers 5 builds an EMPTY tokenizer, without an error, when a class finds no files.
    return len(hf) > 256


# ---------------------------------------------------------------- trained byte-level BPE

def _trained_bpe(cfg: DataConfig) -> Tokenizer:
    from transformers import PreTrainedTokenizerFast

    from scape_train.data.sources import corpus_identity

    t = cfg.tokenizer
    key_src = json.dumps({"algo": "byte_bpe_v1", "vocab": t.vocab_size, "max_bytes": t.train_max_bytes,
                          "corpus": corpus_identity(cfg)}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    root = Path(t.cache_dir or Path.home() / ".cache" / "scape_train" / "tokenizers").expanduser()
    target = root / f"bpe{t.vocab_size}-{key}"
    root.mkdir(parents=True, exist_ok=True)
    # One process trains, the others (ranks on this node) wait on the lock and load the result.
    with open(root / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "tokenizer.json").exists():
            _train_into(cfg, target)
    hf = PreTrainedTokenizerFast.from_pretrained(str(target))
    return Tokenizer(hf, name=f"trained_bpe:{target.name}")


def _train_into(cfg: DataConfig, target: Path) -> None:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from scape_train.data.sources import iter_training_texts

    t = cfg.tokenizer
    if t.vocab_size < 300:
        raise ValueError(f"data.tokenizer.vocab_size={t.vocab_size} is below the 256 bytes + merges minimum")
    start = time.perf_counter()
    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=t.vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rust.train_from_iterator(iter_training_texts(cfg, t.train_max_bytes), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token=EOS_TOKEN)
    # Write next to the target and rename: a crash never leaves a half-written cache entry.
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        hf.save_pretrained(str(tmp))
        if target.exists():        # an entry without tokenizer.json: replace it
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("trained byte-level BPE (vocab %d) in %.1fs -> %s", t.vocab_size,
             time.perf_counter() - start, target)


__all__ = ["Tokenizer", "TokenizerConfig", "build_tokenizer", "DEFAULT_HUB_IDS", "offline_mode"]
