"""Backends are discovered: a backend file in a package named by LOWERBENCH_BACKEND_PACKAGES appears in
`python -m recipes list` and runs through run(), with no project file changed."""
import textwrap

from tests.conftest import run_cli

PACKAGE = "lowerbench_throwaway_backends"

NOTHING_BACKEND = '''
from executorch.exir.backend.partitioner import Partitioner, PartitionResult

from recipes.registry import Backend, recipe


class DelegatesNothing(Partitioner):
    def partition(self, exported_program):
        return PartitionResult(tagged_exported_program=exported_program, partition_tags={})


BACKEND = Backend(
    name="nothing",
    title="Nothing",
    delegate_id="NothingBackend",
    runs_on="any ExecuTorch runtime: its portable kernels run the whole program",
    partitioners=lambda options: [DelegatesNothing()],
    schemes=("fp32",),
)

RECIPES = (recipe(BACKEND, "fp32", "no delegate, portable kernels"),)
'''


def _throwaway_package(tmp_path):
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nothing.py").write_text(textwrap.dedent(NOTHING_BACKEND))
    return tmp_path


def test_backend_file_outside_the_project_is_listed(tmp_path):
    root = _throwaway_package(tmp_path)
    result = run_cli("list", env={"PYTHONPATH": str(root), "LOWERBENCH_BACKEND_PACKAGES": PACKAGE})
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert any(line.split()[:3] == ["nothing-fp32", "nothing", "fp32"] for line in lines if line.split())
    header = next(line.split() for line in lines if line.startswith("scheme "))
    assert "nothing" in header and "xnnpack" in header
    assert any("nothing" in line and "portable kernels run the whole program" in line for line in lines)


def test_backend_file_outside_the_project_runs_through_run(tmp_path, tiny_llama_dir, monkeypatch):
    from recipes.registry import load_backends
    from recipes.request import RunRequest
    from recipes.pipeline.run import run

    monkeypatch.syspath_prepend(str(_throwaway_package(tmp_path)))
    monkeypatch.setenv("LOWERBENCH_BACKEND_PACKAGES", PACKAGE)
    summary = run(RunRequest(recipes=["nothing-fp32"], out_dir=tmp_path / "out", model=str(tiny_llama_dir),
                             max_seq_len=32, max_new_tokens=3, prompt="what is the capital ?"))
    report = summary.recipes[0]
    assert report.errors == [], report.errors
    assert report.recipe.backend == "nothing" and report.delegation.delegated_subgraphs == 0
    assert [g.engine for g in report.generations] == ["eager-fp32", "executorch-runtime"]
    assert (tmp_path / "out" / "model.pte").stat().st_size == report.pte.bytes
    monkeypatch.delenv("LOWERBENCH_BACKEND_PACKAGES")
    assert "nothing" not in load_backends().backends  # gone with the variable
