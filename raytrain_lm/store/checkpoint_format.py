"""Full training state in a Ray Checkpoint folder, written so a partial write never loads.

Each rank writes into its own local folder and Ray merges them in the run's storage. Layout:
    state.pt          rank 0: step, tokens, data position, scaler, config, tokenizer, metrics
    dcp/              model and optimizer, torch.distributed.checkpoint format, under the
                      single-process model's parameter names whatever the layout (every rank
                      writes its shards, a replicated tensor once): a checkpoint saved at one
                      layout (ddp, fsdp, tp, pp, any worker count) loads at any other, or in one
                      process (generate, export, --init-from)
    rng-rank{R}.pt    every RNG state of rank R
    rank{R}.json      rank R's commit record: sha256 of every file it wrote
    tokenizer.json    rank 0, BPE runs: the dataset's tokenizer file, byte for byte, so generate
                      and export need nothing but the checkpoint (its sha256 is in the spec)
    meta.json         rank 0's commit record, written last: step, world size, format, config

A checkpoint is valid only if meta.json and every rank's record are present and every file
matches its checksum; the loader skips an invalid one for the one before it.
"""

from __future__ import annotations

import io
import pickle
import random
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from raytrain_lm.errors import UserError, brief
from raytrain_lm.store import untrusted
from raytrain_lm.store.commit import VERSION, commit, meta_of, read_meta
from raytrain_lm.store.files import DCP_DIR, STATE, TOKENIZER, rng_file

# A single process (generate, export, the tests) saves and loads without a process group, as meant.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, **kwargs)


def rng_state() -> dict[str, Any]:
    """Every RNG state of this process, as tensors and plain Python data only. On CUDA, the state
    of this worker's own device only (Ray sets it with torch.cuda.set_device): every worker of a
    node sees all the node's GPUs, and the other devices' states are not this worker's to keep
    (nor restorable where a resumed worker sees a different number of GPUs)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def cuda_state_for(saved: Any, device_index: int) -> Optional[torch.Tensor]:
    """The CUDA RNG state to restore on device `device_index` from a saved state: this format's
    one state (the saving worker's device), or, from a checkpoint that saved one state per visible
    GPU (a list), the entry of this device where the list has one, else None (resumed where a
    worker sees more GPUs than the saving one did: that device keeps its fresh seed)."""
    if isinstance(saved, torch.Tensor):
        return saved
    if isinstance(saved, (list, tuple)) and 0 <= device_index < len(saved):
        return saved[device_index]
    return None


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        device = torch.cuda.current_device()
        cuda = cuda_state_for(state["cuda"], device)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def safe_load(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """torch.load of tensors and plain data only (`weights_only`): a file that holds anything
    else (a pickled object can run code when loaded) is refused, not unpickled."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise UserError(f"{path} is corrupted: {str(e).splitlines()[0]}") from None
        raise UserError(f"refusing to load {path}: it holds Python objects, not only tensors and "
                        f"plain data (a raytrain-lm checkpoint never does)") from None
    except (RuntimeError, EOFError) as e:
        raise UserError(f"{path} is corrupted: {str(e).splitlines()[0]}") from None


# ---------------------------------------------------------------- saving


# ---------------------------------------------------------------- reading dcp/ safely
# torch.distributed.checkpoint unpickles its .metadata with plain pickle and the non-tensor
# values (optimizer settings) with torch.load(weights_only=False): a dcp/ folder from elsewhere
# could run code when loaded. The reader and planners below accept only what our checkpoints hold.

# Exactly the globals a dcp .metadata of ours names, each (module, name) pair on its own: allowing a
# whole module would let pickle resolve dotted names through what that module imports
# (torch.distributed.checkpoint.metadata imports os, so "os.system" would resolve there).
_DCP_GLOBALS = frozenset({
    ("pathlib", "PosixPath"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
})


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if "." not in name and ((module, name) in _DCP_GLOBALS or
                                (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Weights only load failed: {module}.{name} is not allowed")


def _read_dcp_metadata(folder: Path):
    """dcp/.metadata through the allow-list; anything else is refused here, before dcp.load,
    which would swallow the error and retry with a rank-local metadata file."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    try:
        with (folder / DCP_DIR / ".metadata").open("rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError:
        raise UserError(f"refusing to load {folder / DCP_DIR}: it holds Python objects, not only "
                        f"tensors and plain data (a raytrain-lm checkpoint never does)") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise UserError(f"{folder / DCP_DIR}/.metadata is corrupted: {e}") from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    _check_storage_data(folder / DCP_DIR, metadata)
    return metadata


def _check_storage_data(dcp_dir: Path, metadata) -> None:
    """Where .metadata says each tensor's bytes are: a file of dcp/ itself (a regular file, no
    path out of the folder) and a byte range inside it, before dcp.load opens anything."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    where = f"{dcp_dir}/.metadata"
    sizes: dict[str, int] = {}
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise UserError(f"{where} is corrupted: no storage data")
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str) or "/" in name:
            raise UserError(f"{where} is corrupted: it names {brief(name)}, not a file of {dcp_dir}")
        if name not in sizes:
            sizes[name] = untrusted.size_of(untrusted.inside(dcp_dir, name, where))
        offset, length = info.offset, info.length
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset
                and 0 <= length and offset + length <= sizes[name]):
            raise UserError(f"{where} is corrupted: a byte range outside {name}")


def _dcp_reader(folder: Path):
    from torch.distributed.checkpoint import FileSystemReader

    metadata = _read_dcp_metadata(folder)

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):  # the checked global metadata, never a rank's
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder / DCP_DIR))


