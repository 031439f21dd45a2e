import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from scape_train.eval.loading import load_checkpoint
from scape_train.export import main as export_main
from scape_train.train import run
from tests.test_train import job, tok_cache  # noqa: F401  (fixture)


def test_export_checkpoint_to_transformers(tmp_path, tok_cache):  # noqa: F811
    run(job(tmp_path / "run", tok_cache, "trainer.max_steps=2"))
    assert export_main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    ours, tokenizer, _, _ = load_checkpoint(tmp_path / "run")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "And God said, Let there be light: and there was light."
    ids = torch.tensor([tokenizer.encode(text)])
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=1e-5, rtol=1e-5)


def test_export_reports_missing_checkpoint(tmp_path, capsys):
    assert export_main([str(tmp_path / "nothing"), str(tmp_path / "hf")]) == 1
    assert "no valid checkpoint" in capsys.readouterr().err
