"""The one reader thread of every agent's streams (hetctl.launch.reader), on real pipes and processes."""

from __future__ import annotations

import io
import os
import queue
import subprocess
import sys
import threading
import time

from hetctl.launch import reader, wire

WRITER = r"""
import sys, time
n, tag = int(sys.argv[1]), sys.argv[2]
for i in range(n):
    sys.stdout.write(f"{tag} {i}\n")
    if i % 50 == 0:
        sys.stdout.flush(); time.sleep(0.01)
sys.stdout.write(f"{tag} last")
"""


def _collect() -> tuple[list, threading.Event, reader.OnLine, reader.OnEnd]:
    got: list = []
    ended = threading.Event()

    def on_end() -> None:
        assert not ended.is_set(), "on_end called twice"
        ended.set()

    return got, ended, got.append, on_end


def test_one_thread_reads_many_processes_every_line_in_order():
    r = reader.Reader()
    fallback = sum(1 for t in threading.enumerate() if t.name == "reader")  # other tests' fake streams, if any
    procs, sinks = [], []
    for k in range(40):
        p = subprocess.Popen([sys.executable, "-I", "-c", WRITER, "300", f"p{k}"], stdout=subprocess.PIPE)
        got, ended, on_line, on_end = _collect()
        r.add(p.stdout, on_line, on_end)
        procs.append(p)
        sinks.append((got, ended))
    assert r._thread is not None and r._thread.is_alive()  # one thread of its own for the 40 streams
    assert sum(1 for t in threading.enumerate() if t.name == "reader") <= fallback  # and none per stream
    for k, (got, ended) in enumerate(sinks):
        assert ended.wait(30)
        assert got == [f"p{k} {i}\n".encode() for i in range(300)] + [f"p{k} last".encode()]
    for p in procs:
        p.wait(10)
        p.stdout.close()
    assert r.streams() == 0


def test_what_the_stream_had_already_buffered_comes_first():
    """A start line read with readline leaves the next lines in the stream's buffer, not in the pipe."""
    p = subprocess.Popen([sys.executable, "-I", "-c", "import sys; sys.stdout.write('start\\na\\nb\\n'); "
                          "sys.stdout.flush(); sys.stdin.read(); print('c')"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert p.stdout.readline() == b"start\n"
    got, ended, on_line, on_end = _collect()
    reader.Reader().add(p.stdout, on_line, on_end)
    p.stdin.close()
    assert ended.wait(30) and got == [b"a\n", b"b\n", b"c\n"]
    p.wait(10)


def test_a_line_over_the_limit_is_refused_with_at_most_the_limit_held():
    got, ended, on_line, on_end = _collect()
    cut = reader.LineCut(1000, on_line, on_end)
    data = b"a\n" + b"y" * 100_000 + b"\nb\n" + b"z" * 999 + b"\n" + b"w" * 1000 + b"\n" + b"tail"
    most = 0
    for i in range(0, len(data), 333):
        cut.feed(data[i:i + 333])
        most = max(most, len(cut.buf))
    cut.end()
    assert most <= 1000 and ended.is_set()
    assert got[0] == b"a\n" and got[2] == b"b\n" and got[3] == b"z" * 999 + b"\n" and got[5] == b"tail"
    assert isinstance(got[1], wire.Refused) and got[1].reason == "a line of 100001 bytes or more (the limit is 1000)"
    assert isinstance(got[4], wire.Refused) and got[4].reason.startswith("a line of 1001 bytes")


def test_a_stream_its_owner_closed_without_an_eof_ends():
    """A node whose pipe the controller closed (the agent never hung up) still ends, and its number is free."""
    rfd, wfd = os.pipe()
    stream = os.fdopen(rfd, "rb")
    got, ended, on_line, on_end = _collect()
    r = reader.Reader()
    r.add(stream, on_line, on_end)
    os.write(wfd, b"one\n")
    stream.close()
    assert ended.wait(10)
    rfd2, wfd2 = os.pipe()  # the same descriptor number, most likely: it must read the new stream
    stream2 = os.fdopen(rfd2, "rb")
    got2, ended2, on_line2, on_end2 = _collect()
    r.add(stream2, on_line2, on_end2)
    os.write(wfd2, b"two\n")
    os.close(wfd2)
    assert ended2.wait(10) and got2 == [b"two\n"]
    os.close(wfd)


def test_a_stream_without_a_descriptor_is_read_by_a_thread_of_its_own():
    got, ended, on_line, on_end = _collect()
    reader.Reader().add(io.BytesIO(b"x\ny"), on_line, on_end)
    assert ended.wait(10) and got == [b"x\n", b"y"]


def test_the_agent_connection_reads_its_streams_through_the_shared_reader():
    """AgentLink hands both streams to the one reader: events to the inbox, stderr to the tail, EOF once."""
    from hetctl.launch.agentlink import AgentLink
    from hetctl.remote.local import LocalProcess

    p = subprocess.Popen([sys.executable, "-I", "-c", "import sys; print('{\"ev\": \"hello\"}'); "
                          "print('boom', file=sys.stderr)"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    agent = AgentLink("n1", None, LocalProcess(p), inbox)
    assert agent.eof.wait(30)
    p.wait(10)
    first, last = inbox.get(timeout=5), inbox.get(timeout=5)
    assert first[:2] == ("n1", {"ev": "hello"}) and last[:2] == ("n1", None)
    assert first[2] <= last[2] <= time.monotonic()  # when each was read: the monitor's lag is measured by it
    for _ in range(50):
        if agent.tail():
            break
        threading.Event().wait(0.1)
    assert agent.tail() == "boom"


def test_an_agents_tail_is_its_own_stderr_after_the_start_line_read_back_from_its_file(tmp_path):
    """With stderr in a file (one descriptor per agent): an earlier agent's lines and what the login shell
    printed before the start line are not this agent's last words."""
    from hetctl.files.inventory import Node
    from hetctl.launch.agentlink import AgentLink
    from hetctl.remote.local import LocalTransport

    err = tmp_path / "agent.stderr"
    err.write_text("the agent of the attempt before\n")
    t = LocalTransport(Node(name="n1", host="localhost", python=sys.executable))
    p = t.start(["sh", "-c", "echo 'a banner' >&2; echo hetctl-pid:$$ >&2; echo '{\"ev\": \"hello\"}'; "
                 "echo 'Traceback: boom' >&2"], stderr_to=err)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    agent = AgentLink("n1", t, p, inbox)
    assert agent.eof.wait(30) and p.wait(10) == 0
    assert inbox.get(timeout=5)[:2] == ("n1", {"ev": "hello"})
    assert agent.tail() == "Traceback: boom"
    assert "the agent of the attempt before" in err.read_text()  # kept: the file is the node's, every attempt's
