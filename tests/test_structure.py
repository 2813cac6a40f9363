"""The shape of the code, checked: the layer order of tetron/__init__.py (imports only go down, no cycle
between packages, a small top level), no import cycle among tetron's modules, no function longer than one
screen, parameter layouts only through parallel/layout.py, one caller of the axes' apply_* functions, no
axis that names a model family's modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tetron"
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(), filename=str(path))
    return found


MODULES = _modules()


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the tetron modules it imports anywhere in its text (top level, in functions, or under
    TYPE_CHECKING alike: a cycle hidden in a function is still a cycle)."""
    graph: dict[str, set[str]] = {}
    for name, tree in modules.items():
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:  # `from tetron import device` imports the module tetron.device
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep, path)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def unit_of(module: str) -> str | None:
    """The layer unit a module belongs to: its package (`tetron.data.loader` -> data) or, at the top level,
    itself (`tetron.cli` -> cli); None for tetron itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def layer_order(doc: str) -> list[set[str]]:
    """The layers as tetron/__init__.py's docstring lists them, bottom first: lines `N. a, b, c: what`."""
    found = re.findall(r"^\s+(\d+)\. ([\w, ]+):", doc, re.M)
    return [{name.strip() for name in names.split(",")} for _, names in found]


def upward_imports(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """Every import of a module from a layer above its own, as "a -> b"."""
    rank = {unit: i for i, layer in enumerate(layers) for unit in layer}
    return sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                  if unit_of(a) and unit_of(b) and rank[unit_of(b)] > rank[unit_of(a)])


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which layer units (packages, top-level modules) import which others."""
    units: dict[str, set[str]] = {}
    for a, deps in graph.items():
        if unit_of(a):
            others = {unit_of(b) for b in deps} - {None, unit_of(a)}
            units.setdefault(unit_of(a), set()).update(others)
    return units


LAYERS = layer_order(ast.get_docstring(MODULES["tetron"]) or "")


def test_the_layer_order_lists_every_package_and_top_level_module_once():
    listed = [unit for layer in LAYERS for unit in layer]
    assert len(LAYERS) >= 8 and len(listed) == len(set(listed))
    assert set(listed) == {unit_of(m) for m in MODULES} - {None}


def test_imports_only_go_down_the_layers():
    assert upward_imports(import_graph(MODULES), LAYERS) == []


def test_no_cycles_between_packages():
    assert find_cycle(unit_graph(import_graph(MODULES))) is None


def test_the_checkers_find_an_upward_import_and_a_package_cycle():
    graph = {"tetron.data.loader": {"tetron.checkpoint.save"}, "tetron.checkpoint.save": {"tetron.data.tokenizer"},
             "tetron.data.tokenizer": set()}
    assert upward_imports(graph, [{"data"}, {"checkpoint"}]) == ["tetron.data.loader -> tetron.checkpoint.save"]
    assert find_cycle(unit_graph(graph)) == ["checkpoint", "data", "checkpoint"]


def test_the_top_level_is_small():
    """At most a dozen modules beside the packages: the rest of the code lives in packages by idea."""
    top = [m for m in MODULES if m.count(".") == 1 and not (PACKAGE / m.split(".")[1]).is_dir()]
    assert 5 <= len(top) <= 12, top


def test_axes_name_no_model_modules():
    """The parallel strategies, checkpoints and planner read a family's plan (models/spec.py), never Llama's
    module names: a second family then needs no change in any of them."""
    names = re.compile(r"\b(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|self_attn|mlp|embed_tokens|"
                       r"lm_head|input_layernorm|post_attention_layernorm)\b")
    offenders = []
    for name, tree in MODULES.items():
        if unit_of(name) not in ("parallel", "checkpoint", "plan"):
            continue
        docstrings = {id(body[0].value) for parent in ast.walk(tree) if (body := getattr(parent, "body", None))
                      and isinstance(body, list) and isinstance(body[0], ast.Expr)}
        for node in ast.walk(tree):  # string constants and attribute names; docstrings and comments may explain
            if isinstance(node, ast.Attribute) and names.fullmatch(node.attr):
                offenders.append(f"{name}:{node.lineno} .{node.attr}")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and names.search(node.value)
                  and id(node) not in docstrings):
                offenders.append(f"{name}:{node.lineno} {node.value!r}")
    assert not offenders


def test_find_cycle_finds_one():
    """The checker itself: a planted cycle is found, an acyclic graph passes."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    graph = import_graph(MODULES)
    assert len(graph) > 20 and graph["tetron.train"]  # the graph really covers the package
    assert find_cycle(graph) is None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_functions_fit_on_a_screen(module):
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(MODULES[module])
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{module}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_layouts_only_through_their_accessor():
    """No module reads or writes layout attributes on parameters by name: parallel/layout.py's
    set_layout and layout_of are the only way (a typo there fails loudly, not as 'not sharded')."""
    old_names = {"shard", "logical_size", "sequence_parallel", "summed_over_tp", "tied_copy", "init_name",
                 "main_grad"}
    by_name = old_names | {"_tetron_layout"}
    offenders = []
    for name, tree in MODULES.items():
        for node in ast.walk(tree):
            named = (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                     and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2
                     and isinstance(node.args[1], ast.Constant) and node.args[1].value in by_name)
            if named and name != "tetron.parallel.layout":
                offenders.append(f"{name}:{node.lineno}")
            # `x.shard = ...`; sequence_parallel is also a plain flag of tensor-parallel modules
            if (isinstance(node, ast.Attribute) and node.attr in old_names - {"sequence_parallel"}
                    and isinstance(node.ctx, ast.Store)):
                offenders.append(f"{name}:{node.lineno}")
    assert not offenders


def test_apply_functions_have_one_caller():
    """parallelize() is the recipe: the axes' apply_* functions are called nowhere else in tetron."""
    axes = {node.name for name, tree in MODULES.items() if name.startswith("tetron.parallel.")
            for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name.startswith("apply_")}
    assert {"apply_pipeline_stage", "apply_tensor_parallel", "apply_context_parallel", "apply_data_parallel"} <= axes
    callers = {name for name, tree in MODULES.items() for node in ast.walk(tree)
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in axes}
    assert callers == {"tetron.parallel.parallelize"}
