"""The layout's rules, read from the code itself: no import cycle among the project's modules (imports inside
functions count too), the layers point one way as docs/design.md's table orders them, and a backend or a model family
is named by no module outside its own file."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("models", "quant", "recipes", "zoo", "bench", "ui")


def project_modules() -> dict[str, Path]:
    """Dotted name -> file, for app.py and every module of the project's packages (tests aside)."""
    found = {"app": ROOT / "app.py"}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if any(part.startswith(".") for part in parts):
                continue  # bench/setup.sh's venv and caches are not the project's
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules a file imports, at any depth of its code: `from a.b import c` counts a.b.c when that
    is a module, else a.b."""
    return {name for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.Import, ast.ImportFrom)) for name in imported_modules_of(node, modules)}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(path, modules) - {name} for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import g\n")
    (tmp_path / "c.py").write_text("def g():\n    import a\n")
    modules = {name: tmp_path / f"{name}.py" for name in "abc"}
    graph = {name: imported_modules(path, modules) for name, path in modules.items()}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_import_cycle_among_the_projects_modules():
    assert cycles(import_graph()) == []


def layer_table() -> list[str]:
    """docs/design.md's Layers table: the layers, top (imported by all below it) first."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    return [row.split("|")[1].strip().strip("`") for row in section.splitlines()
            if row.startswith("| `")]


def layer_of(module: str, layers: list[str]) -> str | None:
    """The longest layer name the module's dotted name starts with."""
    found = [layer for layer in layers if module == layer or module.startswith(layer + ".")]
    return max(found, key=len) if found else None


def upward_imports(graph: dict[str, set[str]], layers: list[str]) -> list[str]:
    rank = {layer: index for index, layer in enumerate(layers)}
    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if rank[layer_of(target, layers)] > rank[layer_of(module, layers)])


def test_every_module_belongs_to_a_layer_of_the_design_docs_table():
    layers = layer_table()
    assert layers[:2] == ["models", "quant"] and layers[-1] == "app", layers
    assert [module for module, path in project_modules().items()
            if layer_of(module, layers) is None and path.read_text().strip()] == []  # an empty __init__ aside


def test_no_module_imports_a_layer_below_its_own():
    """The pipeline never imports zoo/, bench/ or the app, models/ and quant/ never import the pipeline, and so on
    down docs/design.md's table."""
    assert upward_imports(import_graph(), layer_table()) == []


def test_an_upward_import_is_found():
    graph = {"models.llama": {"recipes.pipeline.run"}, "recipes.pipeline.run": {"models.llama"}}
    layers = ["models", "quant", "recipes.pipeline"]
    assert upward_imports(graph, layers) == ["models.llama -> recipes.pipeline.run"]


def test_no_module_outside_a_backend_file_imports_it():
    """The pipeline asks the registry; only the backend's own file (and tests and benchmarks of it) name it."""
    graph = import_graph()
    backends = {name for name in graph if name.startswith("recipes.backends.")}
    wrong = {module: sorted(targets & backends) for module, targets in graph.items()
             if not module.startswith(("recipes.backends", "bench")) and targets & backends}
    assert wrong == {}


def test_no_module_outside_the_attention_folder_imports_a_form():
    """The module picks its form by name (models.attention.form_for); only the forms' own folder names them."""
    graph = import_graph()
    shared = {"models.attention", "models.attention.base"}
    forms = {name for name in graph if name.startswith("models.attention.")} - shared
    wrong = {module: sorted(targets & forms) for module, targets in graph.items()
             if not module.startswith("models.attention.") and targets & forms}
    assert forms and wrong == {}


def unexplained_function_imports(path: Path, modules: dict[str, Path]) -> list[str]:
    """Project imports inside functions with no comment saying why: on the import's own line, or on a line of
    the run of imports and comments just above it (one reason may cover a run)."""
    lines = path.read_text().splitlines()
    found = []
    for function in ast.walk(ast.parse("\n".join(lines), str(path))):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or not imported_modules_of(node, modules):
                continue
            above = node.lineno - 2
            explained = "#" in lines[node.lineno - 1]
            while not explained and above >= 0 and lines[above].strip().startswith(("from ", "import ", "#")):
                explained = "#" in lines[above]
                above -= 1
            if not explained:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def imported_modules_of(node, modules: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.module is None or node.level:
        return set()
    return {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
            for alias in node.names} & set(modules)


def test_an_unexplained_function_import_is_found(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.py").write_text("def f():\n    import b\n\n\ndef g():\n    # loads torch\n    import b\n")
    (tmp_path / "b.py").write_text("")
    modules = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    assert unexplained_function_imports(tmp_path / "a.py", modules) == ["a.py:2: import b"]


def test_a_project_import_inside_a_function_says_why():
    """At the top of its module unless it is heavy or optional (loading torch before a process's thread policy,
    say): then a comment says so."""
    modules = project_modules()
    assert [line for path in modules.values() for line in unexplained_function_imports(path, modules)] == []


def family_words() -> dict[str, re.Pattern]:
    """Each family other than Llama itself (the shared module's own) -> the words that name it: its name, its
    architectures and model types, as its file in models/families/ declares them."""
    from models.families import families

    words = {}
    for name, family in families().items():
        if name == "llama":
            continue
        names = sorted({name, *family.architectures, *family.model_types}, key=len, reverse=True)
        words[name] = re.compile(r"(?<![A-Za-z0-9])(" + "|".join(map(re.escape, names)) + r")(?![a-z0-9])",
                                 re.IGNORECASE)
    return words


# The demo apps' own names of a chat format (Android LlamaDemo's model types, etLLM's file prefixes), not a family's.
FAMILY_WORDS_ALLOWED = {"recipes.output.how_to_run": {"smollm3"}}


def modules_naming_a_family(modules: dict[str, Path], words: dict[str, re.Pattern]) -> dict[str, list[str]]:
    found = {}
    for module, path in modules.items():
        if module.startswith("bench."):
            continue  # benchmarks measure named models' shapes, as they may import a backend's file
        allowed = FAMILY_WORDS_ALLOWED.get(module, set())
        named = sorted(family for family, pattern in words.items()
                       if module != f"models.families.{family}" and family not in allowed
                       and pattern.search(path.read_text()))
        if named:
            found[module] = named
    return found


def test_a_family_is_named_by_no_module_outside_its_own_file():
    """The module, the attention forms, quantization, the backends and the report take a family's differences as
    generic choices; only models/families/<family>.py (and tests and benchmarks of it) names it."""
    assert modules_naming_a_family(project_modules(), family_words()) == {}


def test_a_module_naming_a_family_is_found(tmp_path):
    (tmp_path / "shape.py").write_text('if config.model_type == "qwen3":\n    qk_norm = True\n')
    (tmp_path / "plain.py").write_text("qwen30 = 1  # another word\n")
    modules = {"models.shape": tmp_path / "shape.py", "models.plain": tmp_path / "plain.py"}
    assert modules_naming_a_family(modules, family_words()) == {"models.shape": ["qwen3"]}
