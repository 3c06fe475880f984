"""Draws the benchmarks' figures from ``docs/_data/bench/*.json`` with matplotlib (Agg).

Each benchmark writes its JSON file (``nox -s bench``) and the repository commits it;
:mod:`bench_figures` calls :func:`draw` while the docs build, so the build never runs
a benchmark. matplotlib is needed by the docs and bench sessions only, never by a
package. This module needs matplotlib alone (no Sphinx), so that it also runs as a
script: ``python docs/_ext/bench_plots.py OUT_DIR [DATA_DIR]`` draws every figure whose
JSON file exists into OUT_DIR (``nox -s bench`` does, after the benchmarks ran).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

from matplotlib.axes import Axes
from matplotlib.figure import Figure

DATA_DIR = Path("_data") / "bench"
OURS, PEER, LIMIT, TARGET = "#1f6fb4", "#e0821e", "#777777", "#c0392b"
RC = {
    "font.size": 10,
    "axes.titlesize": 10.5,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "legend.fontsize": 8.5,
    "legend.frameon": False,
    "svg.hashsalt": "dist-bench",  # the same data draws the same file
}

Data = dict[str, Any]


def _present(xs: Sequence[Any], ys: Sequence[float | None]) -> tuple[list[Any], list[float]]:
    """The points whose value was measured (``null`` in the JSON is a missing one)."""
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _footer(figure: Figure, data: Data) -> None:
    runs = data.get("runs")
    described = "; ".join(f"{part}: {run}" for part, run in runs.items()) if runs else data["run"]
    text = f"Data: docs/_data/bench/{data['benchmark']}.json, run {described}"
    if data.get("note"):
        text += f"\n({data['note']})"
    figure.text(0.01, -0.02, text, fontsize=8, color="#555555", va="top", wrap=True)


def _label_points(axes: Axes, xs: Sequence[Any], ys: Sequence[float], fmt: str) -> None:
    for x, y in zip(xs, ys, strict=True):
        axes.annotate(
            fmt.format(y),
            (x, y),
            textcoords="offset points",
            xytext=(0, 5),
            ha="center",
            fontsize=8.5,
        )


def _ranks_axis(axes: Axes, ranks: Sequence[int]) -> None:
    """Ranks on a log2 axis (2, 4, 8 equally apart), ticks at the measured counts."""
    axes.set_xscale("log", base=2)
    axes.set_xticks(ranks, [str(n) for n in ranks])
    axes.minorticks_off()
    axes.set_xlim(min(ranks) / 1.4, max(ranks) * 1.4)


def draw_launch(data: Data) -> Figure:
    """Start-up time against ranks, the ratio to torchrun, and crash-to-exit time."""
    hang = data.get("hang_to_restart_s")
    if hang:
        figure = Figure(figsize=(15, 3.6), layout="constrained")
        seconds, ratio, crash, hung = figure.subplots(1, 4, width_ratios=[1.3, 1, 0.9, 1.2])
        _draw_hang(hung, data)
    else:
        figure = Figure(figsize=(10, 3.6), layout="constrained")
        seconds, ratio, crash = figure.subplots(1, 3, width_ratios=[1.3, 1, 0.9])
    ranks = data["ranks"]
    for name, color in (("dist-launch", OURS), ("torchrun", PEER)):
        xs, ys = _present(ranks, data["start_to_exit_s"][name])
        seconds.plot(
            xs,
            ys,
            "o-",
            color=color,
            label=f"{name} (torchrun --standalone)" if name == "torchrun" else name,
        )
        _label_points(seconds, xs, ys, "{:.2f} s")
    seconds.axhline(
        data["floor_s"],
        color=LIMIT,
        ls="--",
        lw=1,
        label=f"floor: one `import torch`, {data['floor_s']:.2f} s",
    )
    missing = [
        str(n)
        for n, a, b in zip(ranks, *data["start_to_exit_s"].values(), strict=True)
        if a is None or b is None
    ]
    if missing:
        seconds.text(
            0.02,
            0.62,
            f"seconds at {', '.join(missing)} ranks\nnot kept for this run",
            transform=seconds.transAxes,
            fontsize=8.5,
            color="#555555",
        )
    seconds.set(
        xlabel="CPU ranks",
        ylabel="seconds, start to every rank's exit",
        title="Start-up: every rank does one all_reduce",
    )
    seconds.set_ylim(bottom=0)
    _ranks_axis(seconds, ranks)
    seconds.legend(loc="upper left")

    xs, ys = _present(ranks, data["ratio"])
    ratio.plot(xs, ys, "o-", color=OURS)
    _label_points(ratio, xs, ys, "{:.2f}x")
    target = data["targets"]["ratio_at_8_ranks"]
    ratio.axhline(target, color=TARGET, ls=":", label=f"target at 8 ranks: at most {target}x")
    ratio.axhline(1.0, color=PEER, lw=1, ls="--", label="torchrun")
    ratio.set(
        xlabel="CPU ranks",
        ylabel="dist-launch time / torchrun time",
        ylim=(0, 1.1),
        title="dist-launch / torchrun",
    )
    _ranks_axis(ratio, ranks)
    ratio.legend(loc="center right")

    names = ["dist-launch", "torchrun"]
    values = [data["crash_to_exit_s"][name] for name in names]
    present = [(n, v) for n, v in zip(names, values, strict=True) if v is not None]
    crash.barh(
        [n for n, _ in present],
        [v for _, v in present],
        color=[OURS if n == "dist-launch" else PEER for n, _ in present],
    )
    for index, (_, value) in enumerate(present):
        crash.text(value, index, f" {value:.2f} s", va="center", fontsize=8.5)
    limit = data["targets"]["crash_to_exit_s"]
    crash.axvline(limit, color=TARGET, ls=":", label=f"target: within {limit} s")
    crash.invert_yaxis()
    crash.set(xlabel="seconds", title=f"Crash to launcher exit, {data['crash_ranks']} ranks")
    crash.set_xlim(0, max([limit, *[v for _, v in present]]) * 1.3)
    crash.legend(loc="upper right")
    _footer(figure, data)
    return figure


def _draw_hang(axes: Axes, data: Data) -> None:
    """A hang's onset to dist-launch's report, and to the restarted group's first step."""
    rows = [
        ("dist-launch: report", data["hang_to_report_s"].get("dist-launch"), OURS),
        ("dist-launch: restarted", data["hang_to_restart_s"].get("dist-launch"), OURS),
        ("torchrun: restarted", data["hang_to_restart_s"].get("torchrun"), PEER),
    ]
    present = [(name, value, color) for name, value, color in rows if value is not None]
    axes.barh(
        [name for name, _, _ in present],
        [value for _, value, _ in present],
        color=[color for _, _, color in present],
    )
    for index, (_, value, _) in enumerate(present):
        axes.text(value, index, f" {value:.1f} s", va="center", fontsize=8.5)
    axes.invert_yaxis()
    axes.set(
        xlabel=f"seconds from the onset\n(--hang-timeout {data['hang_timeout_s']:g};\n"
        f"torchrun: gloo timeout {data['hang_gloo_timeout_s']:g} s)",
        title=f"Hang: report, restart ({data['hang_ranks']} ranks)",
    )
    axes.set_xlim(0, max([value for _, value, _ in present], default=1) * 1.35)


