"""Shared fixtures. One real local Ray cluster per test session: Ray Train's helper actors fail
when two local clusters run on one machine, so tests never start their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent

# One intra-op thread for torch in this process and the CLI's subprocesses, as Ray gives each
# worker: the tests' models are tiny, and two threads spin against each other when another
# process holds the second core (a 150-step training here took 4 s on one thread, 83 s on two).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray Train's controller takes a worker's report when it polls the workers, and a worker holds
# one report at a time: the tests' runs report every few steps of a model whose steps take a few
# ms (rows to check at given steps), and at the product's 0.5 s poll they would mostly wait for
# it (a user's reports are paced by time instead: cadence.Cadence). The driver passes the poll to
# the controller as an argument (ray_compat.polls.Polls). A value set outside still wins.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")


def pytest_configure(config):
    config.addinivalue_line("markers", "own_cluster: starts its own Ray cluster(s); runs last, "
                                       "after the session cluster is shut down")
    config.addinivalue_line("markers", "ray: needs a Ray cluster (set on every test that uses the "
                                       "session cluster or starts its own), or is `slow`; "
                                       "`-m 'not ray'` is the fast tier")
    config.addinivalue_line("markers", "slow: seconds of work without Ray (the local harness of "
                                       "local_mode.py, a GPU smoke test): in the slow tier with the "
                                       "Ray tests, not in the fast tier")


def uses_ray(item) -> bool:
    """The test starts or joins a Ray cluster: the session cluster or one of its own."""
    return "ray_address" in getattr(item, "fixturenames", ()) or item.get_closest_marker("own_cluster") is not None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups and `-m` deselects
def pytest_collection_modifyitems(config, items):
    """Mark the tests that need Ray, and run those that start their own Ray clusters after all
    others (a stable sort), so the session cluster of `ray_address` never has to coexist with
    them or restart.

    Under pytest-xdist (pytest.ini: two workers, `--dist loadgroup`) the tests that use Ray form
    one group, which one worker runs in this order: only one Ray cluster is ever up (two on one
    machine break Ray Train's helper actors), and each module fixture they share (a reference
    run) is made once. Every other test (the fast tier, the harness's `slow` runs, also those of
    files with Ray tests) goes to whichever worker is free, at a lower CPU priority than the
    group's (set_priority): the second core works through them while the first waits on Ray, and
    they take what the group leaves rather than slowing it: the group is the critical path, and
    the harness runs beside it fill the CPU it leaves idle while it waits on Ray's processes."""
    for item in items:
        if uses_ray(item) or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.ray)
        if uses_ray(item):
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
    items.sort(key=lambda item: item.get_closest_marker("own_cluster") is not None)


RAY_GROUP = "ray"
_RUNNING: list = [None]  # the test being set up, for ray_address's check
# The niceness of the tests that run beside the Ray group (and of the processes they start), when
# the session has a Ray group: that group, on one worker, is the suite's critical path, and Ray
# starts its workers at niceness 15 (Ray's RAY_worker_niceness), so a harness run at 0 beside
# them took most of a core they shared (docs/testing.md, Timings). Below Ray's workers, the tests
# beside them get what the group leaves; the group's own tests keep niceness 0.
BESIDE_RAY_NICE = 19
_RAY_GROUP_SELECTED = [False]


def in_ray_group(item) -> bool:
    return any(m.args == (RAY_GROUP,) for m in item.iter_markers("xdist_group"))


def pytest_collection_finish(session):
    _RAY_GROUP_SELECTED[0] = any(in_ray_group(item) for item in session.items)


def set_priority(item) -> None:
    """Niceness 0 for a test of the Ray group, BESIDE_RAY_NICE for any other when the session has a
    Ray group. Only where the process may lower its niceness again (root: CAP_SYS_NICE); the
    calling thread's, which the processes a test starts inherit."""
    if not _RAY_GROUP_SELECTED[0] or os.geteuid() != 0:
        return
    os.setpriority(os.PRIO_PROCESS, 0, 0 if in_ray_group(item) else BESIDE_RAY_NICE)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _RUNNING[0] = item
    set_priority(item)  # before the test's fixtures start anything


def stop_session_ray() -> None:
    """Stops the session cluster, if this process runs one: own-cluster tests run last, and
    nothing after them needs it."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(autouse=True)
def _session_ray_stopped_for_own_cluster(request):
    if request.node.get_closest_marker("own_cluster"):
        stop_session_ray()
    yield


def start_session_ray() -> str:
    """Start this test session's own Ray cluster; returns its address."""
    import ray

    # 4 logical CPUs on a 2-core machine: 2 training workers plus room for Ray's own tasks.
    # address="local": always a fresh cluster of our own. Without it ray.init joins whatever
    # /tmp/ray/ray_current_cluster or RAY_ADDRESS names (a head left by another run) and refuses
    # num_cpus there.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    return ray.get_runtime_context().gcs_address


