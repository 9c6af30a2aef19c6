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
    """The export's config.json is the release's but its dtype, and it carries the release."""
    original = json.loads((folder / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    assert exported == {**original, "torch_dtype": dtype}
    assert_carries_the_release(out, folder)


def assert_carries_the_release(out, folder) -> None:
    """The export's tokenizer and generation files are the release's, byte for byte; the chat
    template and the eos list work."""
    from transformers import AutoTokenizer, GenerationConfig

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


@pytest.fixture(scope="module")
def continued(releases, tmp_path_factory):
    """`train --init-from` the Llama 3.1 Instruct release on a dataset prepared with its
    tokenizer (2 ranks of the local harness, FSDP, 2 steps), resumed for 2 more, as the user
    runs it, then `export --format hf --dtype fp32` of the run (step 4) through the command line."""
    from conftest import cli_here
    from local_mode import run_local
    from raytrain_lm.config.load import build_config
    from raytrain_lm.data.prepare import prepare_dataset
    from raytrain_lm.store.hf_folder import folder_model

    folder, _ = releases["llama3.1-instruct"]
    root = tmp_path_factory.mktemp("continued")
    prepare_dataset("pydoc", root / "data", tokenizer=str(folder / "tokenizer.json"), block_tokens=1024)
    flags = dict(workers=2, strategy="fsdp", max_steps=2, batch_size=2, seq_len=48,
                 checkpoint_every=2, eval_every=2, eval_windows=2, log_every=1,
                 data=str(root / "data"), storage=str(root / "runs"), name="cont", seed=3)
    cfg = build_config(flags=flags, folder=folder_model(folder))
    run_local(cfg, init_from=str(folder), say=lambda m: None)
    # resumed for 2 more steps: the release comes from the checkpoint it resumes from
    run_local(build_config(base=cfg.to_dict(), flags={"max_steps": 4}), resume=True, say=lambda m: None)
    res = cli_here("export", "cont", "--storage", str(root / "runs"), "--format", "hf",
                   "--dtype", "fp32", "--out", str(root / "out"))
    assert res.returncode == 0, res.stderr
    return folder, root


@pytest.mark.slow
def test_a_run_from_a_release_exports_the_release_continued(continued):
    """Through the run and its resume: the checkpoint carries the release's files, the export writes them as
    shipped (config.json's only change: float32), and transformers' logits on the export are
    the trained checkpoint's within 1e-4, the weights trained away from the release's."""
    from raytrain_lm.models import decoder_class
    from raytrain_lm.store.checkpoint_format import load_checkpoint
    from raytrain_lm.store.runs import find_checkpoint

    folder, root = continued
    assert_is_the_release(root / "out", folder, "float32")
    found = find_checkpoint("cont", str(root / "runs"))
    assert found.step == 4  # written after the resume
    state = load_checkpoint(found.path, meta=found.meta)
    assert state["release"] == read_release(folder)
    assert set(state["release"]) == {"config.json", *CARRIED} - {"tokenizer.json"}
    from raytrain_lm.config.settings import TrainConfig

    m = TrainConfig.from_dict(state["config"]).model
    trained = decoder_class(m).from_state_dict(m, state["model"]).eval()
    assert logits_gap(trained, root / "out", m.vocab_size) < 1e-4
    start = ours_from(folder).state_dict()
    assert any(not torch.equal(t, start[name]) for name, t in trained.state_dict().items())
    # the native export of that checkpoint carries the release too: its chat and generation
    # files as shipped, the release's config.json inside its own
    from raytrain_lm.results.export import export_checkpoint

    native = export_checkpoint(found.path, root / "native", source=found.source, meta=found.meta)
    assert_carries_the_release(root / "native", folder)
    assert native["release_config"] == json.loads((folder / "config.json").read_text())


@pytest.mark.slow
def test_evaluate_scores_a_run_from_a_release_and_the_release_itself(continued, tmp_path):
    """`evaluate` on the run started from the release (an export made on the fly, with the
    release's tokenizer settings: lm-eval's prefix is its bos) and on the release's own folder
    (after --init-from's checks of it), each on a local task: exit 0, a score."""
    from conftest import cli_here
    from test_evaluate import write_tasks

    folder, root = continued
    write_tasks(tmp_path / "tasks")
    for model in ("cont", str(folder)):
        res = cli_here("evaluate", model, "--storage", str(root / "runs"), "--tasks", "local_ppl",
                       "--include-path", str(tmp_path / "tasks"), "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["scores"]["local_ppl"]["bits_per_byte"] > 0


@pytest.mark.slow
def test_a_run_from_that_runs_checkpoint_carries_the_release_on(continued):
    """`train --init-from RUN` (the run started from the release): its checkpoints carry the
    release on, read from the checkpoint it started from, so its export is the release too."""
    from local_mode import run_local
    from raytrain_lm.config.load import build_config
    from raytrain_lm.store.checkpoint_format import load_checkpoint
    from raytrain_lm.store.runs import find_checkpoint

    folder, root = continued
    first = load_checkpoint(find_checkpoint("cont", str(root / "runs")).path)
    cfg = build_config(base=first["config"], flags={"name": "cont2", "max_steps": 1,
                                                     "checkpoint_every": 1, "workers": 1})
    run_local(cfg, init_from=str(root / "runs" / "cont"), say=lambda m: None)
    found = find_checkpoint("cont2", str(root / "runs"))
    assert load_checkpoint(found.path, meta=found.meta)["release"] == read_release(folder)
