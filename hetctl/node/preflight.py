"""Pre-flight of one node before an attempt starts: runs there as ``python -c`` (stdlib only).

Arguments: ``WORKDIR WANT_PORT MODULES [AGENT SHA256]`` (MODULES comma-separated).
Prints one JSON line: the python version and executable, the workdir as the node
expands it and whether it is writable (proved by creating a file), which modules
are importable (found, not imported: cheap) and their installed versions, with
WANT_PORT=1 a free TCP port for the rendezvous, the workdir's share id, and with
AGENT whether that file (in the workdir) already has the digest SHA256.

The share id is a random token kept in ``WORKDIR/.hetctl-share-id``, made by the
first node to look (written under a temp name and hard-linked into place, so one
node wins and the others read its whole token): nodes that report the same id and
the same path see one folder (an NFS home), and the controller ships each file
there once. A copied folder (a cloned disk image) carries the token too, so the
controller still checks, on every node, that the shipped files are there.
"""

import binascii
import hashlib
import importlib.util
import json
import os
import socket
import sys
import tempfile


def unsafe(wd: str):
    """Why another user could plant code in ``wd`` (ranks run there), or None when only we can write it.

    Ranks start in the workdir, so a ``torch.py`` planted there would be imported.
    """
    try:
        st = os.stat(wd)
    except OSError:
        return None
    if st.st_uid != os.getuid():
        return "owned by uid %d, not by this user (uid %d)" % (st.st_uid, os.getuid())
    # The sticky bit (/tmp's 1777) only keeps others from deleting our files: they can still
    # create a torch.py beside them, so it makes no folder safe.
    if st.st_mode & 0o002:
        return "writable by others (mode %o)" % (st.st_mode & 0o7777)
    if st.st_mode & 0o020 and not _own_group(st.st_gid):
        return "writable by its group (mode %o)" % (st.st_mode & 0o7777)
    return None


def _own_group(gid: int) -> bool:
    """Whether ``gid`` is this user's private group (no other user in it), as with a umask of 002."""
    try:
        import grp
        import pwd

        me = pwd.getpwuid(os.getuid()).pw_name
        group = grp.getgrgid(gid)
        if any(m != me for m in group.gr_mem):
            return False
        return not any(u.pw_gid == gid and u.pw_name != me for u in pwd.getpwall())
    except (ImportError, KeyError, OSError):
        return False


def share_id(wd: str):
    """The workdir's share token, made now when absent; None when the folder cannot hold it."""
    path = os.path.join(wd, ".hetctl-share-id")
    for _ in range(2):
        try:
            with open(path) as f:
                token = f.read().strip()
            if token:
                return token
        except OSError:
            pass
        try:
            fd, tmp = tempfile.mkstemp(dir=wd, prefix=".hetctl-share-id.")
        except OSError:
            return None
        try:
            os.write(fd, binascii.hexlify(os.urandom(8)) + b"\n")
            os.fsync(fd)
            os.close(fd)
            try:
                os.link(tmp, path)  # atomic: the first node's token stays
            except FileExistsError:
                pass
        except OSError:
            return None
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return None


def has_digest(path: str, sha256: str) -> bool:
    """Whether ``path`` is a file whose SHA-256 is ``sha256``."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return False
    return h.hexdigest() == sha256


def main(argv: list) -> dict:
    wd = os.path.abspath(os.path.expanduser(argv[0]))
    r = {"python": sys.version.split()[0], "executable": sys.executable, "workdir": wd, "writable": False}
    try:
        os.makedirs(wd, exist_ok=True)
        fd, p = tempfile.mkstemp(dir=wd, prefix=".hetctl-probe-")
        os.close(fd)
        os.unlink(p)
        r["writable"] = True
    except OSError as e:
        r["error"] = "%s: %s" % (e.filename or wd, e.strerror)
    r["unsafe"] = unsafe(wd)
    r["share_id"] = share_id(wd) if r["writable"] else None
    if len(argv) >= 5:
        r["agent_ok"] = has_digest(os.path.join(wd, argv[3]), argv[4])
    mods = {}
    for m in filter(None, argv[2].split(",")):
        try:
            mods[m] = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            mods[m] = False
    r["modules"] = mods
    versions = {}
    for m in mods:
        try:
            from importlib import metadata

            versions[m] = metadata.version(m)  # from the package's metadata: torch is not imported
        except Exception:  # noqa: BLE001 - not installed as a distribution (a source tree): no version
            pass
    r["versions"] = versions
    if argv[1] == "1":
        r["port"] = rendezvous_port()
    return r


def rendezvous_port() -> int:
    """A free TCP port for a rendezvous, taken below the kernel's ephemeral range where there is room.

    A port found by binding port 0 is an ephemeral one: between this pick and rank 0's bind, any
    outgoing connection on the node (gloo's, a store client's, another job's) may get it as its
    source port, and rank 0 then fails with EADDRINUSE. Ports below ``ip_local_port_range`` are
    never handed out that way (torchrun's default 29500 is one of them). Checked free by binding
    it; port 0's answer where no such port is free.
    """
    import random

    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    start = max(1024, low - 8192)
    for _ in range(64 if low - start >= 256 else 0):
        port = random.randrange(start, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def missing(pairs: list) -> list:
    """``--have PATH SHA256 …``: the paths that are not there with that digest."""
    return [p for p, d in zip(pairs[0::2], pairs[1::2]) if not has_digest(os.path.expanduser(p), d)]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--have"]:
        print(json.dumps({"missing": missing(sys.argv[2:])}))
    else:
        print(json.dumps(main(sys.argv[1:])))
