"""Everything `train` checks before a worker starts, so a bad input costs a second and writes
nothing: the dataset (the built-in corpus is prepared on first use), the model against the data,
--init-from, the cluster's resources and the memory plan."""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Callable, Optional

from raytrain_lm.cluster.autoscale import wait_for_resources
from raytrain_lm.config.checks import check_layout
from raytrain_lm.config.layout import Layout
from raytrain_lm.config.settings import DEFAULT_DATA, TrainConfig
from raytrain_lm.config.sizes import is_elastic, worker_counts, workers_text
from raytrain_lm.errors import UserError
from raytrain_lm.models import describe, hf_importer
from raytrain_lm.models.family import ModelConfig
from raytrain_lm.plan.auto import cluster_kind
from raytrain_lm.plan.gpus import label_memory_gb
from raytrain_lm.store import untrusted
from raytrain_lm.store.files import TOKENIZER
from raytrain_lm.store.hf_folder import check_tensors, differing_fields, is_hf_folder, read_config
from raytrain_lm.store.release import read_release


def ensure_dataset(cfg: TrainConfig, say: Callable[[str], None]) -> dict:
    """The dataset's manifest; the built-in default corpus is prepared on first use."""
    from raytrain_lm.data.manifest import load_manifest
    from raytrain_lm.data.prepare import prepare_dataset

    if cfg.data == DEFAULT_DATA and not os.path.exists(cfg.data):
        say(f"preparing the built-in corpus (pydoc topics) into {cfg.data} ...")
        prepare_dataset("pydoc", cfg.data)
    return load_manifest(cfg.data)


VOCAB_MULTIPLE = 64  # embedding and output matmuls run faster on multiples of 64


def padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def fit_model_to_data(cfg: TrainConfig, manifest: dict) -> None:
    """The model's vocabulary is the dataset tokenizer's, padded up to a multiple of 64 (the
    padding ids never occur in the data and are never sampled)."""
    vocab = manifest["vocab_size"]
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = padded_vocab(vocab)
    check_layout(cfg)  # now with the vocabulary: the embedding is split over it
    if cfg.doc_mask and manifest.get("separator") != "eot":
        raise UserError(f"--doc-mask needs a dataset whose documents are separated by one token "
                        f"(<|endoftext|>), but {cfg.data} separates them by \"\\n\\n\" (a byte "
                        f"tokenizer's, also found inside documents); prepare it with a BPE")
    if vocab > cfg.model.vocab_size:
        raise UserError(f"dataset {cfg.data} has a vocabulary of {vocab} tokens but the model's "
                        f"vocab_size is {cfg.model.vocab_size}; raise model.vocab_size")


def prepare_data(cfg: TrainConfig, say: Callable[[str], None]) -> dict:
    """The dataset's manifest, with the model's vocabulary fitted to it and a local data path made
    absolute (workers do not share the driver's working directory)."""
    manifest = ensure_dataset(cfg, say)
    fit_model_to_data(cfg, manifest)
    if "://" not in cfg.data:
        cfg.data = os.path.abspath(cfg.data)
    return manifest


def default_run_name(cfg: TrainConfig) -> str:
    return f"{cfg.preset}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def check_resources(cfg: TrainConfig, say: Callable[[str], None] = print) -> None:
    """The cluster holds the run's workers (an elastic run's smallest size), or an autoscaler
    brings them up within --scale-timeout."""
    import ray

    workers = worker_counts(cfg)[0]  # an elastic run starts as soon as its smallest size fits
    flag, least = f"--workers {workers_text(cfg)}", "at least " if is_elastic(cfg) else ""
    per_worker = {"CPU": cfg.worker_cpus, **({"GPU": 1} if cfg.use_gpu else {})}
    total = ray.cluster_resources()
    if any(total.get(k, 0) < v * workers for k, v in per_worker.items()) and \
            wait_for_resources(per_worker, workers, cfg.scale_timeout, say):
        _check_tp_nodes(cfg)
        return  # an autoscaler brought the nodes up
    _check_tp_nodes(cfg)
    if cfg.use_gpu and total.get("GPU", 0) < workers:
        have = int(total.get("GPU", 0))
        raise UserError(f"--use-gpu with {flag} needs {least}{workers} GPUs but the "
                        f"cluster has {have}; drop --use-gpu or lower --workers")
    need = workers * cfg.worker_cpus
    if total.get("CPU", 0) < need:
        raise UserError(f"{flag} needs {least}{need:g} CPUs but the cluster has "
                        f"{total.get('CPU', 0):g}; lower --workers or cpus_per_worker")