def _safe_planner(empty: bool = False):
    """A load planner whose non-tensor values load with weights_only=True; `empty`: gather
    everything into an empty dict (one process)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    base = _EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner

    class SafePlanner(base):
        def load_bytes(self, read_item, value):
            loaded = torch.load(value, weights_only=True)
            super().load_bytes(read_item, io.BytesIO(_reserialize(loaded)))

    return SafePlanner()


def _reserialize(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _dcp_load(state: dict, folder: Path, empty: bool = False) -> dict:
    """dcp.load through the safe reader and planner; a refused value or a damaged file is a
    UserError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    try:
        if empty:  # as dcp_to_torch_save does: the planner fills the dict it is given
            _load_state_dict(state, storage_reader=_dcp_reader(folder), planner=_safe_planner(True),
                             no_dist=True)
        else:
            dcp.load(state, storage_reader=_dcp_reader(folder), planner=_safe_planner())
    except pickle.UnpicklingError:
        raise UserError(f"refusing to load {folder / DCP_DIR}: it holds Python objects, not only "
                        f"tensors and plain data (a raytrain-lm checkpoint never does)") from None
    except CheckpointException as e:  # a BaseException: nothing else would turn it into one line
        raise UserError(f"{folder / DCP_DIR} is corrupted: {_first_failure(e)}") from None
    return state


def _first_failure(error) -> str:
    """One line for a CheckpointException: the first rank's failure (it holds one per rank)."""
    failures = getattr(error, "failures", None) or {}
    for pair in failures.values():  # (exception, its traceback)
        inner = pair[0] if isinstance(pair, tuple) else pair
        text = str(inner).strip()
        return f"{type(inner).__name__}: {text.splitlines()[0]}" if text else \
            f"{type(inner).__name__} (a file cut short?)"
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _state_dicts(step) -> list[tuple[dict, dict]]:
    """(model, optimizer) state dicts of each of `step`'s parts (worker/step.TrainStep: the model
    as this rank holds it, and its optimizers), keyed by the single-process
    model's names: pipeline stages keep "h.<layer>", TP and FSDP keep module paths."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return [get_state_dict(part, opt, options=_options())
            for part, opt in zip(step.parts, step.optimizers)]


def save_checkpoint(folder: Path, rank: int, step, state: Optional[dict[str, Any]],
                    tokenizer_raw: Optional[bytes] = None, commit: bool = True) -> None:
    """Called on every rank (a collective). Rank 0 passes the training `state` and, for a BPE,
    its tokenizer.json (`Tokenizer.raw`). With `commit`, the commit records are written at once;
    else `commit_checkpoint` writes them later (where a checkpoint is uploaded: in the
    background, with asynchronous uploads)."""
    import torch.distributed.checkpoint as dcp

    folder.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), folder / rng_file(rank))
    model_sd, optim_sd = {}, {}
    for msd, osd in _state_dicts(step):  # parts hold disjoint names but the tied embedding
        model_sd.update(msd)
        optim_sd.update(osd)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / DCP_DIR))
    if rank == 0:
        assert state is not None
        torch.save({**state, "format": "dcp"}, folder / STATE)
        if tokenizer_raw is not None:
            (folder / TOKENIZER).write_bytes(tokenizer_raw)
    if commit:
        commit_checkpoint(folder, rank, state)


def commit_checkpoint(folder: Path, rank: int, state: Optional[dict[str, Any]]) -> list[Path]:
    """This rank's commit record and, on rank 0 (`state`), meta.json (commit.py); returns the
    rank's files in the order to copy them."""
    return commit(folder, rank, meta_of(state) if rank == 0 else None)


