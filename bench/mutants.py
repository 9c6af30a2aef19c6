"""Planted bugs: does the test named for each one catch it?

Each mutant is a realistic one-line change to the code, the kind a review once planted to find a
weak test (issue 38), with the tests that must fail when it is there. The script copies the
tracked files into a temporary folder (the working tree is never touched), runs the named tests
there once as they are (they must pass: a test that fails already catches nothing), then applies
each mutant alone, runs its tests, and reports which survive. A survivor is a weak test: make the
test fail on it, then keep the mutant here so that the next weakening is found by this command,
not by a review.

    python bench/mutants.py                 # all of them (the slow ones take minutes each)
    python bench/mutants.py --fast          # those whose tests are in the fast tier
    python bench/mutants.py --only accum-divisor,tied-head
    python bench/mutants.py --list

Not part of the test suite's time (it runs each test once more per mutant); a fast test
(tests/test_bench.py) checks that every mutant still applies to the tree (its line is there,
once) and that its tests exist. Exit code 1 when a mutant survives.
"""

from __future__ import annotations

import argparse
import ast
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str  # the file, from the repository's root
    line: str  # the line as it is (stripped of its indentation; exactly one in the file)
    becomes: str  # the line with the bug (the same indentation)
    tests: tuple[str, ...]  # pytest node ids (a `-k` expression after a space: "FILE -k EXPR")
    why: str
    slow: bool = False  # its tests are in the slow tier (the local harness: minutes)


BAD = "tests/test_bad_inputs.py::test_a_bad_input_is_one_line_exit_2_and_changes_nothing"

