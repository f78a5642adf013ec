"""``prefixroute calibrate`` against the emulator running a known profile gets the profile back
(within the HTTP round trip), and writes a file the emulator and the simulator load."""

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
        assert fitted.step_overhead_s == pytest.approx(0.01, rel=0.2)
        assert fitted.prefill_s_per_token == pytest.approx(1e-4, rel=0.15)
        assert fitted.decode_s_per_seq == pytest.approx(2e-3, rel=0.3)
        assert fitted.decode_s_per_context_token == pytest.approx(1e-6, rel=0.3)
        # The emulator delays each request's entry by 20 ms; calibrate measures it (plus the
        # HTTP round trip) as the request overhead, not as step time
        # (about 4 ms here, more on a loaded machine; the median of 3 repeats damps one slow probe).
        assert 0.016 <= fitted.request_overhead_s <= 0.05
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
