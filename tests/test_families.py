"""The families on the Llama skeleton (llama with Llama 3.x's scaled rotary frequencies and tied
embeddings, qwen2, qwen3, mistral) against transformers, in one process: the logits of
Hub-shaped folders (config.json as the Hub writes it, bf16 safetensors in shards named by an
index, tied or not) as transformers 5 computes them, the published presets' parameter counts,
--init-from's folder as the model (and what contradicts it), the export that loads back as the
same class, and what is refused. The layouts: test_family_layouts.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import cli_here
from raytrain_lm.config.load import build_config
from raytrain_lm.config.presets import preset_config
from raytrain_lm.data.tokenizer import ByteTokenizer
from raytrain_lm.data.vocab import byte_tokenizer_json
from raytrain_lm.errors import UserError
from raytrain_lm.models import build_model, family, hf_adapter, hf_importer
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.store.hf_folder import folder_model
from test_cli_errors import assert_clean_error

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be fetched from a hub
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_VERBOSITY"] = "error"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"

SMALL = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
         "hidden_act": "silu", "torch_dtype": "bfloat16", "initializer_range": 0.02,
         "use_cache": True, "attention_dropout": 0.0, "transformers_version": "4.45.0"}
# config.json as the Hub's folders spell it, every field they ship, small: Llama 3.2 (rope_scaling
# llama3, tied, Llama 3.1's list of eos ids; an original context of 16 under the sequence of 48),
# an older Llama's linear scaling ("type"),
# Qwen2.5 (tied, sliding_window set but use_sliding_window false, as Qwen's files are), Qwen3
# (a head size of 32 on a width of 64 with 4 heads), Mistral 7B v0.1 (a window of 16 under 48).
HUB = {
    "llama3": {**SMALL, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
               "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
               "bos_token_id": 256, "eos_token_id": [257, 258, 259],
               "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 16, "rope_type": "llama3"}},
    "llama-linear": {**SMALL, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
    "qwen2": {**SMALL, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "rope_theta": 1000000.0, "tie_word_embeddings": True, "use_sliding_window": False,
              "sliding_window": 32768, "max_window_layers": 2, "bos_token_id": 300,
              "eos_token_id": 300, "rms_norm_eps": 1e-6},
    "qwen3": {**SMALL, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32,
              "rope_theta": 1000000.0, "tie_word_embeddings": False, "attention_bias": False,
              "rope_scaling": None, "sliding_window": None, "use_sliding_window": False,
              "max_window_layers": 2, "bos_token_id": 300, "eos_token_id": 300, "rms_norm_eps": 1e-6},
    "mistral": {**SMALL, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "rope_theta": 10000.0, "sliding_window": 16, "bos_token_id": 1, "eos_token_id": 2,
                "rms_norm_eps": 1e-5},
}
SEQ = 48


def perturbed_model(folder, seed: int):
    """transformers' model of `folder`'s config.json, its own random init, then every norm gain
    drawn around one and every bias around zero (a weight read from the wrong place, or not at
    all, shows)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=g)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5, generator=g)
    return model


def save_hub_folder(folder, config: dict, seed: int):
    """A folder as the Hub ships one, made by transformers here (nothing downloaded): its own
    random init, every weight then perturbed (norms around one, biases around zero: a weight
    read from the wrong place, or not at all, shows), saved in bf16 in shards with an index,
    the tied head not stored; config.json as given. Returns the name of the class it loaded."""

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    model = perturbed_model(folder, seed)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="40KB")
    (folder / "config.json").write_text(json.dumps(config))  # the Hub's spelling, not v5's
    (folder / "tokenizer.json").write_text(byte_tokenizer_json())
    return type(model).__name__


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """{case: folder} for HUB's configs."""
    root = tmp_path_factory.mktemp("hub")
    for i, (case, config) in enumerate(HUB.items()):
        assert save_hub_folder(root / case, config, seed=i) == config["architectures"][0]
    return {case: root / case for case in HUB}


