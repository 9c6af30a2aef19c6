import torch

from raytrain_lm.config.presets import preset_config
from raytrain_lm.models import family, flops_per_token
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.gpt.gpt import GPT


def small_model(**kw):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, **kw))


def test_shapes_and_loss():
    model = small_model()
    x, y = torch.randint(0, 256, (2, 3, 16))
    logits, loss = model(x, y)
    assert logits.shape == (3, 16, 256)
    # An untrained model predicts ~uniformly: loss close to ln(256) = 5.55.
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.3
    logits, loss = model(x)
    assert logits.shape == (3, 1, 256) and loss is None


def test_causal_future_tokens_do_not_change_the_past():
    model = small_model().eval()
    x = torch.randint(0, 256, (1, 20))
    y = x.clone()
    y[0, 12:] = torch.randint(0, 256, (8,))
    lx, _ = model(x, x)
    ly, _ = model(y, y)
    assert torch.allclose(lx[0, :12], ly[0, :12], atol=1e-6)
    assert not torch.allclose(lx[0, 12:], ly[0, 12:])


def test_tied_embeddings_and_gpt2_size():
    model = small_model()
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    cfg = preset_config("gpt2").model
    cfg.vocab_size = 50304  # GPT-2's BPE, padded (the vocabulary comes from the dataset)
    with torch.device("meta"):
        gpt2 = GPT(cfg)
    # GPT-2 small: 124M parameters (with the 50304-padded vocabulary).
    assert 123e6 < gpt2.num_params() < 125.5e6


def test_kv_cache_matches_full_forward():
    model = small_model().eval()
    x = torch.randint(0, 256, (2, 10))
    full, _ = model(x, x)
    cache = model.new_cache()
    model(x[:, :6], cache=cache)
    for t in range(6, 10):
        step_logits, _ = model(x[:, t:t + 1], cache=cache)
        assert torch.allclose(step_logits[:, 0], full[:, t], atol=1e-5)


def test_flops_of_the_tiny_preset():
    """Counted by hand: 4 blocks of 12 x 128^2 matmul weights + 1,280 biases + 512 LayerNorm
    values, the tied 256 x 128 embedding and the final LayerNorm: N = 826,112 (the README's 858,880
    less the 256 x 128 position embeddings). FLOPs per token at 128 tokens: 6N plus attention's
    12 x 4 layers x 4 heads x 32 x 128 = 4,956,672 + 786,432."""
    cfg = preset_config("tiny").model
    cfg.vocab_size = 256
    model = GPT(cfg)
    assert model.num_params() == 858_880
    assert family(cfg).matmul_params(cfg) == model.num_params() - model.wpe.weight.numel() == 826_112
    assert flops_per_token(cfg, 128) == 5_743_104


def test_sampling_never_returns_an_id_the_tokenizer_cannot_decode():
    """The model's vocabulary may be padded beyond the tokenizer's (256 -> 320 here): even when
    the padding ids have the highest logits, sampling and greedy decoding stay below 256."""
    from raytrain_lm.results.generate import sample

    model = GPT(ModelConfig(vocab_size=320, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    with torch.no_grad():
        model.lm_head.weight[256:] = 5.0  # tied to wte: the padding rows dominate every logit
    for temperature, top_k in ((1.0, None), (0.0, None), (0.8, 40)):
        ids = sample(model, [1, 2, 3], 50, temperature=temperature, top_k=top_k, vocab_size=256)
        assert len(ids) == 50 and max(ids) < 256


def test_the_vocabulary_comes_from_the_dataset_padded_to_64():
    from raytrain_lm.run.preflight import fit_model_to_data

    for preset in ("tiny", "gpt2"):
        cfg = preset_config(preset)
        fit_model_to_data(cfg, {"vocab_size": 256})
        assert cfg.model.vocab_size == 256  # no 38M never-trained embedding rows for bytes
    cfg = preset_config("gpt2")
    fit_model_to_data(cfg, {"vocab_size": 50257})  # GPT-2's BPE
    assert cfg.model.vocab_size == 50304


def test_the_mlp_uses_the_configured_gelu():
    """model.gelu: exact (erf) by default, GPT-2's tanh form where asked; they differ."""
    import torch.nn.functional as F

    from raytrain_lm.models.gpt.gpt import MLP

    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    outs = {}
    for gelu in ("exact", "tanh"):
        torch.manual_seed(0)
        mlp = MLP(ModelConfig(n_embd=32, gelu=gelu))
        approximate = "none" if gelu == "exact" else "tanh"
        expected = mlp.c_proj(F.gelu(mlp.c_fc(x), approximate=approximate))
        outs[gelu] = mlp(x)
        assert torch.equal(outs[gelu], expected)
    assert not torch.equal(outs["exact"], outs["tanh"])
