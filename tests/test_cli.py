"""The command line, as a user runs it."""
import subprocess
import sys


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "lazyrag.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_help_teaches():
    r = run("--help")
    assert r.returncode == 0
    assert "lazyrag demo" in r.stdout and "strategies" in r.stdout


def test_demo_runs_offline_and_compares_ttft():
    r = run("demo", "--max-new-tokens", "6", "--repeats", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Time to first token" in r.stdout
    assert r.stdout.count("Q1") >= 2 and "Q3" in r.stdout


def test_ask_reports_reuse_and_errors_clearly(tmp_path):
    r = run("ask", "Who?", "--chunks-file", str(tmp_path / "missing.txt"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = run("ask", "Who?", "--model", str(tmp_path / "no-model"))
    assert r.returncode == 2 and "does not exist" in r.stderr
