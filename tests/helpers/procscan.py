"""Finding the processes a test helper started, by a marker in their environment or a word in their argv."""

from __future__ import annotations

import os
from typing import Callable

import psutil


def marked(env_var: str, marker: str, in_argv: Callable[[bytes], bool] = lambda cmd: False) -> list[psutil.Process]:
    """Live processes with ``env_var=marker`` (or ``marker:…``) in their environment, or whose argv ``in_argv`` finds.

    Reads ``/proc/<pid>/{environ,cmdline}`` directly: psutil's parsing of every
    process's environment made stopping a cluster take seconds. Zombies have
    neither, so they never match.
    """
    needle = f"{env_var}={marker}".encode()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        hit = needle in env and any(v == needle or v.startswith(needle + b":") for v in env.split(b"\0"))
        if hit or in_argv(cmd):
            try:
                out.append(psutil.Process(int(entry.name)))
            except psutil.NoSuchProcess:
                continue
    return out
