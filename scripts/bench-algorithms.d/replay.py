#!/usr/bin/env python3
"""Replays reference traces through each algorithm's Redis script and
measures its accuracy and cost (docs/ALGORITHMS.md).

Every script is called as the daemon calls it (EVALSHA, same keys and
arguments), with `now` given explicitly: the traces run on a virtual clock
(hours of traffic in a second), aligned so that fixed windows start on the
trace's window boundaries. Nothing here is mocked: a real redis-server
decides, and the numbers are read back from it.

Accuracy, per trace and algorithm:
  over   the most units admitted in any sliding window of the window's
         length, divided by the limit (the exact log: at most 1.00)
  under  requests refused although admitting them would have kept every
         sliding window at or below the limit (the exact log: none), as a
         share of all requests
  vs_log units admitted, as a share of what the exact log admitted

Cost: MEMORY USAGE of a key holding `limit` admissions; Redis µs per call
(INFO commandstats) over the steady trace.

  replay.py --redis /path/redis.sock [--short] [--json out.json]
            [--svg chart.svg] [--markdown table.md] [--check-bounds docs/ALGORITHMS.md]
"""

import argparse
import json
import os
import random
import re
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "..", "src", "redis", "scripts")
SCRIPTS = {
    "log": "sliding_window.lua",
    "ring": "ring.lua",
    "gcra": "gcra.lua",
    "sliding_counter": "sliding_counter.lua",
    "fixed": "fixed_window.lua",
}
ALGORITHMS = list(SCRIPTS)

# Virtual ms. The scripts' PEXPIREs run on Redis's real clock: a key set
# to expire d virtual ms ahead must not expire (in real time) before the
# trace's next request to it. An hour's window makes every such d far
# longer than a replay takes, or a stall of the machine lasts.
WINDOW = 3_600_000
SCALE = WINDOW // 60_000
LIMIT = 100


