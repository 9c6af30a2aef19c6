"""The planner against published runs (raytrain_lm/plan/published_runs.json): docs/planner.md's
tables are what the planner says today (the whole validation: ~6 s of planning, in the slow tier:
it is the document's tables, which nothing cheaper checks); the split and the fitted constants
keep their rules; the published figures convert as their sources define them."""

import json
from pathlib import Path

import pytest

from raytrain_lm.plan import calibration
from raytrain_lm.plan.frameworks import FRAMEWORKS
from raytrain_lm.plan.kinds import kinds
from raytrain_lm.plan.validation import (
    fit_runs,
    load_runs,
    markdown,
    megatron_flops_per_token,
    modelled,
    not_modelled_markdown,
    published_tokens_per_s,
    run_model,
    summary,
    summary_text,
    validate,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "planner.md"


@pytest.mark.slow  # 6-15 s of planning on 2 cores
def test_the_docs_validation_tables_are_the_planners():
    rows = validate()
    doc = DOC.read_text()
    for table in (markdown(rows, "fit"), markdown(rows, "held-out"), not_modelled_markdown(rows)):
        assert table in doc, "docs/planner.md's tables differ: rerun bench/planner_validation.py"
    for split in ("fit", "held-out"):
        assert summary_text(summary([r for r in rows if r.run["split"] == split])) in doc


def test_every_row_names_its_source_split_kind_and_framework():
    runs = load_runs()
    assert len(runs) >= 40 and sum(map(modelled, runs)) >= 40
    for run in runs:
        assert run["source"] and run["split"] in ("fit", "held-out") and run["date"]
        assert run["gpu"] in kinds() and run["framework"] in FRAMEWORKS
        assert (FRAMEWORKS[run["framework"]].not_modelled is None) or not modelled(run)
    assert len({r["name"] for r in runs}) == len(runs)


def test_the_split_follows_its_rule_and_the_constants_name_fit_rows_only():
    """The rule of published_runs.json: per GPU variant the source with the most modelled rows is
    the fit set. Every fitted constant names rows, and only fit rows (f_half is pinned by a
    figure outside the table)."""
    runs = [r for r in load_runs() if FRAMEWORKS[r["framework"]].efficiency == "eta"]
    by_name = {r["name"]: r for r in load_runs()}
    fit = [r for r in runs if r["split"] == "fit" and modelled(r)]
    assert {r["gpu"] for r in fit} == {"a100-80gb", "h100-sxm", "h100-sxm-96gb-500w"}
    variant = {"a100-40gb": "a100-80gb"}  # one chip at one power: one variant
    for gpu in {r["gpu"] for r in fit}:
        sources = {}
        for r in runs:
            if modelled(r) and variant.get(r["gpu"], r["gpu"]) == gpu:
                key = r["source"].split(",")[0].split(" (")[0]
                sources[key] = sources.get(key, 0) + 1
        fit_sources = {r["source"].split(",")[0].split(" (")[0] for r in fit if r["gpu"] == gpu}
        assert len(fit_sources) == 1 and sources[fit_sources.pop()] == max(sources.values())
    for name, c in calibration.constants().items():
        assert c["rows"], name
        if name != "f_half":
            assert all(by_name[row]["split"] == "fit" and modelled(by_name[row]) for row in c["rows"]), name
    capped = {r["name"] for r in fit if r["gpu"] == "h100-sxm-96gb-500w"}
    assert set(calibration.constants()["clock_factor:h100-sxm-96gb-500w"]["rows"]) == capped
    assert set(calibration.constants()["eta"]["rows"]) == {r["name"] for r in fit} - capped
    for name, c in calibration.constants().items():  # each constant: the rows its fit reads
        if not c.get("pinned"):
            assert c["rows"] == [r["name"] for r in fit_runs(load_runs(), name)], name


def test_a_fit_reads_only_in_sample_rows():
    """fit_runs (what bench/planner_validation.py --fit fits each constant on) takes a row of the
    constant's group only while it is in-sample: the same row held out, or every row held out,
    leaves it out; each generation's efficiency reads its own frameworks' rows; and every
    held-out row says when it was frozen."""
    runs = load_runs()
    nemotron = next(r for r in runs if r["framework"] == "megatron-core-2024")
    assert [r["name"] for r in fit_runs(runs, "eta:2024")] == [nemotron["name"]]
    held = dict(nemotron, name="the same run, held out", split="held-out")
    assert held not in fit_runs(runs + [held], "eta:2024")
    assert fit_runs([dict(r, split="held-out") for r in runs], "eta:2024") == []
    assert all(FRAMEWORKS[r["framework"]].efficiency == "eta" for r in fit_runs(runs, "eta"))
    llama3 = [r for r in runs if r["framework"] == "meta-llama3" and modelled(r)]
    assert llama3 and all(r["split"] == "held-out" for r in llama3)
    assert all(r["frozen"] <= "2026-12-07" for r in runs if r["split"] == "held-out")


def test_published_figures_convert_as_their_sources_define_them():
    """Megatron's 96 l h^2 (1 + s/6h + V/16lh) for MT-NLG: 126 TFLOP/s at 29.3 tokens/s per GPU
    (1920 x 2048 tokens in their 60.1 s steps over 2240 GPUs); BLOOM's logged 104.70 s per
    iteration of 2048 x 2048 tokens on 384 GPUs; Llama 3's 430 TFLOP/s by the PaLM count."""
    runs = {r["name"]: r for r in load_runs()}
    mt = runs["MT-NLG 530B"]
    assert abs(126e12 / megatron_flops_per_token(run_model(mt), 2048) - 1920 * 2048 / 60.1 / 2240) < 0.2
    bloom = runs["BLOOM 176B"]
    assert published_tokens_per_s(bloom, run_model(bloom)) == pytest.approx(2048 * 2048 / 104.70 / 384)
    llama = runs["Llama 3 405B, 8192 H100"]
    m = run_model(llama)
    n = 6 * 405.85e9 + 12 * 126 * 16384 * 8192  # 6N + 12 L h s, N within 0.6% of the planner's count
    assert published_tokens_per_s(llama, m) == pytest.approx(430e12 / n, rel=0.01)


def test_calibration_file_is_what_the_fit_wrote():
    data = json.loads(calibration.PATH.read_text())
    assert data.get("fitted_by") == "bench/planner_validation.py --fit"
    for c in data["constants"].values():
        assert {"label", "value", "rows", "what"} <= set(c)
