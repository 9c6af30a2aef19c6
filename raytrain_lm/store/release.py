"""What a release ships beside its weights, carried from the Hugging Face folder a run started
from (`train --init-from FOLDER`) to the folder `export --format hf` writes (and, but for
config.json, which goes inside the native format's own, to a native export), so that the export
is the release, continued: its config.json (every field the model does not change: the padded
vocab_size, router_aux_loss_coef, max_window_layers, the eos list, ...), the tokenizer's settings
(tokenizer_config.json: chat_template, added tokens, bos/eos/pad; special_tokens_map.json; a
chat_template.jinja) and generation_config.json (the eos list, the sampling defaults).

Read without trusting the folder (untrusted.py): each file a regular file inside it, no symlink,
at most MAX_RELEASE_BYTES, UTF-8, the JSON ones a JSON object; read by the driver before launch
(a bad file is one line, nothing started) and again by rank 0 of the workers, which keeps the
texts in every checkpoint's training state (store/checkpoint_format.py: state.pt's "release"), so
a resumed run, a run continued from one of its checkpoints and `export` of any checkpoint find
them. No torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from raytrain_lm.errors import UserError
from raytrain_lm.store import untrusted

RELEASE_CONFIG = "config.json"  # the model's: each export format writes a config.json of its own
JSON_FILES = (RELEASE_CONFIG, "generation_config.json", "tokenizer_config.json",
              "special_tokens_map.json")
TEXT_FILES = ("chat_template.jinja",)
RELEASE_FILES = JSON_FILES + TEXT_FILES
# A tokenizer_config.json with its chat template is tens of KB (Llama 3.1 Instruct: ~55 KB).
MAX_RELEASE_BYTES = 4 << 20

Release = dict[str, str]  # file name -> its text, as the release has it


def read_release(folder: str | Path) -> Release:
    """The release files `folder` has (of RELEASE_FILES), each checked as above."""
    folder = Path(folder)
    out: Release = {}
    for name in RELEASE_FILES:
        path = untrusted.inside(folder, name, str(folder))
        if not path.exists():
            continue
        raw = untrusted.read_bytes(path, MAX_RELEASE_BYTES)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"{path} cannot be read: not UTF-8 text") from None
        if name in JSON_FILES:
            parse(text, path)
        out[name] = text
    return out


def parse(text: str, path: str | Path) -> dict:
    """A release file's JSON object (UserError, naming `path`, for anything else)."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise UserError(f"{path} cannot be read: nested too deeply") from None
    except ValueError as e:
        raise UserError(f"{path} cannot be read: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object")
    return data


def check_release(release: object, where: str) -> Optional[Release]:
    """A release as a checkpoint's state holds it: None, or texts of RELEASE_FILES (the JSON ones
    JSON objects); UserError naming `where` otherwise."""
    if release is None:
        return None
    if not isinstance(release, dict) or not all(
            name in RELEASE_FILES and isinstance(text, str) for name, text in release.items()):
        raise UserError(f"{where}: its release files are damaged")
    for name, text in release.items():
        if name in JSON_FILES:
            parse(text, f"{where}: {name}")
    return release


def write_beside(folder: Path, release: Optional[Release]) -> None:
    """Every file of `release` but its config.json into the export `folder`, as it shipped."""
    for name, text in (release or {}).items():
        if name != RELEASE_CONFIG:
            (folder / name).write_text(text, encoding="utf-8")
