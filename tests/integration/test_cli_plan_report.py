"""``plan``'s report agrees with itself: the inputs it shows are the ones it ran, and one day
has one no-caching provider bill."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from prefixroute.core.economics.planner import DEFAULT_CANDIDATES
from tests.integration.test_cli_plan import SMALL

# Without --policy: the planner's own candidates, which the report must name.
NO_POLICIES = [a for i, a in enumerate(SMALL) if a != "--policy" and SMALL[i - 1] != "--policy"]


@pytest.mark.slow
def test_plan_md_shows_the_policies_it_simulated_and_one_no_caching_bill(tmp_path):
    out = tmp_path / "plan"
    result = subprocess.run([sys.executable, "-m", "prefixroute", "plan", "--out", str(out),
                             *NO_POLICIES], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    markdown = (out / "plan.md").read_text()
    inputs = json.loads(markdown.split("## Inputs", 1)[1].split("```json", 1)[1]
                        .split("```", 1)[0])
    assert len(inputs["policies"]) >= 5
    assert inputs["policies"] == [p for p in DEFAULT_CANDIDATES if p in inputs["policies"]]

    plan = json.loads((out / "plan.json").read_text())
    no_cache = plan["cost_per_day"]["provider"]["no_cache_usd_per_day"]
    for layout in plan["provider_accounting"]["layouts"].values():
        for replay in layout["policies"].values():
            assert replay["no_cache_usd_per_day"] == no_cache
            assert abs(replay["usd_per_day"] - replay["input_multiplier"] * no_cache) < 1e-6
    # Every "no caching" dollar figure in the text is that one.
    section_7 = markdown.split("## 7.", 1)[1].split("## 8.", 1)[0]
    section_8 = markdown.split("## 8.", 1)[1].split("## Inputs", 1)[0]
    stated = f"${no_cache:,.2f}"
    assert stated in section_7
    assert re.search(r"\| provider USD \| " + re.escape(stated) + r" \|", section_8)
    assert "uncached USD/day" not in section_7
