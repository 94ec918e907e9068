"""The package structure holds: imports point one way, between files and between role packages.

Every import counts, including those inside functions (they hide a circle, they do not remove it).
A role package is a module path two levels deep (`streamer.agent`, `learner.trainer`, `simulator.env`).
The product packages, bench/ (micro-benchmarks) and experiments/ (harness, suite, studies) are all checked; which
package may not import which is the FORBIDDEN list.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("simulator", "streamer", "learner", "dashboard")  # the product
TOOLS = ("bench", "experiments")  # run from the checkout, never installed
MAX_LINES = 400

# (importer, imported): no module under the first prefix imports one under the second. A prefix is a module path
# (`learner`, `streamer.wire`): it covers that module and everything below it.
FORBIDDEN = [
    *((pkg, tool) for pkg in PACKAGES for tool in TOOLS),  # the product never needs the benchmarks or experiments
    ("bench", "experiments"),  # experiments may use bench's helpers, not the other way round
    # the directions of docs/architecture.md: the caller passes what the callee needs
    ("simulator", "learner"),  # the simulator checks prompts with a tokenizer loader it is handed
    ("streamer.runs", "simulator"),  # the run analysis reads topics and files, not the task generator
    ("learner", "streamer.agent"),  # the warm start's evaluation is handed the agents' episode loop
    *((f"learner.{pkg}", "simulator") for pkg in ("models", "engines", "algorithms", "trainer", "backends")),
]


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in (*PACKAGES, *TOOLS):
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """Project modules a file imports: `from a.b import c` names a.b.c when that is a module, else a.b."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {mod: _imported(ast.parse(path.read_text()), modules) - {mod} for mod, path in modules.items()}


def _package_of(mod: str) -> str:
    return ".".join(mod.split(".")[:2])


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def forbidden_imports(graph: dict[str, set[str]], rules=FORBIDDEN) -> list[tuple[str, str]]:
    """Every (module, imported module) edge that one of the (importer, imported) prefix rules forbids."""
    return sorted((mod, t) for mod, targets in graph.items() for t in targets
                  for a, b in rules if _under(mod, a) and _under(t, b))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
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
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Imports between role packages. A package's own `__init__` importing its modules is not an edge."""
    out: dict[str, set[str]] = defaultdict(set)
    for mod, targets in graph.items():
        a = _package_of(mod)
        for t in targets:
            b = _package_of(t)
            if a != b and not b.startswith(a + ".") and not a.startswith(b + "."):
                out[a].add(b)
    return dict(out)


def test_cycles_finds_a_hand_made_circle():
    graph = {"a.x": {"a.y"}, "a.y": {"b.z"}, "b.z": {"a.x"}, "c.w": {"a.x"}}
    assert cycles(graph) == [["a.x", "a.y", "b.z"]]
    assert package_graph(graph) == {"a.x": {"a.y"}, "a.y": {"b.z"}, "b.z": {"a.x"}, "c.w": {"a.x"}}
    assert package_graph({"a.x.m": {"a.x.n", "a.y"}, "a": {"a.x.m"}}) == {"a.x": {"a.y"}}
    assert cycles({"a.x": {"a.y"}, "a.y": set()}) == []


def test_forbidden_imports_finds_hand_made_edges():
    graph = {"learner.trainer.loop": {"bench.common", "learner.config"}, "bench.common": {"experiments.stats"},
             "experiments.suite": {"bench.common", "learner.config"}, "streamer.wire": {"benchmarks.x"},
             "experiments": {"experiments.harness"}}
    assert forbidden_imports(graph) == [("bench.common", "experiments.stats"), ("learner.trainer.loop", "bench.common")]
    assert forbidden_imports(graph, [("streamer", "bench")]) == []  # `bench` is not a prefix of `benchmarks`
    assert forbidden_imports(graph, [("experiments", "learner.config")]) == [("experiments.suite", "learner.config")]


def test_no_import_circle_between_files():
    assert cycles(import_graph()) == []


def test_no_import_circle_between_role_packages():
    assert cycles(package_graph(import_graph())) == []


def test_the_wire_contract_imports_nothing_else_of_the_project():
    graph = import_graph()
    outside = {m: {t for t in ts if not t.startswith("streamer.wire")} for m, ts in graph.items()
               if m.startswith("streamer.wire")}
    assert {m: ts for m, ts in outside.items() if ts} == {}


def test_the_product_never_imports_bench_or_experiments_and_bench_never_imports_experiments():
    graph = import_graph()
    assert {"bench.common", "experiments.suite", "experiments.harness.loop", "learner.trainer.loop"} <= set(graph)
    assert forbidden_imports(graph) == []


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}
