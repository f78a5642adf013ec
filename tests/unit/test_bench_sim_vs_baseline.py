"""benchmarks/sim_vs_baseline.py: the baseline that counts chains its block keys."""

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sim_vs_baseline  # noqa: E402


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_the_default_baseline_chains_parent_bar_block():
    tokens = [f"t{i}" for i in range(35)]  # two full blocks of 16, three tokens left over
    first, second = " ".join(tokens[:16]), " ".join(tokens[16:32])
    assert sim_vs_baseline.block_keys(tokens) == [sha("|" + first),
                                                  sha(sha("|" + first) + "|" + second)]


def test_the_footnote_baseline_hashes_each_whole_prefix():
    tokens = [f"t{i}" for i in range(32)]
    assert sim_vs_baseline.block_keys(tokens, chained=False) == [
        sha(" ".join(tokens[:16])), sha(" ".join(tokens))]
