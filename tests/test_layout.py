"""The repository's rooms and the direction of its imports (docs/architecture.md, "Layout").

Every .py file under engram/, parallelisms/, runner/, planner/, recipes/, scripts/ and benchmarks/ is
parsed with `ast` (no import runs, no torch): every import statement, at module level or inside a
function, and every `importlib.import_module("...")` with a literal name, that names one of the
repo's own modules is an edge from its file to the imported file. The rules:

- no import cycle between files;
- a module imports only from its own package or a lower layer, lowest first: engram.runtime <
  engram.config < engram.data < engram.hashing < engram.models < engram.optim <
  engram.checkpoint < engram.train < engram.hf < engram.inference < parallelisms < runner <
  planner < recipes / scripts / benchmarks; nothing in engram/ or parallelisms/ imports runner/
  or planner/;
- no recipe imports another recipe, scripts/ import the library and not recipes/ (a benchmark may
  run a recipe's entry point);
- engram/ has no loose modules (only its __init__.py), and every package under it says in its
  __init__ docstring what belongs there;
- no file of those rooms runs over 600 lines, and no class over 400;
- no function of the planner runs over PLANNER_FUNCTION_LINES lines (its report, estimate,
  flags and communication grow with every axis: split them by section, as they are);
- no code names one of this project's issues (code says why, not when): an upstream issue is
  cited with its project (`torch issue 135712`, `triton-lang/triton-ascend#424`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("engram", "parallelisms", "runner", "planner", "recipes", "scripts", "benchmarks")
ENTRY_POINTS = ("recipes", "scripts", "benchmarks")
LAYERS = (
    "engram.runtime",
    "engram.rowstore",
    "engram.config",
    "engram.data",
    "engram.hashing",
    "engram.models",
    "engram.optim",
    "engram.checkpoint",
    "engram.train",
    "engram.hf",
    "engram.inference",
    "parallelisms",
    "runner",
    "planner",
    ENTRY_POINTS,
)


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name of the importing file
    target: str  # dotted module name of the imported repo file
    path: Path  # the importing file, relative to the repo root
    target_path: Path
    line: int
    statement: str  # the import as written

    def where(self) -> str:
        return f"{self.path}:{self.line}: `{self.statement}`"


def module_name(rel: Path) -> str:
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def repo_modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> path relative to `root` of every .py file in the checked folders."""
    modules = {}
    for top in TOP_LEVEL:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root)
            modules[module_name(rel)] = rel
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The repo module `name` refers to: itself, or its nearest enclosing repo package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _named(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    """The dotted names an import node loads (for `from a import b`: a.b, which may be a name
    defined in a rather than a module; _resolve then falls back to a)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: strip the importer's own name (unless a package) and levels
            package = importer.split(".")
            if not is_package:
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        return [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return [node.args[0].value]
    return []


def repo_imports(root: Path = ROOT) -> list[Import]:
    """Every import of a repo module by a repo module under `root`, module or function level."""
    modules = repo_modules(root)
    found = []
    for importer, rel in modules.items():
        source = (root / rel).read_text()
        for node in ast.walk(ast.parse(source, filename=str(rel))):
            names = _named(node, importer, rel.name == "__init__.py")
            targets = {
                t for t in (_resolve(n, modules) for n in names) if t not in (None, importer)
            }
            for target in sorted(targets):
                statement = ast.get_source_segment(source, node) or target
                statement = " ".join(statement.split()).replace("( ", "(").replace(", )", ")")
                found.append(Import(importer, target, rel, modules[target], node.lineno, statement))
    return found


def layer_of(module: str) -> int | None:
    """Index of `module`'s layer in LAYERS (None: engram's root __init__, below every layer)."""
    for i, layer in enumerate(LAYERS):
        names = layer if isinstance(layer, tuple) else (layer,)
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def layer_violations(imports: list[Import]) -> list[str]:
    bad = []
    for imp in imports:
        src, dst = imp.importer.split(".")[0], imp.target.split(".")[0]
        if dst in ("runner", "planner") and src in ("engram", "parallelisms"):
            bad.append(f"{imp.where()}: {src}/ imports {dst}/ ({dst}/ sits above them)")
        elif src == dst == "recipes" and "recipes" not in (imp.importer, imp.target):
            bad.append(f"{imp.where()}: a recipe imports another recipe ({imp.target})")
        elif src == "scripts" and dst in ("recipes", "benchmarks"):
            bad.append(f"{imp.where()}: scripts/ import the library, not {dst}/ ({imp.target})")
        elif src == "recipes" and dst in ("scripts", "benchmarks"):
            bad.append(f"{imp.where()}: a recipe imports {dst}/ ({imp.target})")
        else:
            have, need = layer_of(imp.importer), layer_of(imp.target)
            if need is not None and (have is None or need > have):
                bad.append(
                    f"{imp.where()}: {imp.importer} imports the higher layer {imp.target} "
                    "(layers, lowest first: "
                    + " < ".join(x if isinstance(x, str) else "/".join(x) for x in LAYERS)
                    + ")"
                )
    return bad


def import_cycles(imports: list[Import]) -> list[list[Import]]:
    """One cycle (as its import edges) per strongly connected group of files that import each
    other, found by Tarjan's algorithm; each reported cycle is a shortest one in its group."""
    graph: dict[str, list[Import]] = {}
    for imp in imports:
        graph.setdefault(imp.importer, []).append(imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of files
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for imp in graph.get(v, []):
            w = imp.target
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:
        start = min(group)
        # breadth-first from `start` back to itself, inside the group: a shortest cycle
        paths: dict[str, list[Import]] = {start: []}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:
            nxt = []
            for v in frontier:
                for imp in graph.get(v, []):
                    if imp.target == start:
                        cycle = [*paths[v], imp]
                        break
                    if imp.target in group and imp.target not in paths:
                        paths[imp.target] = [*paths[v], imp]
                        nxt.append(imp.target)
                if cycle is not None:
                    break
            frontier = nxt
        cycles.append(cycle)
    return cycles


def _describe(cycle: list[Import]) -> str:
    files = " -> ".join([str(cycle[0].path), *(str(imp.target_path) for imp in cycle)])
    steps = "; ".join(imp.where() for imp in cycle)
    return f"import cycle {files} ({steps})"


# --- the repository ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    found = repo_imports()
    # the walk found the repo: every layer is imported by someone
    targets = {layer_of(imp.target) for imp in found}
    assert set(range(len(LAYERS) - 1)) <= targets, f"layers never imported: {targets}"
    return found


def test_no_import_cycles(imports):
    cycles = import_cycles(imports)
    assert not cycles, "\n".join(_describe(c) for c in cycles)


def test_imports_go_down_the_layers(imports):
    bad = layer_violations(imports)
    assert not bad, "\n".join(bad)


# The storage under a table shard: parallelisms/ uses the row stores, never their files or I/O.
STORAGE_INTERNALS = tuple(
    f"engram.rowstore.{m}" for m in ("page_files", "page_io", "page_cache", "linux_aio")
)


def storage_reaches(imports: list[Import]) -> list[str]:
    return [
        f"{imp.where()}: parallelisms/ imports {imp.target} (use the row store, engram/rowstore/)"
        for imp in imports
        if imp.importer.split(".")[0] == "parallelisms" and imp.target in STORAGE_INTERNALS
    ]


def test_parallelisms_use_row_stores_not_page_files_or_aio(imports):
    bad = storage_reaches(imports)
    assert not bad, "\n".join(bad)


# Entry points that read a run's weights without training (a DeepSpeed step folder included).
READERS_WITHOUT_RUNNER = ("recipes.generate", "scripts.export_hf", "scripts.eval_perplexity")


def test_generation_and_export_read_runs_without_the_runner(imports):
    bad = [
        imp.where()
        for imp in imports
        if imp.importer in READERS_WITHOUT_RUNNER and imp.target.split(".")[0] == "runner"
    ]
    assert not bad, "read step folders through engram/checkpoint/:\n" + "\n".join(bad)


def test_engram_has_no_loose_modules():
    loose = sorted(p.name for p in (ROOT / "engram").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"engram/ holds loose modules {loose}: move each into the room it serves"


def test_every_engram_package_says_what_belongs_there():
    """Each room (a folder right under engram/ with Python in it) is a package, and every
    package's __init__ has a docstring. (engram/hf/remote/ is package data, not a package: the
    modeling file shipped in exports.)"""
    engram = ROOT / "engram"
    rooms = {engram / p.relative_to(engram).parts[0] for p in engram.glob("*/**/*.py")}
    inits = {p.parent for p in engram.glob("*/**/__init__.py")}
    missing = []
    for folder in sorted(rooms | inits):
        init = folder / "__init__.py"
        rel = init.relative_to(ROOT)
        if not init.exists():
            missing.append(f"{rel} does not exist")
        elif not (ast.get_docstring(ast.parse(init.read_text())) or "").strip():
            missing.append(f"{rel} has no docstring")
    assert not missing, "\n".join(missing)


PLANNER_FUNCTION_LINES = 100


def test_planner_functions_stay_split_by_section():
    long = []
    for path in sorted((ROOT / "planner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > PLANNER_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "split these by section into named functions:\n" + "\n".join(long)


FILE_LINES, CLASS_LINES = 600, 400  # small files and classes, split along their seams


def test_no_file_over_600_lines_and_no_class_over_400():
    long = []
    for top in TOP_LEVEL:
        for path in sorted((ROOT / top).rglob("*.py")):
            source, rel = path.read_text(), path.relative_to(ROOT)
            if (n := len(source.splitlines())) > FILE_LINES:
                long.append(f"{rel}: {n} lines")
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.ClassDef):
                    if (n := node.end_lineno - node.lineno + 1) > CLASS_LINES:
                        long.append(f"{rel}:{node.lineno} class {node.name}: {n} lines")
    assert not long, "split these along their seams:\n" + "\n".join(long)


# Code files: the rooms, the tests, the config files and the launch scripts.
CODE_GLOBS = ("*.py", "*.sh", "*.toml")
CODE_ROOTS = (*TOP_LEVEL, "tests", "train_configs")
# Projects whose issues code may cite as "<project> issue N".
UPSTREAM = {"torch", "pytorch", "torchtitan", "torchdata", "torchao", "torch_npu", "triton"}
UPSTREAM |= {"triton-ascend", "transformers", "deepspeed", "peft", "safetensors", "upstream"}
_ISSUE = re.compile(r"(?:([\w./-]+)\s+)?\b[Ii]ssues?[\s-]*#?\d+")
_BARE_REF = re.compile(r"(?<![\w/&.-])#\d+\b")  # "#12"; "owner/repo#12", "repo#12" pass


def issue_mentions(text: str) -> list[str]:
    """Every place in `text` that names an issue without naming an upstream project."""
    found = [
        m.group(0) for m in _ISSUE.finditer(text) if (m.group(1) or "").lower() not in UPSTREAM
    ]
    return found + [m.group(0) for m in _BARE_REF.finditer(text)]


def code_files(root: Path = ROOT) -> list[Path]:
    files = [p for glob in CODE_GLOBS for p in root.glob(glob)]
    for top in CODE_ROOTS:
        files += [p for glob in CODE_GLOBS for p in (root / top).rglob(glob)]
    ci = root / ".ci" / "run"  # the suite's runner, a shell script without a suffix
    return sorted(set(files) | ({ci} if ci.exists() else set()))


def test_no_code_names_one_of_our_issues():
    bad = []
    for path in code_files():
        if path == Path(__file__).resolve():
            continue  # its own examples below
        for n, line in enumerate(path.read_text().splitlines(), 1):
            bad += [f"{path.relative_to(ROOT)}:{n}: {m!r}" for m in issue_mentions(line)]
    assert not bad, "code says why, not when (cite upstream issues with their project):\n" + (
        "\n".join(bad)
    )


def test_issue_check_tells_our_issues_from_upstream_ones():
    ours = ["# added after issue 30", '"""Issue 30 item 11: the writer', "(issues 12-13)", "see #7"]
    upstream = [
        "(torch issue 135712; docs/multinode.md)",
        "triton-lang/triton-ascend#424",
        "(ms-swift#7870)",
        "# 2 issues: the first",
        "the tissue 3 times",
    ]
    assert all(issue_mentions(text) for text in ours), [issue_mentions(t) for t in ours]
    assert not any(issue_mentions(text) for text in upstream), [issue_mentions(t) for t in upstream]


# --- the checker on made-up trees --------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_checker_finds_upward_planner_recipe_and_script_imports(tmp_path):
    root = _tree(
        tmp_path,
        {
            "engram/__init__.py": "",
            "engram/config/__init__.py": "",
            "engram/config/schema.py": "def f():\n    from engram.models import builder\n",
            "engram/models/__init__.py": "",
            "engram/models/builder.py": "from ..config import schema\n",  # relative, downward
            "parallelisms/fsdp.py": "import planner.estimate\n",
            "parallelisms/tp.py": "from runner.step import TrainStep\n",
            "runner/step.py": "",
            "planner/estimate.py": "from parallelisms import fsdp\n",
            "recipes/__init__.py": "",
            "recipes/train.py": "",
            "recipes/train_deepspeed.py": "from recipes.train import train\n",
            "scripts/eval.py": "import importlib\nimportlib.import_module('recipes.train')\n",
            "benchmarks/bench.py": "from recipes.train import train\n",
        },
    )
    bad = layer_violations(repo_imports(root))
    assert len(bad) == 5, bad
    assert "engram/config/schema.py:2" in bad[0] and "higher layer engram.models" in bad[0]
    assert "parallelisms/fsdp.py:1" in bad[1] and "imports planner/" in bad[1]
    assert "parallelisms/tp.py:1" in bad[2] and "imports runner/" in bad[2]
    assert "recipes/train_deepspeed.py:1" in bad[3] and "another recipe" in bad[3]
    assert "scripts/eval.py:2" in bad[4] and "not recipes/" in bad[4]


def test_checker_finds_a_cycle_and_names_its_imports(tmp_path):
    root = _tree(
        tmp_path,
        {
            "parallelisms/__init__.py": "",
            "parallelisms/a.py": "from parallelisms.b import x\n",
            "parallelisms/b.py": "def f():\n    from parallelisms import c\n",
            "parallelisms/c.py": "import parallelisms.a\n",
            "parallelisms/d.py": "from parallelisms import a\n",  # into the cycle, not on it
        },
    )
    (cycle,) = import_cycles(repo_imports(root))
    assert [(i.importer, i.target, i.line) for i in cycle] == [
        ("parallelisms.a", "parallelisms.b", 1),
        ("parallelisms.b", "parallelisms.c", 2),
        ("parallelisms.c", "parallelisms.a", 1),
    ]


def test_checker_finds_parallelisms_reaching_into_page_files(tmp_path):
    root = _tree(
        tmp_path,
        {
            "engram/__init__.py": "",
            "engram/rowstore/__init__.py": "",
            "engram/rowstore/page_files.py": "",
            "engram/rowstore/linux_aio.py": "",
            "engram/rowstore/nvme_store.py": "from engram.rowstore import page_files\n",
            "parallelisms/nvme.py": "from engram.rowstore.nvme_store import S\n",  # allowed
            "parallelisms/bad.py": "from engram.rowstore.linux_aio import AioContexts\n",
        },
    )
    (bad,) = storage_reaches(repo_imports(root))
    assert "parallelisms/bad.py:1" in bad and "engram.rowstore.linux_aio" in bad


def test_no_package_exports_a_name_that_is_also_its_submodule():
    """`from engram.checkpoint import step_folders` once gave the module, not the function: the
    first import of a submodule of that name rebinds the package attribute (6 tests failed in
    CI at 7f093da). A package's exported names and its submodules' names stay apart."""
    clashes = []
    for init in sorted(p for top in TOP_LEVEL for p in (ROOT / top).rglob("__init__.py")):
        package = init.parent.relative_to(ROOT).as_posix().replace("/", ".")
        # names imported from elsewhere; `from <the package> import <its submodule>` is no clash
        exported = {
            a.asname or a.name
            for node in ast.parse(init.read_text()).body
            if isinstance(node, ast.ImportFrom)
            and (node.module, node.level) not in ((package, 0), (None, 1))
            for a in node.names
        }
        subs = {p.stem for p in init.parent.glob("*.py")} | {
            p.name for p in init.parent.iterdir() if (p / "__init__.py").exists()
        }
        clashes += [f"{package}: {n}" for n in sorted(exported & subs)]
    assert not clashes, f"exported names that are also submodules (rename the module): {clashes}"