def load_state(folder: Path, step, optimizer: bool = True) -> None:
    """Load dcp/ into this rank's parts (and optimizers), whatever layout saved it."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    templates = _state_dicts(step)  # this layout's shards (initialises optimizer state)
    sd: dict[str, dict] = {"model": {}, **({"optim": {}} if optimizer else {})}
    for msd, osd in templates:
        sd["model"].update(msd)
        if optimizer:
            sd["optim"].update(osd)
    _dcp_load(sd, folder)
    for (msd, osd), part, opt in zip(templates, step.parts, step.optimizers):
        model_sd = {k: sd["model"][k] for k in msd}
        if optimizer:
            set_state_dict(part, opt, model_state_dict=model_sd,
                           optim_state_dict={k: sd["optim"][k] for k in osd}, options=_options())
        else:
            set_model_state_dict(part, model_sd, options=_options())


def load_weights(folder: Path, meta: dict[str, Any], step) -> None:
    """The weights of a checkpoint into this rank's parts, for --init-from (fresh optimizer).
    A checkpoint of an earlier format is gathered in each process first."""
    if meta.get("version", 1) >= 3:
        load_state(folder, step, optimizer=False)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    full = load_checkpoint(folder, meta=meta)["model"]
    for part in step.parts:
        set_model_state_dict(part, {k: v for k, v in full.items() if k in part.state_dict()},
                             options=_options(full_state_dict=True))


# ---------------------------------------------------------------- checking and loading


def _full_state_from_dcp(folder: Path) -> dict[str, Any]:
    """Gather a sharded checkpoint into plain tensors in this one process."""
    return _dcp_load({}, folder, empty=True)


def load_checkpoint(folder: Path, map_location: str | torch.device = "cpu",
                    meta: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The whole training state, with `model` as a plain state dict whatever the strategy that
    saved it (so generate/export/--init-from work on FSDP checkpoints in one process). `meta`:
    what read_meta already returned for `folder`, so its checksums are not computed twice."""
    meta = meta or read_meta(folder)
    state = _read_state(folder, meta, map_location)
    if meta.get("format") == "dcp":
        state["model"] = _full_state_from_dcp(folder).get("model")
    model = state.get("model")
    if not isinstance(model, dict) or "wte.weight" not in model:
        raise UserError(f"{folder} is corrupted: it holds no model weights")
    model.setdefault("lm_head.weight", model["wte.weight"])  # tied: one copy may be all there is
    if meta.get("version", 1) < 3:  # GPT-2's [q; k; v] order, from before the GPT interleaved it
        from raytrain_lm.models.gpt.hf_gpt import qkv_gpt2_to_interleaved

        n_head = state["config"]["model"]["n_head"]
        for key in [k for k in model if k.endswith("attn.c_attn.weight") or k.endswith("attn.c_attn.bias")]:
            model[key] = qkv_gpt2_to_interleaved(model[key], n_head)
    return state


def model_tensor_specs(folder: Path, meta: dict[str, Any]) -> Optional[dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """The model's tensors of a checkpoint that read_meta checked (`meta`), by name: (shape,
    dtype) from dcp/'s metadata, no tensor read; None for a checkpoint of an earlier format
    (whose model load_checkpoint reads whole)."""
    if meta.get("version", 1) < 3 or meta.get("format") != "dcp":
        return None
    entries = _read_dcp_metadata(folder).state_dict_metadata.items()
    return {key.removeprefix("model."): (tuple(md.size), md.properties.dtype) for key, md in entries
            if key.startswith("model.") and hasattr(md, "size")}


def read_model_tensor(folder: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """One tensor of the model, whole, from dcp/ (its chunks from every rank that saved one):
    what export reads one at a time."""
    return _dcp_load({"model": {name: torch.empty(shape, dtype=dtype)}}, folder)["model"][name]


def load_resume_state(folder: Path, meta: dict[str, Any],
                      rank: int) -> tuple[dict[str, Any], Optional[dict[str, Any]]]:
    """(state.pt, this rank's RNG states or None if the saving run had no such rank) of a
    checkpoint that read_meta has checked (`meta`: what it returned)."""
    if meta.get("version", 1) < VERSION:
        raise UserError(f"{folder} was written by an older raytrain-lm, whose data position this "
                        f"one cannot continue from; start a new run from its weights with "
                        f"--init-from {folder}")
    state = _read_state(folder, meta)
    rng_path = folder / rng_file(rank)
    return state, safe_load(rng_path) if rng_path.is_file() else None


def _read_state(folder: Path, meta: dict[str, Any], map_location: str | torch.device = "cpu") -> dict:
    """state.pt, which must say what meta.json says (commit.check_meta checked that) of the step,
    the config and the tokenizer: readers take these from state.pt."""
    state = safe_load(folder / STATE, map_location)
    if not isinstance(state, dict):
        raise UserError(f"{folder}/{STATE} is corrupted: not a training state")
    for key in ("step", "config", "tokenizer"):
        if key in meta and state.get(key) != meta[key]:
            raise UserError(f"{folder}/{STATE} is corrupted: its {key} is not meta.json's")
    return state
