"""The Llama family (Llama 2 and 3.x) and the skeleton the other Llama-like families share (Qwen2,
Qwen3, Mistral: their folders subclass LlamaFamily): what generic code asks of it. Its decoder
is llama.py (one decoder for all of them: q/k/v biases, q/k norms, a sliding window, tied
embeddings and scaled rotary frequencies are its settings), its Hugging Face names and folders
hf_llama.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from raytrain_lm.errors import UserError
from raytrain_lm.models.base import Family, ModelShape, ParamCounts, TPPlan, positive_settings
from raytrain_lm.setting import setting

ROPE_TYPES = ("default", "linear", "llama3")  # of transformers' rope_type, the ones llama.py computes


@dataclass
class LlamaSettings(ModelShape):
    """The Llama skeleton's `model.` settings (llama.py reads them for llama, qwen2, qwen3,
    mistral and moe): RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases but
    Qwen2's q/k/v. Ignored by the GPT (those it cannot compute, it refuses)."""
    n_kv_head: Optional[int] = setting(None, help="llama-like: key/value heads (grouped-query "
                                       "attention; divides n_head) [default: n_head].")
    head_size: Optional[int] = setting(None, help="llama-like: the size of each attention head "
                                       "(Qwen3 0.6B/4B: 128) [default: n_embd / n_head].")
    ffn_dim: Optional[int] = setting(None, help="llama-like: SwiGLU hidden size [default: Llama's "
                                     "rule, 8/3 x n_embd x ffn_multiplier rounded up to multiple_of].")
    ffn_multiplier: Optional[float] = setting(None, help="llama-like: scales the SwiGLU hidden size "
                                              "(Llama 2 70B and Llama 3: 1.3; 405B: 1.2).")
    multiple_of: int = setting(256, help="llama-like: the SwiGLU hidden size is rounded up to a "
                               "multiple of this.")
    rope_theta: float = setting(10000.0, help="llama-like: rotary base (Llama 2: 10000, Llama 3: "
                                "500000, Qwen2.5/3: 1000000).")
    rope_type: str = setting("default", help="llama-like: rotary frequencies as transformers' "
                             "rope_type: default, linear (divided by rope_factor) or llama3 (Llama "
                             "3.1+: the low frequencies divided by rope_factor, a smooth band between).")
    rope_factor: float = setting(1.0, help="llama-like: rope_type linear's and llama3's factor "
                                 "(Llama 3.1: 8, 3.2: 32).")
    rope_low_freq_factor: float = setting(1.0, help="llama-like: llama3's low_freq_factor.")
    rope_high_freq_factor: float = setting(4.0, help="llama-like: llama3's high_freq_factor.")
    rope_original_context: Optional[int] = setting(None, help="llama-like: llama3's "
                                                   "original_max_position_embeddings [default: "
                                                   "block_size].")
    norm_eps: float = setting(1e-5, help="llama-like: RMSNorm epsilon.")
    tie_embeddings: bool = setting(False, help="llama-like: the output head is the token embedding "
                                   "(Llama 3.2 1B/3B, small Qwens; the GPT's always is).")
    qkv_bias: bool = setting(False, help="llama-like: biases on the q, k and v projections (Qwen2).")
    qk_norm: bool = setting(False, help="llama-like: an RMSNorm of each query and key head before "
                            "the rotary embedding (Qwen3).")
    sliding_window: Optional[int] = setting(None, help="llama-like: each token attends to itself and "
                                            "the window-1 tokens before it (Mistral 7B v0.1: 4096) "
                                            "[default: the whole context].")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head


