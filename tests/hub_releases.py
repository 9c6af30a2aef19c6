"""Hub-shaped release folders, small, as their producers make them: an instruct Llama 3.1 and an
instruct Qwen2.5, each with config.json spelled field for field as the release ships it
(torch_dtype, rope_scaling in its 4.x form, Llama 3.1's list of eos ids, Qwen's vocabulary padded
past its tokenizer, use_sliding_window false beside a sliding_window, max_window_layers,
initializer_range, use_cache, transformers_version), weights by transformers' own class in bf16
shards with an index, the family's tokenizer.json written by transformers
(PreTrainedTokenizerFast.save_pretrained of a byte-level BPE trained here with the family's
special tokens and post-processor), tokenizer_config.json as the release has it (added tokens,
bos/eos/pad, its chat_template, tokenizer_class) and generation_config.json (the eos list, the
sampling defaults).

Qwen's own tokenizer.json has an NFC normalizer (transformers' Qwen2 converter sets it); the one
here has none, so that `prepare --tokenizer` takes it whatever that command accepts: this module
is about what the export carries, not about tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eom_id|>", "<|eot_id|>"]
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + "
                   "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
                   "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
QWEN_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
                 "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
BPE_TOKENS = 300  # the trained BPE's tokens, before the family's special ones
SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
         "initializer_range": 0.02, "use_cache": True, "attention_dropout": 0.0,
         "torch_dtype": "bfloat16", "transformers_version": "4.43.1"}


def _tokenizer(texts: list[str], specials: list[str], bos: str | None):
    """A byte-level BPE of BPE_TOKENS tokens trained on `texts`, then `specials` as added special
    tokens (ids after it), with the post-processor of its family: Llama 3's puts `bos` before a
    text (ByteLevel, then TemplateProcessing), Qwen's adds nothing (ByteLevel)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(specials)
    level = processors.ByteLevel(trim_offsets=False)
    if bos is None:
        tok.post_processor = level
    else:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.Sequence([level, processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])])
    return tok


def _added_tokens(tok) -> dict:
    """tokenizer_config.json's added_tokens_decoder, as transformers writes it."""
    return {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in sorted(tok.get_added_tokens_decoder().items())}


def release(kind: str, texts: list[str]) -> dict:
    """{file name: content} of a release of `kind` ("llama3.1-instruct", "qwen2.5-instruct"),
    but its weights; content is a JSON object or, for tokenizer.json, the tokenizer."""
    if kind == "llama3.1-instruct":
        tok = _tokenizer(texts, LLAMA3_SPECIALS, "<|begin_of_text|>")
        ids = {s: tok.token_to_id(s) for s in LLAMA3_SPECIALS}
        eos = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
        config = {"architectures": ["LlamaForCausalLM"], "attention_bias": False,
                  "bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": eos, **SMALL,
                  "max_position_embeddings": 128, "mlp_bias": False, "model_type": "llama",
                  "pretraining_tp": 1, "rms_norm_eps": 1e-05,
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16, "rope_type": "llama3"},
                  "rope_theta": 500000.0, "tie_word_embeddings": False,
                  "vocab_size": tok.get_vocab_size()}
        generation = {"bos_token_id": ids["<|begin_of_text|>"], "do_sample": True,
                      "eos_token_id": eos, "temperature": 0.6, "top_p": 0.9,
                      "transformers_version": "4.42.3"}
        tok_config = {"added_tokens_decoder": _added_tokens(tok), "bos_token": "<|begin_of_text|>",
                      "chat_template": LLAMA3_TEMPLATE, "clean_up_tokenization_spaces": True,
                      "eos_token": "<|eot_id|>",
                      "model_input_names": ["input_ids", "attention_mask"],
                      "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
    elif kind == "qwen2.5-instruct":
        tok = _tokenizer(texts, QWEN_SPECIALS, None)
        ids = {s: tok.token_to_id(s) for s in QWEN_SPECIALS}
        config = {"architectures": ["Qwen2ForCausalLM"], "bos_token_id": ids["<|endoftext|>"],
                  "eos_token_id": ids["<|im_end|>"], **SMALL, "max_position_embeddings": 128,
                  "max_window_layers": 2, "model_type": "qwen2", "rms_norm_eps": 1e-06,
                  "rope_theta": 1000000.0, "sliding_window": 128, "tie_word_embeddings": False,
                  "use_sliding_window": False,
                  "vocab_size": 320}  # padded past the tokenizer, as Qwen2.5-7B: 152064 rows, 151665 tokens
        generation = {"bos_token_id": ids["<|endoftext|>"], "pad_token_id": ids["<|endoftext|>"],
                      "do_sample": True, "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                      "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                      "transformers_version": "4.37.0"}
        tok_config = {"add_bos_token": False, "add_prefix_space": False,
                      "added_tokens_decoder": _added_tokens(tok),
                      "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                      "bos_token": None, "chat_template": QWEN_TEMPLATE,
                      "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
                      "errors": "replace", "model_max_length": 131072, "pad_token": "<|endoftext|>",
                      "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
                      "unk_token": None}
    else:
        raise KeyError(kind)
    return {"config.json": config, "generation_config.json": generation,
            "tokenizer_config.json": tok_config, "tokenizer.json": tok}


def save_release(folder: Path, kind: str, texts: list[str], seed: int = 0) -> dict:
    """The release folder of `kind`: its weights made by transformers' class from config.json
    (its own init, then every weight perturbed so that one read from the wrong place shows), in
    bf16 shards with an index; its tokenizer.json as PreTrainedTokenizerFast saves it; the other
    files as the release spells them. Returns `release(kind)`."""
    from transformers import PreTrainedTokenizerFast

    from test_families import perturbed_model

    files = release(kind, texts)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(files["config.json"], indent=2))
    model = perturbed_model(folder, seed)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="100KB")
    PreTrainedTokenizerFast(tokenizer_object=files["tokenizer.json"]).save_pretrained(folder)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        (folder / name).write_text(json.dumps(files[name], indent=2) + "\n")  # the Hub's spelling
    for extra in ("special_tokens_map.json", "chat_template.jinja"):  # not shipped by these
        (folder / extra).unlink(missing_ok=True)
    return files
