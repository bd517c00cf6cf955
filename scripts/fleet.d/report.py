"""The fleet's table (markdown), JSON and chart (SVG, drawn here: no
plotting library) from the runs' JSON lines.

Usage: report.py RAW_JSONL OUT_DIR META_JSON CI(0|1)
Exit status 1 in CI mode if the shared key was ever over its limit in
Redis's own record or if an audit saw no admission (fatal problems), or if
the record holds fewer admissions of the measured run than wrk got 2xx
responses on a path that answers non-2xx when it cannot decide (direct, sh:
every 2xx there is an admission Redis must hold). Failed requests and socket
errors are reported as warnings: on a loaded CI machine a missed deadline is
decided by the fail policy, as it should be.

With quota leases (FLEET_LEASES=1, the runs hold an `sh` path: a policy
limiter with worker shares; `rl` then measures the daemon's leases alone),
a further table gives the issue's ratios per backend and latency: rl and sh
all-admitted req/s over direct's (target >= 3x), their Redis CPU per decision
over direct's (target <= 0.2x), and the shared key's over- and
under-admission from Redis's record (targets 0 and <= 1 %).
"""
import json
import os
import sys

raw, out, meta, ci = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "1"
runs = [json.loads(line) for line in open(raw) if line.strip()]
delays = sorted({r["delay_ms"] for r in runs})
backends = [b for b in ("single", "cluster") if any(r.get("backend", "single") == b for r in runs)]
BACKEND_NAME = {"single": "one Redis", "cluster": "Redis Cluster (3 primaries)"}


def find(backend, delay, path, case):
    for r in runs:
        if r.get("backend", "single") != backend or r["delay_ms"] != delay or r["path"] != path:
            continue
        kind = "shared" if "shared" in r["url"] else ("c1" if r["conns"] == 1 else "admit")
        if kind == case:
            return r
    return None


rows, summary, problems, warnings = [], [], [], []


def fmt(v):
    return "n/a" if v is None else f"{v:,.0f}"

