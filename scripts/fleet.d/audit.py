"""Reads Redis's own record of one sliding-window key while a run hammers it.

Polls ZRANGE key 0 -1 WITHSCORES, then TIME, every 100 ms until the stop
file exists, following every member ever seen and its score (an admission's
time in ms). An admission stays in the ZSET for a whole window (the script
removes only members older than the window), far longer than a poll's
interval, so the polls see every admission of the run. Prints JSON:
admissions, the most admissions in any window (now - window, now], and how
many the exact log could have admitted under continuous demand over the
same span.

Quota leases (docs/PERFORMANCE.md, "Quota leases") put members in the ZSET
that are not admissions yet: a lease's units, scored in the future
(t0 + life) when reserved. At the lease's settle a used unit is re-scored to
its admission's time (ZADD XX) and an unused one is removed. So:
  * a member's last score seen is its score (a re-scored member moves);
  * a member that disappears while its last score was still inside the
    window (score > T - window, T = Redis's TIME read after the ZRANGE
    that no longer shows it) was removed by a settle, not by the window
    (the scripts remove only scores <= their now - window, and their now
    is at or before T): a lease's unused unit, never an admission. It is
    counted in `withdrawn`, not in the admissions;
  * a member that disappears with a score at or below T - window left the
    window: an admission (or a unit of a lease never settled, which Redis
    counts as one: counting it too errs on the side of over-admission);
  * the members still there at the last poll are admissions: the stop file
    comes 1.2 s after the run, when every lease and worker share of the run
    has ended (life and validity at most 250 ms for a 1 s window) and been
    settled, and before the last used unit's window is over (a used unit is
    re-scored within life + one call of its reservation and stays a window
    after its time, far longer than a poll's interval, so its settled score
    is seen).
  * if the whole key vanishes (expiry), the members it held are counted as
    admissions at their last score (`vanished`): the conservative side.
  * a unit's name is `<base>.l<u>`, and a settle keeps units 1..used and
    removes used+1..granted: a withdrawn unit numbered below a unit of the
    same lease that stayed was used after all (a settle that ran so late
    that a trim took the re-scored unit before a poll saw it, i.e. more
    than a window minus the lease's life after the lease began): it is
    counted as an admission at its last score (`withdrawn_but_used`; 0 is
    expected, and any other number is reported).
The polls must come less than a window minus a lease's life (750 ms for
1 s) apart for all this: `max_poll_gap_ms` says how far apart they came.
A unit handed to an nginx worker (a worker share) is counted by the daemon
as used at t0 + life whether a worker admitted with it or not: Redis's
record holds it as an admission at the latest time it may have been one.
So the admissions here are at least the true admissions (compare with the
2xx responses) and the windows are those of Redis's record. With shares
the under-admission figure is the record's, not the true one: a burnt unit
counts as an admission (lowering it), and a share's units sit at t0 + life,
up to a lease's life (250 ms) after the worker admitted with them, so the
record's windows see them late (raising it just before, lowering it after).
The record is what decides, though: a share unit holds its room until
t0 + life + window, up to `life` longer than a per-request admission would,
and that much is true under-admission on a key at its limit.

Also reported: the most members the record held inside the window ending at
a poll (what a script call would count against the limit: future scores
included), which the scripts keep at or below the limit.

Usage: audit.py PORT KEY WINDOW_MS LIMIT STOP_FILE START_FILE
(START_FILE appears when the measured run starts and holds Redis's TIME
(seconds and microseconds) read just before it; demand is continuous from then on; the warm-up
before it is followed by a pause. Members scored at or after it are the
measured run's: a score is never before its admission's true time.)
"""
import json
import os
import socket
import sys
import time

port, key, window, limit, stop, start = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]


def command(sock, *args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    sock.sendall(b"".join(out))


class Reader:
    def __init__(self, sock):
        self.f = sock.makefile("rb")

    def read(self):
        line = self.f.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"*":
            return [self.read() for _ in range(int(rest))]
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)[:-2]
            return data
        if kind == b":":
            return int(rest)
        if kind == b"-":
            raise RuntimeError(rest.decode())
        return rest