WORKSPACE_METHODS = {
    "shm": ("shared memory (get_tensors_parallel)", OURS),
    "nfsworkspace": ("NFSWorkspace", "#17a2b8"),
    "nfsws-nofsync": ("NFSWorkspace, durable=False", "#8fd3de"),
    "torch.save": ("torch.save / torch.load", PEER),
    "gloo-gather": ("gloo gather", "#9467bd"),
}


def draw_workspace(data: Data) -> Figure:
    """Exchange bandwidth against size with the machine's limits; NFSWorkspace speed-up."""
    calls = data.get("calls")
    exported = data.get("export")
    if calls and exported:
        figure = Figure(figsize=(13, 11.0), layout="constrained")
        (bandwidth, speedup), (per_call, export) = figure.subplots(2, 2)
        _draw_workspace_calls(per_call, calls)
        _draw_workspace_export(export, exported)
    elif calls:
        figure = Figure(figsize=(17, 5.0), layout="constrained")
        bandwidth, speedup, per_call = figure.subplots(1, 3)
        _draw_workspace_calls(per_call, calls)
    else:
        figure = Figure(figsize=(12, 5.0), layout="constrained")
        bandwidth, speedup = figure.subplots(1, 2)
    sizes = data["sizes_mib"]
    copy = data["copy_gbps"]
    in_gbps = all(value is not None for value in copy)
    scale = copy if in_gbps else [1.0] * len(sizes)

    def scaled(values: Sequence[float | None]) -> list[float | None]:
        return [None if v is None else v * s for v, s in zip(values, scale, strict=True)]

    x_copy = data["x_copy"]
    bandwidth.plot(
        sizes,
        scaled([1.0] * len(sizes)),
        "s--",
        color=LIMIT,
        lw=1,
        label="pre-faulted copy (ceiling)",
    )
    if "fresh tmpfs" in x_copy:
        fresh = x_copy["fresh tmpfs"]
        bandwidth.plot(
            *_present(sizes, scaled(fresh)),
            "^--",
            color=LIMIT,
            lw=1,
            mfc="white",
            label="fresh shm pages, one core (limit)",
        )
        # Runs since 0.3.0 measure the three senders writing at once; older ones kept
        # one core's rate only, and twice that stood for both cores.
        measured = x_copy.get("fresh tmpfs, 3 writers")
        both = measured or [None if v is None else 2 * v for v in fresh]
        bandwidth.plot(
            *_present(sizes, scaled(both)),
            ":",
            color=LIMIT,
            lw=1,
            label="fresh shm pages, 3 writers (the limit)"
            if measured
            else "fresh shm pages, both cores (2x)",
        )
        # Runs since 0.3.2 also measure the senders beside the receiver's copy of its
        # own value: the fresh pages the exchange's contract needs in all.
        with_own = x_copy.get("fresh tmpfs, 3 writers + own copy")
        if with_own:
            bandwidth.plot(
                *_present(sizes, scaled(with_own)),
                "-.",
                color=LIMIT,
                lw=1,
                label="fresh shm pages, 3 writers + receiver's own copy",
            )
    targets = data["targets"]
    three_writers = x_copy.get("fresh tmpfs, 3 writers")
    if "shm_x_fresh" in targets and three_writers:
        # Since issue 15 the target is a fraction of the 3-writer fresh-page limit.
        goal = targets["shm_x_fresh"]
        bandwidth.plot(
            *_present(sizes, scaled([None if v is None else goal * v for v in three_writers])),
            ":",
            color=TARGET,
            label=f"target for shared memory: {goal}x the 3-writer limit",
        )
    else:
        target = targets["shm_x_copy"]
        bandwidth.plot(
            sizes,
            scaled([target] * len(sizes)),
            ":",
            color=TARGET,
            label=f"target for shared memory: {target}x copy",
        )
    for key, (label, color) in WORKSPACE_METHODS.items():
        if key not in x_copy:
            continue
        xs, ys = _present(sizes, scaled(x_copy[key]))
        bandwidth.plot(xs, ys, "o-", label=label, color=color)
        if key == "shm":
            _label_points(bandwidth, xs, ys, "{:.2f}")
    bandwidth.set_xscale("log", base=2)
    bandwidth.set_yscale("log")
    bandwidth.set(
        xticks=sizes,
        xticklabels=[str(s) for s in sizes],
        xlabel=f"MiB per rank ({data['senders']} ranks send to rank 0)",
        ylabel="GB/s received" if in_gbps else "bandwidth / pre-faulted copy",
        title="Exchange bandwidth and the machine's limits",
    )
    bandwidth.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize="small")

    speed = data["speedup_over_torch_save"]
    labels = {
        "nfsworkspace": ("NFSWorkspace (durable)", OURS, "o-"),
        "nfsws-nofsync": ("NFSWorkspace, durable=False", "#6aa5d8", "o-"),
        "write+fsync": (
            "limit for a durable exchange\n(torch.save+load / write+fsync)",
            LIMIT,
            "^--",
        ),
    }
    for key, (label, color, style) in labels.items():
        if key in speed:
            xs, ys = _present(sizes, speed[key])
            speedup.plot(xs, ys, style, color=color, label=label)
            if key == "nfsworkspace":
                _label_points(speedup, xs, ys, "{:.2f}x")
    speedup.axhline(1.0, color=PEER, lw=1, ls="--", label="torch.save / torch.load")
    goal = data["targets"]["nfs_speedup"]
    speedup.axhline(goal, color=TARGET, ls=":", label=f"target: {goal}x")
    speedup.set_xscale("log", base=2)
    speedup.set(
        xticks=sizes,
        xticklabels=[str(s) for s in sizes],
        xlabel="MiB per rank",
        ylabel="speed-up over torch.save/load",
        ylim=(0, None),
        title="Through a directory: NFSWorkspace",
    )
    speedup.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize="small")
    for part, title in ((calls, "the cost of a call"), (exported, "the export")):
        part_run = (part or {}).get("run")
        if part_run and part_run != "the run above":
            note = f"{title}: run {part_run}"
            data = {**data, "note": f"{data['note']}; {note}" if data.get("note") else note}
    _footer(figure, data)
    return figure