MUTANTS = [
    Mutant("accum-divisor", "raytrain_lm/worker/step.py",
           "self.scaler.scale(loss / accum).backward()", "self.scaler.scale(loss).backward()",
           ("tests/test_step.py::test_accumulation_gives_the_whole_batchs_gradient_norm_and_update",),
           "gradient accumulation that forgets to divide by the micro-batches (AdamW hides it "
           "in the losses)"),
    Mutant("accum-divisor-ranks", "raytrain_lm/worker/step.py",
           "self.scaler.scale(loss / accum).backward()", "self.scaler.scale(loss).backward()",
           ("tests/test_step_variants.py::test_gradient_accumulation_gives_the_losses_of_the_whole_batch",),
           "the same, on 2 DDP ranks with no_sync", slow=True),
    Mutant("tied-head", "raytrain_lm/models/llama/hf_llama.py",
           'return "model.embed_tokens.weight"  # tied: the head is the embedding', "pass",
           ("tests/test_llama.py::test_a_tied_hf_llama_gives_transformers_logits",),
           "a tied Hugging Face Llama (no lm_head.weight) loaded without its head"),
    Mutant("norm-over-replicas", "raytrain_lm/parallel/grad.py",
           "if pl.is_shard() or isinstance(pl, _StridedShard))", "if not pl.is_partial())",
           ("tests/test_grad_clip.py::test_the_global_norm_and_the_clip_over_tp_fsdp_and_pp_ranks",),
           "the gradient norm sums a replicated weight's squares over the ranks that copy it"),
    Mutant("norm-tied-twice", "raytrain_lm/parallel/grad.py",
           "if p.grad is None or id(p) in exclude:", "if p.grad is None:",
           ("tests/test_grad_clip.py::test_the_global_norm_and_the_clip_over_tp_fsdp_and_pp_ranks",),
           "the pipeline's duplicate of the tied embedding counted in the norm"),
    Mutant("pp-unscaled", "raytrain_lm/parallel/pp.py",
           "return cls(pstages[0], layout.microbatches, loss_fn=loss_fn, scale_grads=True)",
           "return cls(pstages[0], layout.microbatches, loss_fn=loss_fn, scale_grads=False)",
           ("tests/test_parallel_layouts.py::test_every_layout_trains_the_one_worker_model -k gpt-pp2-1f1b",),
           "a pipeline that does not divide its gradients by the microbatches", slow=True),
    Mutant("record-outside", "raytrain_lm/store/commit.py",
           "path = untrusted.inside(folder, rel, str(record_path))", "path = folder / rel",
           (f"{BAD} -k checkpoint-record",),
           "a checkpoint's commit record naming a file outside the checkpoint"),
    Mutant("dcp-outside", "raytrain_lm/store/checkpoint_format.py",
           'if not isinstance(info, _StorageInfo) or not isinstance(name, str) or "/" in name:',
           "if not isinstance(info, _StorageInfo) or not isinstance(name, str):",
           (f"{BAD} -k checkpoint-dcp-outside",),
           "dcp/.metadata sending a read outside dcp/"),
    Mutant("meta-trusted", "raytrain_lm/store/commit.py",
           "problem = check_meta(meta)", 'problem = "" if isinstance(meta, dict) else "not a JSON object"',
           (f"{BAD} -k checkpoint-meta",),
           "meta.json's fields used unchecked"),
    Mutant("state-not-meta", "raytrain_lm/store/checkpoint_format.py",
           'if key in meta and state.get(key) != meta[key]:', "if False:",
           (f"{BAD} -k checkpoint-meta-step-other",),
           "state.pt saying another step (config, tokenizer) than the checked meta.json"),
    Mutant("hf-weights-unchecked", "raytrain_lm/run/preflight.py",
           "check_tensors(folder, shapes, optional, adapter.IGNORED_SUFFIXES, where)", "pass",
           (f"{BAD} -k hf-weight",),
           "a Hugging Face folder's weights not checked against its config before launch"),
    Mutant("hf-config-unchecked", "raytrain_lm/models/llama/hf_llama.py",
           'heads = config_value(c, "num_attention_heads", "count", where)',
           'heads = c["num_attention_heads"]',
           (f"{BAD} -k hf-heads",),
           "config.json's head count trusted (zero, missing, text)"),
    Mutant("yaml-aliases", "raytrain_lm/config/load.py",
           "return yaml.load(text, Loader=NoAliases)", "return yaml.safe_load(text)",
           (f"{BAD} -k alias-bomb",),
           "a YAML alias bomb let through (refused then by its value's type, in another line)"),
    Mutant("whole-value-in-message", "raytrain_lm/config/settings.py",
           'raise UserError(f"{source}: {key} must be {tp.__name__}, got {brief(value)}")',
           'raise UserError(f"{source}: {key} must be {tp.__name__}, got {value!r}")',
           ("tests/test_config.py::test_a_refused_value_is_shown_by_its_start",),
           "a refused value printed whole"),
    Mutant("report-overwrites", "raytrain_lm/results/figure_file.py",
           "if not is_report_figure(path):", "if False:",
           (f"{BAD} -k notes-and-run",),
           "report --out replacing a file it did not write"),
    Mutant("config-symlink", "raytrain_lm/cluster/jobs.py",
           "if step.is_symlink():", "if False:",
           ("tests/test_cluster_config.py::test_a_config_outside_the_folder_cannot_go_with_the_job",),
           "submit uploading what a --config symlink points to"),
    Mutant("dictionary-text", "raytrain_lm/data/sources.py",
           "kind = kind.value_type", "pass",
           ("tests/test_data.py::test_prepare_a_dictionary_encoded_text_column",),
           "a dictionary-encoded text column refused"),
    # issue 48's review: bugs that passed every test reaching their code, or only one or a slow one
    Mutant("moe-aux-per-layer", "raytrain_lm/models/moe/moe.py",
           "self.aux_weight, self.z_weight = cfg.aux_loss_coef / cfg.n_layer, cfg.z_loss_coef / cfg.n_layer",
           "self.aux_weight, self.z_weight = cfg.aux_loss_coef, cfg.z_loss_coef / cfg.n_layer",
           ("tests/test_moe.py::test_the_aux_losses_trained_on_are_the_coefficients_times_their_mean_over_layers",),
           "the balance loss weighted by aux_loss_coef in every layer, not by its n_layer-th part"),
    Mutant("torchrun-local-rank", "raytrain_lm/run/in_process.py",
           "return rank, world, local_world",
           "return local, world, local_world",
           ("tests/test_env.py::test_under_torchrun_a_process_is_its_global_rank_not_its_local_one",),
           "under torchrun, LOCAL_RANK taken as the rank (a second node's first process is a rank 0)"),
    Mutant("epoch-end-on-resume", "raytrain_lm/data/sampler.py",
           "if self.consumed + self.plan.global_batch > self.num_windows:  # the epoch is spent",
           "if self.consumed + self.plan.global_batch >= self.num_windows:  # the epoch is spent",
           ("tests/test_data.py::test_a_stream_resumed_at_any_step_of_an_epoch_reads_what_it_would_have",),
           "a run resumed with exactly one step left in its epoch skips that step's data"),
    Mutant("qwen2-kv-bias-export", "raytrain_lm/models/qwen2/hf_qwen2.py",
           'for i in range(m.n_layer) for p in "qkv"}', 'for i in range(m.n_layer) for p in "q"}',
           ("tests/test_families.py::test_a_qwen2_without_biases_writes_every_q_k_v_bias_as_zeros",),
           "a qwen2 without biases exported without its zero k/v biases (transformers fills them)"),
    Mutant("ep-inverse-permutation", "raytrain_lm/parallel/ep.py",
           "y = torch.zeros_like(y).index_copy(0, order, y)  # back to rank-major", "pass",
           ("tests/test_moe.py::test_expert_parallelism_gives_every_gradient_of_one_process",),
           "expert parallelism's outputs sent back in expert-major order, not to their tokens",
           slow=True),
    Mutant("ep-grad-scale", "raytrain_lm/parallel/ep.py",
           "y = _GradScale.apply(experts(_GradScale.apply(x[order], P), mine, host_mine), 1.0 / P)",
           "y = experts(x[order], mine, host_mine)",
           ("tests/test_moe.py::test_expert_parallelism_gives_every_gradient_of_one_process",),
           "expert parallelism's experts' gradients not divided by ep (nor their inputs' multiplied)",
           slow=True),
    Mutant("plan-unbounded", "raytrain_lm/config/checks.py",
           "if value > most:  # (too small: the family's rules say what each may be)", "if False:",
           (f"{BAD} -k 1e30",),
           "model sizes past any cluster let through"),
    Mutant("moe-cp-window-shares", "raytrain_lm/parallel/__init__.py",
           "layer.window_sum = self.context.window_sum", "pass",
           ("tests/test_moe_parallel.py::test_every_ep_layout_trains_the_one_worker_model -k cp2",),
           "under context parallelism the balance loss's expert shares are a rank's part of each "
           "window, not the whole window's", slow=True),
    Mutant("ring-kv-grads-not-passed", "raytrain_lm/parallel/ring.py",
           "dkv, dreqs = _pass_on(sent, group, GRAD_TAG)", "dreqs = []",
           ("tests/test_context_parallel.py::test_ring_and_gather_give_one_processs_loss_and_gradients",),
           "ring attention's K/V gradients left where they were computed, not sent on to their owner",
           slow=True),
]


