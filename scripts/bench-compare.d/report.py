#!/usr/bin/env python3
"""The report of scripts/bench-compare: reads the raw runs (one JSON object a
line), prints the markdown table and the ratios against the targets of issue
9, and writes bench-compare.json, bench-compare.md and bench-compare.svg
(drawn here, no plotting library) to the results directory.

Usage: report.py RAW.jsonl OUT_DIR META_JSON
"""
import json
import sys
from html import escape

PATHS = [("plain", "no limiter"), ("dict", "shared-dict counter (one incr)"), ("direct", "direct EVALSHA"), ("rl", "ratelimitd"),
         ("sh", "ratelimitd, worker shares")]
CASES = [("admit", "all admitted"), ("attack", "attack (one key over its limit)"), ("hot", "one hot key at its limit"), ("c1", "one connection"), ("c1cold", "one connection, a cold key per request"),
         ("hotadmit", "one hot key, all admitted"), ("keys10k", "10,000 keys, all admitted")]


def load(raw_path):
    runs, rb, rl = {}, [], []
    with open(raw_path) as f:
        for line in f:
            r = json.loads(line)
            if r["kind"] == "wrk":
                runs.setdefault((r["case"], r["path"]), []).append(r)
            elif r["kind"] == "redis-benchmark":
                rb.append(r)
            else:
                rl.append(r)
    return runs, rb, rl


SUMMED = ("requests", "non2xx", "socket_errors", "nginx_error_lines", "evalsha", "redis_calls", "redis_cpu_s",
          "daemon_cpu_s", "daemon_vcsw", "daemon_ivcsw", "nginx_cpu_s", "daemon_fail_policy", "daemon_redis_calls", "daemon_redis_call_s")


def per_decision(rounds):
    """The figures per request of one case and path over its rounds: req/s
    and percentiles are the means of the rounds, counters are summed."""
    r = {k: sum(x[k] for x in rounds) for k in SUMMED}
    r["path"] = rounds[0]["path"]
    mean = lambda k: sum(x[k] for x in rounds) / len(rounds)
    n = max(r["requests"], 1)
    rps = [x["rps"] for x in rounds]
    return {
        "rounds": len(rounds),
        "rps_each_round": rps,
        "rps_spread": (max(rps) - min(rps)) / mean("rps") if mean("rps") else 0,
        "rps": mean("rps"),
        "p50_us": mean("p50_us"),
        "p99_us": mean("p99_us"),
        "admitted": (r["requests"] - r["non2xx"]) / n,
        "evalsha_per_decision": r["evalsha"] / n,
        "redis_commands_per_decision": r["redis_calls"] / n,
        "redis_cpu_us_per_decision": r["redis_cpu_s"] * 1e6 / n,
        "daemon_cpu_us_per_request": r["daemon_cpu_s"] * 1e6 / n,
        "daemon_context_switches_per_request": (r["daemon_vcsw"] + r["daemon_ivcsw"]) / n,
        "nginx_cpu_us_per_request": r["nginx_cpu_s"] * 1e6 / n,
        "daemon_redis_call_us": r["daemon_redis_call_s"] * 1e6 / max(r["daemon_redis_calls"], 1),
        # Requests not decided by a limit: socket errors, failed direct calls
        # (each logged), the daemon's fail-policy decisions and the Lua
        # client's fail-policy log lines (rate-limited: a lower bound).
        "errors": int(r["socket_errors"] + r["nginx_error_lines"] + (r["daemon_fail_policy"] if r["path"] == "rl" else 0)),
    }