def _check_tp_nodes(cfg: TrainConfig) -> None:
    """A GPU run's --tp fits on one of the cluster's nodes (each worker checks its own node
    again: Layout.check_tp_within_node)."""
    import ray

    if cfg.use_gpu and cfg.tp > 1:
        Layout.of(cfg).check_tp_fits_nodes([n["Resources"].get("GPU", 0) for n in ray.nodes()
                                            if n["Alive"]])


def worker_memory_gb(cfg: TrainConfig) -> Optional[float]:
    """Memory one worker may use: its GPU's (from --set gpu_memory_gb or Ray's accelerator
    label, when the label determines it), or on CPU the cluster's memory resource split among
    the workers. None: unknown (a GPU worker then checks its device's own memory)."""
    import ray

    if cfg.use_gpu:
        if cfg.gpu_memory_gb:
            return cfg.gpu_memory_gb
        labels = [k.split(":", 1)[1] for k in ray.cluster_resources() if k.startswith("accelerator_type:")]
        sizes = [size for size in map(label_memory_gb, labels) if size]
        return min(sizes) if sizes else None
    return ray.cluster_resources().get("memory", 0) / 2 ** 30 / cfg.workers or None


def workers_kind(cfg: TrainConfig, memory_gb: Optional[float]) -> Optional[str]:
    """The GPU kind Ray's live nodes' accelerator label names (plan/gpus.py), for the memory
    check; None for CPU workers, no label, several, or one the table does not know."""
    import ray

    return cluster_kind(ray.nodes(), memory_gb) if cfg.use_gpu else None


def configured_memory_gb(cfg: TrainConfig) -> Optional[float]:
    """Memory per GPU known from the config alone (--set gpu_memory_gb=...), so the memory check
    can run before Ray starts."""
    return cfg.gpu_memory_gb if cfg.use_gpu and cfg.gpu_memory_gb else None


def resume_step(cfg: TrainConfig, run, manifest: dict) -> Optional[int]:
    """The step of the run's newest checkpoint, for the message (None: it has none yet, so it
    starts over), after checking that the dataset has the checkpoints' tokenizer. A worker falls
    back to an older checkpoint if the newest proves incomplete, and decides the schedule's
    horizon from the one it resumes from (optim.resumed_horizon)."""
    from raytrain_lm.store.runs import newest_checkpoint_meta

    step, meta = newest_checkpoint_meta(run)
    if meta is not None and "tokenizer" in meta:
        check_same_tokenizer(meta["tokenizer"], manifest, f"run {cfg.name!r}", cfg.data)
    return step


def init_line(path: str, cfg: TrainConfig) -> str:
    """The launch line of --init-from: the model it starts from and the schedule it trains at
    (a released model's: a continued pretraining's, config/presets.CONTINUED, unless given)."""
    steps = f"{cfg.warmup_steps} warmup step{'' if cfg.warmup_steps == 1 else 's'}"
    return (f"--init-from {path}: {describe(cfg.model)}; lr {cfg.lr:g} after {steps}, "
            f"{cfg.schedule} to {cfg.lr * cfg.min_lr_ratio:g}")


