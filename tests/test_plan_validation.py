"""The planner against published runs: docs/planner.md's validation table is what the planner
says today, from raytrain_lm/plan/published_runs.json (the whole table: ~9 s, one claim that
nothing cheaper checks; it is the document's table). That test is in the slow tier: it was a
fifth of the fast tier's time."""

from pathlib import Path

import pytest

from raytrain_lm.plan.validation import load_runs, markdown, megatron_flops_per_token, run_model, validate

DOC = Path(__file__).resolve().parents[1] / "docs" / "planner.md"


@pytest.mark.slow  # 9-14 s of planning on 2 cores
def test_the_docs_validation_table_is_the_planners():
    rows = validate()
    assert len(rows) >= 12
    table = markdown(rows)
    assert table in DOC.read_text(), "docs/planner.md's table differs: rerun bench/planner_validation.py"


def test_megatron_flops_formula_by_hand():
    """Megatron's 96 l h^2 (1 + s/6h + V/16lh) for MT-NLG: 126 TFLOP/s at 29.3 tokens/s per GPU
    (1920 x 2048 tokens in their 60.1 s steps over 2240 GPUs)."""
    run = next(r for r in load_runs() if r["name"] == "MT-NLG 530B")
    f = megatron_flops_per_token(run_model(run), 2048)
    assert abs(126e12 / f - 1920 * 2048 / 60.1 / 2240) < 0.2
