"""One JSON line for one fleet run: wrk's output of every host, the Redis
and daemon counters before and after, and the shared key's audit.

Usage: collect.py LABEL DELAY_MS URL CONNS SECONDS HOSTS "EVALSHA0 CPU0" "EVALSHA1 CPU1"
                  "FAIL0 DECISIONS0 SHARE_UNITS0 GRANTED0 RETURNED0" "FAIL1 ... RETURNED1" AUDIT_JSON WRK_TXT...
(the daemons' counters summed over the hosts: fail-policy decisions,
ratelimitd_decisions_total, ratelimitd_lease_share_units_total,
ratelimitd_lease_units_granted_total, ratelimitd_lease_units_returned_total;
the last two absent from a daemon older than them: null)
"""
import json
import os
import re
import sys

label, delay, url, conns, secs, hosts = sys.argv[1:7]
r0, r1 = sys.argv[7].split(), sys.argv[8].split()
d0, d1 = [int(x) for x in sys.argv[9].split()], [int(x) for x in sys.argv[10].split()]
fail0, fail1 = d0[0], d1[0]
audit = json.load(open(sys.argv[11]))
files = sys.argv[12:]


def us(v):
    m = re.match(r"([\d.]+)(us|ms|s|m)$", v)
    n, unit = float(m.group(1)), m.group(2)
    return n * {"us": 1, "ms": 1e3, "s": 1e6, "m": 60e6}[unit]


per_host = []
for f in files:
    text = open(f).read()
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
    requests = int(re.search(r"(\d+) requests in", text).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)$", text, re.M))
    per_host.append({
        "rps": rps, "requests": requests, "non2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": sum(int(x) for x in errors.groups()) if errors else 0,
        "p50_us": us(lat["50"]), "p99_us": us(lat["99"]),
    })
requests = sum(h["requests"] for h in per_host)
evalsha = int(r1[0]) - int(r0[0])
cpu = float(r1[1]) - float(r0[1])
print(json.dumps({
    "backend": os.environ.get("FLEET_BACKEND", "single"), "path": label, "delay_ms": float(delay), "url": url, "conns": int(conns), "seconds": int(secs),
    "hosts": int(hosts), "rps": sum(h["rps"] for h in per_host), "requests": requests,
    "non2xx": sum(h["non2xx"] for h in per_host), "socket_errors": sum(h["socket_errors"] for h in per_host),
    "p50_us": sum(h["p50_us"] for h in per_host) / len(per_host),
    "p99_us": sum(h["p99_us"] for h in per_host) / len(per_host),
    "evalsha": evalsha, "redis_calls_per_decision": evalsha / requests if requests else 0,
    "redis_cpu_us_per_decision": cpu * 1e6 / requests if requests else 0,
    "fail_policy": fail1 - fail0,
    # Responses other than 2xx and 3xx are the refusals (429) and failures:
    # what wrk saw admitted, to hold against Redis's record.
    "admitted_2xx": requests - sum(h["non2xx"] for h in per_host),
    # Requests the daemons decided (socket round trips from nginx; an
    # admission from a worker share never reaches the daemon) and the units
    # they handed to the workers' shares.
    "daemon_decisions": d1[1] - d0[1], "share_units": d1[2] - d0[2],
    # Where the leases' units went: granted = handed to workers + admitted
    # by the daemons + given back unused (+ held by a lease still open).
    "lease_units_granted": d1[3] - d0[3] if len(d1) > 3 else None,
    "lease_units_returned": d1[4] - d0[4] if len(d1) > 4 else None,
    "per_host": per_host, "audit": audit,
}))