CALL_METHODS = {
    "dist-workspace": ("dist-workspace", OURS),
    "Model Optimizer": ("Model Optimizer", PEER),
    "gloo handshake": ("a gloo group's handshake alone (no data)", PEER),
    "link handshake": ("limit: the link's handshake alone (no data)", LIMIT),
}
HATCHED = {"gloo handshake"}  # shares the peers' colour


def _draw_workspace_calls(axes: Axes, calls: Data) -> None:
    """Time per call over the gather floor, per workload, with the targets."""
    workloads = list(calls["workloads"])
    width = 0.8 / len(CALL_METHODS)
    middle = (len(CALL_METHODS) - 1) / 2
    for offset, (key, (label, color)) in enumerate(CALL_METHODS.items()):
        xs, ys = [], []
        for index, workload in enumerate(workloads):
            item = calls["workloads"][workload].get(key)
            if item is not None:
                xs.append(index + (offset - middle) * width)
                ys.append(item["x_floor"])
        if xs:
            hatch = "//" if key in HATCHED else None
            axes.bar(xs, ys, width, color=color, label=label, hatch=hatch, edgecolor="white")
            _label_points(axes, xs, ys, "{:.2f}x")
    axes.axhline(1.0, color=LIMIT, lw=1, ls="--", label="floor: gather (gather_object for configs)")
    for index, workload in enumerate(workloads):
        goal = calls["targets"].get(workload)
        if goal is not None:
            axes.hlines(goal, index - 0.45, index + 0.45, color=TARGET, ls=":")
            axes.annotate(
                f"target {goal}x",
                (index, goal),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                color=TARGET,
            )
    described = [
        f"{name}\n{row['calls']} calls"
        + (f", {row['kib_per_rank']} KiB" if row["kib_per_rank"] else "")
        for name, row in calls["workloads"].items()
    ]
    axes.set_xticks(range(len(workloads)), described)
    axes.set(
        ylabel="time per call / floor (with one read)",
        ylim=(0, None),
        title="The cost of a call (4 ranks, one host)",
    )
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, fontsize="small")


