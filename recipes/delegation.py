"""Delegation statistics of a lowered edge graph, from ExecuTorch's own get_delegation_info, plus
what lower_to_pte recorded while partitioning: the edge graph's op counts before partitioning, the ops
each partitioner kept from decomposition, and why ops were not delegated (the partitioners' own logs)."""
from __future__ import annotations

import re


def delegation_table(edge_graph_module, ops_before_partitioning: dict[str, int] | None = None,
                     preserved_ops: dict[str, list[str]] | None = None,
                     partitioner_reasons: list[dict] | None = None) -> dict:
    """The table of the lowered edge graph; the keyword arguments are what lower_to_pte recorded while
    partitioning (op counts of the edge graph before it, ops kept from decomposition, partitioner logs)."""
    from executorch.devtools.backend_debug import get_delegation_info

    info = get_delegation_info(edge_graph_module)
    frame = info.get_operator_delegation_dataframe()
    ops = [
        {
            "op": str(row["op_type"]),
            "delegated": int(row["occurrences_in_delegated_graphs"]),
            "non_delegated": int(row["occurrences_in_non_delegated_graphs"]),
        }
        for _, row in frame.iterrows()
        if row["op_type"] != "Total"
    ]
    total = info.num_delegated_nodes + info.num_non_delegated_nodes
    before = ops_before_partitioning or {}
    reasons = why_not_delegated([o["op"] for o in ops if o["non_delegated"]], partitioner_reasons or [])
    for o in ops:
        o["before_partitioning"] = before.get(o["op"])
        o["why_not_delegated"] = reasons.get(o["op"], []) if o["non_delegated"] else []
    return {
        "delegated_subgraphs": int(info.num_delegated_subgraphs),
        "delegated_nodes": int(info.num_delegated_nodes),
        "non_delegated_nodes": int(info.num_non_delegated_nodes),
        "delegated_percent": round(100.0 * info.num_delegated_nodes / total, 1) if total else 0.0,
        "ops": sorted(ops, key=lambda o: (-o["non_delegated"], o["op"])),
        "engine": "executorch.devtools.backend_debug.get_delegation_info on the lowered edge program",
        "edge_nodes_before_partitioning": sum(before.values()) if before else None,
        "preserved_ops": preserved_ops or {},
        "why_not_delegated_source": "log records of the partitioners (logger names given per reason)",
    }


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
