"""A healthy job prints its progress and nothing that reads like a failure: the dependencies' known messages are
silenced (recipes/process/dependency_noise.py) and ExecuTorch's C++ log goes to the job's folder (recipes/process/runtime_log.py)."""
import re
import subprocess
import sys

from tests.conftest import ROOT, run_cli

PROGRESS_LINE = re.compile(r"\[\s*\d+%\] \S.*")


def test_a_cli_job_prints_only_its_progress_and_keeps_the_runtime_log(runner_llama_dir, tmp_path):
    out = tmp_path / "out"
    result = run_cli("run", "--recipe", "xnnpack-8da4w", "--model", str(runner_llama_dir), "--out", str(out),
                     "--max-seq-len", "64", "--max-new-tokens", "4", "--prompt", "what is the capital of France ?")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert [line for line in lines if not PROGRESS_LINE.fullmatch(line)] == []
    assert lines[0].endswith("loading the checkpoint") and lines[-1].endswith("done")
    report = (out / "report.json").read_text()
    assert '"runner_note"' not in report  # healthy: ExecuTorch's LLM runner took the folder's files
    log = (out / "executorch.log").read_text()
    assert "cpuinfo" in log or "tokenizers" in log  # the runtime did write, into the file


def test_python_stderr_reaches_the_terminal_while_the_runtime_log_goes_to_the_file(tmp_path):
    """Written to fd 2, or through sys.stderr in the pybindings' `[file.cpp:line] message` form (in pieces, as
    pybind11's redirect of std::cerr writes them), the runtime's log lands in the file; Python's own lines do not."""
    log = tmp_path / "job" / "executorch.log"
    code = ("import os, sys\nfrom recipes.process.runtime_log import runtime_log_to\n"
            f"with runtime_log_to({str(log)!r}):\n"
            "    os.write(2, b'from C++\\n')\n    print('[ 50%] from Python', file=sys.stderr)\n"
            "    for piece in ('[', 'cpuinfo_utils.cpp', ':', '87', '] ', 'through the pybindings', '\\n'):\n"
            "        sys.stderr.write(piece)\n"
            "print('after', file=sys.stderr)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "[ 50%] from Python\nafter\n"
    assert log.read_text() == "from C++\n[cpuinfo_utils.cpp:87] through the pybindings\n"


def test_an_empty_runtime_log_leaves_nothing_behind_even_when_the_job_fails(tmp_path):
    import pytest

    from recipes.process.runtime_log import runtime_log_to

    with runtime_log_to(tmp_path / "new" / "folder" / "executorch.log"):
        pass
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError), runtime_log_to(tmp_path / "failed" / "executorch.log"):
        raise ValueError("refused before any work")
    assert list(tmp_path.iterdir()) == []