@pytest.fixture(scope="session")
def ray_address():
    """The session's Ray cluster, started once; its address is for subprocesses (`--address`).
    Under xdist only the worker of the Ray group may start it: a test that asks for it by
    `request.getfixturevalue`, which collection cannot see, must sit in a file with a test that
    names it (conftest.pytest_collection_modifyitems)."""
    import ray

    item = _RUNNING[0]
    if os.environ.get("PYTEST_XDIST_WORKER") and item is not None \
            and not in_ray_group(item):
        pytest.fail(f"{item.nodeid} starts the session's Ray outside the Ray group: a second Ray "
                    f"cluster could run beside the group's; see conftest.pytest_collection_modifyitems")
    yield start_session_ray()
    ray.shutdown()


@pytest.fixture(scope="session")
def pydoc_docs() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


@pytest.fixture(scope="session")
def bpe_pydoc(pydoc_docs):
    """A 2048-token byte-level BPE trained on the pydoc corpus (a fraction of a second)."""
    from raytrain_lm.data.tokenizer import train_bpe

    return train_bpe(pydoc_docs, 2048)


@pytest.fixture(scope="session")
def pydoc_data(tmp_path_factory) -> Path:
    from raytrain_lm.data.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("data") / "pydoc"
    prepare_dataset("pydoc", out)
    return out


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None):
    """Run `python cli.py ARGS` in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, str(ROOT / "cli.py"), *args], cwd=cwd or ROOT, capture_output=True,
        text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


CLOSED_ADDRESS = "127.0.0.1:1"  # where no Ray cluster answers
NO_RAY = {"RAY_ADDRESS": ""}  # cli_here's env for commands that work without Ray (a small prepare)


def cli_here(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 0):
    """`python cli.py ARGS` in this process, through `raytrain_lm.cli.main()` itself (its error
    boundary: one line, exit codes), without a subprocess's ~0.3-2 s of start-up and imports.
    Returns what run_cli returns. For inputs refused before any cluster is reached: RAY_ADDRESS
    is a closed port unless `env` names another, Ray is never connected to (a call that gets as
    far as connecting fails as an unexpected AssertionError, exit code 1, after the address check
    that a subprocess would make), and this process's environment, working folder and argv are
    restored after. `timeout`: unused (run_cli's signature)."""
    import contextlib
    import io

    from raytrain_lm import cli
    from raytrain_lm.cluster import connect

    def connect_refused(address, *rest, **kw):
        address = address or os.environ.get("RAY_ADDRESS")
        if address and address != "local":
            connect.check_reachable(address)  # what connect_ray checks first
        raise AssertionError("an in-process CLI call (conftest.cli_here) would connect to Ray")

    def bind(old, new):  # every module that holds `old` by name (`from ... import connect_ray`)
        for module in [m for name, m in list(sys.modules.items()) if name.startswith("raytrain_lm")]:
            if getattr(module, "connect_ray", None) is old:
                module.connect_ray = new

    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    saved_connect, saved_disconnect = connect.connect_ray, cli._disconnect_ray
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        os.environ.update({"RAY_ADDRESS": CLOSED_ADDRESS, **(env or {})})
        os.chdir(cwd or ROOT)
        sys.argv = ["cli.py", *args]
        bind(saved_connect, connect_refused)  # also the modules imported during the call bind this
        cli._disconnect_ray = lambda: None  # a session cluster of this process stays up
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        bind(connect_refused, saved_connect)
        cli._disconnect_ray = saved_disconnect
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(["cli.py", *args], code, out.getvalue(), err.getvalue())


def processes_where(test) -> list[int]:
    """The pids of this machine's processes for which `test(/proc/<pid> folder)` is true; a
    process that ends meanwhile is left out."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and test(entry):
                found.append(int(entry.name))
        except OSError:  # the process ended meanwhile
            pass
    return found


def session_processes(title: str) -> list[int]:
    """The processes of this session's Ray cluster (children of its raylet) whose title starts
    with `title` (Ray names an actor's process `ray::<Class>`). Another Ray may run on this
    machine (a user's training), and its processes are not this test's to kill."""
    import ray
    from ray._private import ray_constants

    node = ray._private.worker._global_node
    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    return processes_where(
        lambda entry: (entry / "cmdline").read_bytes().startswith(title.encode())
        and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == raylet)


def kill_train_workers() -> int:
    """SIGKILL every Ray Train worker process of the session cluster: with a killed driver, the
    whole job is lost at once."""
    import signal

    killed = 0
    for pid in session_processes("ray::RayTrainWorker"):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:  # the process ended meanwhile
            pass
    return killed


# ---------------------------------------------------------------- small runs shared by modules

SMALL_STEPS = 30
SMALL_SETTINGS = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.dropout=0.1",
                  "batch_size=8", "seq_len=64", "warmup_steps=5", "keep_checkpoints=2"]


def small_config(data, storage, name, sets=SMALL_SETTINGS, **flags):
    """A 2-worker run of a 2-layer model; dropout on, so exact-resume checks cover every RNG."""
    from raytrain_lm.config.load import build_config

    flags = {**dict(workers=2, max_steps=SMALL_STEPS, log_every=5, eval_every=15,
                    checkpoint_every=10, data=str(data), storage=str(storage), name=name, seed=11),
             **flags}
    return build_config(flags=flags, sets=sets)


def row_losses(rows) -> dict[int, float]:
    """step -> global training loss of that step, from metrics rows (each carries the losses of
    the steps since the row before)."""
    out = {}
    for row in rows:
        first = row["step"] - len(row["step_losses"]) + 1
        out.update(zip(range(first, row["step"] + 1), row["step_losses"]))
    return out


def step_losses(run_dir: Path) -> dict[int, float]:
    """step -> global training loss of that step, from metrics.jsonl."""
    import json

    return row_losses(json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())


@pytest.fixture(scope="session")
def small_storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("small-runs")


@pytest.fixture(scope="session")
def reference_run(ray_address, pydoc_data, small_storage):
    """An uninterrupted DDP run: (per-step losses, metrics rows). Its folder: small_storage/reference."""
    from raytrain_lm.run.driver import run_training

    rows = []
    summary = run_training(small_config(pydoc_data, small_storage, "reference"),
                           say=lambda m: None, on_metrics=rows.append)
    assert summary["status"] == "completed" and summary["restarts"] == 0
    return step_losses(small_storage / "reference"), rows


TINY_STEPS = 120


@pytest.fixture(scope="session")
def tiny_run(ray_address, pydoc_data, tmp_path_factory):
    """One real 2-worker run of the tiny preset, shared by the modules that look at a finished
    run: (storage, run folder). Validation (on 64 windows: the default 256 cost seconds per
    validation) and checkpoints at steps 60 and 120."""
    import ray

    from raytrain_lm.config.load import build_config
    from raytrain_lm.run.driver import run_training

    storage = tmp_path_factory.mktemp("runs")
    cfg = build_config(flags=dict(workers=2, max_steps=TINY_STEPS, log_every=10, eval_every=60,
                                  eval_windows=64, checkpoint_every=60, data=str(pydoc_data),
                                  storage=str(storage), name="looked-at"))
    before = set(ray._private.state.actors())  # every actor the cluster ever had, dead ones too

    def look_at_the_controller(row):
        if not TINY_RUN_CONTROLLER_LIBS:
            TINY_RUN_CONTROLLER_LIBS.extend(libraries_of_process("ray::Controller"))

    summary = run_training(cfg, say=lambda m: None, on_metrics=look_at_the_controller)
    assert summary["status"] == "completed"
    TINY_RUN_ACTORS.extend(a["ActorClassName"] for i, a in ray._private.state.actors().items()
                           if i not in before)
    return storage, storage / "looked-at"


# `train` on a Ray it starts itself (the README's first command on a laptop): 4 steps of tiny with
# checkpoints at 2 and 4, validated at 4 on 8 windows (the default 256 cost seconds per run); also
# the reference of `--workers 0` (tests/test_workers_0.py)
COLD_FLAGS = ("--max-steps", "4", "--log-every", "2", "--eval-every", "4", "--checkpoint-every", "2",
              "--set", "eval_windows=8")


@pytest.fixture(scope="session")
def cold_run(pydoc_data, tmp_path_factory):
    """`train --address local --workers 1` with COLD_FLAGS, in a process of its own, on a Ray that
    process starts and stops, with no thread count set (as a laptop's shell): (the finished
    process, its run folder, the Ray's temporary folder). For own_cluster tests only (the
    session cluster is stopped first)."""
    import shutil
    import tempfile

    stop_session_ray()
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # Ray's socket paths must be short
    storage = tmp_path_factory.mktemp("cold")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("OMP_NUM_THREADS", raising=False)  # conftest sets it for the other tests
        r = run_cli("train", "--address", "local", "--workers", "1", *COLD_FLAGS, "--data",
                    str(pydoc_data), "--storage", str(storage), "--name", "cold",
                    env={"RAY_TMPDIR": str(ray_tmp)}, timeout=240)
    yield SimpleNamespace(result=r, run_dir=storage / "cold", ray_tmp=ray_tmp)
    shutil.rmtree(ray_tmp, ignore_errors=True)


TINY_RUN_ACTORS: list[str] = []  # the classes of the actors the shared tiny run started
TINY_RUN_CONTROLLER_LIBS: list[str] = []  # the shared libraries its controller had loaded


def libraries_of_process(title: str) -> list[str]:
    """The shared libraries (.so files) mapped by the newest process of the session cluster whose
    title starts with `title`."""
    procs = []
    for pid in session_processes(title):
        try:
            procs.append((Path(f"/proc/{pid}").stat().st_mtime, pid))
        except OSError:  # gone meanwhile
            continue
    return libraries_of_pid(max(procs)[1]) if procs else []


def libraries_of_pid(pid: int) -> list[str]:
    """The shared libraries (.so files) process `pid` has mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1].rsplit("/", 1)[-1] for line in maps if ".so" in line})


