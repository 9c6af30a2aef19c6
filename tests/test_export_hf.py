"""`export --format hf`: transformers loads the folder offline (GPT2LMHeadModel for the GPT,
LlamaForCausalLM for the Llama), computes what our model computes, and generates what
`generate --temperature 0` generates; the tokenizer is the dataset's file."""

import hashlib
import json
import os

import pytest
import torch

from conftest import cli_here
from raytrain_lm.results.generate import sample
from raytrain_lm.results.hf_export import export_checkpoint_hf, export_hf

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be fetched from a hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"

PROMPTS = ["The \"assert\" statement", "class ", "  for x in range(10):\n"]


def full_logits(model, idx):
    """Our model's logits at every position (without targets it returns only the last)."""
    logits, _ = model(idx, targets=idx)
    return logits


def load_hf(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def exported(trained_here, tmp_path_factory):
    """Each trained model exported through the command line: {kind: folder}."""
    out = {}
    for kind, run in trained_here.items():
        out[kind] = tmp_path_factory.mktemp("hf") / kind
        res = cli_here("export", str(run.ckpt), "--format", "hf", "--dtype", "fp32", "--out", str(out[kind]))
        assert res.returncode == 0, res.stderr
    return out


@pytest.mark.parametrize("kind", ["byte", "bpe", "llama"])
@pytest.mark.slow  # a model trained here (conftest.trained_here) and transformers
def test_exported_logits_equal_ours(trained_here, exported, kind):
    run = trained_here[kind]
    hf, _ = load_hf(exported[kind])
    V = run.tok.vocab_size
    assert hf.config.vocab_size == V  # the padding rows are dropped: every id is a token
    idx = torch.randint(0, V, (3, run.cfg.model.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (full_logits(run.model, idx)[..., :V] - hf(idx).logits).abs().max().item()
    assert diff < 1e-5, diff


@pytest.mark.parametrize("kind", ["byte", "llama"])
@pytest.mark.slow  # a model trained here (conftest.trained_here) and transformers
def test_logits_equal_with_eager_attention_too(trained_here, exported, kind):
    from transformers import AutoModelForCausalLM

    run = trained_here[kind]
    V = run.tok.vocab_size
    hf = AutoModelForCausalLM.from_pretrained(exported[kind], attn_implementation="eager").eval()
    idx = torch.randint(0, V, (2, 128), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (full_logits(run.model, idx)[..., :V] - hf(idx).logits).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", ["byte", "bpe", "llama"])
@pytest.mark.slow  # a model trained here (conftest.trained_here) and transformers
def test_greedy_generate_in_transformers_equals_our_generate(trained_here, exported, kind):
    """transformers' generate() (its own KV cache) gives the tokens `python cli.py generate
    --temperature 0` gives, and every step's logits match ours on the whole sequence. (The
    Llama on one prompt: its tokenizer is the bpe model's.)"""
    run = trained_here[kind]
    hf, hf_tok = load_hf(exported[kind])
    eot = run.tok.eot_id
    for prompt in PROMPTS[:1] if kind == "llama" else PROMPTS:
        res = cli_here("generate", str(run.ckpt), "--prompt", prompt, "--temperature", "0",
                      "--max-new-tokens", "30", "--json", "--device", "cpu")
        assert res.returncode == 0, res.stderr
        ours = json.loads(res.stdout)["token_ids"]
        ids = [int(i) for i in run.tok.encode(prompt)]
        assert hf_tok(prompt)["input_ids"] == ids
        inp = torch.tensor([ids])
        out = hf.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=30,
                          pad_token_id=eot if eot is not None else 0, return_dict_in_generate=True,
                          output_logits=True)
        theirs = out.sequences[0, len(ids):].tolist()
        if len(theirs) < 30:  # generate() stops after <|endoftext|>; ours goes on
            assert theirs[-1] == eot
        assert theirs == ours[:len(theirs)]
        with torch.no_grad():
            ref = full_logits(run.model, torch.tensor([ids + theirs]))[0, len(ids) - 1:-1, :run.tok.vocab_size]
        assert (torch.stack([lg[0] for lg in out.logits]) - ref).abs().max().item() < 1e-5
        assert sample(run.model, ids, 30, temperature=0.0, vocab_size=run.tok.vocab_size) == ours


@pytest.mark.slow  # a model trained here (conftest.trained_here) and transformers
def test_the_tokenizer_file_is_the_same_in_dataset_checkpoint_and_export(trained_here, exported, tmp_path):
    run = trained_here["bpe"]
    res = cli_here("export", str(run.ckpt), "--out", str(tmp_path / "native"))  # native keeps it too
    assert res.returncode == 0, res.stderr
    files = [run.data / "tokenizer.json", run.ckpt / "tokenizer.json", exported["bpe"] / "tokenizer.json",
             tmp_path / "native" / "tokenizer.json"]
    assert {hashlib.sha256(f.read_bytes()).hexdigest() for f in files} == {run.manifest["tokenizer"]["sha256"]}
    # the checkpoint's commit record covers it: a changed copy makes the checkpoint invalid
    assert json.loads((run.ckpt / "rank0.json").read_text())["tokenizer.json"] == run.manifest["tokenizer"]["sha256"]
    # the byte tokenizer ships no file, but its export gets an equivalent tokenizer.json
    assert not (trained_here["byte"].ckpt / "tokenizer.json").exists()
    assert (exported["byte"] / "tokenizer.json").is_file()


@pytest.mark.parametrize("kind", ["byte", "bpe", "llama"])
@pytest.mark.slow  # a model trained here (conftest.trained_here) and transformers
def test_the_hf_tokenizer_is_ours(trained_here, exported, kind, pydoc_docs):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from test_tokenizer import EDGE_CASES, random_texts

    run = trained_here[kind]
    _, hf_tok = load_hf(exported[kind])
    plain = Tokenizer.from_file(str(exported[kind] / "tokenizer.json"))  # `tokenizers` alone
    assert isinstance(hf_tok, PreTrainedTokenizerFast) and len(hf_tok) == run.tok.vocab_size
    for text in EDGE_CASES + random_texts(300, seed=3) + pydoc_docs:
        ids = hf_tok(text)["input_ids"]
        if "<|endoftext|>" not in text or kind == "byte":
            assert ids == run.tok.encode(text).tolist() == plain.encode(text).ids
        # transformers matches "<|endoftext|>" in text to the special token (its convention);
        # ours keeps it text. Both decode back to the text.
        assert hf_tok.decode(ids) == text


@pytest.mark.slow  # a model trained here (conftest.trained_here) and transformers
def test_bias_false_exports_zero_biases_and_conv1d_shapes(trained_here, exported):
    from safetensors.torch import load_file

    run = trained_here["bpe"]
    assert run.model.cfg.bias is False
    weights = load_file(exported["bpe"] / "model.safetensors")
    biases = [k for k in weights if k.endswith(".bias")]
    assert len(biases) == 2 * 6 + 1  # per layer: ln_1, ln_2, c_attn, c_proj, c_fc, mlp.c_proj; ln_f
    assert all(not weights[k].any() for k in biases)
    assert "lm_head.weight" not in weights  # tied: stored once
    assert weights["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # Conv1D: (in, out)
    cfg = json.loads((exported["bpe"] / "config.json").read_text())
    assert cfg["activation_function"] == "gelu_new" and cfg["layer_norm_epsilon"] == 1e-5  # tanh
    byte = json.loads((exported["byte"] / "config.json").read_text())
    assert run.model.cfg.gelu == "tanh" and trained_here["byte"].model.cfg.gelu == "exact"
    assert byte["activation_function"] == "gelu"  # transformers' exact GELU, as the model's
    assert cfg["tie_word_embeddings"] is True and cfg["eos_token_id"] == run.tok.eot_id == 0


@pytest.mark.slow  # a model trained here (conftest.trained_here) and transformers
def test_padded_ids_are_never_generated(trained_here, tmp_path):
    """A model whose padding rows would win every argmax: the export has no such ids."""
    import copy

    from transformers import AutoModelForCausalLM

    run = trained_here["byte"]
    assert run.model.cfg.vocab_size == 256  # bytes need no padding; pad one to 320 to check
    cfg = copy.deepcopy(run.model.cfg)
    cfg.vocab_size = 320
    from raytrain_lm.models.gpt.gpt import GPT

    model = GPT(cfg).eval()
    state = {k: v.clone() for k, v in run.model.state_dict().items()}
    for k in ("wte.weight", "lm_head.weight"):
        state[k] = torch.cat([state[k], torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 5])
    model.load_state_dict(state)
    ids = [int(i) for i in run.tok.encode("class ")]
    assert int(full_logits(model, torch.tensor([ids]))[0, -1].argmax()) >= 256  # the trap works
    export_hf(model.state_dict(), cfg, run.tok, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    inp = torch.tensor([ids])
    out = hf.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=30,
                      pad_token_id=0)
    assert out.max().item() < 256


@pytest.mark.slow  # a model trained here (conftest.trained_here) and transformers
def test_export_refusals(trained_here, exported, tmp_path):
    import copy

    from raytrain_lm.errors import UserError
    from raytrain_lm.models.gpt.gpt import GPT

    run = trained_here["bpe"]
    cfg = copy.deepcopy(run.model.cfg)
    cfg.vocab_size = 512
    with pytest.raises(UserError, match="512 token embeddings"):
        export_hf(GPT(cfg).state_dict(), cfg, run.tok, tmp_path / "small")
    res = cli_here("export", str(run.ckpt), "--format", "hf", "--out", str(exported["bpe"]))
    assert res.returncode == 2 and "--force" in res.stderr
    res = cli_here("export", str(run.ckpt), "--format", "onnx", "--out", str(tmp_path / "x"))
    assert res.returncode == 2 and "--format must be one of native, hf" in res.stderr
    assert not (tmp_path / "x").exists()
    (exported["bpe"] / "config.json").write_text("{}")  # what --force must replace
    export_checkpoint_hf(run.ckpt, exported["bpe"], force=True)
    export_checkpoint_hf(run.ckpt, tmp_path / "fresh")
    assert (exported["bpe"] / "config.json").read_text() == (tmp_path / "fresh" / "config.json").read_text()


def test_c_attn_reaches_gpt2_in_its_qkv_order(tmp_path):
    """Our c_attn rows are head-interleaved (models/gpt/gpt.py, for tensor parallelism); GPT-2's are
    [q; k; v]. Same shapes, so a missing or wrong-way permutation loads silently in transformers:
    only the logits tell. An untrained model with random biases (every row distinct), 4 heads
    (with 1 head the layouts coincide; with 3 the permutation is its own inverse)."""
    from transformers import GPT2LMHeadModel

    from raytrain_lm.data.tokenizer import ByteTokenizer
    from raytrain_lm.models.family import ModelConfig
    from raytrain_lm.models.gpt.gpt import GPT
    from raytrain_lm.models.gpt.hf_gpt import qkv_gpt2_to_interleaved, qkv_interleaved_to_gpt2

    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=256, bias=True,
                      dropout=0.0)
    model = GPT(cfg, seed=3).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    rows = torch.arange(3 * 32)
    assert torch.equal(qkv_interleaved_to_gpt2(qkv_gpt2_to_interleaved(rows, 4), 4), rows)  # inverse
    export_hf(model.state_dict(), cfg, ByteTokenizer(), tmp_path / "hf", dtype="fp32")
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (full_logits(model, idx) - hf(idx).logits).abs().max().item() < 1e-5


@pytest.mark.slow  # a model trained here (conftest.trained_here) and transformers
def test_a_sharded_bf16_export_is_what_transformers_loads(trained_here, tmp_path):
    """The default dtype (bf16, as the Hub's) in shards of at most --max-shard-size, named by
    model.safetensors.index.json, written a tensor at a time: transformers loads it
    (AutoModelForCausalLM, AutoTokenizer) and computes our model's logits with its weights
    rounded to bf16; --force replaces a sharded export."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from raytrain_lm.models import build_model

    run = trained_here["llama"]
    out = tmp_path / "hf"
    res = cli_here("export", str(run.ckpt), "--format", "hf", "--max-shard-size", "100KB", "--out", str(out))
    assert res.returncode == 0, res.stderr
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == set(shards)
    assert not (out / "model.safetensors").exists()
    sizes = {}
    for name in shards:
        with safe_open(out / name, "pt") as f:
            assert f.metadata()["source"] == "raytrain-lm/gpt-2"
            sizes[name] = sum(f.get_tensor(k).nbytes for k in f.keys())
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
            assert all(index["weight_map"][k] == name for k in f.keys())
    # each shard closes before the tensor that would take it past 100 kB (one larger is alone)
    largest = max(t.numel() * 2 for t in run.model.state_dict().values())
    assert all(size <= max(100_000, largest) for size in sizes.values())
    assert index["metadata"]["total_size"] == sum(sizes.values())
    V = run.tok.vocab_size
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    rounded = build_model(run.cfg.model)
    rounded.load_state_dict({k: v.bfloat16().float() for k, v in run.model.state_dict().items()})
    idx = torch.randint(0, V, (2, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (full_logits(rounded.eval(), idx)[..., :V] - hf(idx).logits).abs().max().item() < 1e-5
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == tok.bos_token == "<|endoftext|>" == run.tok.token_bytes(run.tok.eot_id).decode()
    res = cli_here("export", str(run.ckpt), "--format", "hf", "--dtype", "fp32", "--out", str(out), "--force")
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.slow  # a model trained here (conftest.trained_here) and transformers
def test_export_reads_the_checkpoint_one_tensor_at_a_time(trained_here, tmp_path, monkeypatch):
    """Each of the model's tensors is read from dcp/ alone, once (a tied one once), and is the
    checkpoint's: what keeps export's memory to a few tensors whatever the model's size (the
    figure: bench/hf_load.py)."""
    from raytrain_lm.store import checkpoint_format

    run = trained_here["bpe"]
    reads = []
    real = checkpoint_format.read_model_tensor

    def counting(folder, name, shape, dtype):
        reads.append(name)
        return real(folder, name, shape, dtype)

    monkeypatch.setattr(checkpoint_format, "read_model_tensor", counting)
    export_checkpoint_hf(run.ckpt, tmp_path / "hf", dtype="fp32")
    assert sorted(reads) == sorted(n for n, _ in run.model.named_parameters())  # wte once: tied


def test_bos_and_eos_come_from_the_tokenizer_file():
    """<|endoftext|> is both (GPT-2, Qwen); a Llama 3-style file (a post-processor that puts
    <|begin_of_text|> first, <|end_of_text|> as its end) gives each its own; the byte tokenizer
    has none."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    from raytrain_lm.data.tokenizer import BPETokenizer, ByteTokenizer
    from raytrain_lm.data.vocab import bytes_to_unicode
    from raytrain_lm.results.hf_export import special_tokens

    def file(specials, post_processor):
        tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(bytes_to_unicode().values())},
                                     merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(specials)
        tok.post_processor = post_processor
        return BPETokenizer("tokenizer.json", raw=tok.to_str().encode())

    llama3 = file(["<|begin_of_text|>", "<|end_of_text|>"], processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 256)]))
    assert special_tokens(llama3) == (256, 257)
    assert special_tokens(file(["<|endoftext|>", "<|im_end|>"], processors.ByteLevel())) == (256, 256)
    assert special_tokens(ByteTokenizer()) == (None, None)
