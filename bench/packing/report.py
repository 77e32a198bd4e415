"""Run the study and present it: the JSON result, the Markdown table, the plot."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from bench.packing.sim import MAX_QUEUE_WAIT_S, replay
from bench.packing.strategies import Strategy, default_strategies
from bench.packing.trace import generate

# Keys every strategy reports, in table order (the headline keys first).
TABLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("pods_served", "pods served"),
    ("memory_utilisation", "memory util."),
    ("active_memory_utilisation", "active util."),
    ("demand_met", "demand met"),
    ("oom_crashes", "OOM crashes"),
    ("waits", "waits"),
    ("burst_denied", "bursts denied"),
    ("evictions", "evictions"),
    ("swaps", "swaps"),
    ("idle_reaped", "idle reaped"),
    ("pods_disrupted", "pods disrupted"),
    ("batch_completed", "batch jobs done"),
    ("mean_queue_delay_min", "mean queue (min)"),
)
SENSITIVITY_KEYS = ("pods_served", "memory_utilisation", "demand_met", "oom_crashes", "evictions")


def _describe(s: Strategy) -> dict[str, Any]:
    d: dict[str, Any] = {"model": " ".join((type(s).__doc__ or "").split("\n\n")[0].split())}
    if s.slots_per_gpu is not None:
        d["pods_per_gpu"] = s.slots_per_gpu
    if s.isolated and s.slots_per_gpu is None:
        d["allocation_policy"] = s.allocation_policy
    if s.resolvers:
        d.update(
            resolvers=list(s.resolvers),
            wait_timeout_s=s.wait_timeout_s,
            evict_idle_threshold_s=s.evict_idle_threshold_s,
            host_ram_budget_gib=s.host_ram_budget_gib,
        )
    if s.idle_reaping:
        d["idle_timeout_s"] = s.idle_timeout_s
    return d


def run_study(
    seed: int = 7,
    sensitivity_seeds: int = 5,
    strategies: list[Strategy] | None = None,
    trace_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Replay the seeded day against every strategy; repeat on other seeds for the spread."""
    strategies = strategies or default_strategies()
    tkw = trace_kwargs or {}
    trace = generate(seed, **tkw)
    results = {s.name: replay(trace, s).to_json() for s in strategies}
    data: dict[str, Any] = {
        "study": "capacity: one synthetic day on an 8-GPU node (a model, not a measurement)",
        "seed": seed,
        "trace": trace.summary() | {"generator": trace.params},
        "admission": {"queue": "FIFO, no head-of-line blocking", "max_queue_wait_s": MAX_QUEUE_WAIT_S},
        "strategies": results,
        "models": {s.name: _describe(s) for s in strategies},
    }
    if sensitivity_seeds > 1:
        seeds = [seed + i for i in range(sensitivity_seeds)]
        per_seed = {s.name: [replay(generate(x, **tkw), s).to_json() for x in seeds] for s in strategies}
        data["sensitivity"] = {
            "seeds": seeds,
            "strategies": {
                name: {
                    key: {
                        "mean": round(statistics.fmean(float(r[key]) for r in rs), 4),  # type: ignore[arg-type]
                        "min": min(r[key] for r in rs),  # type: ignore[type-var]
                        "max": max(r[key] for r in rs),  # type: ignore[type-var]
                    }
                    for key in SENSITIVITY_KEYS
                }
                for name, rs in per_seed.items()
            },
        }
    return data


def write_json(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _cell(key: str, value: Any) -> str:
    if key in ("memory_utilisation", "active_memory_utilisation", "demand_met"):
        return f"{100 * float(value):.0f} %"
    return str(value)


def markdown_table(data: dict[str, Any]) -> str:
    served_of = data["trace"]["pods"]
    head = "| strategy | " + " | ".join(label for _, label in TABLE_COLUMNS) + " |"
    rule = "|---|" + "---:|" * len(TABLE_COLUMNS)
    rows = []
    for name, r in data["strategies"].items():
        cells = [_cell(k, r[k]) + (f" / {served_of}" if k == "pods_served" else "") for k, _ in TABLE_COLUMNS]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    lines = [head, rule, *rows]
    sens = data.get("sensitivity")
    if sens:
        seeds = sens["seeds"]
        lines += [
            "",
            f"Across seeds {seeds[0]}..{seeds[-1]} (mean, [min, max]):",
            "",
            "| strategy | " + " | ".join(SENSITIVITY_KEYS) + " |",
            "|---|" + "---:|" * len(SENSITIVITY_KEYS),
        ]
        for name, keys in sens["strategies"].items():
            cells = []
            for k in SENSITIVITY_KEYS:
                v = keys[k]
                if k in ("memory_utilisation", "demand_met"):
                    cells.append(f"{100 * v['mean']:.0f} % [{100 * v['min']:.0f}, {100 * v['max']:.0f}]")
                else:
                    cells.append(f"{v['mean']:.1f} [{v['min']}, {v['max']}]")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


BEGIN, END = "<!-- packing-results:begin -->", "<!-- packing-results:end -->"


def update_doc(doc: Path, data: dict[str, Any]) -> None:
    """Replace the generated block of the study's page; the prose around it is hand-written."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{doc}: markers {BEGIN} and {END} not found")
    block = f"{BEGIN}\n<!-- generated by `python -m bench.packing --docs`; seed {data['seed']} -->\n\n"
    block += markdown_table(data) + f"\n\n{END}"
    doc.write_text(re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S))


def plot(data: dict[str, Any], path: Path) -> None:
    """Two panels: GPU memory in use over the day, and what each strategy served and broke."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["strategies"]
    total = data["trace"]["node"]["gpus"] * data["trace"]["node"]["gpu_memory_gib"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.4, 1]})
    for name, r in results.items():
        hourly = r["hourly_used_gib"]
        # The last hour's value is repeated so the step reaches the end of the day.
        ax1.step(
            range(len(hourly) + 1),
            [*hourly, hourly[-1]],
            where="post",
            label=name,
            linestyle="--" if name == "time_slicing" else "-",
        )
    ax1.axhline(total, color="grey", linewidth=0.8)
    ax1.text(23.8, total * 0.97, f"node: {total:.0f} GiB", ha="right", va="top", fontsize=8, color="grey")
    ax1.set(xlabel="hour of day", ylabel="GPU memory in use (GiB, hourly mean)", xlim=(0, 24))
    ax1.set_ylim(0, total * 1.05)
    ax1.set_title("Memory in use over the day", fontsize=10)
    ax1.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 0.93))

    names = list(results)
    x = list(range(len(names)))
    w = 0.38
    ax2.bar([i - w / 2 for i in x], [results[n]["pods_served"] for n in names], w, label="pods served")
    disrupted = [results[n]["pods_disrupted"] for n in names]
    ax2.bar([i + w / 2 for i in x], disrupted, w, label="pods crashed or evicted")
    # Crash and eviction counts dwarf pod counts: written on the bars, not drawn.
    for i, n in enumerate(names):
        note = f"{results[n]['oom_crashes']} OOM\n{results[n]['evictions']} evict"
        ax2.text(i + w / 2, disrupted[i] + 1, note, ha="center", va="bottom", fontsize=7)
    ax2.axhline(data["trace"]["pods"], color="grey", linewidth=0.8)
    ax2.set_xticks(x, [n.replace("_", "\n") for n in names], fontsize=8)
    ax2.set_ylim(0, data["trace"]["pods"] * 1.2)
    ax2.set_title(f"Pods served of {data['trace']['pods']}, and harm done", fontsize=10)
    ax2.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"Capacity study (model), seed {data['seed']}: 8 x 80 GiB, one day", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
