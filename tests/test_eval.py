"""Downstream evaluation: the lm-eval adapter against direct computation, the HF export path,
data parallelism, task validation and data errors, and checkpoint loading checks."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

from scape_train.checkpoint import CheckpointError, CheckpointManager
from scape_train.distributed import DistInfo
from scape_train.eval.adapter import ScapeLM
from scape_train.eval.config import EvalConfig
from scape_train.eval.tasks import TaskConfigError, TaskDataUnavailableError, load_tasks, prepare_tasks

TINY = dict(name="eval_tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=32)
LIMIT = 24


def _tokenizer(shared_data: Path):
    from scape_train.data import build_tokenizer
    from scape_train.data.config import DataConfig, TokenizerConfig

    return build_tokenizer(DataConfig(tokenizer=TokenizerConfig(kind="gpt2", path=str(shared_data / "tokenizers" / "gpt2"))))


def _model(vocab: int, seed: int = 0, **over):
    from scape_train.models import ModelConfig, build_model

    torch.manual_seed(seed)
    return build_model(ModelConfig(**{**TINY, **over}), vocab_size=vocab).eval()


def _lambada_cfg(shared_data: Path, **over) -> EvalConfig:
    local = {"lambada_openai": str(shared_data / "eval" / "lambada_openai" / "lambada_test.jsonl")}
    return EvalConfig(enabled=True, tasks=["lambada_openai"], limit=LIMIT, local_data=local,
                      bootstrap_iters=0, **over)


@pytest.fixture(scope="module")
def tok(shared_data):
    return _tokenizer(shared_data)


def _req(kind: str, args: tuple) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def _direct_logprob(model, ids: list[int], n_cont: int) -> tuple[float, bool]:
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]])).float(), -1)[0]
    target = torch.tensor(ids[1:])
    tail = logp[-n_cont:]
    return tail.gather(-1, target[-n_cont:, None]).sum().item(), bool((tail.argmax(-1) == target[-n_cont:]).all())


def test_loglikelihood_matches_direct_computation(tok):
    model = _model(tok.vocab_size)
    lm = ScapeLM(model, tok, batch_size=3)
    pairs = [("The cat sat on the", " mat"), ("Once upon a time there was a", " little old house"),
             ("Hello", " world"), ("A", " b c d e f"), ("", "Completely unconditioned text")]
    got = lm.loglikelihood([_req("loglikelihood", p) for p in pairs], disable_tqdm=True)
    for (ctx, cont), (score, greedy) in zip(pairs, got):
        whole = tok.encode(ctx + cont)
        n_ctx = len(tok.encode(ctx)) if ctx else 0
        ids = ([tok.eos_id] + whole) if not ctx else whole
        want, want_greedy = _direct_logprob(model, ids, len(whole) - n_ctx)
        assert score == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy

    # A continuation made of the model's own argmax tokens is greedy; perturbing one token is not.
    ctx_ids = tok.encode("In the beginning God created")
    ids = list(ctx_ids)
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    greedy_req = ((tok.decode(ctx_ids), tok.decode(ids[len(ctx_ids):])), ctx_ids, ids[len(ctx_ids):])
    other = ids[len(ctx_ids):-1] + [(ids[-1] + 1) % tok.vocab_size]
    bad_req = ((greedy_req[0][0], tok.decode(other)), ctx_ids, other)
    (s1, g1), (s2, g2) = lm._loglikelihood_tokens([greedy_req, bad_req])
    assert g1 is True and g2 is False and s1 > s2


def test_rolling_loglikelihood_covers_long_text_once(tok):
    model = _model(tok.vocab_size)
    lm = ScapeLM(model, tok, batch_size=2)
    L = model.cfg.max_seq_len
    text = " ".join(f"word{i} and more text" for i in range(40))
    ids = tok.encode(text)
    assert len(ids) > 3 * L
    (got,) = lm.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))], disable_tqdm=True)
    # Direct: every token once; the first L from [EOS]+prefix, then chunks of L tokens each seeing
    # the L tokens before it (the last chunk keeps a full window).
    seq = [tok.eos_id] + ids
    total, done = 0.0, 0
    while done < len(ids):
        n = min(L, len(ids) - done)
        end = done + n + 1                        # seq index after the last predicted token
        window = seq[max(0, end - L - 1):end]
        total += _direct_logprob(model, window, n)[0]
        done += n
    assert got == pytest.approx(total, rel=1e-5)


def test_generate_until_greedy_with_stop(tok):
    model = _model(tok.vocab_size)
    lm = ScapeLM(model, tok, batch_size=2)
    ctx = "The king said"
    ids = tok.encode(ctx)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    full = tok.decode(ids[len(tok.encode(ctx)):])
    stop = tok.decode(ids[-2:-1])  # a token of the greedy path: output ends before it
    outs = lm.generate_until([_req("generate_until", (ctx, {"until": [], "max_gen_toks": 6})),
                              _req("generate_until", (ctx, {"until": [stop], "max_gen_toks": 6}))])
    assert outs[0] == full
    assert outs[1] == full.split(stop)[0]


def test_lambada_end_to_end_matches_hf_export(tok, shared_data, tmp_path):
    from lm_eval.models.huggingface import HFLM

    from scape_train.eval.runner import evaluate_downstream, flat_metrics, run_lm_eval
    from scape_train.models import export_hf

    model = _model(tok.vocab_size, seed=1)
    cfg = _lambada_cfg(shared_data)
    ours = evaluate_downstream(model, tok, cfg, tmp_path, DistInfo())
    saved = json.loads((tmp_path / "eval" / "results_final.json").read_text())
    assert saved["results"]["lambada_openai"]["acc,none"] == ours["lambada_openai/acc"]
    assert ours["lambada_openai/sample_len"] == LIMIT and ours["lambada_openai/perplexity"] > 1

    export = export_hf(model, tmp_path / "hf", tokenizer=tok.hf)
    hf_lm = HFLM(pretrained=str(export), tokenizer=str(export), batch_size=4, device="cpu",
                 dtype="float32", prefix_token_id=tok.eos_id)
    setup = prepare_tasks(cfg)
    try:
        theirs = flat_metrics(run_lm_eval(hf_lm, cfg, setup))
    finally:
        setup.close()
    assert theirs["lambada_openai/acc"] == ours["lambada_openai/acc"]
    assert theirs["lambada_openai/perplexity"] == pytest.approx(ours["lambada_openai/perplexity"], rel=1e-4)


def _dp_rank(rank: int, world: int, shared_data: str, out_dir: str) -> dict:
    from scape_train.distributed import init_distributed
    from scape_train.eval.runner import evaluate_downstream

    info = init_distributed("cpu")
    tok = _tokenizer(Path(shared_data))
    return evaluate_downstream(_model(tok.vocab_size, seed=1), tok, _lambada_cfg(Path(shared_data)),
                               out_dir, info)


@pytest.mark.dist
@pytest.mark.slow
def test_data_parallel_two_ranks_equal_one(tok, shared_data, tmp_path):
    from tests._dist import run_distributed
    from scape_train.eval.runner import evaluate_downstream

    single = evaluate_downstream(_model(tok.vocab_size, seed=1), tok, _lambada_cfg(shared_data), tmp_path)
    r0, r1 = run_distributed(_dp_rank, 2, (str(shared_data), str(tmp_path / "dp")))
    assert r0 == r1  # every rank gets rank 0's gathered scores
    assert r0["lambada_openai/acc"] == single["lambada_openai/acc"]
    assert r0["lambada_openai/perplexity"] == pytest.approx(single["lambada_openai/perplexity"], rel=1e-6)


def test_unknown_task_fails_before_model_loads(tmp_path):
    from scape_train.eval.__main__ import EvalAppConfig, run

    # A checkpoint path that does not exist: reaching the model load would raise CheckpointError.
    app = EvalAppConfig(checkpoint=str(tmp_path / "missing"), eval=EvalConfig(tasks=["lambada_opneai"]))
    with pytest.raises(TaskConfigError) as err:
        run(app)
    msg = str(err.value)
    assert "lambada_opneai" in msg and "lambada_openai" in msg and "lm_eval --tasks list" in msg


def test_missing_local_file_is_a_config_error(tmp_path):
    cfg = EvalConfig(tasks=["lambada_openai"], local_data={"lambada_openai": str(tmp_path / "nope.jsonl")})
    with pytest.raises(TaskConfigError, match="eval.local_data.lambada_openai"):
        prepare_tasks(cfg)


def test_unreachable_hub_data_fails_fast_naming_task(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    setup = prepare_tasks(EvalConfig(tasks=["piqa"]))
    try:
        start = time.perf_counter()
        with pytest.raises(TaskDataUnavailableError) as err:
            load_tasks(setup)
        assert time.perf_counter() - start < 10
    finally:
        setup.close()
    assert "'piqa'" in str(err.value) and "eval.local_data.piqa=" in str(err.value)


# -- checkpoints -------------------------------------------------------------------------------

def _save_run(tmp_path: Path, tok, model) -> Path:
    import dataclasses

    from scape_train.data.config import DataConfig, TokenizerConfig

    run_dir = tmp_path / "run"
    tok.save_pretrained(run_dir / "tokenizer")
    meta = {"model": dataclasses.asdict(model.cfg),
            "data": dataclasses.asdict(DataConfig(tokenizer=TokenizerConfig(kind="gpt2"))),
            "tokenizer_fingerprint": tok.fingerprint}
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    CheckpointManager(run_dir / "checkpoints", DistInfo()).save(3, state, {"x": 1}, meta)
    return run_dir


def _edit_meta(run_dir: Path, **changes) -> None:
    path = next((run_dir / "checkpoints").glob("step_*")) / "manifest.json"
    manifest = json.loads(path.read_text())
    for key, value in changes.items():
        if key == "model":
            manifest["meta"]["model"].update(value)
        else:
            manifest["meta"][key] = value
    path.write_text(json.dumps(manifest))


def test_standalone_checkpoint_equals_in_memory(tok, shared_data, tmp_path):
    from scape_train.eval.__main__ import EvalAppConfig, run
    from scape_train.eval.runner import evaluate_downstream

    model = _model(tok.vocab_size, seed=2)
    run_dir = _save_run(tmp_path, tok, model)
    cfg = _lambada_cfg(shared_data)
    direct = evaluate_downstream(model, tok, cfg, tmp_path / "direct")
    standalone = run(EvalAppConfig(checkpoint=str(run_dir), device="cpu", eval=cfg))
    assert standalone == direct
    assert (run_dir / "eval" / "results_step00000003.json").is_file()


def test_checkpoint_model_mismatch_is_clear(tok, tmp_path):
    from scape_train.eval.loading import load_checkpoint

    run_dir = _save_run(tmp_path, tok, _model(tok.vocab_size))
    _edit_meta(run_dir, model={"d_model": 96, "ffn_dim": 256})
    with pytest.raises(CheckpointError, match="do not fit the model config.*shape"):
        load_checkpoint(run_dir)


def test_checkpoint_tokenizer_mismatch_is_clear(tok, tmp_path):
    from scape_train.eval.loading import load_checkpoint

    run_dir = _save_run(tmp_path, tok, _model(tok.vocab_size))
    _edit_meta(run_dir, tokenizer_fingerprint="0123456789abcdef")
    with pytest.raises(CheckpointError, match="another tokenizer"):
        load_checkpoint(run_dir)