for b, d in [(b, d) for b in backends for d in delays]:
    plain, direct, rl = (find(b, d, p, "admit") for p in ("plain", "direct", "rl"))
    if plain is None:
        continue
    p1, d1, l1 = (find(b, d, p, "c1") for p in ("plain", "direct", "rl"))
    ds, ls = find(b, d, "direct", "shared"), find(b, d, "rl", "shared")
    sh, s1, ss = find(b, d, "sh", "admit"), find(b, d, "sh", "c1"), find(b, d, "sh", "shared")
    s = {"backend": b, "delay_ms": d}
    s["admit_rps"] = {"plain": plain["rps"], "direct": direct["rps"], "rl": rl["rps"]}
    s["admit_failed"] = {"direct": direct["non2xx"], "rl": rl["non2xx"], "direct_c1": d1["non2xx"], "rl_c1": l1["non2xx"]}
    for r in (direct, rl, d1, l1):
        if r["non2xx"]:
            warnings.append(f"{b}: {r['path']} {r['url']} c{r['conns']} at {d} ms: {r['non2xx']} requests not admitted (the path failed: its deadline or Redis)")
    s["admit_ratio_rl_direct"] = rl["rps"] / direct["rps"] if direct["rps"] else None
    s["per_host_rps"] = {"direct": [h["rps"] for h in direct["per_host"]], "rl": [h["rps"] for h in rl["per_host"]]}
    s["added_p50_us"] = {"direct": d1["p50_us"] - p1["p50_us"], "rl": l1["p50_us"] - p1["p50_us"]}
    s["added_p99_us"] = {"direct": d1["p99_us"] - p1["p99_us"], "rl": l1["p99_us"] - p1["p99_us"]}
    s["added_p50_ratio_rl_direct"] = s["added_p50_us"]["rl"] / s["added_p50_us"]["direct"] if s["added_p50_us"]["direct"] > 0 else None
    s["redis_calls_per_decision"] = {"direct": direct["redis_calls_per_decision"], "rl": rl["redis_calls_per_decision"],
                                     "direct_shared": ds["redis_calls_per_decision"], "rl_shared": ls["redis_calls_per_decision"]}
    s["redis_cpu_us_per_decision"] = {"direct": direct["redis_cpu_us_per_decision"], "rl": rl["redis_cpu_us_per_decision"],
                                      "direct_shared": ds["redis_cpu_us_per_decision"], "rl_shared": ls["redis_cpu_us_per_decision"]}
    for name, r, rs in (("sh", sh, ss),):
        if r is not None and rs is not None:
            s["redis_calls_per_decision"][name], s["redis_calls_per_decision"][name + "_shared"] = r["redis_calls_per_decision"], rs["redis_calls_per_decision"]
            s["redis_cpu_us_per_decision"][name], s["redis_cpu_us_per_decision"][name + "_shared"] = r["redis_cpu_us_per_decision"], rs["redis_cpu_us_per_decision"]
    s["shared"] = {}
    for name, r in (("direct", ds), ("rl", ls), ("sh", ss)):
        if r is None:
            continue
        a = r["audit"]
        most_at_poll = a.get("most_in_record_at_a_poll", 0)
        s["shared"][name] = {
            "requests": r["requests"], "admissions": a["admissions"], "limit": a["limit"],
            "max_in_any_window": a["max_in_any_window"],
            "over_admission": max(0, a["max_in_any_window"] - a["limit"], most_at_poll - a["limit"]),
            "mean_in_window": a["mean_in_window"], "least_in_window": a["least_in_window"],
            "under_admission": 1 - a["mean_in_window"] / a["limit"] if a["mean_in_window"] is not None else None,
            "fail_policy": r["fail_policy"],
            # Redis's record against what wrk saw admitted, in the measured run.
            "admitted_2xx": r.get("admitted_2xx"), "in_record_measured": a.get("admissions_measured"),
            "withdrawn": a.get("withdrawn"), "withdrawn_but_used": a.get("withdrawn_but_used"),
            "rescored": a.get("rescored"), "vanished": a.get("vanished"), "max_poll_gap_ms": a.get("max_poll_gap_ms"),
            "most_in_record_at_a_poll": most_at_poll,
            "daemon_decisions": r.get("daemon_decisions"), "share_units": r.get("share_units"),
            "lease_units_granted": r.get("lease_units_granted"), "lease_units_returned": r.get("lease_units_returned"),
        }
        if a["max_in_any_window"] > a["limit"]:
            problems.append(f"{b}: {name} at {d} ms: {a['max_in_any_window']} admissions in one window, limit {a['limit']}")
        if most_at_poll > a["limit"]:
            problems.append(f"{b}: {name} at {d} ms: Redis's record held {most_at_poll} members in the window ending at a poll, limit {a['limit']}")
        if a["admissions"] == 0:
            problems.append(f"{b}: {name} at {d} ms: the audit saw no admission of the shared key")
        # The audit sees every member only if its polls come less than a
        # window minus a lease's life (250 ms at most for 1 s) apart.
        gap = a.get("max_poll_gap_ms") or 0
        blind = gap >= a["window_ms"] - 300
        if blind:
            warnings.append(f"{b}: {name} at {d} ms: the audit's polls came up to {gap} ms apart: it may have missed members "
                            "(a stalled machine); its figures for this run are not conclusive")
        if a.get("withdrawn_but_used"):
            warnings.append(f"{b}: {name} at {d} ms: {a['withdrawn_but_used']} lease units removed before a poll saw their settled "
                            "score, below a unit of their lease that stayed (a late settle): counted as admissions")
        got, held = r.get("admitted_2xx"), a.get("admissions_measured")
        if got is not None and held is not None and held < got:
            # rl: its on_error is open (the client's default), and an
            # admission the fail policy made is in no record; direct and
            # sh answer non-2xx when they cannot decide.
            msg = (f"{b}: {name} at {d} ms: Redis's record holds {held} admissions of the measured run, "
                   f"wrk got {got} 2xx responses ({r['fail_policy']} fail-policy decisions by the daemons)")
            (warnings if name == "rl" or blind else problems).append(msg)
    if sh is not None:
        s["leases"] = {
            "admit_rps": {"direct": direct["rps"], "rl": rl["rps"], "sh": sh["rps"]},
            "admit_ratio_rl_direct": rl["rps"] / direct["rps"] if direct["rps"] else None,
            "admit_ratio_sh_direct": sh["rps"] / direct["rps"] if direct["rps"] else None,
            "redis_calls_per_decision": {"direct": direct["redis_calls_per_decision"], "rl": rl["redis_calls_per_decision"], "sh": sh["redis_calls_per_decision"]},
            "redis_cpu_us_per_decision": {"direct": direct["redis_cpu_us_per_decision"], "rl": rl["redis_cpu_us_per_decision"], "sh": sh["redis_cpu_us_per_decision"]},
            "cpu_ratio_rl_direct": rl["redis_cpu_us_per_decision"] / direct["redis_cpu_us_per_decision"] if direct["redis_cpu_us_per_decision"] else None,
            "cpu_ratio_sh_direct": sh["redis_cpu_us_per_decision"] / direct["redis_cpu_us_per_decision"] if direct["redis_cpu_us_per_decision"] else None,
            # Socket round trips to the daemon per request (shares admit without one).
            "daemon_round_trips_per_request": {"rl": rl["daemon_decisions"] / rl["requests"] if rl["requests"] else None,
                                               "sh": sh["daemon_decisions"] / sh["requests"] if sh["requests"] else None},
            "share_units": sh["share_units"],
            "added_p50_us": {"sh": s1["p50_us"] - p1["p50_us"]}, "added_p99_us": {"sh": s1["p99_us"] - p1["p99_us"]},
            "failed": {"sh": sh["non2xx"], "sh_c1": s1["non2xx"]},
        }
        for r in (sh, s1):
            if r["non2xx"]:
                warnings.append(f"{b}: sh {r['url']} c{r['conns']} at {d} ms: {r['non2xx']} requests not admitted (the path failed: its deadline or Redis)")
    for r in [x for x in (plain, direct, rl, p1, d1, l1, ds, ls, sh, s1, ss) if x is not None]:
        if r["socket_errors"]:
            warnings.append(f"{b}: {r['path']} {r['url']} at {d} ms: {r['socket_errors']} socket errors")
    summary.append(s)

