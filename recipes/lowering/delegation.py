"""Delegation statistics of a lowered edge graph, from ExecuTorch's own get_delegation_info, plus
what lower_to_pte recorded while partitioning: the edge graph's op counts before partitioning, the ops
each partitioner kept from decomposition, and why ops were not delegated (the partitioners' own logs)."""
from __future__ import annotations

import re
from dataclasses import replace

from recipes.output.report import DelegatedOp, Delegation


def delegation_table(edge_graph_module, ops_before_partitioning: dict[str, int] | None = None,
                     preserved_ops: dict[str, list[str]] | None = None,
                     partitioner_reasons: list[dict] | None = None) -> Delegation:
    """The table of the lowered edge graph; the keyword arguments are what lower_to_pte recorded while
    partitioning (op counts of the edge graph before it, ops kept from decomposition, partitioner logs)."""
    from executorch.devtools.backend_debug import get_delegation_info

    info = get_delegation_info(edge_graph_module)
    frame = info.get_operator_delegation_dataframe()
    ops = [
        DelegatedOp(op=str(row["op_type"]), delegated=int(row["occurrences_in_delegated_graphs"]),
                    non_delegated=int(row["occurrences_in_non_delegated_graphs"]))
        for _, row in frame.iterrows()
        if row["op_type"] != "Total"
    ]
    total = info.num_delegated_nodes + info.num_non_delegated_nodes
    before = ops_before_partitioning or {}
    reasons = why_not_delegated([o.op for o in ops if o.non_delegated], partitioner_reasons or [])
    for o in ops:
        o.before_partitioning = before.get(o.op)
        o.why_not_delegated = reasons.get(o.op, []) if o.non_delegated else []
    return Delegation(
        delegated_subgraphs=int(info.num_delegated_subgraphs),
        delegated_nodes=int(info.num_delegated_nodes),
        non_delegated_nodes=int(info.num_non_delegated_nodes),
        delegated_percent=round(100.0 * info.num_delegated_nodes / total, 1) if total else 0.0,
        ops=_outside_first(ops),
        engine="executorch.devtools.backend_debug.get_delegation_info on the lowered edge program",
        edge_nodes_before_partitioning=sum(before.values()) if before else None,
        preserved_ops=preserved_ops or {},
        why_not_delegated_source="log records of the partitioners (logger names given per reason)",
    )


def _outside_first(ops: list[DelegatedOp]) -> list[DelegatedOp]:
    return sorted(ops, key=lambda o: (-o.non_delegated, o.op))


def methods_delegation_table(graph_modules: dict, **recorded) -> Delegation:
    """delegation_table of a program of several methods, each method's lowered edge graph in `graph_modules`: the
    counts summed over the methods (the edge op counts before partitioning are already summed), their names
    listed."""
    tables = {name: delegation_table(gm, **recorded) for name, gm in graph_modules.items()}
    if len(tables) == 1:
        return next(iter(tables.values()))
    delegated = sum(t.delegated_nodes for t in tables.values())
    non_delegated = sum(t.non_delegated_nodes for t in tables.values())
    total = delegated + non_delegated
    rows: dict[str, DelegatedOp] = {}
    for table in tables.values():
        for row in table.ops:
            into = rows.setdefault(row.op, replace(row, delegated=0, non_delegated=0, why_not_delegated=[]))
            into.delegated += row.delegated
            into.non_delegated += row.non_delegated
            into.why_not_delegated += [r for r in row.why_not_delegated if r not in into.why_not_delegated]
    return replace(next(iter(tables.values())),
                   delegated_subgraphs=sum(t.delegated_subgraphs for t in tables.values()),
                   delegated_nodes=delegated, non_delegated_nodes=non_delegated,
                   delegated_percent=round(100.0 * delegated / total, 1) if total else 0.0,
                   ops=_outside_first(list(rows.values())), methods=list(tables))


def _normalized(text: str) -> str:
    return "_" + re.sub(r"[^a-z0-9]+", "_", text.lower()) + "_"


def why_not_delegated(op_types: list[str], records: list[dict]) -> dict[str, list[dict]]:
    """Reasons per non-delegated op type: records naming the node (XNNPACK's WhyNoPartition), else
    records whose message names the op (Core ML logs "... not supported by CoreML: aten.acosh.default")."""
    found: dict[str, list[dict]] = {op: [] for op in op_types}
    for record in records:
        if record["op"] is not None:
            targets = [record["op"]] if record["op"] in found else []
        else:
            message = _normalized(record["reason"])
            targets = [op for op in op_types if f"_{op}_" in message]
        for op in targets:
            reason = {"source": record["source"], "reason": record["reason"]}
            if reason not in found[op]:
                found[op].append(reason)
    return found