def node_parts(test: str) -> tuple[str, str, str]:
    """'FILE::FUNC -k EXPR' -> (FILE, FUNC, EXPR)."""
    node, _, expr = test.partition(" -k ")
    path, _, func = node.partition("::")
    return path, func, expr


def check_applies(mutant: Mutant, root: Path = ROOT) -> list[str]:
    """What keeps `mutant` from applying to the tree at `root` (empty: it applies): its line
    there exactly once, each named test a function of its file."""
    problems = []
    source = root / mutant.path
    if not source.is_file():
        return [f"{mutant.name}: no file {mutant.path}"]
    found = [line for line in source.read_text().splitlines() if line.strip() == mutant.line]
    if len(found) != 1:
        problems.append(f"{mutant.name}: {mutant.path} holds its line {len(found)} times, not once")
    for test in mutant.tests:
        path, func, _ = node_parts(test)
        tree = ast.parse((root / path).read_text()) if (root / path).is_file() else None
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)} if tree else set()
        if func not in names:
            problems.append(f"{mutant.name}: no test {path}::{func}")
    return problems


def apply(mutant: Mutant, root: Path) -> str:
    """Write the mutant into the tree at `root`; returns the file's text before, to restore."""
    source = root / mutant.path
    text = source.read_text()
    lines = text.splitlines(keepends=True)
    [i] = [i for i, line in enumerate(lines) if line.strip() == mutant.line]
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = indent + mutant.becomes + "\n"
    source.write_text("".join(lines))
    return text