def check_init_from(path: str, cfg: TrainConfig, manifest: dict, say=None) -> str:
    """Validate --init-from against the model and dataset before any worker starts; returns the
    checkpoint folder to load (a run's best checkpoint, else its latest), or a Hugging Face
    folder of a family that imports it (check_hf_init_from)."""
    from raytrain_lm.store.runs import find_checkpoint

    if is_hf_folder(path):
        return check_hf_init_from(path, cfg.model, manifest)

    found = find_checkpoint(path, cfg.storage, best_else_latest=True, say=say)
    # the tokenizer first: another tokenizer usually means another vocabulary size as well, and
    # it is the cause to name
    check_same_tokenizer(found.meta["tokenizer"], manifest, f"checkpoint {found.source}", cfg.data)
    theirs = TrainConfig.from_dict(found.meta["config"]).model
    if theirs != cfg.model:
        diff = ", ".join(f"{k}: {getattr(theirs, k)} vs {getattr(cfg.model, k)}"
                         for k in vars(theirs) if getattr(theirs, k) != getattr(cfg.model, k))
        raise UserError(f"checkpoint {found.source} is for another model shape ({diff})")
    return str(found.path.resolve())


def check_hf_init_from(folder: str | Path, m: ModelConfig, manifest: dict) -> str:
    """A Hugging Face folder fits this run: a family imports its model_type, its config.json's
    every field read is of its type (the family's model_fields), its model is this run's (each
    field its config.json fixes, as the model computes it: kv heads as given or n_head, the head
    size as given or width / heads, the ffn size by its rule; `train` builds the model from the
    folder, so only a config made otherwise differs), its tokenizer.json is, byte for byte, the
    dataset's, and its weight files hold exactly the tensors of that model, each of its shape
    (their headers read: no tensor; every file inside the folder: store/hf_folder.py), and the
    release files it ships are readable (store/release.py). Before any worker starts. Returns
    the folder, resolved."""
    from raytrain_lm.data.manifest import tokenizer_sha256

    folder = Path(folder)
    where = f"--init-from {folder}"
    config = read_config(folder)
    adapter = hf_importer(config.get("model_type"), where)
    fields = adapter.model_fields(config, where)
    diff = differing_fields(fields, m)
    if diff:
        theirs = ", ".join(diff)
        raise UserError(f"{where} is another model ({theirs}: the folder's vs this run's); its "
                        f"config.json is the model: leave out --preset and --set model.*")
    path = folder / TOKENIZER
    if not path.is_file() or untrusted.digest(path) != tokenizer_sha256(manifest):
        raise UserError(f"{where}: its tokenizer.json is not the dataset's tokenizer, so its token ids "
                        f"mean other text; prepare the dataset with `prepare --tokenizer {folder}`")
    shapes, optional = adapter.expected_tensors(config, m, where)
    check_tensors(folder, shapes, optional, adapter.IGNORED_SUFFIXES, where)
    read_release(folder)  # what the export carries (store/release.py), read as rank 0 will
    return str(folder.resolve())


def describe_tokenizer(spec: dict) -> str:
    if spec.get("type") == "bpe":
        return f"a BPE of {spec['vocab_size']} tokens (tokenizer.json sha256 {spec['sha256'][:12]})"
    return f"the {spec.get('type')} tokenizer"


def check_same_tokenizer(spec: dict, manifest: dict, what: str, data: str) -> None:
    """A model's token ids mean what its tokenizer says: weights trained on one tokenizer's ids
    cannot continue on another's data (same vocabulary size or not)."""
    from raytrain_lm.data.spec import vocabulary_of

    if vocabulary_of(spec) != vocabulary_of(manifest["tokenizer"]):
        raise UserError(f"{what} was trained with {describe_tokenizer(spec)} but dataset {data} "
                        f"uses {describe_tokenizer(manifest['tokenizer'])}; use a dataset prepared "
                        f"with the same tokenizer (prepare --tokenizer CHECKPOINT_FOLDER)")