def ours_from(folder):
    """Our model of a folder, as --init-from builds and fills it: config.json -> ModelConfig, an
    fp32 model, the weights through the family's adapter into it."""
    from raytrain_lm.worker.hf_load import load_hf_weights

    m = ModelConfig(**folder_model(folder)[1])
    model = build_model(m, seed=0)
    load_hf_weights(folder, [model], m)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model.eval()


@pytest.mark.parametrize("case", HUB)
def test_logits_equal_transformers_on_hub_folders(hub, case):
    """fp32, within 1e-5 at every position of 48 tokens: past Llama 3.2's original context of
    16, past Mistral's window of 16; the folder in bf16 shards with an index, a tied head
    not stored (and kept one parameter)."""
    from transformers import AutoModelForCausalLM

    folder = hub[case]
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    tied = HUB[case].get("tie_word_embeddings", False)
    assert ("lm_head.weight" in index) != tied
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = ours_from(folder)
    assert (ours.lm_head.weight is ours.wte.weight) == tied
    idx = torch.randint(0, 320, (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        diff = (ours(idx, targets=idx)[0] - theirs(idx).logits).abs().max().item()
    assert diff < 1e-5, diff


@pytest.mark.parametrize("case", HUB)
def test_each_adapter_names_every_tensor_both_ways_with_its_shape(hub, case):
    """One tensor at a time, as the loader and the exporter use them: hf_name and our_name are
    inverse (a tied head is the embedding's tensor, and the folder's head is skipped), and
    hf_shapes (arithmetic on the config) is every tensor of the model as the folder names it."""
    m = ModelConfig(**folder_model(hub[case])[1])
    adapter = hf_adapter(m)
    with torch.device("meta"):
        model = build_model(m)
    named = {adapter.hf_name(n, m): (n, tuple(p.shape)) for n, p in model.named_parameters()}
    assert adapter.hf_shapes(m) == {hf: shape for hf, (_, shape) in named.items()}
    assert all(adapter.our_name(hf, m) == n for hf, (n, _) in named.items())
    assert (adapter.hf_name("lm_head.weight", m) == "model.embed_tokens.weight") == m.tie_embeddings


def test_kv_cache_steps_past_the_window_equal_the_full_forward(hub):
    """Sampling's cached steps see only the window too (Mistral's 16 keys of 40)."""
    model = ours_from(hub["mistral"])
    idx = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache()
    with torch.no_grad():
        last = [model(idx[:, :8], cache=cache)[0][0, -1]]
        for t in range(8, 40):
            last.append(model(idx[:, t:t + 1], cache=cache)[0][0, -1])
        full, _ = model(idx, targets=idx)
    assert (torch.stack(last[:-1]) - full[0, 7:39]).abs().max().item() < 1e-5


# The Hub's config.json of each preset's checkpoint (the fields that make its shape) and its
# parameter count, the total of its safetensors.
PUBLISHED = {
    "llama3.2-1b": (1_235_814_400, dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                           "original_max_position_embeddings": 8192, "rope_type": "llama3"})),
    "llama3.2-3b": (3_212_749_824, dict(
        model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                           "original_max_position_embeddings": 8192, "rope_type": "llama3"})),
    "llama3.1-8b": (8_030_261_248, dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=500000.0, rope_scaling={"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                           "original_max_position_embeddings": 8192, "rope_type": "llama3"})),
    "qwen2.5-7b": (7_615_616_512, dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_theta=1000000.0, use_sliding_window=False, sliding_window=131072, max_window_layers=28)),
    "qwen3-8b": (8_190_735_360, dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_theta=1000000.0, attention_bias=False, use_sliding_window=False)),
    "mistral-7b": (7_241_732_096, dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=10000.0, sliding_window=4096)),
}


