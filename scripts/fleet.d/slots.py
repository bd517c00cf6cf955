"""A cluster node's slot map (CLUSTER SLOTS), as scripts/fleet needs it.

Usage: slots.py PORT ports    the primaries' announced ports, one per line
       slots.py PORT ranges   "first last port" per slot range (the primary's)
"""
import socket
import sys

port, what = int(sys.argv[1]), sys.argv[2]


def read(f):
    line = f.readline()
    kind, rest = line[:1], line[1:-2]
    if kind == b"*":
        return [read(f) for _ in range(int(rest))]
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else f.read(n + 2)[:-2]
    if kind == b":":
        return int(rest)
    if kind == b"-":
        sys.exit(f"CLUSTER SLOTS on {port}: {rest.decode()}")
    return rest


sock = socket.create_connection(("127.0.0.1", port), timeout=5)
sock.sendall(b"*2\r\n$7\r\nCLUSTER\r\n$5\r\nSLOTS\r\n")
slots = read(sock.makefile("rb"))
if what == "ports":
    for p in sorted({r[2][1] for r in slots}):
        print(p)
elif what == "ranges":
    for r in sorted(slots):
        print(r[0], r[1], r[2][1])
else:
    sys.exit(f"unknown request {what!r} (ports, ranges)")
