"""The Llama family (Llama 2 and 3): what generic code asks of it. Its decoder is llama.py, its
Hugging Face names and folders hf_llama.py."""

from __future__ import annotations

from raytrain_lm.errors import UserError
from raytrain_lm.models.family import Family, ModelConfig, ParamCounts, TPPlan, positive_settings


class LlamaFamily(Family):
    name = "llama"
    decoder = "raytrain_lm.models.llama.llama:Llama"
    # rank r: query heads r*H/tp.., key/value heads r*KV/tp.. (check_layout: KV divisible by tp)
    tp_plan = TPPlan(colwise=("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj",
                              "mlp.up_proj"),
                     rowwise=("attn.o_proj", "mlp.down_proj"))
    defaults = {"arch": "llama", "bias": False}
    hf_adapter = "raytrain_lm.models.llama.hf_llama"
    hf_model_types = ("llama",)
    export_format = "raytrain-lm/llama"  # llama.py's names, as they are

    def check(self, m: ModelConfig) -> None:
        if m.bias:
            raise UserError("the Llama has no biases: drop model.bias=true")
        if m.dropout:
            raise UserError("the Llama has no dropout: drop model.dropout")
        if m.n_kv_head is not None and (m.n_kv_head < 1 or m.n_head % m.n_kv_head):
            raise UserError(f"model.n_kv_head ({m.n_kv_head}) must divide model.n_head ({m.n_head}): "
                            f"each key/value head serves a group of query heads")
        if m.head_dim % 2:
            raise UserError(f"the head size model.n_embd / model.n_head ({m.head_dim}) must be even: "
                            f"rotary embeddings turn pairs of dimensions")
        for key in ("ffn_dim", "multiple_of"):
            if getattr(m, key) is not None and getattr(m, key) < 1:
                raise UserError(f"model.{key} must be at least 1, got {getattr(m, key)}")
        positive_settings(m, ("ffn_multiplier", "rope_theta", "norm_eps"))

    def hidden_dim(self, m: ModelConfig) -> int:
        """SwiGLU's hidden size: ffn_dim, else Meta's rule (llama/model.py: int(2 * 4 * dim / 3),
        times ffn_multiplier, up to a multiple_of)."""
        if m.ffn_dim is not None:
            return m.ffn_dim
        hidden = int(2 * 4 * m.n_embd / 3)
        if m.ffn_multiplier is not None:
            hidden = int(m.ffn_multiplier * hidden)
        return m.multiple_of * -(-hidden // m.multiple_of)

    def _matrices(self, m: ModelConfig) -> int:
        """A block's matrices: q, o (h x h), k, v (h x kv heads), SwiGLU (3 h x hidden)."""
        h = m.n_embd
        return 2 * h * h + 2 * h * m.kv_heads * m.head_dim + 3 * h * self.hidden_dim(m)

    def counts(self, m: ModelConfig) -> ParamCounts:
        h, V = m.n_embd, m.vocab_size or 256
        block = self._matrices(m) + 2 * h  # and two RMSNorms
        root = 2 * V * h + h  # embedding, untied head, final norm
        return ParamCounts(block, root, m.n_layer * block + root)

    def lookup_params(self, m: ModelConfig) -> int:
        return (m.vocab_size or 256) * m.n_embd  # the embedding; its head is its own matrix

    def tp_counts(self, m: ModelConfig, tp: int) -> dict[str, float]:
        h, V = m.n_embd, m.vocab_size or 256  # every matrix split, the RMSNorms whole
        return {"block": self._matrices(m) / tp + 2 * h, "wte": V * h / tp, "wpe": 0, "ln_f": h,
                "head": V * h / tp}

    def block_matmuls(self, m: ModelConfig) -> list[int]:
        h, kv, f = m.n_embd, m.kv_heads * m.head_dim, self.hidden_dim(m)
        return [h * h, h * kv, h * kv, h * h, h * f, h * f, h * f]

    def activation_split(self, m: ModelConfig, ac: str) -> tuple[float, float]:
        """Counted as the GPT's (gpt.AC_SPLIT): without recomputation the two norm inputs and the
        inputs of q/k/v and of the MLP stay whole (4); the rotated q and k, v, the attention
        output and SwiGLU's gate, up, silu(gate) and product (4 x hidden) divide. Selective keeps
        the block input and the two row-parallel outputs whole (3) and the q/k/v and attention
        outputs, gate and up divided. Op (every other matmul: parallel/ac.py) keeps the block
        input and the down projection's output whole (2), and the q, v, attention and gate
        outputs divided."""
        kv, f = 2 * m.kv_heads / m.n_head, self.hidden_dim(m) / m.n_embd
        return {"none": (4, 2 + kv + 4 * f), "selective": (3, 2 + kv + 2 * f),
                "op": (2, 2 + kv / 2 + f)}[ac]

    def fused_mlp_unsaved(self, m: ModelConfig) -> float:
        return 2 * self.hidden_dim(m) / m.n_embd  # silu(gate) and its product with up

    def kernel_bytes(self, m: ModelConfig, kernels: str) -> tuple[tuple[float, float], tuple[float, float]]:
        """Fused: two RMSNorms (2h + 3h each), two residual adds (3h + 3h each), rotary over q and
        k (2(h + kv) + 2(h + kv)), SwiGLU over the hidden f (3f + 5f). Eager (models/llama/llama.py
        and torchtitan without compile): RMSNorm in fp32 as six kernels (18h + 36h), rotary through
        fp32 (10(h + kv) each way), silu and the product as two kernels (5f + 8f)."""
        h, f, qk = m.n_embd, self.hidden_dim(m), m.n_embd + m.kv_heads * m.head_dim
        eager = kernels == "eager"
        norm = (18 * h, 36 * h) if eager else (2 * h, 3 * h)
        whole = (2 * norm[0] + 2 * 3 * h, 2 * norm[1] + 2 * 3 * h)
        rot = (10 * qk, 10 * qk) if eager else (2 * qk, 2 * qk)
        glu = (5 * f, 8 * f) if eager else (3 * f, 5 * f)
        return whole, (rot[0] + glu[0], rot[1] + glu[1])