def run_tests(tests: tuple[str, ...], root: Path, timeout: float) -> tuple[int, float, str]:
    """pytest on `tests` in the tree at `root`, in one process each (-n 0): the plain node ids in
    one run, each `-k` selection in its own (pytest keeps one -k). (The first failing run's exit
    code, else 0; seconds in all; the last lines of its output.) 124: a run past `timeout`."""
    plain = [t for t in tests if not node_parts(t)[2]]
    runs = ([plain] if plain else []) + [[t] for t in tests if node_parts(t)[2]]
    total, code, tail = 0.0, 0, ""
    for selection in runs:
        args = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-x", "-p", "no:cacheprovider",
                "-o", "addopts="]
        for test in selection:
            path, func, expr = node_parts(test)
            args += [f"{path}::{func}"] + (["-k", expr] if expr else [])
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        t0 = time.monotonic()
        try:
            r = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
            returncode, out = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired:
            returncode, out = 124, "timed out"
        total += time.monotonic() - t0
        if returncode != 0 and code == 0:
            code, tail = returncode, "\n".join(out.strip().splitlines()[-3:])
    return code, total, tail


def copy_tree(dest: Path) -> None:
    """The tracked files (and untracked ones git does not ignore) of the repository, as they are."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for rel in filter(None, (p.decode() for p in listed)):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated mutant names")
    parser.add_argument("--fast", action="store_true", help="only mutants whose tests are fast")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "mutants.json"))
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if (not args.only or m.name in args.only.split(","))
              and not (args.fast and m.slow)]
    if args.list:
        for m in chosen:
            print(f"{m.name:24} {m.path}: {m.why}\n{'':24} caught by {', '.join(m.tests)}")
        return 0
    problems = [p for m in chosen for p in check_applies(m)]
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="raytrain-lm-mutants-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        code, seconds, tail = run_tests(tests, root, args.timeout)
        print(f"baseline: {len(tests)} test selections {'pass' if code == 0 else 'FAIL'} ({seconds:.0f} s)",
              flush=True)
        if code != 0:
            print(tail, file=sys.stderr)
            return 2
        for m in chosen:
            before = apply(m, root)
            try:
                code, seconds, tail = run_tests(m.tests, root, args.timeout)
            finally:
                (root / m.path).write_text(before)
            caught = code not in (0, 5)  # 5: no test ran, which catches nothing
            rows.append({"mutant": m.name, "file": m.path, "tests": list(m.tests), "caught": caught,
                         "exit_code": code, "seconds": round(seconds, 1), "why": m.why})
            print(f"{'caught  ' if caught else 'SURVIVED'} {m.name:24} {seconds:6.1f} s  {m.why}",
                  flush=True)
    survivors = [r["mutant"] for r in rows if not r["caught"]]
    print(f"{len(rows) - len(survivors)} of {len(rows)} caught" +
          (f"; survived: {', '.join(survivors)}" if survivors else ""))
    if args.out and not args.only:
        Path(args.out).write_text(json.dumps({
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python", "bench/mutants.py", *sys.argv[1:]]), "mutants": rows},
            indent=2) + "\n")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
