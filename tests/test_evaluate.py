"""`evaluate`: lm-evaluation-harness's `hf` model on an export made on the fly, offline, on two
tasks this test writes in the harness's YAML format over local JSONL (a perplexity task and a
multiple-choice one); each score is checked against the same score computed here directly from
our model's logits. The results land next to the run (eval/<task>.json, summary.json and its
table) and in its MLflow run."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from conftest import cli_here

pytestmark = pytest.mark.slow  # a model trained here, lm-eval's imports and run: ~25 s

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be fetched from a hub
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

TEXTS = ["The assert statement is a convenient way to insert debugging assertions.",
         "A class definition defines a class object.",
         "for x in range(10):\n    print(x)"]  # no trailing newline: Jinja drops one
QUESTIONS = [("Keyword that defines a function in Python:", ["def", "zebra"], 0),
             ("The value of a comparison is True or", ["purple", "False"], 1),
             ("To leave a loop early, use", ["break", "banana"], 0),
             ("A sequence of characters is a", ["strange", "string"], 1)]


PPL_METRICS = "".join(f"  - {{metric: {m}, aggregation: {a}, higher_is_better: false}}\n" for m, a in
                      (("word_perplexity", "weighted_perplexity"), ("byte_perplexity", "weighted_perplexity"),
                       ("bits_per_byte", "bits_per_byte")))
MC_METRICS = "".join(f"  - {{metric: {m}, aggregation: mean, higher_is_better: true}}\n" for m in ("acc", "acc_norm"))


def write_tasks(folder):
    """Two tasks in lm-eval's YAML format, their data in local JSONL files."""
    folder.mkdir()
    (folder / "ppl.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (folder / "mc.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "gold": g}) + "\n"
                                             for q, c, g in QUESTIONS))
    for task, data, kind in (("local_ppl", "ppl.jsonl", "loglikelihood_rolling"),
                             ("local_mc", "mc.jsonl", "multiple_choice")):
        docs = ("doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n" + PPL_METRICS
                if kind == "loglikelihood_rolling" else
                "doc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{gold}}'\n"
                "metric_list:\n" + MC_METRICS)
        (folder / f"{task}.yaml").write_text(
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / data}\n"
            f"test_split: test\noutput_type: {kind}\n{docs}metadata:\n  version: 1.0\n")


def log_probs(run, ids: list[int]) -> torch.Tensor:
    """log p(ids[t+1] | ids[:t+1]) for every t, from our model's logits over the tokenizer's
    tokens (the model's vocabulary is padded to a multiple of 64; the rows past the tokenizer's
    are not tokens, and the export leaves them out)."""
    idx = torch.tensor([[int(i) for i in ids]])
    with torch.no_grad():
        logits, _ = run.model(idx[:, :-1], targets=idx[:, 1:])  # every position's logits
    logits = logits[0, :, :run.tok.vocab_size].double()
    return torch.log_softmax(logits, -1).gather(1, idx[0, 1:, None])[:, 0]


def expected_scores(run) -> dict:
    """The tasks' scores, from our model (not the export): bits per byte of each text after the
    end-of-text token (the harness's rolling loglikelihood of a short document), and the share
    of questions whose right choice is the likeliest continuation (acc) and the likeliest per
    character (acc_norm); a choice continues the question after a space (the harness's target
    delimiter), its tokens split from the context's as the harness splits them."""
    enc = lambda text: [int(i) for i in run.tok.encode(text)]  # noqa: E731
    # before each text: the end-of-text token, or where the tokenizer has none (bytes) the last
    # token of the "\n\n" its datasets put between documents
    first = run.tok.eot_id if run.tok.eot_id is not None else enc("\n\n")[-1]
    ll = sum(log_probs(run, [first, *enc(t)]).sum().item() for t in TEXTS)
    nbytes = sum(len(t.encode()) for t in TEXTS)
    acc = acc_norm = 0
    for question, choices, gold in QUESTIONS:
        scores = []
        for choice in choices:
            context, whole = enc(question), enc(question + " " + choice)
            scores.append(log_probs(run, whole)[len(context) - 1:].sum().item())
        acc += max(range(len(choices)), key=lambda i: scores[i]) == gold
        acc_norm += max(range(len(choices)), key=lambda i: scores[i] / len(choices[i])) == gold
    bpb = -ll / nbytes / math.log(2)
    return {"local_ppl": {"bits_per_byte": bpb, "byte_perplexity": 2 ** bpb},
            "local_mc": {"acc": acc / len(QUESTIONS), "acc_norm": acc_norm / len(QUESTIONS)}}