@pytest.mark.parametrize("mode", ["full", "selective", "op"])
def test_activation_checkpointing_keeps_every_gradient_of_the_families_settings(mode):
    """Recomputed in backward, the q/k norms, the biases, the window's mask and the tied head
    give the gradients of no recomputation, exactly."""
    from raytrain_lm.parallel.ac import apply_activation_checkpointing

    m = ModelConfig(arch="qwen3", bias=False, vocab_size=320, block_size=64, n_layer=2, n_head=4,
                    n_kv_head=2, n_embd=64, head_size=32, multiple_of=32, qkv_bias=True, qk_norm=True,
                    tie_embeddings=True, sliding_window=16, rope_type="llama3", rope_factor=8.0,
                    rope_original_context=16)
    idx = torch.randint(0, 320, (2, SEQ), generator=torch.Generator().manual_seed(6))
    grads = []
    for ac in ("none", mode):
        model = build_model(m, seed=4)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.1, generator=g)
        apply_activation_checkpointing(model, ac)
        model(idx, idx)[1].backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


@pytest.mark.parametrize("preset", PUBLISHED)
def test_presets_are_the_published_checkpoints(preset):
    """Each preset is its checkpoint's config.json (the model --init-from reads from it), and
    has its published parameter count, which transformers' class of that config.json also has
    (built on the meta device), as has the model built here and the planner's count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    published, config = PUBLISHED[preset]
    m = preset_config(preset).model
    fields = hf_importer(config["model_type"], preset).model_fields(config, preset)
    assert all(getattr(m, k) == v for k, v in fields.items()), preset
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
        ours = build_model(m)
    assert family(m).counts(m).total == ours.num_params() == published
    assert sum(p.numel() for p in theirs.parameters()) == published


@pytest.mark.parametrize("case", HUB)
def test_an_export_loads_back_as_the_same_class(hub, case, tmp_path):
    """export --format hf of each family's model: transformers loads it as the folder's own
    class (a tied head tied again, not stored) with the same logits, and --init-from reads it
    back to the same tensors and model settings."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from raytrain_lm.results.hf_export import export_hf

    ours = ours_from(hub[case])
    m = ours.cfg
    export_hf(ours.state_dict(), m, ByteTokenizer(), tmp_path / "out", dtype="fp32")  # 256 rows: bytes
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert type(theirs).__name__ == HUB[case]["architectures"][0]
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) != m.tie_embeddings
    idx = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (ours(idx, targets=idx)[0][..., :256] - theirs(idx).logits).abs().max().item()
    assert diff < 1e-5, diff
    back = ModelConfig(**folder_model(tmp_path / "out")[1])
    assert back == ModelConfig(**{**vars(m), "vocab_size": 256})
    weights = ours_from(tmp_path / "out").state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(weights[name], t[:256] if name in ("wte.weight", "lm_head.weight") else t)


def test_the_folder_is_the_model(hub, tmp_path):
    """train/plan --init-from FOLDER: every model field from config.json, no --preset or --set
    needed; a preset of the same model is chosen by itself; a file, flag or --set that agrees
    passes and one that contradicts is refused, naming both values."""
    folder = folder_model(hub["qwen3"])
    cfg = build_config(folder=folder, flags={"seq_len": 48})
    assert cfg.preset == "tiny" and cfg.model == ModelConfig(**{**vars(ModelConfig()), **folder[1]})
    assert (cfg.model.arch, cfg.model.head_dim, cfg.model.qk_norm, cfg.model.block_size) == ("qwen3", 32, True, 128)
    build_config(folder=folder, flags={"seq_len": 48, "model": {"arch": "qwen3"}}, sets=["model.n_layer=2"])
    where = folder[0]
    for kw, said in [(dict(sets=["model.n_layer=4"]), "--set model.n_layer=4"),
                     (dict(flags={"model": {"arch": "llama"}}), "--arch llama"),
                     (dict(preset="llama-tiny"), "--preset llama-tiny (model.arch=llama)")]:
        with pytest.raises(UserError) as e:
            build_config(folder=folder, **kw)
        key = said.split("model.")[-1].split("=")[0] if "model." in said else "arch"
        want = {"n_layer": 2, "arch": "qwen3"}[key]
        assert str(e.value) == (f"{said} contradicts {where}, whose config.json makes model.{key}="
                                f"{want}: drop it (the folder is the model)")
    (tmp_path / "c.yaml").write_text("model:\n  tie_embeddings: true\n")
    with pytest.raises(UserError, match=r"config file .*c.yaml \(model.tie_embeddings=True\) contradicts"):
        build_config(folder=folder, config_file=str(tmp_path / "c.yaml"))
    fields = hf_importer("llama", "x").model_fields(PUBLISHED["llama3.2-1b"][1], "x")
    assert build_config(folder=("x", fields)).preset == "llama3.2-1b"