# ---------------------------------------------------------------- models trained without Ray

class TrainedHere:
    """A tiny model trained in this process on the pydoc corpus with one tokenizer and saved as a
    checkpoint beside its dataset: for export, generate and --init-from tests that need a model
    whose predictions are not noise (a few dozen steps put the loss well below a random model's,
    so greedy choices are not near-ties) but need no Ray."""

    def __init__(self, root: Path, tokenizer: str, vocab_size, bias: bool, steps: int = 30,
                 arch: str = "gpt", data: Optional[Path] = None, gelu: str = "exact"):
        """`data`: an existing dataset to train on (else one is prepared with `tokenizer`)."""
        import torch

        from raytrain_lm.config.load import build_config
        from raytrain_lm.data.manifest import dataset_tokenizer, load_manifest
        from raytrain_lm.data.prepare import prepare_dataset
        from raytrain_lm.data.windows import TokenWindows
        from raytrain_lm.models import build_model
        from raytrain_lm.run.preflight import fit_model_to_data
        from raytrain_lm.store.checkpoint_format import save_checkpoint

        self.data, self.ckpt, self.steps = data or root / "data", root / "ckpt", steps
        self.manifest = load_manifest(data) if data else prepare_dataset(
            "pydoc", self.data, tokenizer=tokenizer, vocab_size=vocab_size, block_tokens=1024)
        self.tok = dataset_tokenizer(self.data)
        self.cfg = build_config(flags=dict(data=str(self.data), seq_len=64, batch_size=16),
                                sets=["model.n_layer=2", "model.n_head=4", "model.n_embd=64",
                                      "model.block_size=128", f"model.bias={bias}",
                                      f"model.gelu={gelu}", f"model.arch={arch}",
                                      *(LLAMA_SETTINGS if arch == "llama" else [])])
        fit_model_to_data(self.cfg, self.manifest)  # vocabulary padded to a multiple of 64
        torch.manual_seed(0)
        self.model = build_model(self.cfg.model)
        opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        train = TokenWindows(self.data, "train", 64)
        g = torch.Generator().manual_seed(0)
        self.losses = []
        for _ in range(steps):
            batch = train.__getitems__(torch.randint(len(train), (8,), generator=g).tolist())
            _, loss = self.model(batch[:, :-1], batch[:, 1:])
            self.losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
        self.model.eval()
        # what the tests rely on: it learned (a random model's loss is about ln(vocab))
        assert sum(self.losses[-5:]) / 5 < self.losses[0] - 0.5, self.losses
        state = {"step": steps, "tokens": steps * 8 * 64, "world_size": 1, "config": self.cfg.to_dict(),
                 "tokenizer": self.tok.spec(), "scaler": {}, "data": {"epoch": 0, "consumed": 0}}
        # save_checkpoint takes the model as the step holds it: parts and their optimizers
        save_checkpoint(self.ckpt, 0, SimpleNamespace(parts=[self.model], optimizers=[opt]),
                        state=state, tokenizer_raw=self.tok.raw)