class Redis:
    """RESP2 over a Unix socket or host:port, with pipelining."""

    def __init__(self, address):
        if address.startswith("/"):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(address)
        else:
            host, port = address.rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)))
        self.buf = b""

    @staticmethod
    def encode(args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        return b"".join(out)

    def _line(self):
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n):
        while len(self.buf) < n + 2:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def read(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise RuntimeError("bad reply %r" % line)

    def call(self, *args):
        self.sock.sendall(self.encode(args))
        return self.read()

    def pipeline(self, commands, chunk=1000):
        out = []
        for i in range(0, len(commands), chunk):
            part = commands[i:i + chunk]
            self.sock.sendall(b"".join(self.encode(c) for c in part))
            out.extend(self.read() for _ in part)
        return out


# ---------------------------------------------------------------- traces

def base_time():
    # A multiple of the window: fixed windows start at base + k * WINDOW.
    return (1_700_000_000_000 // WINDOW + 1) * WINDOW


def steady(windows):
    """1.5 x the limit, evenly spaced."""
    n = int(1.5 * LIMIT * windows)
    step = WINDOW * windows / n
    return [(int(i * step), 1) for i in range(n)]


def edge_bursts(windows):
    """Quiet, then a burst of `limit` just before a window edge and another
    just after it, every other window; light background in between."""
    rng = random.Random(7)
    out = []
    for w in range(windows):
        edge = (w + 1) * WINDOW
        if w % 2 == 1:
            out += [(edge - SCALE * (50 - i % 40), 1) for i in range(LIMIT)]
            out += [(edge + SCALE * (i % 40), 1) for i in range(LIMIT)]
        out += [(w * WINDOW + rng.randrange(WINDOW), 1) for _ in range(LIMIT // 5)]
    return sorted(out)


def ramp(windows):
    """From 0.2 x to 3 x the limit, rising linearly."""
    out, t = [], 0.0
    end = windows * WINDOW
    while t < end:
        rate = (0.2 + 2.8 * t / end) * LIMIT / WINDOW  # per ms
        out.append((int(t), 1))
        t += 1 / rate
    return out


def random_costs(windows):
    """Random arrivals at 1.3 x the limit in units, costs 1..10."""
    rng = random.Random(11)
    out, t = [], 0.0
    end = windows * WINDOW
    while t < end:
        cost = rng.randint(1, 10)
        out.append((int(t), cost))
        t += rng.expovariate(1.3 * LIMIT / WINDOW / 5.5)
    return out


def traces(short):
    w = 4 if short else 12
    return {
        "steady_1.5x": steady(w),
        "edge_bursts": edge_bursts(w),
        "ramp": ramp(w),
        "random_costs": random_costs(w),
    }


# ---------------------------------------------------------------- replay

def replay(r, shas, algorithm, name, trace, tag):
    key = "bench:{%s:%s:%s}" % (tag, name, algorithm)
    r.call("DEL", key)
    t0 = base_time()
    cmds = [("EVALSHA", shas[algorithm], 1, key, WINDOW, t0 + t, "m%d" % i, LIMIT, cost) for i, (t, cost) in enumerate(trace)]
    replies = r.pipeline(cmds)
    r.call("DEL", key)
    return [rep[0] == 1 for rep in replies], replies


def accuracy(trace, admitted):
    """over, under, admitted units (see the module doc)."""
    window_sum, left, best = 0, 0, 0
    adm = []  # (time, cost) admitted, in order
    under = 0
    for (t, cost), ok in zip(trace, admitted):
        while left < len(adm) and adm[left][0] <= t - WINDOW:
            window_sum -= adm[left][1]
            left += 1
        if ok:
            adm.append((t, cost))
            window_sum += cost
            best = max(best, window_sum)
        elif window_sum + cost <= LIMIT:
            under += 1
    return best / LIMIT, under / len(trace), sum(c for _, c in adm)


def in_window_series(trace, admitted, points=400):
    """(t, units admitted in (t - W, t]) at `points` instants across the trace."""
    adm = [(t, c) for (t, c), ok in zip(trace, admitted) if ok]
    end = trace[-1][0]
    out = []
    for k in range(points + 1):
        t = end * k / points
        out.append((t, sum(c for a, c in adm if t - WINDOW < a <= t)))
    return out


def memory_per_key(r, shas, algorithm, limit):
    key = "bench:{mem:%s:%d}" % (algorithm, limit)
    r.call("DEL", key)
    t0 = base_time()
    step = WINDOW / limit / 2
    cmds = [("EVALSHA", shas[algorithm], 1, key, WINDOW, int(t0 + i * step), "%016x:%d" % (0xABCDEF, i), limit, 1) for i in range(limit)]
    r.pipeline(cmds)
    usage = r.call("MEMORY", "USAGE", key, "SAMPLES", "0")
    r.call("DEL", key)
    return usage


def usec_per_call(r, shas, algorithm, trace, runs=3):
    """The least of `runs` replays: other work on the machine only adds."""
    best = None
    for _ in range(runs):
        r.call("CONFIG", "RESETSTAT")
        replay(r, shas, algorithm, "cost", trace, "usec")
        info = r.call("INFO", "commandstats").decode()
        m = re.search(r"cmdstat_evalsha:calls=(\d+),usec=(\d+),usec_per_call=([\d.]+)", info)
        if m:
            best = float(m.group(3)) if best is None else min(best, float(m.group(3)))
    return best


# ---------------------------------------------------------------- outputs

COLORS = {"log": "#000000", "ring": "#999999", "gcra": "#d62728", "sliding_counter": "#1f77b4", "fixed": "#2ca02c"}


def svg_chart(series, title):
    w, h, ml, mr, mt, mb = 760, 360, 60, 150, 30, 40
    tmax = max(t for s in series.values() for t, _ in s) or 1
    ymax = max(2.0, max(v for s in series.values() for _, v in s) / LIMIT * 1.05)
    x = lambda t: ml + (w - ml - mr) * t / tmax
    y = lambda v: mt + (h - mt - mb) * (1 - v / ymax)
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">' % (w, h),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="18" font-size="14">%s</text>' % (ml, title)]
    for k in range(0, int(ymax * 4) + 1):
        v = k / 4
        out.append('<line x1="%d" x2="%d" y1="%.1f" y2="%.1f" stroke="%s"/>' % (ml, w - mr, y(v), y(v), "#888" if v == 1 else "#eee"))
        out.append('<text x="%d" y="%.1f" text-anchor="end">%.2f</text>' % (ml - 6, y(v) + 4, v))
    for k in range(int(tmax // WINDOW) + 1):
        out.append('<line x1="%.1f" x2="%.1f" y1="%d" y2="%d" stroke="#eee"/>' % (x(k * WINDOW), x(k * WINDOW), mt, h - mb))
    out.append('<text x="%d" y="%d">time (windows)</text>' % ((w - mr) // 2, h - 8))
    out.append('<text x="14" y="%d" transform="rotate(-90 14 %d)">admitted in the last window / limit</text>' % (h // 2 + 90, h // 2 + 90))
    for i, (name, s) in enumerate(series.items()):
        pts = " ".join("%.1f,%.1f" % (x(t), y(v / LIMIT)) for t, v in s)
        dash = ' stroke-dasharray="5,4"' if name == "ring" else ""
        out.append('<polyline fill="none" stroke="%s" stroke-width="1.6"%s points="%s"/>' % (COLORS[name], dash, pts))
        out.append('<line x1="%d" x2="%d" y1="%d" y2="%d" stroke="%s" stroke-width="2"%s/>' % (w - mr + 12, w - mr + 36, mt + 20 * i + 10, mt + 20 * i + 10, COLORS[name], dash))
        out.append('<text x="%d" y="%d">%s</text>' % (w - mr + 42, mt + 20 * i + 14, name))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def bounds_from(doc_path):
    """algorithm -> (over bound, under bound) from the `| Algorithm | Over-admission bound | Under-admission bound |` table."""
    out = {}
    with open(doc_path) as f:
        rows = [l for l in f if l.startswith("|")]
    for i, l in enumerate(rows):
        if l.replace(" ", "").startswith("|Algorithm|Over-admissionbound|Under-admissionbound|"):
            for row in rows[i + 2:]:
                cells = [c.strip().strip("`") for c in row.strip().strip("|").split("|")]
                if len(cells) < 3 or cells[0] not in SCRIPTS:
                    break
                out[cells[0]] = (float(cells[1]), float(cells[2].rstrip("%")) / 100)
            return out
    raise SystemExit("%s: no `| Algorithm | Over-admission bound | Under-admission bound |` table" % doc_path)


def assembled(file):
    """The script as the daemon runs it: every `--@include FILE` line
    replaced by that file, expanded the same way (build.rs and
    scripts/lib.sh's redis_script do the same)."""
    out = []
    with open(os.path.join(SRC, file)) as f:
        for line in f:
            if line.startswith("--@include "):
                out.append(assembled(line[len("--@include "):].strip()))
            else:
                out.append(line)
    return "".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True, help="Unix socket path or host:port")
    ap.add_argument("--short", action="store_true", help="fewer windows; no memory or µs figures")
    ap.add_argument("--json")
    ap.add_argument("--svg")
    ap.add_argument("--markdown")
    ap.add_argument("--check-bounds")
    a = ap.parse_args()

    r = Redis(a.redis)
    shas = {}
    for name, file in SCRIPTS.items():
        shas[name] = r.call("SCRIPT", "LOAD", assembled(file).encode()).decode()

    results = {"window_ms": WINDOW, "limit": LIMIT, "traces": {}, "cost": {}}
    chart = {}
    violations = []
    for tname, trace in traces(a.short).items():
        row = {}
        decisions = {}
        for alg in ALGORITHMS:
            admitted, _ = replay(r, shas, alg, tname, trace, "acc")
            decisions[alg] = admitted
            over, under, units = accuracy(trace, admitted)
            row[alg] = {"over": over, "under": under, "units": units}
            if tname == "edge_bursts":
                chart[alg] = in_window_series(trace, admitted)
        for alg in ALGORITHMS:
            row[alg]["vs_log"] = row[alg]["units"] / row["log"]["units"]
        if decisions["ring"] != decisions["log"]:
            violations.append("%s: the ring decided differently from the log" % tname)
        results["traces"][tname] = {"requests": len(trace), "units": sum(c for _, c in trace), "algorithms": row}

    if not a.short:
        steady_trace = traces(False)["steady_1.5x"]
        for alg in ALGORITHMS:
            results["cost"][alg] = {
                "memory_100": memory_per_key(r, shas, alg, 100),
                "memory_10000": memory_per_key(r, shas, alg, 10_000),
                "usec_per_call": usec_per_call(r, shas, alg, steady_trace),
            }

    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.svg:
        with open(a.svg, "w") as f:
            f.write(svg_chart(chart, "edge-burst trace: admitted in the last window (%d min), per algorithm, limit %d" % (WINDOW // 60_000, LIMIT)))
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown(results))

    if a.check_bounds:
        bounds = bounds_from(a.check_bounds)
        for tname, t in results["traces"].items():
            for alg, m in t["algorithms"].items():
                if alg not in bounds:
                    violations.append("%s has no documented bound" % alg)
                    continue
                over_b, under_b = bounds[alg]
                if m["over"] > over_b + 1e-9:
                    violations.append("%s on %s: over-admission %.3f above its bound %.2f" % (alg, tname, m["over"], over_b))
                if m["under"] > under_b + 1e-9:
                    violations.append("%s on %s: under-admission %.2f%% above its bound %.2f%%" % (alg, tname, 100 * m["under"], 100 * under_b))
    for v in violations:
        print("VIOLATION: " + v, file=sys.stderr)
    if not a.markdown:
        print(json.dumps(results["traces"], indent=1))
    return 1 if violations else 0


def markdown(res):
    names = list(res["traces"])
    out = ["Limit %d per window of %d ms (virtual clock); %s." % (res["limit"], res["window_ms"], ", ".join("%s %d requests" % (n, t["requests"]) for n, t in res["traces"].items())), ""]
    out.append("Over-admission (most units admitted in any sliding window ÷ limit) / under-admission (requests refused while admitting them kept every window at or below the limit) / units admitted vs the exact log:")
    out.append("")
    out.append("| Algorithm | " + " | ".join(names) + " |")
    out.append("|---|" + "---|" * len(names))
    for alg in ALGORITHMS:
        cells = []
        for n in names:
            m = res["traces"][n]["algorithms"][alg]
            cells.append("%.2f / %.1f%% / %.0f%%" % (m["over"], 100 * m["under"], 100 * m["vs_log"]))
        out.append("| `%s` | %s |" % (alg, " | ".join(cells)))
    if res["cost"]:
        out.append("")
        out.append("| Algorithm | `MEMORY USAGE` at limit 100 | at limit 10,000 | Redis µs per call (steady trace) |")
        out.append("|---|---|---|---|")
        for alg in ALGORITHMS:
            c = res["cost"][alg]
            out.append("| `%s` | %d B | %d B | %.2f |" % (alg, c["memory_100"], c["memory_10000"], c["usec_per_call"]))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
