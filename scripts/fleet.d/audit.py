"""Reads Redis's own record of one sliding-window key while a run hammers it.

Polls ZRANGE key 0 -1 WITHSCORES every 100 ms until the stop file exists,
keeping every member ever seen with its score (the admission's time in ms).
An admission stays in the ZSET for a whole window (the script removes only
members older than the window), far longer than a poll's interval, so the
union of the polls is every admission of the run. Prints JSON: admissions,
the most admissions in any window (now - window, now], and how many the
exact log could have admitted under continuous demand over the same span.

Usage: audit.py PORT KEY WINDOW_MS LIMIT STOP_FILE START_FILE
(START_FILE appears when the measured run starts: Redis's TIME then marks
where demand is continuous; the warm-up before it is followed by a pause.)
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
seen = {}
polls = 0
started_ms = None
while True:
    done = os.path.exists(stop)
    if started_ms is None and os.path.exists(start):
        command(sock, "TIME")
        sec, usec = reader.read()
        started_ms = int(sec) * 1000 + int(usec) // 1000
    command(sock, "ZRANGE", key, 0, -1, "WITHSCORES")
    flat = reader.read()
    for i in range(0, len(flat), 2):
        seen[flat[i]] = int(float(flat[i + 1]))
    polls += 1
    if done:
        break
    time.sleep(0.1)

times = sorted(seen.values())
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
t, lo, hi = ((started_ms or times[0]) + window, 0, 0) if times else (0, 0, 0)
while times and t <= times[-1]:
    while hi < len(times) and times[hi] <= t:
        hi += 1
    while times[lo] <= t - window:
        lo += 1
    counts.append(hi - lo)
    t += 10
mean_in_window = sum(counts) / len(counts) if counts else None
print(json.dumps({
    "key": key, "admissions": len(times), "max_in_any_window": most, "limit": limit,
    "window_ms": window, "span_ms": span, "polls": polls,
    "mean_in_window": mean_in_window, "least_in_window": min(counts) if counts else None,
}))