EXPORT_METHODS = {
    "export_sharded": ("export_sharded\n(every rank writes)", OURS),
    "export_sharded 256MB": ("sharded,\n256MB files", OURS),
    "gather + one file": ("gather to rank 0\n+ one file", PEER),
    "4 writers": ("limit: 4 writers,\nwrite + fsync", LIMIT),
    "1 writer": ("limit: 1 writer,\nwrite + fsync", LIMIT),
}


def _draw_workspace_export(axes: Axes, exported: Data) -> None:
    """Seconds to export the model: sharded, gathered to rank 0, and the disk's limits."""
    seconds = exported["seconds"]
    keys = [key for key in EXPORT_METHODS if key in seconds]
    xs = list(range(len(keys)))
    ys = [seconds[key] for key in keys]
    axes.bar(
        xs,
        ys,
        0.6,
        color=[EXPORT_METHODS[key][1] for key in keys],
        hatch=["//" if key in ("4 writers", "1 writer") else "" for key in keys],
    )
    _label_points(axes, xs, ys, "{:.2f} s")
    axes.set_xticks(xs, [EXPORT_METHODS[key][0] for key in keys])
    axes.set(
        ylabel="seconds, barrier to complete on disk",
        ylim=(0, max(ys) * 1.2),
        title=f"Exporting a {exported['gib']:g} GiB model held by 4 ranks",
    )


def _draw_ft_transfer(axes: Axes, transfer: Data) -> None:
    """A healing replica's state transfer against the raw transports, same bytes, same run."""
    gbps = transfer["gbps"]
    bars = [
        ("recv_state,\nfresh tensors", gbps["fresh"], OURS),
        ("recv_state,\ninto own state", gbps["in place"], OURS),
        ("limit: raw\ngloo", gbps["gloo"], LIMIT),
        ("limit: raw\nsocket", gbps["socket"], LIMIT),
    ]
    if "map" in gbps:  # what fresh tensors pay on top: mapping the memory
        bars.append(("limit: map\nfresh memory", gbps["map"], LIMIT))
    names = [name for name, _, _ in bars]
    axes.bar(names, [v for _, v, _ in bars], color=[c for _, _, c in bars], width=0.6)
    for index, (_, value, _) in enumerate(bars):
        axes.text(index, value, f"{value:.2f}", ha="center", va="bottom", fontsize=8.5)
    axes.axhline(
        transfer["target_gbps"],
        color=TARGET,
        ls=":",
        label=f"target {transfer['target_gbps']} GB/s (torchft's reported rate)",
    )
    axes.set(
        ylabel="GB/s per rank, median",
        ylim=(0, max(v for _, v, _ in bars) * 1.3),
        title=f"State transfer, {transfer['state_bytes'] / 2**30:.2f} GiB, gloo, 2 processes",
    )
    axes.tick_params(axis="x", labelsize=8)
    axes.legend(loc="upper left")


