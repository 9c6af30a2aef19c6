import torch

from raytrain_lm.config import ModelConfig, preset_config
from raytrain_lm.model import GPT, flops_per_token


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


def test_flops_formula():
    cfg = ModelConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64)
    assert flops_per_token(cfg, 1000, 64) == 6 * 1000 + 12 * 2 * 4 * 16 * 64
