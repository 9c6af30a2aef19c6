"""docs/testing.md lists every claim the suite checks: it names only tests that exist, and every
test function of tests/ is in it (a test added without its claim, or a claim whose test went,
fails here)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLACES = {"Ray", "harness", "neither"}


def listed() -> dict[tuple[str, str], str]:
    """{(file, test function): where it runs} from docs/testing.md's tables."""
    out, file = {}, None
    for line in (ROOT / "docs" / "testing.md").read_text().splitlines():
        if m := re.match(r"## (test_\w+\.py)$", line):
            file = m[1]
        elif file and (m := re.match(r"\| (.+) \| `(test_\w+)` \| (\w+) \|$", line)):
            assert m[3] in PLACES, line
            assert (file, m[2]) not in out, f"{file}::{m[2]} listed twice"
            out[(file, m[2])] = m[3]
    return out


def defined_tests() -> set[tuple[str, str]]:
    found = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found.add((path.name, node.name))
    return found


def test_every_test_has_its_claim_in_docs_testing_md_and_no_other():
    docs, tests = listed(), defined_tests()
    assert sorted(set(docs) - tests) == [], "named in docs/testing.md, but no such test"
    assert sorted(tests - set(docs)) == [], "tests without a line in docs/testing.md"
