"""Context parallelism and document masking (parallel/cp.py, models/attention.py): on the local
harness (local_mode.py, gloo ranks) a window split over cp ranks trains the one-worker model, and
in one process the masks compute what running each document alone computes."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from conftest import step_losses
from local_mode import run_local
from raytrain_lm.config.load import build_config
from test_parallel_layouts import GLOBAL_BATCH, STEPS, assert_trains_the_one_worker_model, layout_config, run_config

# name: (workers, flags); the Llama (rotary positions, 4 query heads over 2 kv heads: GQA)
CP_LAYOUTS = {
    "one": (1, {}),
    "cp2": (2, dict(cp=2)),
    # on 4 ranks: cp composed with FSDP (sharded over dp x cp), tp (heads split inside a cp
    # shard) and a pipeline (each stage's attention gathers over its cp group)
    "cp2xfsdp2": (4, dict(cp=2, strategy="fsdp")),
    "cp2xtp2-sp": (4, dict(cp=2, tp=2, sequence_parallel=True)),
    "cp2xpp2": (4, dict(cp=2, pp=2, pp_schedule="1f1b", microbatches=4)),
}


def cp_config(data, storage, name, workers, flags):
    dp = workers // (flags.get("tp", 1) * flags.get("pp", 1) * flags.get("cp", 1))
    return layout_config(data, storage, name, workers, {"batch_size": GLOBAL_BATCH // dp, **flags},
                         arch="llama", checkpoint_every=7)


@pytest.fixture(scope="module")
def cp_storage(tmp_path_factory):
    return tmp_path_factory.mktemp("cp")


@pytest.fixture(scope="module")
def cp_runs(pydoc_data, cp_storage):
    """runs(name): a layout's (per-step losses, metrics rows), each run once on first use."""
    done = {}

    def get(name):
        if name not in done:
            done[name] = run_config(cp_config(pydoc_data, cp_storage, name, *CP_LAYOUTS[name]))
        return done[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in CP_LAYOUTS if n != "one"])
def test_context_parallel_trains_the_one_worker_model(cp_runs, layout):
    """Within 1e-4 relative at each step, the gradient norm and the validation loss: the split
    windows' attention (K/V all-gathered, masked by place in the window), rotary positions by
    place, the loss averaged over the cp ranks and their gradients over dp x cp."""
    assert_trains_the_one_worker_model(cp_runs(layout), cp_runs("one"))


@pytest.mark.slow
def test_context_parallel_moves_keys_and_values(cp_runs):
    """The cp dim moves bytes (every layer's all-gather of K/V and its gradients), and each cp
    rank holds the whole model (DDP over dp x cp)."""
    row = cp_runs("cp2")[1][-1]
    assert row["comm_bytes"]["cp"] > 0
    assert row["param_fraction"] == 1.0


@pytest.mark.slow  # (the cp2xfsdp2 run above)
def test_context_parallel_rows_carry_the_noise_scale(cp_runs):
    """Over dp 2 x cp 2 every row has the gradient noise scale's estimates (parallel/noise.py:
    the cp ranks' parts summed before squaring), which the batch hint reads (train's
    BatchAdvice); the float64 arithmetic is test_noise_worker's."""
    from raytrain_lm.plan.noise_scale import BatchAdvice

    rows = cp_runs("cp2xfsdp2")[1]
    advice = BatchAdvice(GLOBAL_BATCH, settle=0, factor=1.0)  # (a hint at any distance)
    hints = []
    for row in rows:
        assert row["noise_grad_sq"] is not None and row["noise_trace"] is not None
        hints.append(advice.update(row))
    assert advice.b_simple == rows[-1]["noise_scale"]
    assert any(hints) == any(row["noise_scale"] is not None for row in rows)


# ---------------------------------------------------------------- in one process, float64

SEP = 0  # the token that opens a document (the dataset's <|endoftext|>)


def small_model(arch: str, window=None, param="sp"):
    from raytrain_lm.models import build_model
    from raytrain_lm.models.family import ModelConfig

    extra = dict(bias=False, n_kv_head=2, multiple_of=32, sliding_window=window) if arch == "llama" else {}
    if param == "mup":  # attention's q.k scaled by muP's sqrt(d_base)/d, not SDPA's default
        extra.update(param="mup", mup_base_width=16)
    m = ModelConfig(arch=arch, vocab_size=64, block_size=64, n_layer=2, n_head=4, n_embd=32,
                    dropout=0.0, **extra)
    return build_model(m, seed=3).double().eval()


