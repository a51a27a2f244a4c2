"""What a soak cost and found: time lost per fault, the tables, the timeline plot.

**Time lost by a fault**: from the signal to the first step the job committed
after it (the earliest report of that step by any rank), minus the median gap
between committed steps (what the next step takes anyway), never below 0.  It
includes detection (a SIGSTOPped rank costs the heartbeat timeout), the repair
and the redone step.  A fault is **survived** when the job
committed a step after it.
"""

import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"KILL": "tab:red", "STOP": "tab:purple", "TERM": "tab:orange", "RAISE": "tab:brown"}


def median_step(records):
    times = sorted(records.commit_time.values())
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else 0.0


def losses(records, faults):
    """fault -> seconds lost (None: no step was committed after it)."""
    typical = median_step(records)
    lost = {}
    for fault in faults:
        after = records.first_commit_after(fault.t)
        lost[id(fault)] = None if after is None else max(0.0, after - fault.t - typical)
    return lost


def _percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _row(name, faults, lost):
    took = [lost[id(f)] * 1e3 for f in faults if lost[id(f)] is not None]
    cells = (f"{statistics.median(took):9.0f} {_percentile(took, 99):9.0f} {max(took):9.0f}"
             if took else f"{'-':>9} {'-':>9} {'-':>9}")
    return f"{name:<22} {len(faults):6d} {len(took):8d} {cells}"


def table(records, faults, invariants, exit_status, seconds):
    lost = losses(records, faults)
    lines = [f"soak: {seconds / 60:.1f} min, {len(records.commit_time)} steps committed, "
             f"{len(records.epoch_ends)} epochs, median step {median_step(records) * 1e3:.0f} ms, "
             f"job exit status {exit_status}",
             "",
             f"{'faults':<22} {'n':>6} {'survived':>8} {'lost p50':>9} {'p99 ms':>9} {'max ms':>9}"]
    groups = [("all", faults)]
    for attr in ("kind", "moment"):
        for value in sorted({getattr(f, attr) for f in faults}):
            groups.append((f"{attr}={value}", [f for f in faults if getattr(f, attr) == value]))
    groups.append(("rank 0 hit", [f for f in faults if f.rank == 0]))
    lines += [_row(name, group, lost) for name, group in groups]
    lines += ["", f"{'invariant':<22} {'checks':>8} {'violations':>10}"]
    names = sorted(set(invariants.checks) | {v.invariant for v in invariants.violations})
    for name in names:
        broken = sum(v.invariant == name for v in invariants.violations)
        lines.append(f"{name:<22} {invariants.checks[name]:8d} {broken:10d}")
    lines.append(f"(steps begun at a rate not yet rescaled for their size: "
                 f"{invariants.lr_stale_steps}; ranks judged for RSS: "
                 f"{len(invariants.rss_summary())})")
    return "\n".join(lines)


def survived(records, faults):
    return sum(records.first_commit_after(f.t) is not None for f in faults)


def plot(records, faults, path, start):
    steps = sorted(records.commit_time)
    t = [records.commit_time[s] - start for s in steps]
    first = [records.steps[s][0] for s in steps]
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(14, 9))
    axes[0].step(t, [r["size"] for r in first], where="post")
    axes[0].set_ylabel("ranks")
    axes[1].semilogy(t[1:], [b - a for a, b in zip(t, t[1:])], ".", markersize=2)
    axes[1].set_ylabel("step gap (s)")
    axes[2].plot(t, [r["mse"] for r in first], linewidth=0.5)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("regression loss")
    axes[2].set_xlabel("seconds since the driver started")
    for fault in faults:
        for ax in axes:
            ax.axvline(fault.t - start, color=COLORS[fault.kind], alpha=0.5, linewidth=0.8)
    handles = [plt.Line2D([], [], color=c, label=k) for k, c in COLORS.items()]
    axes[0].legend(handles=handles, loc="lower left", ncol=4, fontsize=8)
    axes[0].set_title(f"soak: {len(faults)} faults")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
