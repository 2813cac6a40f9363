"""A backward pass in two halves, for the zero-bubble pipeline schedules: B now, W later.

B is the gradient of a stage's input: the previous stage is waiting for it. W is the gradients of the
stage's weights: only the optimizer needs them, so a schedule may run W whenever a rank would idle.

The split works on autograd's graph, whatever the layers are (column/row/vocab-parallel linears, norms,
embeddings, attention kernels, the collectives between them). Call I the nodes of the graph from which
the stage input's gradient is reachable: B runs the engine from the output to the input only, so it
runs the I nodes and only the parts of them the input needs (a matmul's backward computes dX, not dW;
the collectives on the way, tensor parallelism's f and g, ring attention's P2P, run here). An I node
that also has an edge leading to some weight and not to the input is an *intermediate*: B records the
gradient that flows into it (a pre-hook) and keeps the graph. W runs the engine again from each
intermediate, with that gradient, to the weights only: the matmul's backward once more, for dW now.
Intermediates that share weights (or weight-only nodes) are run together; others one group at a time.

W computes the weight gradients without accumulating them, then accumulates all of them in one last
engine pass over the weights themselves, so that gradient hooks fire exactly as in a plain backward:
data parallelism's buckets fill, and under sync the reductions start and are awaited at its end.
A stage whose input needs no gradient (the first, which embeds tokens) has nothing to do in B: its
whole backward runs as W. Everything B kept is released when W is done (the caller drops the record).

A node of the graph may defer work of its own: a layer that recomputes its forward in the backward
(recompute.py under these schedules) is one node whose backward rebuilds the layer's graph and runs B
on it, leaving that graph's W in the list `deferred` on the node. B collects those lists; W computes
their weight gradients with its own and accumulates them all in the same last pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from tetron.torch_private import run_backward


@dataclass(eq=False)
class _Group:
    """Intermediates whose weight-side subgraphs touch the same weights: one W engine run."""

    nodes: list[Node] = field(default_factory=list)
    weights: list[nn.Parameter] = field(default_factory=list)
    below: list[Node] = field(default_factory=list)  # the intermediates' children on the weights' side


@dataclass
class PendingWeightGrad:
    """What B leaves for W: the groups and the gradients captured at their intermediates, or, where
    B had nothing to do, the output and its incoming gradient for one whole backward."""

    groups: list[_Group]
    captured: dict[Node, tuple[Tensor | None, ...]]
    whole: tuple[GradientEdge, Tensor, list[nn.Parameter]] | None = None
    # the `deferred` lists of the nodes below the output that defer a W of their own (filled by B)
    nested: list[list[PendingWeightGrad]] = field(default_factory=list)


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _reach(root: Node, targets: set[Node]) -> dict[Node, bool]:
    """For every node below `root`, whether some node of `targets` is reachable from it (iterative:
    a stage's graph is deeper than Python's recursion limit)."""
    reach: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if node in reach and not expanded:
            continue
        if expanded:
            reach[node] = node in targets or any(reach[c] for c in _children(node))
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if c not in reach)
    return reach


def _groups(root: Node, input_node: Node, weights: dict[Node, nn.Parameter]) -> list[_Group] | None:
    """The intermediates (I nodes with an edge into weight-only territory), grouped by shared weights;
    None if the output does not depend on the input at all."""
    to_input = _reach(root, {input_node})
    if not to_input[root]:
        return None
    to_weight = _reach(root, set(weights))
    owner: dict[nn.Parameter, _Group] = {}
    groups: list[_Group] = []
    for node, on_input_path in to_input.items():
        if not on_input_path:
            continue
        below = [c for c in _children(node) if not to_input[c] and to_weight[c]]
        if not below:
            continue
        # in graph order, never a set's: the order of W's accumulation is the order in which data
        # parallelism's buckets fill and reduce, which must be the same on every rank
        reached = list(dict.fromkeys(weights[n] for n in _reach_all(below) if n in weights))
        merged = _Group([node], [], below)
        for group in {id(owner[w]): owner[w] for w in reached if w in owner}.values():
            merged.nodes += group.nodes
            merged.weights += group.weights
            merged.below += group.below
            groups.remove(group)
        merged.weights += [w for w in reached if w not in merged.weights]
        for w in merged.weights:
            owner[w] = merged
        groups.append(merged)
    for group in groups:
        _check_no_double_path(group, to_input)
    return groups


def _reach_all(starts: list[Node]) -> dict[Node, None]:
    """Every node reachable from `starts`, in the order found (the same on every rank: the graphs are)."""
    seen: dict[Node, None] = {}
    stack = list(starts)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen[node] = None
            stack.extend(_children(node))
    return seen


def _check_no_double_path(group: _Group, to_input: dict[Node, bool]) -> None:
    """W runs a group's intermediates together; if one lay below another on the input path (a weight
    used at two depths of one stage), the upper one's run would reach the lower one's weights again."""
    if len(group.nodes) < 2:
        return
    members = set(group.nodes)
    for node in group.nodes:
        below = _reach_all([c for c in _children(node) if to_input[c]])
        if below.keys() & members:
            raise RuntimeError("a weight is used at two depths of one pipeline stage's input path: its "
                               "backward cannot be split into B and W; use pp_schedule=1f1b or interleaved")


def backward_input(output: Tensor, grad: Tensor | None, stage_input: Tensor | None,
                   params: list[nn.Parameter]) -> tuple[Tensor | None, PendingWeightGrad]:
    """B: the gradient of `stage_input` from `output` (whose data may have been released; `grad`
    None: a scalar loss), and what W will need. Accumulates nothing; keeps the graph."""
    root = get_gradient_edge(output)
    grad = torch.ones_like(output) if grad is None else grad
    weights = {get_gradient_edge(p).node: p for p in params if p.requires_grad}
    nested = [node.deferred for node in _reach_all([root.node]) if isinstance(getattr(node, "deferred", None), list)]
    whole = PendingWeightGrad([], {}, whole=(root, grad, list(weights.values())), nested=nested)
    if stage_input is None or not stage_input.requires_grad:
        return None, whole
    input_edge = get_gradient_edge(stage_input)
    groups = _groups(root.node, input_edge.node, weights)
    if groups is None:  # nothing to send back: the whole backward is W's
        return torch.zeros_like(stage_input), whole
    captured: dict[Node, tuple[Tensor | None, ...]] = {}

    def capture(node: Node):
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            captured[node] = grad_outputs
        return hook

    handles = [node.register_prehook(capture(node)) for group in groups for node in group.nodes]
    try:
        (dx,) = run_backward((root,), (grad,), keep_graph=True, inputs=(input_edge,), accumulate=False)
    finally:
        for handle in handles:  # a hook holds its node: left in place it would keep the graph alive
            handle.remove()
    return dx, PendingWeightGrad(groups, captured, nested=nested)


def weight_nodes(pending: PendingWeightGrad) -> set[Node] | None:
    """The nodes W will run from what B left (the intermediates and the weight-only nodes below them),
    whose saved tensors W reads; None: all of them (a whole backward)."""
    if pending.whole is not None:
        return None
    below = _reach_all([c for g in pending.groups for c in g.below])
    return {n for g in pending.groups for n in g.nodes} | below.keys()


def backward_weight(pending: PendingWeightGrad) -> None:
    """W: the weight gradients B left, accumulated into `.grad` in one engine pass (hooks fire there)."""
    weights: list[nn.Parameter] = []
    grads: list[Tensor] = []
    _weight_grads(pending, weights, grads)
    if weights:
        run_backward(weights, grads)


def _weight_grads(pending: PendingWeightGrad, weights: list[nn.Parameter], grads: list[Tensor]) -> None:
    """Append the weight gradients `pending` holds (and those its nodes deferred) to `weights`, `grads`;
    release what it kept."""
    if pending.whole is not None:
        edge, grad, params = pending.whole
        pending.whole = None
        dws = run_backward((edge,), (grad,), inputs=[get_gradient_edge(p) for p in params], accumulate=False)
        for w, dw in zip(params, dws):
            if dw is not None:
                weights.append(w)
                grads.append(dw)
    for group in pending.groups:
        roots, incoming = [], []
        for node in group.nodes:
            for nr, g in enumerate(pending.captured.get(node, ())):
                if g is not None:
                    roots.append(GradientEdge(node, nr))
                    incoming.append(g)
        if not roots:
            continue  # no gradient reached this part of the graph (an unused branch)
        edges = tuple(get_gradient_edge(w) for w in group.weights)
        dws = run_backward(roots, incoming, inputs=edges, accumulate=False)
        for w, dw in zip(group.weights, dws):
            if dw is not None:
                weights.append(w)
                grads.append(dw)
    pending.groups, pending.captured = [], {}
    for deferred in pending.nested:  # filled by B (or, for a whole backward, by the run above)
        for inner in deferred:
            _weight_grads(inner, weights, grads)
        deferred.clear()  # the node may outlive W in the caller's graph: it must not keep the rebuilt one
    pending.nested = []