class TrainedModels(dict):
    """{"byte": a byte model (vocabulary 256, biases, exact GELU), "bpe": a BPE model (1000 tokens
    padded to 1024, bias=False and tanh GELU as the gpt2 preset), "llama": a Llama (2 kv heads) on
    the same BPE}, each trained the first time a test of this process asks for it (a module that
    needs one model does not pay for three); items() trains them all."""

    KINDS = ("byte", "bpe", "llama")

    def __init__(self, root: Path):
        super().__init__()
        self.root = root

    def __missing__(self, kind: str) -> TrainedHere:
        if kind == "byte":
            made = TrainedHere(self.root / "byte", "byte", None, bias=True)
        elif kind == "bpe":
            made = TrainedHere(self.root / "bpe", "bpe", 1000, bias=False, gelu="tanh")
        elif kind == "llama":
            made = TrainedHere(self.root / "llama", "bpe", 1000, bias=False, arch="llama",
                               data=self["bpe"].data)
        else:
            raise KeyError(kind)
        self[kind] = made
        return made

    def items(self):
        return [(kind, self[kind]) for kind in self.KINDS]


@pytest.fixture(scope="session")
def trained_here(tmp_path_factory) -> TrainedModels:
    return TrainedModels(tmp_path_factory.mktemp("trained-here"))


