"""bench/results/*.json -> bench/results/README.md (markdown tables, ratios against the peer measured
in the same run) and bench/results/scaling.png."""
from __future__ import annotations

import json
from pathlib import Path

from bench.front import is_default
from bench.kv import ATTENTION, BUILTIN_SHAPE, FLOOR, OPTIMUM, PROGRAMS
from bench.runner import RUNNER
from bench.scale import params_of

def ratio(a, b) -> str:
    return f"{a / b:.2f}×" if a and b else "–"


def fmt(x, digits=1) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _meta_line(meta: dict, how: str | None = None) -> str:
    m = meta["machine"]
    runs = meta.get("runs_requested")
    how = how or f"median of {runs} run{'s' if runs != 1 else ''} per figure, peers run in turn within each run"
    line = (f"{meta['date']} · {m['cpu']}, {m['cores']} cores, {m['ram_gb']} GB · {how} · load average before/after "
            f"{meta['load_average_before'][0]} / {meta['load_average_after'][0]}")
    return line + (f" · {meta['note']}" if meta.get("note") else "")


ONE_THREAD_PROBE = "lowerbench-pte (1 thread)"  # engine name of the one-thread run of the Lowerbench .pte
STOCK_THREADS_PROBE = "lowerbench-pte (stock threads)"  # the Lowerbench .pte without recipes/process/thread_policy.py
# The README's last section, kept as it is when the tables are written again: dates and notes no JSON records.
HAND_WRITTEN = "## Notes on these tables (written by hand)"
MEMORY_READ = "memory-read"  # bench/memory.py: the machine's read speed, measured in turn with the engines
STEP_LOOP = "executorch-runtime step loop"  # engine of bench/decode.py's .pte engines: Lowerbench's Python loop


def decode_table(data: dict) -> list[str]:
    engines = data["engines"]
    lb = engines.get("lowerbench-pte", {})
    s = data["settings"]
    lines = [f"### Decode ({s['new_tokens']} new tokens, greedy, {s['threads']} threads, same prompt token ids)",
             _meta_line(data["meta"]), "",
             "| engine | prefill tok/s | decode tok/s | Lowerbench ÷ engine (decode) "
             "| prefill tok/CPU-s | decode tok/CPU-s | Lowerbench ÷ engine (decode, per CPU-s) | runs |",
             "|---|---|---|---|---|---|---|---|"]
    memory = engines.get(MEMORY_READ)
    for name, row in engines.items():
        if name == MEMORY_READ:
            continue
        rel = "" if name == "lowerbench-pte" else ratio(lb.get("decode_tokens_per_s"), row["decode_tokens_per_s"])
        rel_cpu = "" if name == "lowerbench-pte" else ratio(lb.get("decode_tokens_per_cpu_s"), row.get("decode_tokens_per_cpu_s"))
        lines.append(f"| {name} | {fmt(row['prefill_tokens_per_s'])} | {fmt(row['decode_tokens_per_s'])} | {rel} "
                     f"| {fmt(row.get('prefill_tokens_per_cpu_s'))} | {fmt(row.get('decode_tokens_per_cpu_s'))} "
                     f"| {rel_cpu} | {row['runs']} |")
    for name, why in data.get("skipped", {}).items():
        lines.append(f"| {name} | not run: {why} | | | | | | 0 |")
    lines += ["", "tok/CPU-s: tokens per CPU-second of the engine's process (all its threads); other jobs on a "
                  "shared CPU distort it far less than wall-clock tok/s."]
    one = engines.get(ONE_THREAD_PROBE, {}).get("decode_tokens_per_s")
    many = lb.get("decode_tokens_per_s")
    if one and many:
        lines += ["", f"Decode on {s['threads']} threads ÷ on 1 thread, same .pte: lowerbench-pte {ratio(many, one)}."]
    stock = engines.get(STOCK_THREADS_PROBE, {})
    if stock.get("prefill_tokens_per_s") and lb.get("prefill_tokens_per_s"):
        lines += ["", f"Lowerbench's thread policy (recipes/process/thread_policy.py), same .pte with ÷ without it: prefill "
                      f"{ratio(lb['prefill_tokens_per_s'], stock['prefill_tokens_per_s'])}, decode "
                      f"{ratio(lb.get('decode_tokens_per_s'), stock.get('decode_tokens_per_s'))}."]
    weight_mb = s.get("decode_weight_mb_per_token")
    if memory and memory.get("read_gb_per_s") and weight_mb:
        bound = memory["read_gb_per_s"] * 1000 / weight_mb
        lines += ["", f"Memory-bound ceiling: the machine read {fmt(memory['read_gb_per_s'])} GB/s on {s['threads']} "
                      f"threads (bench/memory.py, median of {memory['runs']} runs in turn with the engines); one decode "
                      f"step reads {fmt(weight_mb)} MB of int4 g32 weights, so no engine can decode faster than "
                      f"{fmt(bound)} tok/s on it."]
        if many:
            share = many / bound
            lines.append(f"lowerbench-pte decodes at {share:.0%} of it; it reads its weights at "
                         f"{fmt(many * weight_mb / 1000)} GB/s.")
    return lines


