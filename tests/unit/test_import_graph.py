"""The package's import graph has no circles but the few listed here, each with its owner.

A circle is a strongly connected component of the module graph built from every
``import`` in ``hpcmac/`` (module level or inside functions alike; imports under
``if TYPE_CHECKING:`` are annotations only and do not count). A new circle fails
this test: break it, do not list it.
"""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# circles that remain, and who ends them
ALLOWED = {
    # DistMatrix's operators are numpy-style sugar: thin, and they import the algorithms
    # lazily (test_distmatrix_operators_stay_thin); kept on purpose
    frozenset({"hpcmac.linalg.arith", "hpcmac.linalg.distmatrix", "hpcmac.linalg.remap",
               "hpcmac.linalg.summa"}),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in (ROOT / "hpcmac").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, package: str):
    """(imported name, at module level?) for every import outside TYPE_CHECKING blocks."""
    def walk(node, top):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    yield from walk(sub, top)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, top
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    name = ".".join(base + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                for alias in child.names:
                    yield f"{name}.{alias.name}", top
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda))
            yield from walk(child, inner)
    yield from walk(tree, True)


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(every edge, module-level edges only) between hpcmac's modules."""
    mods = _modules()

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph, top_graph = defaultdict(set), defaultdict(set)
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for name, top in _imports(ast.parse(path.read_text()), package):
            if not name.startswith("hpcmac"):
                continue
            target = resolve(name)
            if target and target != mod:
                graph[mod].add(target)
                if top:
                    top_graph[mod].add(target)
    return graph, top_graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(frozenset(comp))
    return out


# A matrix type's operators as numpy-style sugar (``A @ x``, ``A + B``, ``A.T``): its module
# imports the algorithms lazily, inside the operator methods, and they import the type.
# Such a circle is kept on purpose while the type's module-level imports stay out of it.
SUGAR_TYPES = {"hpcmac.linalg.sparse.distcsr": "hpcmac.linalg.sparse."}


def _sugar(circle: frozenset[str], top: dict[str, set[str]]) -> bool:
    for mod, package in SUGAR_TYPES.items():
        if mod in circle and all(m.startswith(package) for m in circle):
            return not top[mod] & circle
    return False


def test_no_new_import_circles():
    graph, top = import_graph()
    new = [sorted(c) for c in circles(graph) if c not in ALLOWED and not _sugar(c, top)]
    assert not new, f"new import circles (break them): {new}"


def test_the_finder_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        frozenset({"a", "b", "c"})]


def test_distmatrix_operators_stay_thin():
    _, top = import_graph()
    algorithms = {"hpcmac.linalg.arith", "hpcmac.linalg.summa", "hpcmac.linalg.remap"}
    assert not top["hpcmac.linalg.distmatrix"] & algorithms


def test_plan_does_not_import_bench():
    graph, _ = import_graph()
    for mod, targets in graph.items():
        if mod.startswith("hpcmac.plan"):
            assert not {t for t in targets if t.startswith("hpcmac.bench")}, mod


def test_errors_imports_nothing_of_hpcmac():
    graph, _ = import_graph()
    assert not graph.get("hpcmac.errors")


def test_comm_reads_no_launcher_file():
    # the job's hostfile is parsed by whoever starts the job and handed to comm.init
    graph, _ = import_graph()
    for mod, targets in graph.items():
        if mod.startswith("hpcmac.comm"):
            assert not {t for t in targets if t.startswith("hpcmac.launch")}, mod