def test_train_names_the_family_and_count_and_plan_plans_the_folder(hub, pydoc_data, tmp_path):
    """`train --init-from FOLDER` with no --preset or --set: the launch line names the family,
    the parameter count and the schedule; `plan --init-from FOLDER` plans that model."""
    folder = hub["qwen2"]
    m = ModelConfig(**folder_model(folder)[1])
    n = family(m).counts(m).total
    assert n == sum(p.numel() for p in ours_from(folder).parameters())
    r = cli_here("train", "--init-from", str(folder), "--data", str(pydoc_data), "--storage",
                 str(tmp_path / "runs"), "--seq-len", "48")
    cfg = build_config(folder=folder_model(folder), flags={"seq_len": 48})
    assert (f"--init-from {folder}: a qwen2 of {n:,} parameters; lr {cfg.lr:g} after "
            f"{cfg.warmup_steps} warmup steps, cosine to {cfg.lr * cfg.min_lr_ratio:g}") in r.stdout
    assert_clean_error(r, "no Ray cluster answers")  # cli_here stops the run at the cluster
    r = cli_here("plan", "--init-from", str(folder), "--gpus", "2", "--seq-len", "48")
    assert r.returncode == 0, r.stderr
    assert f"the qwen2 of {folder}: {n:,} parameters" in r.stdout


def test_export_help_names_the_classes_it_writes():
    """`export --help` says --format hf writes the model's own class, not a GPT-2 folder."""
    r = cli_here("export", "--help")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0 and "GPT-2 folder" not in text
    for cls in ("GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                "MistralForCausalLM"):
        assert cls in text.replace("│", "").replace(" ", ""), cls


@pytest.mark.parametrize("change,expected", [
    ({"model_type": "gemma"}, "holds a 'gemma' model; --init-from takes Hugging Face folders of "
                              "model_type llama, qwen2, qwen3, mistral"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' (the rotary embeddings computed here"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     "rope_type 'llama3' without factor"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=true"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true (biases on q/k/v and o)"),
])
def test_what_the_skeleton_does_not_compute_is_refused_in_one_line(change, expected):
    config = {**HUB["llama-linear"], **change}
    with pytest.raises(UserError) as e:
        hf_importer(config["model_type"], "--init-from F").model_fields(config, "--init-from F")
    assert expected in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("arch,setting,expected", [
    ("llama", "qk_norm", "a llama with model.qk_norm has no Hugging Face class (LlamaForCausalLM"),
    ("llama", "sliding_window", "a llama with model.sliding_window has no"),
    ("qwen2", "qk_norm", "a qwen2 with model.qk_norm has no"),
    ("qwen3", "qkv_bias", "a qwen3 with model.qkv_bias, model.qk_norm=false has no"),
    ("mistral", "qkv_bias", "a mistral with model.qkv_bias has no"),
])
def test_an_export_its_class_cannot_hold_is_refused(arch, setting, expected):
    m = ModelConfig(arch=arch, bias=False, vocab_size=256, **{setting: 8 if setting == "sliding_window" else True})
    with pytest.raises(UserError, match=expected.replace("(", r"\(")):
        hf_adapter(m).hf_config(m, 256, None)


def test_a_qwen2_without_biases_writes_every_q_k_v_bias_as_zeros(tmp_path):
    """The exported file itself (no transformers load, which fills a missing tensor with its own
    initial values): every layer's q, k and v biases, at the q and k/v widths, all zero; only
    q/k/v have them."""
    from safetensors import safe_open

    from raytrain_lm.results.hf_export import export_hf

    m = ModelConfig(arch="qwen2", bias=False, qkv_bias=False, vocab_size=256, n_layer=3, n_head=4,
                    n_kv_head=2, n_embd=64, block_size=64)
    export_hf(build_model(m, seed=1).state_dict(), m, ByteTokenizer(), tmp_path / "out", dtype="fp32")
    tensors = {}
    for path in (tmp_path / "out").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if k.endswith(".bias")})
    q, kv = m.n_head * m.head_dim, m.kv_heads * m.head_dim
    assert (q, kv) == (64, 32)
    assert {k: tuple(t.shape) for k, t in tensors.items()} == {
        f"model.layers.{i}.self_attn.{p}_proj.bias": (q if p == "q" else kv,)
        for i in range(3) for p in "qkv"}
    assert not any(t.any() for t in tensors.values())