sock = socket.create_connection(("127.0.0.1", port))
reader = Reader(sock)
alive = {}  # member -> score, as of the last poll
max_gap, last_poll = 0, None
gone = {}  # member -> score: left the window (admissions)
withdrawn = set()  # removed inside the window: a lease's unused units
withdrawn_scores = {}
vanished = 0
rescored = 0
most_in_record = 0
polls = 0
started_ms = None
while True:
    done = os.path.exists(stop)
    if started_ms is None and os.path.exists(start):
        sec, usec = open(start).read().split()
        started_ms = int(sec) * 1000 + int(usec) // 1000
    # TIME after the ZRANGE: any script call whose removals it shows ran
    # with a clock at or before now_ms.
    command(sock, "ZRANGE", key, 0, -1, "WITHSCORES")
    command(sock, "TIME")
    flat = reader.read()
    sec, usec = reader.read()
    now_ms = int(sec) * 1000 + int(usec) // 1000
    if last_poll is not None:
        max_gap = max(max_gap, now_ms - last_poll)
    last_poll = now_ms
    current = {flat[i]: int(float(flat[i + 1])) for i in range(0, len(flat), 2)}
    for m, score in alive.items():
        if m in current:
            continue
        if not current and score > now_ms - window:
            vanished += 1
            gone[m] = score
        elif score > now_ms - window:
            withdrawn.add(m)
            withdrawn_scores[m] = score
        else:
            gone[m] = score
    for m, score in current.items():
        if m in alive and alive[m] != score:
            rescored += 1
        withdrawn.discard(m)
        gone.pop(m, None)
    alive = current
    most_in_record = max(most_in_record, sum(1 for s in current.values() if s > now_ms - window))
    polls += 1
    if done:
        break
    time.sleep(0.1)

final = dict(gone)
final.update(alive)


def unit(m):
    base, sep, u = m.rpartition(b".l")
    return (base, int(u)) if sep and u.isdigit() else (None, None)


kept = {}  # lease base -> the highest unit number that stayed
for m in final:
    base, u = unit(m)
    if base is not None:
        kept[base] = max(kept.get(base, 0), u)
withdrawn_but_used = 0
for m in list(withdrawn):
    base, u = unit(m)
    if base is not None and kept.get(base, 0) > u:
        withdrawn.discard(m)
        final[m] = withdrawn_scores[m]
        withdrawn_but_used += 1
times = sorted(final.values())
most, j = 0, 0
for i, t in enumerate(times):
    # admissions in (t - window, t]
    while times[j] <= t - window:
        j += 1
    most = max(most, i - j + 1)
span = (times[-1] - times[0]) if times else 0
# Under-admission: in the run's interior (from one window after the
# measured run started to the last admission), where demand never stopped, the exact log
# holds `limit` admissions in every window; fewer means refusals while
# under the limit. Sampled every 10 ms: the mean and the least count.
counts = []
t, lo, hi = (max(started_ms or times[0], times[0]) + window, 0, 0) if times else (0, 0, 0)
while times and t <= times[-1]:
    while hi < len(times) and times[hi] <= t:
        hi += 1
    while times[lo] <= t - window:
        lo += 1
    counts.append(hi - lo)
    t += 10
mean_in_window = sum(counts) / len(counts) if counts else None
# AUDIT_DUMP=PREFIX (a diagnosis, not used by the fleet's report): the
# admissions' times and the interior's counts every 10 ms, to a file per run.
if os.environ.get("AUDIT_DUMP"):
    name = "%s-%d.json" % (os.environ["AUDIT_DUMP"], started_ms or 0)
    json.dump({"key": key.decode("latin-1") if isinstance(key, bytes) else key, "started_ms": started_ms, "times": times, "counts": counts}, open(name, "w"))
print(json.dumps({
    "key": key, "admissions": len(times), "max_in_any_window": most, "limit": limit,
    "window_ms": window, "span_ms": span, "polls": polls,
    "mean_in_window": mean_in_window, "least_in_window": min(counts) if counts else None,
    "started_ms": started_ms,
    "admissions_measured": sum(1 for x in times if started_ms is not None and x >= started_ms),
    "withdrawn": len(withdrawn), "withdrawn_but_used": withdrawn_but_used, "rescored": rescored, "vanished": vanished,
    "max_poll_gap_ms": max_gap,
    "most_in_record_at_a_poll": most_in_record,
}))
