"""Node-side TCP stream test for ``hetctl probe --bench`` and ``launch --health-check`` (stdlib only).

One link is measured by two runs of this file, shipped like the collector as
``python3 - ARGS`` with the source on stdin, preceded by one line that sets
``TOKEN`` (a random nonce, so it never shows in ``ps``). ``ARGS`` is one JSON
object:

* the receiver, ``{"mode": "recv", "streams": 4, "wait_s": 60}``: listens on a
  free TCP port on every address, prints ``{"port": N}`` at once, then takes
  ``streams`` data connections that start with the token (others are closed
  unread), counts what arrives until each sender closes, and prints
  ``{"bytes": B, "seconds": S, "streams": K, "error": null}``: S runs from the
  first byte to the last connection's end. It gives up ``wait_s`` after starting.
* the sender, ``{"mode": "send", "host": "gpu-02", "port": N, "seconds": 1.0,
  "streams": 4, "pings": 20}``: first times ``pings`` one-byte round trips on a
  connection of its own (the median is ``rtt_ms``), then opens ``streams``
  connections and writes as fast as it can on all of them for ``seconds``, and
  prints ``{"sent": B, "seconds": S, "rtt_ms": R, "local": "10.0.0.1", "error": null}``.

Several streams because one Python stream stops short of a fast NIC; a short
fixed time because the check must stay cheap. The receiver's count is the
measurement: it is what crossed the link. Nothing here is estimated: a failure
(refused, unreachable, timed out) is the ``error`` line and no figure.
"""

import json
import socket
import sys
import threading
import time

TOKEN = globals().get("TOKEN", "")
CHUNK = 1 << 20
HELLO_TIMEOUT_S = 10.0


def _first_line(exc):
    text = str(exc).strip().splitlines()
    return "%s: %s" % (type(exc).__name__, text[0] if text else "")


def _listen():
    """A listening socket on a free port of every address (IPv4 and IPv6 where the node has both)."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64)
        except OSError:
            pass
    return socket.create_server(("", 0), backlog=64)


def _read_exact(conn, n):
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            break
        data += part
    return data


def receive(args, out=sys.stdout):
    streams = max(1, int(args.get("streams", 4)))
    deadline = time.monotonic() + float(args.get("wait_s", 60.0))
    srv = _listen()
    out.write(json.dumps({"port": srv.getsockname()[1]}) + "\n")
    out.flush()
    hello = TOKEN.encode()
    lock = threading.Lock()
    state = {"bytes": 0, "first": None, "last": None}
    workers = []

    def drain(conn):
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        got = 0
        first = None
        try:
            conn.settimeout(max(1.0, deadline - time.monotonic()))
            while True:
                n = conn.recv_into(view)
                if not n:
                    break
                if first is None:
                    first = time.monotonic()
                got += n
        except OSError:
            pass
        finally:
            conn.close()
        end = time.monotonic()
        with lock:
            state["bytes"] += got
            if first is not None:
                state["first"] = first if state["first"] is None else min(state["first"], first)
                state["last"] = end if state["last"] is None else max(state["last"], end)

    error = None
    try:
        while len(workers) < streams:
            left = deadline - time.monotonic()
            if left <= 0:
                error = "only %d of %d streams arrived in time" % (len(workers), streams)
                break
            srv.settimeout(left)
            conn, _ = srv.accept()
            conn.settimeout(HELLO_TIMEOUT_S)
            try:
                kind = _read_exact(conn, len(hello) + 1)
            except OSError:
                conn.close()
                continue
            if kind[:len(hello)] != hello:
                conn.close()  # not our sender
                continue
            if kind[-1:] == b"p":  # round trips: echo each byte until the sender closes
                try:
                    while True:
                        b = conn.recv(1)
                        if not b:
                            break
                        conn.sendall(b)
                except OSError:
                    pass
                conn.close()
                continue
            t = threading.Thread(target=drain, args=(conn,), daemon=True)
            t.start()
            workers.append(t)
    except socket.timeout:
        error = "only %d of %d streams arrived in time" % (len(workers), streams)
    except OSError as e:
        error = _first_line(e)
    finally:
        srv.close()
    for t in workers:
        t.join(max(0.0, deadline - time.monotonic()))
    seconds = (state["last"] - state["first"]) if state["first"] is not None else None
    return {"bytes": state["bytes"], "seconds": seconds, "streams": len(workers), "error": error}


def send(args):
    host, port = args["host"], int(args["port"])
    seconds = float(args.get("seconds", 1.0))
    streams = max(1, int(args.get("streams", 4)))
    pings = max(0, int(args.get("pings", 20)))
    hello = TOKEN.encode()
    report = {"sent": 0, "seconds": None, "rtt_ms": None, "local": None, "error": None}
    try:
        rtts = []
        if pings:
            with socket.create_connection((host, port), timeout=HELLO_TIMEOUT_S) as c:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                report["local"] = c.getsockname()[0]
                c.sendall(hello + b"p")
                for _ in range(pings):
                    t0 = time.perf_counter()
                    c.sendall(b"x")
                    if _read_exact(c, 1) != b"x":
                        raise OSError("the receiver closed the round-trip connection")
                    rtts.append(time.perf_counter() - t0)
            rtts.sort()
            report["rtt_ms"] = float("%.4g" % (1000 * rtts[len(rtts) // 2]))
        conns = [socket.create_connection((host, port), timeout=HELLO_TIMEOUT_S) for _ in range(streams)]
    except OSError as e:
        report["error"] = "cannot reach %s port %d: %s" % (host, port, _first_line(e))
        return report
    sent = [0] * streams
    stop_at = [0.0]
    payload = memoryview(bytes(CHUNK))

    def pump(i, conn):
        try:
            conn.sendall(hello + b"d")
            while time.monotonic() < stop_at[0]:
                conn.sendall(payload)
                sent[i] += len(payload)
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(HELLO_TIMEOUT_S + seconds)
            conn.recv(1)  # the receiver's close: everything sent has arrived
        except OSError as e:
            report["error"] = report["error"] or _first_line(e)
        finally:
            conn.close()

    t0 = time.monotonic()
    stop_at[0] = t0 + seconds
    threads = [threading.Thread(target=pump, args=(i, c), daemon=True) for i, c in enumerate(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report["sent"] = sum(sent)
    report["seconds"] = time.monotonic() - t0
    return report


def main(argv):
    try:
        args = json.loads(argv[1]) if len(argv) > 1 else {}
    except ValueError as e:
        sys.stderr.write("hetctl linkbench: bad argument JSON: %s\n" % e)
        return 2
    if args.get("mode") == "recv":
        report = receive(args)
    elif args.get("mode") == "send":
        report = send(args)
    else:
        sys.stderr.write("hetctl linkbench: mode must be recv or send\n")
        return 2
    json.dump(report, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