def _maybe_seconds(value: float | None) -> str:
    """A time of the scale figure, or "none" where the run got none."""
    return f"{value:.2f} s" if value is not None else "none"


def _draw_ft_scale(axes: Axes, scale: Data) -> None:
    """Store load of N replicas against the store's own rate, with the measured times."""
    rows = scale["rows"]
    ns = [row["replicas"] for row in rows]
    axes.plot(ns, [row["keys_per_s"] for row in rows], "o-", color=OURS, label="keys read/s")
    axes.plot(
        ns, [row["requests_per_s"] for row in rows], "s-", color="#6aa5d8", label="requests/s"
    )
    for key, style, what in (
        ("limit_keys_per_s", "--", "keys/s (multi_get)"),
        ("limit_adds_per_s", ":", "round trips/s"),
    ):
        axes.plot(
            ns, [row[key] for row in rows], style, color=LIMIT, label=f"limit: the store's {what}"
        )
    for row in rows:
        text = (
            f"quorum {_maybe_seconds(row.get('quorum_s'))}\n"
            f"death seen {_maybe_seconds(row.get('death_all_s'))}"
            if row.get("simulated")
            else f"scaled from {row['scaled_from']}"
        )
        axes.annotate(
            text,
            (row["replicas"], row["keys_per_s"]),
            textcoords="offset points",
            xytext=(0, 8),
            ha="center",
            fontsize=7.5,
        )
    axes.set_yscale("log")
    _ranks_axis(axes, ns)
    axes.set(
        xlabel="replicas, one TCPStore, 500 ms heartbeats (100 ms ticks)",
        ylabel="per second",
        title=f"Quorum at scale: one store carries about {scale['carried_replicas']} replicas",
    )
    axes.legend(loc="lower right", fontsize=7.5)


def draw_ft(data: Data) -> Figure:
    """Reconfiguration against torchft; Manager step overhead; state transfer; scale."""
    extra = [key for key in ("transfer", "quorum_scale") if key in data]
    figure = Figure(figsize=(10, 3.3 * (1 + (len(extra) > 0))), layout="constrained")
    if extra:
        top, bottom = figure.subfigures(2, 1)
        reconfigure, step = top.subplots(1, 2, width_ratios=[1.6, 1])
        lower = bottom.subplots(1, len(extra), squeeze=False)[0]
        drawers = {"transfer": _draw_ft_transfer, "quorum_scale": _draw_ft_scale}
        for axes, key in zip(lower, extra, strict=True):
            drawers[key](axes, data[key])
    else:
        reconfigure, step = figure.subplots(1, 2, width_ratios=[1.6, 1])
    cases = data["reconfigure"]
    torchft = data.get("torchft")
    height = 0.38
    ratio = data["targets"]["reconfigure_ratio"]
    for index, case in enumerate(cases):
        ours, theirs = case["ours_ms"], case["torchft_ms"]
        reconfigure.barh(
            index - height / 2,
            ours,
            height,
            color=OURS,
            label="dist_collectives.ft" if index == 0 else None,
        )
        reconfigure.text(ours, index - height / 2, f" {ours:.2f} ms", va="center", fontsize=8.5)
        if theirs is None:
            reconfigure.text(
                0,
                index + height / 2,
                " torchft not installed: not measured",
                va="center",
                fontsize=8.5,
                color="#555555",
            )
            continue
        reconfigure.barh(
            index + height / 2,
            theirs,
            height,
            color=PEER,
            label=f"torchft {torchft}" if index == 0 else None,
        )
        reconfigure.text(
            theirs,
            index + height / 2,
            f" {theirs:.2f} ms ({ours / theirs:.2f}x)",
            va="center",
            fontsize=8.5,
        )
        reconfigure.plot(
            [ratio * theirs] * 2,
            [index - height, index],
            color=TARGET,
            lw=1.5,
            label=f"target: at most {ratio}x torchft" if index == 0 else None,
        )
    reconfigure.set_yticks(range(len(cases)), [f"{c['ranks']} ranks,\n{c['case']}" for c in cases])
    reconfigure.set_ylim(len(cases) - 0.4, -0.6)  # first case on top
    longest = max(max(c["ours_ms"], c["torchft_ms"] or 0) for c in cases)
    reconfigure.set_xlim(0, longest * 1.35)
    reconfigure.set(
        xlabel="ms, slowest rank, median",
        title="Reconfigure a gloo group (recovery: the survivors' new group)",
    )
    reconfigure.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3)

    steps = data["step_ms"]
    names = list(steps)
    step.bar(names, [steps[n] for n in names], color=[PEER, OURS][: len(names)], width=0.55)
    for index, name in enumerate(names):
        step.text(
            index, steps[name], f"{steps[name]:.2f} ms", ha="center", va="bottom", fontsize=8.5
        )
    limit = data["targets"]["step_ratio"] * steps["plain gloo"]
    step.axhline(
        limit,
        color=TARGET,
        ls=":",
        label=f"target: at most {data['targets']['step_ratio']:.2f}x plain",
    )
    step.set(
        ylabel="ms per step, median",
        ylim=(0, max([limit, *steps.values()]) * 1.25),
        title=f"Training step, {data.get('step_model', 'small MLP')}, 4 ranks",
    )
    step.legend(loc="upper left")
    _footer(figure, data)
    return figure