def runner_table(data: dict) -> list[str]:
    s = data["settings"]
    if not data.get("runs"):
        return ["### ExecuTorch's LLM runner", *(f"Not run: {why}" for why in data.get("skipped", {}).values())]
    lines = [f"### ExecuTorch's LLM runner against the Python step loop ({s['new_tokens']} new tokens, greedy, "
             f"{s['threads']} threads, max context {s['max_seq_len']}, same prompt)",
             _meta_line(data["meta"], f"median of {data['meta']['runs_requested']} runs per figure, engines in turn "
                                      f"within each run, each in its own process"), "",
             "| program · engine | prefill tok/s | decode tok/s | decode tok/s range | first token ms | load ms "
             "| prompt tokens | new tokens | runs |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in data["engines"].items():
        low_high = "–" if not row.get("decode_tokens_per_s_range") else "–".join(
            fmt(x) for x in row["decode_tokens_per_s_range"])
        early = f" ({row['runs_stopped_early']} stopped early)" if row.get("runs_stopped_early") else ""
        lines.append(f"| {name} | {fmt(row.get('prefill_tokens_per_s'))} | {fmt(row.get('decode_tokens_per_s'))} "
                     f"| {low_high} | {fmt(row.get('time_to_first_token_ms'), 0)} | {fmt(row.get('model_load_ms'), 0)} "
                     f"| {row.get('prompt_tokens', '–')} | {row.get('new_tokens', '–')}{early} | {row['runs']} |")
    for name, why in data.get("skipped", {}).items():
        lines.append(f"| {name} | not run: {why} | | | | | | | 0 |")
    if data.get("ratios"):
        lines += ["", "| same-run ratio (median over runs of the pair measured back to back) | prefill | decode |",
                  "|---|---|---|"]
        lines += [f"| {r['what']} | {fmt(r['prefill_tokens_per_s'], 2)}× | {fmt(r['decode_tokens_per_s'], 2)}× |"
                  for r in data["ratios"]]
    lines += ["", f"{RUNNER}: rates from the runner's own Stats (prefill: prompt tokens over tokenizing + prefill; "
                  f"decode: generated tokens after the first over the rest, both on its millisecond clock). "
                  f"{STEP_LOOP}: bench/decode.py's timing of recipes/running/generate.py's loop, the figures the app showed "
                  f"before it ran the runner. The runner's Python binding cannot ignore end of sequence; the prompt "
                  f"(\"{s['prompt']}\") keeps both programs generating, and a run that stops early says so."]
    return lines


def export_table(data: dict) -> list[str]:
    peers = data["peers"]
    lb, opt = peers.get("lowerbench", {}), peers.get("optimum", {})
    lines = [f"### Export (xnnpack-8da4w vs optimum-cli xnnpack 8da4w/8w, max_seq_len {data['settings']['max_seq_len']})",
             _meta_line(data["meta"]), "",
             "| tool | wall s | CPU s | peak RSS MB (process tree) | .pte MB | runs |", "|---|---|---|---|---|---|"]
    for name, row in peers.items():
        lines.append(f"| {name} | {fmt(row['wall_s'])} | {fmt(row.get('cpu_s'))} | {fmt(row['peak_rss_mb'], 0)} "
                     f"| {fmt(row['pte_mb'])} | {row['runs']} |")
        for failed in row.get("failed_runs", []):
            lines.append(f"| {name} (unfinished) | > {fmt(failed['wall_s'])} | > {fmt(failed['cpu_s'])} "
                         f"| ≥ {fmt(failed.get('peak_rss_mb'), 0)} | | exit {failed['returncode']} |")
    for name, why in data.get("skipped", {}).items():
        lines.append(f"| {name} | not run: {why} | | | | 0 |")
    if lb.get("wall_s") and opt.get("wall_s"):
        full = peers.get("lowerbench-full", {})
        lines += ["", f"Lowerbench (`--export-only`: checkpoint folder → .pte, what optimum-cli does) ÷ optimum wall "
                      f"time: **{ratio(lb['wall_s'], opt['wall_s'])}**. "
                      + (f"The whole Lowerbench job (also the fp32 reference and runtime generations and two fidelity "
                         f"passes) ÷ optimum: {ratio(full['wall_s'], opt['wall_s'])}. " if full.get("wall_s") else "")
                      + f"CPU-time ratio {ratio(lb.get('cpu_s'), opt.get('cpu_s'))}. "
                      f"Peak RSS ratio {ratio(lb['peak_rss_mb'], opt['peak_rss_mb'])}. "
                      "optimum-cli reports no stage times, so per-stage ratios are not available."]
    if lb.get("stages_s"):
        stages = lb["stages_s"]
        lines += ["", "Lowerbench stages (s, report.json timings_s): "
                  + " · ".join(f"{k} {fmt(v)}" for k, v in stages.items() if v is not None)]
    return lines


def scaling_table(data: dict) -> list[str]:
    rows = data["layers"]
    lines = [f"### Export scaling with depth ({data['settings']['recipe']}, Lowerbench functions in one process)",
             _meta_line(data["meta"]), "", "![export time and peak RSS vs layers](scaling.png)", "",
             "| layers | load s | quantize s | export s | lower s | serialize s | quantize→serialize s | s per layer | peak RSS MB | runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        s = row["stages_s"]
        lines.append(f"| {row['layers']} | {fmt(s['load'])} | {fmt(s['quantize'])} | {fmt(s['export'])} | {fmt(s['lower'])} "
                     f"| {fmt(s['serialize'])} | {fmt(s['export_path'])} | {fmt(s['export_path'] / row['layers'], 2)} "
                     f"| {fmt(row['peak_rss_mb'], 0)} | {row['runs']} |")
    if len(rows) >= 3 and data["meta"]["runs_requested"] >= 3:
        lines += ["", f"Growth: {_growth(rows)}"]
    elif len(rows) >= 3:
        lines += ["", "Growth not judged: single runs on a shared CPU scatter more than the trend (`--runs 3`)."]
    return lines


def _growth(rows: list[dict]) -> str:
    """Least-squares fit of quantize→serialize time = a + b·L + c·L²; quadratic growth shows as c·L² being a
    large share of the time at the deepest point."""
    import numpy as np

    layers = np.array([r["layers"] for r in rows], dtype=float)
    t = np.array([r["stages_s"]["export_path"] for r in rows])
    if len(rows) < 3:
        return "too few points"
    c, b, a = np.polyfit(layers, t, 2)
    share = c * layers[-1] ** 2 / t[-1]
    return (f"fit t ≈ {a:.1f} + {b:.2f}·L + {c:.4f}·L² s; the L² term is {share:.0%} of the time at "
            f"{int(layers[-1])} layers ({'linear' if abs(share) < 0.15 else 'not linear'} by that measure).")


def scaling_plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["layers"]
    layers = [r["layers"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("export_path", "quantize→serialize"), ("export", "torch.export"), ("lower", "to_edge_transform_and_lower")):
        ax.plot(layers, [r["stages_s"][key] for r in rows], marker="o", label=label)
    ax.set_xlabel("decoder layers")
    ax.set_ylabel("seconds")
    rss = ax.twinx()
    rss.plot(layers, [r["peak_rss_mb"] for r in rows], color="grey", linestyle="--", marker="x", label="peak RSS")
    rss.set_ylabel("peak RSS MB (dashed)")
    ax.legend(loc="upper left")
    ax.set_title(f"Lowerbench export vs depth (median of {data['meta']['runs_requested']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def scale_plot(data: dict, path: Path) -> None:
    """Peak RSS, export wall time and .pte size against parameter count, one line per peer: cost that grows
    linearly with the model is a straight line through the shapes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for peer in dict.fromkeys(r["peer"] for r in data["shapes"]):
        rows = [{**r, "params": params_of(data, r["shape"])} for r in data["shapes"] if r["peer"] == peer and r["runs"]]
        rows = sorted((r for r in rows if r["params"]), key=lambda r: r["params"])
        if not rows:
            continue
        x = [r["params"] / 1e9 for r in rows]
        for ax, key, scale in zip(axes, ("peak_rss_mb", "wall_s", "pte_mb"), (1 / 1024, 1, 1)):
            ax.plot(x, [(r.get(key) or 0) * scale for r in rows], marker="o", label=peer)
    for ax, label in zip(axes, ("peak RSS GiB", "export wall s", ".pte MB")):
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel(label)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Export cost vs model size ({data['meta']['date'][:10]}, {data['meta']['machine']['cpu']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def breakdown_table(data: dict) -> list[str]:
    s = data["settings"]
    lines = [f"### Where a decode step goes (xnnpack-8da4w with one part taken out; {s['new_tokens']} new tokens, "
             f"{s['threads']} threads, one process)",
             _meta_line(data["meta"], f"median over {len(data.get('timings', []))} processes (one per rotation of the "
                                      f"load order) × {s['rounds']} rounds, each round one generation per program in turn"),
             "", "| program | what it lacks | decode tok/s | ms per token | ms per token vs full | prefill tok/s |",
             "|---|---|---|---|---|---|"]
    lacks = data.get("what_each_lacks", {})
    for name, row in data.get("engines", {}).items():
        what = lacks.get(name, "– (optimum-executorch's own .pte, same process)" if name == "optimum-pte" else "")
        lines.append(f"| {name} | {what} | {fmt(row['decode_tokens_per_s'])} | {fmt(row['ms_per_token'], 3)} "
                     f"| {fmt(row['ms_per_token_vs_full'], 3)} | {fmt(row['prefill_tokens_per_s'], 0)} |")
    for name, why in data.get("skipped", {}).items():
        lines.append(f"| {name} | not run: {why} | | | | |")
    for export in data.get("exports", []):
        if export["returncode"] != 0:
            lines.append(f"| {export['variant']} | export failed (bench/results/tmp/logs) | | | | |")
    lines += ["", "The programs without a part compute wrong tokens on purpose: they are only timed, to show what "
                  "the step would cost without that part (bench/breakdown.py)."]
    return lines + _floor_lines(data.get("floor"))


def _floor_lines(floor: dict | None) -> list[str]:
    if not floor:
        return []
    c, work = floor["costs"], floor["work"]
    lines = ["", f"**Against the floor of XNNPACK's kernels** (bench/floor.py, probe programs timed on the runtime, "
                 f"median of {floor['processes']} processes, in turn with the timings above):",
             f"- XNNPACK's int4 g32 linear streams weights at {fmt(c['stream_gb_per_s'])} GB/s from memory "
             f"({fmt(c['l3_gb_per_s'])} GB/s from the L3 cache); every int4 linear costs "
             f"{fmt(c['us_per_linear'], 2)} µs on top ({fmt(c['us_per_linear_in_l3'], 2)} µs in L3), every other op "
             f"{fmt(c['us_per_op'], 3)} µs"
             + (f"; an RMSNorm over the hidden size {fmt(c['us_per_norm'], 2)} µs ({fmt(c['us_per_norm_with_xnnpack_mean'], 2)} "
                f"µs with XNNPACK's mean instead of Lowerbench's linear)." if c.get("us_per_norm") else "."),
             f"- The full step, {fmt(floor['full_ms'], 3)} ms = {fmt(floor['shared_kernels_ms'], 3)} ms in the two "
             f"ExecuTorch kernels optimum's `.pte` calls alike (custom_sdpa and update_cache; "
             + ("both taken out at once" if floor.get("shared_kernels_how", "").startswith("both") else
                "the sum of the two rows above, which overlap and so overstate it") + ") + "
             f"{fmt(floor['own_ms'], 3)} ms of Lowerbench's own part."
             + (f" Probed alone, the same kernels for all layers take {fmt(c['attention_ms_warm'], 3)} ms with the "
                f"KV caches in the L3 cache and {fmt(c['attention_ms_after_weights'], 3)} ms right after a step's "
                f"worth of weights went through it." if c.get("attention_ms_after_weights") else ""),
             f"- Its delegated work, {work['quantized_linears']} int4 linears, {work['other_ops']} other ops and "
             f"{fmt(floor['weight_mb'])} MB of weights, can cost no less than {fmt(floor['own_floor_ms'], 3)} ms with "
             f"these kernels: the own part takes {ratio(floor['own_ms'], floor['own_floor_ms'])} the floor's time."]
    if floor.get("optimum_ms") is not None:
        lines.append(f"- optimum's `.pte` takes {fmt(floor['optimum_ms'], 3)} ms per step; at the floor, Lowerbench's "
                     f"step would take {fmt(floor['own_floor_ms'] + floor['shared_kernels_ms'], 3)} ms.")
    return lines


def scale_table(data: dict) -> list[str]:
    lines = ["### Scale (random bf16 checkpoints with the published configs; max context 512)",
             _meta_line(data["meta"]), "",
             "| shape | peer | wall s | peak RSS MB (process tree) | estimate GB | .pte (+ .ptd) MB | stage peaks MB | runs |",
             "|---|---|---|---|---|---|---|---|"]
    for row in data["shapes"]:
        stages = ", ".join(f"{k} {v:.0f}" for k, v in (row.get("stage_peaks_mb") or {}).items())
        lines.append(f"| {row['shape']} | {row['peer']} | {fmt(row.get('wall_s'))} | {fmt(row.get('peak_rss_mb'))} "
                     f"| {fmt(row.get('estimate_gb'), 2)} | {fmt(row.get('pte_mb'))} | {stages} | {row['runs']} |")
    for name, why in data.get("skipped", {}).items():
        lines.append(f"| {name} | not run: {why} | | | | | | 0 |")
    if data.get("decode_summary"):
        lines += ["", "| shape | engine | prompt tokens | prefill tok/s | decode tok/s |", "|---|---|---|---|---|"]
        for d in data["decode_summary"]:
            engine = d["engine"] if RUNNER in d["engine"] else f"{d['engine']} (executorch-runtime step loop)"
            lines.append(f"| {d['shape']} | {engine} | {d.get('prompt_tokens')} "
                         f"| {fmt(d['prefill_tokens_per_s'])} | {fmt(d['decode_tokens_per_s'])} |")
    if data.get("ratios"):
        lines += ["", "Lowerbench ÷ optimum-cli, export-only xnnpack-8da4w (with hqq, optimum's qparams; and with "
                  "Lowerbench's default algorithm), paired within each run:", "",
                  "| shape | export wall | export wall, default algorithm | peak RSS | .pte (+ .ptd) size | prefill tok/s "
                  f"| decode tok/s | prefill tok/s ({RUNNER}) | decode tok/s ({RUNNER}) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in data["ratios"]:
            q = r["lowerbench_over_optimum"]
            lines.append(f"| {r['shape']} | " + " | ".join(ratio_cell(q.get(k)) for k in (
                "export_wall", "default_export_wall", "peak_rss", "pte_bytes", "prefill_tokens_per_s",
                "decode_tokens_per_s", "runner_prefill_tokens_per_s", "runner_decode_tokens_per_s")) + " |")
    return lines


def versions_table(data: dict) -> list[str]:
    installs = data["settings"]["installs"]
    describe = lambda i: f"executorch {i['executorch']}, torch {i['torch']}, torchao {i['torchao']} ({i['commit']})"
    lines = [f"### Versions (export-only {data['settings']['recipe']}, max context {data['settings']['max_seq_len']}; "
             "decode on each install's own runtime)", _meta_line(data["meta"]), "",
             f"current: {describe(installs['current'])}; baseline: {describe(installs['baseline'])}.", "",
             "| shape | install | wall s | peak RSS MB | .pte MB | prefill tok/s | decode tok/s | runs |",
             "|---|---|---|---|---|---|---|---|"]
    for row in data["shapes"]:
        for name in ("current", "baseline"):
            r = row[name]
            lines.append(f"| {row['shape']} | {name} | {fmt(r['wall_s'])} | {fmt(r['peak_rss_mb'])} | {fmt(r['pte_mb'])} "
                         f"| {fmt(r['prefill_tokens_per_s'])} | {fmt(r['decode_tokens_per_s'])} | {r['runs']} |")
    lines += ["", "current ÷ baseline, paired within each run:", "",
              "| shape | export wall | peak RSS | .pte size | prefill tok/s | decode tok/s |", "|---|---|---|---|---|---|"]
    for row in data["shapes"]:
        q = row["current_over_baseline"]
        lines.append(f"| {row['shape']} | " + " | ".join(ratio_cell(q.get(k)) for k in (
            "wall", "peak_rss", "pte", "prefill", "decode")) + " |")
    return lines


def _front_meta_lines(data: dict) -> list[str]:
    def how(meta: dict) -> str:
        runs = meta.get("runs_requested")
        return ("built-in model: one full job per row, one after another in one invocation (fidelity); every .pte: "
                f"median of {runs} decode runs, the programs in turn within each run")

    lines = [_meta_line(data["meta"], how(data["meta"]))]
    earlier = data["meta"].get("earlier_meta")
    while earlier:
        lines.append("earlier rows: " + _meta_line(earlier, how(earlier)))
        earlier = earlier.get("earlier_meta")
    return lines


def _front_beats(row: dict) -> str:
    if row["beats_default"] is None:
        return "– (fidelity not measured)"
    if is_default(row):
        return "the default"
    return "**yes**" if row["beats_default"] else "no"


def _front_8bit(row: dict) -> str:
    # loads torch, which bench's driver leaves to the processes it starts
    from quant.mixed_precision import describe_units

    # rows measured before the output layer became a unit list decoder layer indices
    units = row.get("units_8bit") or [f"model.layers.{i}" for i in row.get("layers_8bit") or ()]
    if not units:
        return "–" if not row["mixed_precision_budget"] else "none fit"
    return f"{describe_units(units)}, +{fmt(row['extra_bytes_per_token'] / 1e6, 2)} MB/token"


def _front_engine(row: dict) -> str:
    if not row["decode_engine"]:
        return "–"
    return row["decode_engine"] + (f", {row['new_tokens']} tokens" if row.get("new_tokens") else "")


def front_table(data: dict) -> list[str]:
    s = data["settings"]
    lines = [f"### Speed–quality front of {s['recipe']} (int4 weight groups and algorithms; max context "
             f"{s['max_seq_len']}, {s['threads']} threads)", *_front_meta_lines(data), "",
             "![perplexity ratio against weight bytes per token and decode speed](front.png)", "",
             "| model | algorithm | group | 8-bit layers | weight MB/token | .pte MB | perplexity ratio (eval / held-out) "
             "| top-1 % (eval / held-out) | fidelity engine | decode tok/s | prefill tok/s | decode engine "
             "| quantize s | beats the default on both |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        weights = "built-in" if row["full_job"] else "random weights"
        failed = "" if row["ok"] else " (failed, see its log)"
        lines.append(
            f"| {row['shape']} ({weights}) | {row['algorithm']}{failed} | {row['group_size']} | {_front_8bit(row)} "
            f"| {fmt(row['weight_mb_per_token'], 2)} | {fmt(row['pte_mb'])} "
            + (f"| {fmt(row['perplexity_ratio'], 3)} / {fmt(row['heldout_perplexity_ratio'], 3)} "
               f"| {fmt(row['top1_agreement_percent'])} / {fmt(row['heldout_top1_agreement_percent'])} "
               f"| {row['fidelity_engine'] or '–'} " if row["full_job"] else f"| {row['fidelity_engine']} | | | ")
            + f"| {fmt(row['decode_tokens_per_s'])} | {fmt(row['prefill_tokens_per_s'])} "
            f"| {_front_engine(row)} "
            f"| {fmt(row['quantize_s'])} | {_front_beats(row)} |")
    for name, why in data.get("skipped", {}).items():
        lines.append(f"| {name} | not run: {why} | | | | | | | | | | | | |")
    same = data.get("same_bytes_across_algorithms") or {}
    if same:
        lines += ["", "Weight bytes per token equal across the algorithms at one group size (the algorithm "
                      "changes the values, not the program): "
                  + "; ".join(f"{k} {'yes' if v['same'] else '**no**'} ({', '.join(v['algorithms'])})"
                              for k, v in same.items()) + "."]
    spread = data.get("same_program_decode_range") or {}
    if spread:
        lines += ["", "Decode tok/s of one program across its algorithm rows (run-to-run noise a speed difference "
                      "has to exceed): " + ", ".join(f"{k} {fmt(lo)}–{fmt(hi)}" for k, (lo, hi) in spread.items()) + "."]
    lines += ["", "Beats the default on both: decode faster than hqq g32 (optimum-executorch's default, "
                  "`--qlinear 8da4w`, group 32) on the same engine, measured in the same invocation, by more than the "
                  f"largest spread of one program above ({data.get('decode_noise', 0):.1%}), and a lower "
                  "perplexity ratio against fp32 eager on the evaluation text. Decode tok/s is each .pte's median over "
                  "the timed runs (a built-in row not timed shows its own short sample generation, in the runner). "
                  "Fidelity needs real weights: the "
                  "random-weight shapes show bytes and speed only, timed with minmax, since every algorithm makes the "
                  "same program at one group size."]
    return lines


def front_plot(data: dict, path: Path) -> None:
    """Perplexity ratio against weight bytes per token and against decode speed on the built-in model, one
    marker per algorithm, each point labelled by its group size; and decode speed against bytes per token of
    the random-weight shapes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    markers = {"minmax": "o", "hqq": "s", "awq": "^", "spinquant": "D", "gptq": "v", "awq-gptq": "P"}
    real = [r for r in data["rows"] if r["full_job"] and r["ok"] and r["perplexity_ratio"]]
    shapes = [r for r in data["rows"] if not r["full_job"] and r["ok"] and r["decode_tokens_per_s"]]
    fig, axes = plt.subplots(1, 3 if shapes else 2, figsize=(15 if shapes else 10, 4.4))
    for ax, key, label in ((axes[0], "weight_mb_per_token", "weight MB read per token"),
                           (axes[1], "decode_tokens_per_s", "decode tok/s")):
        for algorithm, marker in markers.items():
            rows = [r for r in real if r["algorithm"] == algorithm]
            ax.scatter([r[key] for r in rows], [r["perplexity_ratio"] for r in rows], marker=marker, label=algorithm)
            for r in rows:
                text = (f"g{r['group_size']}" + (" +8-bit" if r["mixed_precision_budget"] else "")
                        + (" (optimum's default)" if is_default(r) else " ★" if r.get("beats_default") else ""))
                ax.annotate(text, (r[key], r["perplexity_ratio"]), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
        ax.set_xlabel(label)
        ax.set_ylabel("perplexity ratio vs fp32 (lower is better)")
    engines = sorted({r["decode_engine"] for r in real if r["decode_engine"]})
    fidelity = sorted({r["fidelity_engine"] for r in real if r["fidelity_engine"]})
    axes[0].set_title(f"{real[0]['shape'] if real else ''}: fidelity on {', '.join(fidelity)}", fontsize=9)
    axes[1].set_title(f"decode on {', '.join(engines)}", fontsize=9)
    axes[0].legend(fontsize=8)
    if shapes:
        for shape in dict.fromkeys(r["shape"] for r in shapes):
            rows = sorted((r for r in shapes if r["shape"] == shape), key=lambda r: r["weight_mb_per_token"])
            axes[2].plot([r["weight_mb_per_token"] for r in rows], [r["decode_tokens_per_s"] for r in rows],
                         marker="o", label=f"{shape} (random weights, minmax)")
            for r in rows:
                axes[2].annotate(f"g{r['group_size']}", (r["weight_mb_per_token"], r["decode_tokens_per_s"]),
                                 textcoords="offset points", xytext=(4, 4), fontsize=7)
        axes[2].set_xlabel("weight MB read per token")
        axes[2].set_ylabel("decode tok/s")
        axes[2].set_title(f"decode on {shapes[0]['decode_engine']}", fontsize=9)
        axes[2].legend(fontsize=8)
    meta = data["meta"]
    fig.suptitle(f"xnnpack-8da4w int4 front ({meta['date'][:10]}, {meta['machine']['cpu']}, "
                 f"{data['settings']['threads']} threads; ★ beats optimum's default on both)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def kv_table(data: dict) -> list[str]:
    """bench/kv.py: the LLM runner at positions of one long context, fp32 and int8 caches and optimum's .pte."""
    s, rows = data["settings"], data["rows"]
    fp32, int8 = PROGRAMS
    shape = s.get("shape", BUILTIN_SHAPE)
    model = "the built-in model" if shape == BUILTIN_SHAPE else f"{shape}'s shape, random weights"
    lines = [f"### KV cache in ExecuTorch's LLM runner: {model} ({s['recipe']}, {s['quant_algorithm']} qparams, context "
             f"{s['context']}, {s['new_tokens']} new tokens ending at each position, greedy, {s['threads']} threads)",
             _meta_line(data["meta"], "median of the runs per figure, programs in turn at each position, each "
                                      "measurement its own process"), "",
             "| position | program | prefill tok/s | decode tok/s | peak RSS MB | int8 ÷ this (decode) "
             "| int8 ÷ this (RSS) | runs | stopped early |", "|---|---|---|---|---|---|---|---|---|"]
    for position in s["positions"]:
        mine = rows.get(f"{int8} @ {position}", {})
        for program in (fp32, int8, OPTIMUM):
            row = rows.get(f"{program} @ {position}")
            if not row:
                continue
            own = program == int8
            lines.append(f"| {position} | {program} | {fmt(row['prefill_tokens_per_s'])} "
                         f"| {fmt(row['decode_tokens_per_s'])} | {fmt(row['peak_rss_mb'], 0)} "
                         f"| {'' if own else ratio(mine.get('decode_tokens_per_s'), row['decode_tokens_per_s'])} "
                         f"| {'' if own else ratio(mine.get('peak_rss_mb'), row['peak_rss_mb'])} | {row['runs']} "
                         f"| {row['runs_stopped_early']} |")
    for name, why in data.get("skipped", {}).items():
        lines.append(f"| | {name} | not run: {why} | | | | | 0 | |")
    floor = rows.get(FLOOR, {}).get("peak_rss_mb")
    if floor:
        last = s["positions"][-1]
        lines += ["", f"RSS floor: the runner's process with its imports and thread pool and no program peaks at "
                      f"{fmt(floor, 0)} MB (median of {rows[FLOOR]['runs']}); above it, at position {last}:"]
        above = {p: (rows.get(f"{p} @ {last}") or {}).get("peak_rss_mb") for p in (fp32, int8, OPTIMUM)}
        above = {p: v - floor for p, v in above.items() if v}
        lines.append(", ".join(f"{p} {fmt(v, 0)} MB" for p, v in above.items())
                     + (f"; int8 ÷ fp32 above the floor {ratio(above.get(int8), above.get(fp32))}."
                        if above.get(int8) and above.get(fp32) else "."))
    attention = {name: row["attention_ms_by_position"] for name, row in rows.items() if name.startswith(ATTENTION)}
    if attention:
        lines += ["", "The cache's work alone (every layer's cache write and attention on the model's cache shape, no "
                      "weights, lowered as the programs are), ms per decode step at "
                      + ", ".join(str(p) for p in s["positions"]) + ": "
                      + "; ".join(f"{name[len(ATTENTION):].strip(' ()')} "
                                  + " / ".join(fmt(ms.get(str(p)), 2) for p in s["positions"])
                                  for name, ms in attention.items()) + "."]
    lines += ["", "Each measurement prefills running text (the evaluation texts chained, no chat template) up to "
                  f"{s['new_tokens']} tokens before the position and decodes {s['new_tokens']} tokens to it, in a "
                  "fresh process after a 2-token warm-up; peak RSS is the process tree's (bench/measure.py)."]
    return lines


def kv_fidelity_table(data: dict) -> list[str]:
    """bench/kv_fidelity.py: each cache against the fp32 cache with the same weights."""
    lines = ["### KV cache fidelity against the fp32 cache (built-in model, evaluation texts chained to each "
             "context, on the runtime)", _meta_line(data["meta"], "one program per weights and cache, deterministic"),
             "", "| weights | cache | context | perplexity (fp32 cache) | perplexity ratio | top-1 % | mean KL "
                 "| against fp32 weights and cache: perplexity ratio / mean KL |",
             "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        weights = row["weights"] + (f" ({row['quant_algorithm']})" if row.get("quant_algorithm") else "")
        lines.append(f"| {weights} | {row['cache']} | {row['context']} | {fmt(row['perplexity_fp32'], 3)} "
                     f"| {fmt(row['perplexity_ratio'], 4)} | {fmt(row['top1_agreement_percent'], 2)} "
                     f"| {fmt(row['mean_kl'], 6)} | {fmt(row.get('fp32_model_perplexity_ratio'), 4)} / "
                     f"{fmt(row.get('fp32_model_mean_kl'), 6)} |")
    lines += ["", "Perplexity ratio, top-1 and mean KL against the program with the same weights and an fp32 cache; "
                  "the text repeats after 817 tokens, so at 2048 a model that attends that far copies it (a ring "
                  "of 512 recent tokens cannot)."]
    return lines


def ratio_cell(value) -> str:
    return "–" if value is None else f"{value:.2f}×"


ONE_OFFS = ("The scaling, breakdown and kv-fidelity tables come from one-off experiments removed after commit "
            "cb30814, their last version (`git show cb30814:bench/scaling.py`, `bench/breakdown.py`, "
            "`bench/kv_fidelity.py`).")


def write_all(results: Path) -> None:
    lines = ["# Lowerbench benchmark results", "",
             "Made by `python3 -m bench` (see bench/__main__.py); raw runs in the *.json files beside this one.",
             ONE_OFFS, ""]
    for name, render in (("decode", decode_table), ("runner", runner_table), ("export", export_table),
                         ("scaling", scaling_table), ("breakdown", breakdown_table), ("scale", scale_table),
                         ("versions", versions_table), ("front", front_table), ("kv", kv_table),
                         *((path.stem, kv_table) for path in sorted(results.glob("kv-*.json"))
                           if path.stem != "kv-fidelity"),
                         ("kv-fidelity", kv_fidelity_table)):
        path = results / f"{name}.json"
        if not path.is_file():
            lines += [f"### {name.capitalize()}", f"No results yet: `python3 -m bench --phases {name}`.", ""]
            continue
        data = json.loads(path.read_text())
        lines += render(data) + [""]
        if name == "scaling" and data["layers"]:
            scaling_plot(data, results / "scaling.png")
        if name == "scale" and data["shapes"]:
            scale_plot(data, results / "scale.png")
            lines += ["![export cost vs model size](scale.png)", ""]
        if name == "front" and data["rows"]:
            front_plot(data, results / "front.png")
    readme = results / "README.md"
    kept = readme.read_text().partition(HAND_WRITTEN)[1:] if readme.is_file() else ("", "")
    readme.write_text("\n".join(lines) + ("\n" + "".join(kept) if kept[0] else ""))


if __name__ == "__main__":
    write_all(Path(__file__).resolve().parent / "results")