def batches_as_read(cfg, dp_rank: int = 0, dp_size: int = 1):
    """The micro-batches a worker's `train_stream` reads, read here without Ray: the same
    windows in the same order through a plain DataLoader (Ray's prepare_data_loader only moves
    them to the worker's device)."""
    from torch.utils.data import DataLoader

    from raytrain_lm.data.sampler import BatchPlan, BatchStream
    from raytrain_lm.data.windows import TokenWindows, collate_windows

    dataset = TokenWindows(cfg.data, "train", cfg.seq_len)
    return BatchStream(dataset.shard_windows, BatchPlan(cfg.batch_size, cfg.grad_accum, dp_rank, dp_size),
                       cfg.seed, lambda b: DataLoader(dataset, batch_sampler=b, collate_fn=collate_windows))


def validation_as_read(cfg, byte_lengths):
    """The (inputs, targets) of a one-rank `Validation`, read without Ray (as batches_as_read)."""
    from torch.utils.data import DataLoader

    from raytrain_lm.data.loaders import Validation
    from raytrain_lm.data.windows import collate_windows

    v = Validation(cfg, 0, 1, byte_lengths)
    for (x, y), real in zip(DataLoader(v.dataset, batch_sampler=v.indices, collate_fn=collate_windows), v.real):
        yield x, v.targets(y, real)


# ---------------------------------------------------------------- Llama

# What the Llama tests add to a GPT's settings: grouped-query attention (2 kv heads: whole kv heads
# on each of 2 tp ranks), SwiGLU's hidden size rounded to a multiple of 32.
LLAMA_SETTINGS = ["model.arch=llama", "model.bias=false", "model.n_kv_head=2", "model.multiple_of=32"]


def save_hf_llama(folder: Path, m, tokenizer_json: bytes, seed: int = 0, tied: bool = False,
                  max_shard_size: str = "50GB"):
    """A LlamaForCausalLM of `m`'s shape (a ModelConfig) with transformers' own random init,
    saved as a Hugging Face folder (safetensors, config.json) with `tokenizer_json`: a released
    checkpoint in miniature, made here (nothing downloaded). `tied`: tie_word_embeddings (no
    lm_head.weight, as Llama 3.2 1B/3B); `max_shard_size` past the weights' size: shards and
    model.safetensors.index.json, as every larger Hub model. Returns the model (eval mode)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.n_embd,
                         intermediate_size=m.hidden_dim, num_hidden_layers=m.n_layer,
                         num_attention_heads=m.n_head, num_key_value_heads=m.kv_heads,
                         max_position_embeddings=m.block_size, rms_norm_eps=m.norm_eps,
                         rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
                         tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    (Path(folder) / "tokenizer.json").write_bytes(tokenizer_json)
    return model


class MeteredStep:
    """What worker/metrics.Meter reads of the step (worker/step.TrainStep's attributes), for
    Meter's tests without a model: `data_wait` seconds a step waited for data, `moe` a mixture
    of experts' row keys (None: a dense model)."""

    def __init__(self, data_wait: float = 0.0, moe: Optional[dict] = None):
        import torch

        self.parts, self.optimizers, self.comm_bytes = [torch.nn.Linear(2, 2)], [], {}
        self.data_wait, self.moe = data_wait, moe

    def take_bubble(self):
        return None

    def take_data_wait(self):
        return self.data_wait

    def moe_stats(self):
        import torch

        return None if self.moe is None else torch.zeros(1, dtype=torch.float64)

    def moe_summary(self, summed):
        return self.moe
