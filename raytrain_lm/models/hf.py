"""A model family's Hugging Face format, one tensor at a time (torch-free: a transform uses the
tensor's own methods). Each family with a format has an `HFAdapter` in its folder
(models/<family>/hf_<family>.py, `Family.hf_adapter` names it); the loader and the exporter
(worker/, results/) call only this interface, so they can stream a folder of any size shard by
shard, and each rank can read only the slices it keeps:

  names       `hf_name(ours, m)`: the folder's tensor that holds our tensor's values (a tied
              head: the embedding's; None where the format keeps no such tensor);
              `our_name(hf, m)`: the tensor of ours a folder's tensor fills (None: skipped, as
              an old export's rotary buffer; a UserError for a tensor the family has no place for).
  values      `to_hf_tensor` / `from_hf_tensor`: a whole tensor from one layout to the other
              (the identity for every Llama-skeleton family); `sliceable(ours, m)`: whether rows
              and columns [a:b] of ours are [a:b] of theirs, so a rank may read only its slice.
              Our vocabulary rows (`VOCAB_ROWS`) may outnumber the folder's: an export keeps the
              tokenizer's rows, an import needs the model's vocabulary to be the folder's.
  zeros       `hf_zeros(m)`: tensors the format has and the model does not (GPT-2's biases of a
              bias-free GPT), written as zeros of these shapes.
  stacks      `hf_stack(ours, m)`: the folder's tensors that, stacked along dim 0, are our
              tensor (a mixture of experts' per-expert matrices: models/moe/hf_moe.py); None
              for a tensor that is one of the folder's (hf_name).
  config.json `model_fields(config, where)`: the ModelConfig fields a folder fixes (every shape
              field), after refusing in one line what the decoder does not compute;
              `hf_config(m, vocab_size, eot)`: the config.json an export writes.

`to_hf` and `from_hf` apply these to a whole state dict held in memory.
"""

from __future__ import annotations

from typing import Any, Optional

from raytrain_lm.errors import UserError
from raytrain_lm.models.family import ModelConfig

# Our tensors whose rows are the vocabulary (every decoder of models/decoder.py)
VOCAB_ROWS = ("wte.weight", "lm_head.weight")


class HFAdapter:
    model_type: str  # config.json's model_type: what the family imports and exports
    architecture: str  # config.json's architectures[0]: the transformers class that loads it

    def hf_name(self, name: str, m: ModelConfig) -> Optional[str]:
        raise NotImplementedError

    def our_name(self, hf: str, m: ModelConfig) -> Optional[str]:
        raise UserError(f"Hugging Face folders of model_type {self.model_type!r} are not imported here")

    def to_hf_tensor(self, name: str, t, m: ModelConfig):
        """Our tensor `name` as the folder holds it (the whole tensor)."""
        return t

    def from_hf_tensor(self, name: str, t, m: ModelConfig):
        """The folder's tensor, filling our tensor `name`, as we hold it (the whole tensor)."""
        return t

    def sliceable(self, name: str, m: ModelConfig) -> bool:
        """Whether a slice of our tensor `name` is the same slice of the folder's tensor."""
        return True

    def hf_zeros(self, m: ModelConfig) -> dict[str, tuple[int, ...]]:
        return {}

    def hf_stack(self, name: str, m: ModelConfig) -> Optional[list[str]]:
        return None

    def hf_config(self, m: ModelConfig, vocab_size: int, eot: Optional[int]) -> dict[str, Any]:
        raise NotImplementedError

    def model_fields(self, config: dict[str, Any], where: str) -> dict[str, Any]:
        raise UserError(f"{where}: Hugging Face folders of model_type {self.model_type!r} are not "
                        f"imported here")

    # ------------------------------------------------------------ whole state dicts in memory

    def to_hf(self, state: dict, m: ModelConfig, vocab_size: int) -> dict:
        """Our state dict under the folder's names, each tensor once (a tied pair is one), the
        vocabulary cut to the tokenizer's `vocab_size` rows."""
        out: dict = {}
        for name, t in state.items():
            hf = self.hf_name(name, m)
            if hf is None or hf in out:
                continue
            t = t[:vocab_size] if name in VOCAB_ROWS else t
            out[hf] = self.to_hf_tensor(name, t, m).detach().contiguous()
        for hf, shape in self.hf_zeros(m).items():
            out[hf] = next(iter(state.values())).new_zeros(shape)
        return out

    def from_hf(self, weights: dict, m: ModelConfig) -> dict:
        """A folder's tensors under our names (each of ours once: a tied head is the
        embedding, which the model shares)."""
        out = {}
        for hf, t in weights.items():
            ours = self.our_name(hf, m)
            if ours is not None:
                out[ours] = self.from_hf_tensor(ours, t, m)
        for name in VOCAB_ROWS:  # a tied head: the embedding's tensor, under its own name too
            hf = self.hf_name(name, m)
            if name not in out and hf in weights:
                out[name] = self.from_hf_tensor(name, weights[hf], m)
        return out
