"""Our mixture of experts (moe.py) and Hugging Face's MixtralForCausalLM and Qwen3MoeForCausalLM,
both ways: the Llama skeleton's names and config.json (hf_llama.py) for the attention and the
norms (Qwen3-MoE's q/k norms and head size included), and the MoE layer's:

    ours                         Mixtral                                  Qwen3-MoE
    h.{i}.mlp.router.weight      layers.{i}.block_sparse_moe.gate.weight  layers.{i}.mlp.gate.weight
    h.{i}.mlp.experts.gate_proj  ...block_sparse_moe.experts.{j}.w1       ...mlp.experts.{j}.gate_proj
    h.{i}.mlp.experts.up_proj    ...block_sparse_moe.experts.{j}.w3       ...mlp.experts.{j}.up_proj
    h.{i}.mlp.experts.down_proj  ...block_sparse_moe.experts.{j}.w2       ...mlp.experts.{j}.down_proj

Each of our expert tensors (E, out, in) is the folder's E per-expert matrices stacked along dim
0, as the Hub's folders hold them (and as transformers 5 writes them, though its modules fuse
gate and up): `hf_stack` names them, so a loader can read only the experts a rank keeps, and
`to_hf` / `from_hf` stack and unstack them for whole state dicts. Which class a model exports as
follows from its attention: q/k norms are Qwen3-MoE's, none Mixtral's.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from raytrain_lm.errors import UserError
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.models.hf import HFAdapter
from raytrain_lm.models.llama.hf_llama import LlamaAdapter, config_value

EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")  # ours, in the order of each class's names
_EXPERT = re.compile(r"^h\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")


class _MoEFormat(LlamaAdapter):
    """A class of Hugging Face's that holds our mixture of experts: the Llama skeleton's names, and
    its MoE layer's (`moe`: the layer's module name; `experts`: its three per-expert names)."""

    family = "moe"
    moe = ""
    experts: tuple[str, str, str] = ("", "", "")  # for gate_proj, up_proj, down_proj

    def _router(self, i: int) -> str:
        return f"model.layers.{i}.{self.moe}.gate.weight"

    def hf_stack(self, name: str, m: ModelConfig) -> Optional[list[str]]:
        """The folder's tensors that, stacked along dim 0, are our expert tensor `name` (one per
        expert); None for every other tensor."""
        found = _EXPERT.match(name)
        if not found:
            return None
        i, which = found.groups()
        theirs = self.experts[EXPERT_MATRICES.index(which)]
        return [f"model.layers.{i}.{self.moe}.experts.{j}.{theirs}.weight" for j in range(m.n_experts)]

    def hf_name(self, name: str, m: ModelConfig) -> Optional[str]:
        found = re.match(r"^h\.(\d+)\.mlp\.router\.weight$", name)
        if found:
            return self._router(int(found.group(1)))
        if _EXPERT.match(name):
            raise ValueError(f"{name} is {m.n_experts} tensors of the folder: hf_stack")
        return super().hf_name(name, m)

    def our_name(self, hf: str, m: ModelConfig) -> Optional[str]:
        found = re.match(rf"^model\.layers\.(\d+)\.{re.escape(self.moe)}\.gate\.weight$", hf)
        if found:
            return f"h.{found.group(1)}.mlp.router.weight"
        found = re.match(rf"^model\.layers\.(\d+)\.{re.escape(self.moe)}\.experts\.(\d+)\.(\w+)\.weight$", hf)
        if found and found.group(3) in self.experts:
            return f"h.{found.group(1)}.mlp.experts.{EXPERT_MATRICES[self.experts.index(found.group(3))]}"
        return super().our_name(hf, m)

    def hf_shapes(self, m: ModelConfig) -> dict[str, tuple[int, ...]]:
        """The skeleton's tensors but its dense MLP's, the routers and every expert's matrices."""
        h, f, E = m.n_embd, m.hidden_dim, m.n_experts
        out = {k: v for k, v in super().hf_shapes(m).items() if ".mlp." not in k}
        shapes = {"gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
        for i in range(m.n_layer):
            out[self._router(i)] = (E, h)
            for which, shape in shapes.items():
                for hf in self.hf_stack(f"h.{i}.mlp.experts.{which}", m):
                    out[hf] = shape
        return out

    # ------------------------------------------------------------ whole state dicts in memory

    def to_hf(self, state: dict, m: ModelConfig, vocab_size: int) -> dict:
        self.hf_config(m, vocab_size, None)  # refuses, before any tensor, what the class cannot hold
        experts = {k: v for k, v in state.items() if _EXPERT.match(k)}
        out = super().to_hf({k: v for k, v in state.items() if k not in experts}, m, vocab_size)
        for name, t in experts.items():
            for hf, matrix in zip(self.hf_stack(name, m), t.unbind(0)):
                out[hf] = matrix.detach().contiguous()
        return out

    def from_hf(self, weights: dict, m: ModelConfig) -> dict:
        import torch  # torch: stacks the experts' tensors (a model being built)

        experts = {n: self.hf_stack(n, m) for n in (f"h.{i}.mlp.experts.{w}" for i in range(m.n_layer)
                                                     for w in EXPERT_MATRICES)}
        parts = {hf for names in experts.values() for hf in names}
        out = super().from_hf({k: v for k, v in weights.items() if k not in parts}, m)
        for name, names in experts.items():
            missing = [hf for hf in names if hf not in weights]
            if missing:
                raise UserError(f"the folder's weights lack {missing[0]} (the model's {name})")
            out[name] = torch.stack([weights[hf] for hf in names])
        return out

    # ------------------------------------------------------------ config.json

    def hf_config(self, m: ModelConfig, vocab_size: int, eot: Optional[int]) -> dict[str, Any]:
        config = super().hf_config(m, vocab_size, eot)
        for key in ("attention_bias", "mlp_bias"):
            config.pop(key, None)
        return {**config, "num_experts_per_tok": m.top_k, "router_aux_loss_coef": _aux_coef(m),
                "output_router_logits": False, **self._moe_config(m)}

    def _moe_config(self, m: ModelConfig) -> dict[str, Any]:
        raise NotImplementedError

    def _moe_fields(self, c: dict[str, Any], problems: list[str], where: str) -> dict[str, Any]:
        """top_k and the balance loss's weight, which every class names alike (the experts'
        count it does not). transformers' balance loss (load_balancing_loss_func) counts each
        token's k routed slots as k tokens: E x sum_e F_e P_e with sum_e F_e = top_k, top_k when
        balanced; ours (models/moe/moe.py) is the share of slots, 1 when balanced, so the same
        pressure on the router is router_aux_loss_coef x top_k here (divided back on export:
        `_aux_coef`). So a folder trains with its own weight (Mixtral 8x7B ships 0.02,
        Qwen3-30B-A3B 0.001); 0 turns it off."""
        coef = c["router_aux_loss_coef"]
        if coef != 0 or isinstance(coef, bool):
            coef = config_value(c, "router_aux_loss_coef", "number", where)
        top_k = config_value(c, "num_experts_per_tok", "count", where)
        return {"top_k": top_k, "aux_loss_coef": float(coef) * top_k}


def _aux_coef(m: ModelConfig) -> float:
    """config.json's router_aux_loss_coef of our aux_loss_coef (`_moe_fields`)."""
    return m.aux_loss_coef / m.top_k


class MixtralAdapter(_MoEFormat):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    moe = "block_sparse_moe"
    experts = ("w1", "w3", "w2")
    defaults = {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None,
                "num_local_experts": 8, "num_experts_per_tok": 2, "router_jitter_noise": 0.0,
                "router_aux_loss_coef": 0.001}
    aliases = {"num_experts": "num_local_experts"}

    def _own_fields(self, c: dict[str, Any], problems: list[str], where: str) -> dict[str, Any]:
        if c.get("router_jitter_noise") not in (None, 0, 0.0):
            problems.append("router_jitter_noise (the router's inputs are not jittered here)")
        window = c.get("sliding_window")
        return {**self._moe_fields(c, problems, where),
                "n_experts": config_value(c, "num_local_experts", "count", where), "norm_top_k": True,
                "sliding_window": None if window is None else config_value(c, "sliding_window", "count", where)}

    def _moe_config(self, m: ModelConfig) -> dict[str, Any]:
        return {"num_local_experts": m.n_experts, "router_jitter_noise": 0.0,
                "sliding_window": m.sliding_window}

    def _cannot_hold(self, m: ModelConfig) -> list[str]:
        out = [f"model.{k}" for k in ("qkv_bias", "qk_norm", "shared_ffn_dim") if getattr(m, k)]
        return out + ([] if m.norm_top_k else ["model.norm_top_k=false"])


class Qwen3MoeAdapter(_MoEFormat):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    moe = "mlp"
    experts = ("gate_proj", "up_proj", "down_proj")
    defaults = {"num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 32768,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "num_experts": 128,
                "num_experts_per_tok": 8, "norm_topk_prob": False, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "router_aux_loss_coef": 0.001}
    aliases = {"num_local_experts": "num_experts"}  # transformers 5 saves the count so

    def _own_fields(self, c: dict[str, Any], problems: list[str], where: str) -> dict[str, Any]:
        if config_value(c, "attention_bias", "bool", where, False):
            problems.append("attention_bias=true (biases on q/k/v and o)")
        if config_value(c, "use_sliding_window", "bool", where, False):
            problems.append("use_sliding_window=true (Qwen3's window is not built here)")
        if c.get("mlp_only_layers") or config_value(c, "decoder_sparse_step", "count", where) != 1:
            problems.append("dense layers among the MoE ones (mlp_only_layers, decoder_sparse_step)")
        return {**self._moe_fields(c, problems, where), "qk_norm": True,
                "n_experts": config_value(c, "num_experts", "count", where),
                "ffn_dim": config_value(c, "moe_intermediate_size", "count", where),
                "norm_top_k": config_value(c, "norm_topk_prob", "bool", where)}

    def _moe_config(self, m: ModelConfig) -> dict[str, Any]:
        return {"num_experts": m.n_experts, "moe_intermediate_size": m.hidden_dim,
                "norm_topk_prob": m.norm_top_k, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "use_sliding_window": False, "attention_bias": False}

    def _cannot_hold(self, m: ModelConfig) -> list[str]:
        return [f"model.{k}" for k in ("qkv_bias", "sliding_window", "shared_ffn_dim") if getattr(m, k)]


class MoEAdapter(HFAdapter):
    """The family's adapter (models/hf.py's interface): Qwen3-MoE's format for a model with q/k
    norms, Mixtral's otherwise; a folder's own (`model_fields`) by its model_type. Whole tensors
    and slices are the folder's as they are (HFAdapter's defaults)."""

    FORMATS = {a.model_type: a for a in (MixtralAdapter(), Qwen3MoeAdapter())}
    IGNORED_SUFFIXES = LlamaAdapter.IGNORED_SUFFIXES

    def of(self, m: ModelConfig) -> _MoEFormat:
        return self.FORMATS["qwen3_moe" if m.qk_norm else "mixtral"]

    def model_fields(self, config: dict[str, Any], where: str) -> dict[str, Any]:
        return self.FORMATS[config.get("model_type")].model_fields(config, where)

    def hf_name(self, name: str, m: ModelConfig) -> Optional[str]:
        return self.of(m).hf_name(name, m)

    def our_name(self, hf: str, m: ModelConfig) -> Optional[str]:
        return self.of(m).our_name(hf, m)

    def hf_stack(self, name: str, m: ModelConfig) -> Optional[list[str]]:
        return self.of(m).hf_stack(name, m)

    def hf_shapes(self, m: ModelConfig) -> dict[str, tuple[int, ...]]:
        return self.of(m).hf_shapes(m)

    def expected_tensors(self, config: dict[str, Any], m: ModelConfig, where: str):
        return self.of(m).expected_tensors(config, m, where)

    def hf_config(self, m: ModelConfig, vocab_size: int, eot: Optional[int]) -> dict[str, Any]:
        return self.of(m).hf_config(m, vocab_size, eot)

    def to_hf(self, state: dict, m: ModelConfig, vocab_size: int) -> dict:
        return self.of(m).to_hf(state, m, vocab_size)

    def from_hf(self, weights: dict, m: ModelConfig) -> dict:
        return self.of(m).from_hf(weights, m)


ADAPTER = MoEAdapter()
