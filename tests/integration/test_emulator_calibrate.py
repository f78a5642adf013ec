"""``prefixroute calibrate`` against the emulator running a known profile gets the profile back
(each term on its own scale: wall-clock measurements on a shared machine), and writes a file
the emulator and the simulator load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefixroute.core.replica.service_time import profile_from_dict
from prefixroute.edges.emulator.process import EmulatorProcess

TRUE = {"step_overhead_s": 0.01, "prefill_s_per_token": 1e-4,
        "attention_s_per_token_context": 2e-8, "decode_s_per_seq": 2e-3,
        "decode_s_per_context_token": 1e-6, "request_overhead_s": 0.02}


@pytest.mark.slow
def test_calibrating_the_emulator_recovers_its_profile(tmp_path):
    truth = tmp_path / "truth.json"
    truth.write_text(json.dumps({"base": "instant", "name": "truth", **TRUE}))
    out = tmp_path / "fitted.json"
    with EmulatorProcess(["--block-size", "16", "--num-blocks", "600",
                          "--profile", str(truth)]) as replica:
        result = subprocess.run(
            [sys.executable, "-m", "prefixroute", "calibrate", "--backend", replica.url,
             "--out", str(out), "--max-prompt-tokens", "2000", "--repeats", "3"],
            capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        fitted = profile_from_dict(json.loads(out.read_text()))
        # Wall-clock measurements: on an idle machine each term comes back within 15-30 %;
        # beside two CPU hogs the prefill term came back 22 % high. The bands below only
        # assert each term lands on its own term's scale (the terms are 10x to 1000x apart,
        # so a swapped or lost term still fails); the exact recovery is specified on exact
        # timings in tests/unit/test_emulator_calibration.py.
        assert 0.5 * 0.01 <= fitted.step_overhead_s <= 2 * 0.01
        assert 0.5 * 1e-4 <= fitted.prefill_s_per_token <= 2 * 1e-4
        assert 0.5 * 2e-3 <= fitted.decode_s_per_seq <= 2 * 2e-3
        assert fitted.decode_s_per_context_token <= 3 * 1e-6
        # The emulator delays each request's entry by 20 ms; calibrate measures it (plus the
        # HTTP round trip, about 4 ms when idle) as the request overhead, not as step time.
        assert 0.016 <= fitted.request_overhead_s <= 0.1
        assert "against" in fitted.source
        # Only timings were probed: the output says the KV size is not the engine's.
        assert "only timings are measured" in result.stderr
        # The emulator itself loads the file.
        with EmulatorProcess(["--num-blocks", "64", "--profile", str(out)]):
            pass


def test_a_backend_that_is_not_there_is_a_clean_error():
    result = subprocess.run([sys.executable, "-m", "prefixroute", "calibrate", "--backend",
                             "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "cannot list models" in result.stderr and "Traceback" not in result.stderr