def draw_collectives(data: Data) -> Figure:
    """Per-call time of the wrappers over raw all_to_all_single, with the A/A control."""
    figure = Figure(figsize=(7, 3.3), layout="constrained")
    axes = figure.subplots()
    sizes = data["sizes"]
    positions = list(range(len(sizes)))
    styles = {
        "all_to_all": ("all_to_all / all_to_all_single", OURS, "o-"),
        "all_to_all_v": ("all_to_all_v / all_to_all_single (splits)", "#6aa5d8", "o-"),
        "raw (again)": ("A/A control: raw / raw (the noise)", LIMIT, "s--"),
    }
    for key, (label, color, style) in styles.items():
        xs, ys = _present(positions, data["ratio"].get(key, [None] * len(sizes)))
        if ys:
            axes.plot(xs, ys, style, color=color, label=label)
            _label_points(axes, xs, ys, "{:.3f}")
    limit = data["targets"]["ratio_from_1_mib"]
    axes.axhline(1.0, color=PEER, lw=1, ls="--", label="raw torch call")
    axes.axhline(limit, color=TARGET, ls=":", label=f"target from 1 MiB: at most {limit}x")
    axes.set_xticks(positions, sizes)
    axes.set_xlim(-0.5, len(sizes) - 0.5)
    axes.set(
        xlabel=f"bytes per rank, gloo, {data['ranks']} ranks",
        ylabel="time / raw, median",
        title="all_to_all wrappers against the raw torch call",
    )
    axes.legend(loc="center left", bbox_to_anchor=(1.0, 0.5))
    _footer(figure, data)
    return figure


DRAWERS: dict[str, Callable[[Data], Figure]] = {
    "launch": draw_launch,
    "workspace": draw_workspace,
    "ft": draw_ft,
    "collectives": draw_collectives,
}


def draw(name: str, source: Path, target: Path) -> None:
    """Draws benchmark ``name``'s figure from its JSON file ``source`` to ``target``."""
    data = json.loads(source.read_text())
    with matplotlib.rc_context(RC):
        figure = DRAWERS[name](data)
        target.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(target, bbox_inches="tight", metadata={"Date": None})


def main(argv: Sequence[str]) -> int:
    """Draws every figure whose JSON file exists: ``OUT_DIR [DATA_DIR]``."""
    if not 1 <= len(argv) <= 2:
        print("usage: python docs/_ext/bench_plots.py OUT_DIR [DATA_DIR]", file=sys.stderr)
        return 2
    out = Path(argv[0])
    data_dir = Path(argv[1]) if len(argv) == 2 else Path(__file__).parents[1] / DATA_DIR
    for name in DRAWERS:
        source = data_dir / f"{name}.json"
        if source.is_file():
            draw(name, source, out / f"bench-{name}.svg")
            print(f"drew {out / f'bench-{name}.svg'} from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