@pytest.fixture(scope="module")
def evaluated(trained_here, tmp_path_factory):
    """The BPE model's checkpoint as a finished run (summary.json, an MLflow run made by the
    driver's tracking code), evaluated through the command line."""
    from mlflow import MlflowClient

    from raytrain_lm.track import Tracking

    root = tmp_path_factory.mktemp("evaluate")
    run = trained_here["bpe"]
    folder = root / "runs" / "r"
    shutil.copytree(run.ckpt, folder / f"checkpoint_{run.steps:08d}")
    (folder / "summary.json").write_text(json.dumps({"status": "completed", "name": "r", "steps": run.steps}))
    env = {"MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    with pytest.MonkeyPatch.context() as patch:
        for k, v in env.items():
            patch.setenv(k, v)
        Tracking(["mlflow"], "r", {}, on_records=lambda records: (folder / "tracking.json").write_text(
            json.dumps(records))).close("completed")
    write_tasks(root / "tasks")
    res = cli_here("evaluate", "r", "--storage", str(root / "runs"), "--tasks", "local_ppl,local_mc",
                   "--include-path", str(root / "tasks"), "--json", env=env)
    assert res.returncode == 0, res.stderr
    record = json.loads((folder / "tracking.json").read_text())["mlflow"]
    mlflow_run = MlflowClient(env["MLFLOW_TRACKING_URI"]).get_run(record["run_id"])
    return run, folder, json.loads(res.stdout), mlflow_run


def test_scores_equal_the_ones_from_our_models_logits(evaluated):
    run, _, out, _ = evaluated
    expected = expected_scores(run)
    assert out["step"] == run.steps
    for metric in ("bits_per_byte", "byte_perplexity"):
        assert out["scores"]["local_ppl"][metric] == pytest.approx(expected["local_ppl"][metric], rel=1e-5)
    assert out["scores"]["local_mc"]["acc"] == expected["local_mc"]["acc"]
    assert out["scores"]["local_mc"]["acc_norm"] == expected["local_mc"]["acc_norm"]


def test_results_go_next_to_the_run_its_table_and_its_tracking_run(evaluated):
    from raytrain_lm.results.tables import results_table

    _, folder, out, mlflow_run = evaluated
    for task in ("local_ppl", "local_mc"):
        kept = json.loads((folder / "eval" / f"{task}.json").read_text())
        assert kept["scores"] == out["scores"][task] and kept["step"] == out["step"]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["eval"]["local_mc"]["acc"] == out["scores"]["local_mc"]["acc"]
    table = results_table(summary)
    assert ["local_ppl", "bits_per_byte", f"{out['scores']['local_ppl']['bits_per_byte']:.4f}", "(step",
            f"{out['step']})"] in [line.split() for line in table.splitlines()]
    assert mlflow_run.data.metrics["summary/eval/local_mc/acc"] == out["scores"]["local_mc"]["acc"]
    assert mlflow_run.info.status == "FINISHED"


def test_a_byte_run_is_scored_with_the_separator_before_each_text(trained_here, tmp_path):
    """The byte tokenizer has no bos or eos, which lm-eval puts before a text scored from its
    start (it failed decoding None: "'None' is not an instance of 'Sequence'" for every task);
    evaluate gives it the token the model saw before every document, the last of "\n\n"."""
    run = trained_here["byte"]
    write_tasks(tmp_path / "tasks")
    res = cli_here("evaluate", str(run.ckpt), "--tasks", "local_ppl,local_mc", "--include-path",
                   str(tmp_path / "tasks"), "--json", "--storage", str(tmp_path / "runs"))
    assert res.returncode == 0, res.stderr
    out, expected = json.loads(res.stdout), expected_scores(run)
    assert out["scores"]["local_ppl"]["bits_per_byte"] == pytest.approx(
        expected["local_ppl"]["bits_per_byte"], rel=1e-5)
    assert out["scores"]["local_mc"]["acc"] == expected["local_mc"]["acc"]
