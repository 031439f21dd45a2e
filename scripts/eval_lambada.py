"""LAMBADA (OpenAI) accuracy and perplexity of an untrained model of a named shape (a baseline).

    python scripts/eval_lambada.py --model llama_tiny --tokenizer-path ../shared/data/tokenizers/gpt2 \
        --data ../shared/data/eval/lambada_openai/lambada_test.jsonl [--limit N] [--out DIR]

The model is built from configs/model/<name>.yaml with seed 0 and evaluated exactly as the trainer
does at the end of a run (scape_train.eval.runner.evaluate_downstream). A trained checkpoint is
evaluated with ``python -m scape_train.eval checkpoint=<run dir> eval=lambada_local`` instead.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from scape_train.data import build_tokenizer
from scape_train.data.config import DataConfig, TokenizerConfig
from scape_train.eval.config import EvalConfig
from scape_train.eval.runner import evaluate_downstream
from scape_train.models import ModelConfig, build_model

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama_tiny", help="a configs/model/<name>.yaml")
    ap.add_argument("--tokenizer-kind", default="gpt2")
    ap.add_argument("--tokenizer-path", required=True)
    ap.add_argument("--data", required=True, help="lambada_test.jsonl (OpenAI's detokenized test set)")
    ap.add_argument("--limit", type=int, default=None, help="first N examples (default: all 5153)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default="outputs/eval_lambada")
    args = ap.parse_args()

    tok = build_tokenizer(DataConfig(tokenizer=TokenizerConfig(kind=args.tokenizer_kind, path=args.tokenizer_path)))
    node = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(REPO / "configs" / "model" / f"{args.model}.yaml"))
    torch.manual_seed(0)
    model = build_model(OmegaConf.to_object(node), vocab_size=tok.vocab_size).eval()
    cfg = EvalConfig(enabled=True, tasks=["lambada_openai"], limit=args.limit, batch_size=args.batch_size,
                     local_data={"lambada_openai": str(Path(args.data).resolve())})
    start = time.perf_counter()
    metrics = evaluate_downstream(model, tok, cfg, args.out)
    print(f"{args.model} (untrained, seed 0, tokenizer {tok.name}, {sum(p.numel() for p in model.parameters()):,} params): "
          f"acc={metrics['lambada_openai/acc']:.4f} perplexity={metrics['lambada_openai/perplexity']:.1f} "
          f"n={int(metrics['lambada_openai/sample_len'])} in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
