"""Output files and the one ``--json [FILE]`` convention, as a user on a shared machine meets them."""

import json
import os
import stat
import subprocess
import sys


def prefixroute(*args, cwd=None, umask=None):
    def preexec():
        if umask is not None:
            os.umask(umask)
    return subprocess.run([sys.executable, "-m", "prefixroute", *args], capture_output=True,
                          text=True, timeout=180, cwd=cwd, preexec_fn=preexec)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_simulate_and_sweep_files_get_the_umask_permissions_not_private_ones(tmp_path):
    report, plots = tmp_path / "report.json", tmp_path / "plots"
    result = prefixroute("simulate", "--workload", "universal-prefix", "--policy",
                         "round_robin", "--json", str(report), "--plot", str(plots),
                         umask=0o022)
    assert result.returncode == 0, result.stderr
    assert mode(report) == 0o644
    assert {mode(p) for p in plots.iterdir()} == {0o644}
    sweep = tmp_path / "sweep.json"
    result = prefixroute("sweep", "--workload", "universal-prefix", "--policy", "round_robin",
                         "--jobs", "1", "--json", str(sweep), umask=0o027)
    assert result.returncode == 0, result.stderr
    assert mode(sweep) == 0o640


def test_sweep_json_into_a_missing_directory_exits_2_and_creates_nothing(tmp_path):
    target = tmp_path / "missing" / "dir" / "x.json"
    result = prefixroute("sweep", "--workload", "universal-prefix", "--policy", "round_robin",
                         "--jobs", "1", "--json", str(target))
    assert result.returncode == 2
    assert "does not exist" in result.stderr and str(tmp_path / "missing" / "dir") in result.stderr
    assert not (tmp_path / "missing").exists()


def test_json_without_a_file_prints_and_with_a_file_writes_for_every_command(tmp_path):
    printed = prefixroute("repro", "--json")
    assert printed.returncode == 0, printed.stderr
    written = tmp_path / "repro.json"
    result = prefixroute("repro", "--json", str(written))
    assert result.returncode == 0 and result.stdout == ""
    assert json.loads(written.read_text()) == json.loads(printed.stdout)
    result = prefixroute("simulate", "--workload", "universal-prefix", "--policy",
                         "round_robin", "--json")
    assert json.loads(result.stdout)["policies"]["round_robin"]["assignments"] == [10] * 5


def test_old_flag_style_json_before_the_input_still_reads_the_input(tmp_path):
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(list(range(40))))
    result = prefixroute("hash", "--json", str(tokens))
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["block_digests"]) == 2
    assert tokens.read_text() == json.dumps(list(range(40)))  # not overwritten


def test_every_table_column_is_explained_in_help_and_in_docs_metrics():
    from pathlib import Path

    from prefixroute.edges.cli.columns import LINT_COLUMNS, POLICY_COLUMNS
    docs = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for command, columns in (("sweep", POLICY_COLUMNS), ("lint", LINT_COLUMNS)):
        help_text = " ".join(prefixroute(command, "--help").stdout.split())
        for column in columns:
            assert f"| `{column.name}` | `{column.key}` | {column.meaning} |" in docs, column.name
            assert " ".join(column.meaning.split()) in help_text, (command, column.name)


def test_tables_fit_100_columns_and_print_as_markdown_and_csv():
    import csv
    import io
    env_width = {"COLUMNS": "100"}
    result = subprocess.run([sys.executable, "-c", (
        "import sys; from rich.console import Console; "
        "from prefixroute.edges.cli import simulate, main; "
        "simulate.stdout_console = lambda: Console(width=100); "
        "sys.exit(main.main(sys.argv[1:]))"), "simulate", "--workload", "universal-prefix",
        "--policy", "sglang_cache_aware", "--policy", "round_robin"],
        capture_output=True, text=True, timeout=180, env={**os.environ, **env_width})
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if "round_robin" in line
            or "sglang_cache_aware" in line]
    assert len(rows) == 2 and all(len(line.rstrip()) <= 100 for line in result.stdout.splitlines())
    markdown = prefixroute("simulate", "--workload", "universal-prefix", "--policy",
                           "round_robin", "--format", "markdown").stdout
    assert "| round_robin | 72.0% | 90.0% |" in markdown
    table = list(csv.DictReader(io.StringIO(prefixroute(
        "simulate", "--workload", "universal-prefix", "--policy", "round_robin", "--format",
        "csv", "--columns", "policy,token hit,assignments").stdout)))
    assert table == [{"policy": "round_robin", "token hit": "0.72",
                      "assignments": "10 10 10 10 10"}]


def test_lint_prints_its_table_as_csv_with_raw_rates(tmp_path):
    import csv
    import io
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps({"tenant": "acme", "prompt": list(range(40)) + [n]})
                           + "\n" for n in range(100, 104)))
    result = prefixroute("lint", str(log), "--format", "csv", "--columns",
                         "tenant,requests,hit now")
    assert result.returncode == 0, result.stderr
    # 41 tokens each, 2 full 16-token blocks shared: requests 2-4 reuse 32 of 41.
    assert list(csv.DictReader(io.StringIO(result.stdout))) == [
        {"tenant": "acme", "requests": "4", "hit now": str(3 * 32 / (4 * 41))}]