def main():
    raw_path, out_dir, meta = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    runs, rb, rl = load(raw_path)
    rows = []
    for case, case_label in CASES:
        for path, path_label in PATHS:
            r = runs.get((case, path))
            if r:
                rows.append({"case": case, "case_label": case_label, "path": path, "path_label": path_label,
                             "conns": r[0]["conns"], **per_decision(r)})
    fig = {(r["case"], r["path"]): r for r in rows}

    def rps(case, path):
        return fig[(case, path)]["rps"]

    added = {p: fig[("c1", p)]["p50_us"] - fig[("c1", "plain")]["p50_us"] for p in ("direct", "rl")}
    added99 = {p: fig[("c1", p)]["p99_us"] - fig[("c1", "plain")]["p99_us"] for p in ("direct", "rl")}
    added_mean = {p: 1e6 / rps("c1", p) - 1e6 / rps("c1", "plain") for p in ("direct", "rl")}
    # A cold key at one connection (issue 34 item 4): every decision asks
    # Redis, through the daemon (two more process wake-ups) or directly.
    cold = {p: fig[("c1cold", p)]["p50_us"] - fig[("c1cold", "plain")]["p50_us"] for p in ("direct", "rl")} if ("c1cold", "rl") in fig else None
    rb_p50 = min(r["p50_us"] for r in rb)
    rl_p50 = min(r["p50_us"] for r in rl)
    hot = fig[("hot", "rl")]
    ratios = [
        ("all admitted c64: ratelimitd / direct (req/s)", rps("admit", "rl") / rps("admit", "direct"), ">= 1.8", lambda v: v >= 1.8),
        ("attack c64: ratelimitd / direct (req/s)", rps("attack", "rl") / rps("attack", "direct"), ">= 4", lambda v: v >= 4),
        ("attack c64: ratelimitd / no limiter (req/s)", rps("attack", "rl") / rps("admit", "plain"), ">= 0.7", lambda v: v >= 0.7),
        ("hot key c64: ratelimitd / direct (req/s)", rps("hot", "rl") / rps("hot", "direct"), "", None),
        ("one connection: p50 added, ratelimitd / direct", added["rl"] / added["direct"] if added["direct"] > 0 else float("nan"), "<= 0.8", lambda v: v <= 0.8),
        ("one connection: p99 added, ratelimitd / direct", added99["rl"] / added99["direct"] if added99["direct"] > 0 else float("nan"), "", None),
        ("`ratelimitd bench -c1` p50 / `redis-benchmark -c1` EVALSHA p50", rl_p50 / rb_p50, "<= 1.25", lambda v: v <= 1.25),
        ("one connection, a cold key per request: p50 added, ratelimitd / direct", cold["rl"] / cold["direct"] if cold and cold["direct"] > 0 else float("nan"), "<= 1.0", lambda v: v <= 1.0),
        ("hot key c64: ratelimitd Redis calls per decision", hot["evalsha_per_decision"], "<= 0.2 admitting, ~0 refusing", lambda v: v <= 0.2),
        ("attack c64: ratelimitd Redis calls per decision", fig[("attack", "rl")]["evalsha_per_decision"], "~0", lambda v: v <= 0.05),
    ]
    # Issue 34's table (and issue 23's targets): rl = the daemon (quota
    # leases with BENCH_LEASES=1), sh = worker shares (BENCH_LEASES=1 only).
    for p, label in (("rl", "daemon"), ("sh", "worker shares")):
        if ("hotadmit", p) not in fig:
            continue
        added_p = fig[("c1", p)]["p50_us"] - fig[("c1", "plain")]["p50_us"]
        ratios += [
            (f"one hot key, all admitted c64, {label}: / direct (req/s)", rps("hotadmit", p) / rps("hotadmit", "direct"), ">= 2.5", lambda v: v >= 2.5),
            (f"one hot key, all admitted c64, {label}: / shared-dict counter (req/s)", rps("hotadmit", p) / rps("hotadmit", "dict"), ">= 0.6", lambda v: v >= 0.6),
            (f"one hot key, all admitted c64, {label}: / no limiter (req/s)", rps("hotadmit", p) / rps("admit", "plain"), ">= 0.6", lambda v: v >= 0.6),
            (f"64 keys, all admitted c64, {label}: / direct (req/s)", rps("admit", p) / rps("admit", "direct"), ">= 2", lambda v: v >= 2),
            (f"10,000 keys c64, {label}: / direct (req/s)", rps("keys10k", p) / rps("keys10k", "direct"), ">= 1.0", lambda v: v >= 1.0),
            (f"one connection, {label}: p50 added / direct's", added_p / added["direct"] if added["direct"] > 0 else float("nan"), "<= 0.5 (key in a lease), <= 1.0 (cold key)", None),
            (f"one hot key, {label}: Redis calls per admitted decision", fig[("hotadmit", p)]["evalsha_per_decision"], "<= 0.05", lambda v: v <= 0.05),
        ]
    ratio_rows = [{"what": w, "value": v, "target": t, "met": (f(v) if f and v == v else None)} for w, v, t, f in ratios]

    md = []
    md.append(f"wrk {meta['wrk_seconds']} s per run, {meta['rounds']} rounds (means; spread: (max - min) / mean of req/s), {meta['cores']} cores shared by wrk, nginx (2 workers), ratelimitd and "
              f"redis-server; {meta['conns']} connections except \"one connection\"; attack limit {meta['attack_limit']}/s, "
              f"hot key limit {meta['hot_limit']}/s; daemon to Redis over {meta['redis_link']}; {meta['date']}, commit {meta['commit']}"
              + (f"; {meta['note']}" if meta.get("note") else "") + ".")
    md.append("")
    md.append("| case | path | req/s (spread) | admitted | p50 µs | p99 µs | Redis calls / decision | Redis CPU µs / decision | daemon CPU µs / req | nginx CPU µs / req | errors |")
    md.append("|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in rows:
        lim = r["path"] not in ("plain", "dict")
        md.append("| {} | {} | {:,.0f} ({:.0%}) | {:.1%} | {:.0f} | {:.0f} | {} | {} | {} | {:.1f} | {} |".format(
            r["case_label"] + ("" if r["case"] == "c1" else f" (c{r['conns']})"), r["path_label"], r["rps"], r["rps_spread"], r["admitted"],
            r["p50_us"], r["p99_us"],
            f"{r['evalsha_per_decision']:.2f}" if lim else "–",
            f"{r['redis_cpu_us_per_decision']:.1f}" if lim else "–",
            f"{r['daemon_cpu_us_per_request']:.1f}" if r["path"] == "rl" else "–",
            r["nginx_cpu_us_per_request"], r["errors"]))
    md.append("")
    md.append(f"One connection, latency added over no limiter: direct p50 +{added['direct']:.0f} µs, p99 +{added99['direct']:.0f} µs, "
              f"mean +{added_mean['direct']:.0f} µs; ratelimitd p50 +{added['rl']:.0f} µs, p99 +{added99['rl']:.0f} µs, "
              f"mean +{added_mean['rl']:.0f} µs. `ratelimitd bench --concurrency 1` p50 {rl_p50:.0f} µs against "
              f"`redis-benchmark -c 1` EVALSHA p50 {rb_p50:.0f} µs (lower of 2 rounds each).")
    md.append("")
    md.append("| ratio (one run) | measured | target | met |")
    md.append("|---|--:|---|---|")
    for r in ratio_rows:
        met = "" if r["met"] is None else ("yes" if r["met"] else "**no**")
        value = "n/a" if r["value"] != r["value"] else f"{r['value']:.2f}"  # NaN: the direct path added nothing
        md.append(f"| {r['what']} | {value} | {r['target']} | {met} |")
    text = "\n".join(md) + "\n"
    print(text)

    doc = {"meta": meta, "rows": rows, "ratios": ratio_rows,
           "one_connection_added_us": {"p50": added, "p99": added99, "mean": added_mean},
           "c1_p50_us": {"ratelimitd_bench": rl_p50, "redis_benchmark": rb_p50},
           "redis_benchmark_c1": rb, "ratelimitd_bench_c1": rl}
    with open(f"{out_dir}/bench-compare.json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(f"{out_dir}/bench-compare.md", "w") as f:
        f.write(text)
    with open(f"{out_dir}/bench-compare.svg", "w") as f:
        f.write(svg(fig, added, added99, rl_p50, rb_p50, meta))
    print(f"written: {out_dir}/bench-compare.json, bench-compare.md, bench-compare.svg", file=sys.stderr)


COLORS = {"plain": "#9e9e9e", "direct": "#e07b39", "rl": "#3b75af", "rb": "#e07b39", "rlb": "#3b75af"}


def bars(x0, y0, w, h, title, groups, unit):
    """A grouped bar chart: groups = [(label, [(series, value, text)])]."""
    out = [f'<text x="{x0 + w / 2}" y="{y0 - 14}" text-anchor="middle" font-weight="bold">{escape(title)}</text>']
    top = max((v for _, s in groups for _, v, _ in s), default=1) * 1.15 or 1
    out.append(f'<line x1="{x0}" y1="{y0 + h}" x2="{x0 + w}" y2="{y0 + h}" stroke="#333"/>')
    gw = w / len(groups)
    for gi, (label, series) in enumerate(groups):
        bw = gw * 0.8 / max(len(series), 1)
        for si, (name, v, txt) in enumerate(series):
            bh = h * v / top
            x = x0 + gi * gw + gw * 0.1 + si * bw
            out.append(f'<rect x="{x:.1f}" y="{y0 + h - bh:.1f}" width="{bw * 0.92:.1f}" height="{bh:.1f}" fill="{COLORS[name]}"/>')
            out.append(f'<text x="{x + bw * 0.46:.1f}" y="{y0 + h - bh - 4:.1f}" text-anchor="middle" font-size="10">{escape(txt)}</text>')
        out.append(f'<text x="{x0 + gi * gw + gw / 2:.1f}" y="{y0 + h + 16}" text-anchor="middle" font-size="11">{escape(label)}</text>')
    out.append(f'<text x="{x0 - 8}" y="{y0 + h / 2}" text-anchor="middle" font-size="11" transform="rotate(-90 {x0 - 8} {y0 + h / 2})">{escape(unit)}</text>')
    return out


def svg(fig, added, added99, rl_p50, rb_p50, meta):
    W, H = 960, 430
    el = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
          f'<rect width="{W}" height="{H}" fill="white"/>',
          f'<text x="{W / 2}" y="20" text-anchor="middle" font-size="14" font-weight="bold">ratelimitd vs direct EVALSHA vs no limiter: one run, {meta["cores"]} shared cores, {escape(meta["date"])}</text>']
    groups = []
    for case, label in (("admit", "all admitted"), ("attack", "attack"), ("hot", f"hot key ({meta['hot_limit']}/s)")):
        s = []
        for p in ("plain", "direct", "rl"):
            r = fig.get((case, p)) or (fig.get(("admit", "plain")) if p == "plain" else None)
            if r:
                s.append((p, r["rps"], f"{r['rps'] / 1000:.1f}k"))
        groups.append((label, s))
    el += bars(60, 70, 470, 280, f"throughput, c{meta['conns']} (no limiter: all-admitted run)", groups, "req/s")
    lat = [("p50 added", [("direct", max(added["direct"], 0), f"{added['direct']:.0f}"), ("rl", max(added["rl"], 0), f"{added['rl']:.0f}")]),
           ("p99 added", [("direct", max(added99["direct"], 0), f"{added99['direct']:.0f}"), ("rl", max(added99["rl"], 0), f"{added99['rl']:.0f}")]),
           ("bench -c1 p50", [("rb", rb_p50, f"{rb_p50:.0f}"), ("rlb", rl_p50, f"{rl_p50:.0f}")])]
    el += bars(620, 70, 310, 280, "one connection: µs added / µs", lat, "µs")
    ly = 395
    for i, (k, label) in enumerate((("plain", "no limiter"), ("direct", "direct EVALSHA (last group: redis-benchmark -c1)"), ("rl", "ratelimitd (last group: ratelimitd bench -c1)"))):
        x = 60 + i * 290
        el.append(f'<rect x="{x}" y="{ly}" width="12" height="12" fill="{COLORS[k]}"/><text x="{x + 18}" y="{ly + 11}">{escape(label)}</text>')
    el.append("</svg>")
    return "\n".join(el) + "\n"


if __name__ == "__main__":
    main()
