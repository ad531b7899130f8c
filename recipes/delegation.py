"""Delegation statistics of a lowered edge graph, from ExecuTorch's own get_delegation_info."""
from __future__ import annotations


def delegation_table(edge_graph_module) -> dict:
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
    return {
        "delegated_subgraphs": int(info.num_delegated_subgraphs),
        "delegated_nodes": int(info.num_delegated_nodes),
        "non_delegated_nodes": int(info.num_non_delegated_nodes),
        "delegated_percent": round(100.0 * info.num_delegated_nodes / total, 1) if total else 0.0,
        "ops": sorted(ops, key=lambda o: (-o["non_delegated"], o["op"])),
        "engine": "executorch.devtools.backend_debug.get_delegation_info on the lowered edge program",
    }