def packed_window(lengths, seed=0):
    """(x, y) of one window packing documents of `lengths` tokens (each opened by SEP, as the
    dataset writes them), and each document's (start, end) in x."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.tensor([SEP]), torch.randint(1, 64, (n - 1,), generator=g)]) for n in lengths]
    stream = torch.cat(docs + [torch.tensor([SEP])])  # the next document's opener: the last target
    starts = torch.tensor([0, *lengths]).cumsum(0).tolist()
    return stream[None, :-1], stream[None, 1:], list(zip(starts[:-1], starts[1:]))


def doc_span(x):
    from raytrain_lm.parallel.cp import ContextParallel

    return ContextParallel(1, 0, None, SEP).shard(x, x)[2]


@pytest.mark.parametrize("arch,param", [("gpt", "sp"), ("llama", "sp"), ("gpt", "mup"), ("llama", "mup")])
def test_document_masked_logits_equal_each_document_alone(arch, param):
    """Packed with --doc-mask, every document's logits are those of the document run alone
    (positions restart at each document: the GPT's learned ones too; under muP the masked path
    keeps the model's attention scale), to float64 rounding."""
    from raytrain_lm.models.attention import using

    model = small_model(arch, param=param)
    x, y, bounds = packed_window([9, 20, 3, 16])
    with torch.no_grad(), using(doc_span(x)):
        packed = model(x, y)[0]
    with torch.no_grad():
        for s, e in bounds:
            alone = model(x[:, s:e], y[:, s:e])[0]
            assert torch.allclose(packed[:, s:e], alone, rtol=0, atol=1e-10), (s, e)
        unmasked = model(x, y)[0]
    # without the mask a later document sees the earlier ones: the claim is not vacuous
    assert not torch.allclose(packed[:, 9:29], unmasked[:, 9:29], atol=1e-3)


def test_a_packed_windows_loss_is_the_token_weighted_sum_of_its_documents():
    """The window's mean loss under --doc-mask = sum over documents of (tokens x the document's
    own mean loss) / the window's tokens."""
    import torch.nn.functional as F

    from raytrain_lm.models.attention import using

    def loss(x, y):  # the decoder's cross-entropy, kept in float64 (it takes it in fp32)
        return F.cross_entropy(model(x, y)[0].flatten(0, 1), y.reshape(-1)).item()

    model = small_model("llama")
    x, y, bounds = packed_window([5, 30, 12, 17])
    with torch.no_grad():
        with using(doc_span(x)):
            packed = loss(x, y)
        weighted = sum((e - s) * loss(x[:, s:e], y[:, s:e]) for s, e in bounds) / x.size(1)
        unmasked = loss(x, y)
    assert packed == pytest.approx(weighted, rel=1e-12)
    assert unmasked != pytest.approx(weighted, rel=1e-4)


@pytest.mark.parametrize("cp", [1, 2])
def test_a_microbatchs_rows_of_the_span_are_the_span_of_those_rows(cp):
    """A pipeline stage runs a microbatch of the batch's rows under the span of the whole batch
    (every pp rank reads the batch): Span.of_rows gives the span built from those rows alone
    (their documents and restarted positions, the keys' documents), at cp 1 and on cp 2's rank 1."""
    from raytrain_lm.parallel.cp import ContextParallel

    x = torch.cat([packed_window(lengths, seed=i)[0]
                   for i, lengths in enumerate([[9, 20, 3, 32], [30, 34], [5, 59], [64]])])
    context = ContextParallel(cp, cp - 1, None, SEP)
    rows = torch.tensor([2, 3])
    got, alone = context.shard(x, x)[2].of_rows(rows), context.shard(x[rows], x[rows])[2]
    for name in ("index", "positions", "docs", "key_index", "key_docs"):
        assert torch.equal(getattr(got, name), getattr(alone, name)), name
    assert not torch.equal(got.docs, context.shard(x, x)[2].docs[:2])  # the rows' own documents


@pytest.mark.parametrize("arch,window,docs", [("gpt", None, False), ("llama", None, False),
                                              ("llama", None, True), ("llama", 11, False),
                                              ("llama", 11, True)])
@pytest.mark.parametrize("cp", [2, 4])
def test_the_chunk_order_with_its_mask_computes_the_window(arch, window, docs, cp):
    """Context parallelism's arithmetic without the collective: the window's tokens in the cp
    ranks' gathered order (rank 0's chunks 0 and 2cp-1, rank 1's ...), attending by their places
    in the window, give the window's own logits in that order: causal order, rotary and learned
    positions by place, GQA, a sliding window (Mistral's, shorter than a chunk pair apart) and
    documents. The gather itself: the harness runs (test_context_parallel_trains_...)."""
    from raytrain_lm.models.attention import Span, document_ids, document_positions, using
    from raytrain_lm.parallel.cp import chunk_index

    model = small_model(arch, window)
    x, y, _ = packed_window([13, 27, 24])
    T = x.size(1)
    order = torch.cat([chunk_index(T, cp, r) for r in range(cp)])
    assert sorted(order.tolist()) == list(range(T))
    with torch.no_grad():
        if docs:
            with using(doc_span(x)):
                whole = model(x, y)[0]
            d = document_ids(x, SEP)
            span = Span(index=order, positions=document_positions(d)[:, order], docs=d[:, order])
        else:
            whole = model(x, y)[0]
            span = Span(index=order, positions=order)
        with using(span):
            split = model(x[:, order], y[:, order])[0]
    assert torch.allclose(split, whole[:, order], rtol=0, atol=1e-10)


def test_chunks_balance_the_causal_work():
    """Rank i holds chunks i and 2cp-1-i: every rank the same number of (query, visible key)
    pairs, which a contiguous split would not give."""
    from raytrain_lm.parallel.cp import chunk_index

    T, cp = 64, 4
    pairs = [int((chunk_index(T, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(pairs)) == 1
    contiguous = [sum(range(r * T // cp + 1, (r + 1) * T // cp + 1)) for r in range(cp)]
    assert len(set(contiguous)) == cp


@pytest.mark.slow
def test_a_one_worker_checkpoint_resumes_at_cp2(cp_runs, cp_storage):
    """Saved by one worker at step 7, continued with --cp 2 on two workers (the same one
    data-parallel rank of 16 sequences, each window split over the two): every later step's loss
    is the uninterrupted one-worker run's."""
    import shutil

    cp_runs("one")
    shutil.copytree(cp_storage / "one", cp_storage / "one-to-cp2")
    torn = cp_storage / "one-to-cp2" / f"checkpoint_{STEPS:08d}" / "state.pt"
    torn.write_bytes(torn.read_bytes()[:100])  # the final checkpoint is skipped: resume from 7
    cfg = build_config(base=json.loads((cp_storage / "one-to-cp2" / "config.json").read_text()),
                       flags={"workers": 2, "cp": 2})
    cfg.name = "one-to-cp2"
    summary = run_local(cfg, resume=True, say=lambda m: None)
    assert summary["resumed_from_step"] == 7
    resumed, uninterrupted = step_losses(cp_storage / "one-to-cp2"), cp_runs("one")[0]
    for step in range(8, STEPS + 1):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-4), step


@pytest.mark.slow
@pytest.mark.parametrize("to,flags", [("cp4", dict(workers=4, cp=4)), ("one", dict(workers=1, cp=1))])
def test_a_cp2_checkpoint_resumes_at_another_cp_degree(cp_runs, cp_storage, to, flags):
    """Saved at --cp 2 at step 7, continued at --cp 4 on four workers (each window in 8 chunks)
    and at one worker: every later step's loss is the uninterrupted cp2 run's (checkpoints keep
    the single-process names and shapes, and the windows and their order do not depend on cp)."""
    import shutil

    uninterrupted = cp_runs("cp2")[0]
    name = f"cp2-to-{to}"
    shutil.copytree(cp_storage / "cp2", cp_storage / name)
    torn = cp_storage / name / f"checkpoint_{STEPS:08d}" / "state.pt"
    torn.write_bytes(torn.read_bytes()[:100])  # the final checkpoint is skipped: resume from 7
    cfg = build_config(base=json.loads((cp_storage / name / "config.json").read_text()), flags=flags)
    cfg.name = name
    summary = run_local(cfg, resume=True, say=lambda m: None)
    assert summary["resumed_from_step"] == 7
    resumed = step_losses(cp_storage / name)
    for step in range(8, STEPS + 1):
        assert resumed[step] == pytest.approx(uninterrupted[step], rel=1e-4), step


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory, pydoc_docs):
    """A BPE dataset (documents separated by <|endoftext|>) of short documents, the paragraphs of
    the pydoc topics: a 64-token window packs several."""
    from raytrain_lm.data.prepare import prepare_dataset

    folder = tmp_path_factory.mktemp("short-docs")
    lines = [json.dumps({"text": p}) for doc in pydoc_docs for p in doc.split("\n\n") if 40 <= len(p) <= 200]
    (folder / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare_dataset(str(folder / "docs.jsonl"), folder / "ds", tokenizer="bpe", vocab_size=320,
                    block_tokens=1024)
    return folder / "ds"


# name: (workers, flags) of the --doc-mask runs on short_docs
DOC_LAYOUTS = {
    "doc-one": (1, {}),
    "doc-cp2": (2, dict(cp=2)),  # documents found on the whole window, then split
    # each stage takes its microbatch's rows of the batch's documents (every pp rank reads the
    # batch); checkpointed blocks recompute by the microbatch's span in backward
    "doc-pp2": (2, dict(pp=2, pp_schedule="1f1b", microbatches=4, activation_checkpointing="full")),
}


@pytest.fixture(scope="module")
def doc_runs(short_docs, cp_storage):
    """runs(name): a --doc-mask layout's (per-step losses, metrics rows), each run once."""
    done = {}

    def get(name):
        if name not in done:
            workers, flags = DOC_LAYOUTS[name]
            done[name] = run_config(cp_config(short_docs, cp_storage, name, workers, {**flags, "doc_mask": True}))
        return done[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", [n for n in DOC_LAYOUTS if n != "doc-one"])
def test_document_masked_layouts_train_the_one_worker_model(doc_runs, short_docs, cp_storage, layout):
    """--doc-mask on packed windows of several documents: at --cp 2 and --pp 2 (four
    microbatches, full checkpointing) the one-worker doc-masked run's losses, gradient norms and
    validation loss, step for step."""
    from conftest import batches_as_read
    from raytrain_lm.data.manifest import load_manifest

    eot = load_manifest(short_docs)["tokenizer"]["eot_id"]
    (losses, rows), (reference, one) = doc_runs(layout), doc_runs("doc-one")
    assert losses.keys() == reference.keys() == set(range(1, STEPS + 1))
    for step in reference:
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), step
    for row, ref in zip(rows, one, strict=True):
        assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4), row["step"]
    # a BPE's bits per byte: each data-parallel group's text bytes counted once, not per cp rank
    # or stage
    for key in ("val_loss", "val_bpb"):
        assert rows[-1][key] == pytest.approx(one[-1][key], rel=1e-4), key
    x, _ = batches_as_read(cp_config(short_docs, cp_storage, layout, *DOC_LAYOUTS[layout])).next()
    # a document starts inside a window, in different places in different rows: the mask matters,
    # and differs by microbatch
    starts = (x[:, 1:] == eot)
    assert bool(starts.any()) and not bool((starts == starts[:1]).all())


def test_cp2_on_ray_workers_trains_the_one_worker_model(ray_address, cp_runs, pydoc_data, cp_storage):
    """--cp 2 on two Ray Train workers (Ray's DDP over both: the cp ranks' gradients averaged):
    the harness's one-worker losses, gradient norms and validation loss, step for step."""
    from raytrain_lm.run.driver import run_training

    run = run_config(cp_config(pydoc_data, cp_storage, "cp2-ray", *CP_LAYOUTS["cp2"]), train=run_training)
    assert_trains_the_one_worker_model(run, cp_runs("one"))


@pytest.mark.parametrize("flags,expected", [
    (dict(workers=3, cp=2), "--workers 3 must be a multiple of --tp x --pp x --cp = 2"),
    (dict(workers=2, cp=0), "--tp, --pp, --ep and --cp must be at least 1"),
    (dict(workers=4, cp=4, seq_len=36), "--seq-len 36 must be divisible by 2 x --cp = 8"),
])
def test_cp_layouts_that_cannot_work_are_refused(flags, expected):
    """One line each, before anything starts (config/layout.py, what `train` checks first)."""
    from raytrain_lm.config.checks import check_layout
    from raytrain_lm.errors import UserError

    with pytest.raises(UserError, match=expected.replace("+", r"\+")):
        cfg = build_config(flags=flags)
        cfg.model.vocab_size = 256
        check_layout(cfg)


def test_doc_mask_refuses_a_dataset_without_a_one_token_separator():
    """A byte dataset separates documents by "\\n\\n", found inside documents too: --doc-mask
    says so in one line instead of guessing documents."""
    from raytrain_lm.errors import UserError
    from raytrain_lm.run.preflight import fit_model_to_data

    cfg = build_config(flags=dict(workers=1, doc_mask=True))
    with pytest.raises(UserError, match="--doc-mask needs a dataset whose documents are separated by one token"):
        fit_model_to_data(cfg, {"vocab_size": 256, "separator": "\n\n"})
    cfg.doc_mask = False
    fit_model_to_data(cfg, {"vocab_size": 256, "separator": "\n\n"})


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_kv_kept_as_the_ranks_part_and_gathered_again_gives_the_same_gradients(ac):
    """The attention's backward gets the gathered K/V again from this rank's part (saved-tensor
    hooks, wrapping whatever hooks are installed around it: activation checkpointing's): the
    gradients are those of attention over K/V saved whole, with and without checkpointing (one
    rank's "gather" that repeats every key: the same attention)."""
    import dataclasses

    from raytrain_lm.models.attention import using
    from raytrain_lm.parallel.ac import apply_activation_checkpointing

    def grads(model, span):
        model.zero_grad()
        with using(span):
            model(x, y)[1].backward()
        return [p.grad.clone() for p in model.parameters()]

    x, y, _ = packed_window([20, 44])
    plain = doc_span(x)
    # every key twice: attention over [K; K], [V; V] is attention over K, V (each pair's two
    # weights are halves of one), and a backward handed the part alone would fail on its shape
    twice = torch.cat([plain.index, plain.index])
    gathered = dataclasses.replace(plain, key_index=twice, key_docs=torch.cat([plain.docs] * 2, dim=1),
                                   gather=lambda t: torch.cat([t, t], dim=2), masks={})
    model = small_model("llama")
    expected = grads(model, plain)
    apply_activation_checkpointing(model, ac)
    for got, want in zip(grads(model, gathered), expected, strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("order,window,docs", [("cp", None, False), ("cp", 11, True), ("plain", 11, False)])
def test_the_gpus_block_mask_is_the_dense_masks_rule(order, window, docs):
    """The GPU path's flex_attention BlockMask (built from the same rule) is the dense mask's rule
    at every (query, key) and gives its attention, here with flex_attention's eager reference on
    the CPU (the GPU compiles it): for the cp ranks' chunk order with documents and a sliding
    window, and for a plain forward past its sliding window (the Llama's without a span:
    attention.window_span's block mask against llama.window_mask and the CPU's SDPA with it)."""
    import warnings

    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from raytrain_lm.models.attention import Span, block_mask, dense_mask, document_ids, sliding_window, window_span
    from raytrain_lm.models.llama.llama import window_mask
    from raytrain_lm.parallel.cp import chunk_index

    g = torch.Generator().manual_seed(1)
    if order == "plain":
        span, Tq = window_span(64, "cpu"), 64
        rule = window_mask(0, 64, 64, window, "cpu")
    else:
        x, _, _ = packed_window([13, 27, 24])
        index = torch.cat([chunk_index(64, 2, r) for r in range(2)])
        d = document_ids(x, SEP)
        span, Tq = Span(index=index[:32], positions=index[:32], key_index=index,
                        docs=d[:, index[:32]] if docs else None, key_docs=d[:, index] if docs else None), 32
        rule = dense_mask(span, window, "cpu", torch.float32)[0, 0] == 0
    q = torch.randn(1, 4, Tq, 8, generator=g)
    k, v = (torch.randn(1, 2, 64, 8, generator=g) for _ in "kv")
    blocks = block_mask(span, window, Tq, 64, "cpu")
    i, j = torch.arange(Tq)[:, None], torch.arange(64)[None, :]
    assert torch.equal(blocks.mask_mod(torch.tensor(0), torch.tensor(0), i, j), rule)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=rule, enable_gqa=True)
    if order == "plain":  # what the CPU runs there
        assert torch.equal(sliding_window(q, k, v, window), dense)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager reference warns that it is one
        flex = flex_attention(q, k, v, block_mask=blocks, enable_gqa=True)
    assert torch.allclose(flex, dense, rtol=0, atol=1e-5)  # float32 sums in two orders


@pytest.mark.parametrize("rank", [0, 3, 6])
def test_cp_and_ep_groups_are_the_layouts_coordinates(rank):
    """--cp 2 --ep 2 --tp 2 on 8 workers (mesh pp, edp, ep, cp, tp): the cp group is the ranks
    of this rank's dp index, the ep group those of its cp index and edp, the experts' group
    (edp_cp) those holding its experts, the parameters' group (dp_cp) every rank of its tp
    index; each as Layout.coords places the ranks (data sharding, seeds and the planner read
    those). On fake ranks: the groups' members, not their traffic."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from raytrain_lm.config.layout import Layout
    from raytrain_lm.parallel.mesh import build_mesh, dim_mesh

    cfg = build_config(preset="moe-tiny", flags=dict(workers=8, cp=2, ep=2, tp=2, strategy="fsdp"))
    layout = Layout.of(cfg)
    assert layout.mesh_shape == {"pp": 1, "edp": 1, "ep": 2, "cp": 2, "tp": 2}
    c = [layout.coords(r) for r in range(8)]
    me = c[rank]
    expected = {
        "cp": [r for r in range(8) if (c[r].dp, c[r].tp) == (me.dp, me.tp)],
        "ep": [r for r in range(8) if (c[r].cp, c[r].tp, c[r].dp // 2) == (me.cp, me.tp, me.dp // 2)],
        "edp_cp": [r for r in range(8) if (c[r].tp, c[r].dp % 2) == (me.tp, me.dp % 2)],
        "dp_cp": [r for r in range(8) if c[r].tp == me.tp],
        "tp": [r for r in range(8) if (c[r].dp, c[r].cp) == (me.dp, me.cp)],
    }
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    try:
        mesh = build_mesh(torch.device("cpu"), layout)
        got = {dim: sorted(dist.get_process_group_ranks(dim_mesh(mesh, dim).get_group())) for dim in expected}
    finally:
        dist.destroy_process_group()
    assert got == expected
    assert len(expected["ep"]) == len(expected["cp"]) == 2 and len(expected["edp_cp"]) == 2


def _cp_grads(rank, world, store, out, ring, window, docs):
    """One cp rank (forked: the modules are imported already): its chunks' loss and gradients,
    averaged over the cp ranks as data parallelism does, saved by rank 0."""
    import torch.distributed as dist

    from raytrain_lm.models.attention import using
    from raytrain_lm.parallel.cp import ContextParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model = small_model("llama", window, param="mup")
    x, y, _ = packed_window([13, 27, 24])
    x, y, span = ContextParallel(world, rank, dist.group.WORLD, SEP if docs else None, ring=ring).shard(x, y)
    with using(span):
        loss = model(x, y)[1]
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    for t in [loss.detach(), *grads.values()]:
        dist.all_reduce(t)
        t /= world
    if rank == 0:
        torch.save((loss.detach(), grads), out)
    dist.destroy_process_group()


@pytest.mark.slow  # 2 or 4 forked gloo ranks: seconds, not the harness's minutes
@pytest.mark.parametrize("ring,cp,window,docs", [(True, 2, 11, True), (True, 4, None, False),
                                                 (True, 4, 11, True), (False, 2, 11, True)])
def test_ring_and_gather_give_one_processs_loss_and_gradients(tmp_path, ring, cp, window, docs):
    """The Llama (GQA, rotary, muP's attention scale) on a packed window split over cp gloo
    ranks, K/V passed around the ring (parallel/ring.py: blocks merged by their log-sum-exps,
    a flash-style backward whose K/V gradients travel back to their owner) or all-gathered:
    the loss and every parameter's gradient are one process's on the whole window, with
    documents and a sliding window. In float64, so the two differ only by the order of sums
    (the ring adds a row's keys block by block): 1e-10 of each tensor's largest entry."""
    import torch.multiprocessing as mp

    from raytrain_lm.models.attention import using

    mp.start_processes(_cp_grads, args=(cp, tmp_path / "store", tmp_path / "grads.pt", ring, window, docs),
                       nprocs=cp, start_method="fork")
    loss, grads = torch.load(tmp_path / "grads.pt")
    model = small_model("llama", window, param="mup")
    x, y, _ = packed_window([13, 27, 24])
    with using(doc_span(x)) if docs else contextlib.nullcontext():
        expected = model(x, y)[1]
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-10 * p.grad.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")