def test_a_qwen2_without_biases_exports_zero_biases(tmp_path):
    """Qwen2's class always has q/k/v biases: a qwen2 trained without them exports zeros, and
    computes the same."""
    from transformers import AutoModelForCausalLM

    from raytrain_lm.results.hf_export import export_hf

    m = ModelConfig(arch="qwen2", bias=False, qkv_bias=False, vocab_size=256, n_kv_head=2, block_size=64)
    ours = build_model(m, seed=1).eval()
    export_hf(ours.state_dict(), m, ByteTokenizer(), tmp_path / "out", dtype="fp32")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    assert not theirs.model.layers[0].self_attn.q_proj.bias.any()
    idx = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(idx, targets=idx)[0] - theirs(idx).logits).abs().max().item() < 1e-5


def test_a_folder_trains_at_continued_pretraining_defaults(hub, tmp_path):
    """--init-from a folder without lr or schedule settings: a continued pretraining's peak, a
    short warmup (5% of the steps, at most 100), cosine to 10% (presets.CONTINUED), not the
    preset's lr for random weights; each setting a flag, --set or config file gives is kept,
    the others still the continued defaults; a run from random weights keeps its preset's."""
    from raytrain_lm.config.presets import CONTINUED, continued_defaults

    folder = folder_model(hub["llama3"])
    for steps, warmup in ((300, 15), (10_000, 100), (4, 1)):
        cfg = build_config(folder=folder, flags={"seq_len": 48, "max_steps": steps})
        assert continued_defaults(steps) == {**CONTINUED, "warmup_steps": warmup}
        assert {k: getattr(cfg, k) for k in continued_defaults(steps)} == continued_defaults(steps)
    assert CONTINUED["lr"] < preset_config("tiny").lr / 10
    cfg = build_config(folder=folder, flags={"seq_len": 48, "lr": 1e-4}, sets=["warmup_steps=7"])
    assert (cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio) == (1e-4, 7, CONTINUED["min_lr_ratio"])
    (tmp_path / "c.yaml").write_text("schedule: wsd\nmin_lr_ratio: 0.0\n")
    cfg = build_config(folder=folder, flags={"seq_len": 48}, config_file=str(tmp_path / "c.yaml"))
    assert (cfg.schedule, cfg.min_lr_ratio, cfg.lr) == ("wsd", 0.0, CONTINUED["lr"])
    assert build_config(flags={"seq_len": 48}).lr == preset_config("tiny").lr


def test_evaluate_checks_a_folder_as_init_from_does(hub, tmp_path):
    """`evaluate FOLDER` checks the folder with --init-from's checks before lm-eval opens it:
    a config.json that does not describe the weights (another ffn size), or a model the family
    does not compute, is one line and exit code 2."""
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(hub["qwen3"], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    r = cli_here("evaluate", str(bad), "--tasks", "local_ppl")
    assert_clean_error(r, f"evaluate {bad}: model.layers.0.mlp.")
    assert "its config.json says [128, 64]" in r.stderr or "its config.json says [64, 128]" in r.stderr
    (bad / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    assert_clean_error(cli_here("evaluate", str(bad), "--tasks", "local_ppl"),
                       "is a Qwen3ForCausalLM this project cannot compute: hidden_act 'gelu'")