class LlamaFamily(Family):
    name = "llama"
    title = "Llama"
    summary = "RMSNorm, rotary positions, SwiGLU, grouped-query attention; no biases"
    hf_releases = ("Llama",)
    decoder = "raytrain_lm.models.llama.llama:Llama"
    defaults = {"arch": "llama", "bias": False}
    hf_adapter = "raytrain_lm.models.llama.hf_llama"
    hf_model_types = ("llama",)
    export_format = "raytrain-lm/llama"  # llama.py's names, as they are
    # rank r: query heads r*H/tp.., key/value heads r*KV/tp.. (check_layout: KV divisible by tp),
    # with their q/k/v biases; the q/k norms (qk_norm) whole
    tp_plan = TPPlan(colwise=("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj",
                              "mlp.up_proj"),
                     rowwise=("attn.o_proj", "mlp.down_proj"),
                     head_norms=("attn.q_norm", "attn.k_norm"))

    def tied(self, m: LlamaSettings) -> bool:
        return m.tie_embeddings

    def check(self, m: LlamaSettings) -> None:
        if m.bias:
            raise UserError(f"the {self.title} has no biases (Qwen2's q/k/v biases are "
                            f"model.qkv_bias): drop model.bias=true")
        if m.dropout:
            raise UserError(f"the {self.title} has no dropout: drop model.dropout")
        if m.n_kv_head is not None and (m.n_kv_head < 1 or m.n_head % m.n_kv_head):
            raise UserError(f"model.n_kv_head ({m.n_kv_head}) must divide model.n_head ({m.n_head}): "
                            f"each key/value head serves a group of query heads")
        if m.head_size is not None and m.head_size < 1 or m.head_dim % 2:
            raise UserError(f"the head size ({m.head_dim}: model.head_size, else n_embd / n_head) "
                            f"must be even and positive: rotary embeddings turn pairs of dimensions")
        for key in ("ffn_dim", "multiple_of", "sliding_window", "rope_original_context"):
            if getattr(m, key) is not None and getattr(m, key) < 1:
                raise UserError(f"model.{key} must be at least 1, got {getattr(m, key)}")
        positive_settings(m, ("ffn_multiplier", "rope_theta", "norm_eps", "rope_factor",
                              "rope_low_freq_factor", "rope_high_freq_factor"))
        if m.rope_type not in ROPE_TYPES:
            raise UserError(f"model.rope_type {m.rope_type!r} is not computed here: use "
                            f"{', '.join(ROPE_TYPES)}")
        if m.rope_type == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
            raise UserError(f"model.rope_high_freq_factor ({m.rope_high_freq_factor}) must exceed "
                            f"model.rope_low_freq_factor ({m.rope_low_freq_factor})")

    def hidden_dim(self, m: LlamaSettings) -> int:
        """SwiGLU's hidden size: ffn_dim, else Meta's rule (llama/model.py: int(2 * 4 * dim / 3),
        times ffn_multiplier, up to a multiple_of)."""
        if m.ffn_dim is not None:
            return m.ffn_dim
        hidden = int(2 * 4 * m.n_embd / 3)
        if m.ffn_multiplier is not None:
            hidden = int(m.ffn_multiplier * hidden)
        return m.multiple_of * -(-hidden // m.multiple_of)

    def _matrices(self, m: LlamaSettings) -> int:
        """A block's matrices: q, o (h x heads), k, v (h x kv heads), SwiGLU (3 h x hidden)."""
        h, q, kv = m.n_embd, m.n_head * m.head_dim, m.kv_heads * m.head_dim
        return 2 * h * q + 2 * h * kv + 3 * h * self.hidden_dim(m)

    def _split_vectors(self, m: LlamaSettings) -> int:
        """A block's vectors that tensor parallelism splits: the q/k/v biases."""
        return (m.n_head + 2 * m.kv_heads) * m.head_dim if m.qkv_bias else 0

    def _whole_vectors(self, m: LlamaSettings) -> int:
        """A block's vectors every tp rank holds whole: two RMSNorms and the q/k norms."""
        return 2 * m.n_embd + (2 * m.head_dim if m.qk_norm else 0)

    def counts(self, m: LlamaSettings) -> ParamCounts:
        h, V = m.n_embd, m.vocab_size or 256
        block = self._matrices(m) + self._split_vectors(m) + self._whole_vectors(m)
        root = (1 if self.tied(m) else 2) * V * h + h  # embedding, head (unless tied), final norm
        return ParamCounts(block, root, m.n_layer * block + root)

    def lookup_params(self, m: LlamaSettings) -> int:
        """The embedding, unless tied: then it counts once, as the head's matmul (as the GPT's)."""
        return 0 if self.tied(m) else (m.vocab_size or 256) * m.n_embd

    def tp_counts(self, m: LlamaSettings, tp: int) -> dict[str, float]:
        h, V = m.n_embd, m.vocab_size or 256  # every matrix and bias split, the norms whole
        out = {"block": (self._matrices(m) + self._split_vectors(m)) / tp + self._whole_vectors(m),
               "wte": V * h / tp, "wpe": 0, "ln_f": h}
        if not self.tied(m):  # tied: the last stage holds a copy of wte instead
            out["head"] = V * h / tp
        return out

    def block_matmuls(self, m: LlamaSettings) -> list[int]:
        h, q, kv, f = m.n_embd, m.n_head * m.head_dim, m.kv_heads * m.head_dim, self.hidden_dim(m)
        return [h * q, h * kv, h * kv, q * h, h * f, h * f, h * f]

    def activation_split(self, m: LlamaSettings, ac: str) -> tuple[float, float]:
        """Counted as the GPT's (gpt.AC_SPLIT), in units of the width: without recomputation the
        two norm inputs and the inputs of q/k/v and of the MLP stay whole (4); the rotated q and
        k, v, the attention output and SwiGLU's gate, up, silu(gate) and product (4 x hidden)
        divide. Selective keeps the block input and the two row-parallel outputs whole (3) and
        the q/k/v and attention outputs, gate and up divided. Op (every other matmul:
        parallel/ac.py) keeps the block input and the down projection's output whole (2), and
        the q, v, attention and gate outputs divided."""
        q, kv = m.n_head * m.head_dim / m.n_embd, 2 * m.kv_heads * m.head_dim / m.n_embd
        f = self.hidden_dim(m) / m.n_embd
        return {"none": (4, 2 * q + kv + 4 * f), "selective": (3, 2 * q + kv + 2 * f),
                "op": (2, 2 * q + kv / 2 + f)}[ac]

    def fused_mlp_unsaved(self, m: LlamaSettings) -> float:
        return 2 * self.hidden_dim(m) / m.n_embd  # silu(gate) and its product with up

    def kernel_bytes(self, m: LlamaSettings, kernels: str) -> tuple[tuple[float, float], tuple[float, float]]:
        """Fused: two RMSNorms (2h + 3h each), two residual adds (3h + 3h each), rotary over q and
        k (2(q + kv) + 2(q + kv); q = h unless the head size is its own), SwiGLU over the hidden
        f (3f + 5f). Eager (models/llama/llama.py and torchtitan without compile): RMSNorm in fp32
        as six kernels (18h + 36h), rotary through fp32 (10(q + kv) each way), silu and the
        product as two kernels (5f + 8f)."""
        h, f, qk = m.n_embd, self.hidden_dim(m), (m.n_head + m.kv_heads) * m.head_dim
        eager = kernels == "eager"
        norm = (18 * h, 36 * h) if eager else (2 * h, 3 * h)
        whole = (2 * norm[0] + 2 * 3 * h, 2 * norm[1] + 2 * 3 * h)
        rot = (10 * qk, 10 * qk) if eager else (2 * qk, 2 * qk)
        glu = (5 * f, 8 * f) if eager else (3 * f, 5 * f)
        return whole, (rot[0] + glu[0], rot[1] + glu[1])
