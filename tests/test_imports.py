"""The import graph: every module imports in a fresh interpreter, the project's modules import one
another in one direction (no cycle), no project import hides inside a function, and no project name
shadows an installed package."""
import ast
import importlib.metadata
import subprocess
import sys

from conftest import ROOT

MODULES = sorted([p.stem for p in ROOT.glob("*.py")] + [f"gpu_kernels.{p.stem}" for p in (ROOT / "gpu_kernels").glob("*.py")
                                                         if p.stem != "__init__"])
TOP = {name.split(".")[0] for name in MODULES}


def project_imports(path):
    """(imported top-level project module, inside a function?) for every import statement of path."""
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, True)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in child.names] if isinstance(child, ast.Import) else [child.module or ""]
                found.extend((n.split(".")[0], in_function) for n in names if n.split(".")[0] in TOP)
            else:
                visit(child, in_function)
    visit(ast.parse(path.read_text()), False)
    return found


def test_every_module_imports_in_a_fresh_interpreter():
    script = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    result = subprocess.run([sys.executable, "-c", script, *MODULES], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def test_imports_point_one_way_and_none_hides_in_a_function():
    files = {name: ROOT / f"{name.replace('.', '/')}.py" for name in MODULES}
    edges = {top: set() for top in TOP}
    for name, path in files.items():
        me = name.split(".")[0]
        for target, in_function in project_imports(path):
            assert not in_function, f"{path.name} imports {target} inside a function"
            if target != me:
                edges[me].add(target)
    order, state = [], {}

    def walk(node, trail):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", f"an import cycle: {' -> '.join(trail + [node])}"
        state[node] = "open"
        for target in sorted(edges[node]):
            walk(target, trail + [node])
        state[node] = "done"
        order.append(node)
    for node in sorted(edges):
        walk(node, [])
    assert order.index("model") < order.index("speculative") < order.index("generate")
    assert edges["model"] == set()  # the model imports nothing of the project


def test_no_project_name_shadows_an_installed_or_standard_module():
    """The repository root comes first on sys.path, so a project module named like an installed package
    hides that package from everyone: transformers imports Hugging Face's `kernels` package, once a
    name of ours, and failed with an ImportError from our folder."""
    ours = ({p.stem for folder in (".", "scripts", "research") for p in (ROOT / folder).glob("*.py")}
            | {p.parent.name for p in ROOT.glob("*/__init__.py")})
    taken = set(importlib.metadata.packages_distributions()) | set(sys.stdlib_module_names)
    assert not ours & taken, f"project modules named like installed or standard ones: {sorted(ours & taken)}"