hosts = meta["hosts"]
md = [f"Fleet: {hosts} gateway hosts (nginx with one worker + ratelimitd each, own network namespace), "
      f"Redis ({' and '.join(BACKEND_NAME[b] for b in backends)}) behind a user-space delay proxy; wrk {meta['seconds']} s per run on every host at once, "
      f"{meta['conns_per_host']} connections per host (c1: 1 per host); {meta['cores']} cores shared by everything; "
      f"{meta['date']}, commit {meta['commit']}.", ""]
md.append("| Redis | one-way latency | all admitted req/s: no limiter / direct / ratelimitd | ratelimitd ÷ direct | "
          "added p50 µs (c1): direct / ratelimitd | ratio | added p99 µs: direct / ratelimitd | "
          "Redis calls per decision: direct / ratelimitd | Redis CPU µs per decision: direct / ratelimitd | failed (c16 + c1): direct / ratelimitd |")
md.append("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
for s in summary:
    a, p50, p99 = s["admit_rps"], s["added_p50_us"], s["added_p99_us"]
    c, u = s["redis_calls_per_decision"], s["redis_cpu_us_per_decision"]
    ratio = s["added_p50_ratio_rl_direct"]
    md.append(f"| {BACKEND_NAME[s['backend']]} | {s['delay_ms']} ms | {a['plain']:,.0f} / {a['direct']:,.0f} / {a['rl']:,.0f} | {s['admit_ratio_rl_direct']:.2f}x | "
              f"{p50['direct']:.0f} / {p50['rl']:.0f} | {'n/a' if ratio is None else f'{ratio:.2f}x'} | {p99['direct']:.0f} / {p99['rl']:.0f} | "
              f"{c['direct']:.2f} / {c['rl']:.2f} | {u['direct']:.1f} / {u['rl']:.1f} | "
              f"{s['admit_failed']['direct'] + s['admit_failed']['direct_c1']} / {s['admit_failed']['rl'] + s['admit_failed']['rl_c1']} |")
md += ["", f"One key limited to {meta['shared_limit']} per second, hammered from all {hosts} hosts; "
       "Redis's own record (every member of the window's ZSET):", "",
       "| Redis | one-way latency | path | requests (measured run) | admitted (warm-up included) | most in any window | limit | over-admission | mean / least in a window (interior) | under-admission | fail-policy decisions | Redis calls per decision |",
       "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
PATH_NAME = {"direct": "direct EVALSHA", "rl": "ratelimitd", "sh": "ratelimitd + worker shares"}
for s in summary:
    for name, label in PATH_NAME.items():
        if name not in s["shared"]:
            continue
        x = s["shared"][name]
        calls = s["redis_calls_per_decision"][name + "_shared"]
        under = "n/a" if x["under_admission"] is None else f"{100 * x['under_admission']:.1f} %"
        md.append(f"| {BACKEND_NAME[s['backend']]} | {s['delay_ms']} ms | {label} | {x['requests']:,} | {x['admissions']:,} | {x['max_in_any_window']:,} | "
                  f"{x['limit']:,} | {x['over_admission']} | {fmt(x['mean_in_window'])} / {fmt(x['least_in_window'])} | {under} | {x['fail_policy']} | {calls:.3f} |")
md += ["", "The shared key: Redis's record against the 2xx responses wrk counted (the measured run; the record's members scored at or "
       "after its start). Withdrawn: members removed inside their window (a quota lease's unused units at its settle: never admissions); "
       "re-scored: members moved (a lease's used unit, from the lease's end to its time; a share's, to its deadline); a worker share's units "
       "count used or not, so the record may hold more than wrk saw. Lease units (the daemons' counters, the whole run with its warm-up): "
       "granted in Redis, handed to workers, given back unused; the rest were admitted by the daemons.", "",
       "| Redis | one-way latency | path | 2xx (wrk) | in the record | record − 2xx | withdrawn | re-scored | most in the record at a poll | daemon decisions | lease units: granted / shared / given back | longest gap between polls |",
       "|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
for s in summary:
    for name, label in PATH_NAME.items():
        x = s["shared"].get(name)
        if x is None or x["in_record_measured"] is None:
            continue
        md.append(f"| {BACKEND_NAME[s['backend']]} | {s['delay_ms']} ms | {label} | {x['admitted_2xx']:,} | {x['in_record_measured']:,} | "
                  f"{x['in_record_measured'] - x['admitted_2xx']:,} | {x['withdrawn']:,} | {x['rescored']:,} | {x['most_in_record_at_a_poll']:,} | "
                  f"{x['daemon_decisions']:,} | {fmt(x['lease_units_granted'])} / {x['share_units']:,} / {fmt(x['lease_units_returned'])} | {x['max_poll_gap_ms']} ms |")
leased = [s for s in summary if "leases" in s]
if leased:
    def ratio(v):
        return "n/a" if v is None else f"{v:.2f}x"

    def mark(ok):
        return "yes" if ok else "**no**"

    def f3(v):
        return "n/a" if v is None else f"{v:.3f}"
    md += ["", "With the sh path (`FLEET_LEASES=1`): rl = an inline limiter, sh = a policy limiter, both with the defaults (quota "
           "leases, worker shares). The issue's targets: all admitted ≥ 3x direct; Redis CPU per decision ≤ 0.2x direct's; the shared key "
           "0 over-admission and ≤ 1 % under-admission in Redis's record. A unit handed to a worker's share is in the record "
           "as an admission whether a worker used it or not (record − 2xx above), at its share's deadline, after the "
           "admission it stands for: the under-admission is the record's (fleet.d/audit.py).", "",
           "| Redis | one-way latency | all admitted req/s: direct / rl / sh | rl ÷ direct | sh ÷ direct | ≥ 3x (sh) | "
           "Redis calls per decision: direct / rl / sh | Redis CPU µs per decision: direct / rl / sh | rl ÷ direct | sh ÷ direct | ≤ 0.2x (sh) | "
           "daemon round trips per request: rl / sh | added p50 / p99 µs (c1), sh | shared over-admission: rl / sh | shared under-admission: rl / sh | targets met (sh) | failed (sh, c16 + c1) |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for s in leased:
        x = s["leases"]
        a, c, u, rt = x["admit_rps"], x["redis_calls_per_decision"], x["redis_cpu_us_per_decision"], x["daemon_round_trips_per_request"]
        rl_s, sh_s = s["shared"].get("rl"), s["shared"].get("sh")
        under = lambda y: "n/a" if y is None or y["under_admission"] is None else f"{100 * y['under_admission']:.1f} %"
        over = lambda y: "n/a" if y is None else str(y["over_admission"])
        ok = {
            "admit": x["admit_ratio_sh_direct"] is not None and x["admit_ratio_sh_direct"] >= 3,
            "cpu": x["cpu_ratio_sh_direct"] is not None and x["cpu_ratio_sh_direct"] <= 0.2,
            "over": sh_s is not None and sh_s["over_admission"] == 0,
            "under": sh_s is not None and sh_s["under_admission"] is not None and sh_s["under_admission"] <= 0.01,
        }
        x["targets_met_sh"] = ok
        md.append(f"| {BACKEND_NAME[s['backend']]} | {s['delay_ms']} ms | {a['direct']:,.0f} / {a['rl']:,.0f} / {a['sh']:,.0f} | "
                  f"{ratio(x['admit_ratio_rl_direct'])} | {ratio(x['admit_ratio_sh_direct'])} | {mark(ok['admit'])} | "
                  f"{c['direct']:.3f} / {c['rl']:.3f} / {c['sh']:.3f} | {u['direct']:.2f} / {u['rl']:.2f} / {u['sh']:.2f} | "
                  f"{ratio(x['cpu_ratio_rl_direct'])} | {ratio(x['cpu_ratio_sh_direct'])} | {mark(ok['cpu'])} | "
                  f"{f3(rt['rl'])} / {f3(rt['sh'])} | {x['added_p50_us']['sh']:.0f} / {x['added_p99_us']['sh']:.0f} | "
                  f"{over(rl_s)} / {over(sh_s)} | {under(rl_s)} / {under(sh_s)} | "
                  f"{sum(ok.values())} of 4 ({', '.join(k for k, v in ok.items() if not v) or 'all'}{' missed' if not all(ok.values()) else ''}) | "
                  f"{x['failed']['sh'] + x['failed']['sh_c1']} |")
md += ["", "Per host, all admitted req/s (direct | ratelimitd): " + "; ".join(
    f"{s['backend']} {s['delay_ms']} ms: " + ", ".join(f"{d:,.0f}|{r:,.0f}" for d, r in zip(s["per_host_rps"]["direct"], s["per_host_rps"]["rl"]))
    for s in summary)]
md += ["", "Delay proxy lateness (last report per latency): " + meta.get("proxy_lateness", "")]
text = "\n".join(md) + "\n"

# Chart: per latency, ratelimitd ÷ direct for throughput (all admitted) and
# for the p50 latency added at one connection.
W, H, L, B = 660, 380, 60, 70
maxy = max([2.0] + [v for s in summary for v in (s["admit_ratio_rl_direct"] or 0, s["added_p50_ratio_rl_direct"] or 0)])
def x(i):
    return L + (W - L - 20) * (i / max(1, len(delays) - 1)) if len(delays) > 1 else L + (W - L - 20) / 2
def y(v):
    return H - B - (H - B - 30) * v / maxy
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
       f'<text x="{W/2}" y="18" text-anchor="middle">ratelimitd ÷ direct EVALSHA, {hosts} hosts, by one-way latency to Redis</text>',
       f'<line x1="{L}" y1="{H-B}" x2="{W-20}" y2="{H-B}" stroke="black"/><line x1="{L}" y1="30" x2="{L}" y2="{H-B}" stroke="black"/>']
for k in range(int(maxy) + 1):
    svg.append(f'<text x="{L-8}" y="{y(k)+4}" text-anchor="end">{k}x</text><line x1="{L}" y1="{y(k)}" x2="{W-20}" y2="{y(k)}" stroke="#ddd"/>')
for i, d in enumerate(delays):
    svg.append(f'<text x="{x(i)}" y="{H-B+18}" text-anchor="middle">{d} ms</text>')
legend = 0
for key, colour, label in (("admit_ratio_rl_direct", "#1f77b4", "throughput, all admitted (higher is better)"),
                           ("added_p50_ratio_rl_direct", "#d62728", "p50 latency added at c1 (lower is better)")):
    for backend in backends:
        dash = "" if backend == "single" else ' stroke-dasharray="6,4"'
        pts = [(x(delays.index(s["delay_ms"])), y(s[key])) for s in summary if s["backend"] == backend and s[key] is not None]
        if len(pts) > 1:
            svg.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2"{dash} points="' + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) + '"/>')
        for a, b in pts:
            svg.append(f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{colour}"/>')
        svg.append(f'<line x1="{L + 10 + (legend % 2) * 290}" y1="{H - 28 + (legend // 2) * 16}" x2="{L + 30 + (legend % 2) * 290}" '
                   f'y2="{H - 28 + (legend // 2) * 16}" stroke="{colour}" stroke-width="2"{dash}/>'
                   f'<text x="{L + 34 + (legend % 2) * 290}" y="{H - 24 + (legend // 2) * 16}" font-size="10" fill="{colour}">{label}, {BACKEND_NAME[backend]}</text>')
        legend += 1
svg.append('</svg>')

os.makedirs(out, exist_ok=True)
json.dump({"meta": meta, "summary": summary, "runs": runs}, open(os.path.join(out, "fleet.json"), "w"), indent=1)
open(os.path.join(out, "fleet.md"), "w").write(text)
open(os.path.join(out, "fleet.svg"), "w").write("\n".join(svg) + "\n")
print(text)
print(f"written: {out}/fleet.json, fleet.md, fleet.svg")
if warnings:
    print("warnings:\n  " + "\n  ".join(warnings), file=sys.stderr)
if problems:
    print("problems:\n  " + "\n  ".join(problems), file=sys.stderr)
    if ci:
        sys.exit(1)
