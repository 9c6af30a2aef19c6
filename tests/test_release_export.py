"""The export of a model started from a release is the release, continued: on Hub-shaped instruct
folders (tests/hub_releases.py: Llama 3.1 with its eos list and rope_scaling in the 4.x form,
Qwen2.5 with its vocabulary padded past the tokenizer and use_sliding_window false beside a
sliding_window; chat templates, generation defaults) the exported config.json, tokenizer files and
generation config are the release's, field by field, but what the export changed (the weights'
dtype); transformers computes the exported model's logits over every row of the release's
embedding; apply_chat_template works on the export as on the release. Through a real run
(`train --init-from`, then `export`, then `evaluate`): the slow test at the end."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from hub_releases import save_release
from raytrain_lm.data.tokenizer import BPETokenizer
from raytrain_lm.store.release import read_release
from test_families import ours_from

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"

KINDS = ("llama3.1-instruct", "qwen2.5-instruct")
CHAT = [{"role": "user", "content": "What does the assert statement do?"}]
CARRIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def releases(tmp_path_factory, pydoc_docs):
    root = tmp_path_factory.mktemp("releases")
    return {kind: (root / kind, save_release(root / kind, kind, pydoc_docs, seed=i))
            for i, kind in enumerate(KINDS)}


def logits_gap(ours, folder, vocab: int) -> float:
    """Our model's logits against transformers' on the folder, fp32, every position of 48 tokens
    (past Llama 3.1's original context of 16) and every row of the embedding."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    idx = torch.randint(0, vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours_logits = ours(idx, targets=idx)[0]
        theirs_logits = theirs(idx).logits
    assert ours_logits.shape == theirs_logits.shape
    return (ours_logits - theirs_logits).abs().max().item()


def assert_is_the_release(out, folder, dtype: str) -> None:
    """The export's config.json is the release's but its dtype; its tokenizer and generation
    files are the release's, byte for byte; the chat template and the eos list work."""
    from transformers import AutoTokenizer, GenerationConfig

    original = json.loads((folder / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    assert exported == {**original, "torch_dtype": dtype}
    for name in CARRIED:
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    ours, theirs = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(folder)
    assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            == theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    assert (ours.eos_token, ours.bos_token, ours.pad_token) == (theirs.eos_token, theirs.bos_token,
                                                                theirs.pad_token)
    assert GenerationConfig.from_pretrained(out).to_dict() == GenerationConfig.from_pretrained(folder).to_dict()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_an_export_of_a_release_is_the_release_continued(releases, kind, dtype, tmp_path):
    """export of the model read from a release, with the release's files: every carried file as
    it shipped, config.json the release's but for the dtype (bf16: nothing differs), every row
    of the embedding kept (Qwen's 320 past its 303 tokens), transformers' logits ours."""
    from raytrain_lm.results.hf_export import export_hf

    folder, _ = releases[kind]
    ours = ours_from(folder)
    tok = BPETokenizer(folder / "tokenizer.json")
    config = export_hf(ours.state_dict(), ours.cfg, tok, tmp_path / "out", dtype=dtype,
                       release=read_release(folder))
    assert config["vocab_size"] == ours.cfg.vocab_size >= tok.vocab_size
    assert_is_the_release(tmp_path / "out", folder, {"bf16": "bfloat16", "fp32": "float32"}[dtype])
    assert logits_gap(ours, tmp_path / "out", tok.vocab_size) < 1e-5  # bf16 weights, read exactly


def test_a_run_from_random_weights_exports_as_before(releases, tmp_path):
    """No release: the vocabulary is the tokenizer's rows, config.json the adapter's, the
    tokenizer files written here (the export of a run that started from no folder)."""
    from raytrain_lm.results.hf_export import export_hf

    folder, _ = releases["qwen2.5-instruct"]
    ours = ours_from(folder)
    tok = BPETokenizer(folder / "tokenizer.json")
    config = export_hf(ours.state_dict(), ours.cfg, tok, tmp_path / "out", dtype="fp32")
    assert config["vocab_size"] == tok.vocab_size < ours.cfg.vocab_size
    assert "max_window_layers" not in json.loads((tmp_path / "out" / "config.json").read_text())
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["tokenizer_class"] \
        == "PreTrainedTokenizerFast"


def test_a_release_whose_files_are_bad_is_refused_in_one_line(releases, tmp_path):
    """The release files are read as any file of a folder from elsewhere: a symlink or a file
    that is not a JSON object is refused, naming it."""
    from raytrain_lm.errors import UserError

    folder, _ = releases["llama3.1-instruct"]
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="generation_config.json is not a JSON object"):
        read_release(bad)
    (bad / "generation_config.json").unlink()
    (bad / "generation_config.json").symlink_to(folder / "generation_config.json")
    with pytest.raises(UserError, match="generation_config.json, a symlink"):
        read_release(bad)
