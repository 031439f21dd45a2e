"""lm-eval's view of an in-memory scape_train model: ``ScapeLM`` (registered as ``scape_train``).

The model is any module with ``forward(input_ids[B, T]) -> logits[B, T, V]``; the tokenizer is
``scape_train.data.Tokenizer`` (ids without special tokens, ``eos_id``). Three request kinds:

    loglikelihood           sum of log-softmax of the continuation tokens, and whether greedy
                            decoding would have produced them; batched, longest first
    loglikelihood_rolling   a whole document in disjoint windows of ``max_length`` (lm-eval's
                            rolling-window helper), every token scored exactly once
    generate_until          greedy decoding until a stop string, EOS or ``max_gen_toks``

Under torchrun the evaluator hands each rank its share of the documents; this class supplies
the collectives it needs (``all_gather``, ``gather_object``, ``barrier``) so rank 0 ends with
every rank's scores. The model must be replicated on every rank (each rank runs its own number of
forwards); that holds for every strategy in ``scape_train.optim``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Sequence

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from scape_train.comm import Comm

# (request strings, context ids, continuation ids) as TemplateLM.loglikelihood builds them
TokRequest = tuple[tuple[str, str], list[int], list[int]]


@register_model("scape_train")
class ScapeLM(TemplateLM):
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        batch_size: int = 8,
        max_length: int = 0,
        max_gen_toks: int = 256,
        precision: str = "fp32",
        prefix_token_id: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.tok = tokenizer
        # lm-eval reads pad/eos/bos names from ``.tokenizer`` for its results' metadata.
        self.tokenizer = getattr(tokenizer, "hf", None)
        self.batch_size = int(batch_size)
        if self.batch_size < 1:
            raise ValueError(f"eval.batch_size must be >= 1, got {batch_size}")
        model_len = int(getattr(getattr(model, "cfg", None), "max_seq_len", 0) or 0)
        self._max_length = int(max_length) or model_len
        if self._max_length <= 1:
            raise ValueError("the evaluation context length is unknown: set eval.max_length or give "
                             "the model a cfg.max_seq_len")
        if model_len and self._max_length > model_len:
            raise ValueError(f"eval.max_length={max_length} exceeds the model's max_seq_len={model_len}")
        self.max_gen_toks = int(max_gen_toks)
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"eval.precision must be fp32|bf16, got {precision!r}")
        self.precision = precision
        # Documents were packed as ``doc EOS doc EOS``: EOS is what the model saw before a text.
        self._prefix = tokenizer.eos_id if prefix_token_id is None else int(prefix_token_id)
        self._device = next(model.parameters()).device
        self._comm = Comm()   # the evaluator's collectives: device tensors, counted as ``eval``
        self._rank, self._world_size = self._comm.rank, self._comm.world

    # -- properties lm-eval reads ------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tok, "name", type(self.tok).__name__)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return list(self.tok.encode(string))

    def tok_decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids))

    # -- collectives the evaluator calls under torchrun --------------------------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor.reshape(-1)
        t = tensor.reshape(-1).contiguous()
        out = t.new_empty(t.numel() * self.world_size)
        self._comm.all_gather(out, t, kind="eval")
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        if self.world_size == 1:
            return [obj]
        gathered = self._comm.all_gather_object(obj, kind="eval")
        return gathered if self.rank == dst else None

    def barrier(self) -> None:
        self._comm.barrier()

    # -- the model -------------------------------------------------------------------------
    def _autocast(self):
        if self.precision == "bf16":
            return torch.autocast(self._device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @torch.no_grad()
    def _log_probs(self, rows: Sequence[list[int]]) -> torch.Tensor:
        """Log-softmax (fp32) for right-padded rows: [B, T_max, V]. Causal, so padding after a
        row's end never changes the positions before it."""
        width = max(len(r) for r in rows)
        batch = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            batch[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        with self._autocast():
            logits = self.model(batch.to(self._device))
        return F.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests: list[TokRequest], disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        # Longest first: batches hold similar lengths (little padding) and memory peaks at once.
        order = sorted(range(len(requests)),
                       key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        was_training = self.model.training
        self.model.eval()
        bar = tqdm(total=len(order), desc="scape_train loglikelihood",
                   disable=disable_tqdm or self.rank != 0)
        try:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                bar.update(len(chunk))
                rows, conts = [], []
                for i in chunk:
                    _, ctx, cont = requests[i]
                    if not cont:
                        raise ValueError(f"empty continuation in request {requests[i][0]!r}")
                    if len(cont) > self.max_length:
                        raise ValueError(f"a continuation of {len(cont)} tokens exceeds max_length="
                                         f"{self.max_length}")
                    # Keep the last max_length+1 tokens; the input drops the final one.
                    rows.append((ctx + cont)[-(self.max_length + 1):][:-1])
                    conts.append(cont)
                logp = self._log_probs(rows)
                for j, i in enumerate(chunk):
                    n, cont = len(rows[j]), conts[j]
                    span = logp[j, n - len(cont) : n]                    # [len(cont), V]
                    target = torch.tensor(cont, device=span.device)
                    score = span.gather(-1, target[:, None]).sum().item()
                    greedy = bool((span.argmax(-1) == target).all().item())
                    results[i] = (score, greedy)
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], (score, greedy))
        finally:
            bar.close()
            self.model.train(was_training)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows: list[TokRequest] = []
        owner: list[int] = []
        for idx, req in enumerate(requests):
            (text,) = req.args
            for ctx, pred in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append(((text, ""), ctx, pred))
                owner.append(idx)
        totals = [0.0] * len(requests)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        for idx, (score, _) in zip(owner, scores, strict=True):
            totals[idx] += score
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation ------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        items = []
        for req in requests:
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            if gen_kwargs.pop("do_sample", False) and float(gen_kwargs.get("temperature", 1.0)) > 0:
                raise ValueError("the scape_train adapter decodes greedily only; the task asks for "
                                 "sampling (do_sample=True)")
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            eos_text = self.tok_decode([self.eot_token_id])
            if eos_text not in until:
                until.append(eos_text)
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            # Leave room for the answer; the context is cut from the left.
            ctx = self.tok_encode(context)[-max(1, self.max_length - max_new):] or [self.prefix_token_id]
            items.append((ctx, until, max_new))
        order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))
        out: list[str | None] = [None] * len(items)
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                texts = self._greedy([items[i] for i in chunk])
                for i, text in zip(chunk, texts, strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        finally:
            self.model.train(was_training)
        return out  # type: ignore[return-value]

    def _greedy(self, items: list[tuple[list[int], list[str], int]]) -> list[str]:
        """Greedy continuation of a batch; each text ends before its first stop string."""
        seqs = [list(ctx) for ctx, _, _ in items]
        gen: list[list[int]] = [[] for _ in items]
        done = [False] * len(items)
        for step in range(max(m for _, _, m in items)):
            live = [i for i in range(len(items)) if not done[i] and step < items[i][2]]
            if not live:
                break
            # Recompute the window each step (no KV cache): simple, and cheap at eval sizes.
            rows = [seqs[i][-self.max_length:] for i in live]
            logp = self._log_probs(rows)
            for j, i in enumerate(live):
                nxt = int(logp[j, len(rows[j]) - 1].argmax().item())
                seqs[i].append(nxt)
                gen[i].append(nxt)
                text = self.tok_decode(gen[i])
                if nxt == self.eot_token_id or any(s in text for s in items[i][1]) \
                        or len(gen[i]) >= items[i][2]:
                    done[i] = True
        texts = []
        for i, (_, until, _) in enumerate(items):
            text = self.tok_decode(gen[i])
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            texts.append(text)
        return texts

    def get_model_info(self) -> dict[str, Any]:
        cfg = getattr(self.model, "cfg", None)
        return {"model_name": getattr(cfg, "name", type(self.model).__name__),
                "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
                "max_length": self.max_length, "precision": self.precision}
