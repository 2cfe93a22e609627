"""Node-side fact collector for ``hetctl probe`` (stdlib only, shipped over SSH).

The controller sends this file as the program on stdin (``python3 - ARGS``), behind
the tool runner it uses (:mod:`hetctl.node.toolrun`, one text: :func:`hetctl.node.source`),
so that a node needs nothing but a Python interpreter: no hetctl install, no pip.
``ARGS`` is one JSON object::

    {"tools": {"nvidia-smi-csv": ["nvidia-smi", "--query-gpu=...", ...], ...},
     "timeout": 20}

The collector gathers raw facts and prints one JSON object (the ``raw`` dict
that :func:`hetctl.probe.tools.chips_from_raw` and
:func:`hetctl.probe.assemble.node_facts` parse on the controller)::

    {"collector": 1, "hostname": str,
     "tools": {key: {"argv": [...], "rc": int | None, "stdout": str,
                     "stderr": str, "timeout": bool}},
     "pci": [{"address", "vendor", "device", "class"}],
     "dev": ["nvidia0", "davinci0", "biren/card_0", ...],
     "cpu": {"model": str | None, "cores": int | None},
     "memory_gb": float | None,
     "nics": [{"name", "kind", "speed_gbps"}],
     "software": {"python", "torch", "plugins": {dist: version}, "drivers": {module: version}},
     "elapsed_s": float}

Nothing is parsed here beyond reading single-value files: vendor formats are
parsed on the controller by pure functions, where tests meet real captures.
Tools run in parallel threads, each with its own timeout, only when their
``argv[0]`` exists, so a node without accelerators answers in well under a
second.

Test seam: when ``HETCTL_SYSFS_ROOT`` is set, ``/sys/...`` and ``/dev/...`` are
read below that directory instead of ``/`` (``$HETCTL_SYSFS_ROOT/sys/bus/pci/
devices``, ``$HETCTL_SYSFS_ROOT/dev/davinci0``). Integration tests use it to give
each loopback sshd host its own simulated hardware; it is never set in production.
"""

import json
import os
import platform
import signal
import socket
import sys
import threading
import time

if "collect_tools" not in globals():  # imported from the package; shipped, toolrun.py's text is already above
    from hetctl.node.toolrun import collect_tools, on_term

SYSFS_ROOT_ENV = "HETCTL_SYSFS_ROOT"

# PCI base classes that never hold an accelerator: mass storage, network,
# memory, bridges, communication, base peripherals, input, docking, serial bus.
SKIP_PCI_CLASSES = ("0x01", "0x02", "0x05", "0x06", "0x07", "0x08", "0x09", "0x0a", "0x0c")

# /dev entries (top level, or the directories named) that accelerators create.
DEV_PREFIXES = (
    "nvidia", "davinci", "devmm_svm", "hisi_hdc", "mtgpu", "cambricon", "iluvatar", "itrctl",
    "mxcd", "mxnd", "mxgd", "kfd", "mkfd", "gcu", "accel", "biren", "dri", "hl", "xpu", "alixpu",
)
DEV_DIRS = ("biren", "dri", "accel")


def _root():
    return os.environ.get(SYSFS_ROOT_ENV, "").rstrip("/")


def _hw(path):
    """Map an absolute /sys or /dev path below the test root when one is set."""
    return _root() + path


def _read(path, default=None):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return default


def collect_pci():
    base = _hw("/sys/bus/pci/devices")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for addr in names:
        d = os.path.join(base, addr)
        cls = _read(os.path.join(d, "class"), "")
        if cls[:4].lower() in SKIP_PCI_CLASSES:
            continue
        out.append({
            "address": addr,
            "vendor": _read(os.path.join(d, "vendor")),
            "device": _read(os.path.join(d, "device")),
            "class": cls or None,
        })
    return out


def collect_dev():
    base = _hw("/dev")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    out = []
    for name in names:
        if not name.startswith(DEV_PREFIXES):
            continue
        path = os.path.join(base, name)
        if name in DEV_DIRS and os.path.isdir(path):
            try:
                out.extend("%s/%s" % (name, sub) for sub in sorted(os.listdir(path)))
            except OSError:
                pass
        else:
            out.append(name)
    return out


def collect_cpu():
    model = None
    info = _read("/proc/cpuinfo", "")
    for line in info.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model", "hardware") and value.strip():
            model = value.strip()
            break
    if model is None:
        model = platform.processor() or platform.machine() or None
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count()
    return {"model": model, "cores": cores}


def collect_memory_gb():
    for line in _read("/proc/meminfo", "").splitlines():
        if line.startswith("MemTotal:"):
            try:
                return round(int(line.split()[1]) / 1024 / 1024, 1)
            except (IndexError, ValueError):
                return None
    return None


def _rdma_netdevs():
    """netdev name → (link_layer, Gb/s) for every RDMA port that has a netdev."""
    out = {}
    base = _hw("/sys/class/infiniband")
    try:
        hcas = sorted(os.listdir(base))
    except OSError:
        return out, []
    bare = []
    for hca in hcas:
        ports_dir = os.path.join(base, hca, "ports")
        try:
            ports = sorted(os.listdir(ports_dir))
        except OSError:
            ports = []
        link, rate = None, None
        for p in ports:
            link = link or _read(os.path.join(ports_dir, p, "link_layer"))
            r = _read(os.path.join(ports_dir, p, "rate"), "")
            try:
                rate = max(rate or 0.0, float(r.split()[0]))
            except (IndexError, ValueError):
                pass
        try:
            nets = sorted(os.listdir(os.path.join(base, hca, "device", "net")))
        except OSError:
            nets = []
        for n in nets:
            out[n] = (link, rate)
        if not nets:
            kind = "roce" if (link or "").lower() == "ethernet" else "ib"
            bare.append({"name": hca, "kind": kind, "speed_gbps": rate})
    return out, bare


def collect_nics():
    rdma, bare = _rdma_netdevs()
    base = _hw("/sys/class/net")
    try:
        names = sorted(os.listdir(base))
    except OSError:
        names = []
    nics = []
    for name in names:
        d = os.path.join(base, name)
        dev_type = _read(os.path.join(d, "type"))
        speed = None
        s = _read(os.path.join(d, "speed"))
        try:
            mbps = int(s) if s is not None else -1
            if mbps > 0:
                speed = mbps / 1000.0
        except ValueError:
            pass
        if name == "lo" or dev_type == "772":
            kind = "loopback"
        elif dev_type == "32":
            kind = "ib"
        elif name in rdma:
            kind = "roce" if (rdma[name][0] or "ethernet").lower() == "ethernet" else "ib"
        elif os.path.exists(os.path.join(d, "device")):
            kind = "ethernet"
        else:
            kind = "other"
        if speed is None and name in rdma:
            speed = rdma[name][1]
        nics.append({"name": name, "kind": kind, "speed_gbps": speed})
    return nics + bare


def installed_dists():
    """Normalised distribution name → version, from ``*.dist-info`` / ``*.egg-info`` on sys.path.

    A directory listing per path entry instead of :mod:`importlib.metadata`,
    whose import and per-name scans cost tens of milliseconds on every node.
    The first entry on ``sys.path`` wins, as it does for imports.
    """
    found = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for n in names:
            if not n.endswith((".dist-info", ".egg-info")):
                continue
            name, _, version = n.rsplit(".", 1)[0].partition("-")
            version = version.split("-py")[0]
            key = name.lower().replace("-", "_").replace(".", "_")
            if version and key not in found:
                found[key] = version
    return found


def collect_software(plugin_dists=(), driver_modules=()):
    """Versions of python, torch, the vendor plugins and the drivers.

    ``plugin_dists`` (normalised distribution names, read from package metadata so
    that torch itself is never imported: importing it costs seconds) and
    ``driver_modules`` (kernel modules whose version file names the driver) come in
    the collector's arguments, from hetctl's vendor table.
    """
    dists = installed_dists()
    plugins = {d: dists[d] for d in plugin_dists if d in dists}
    drivers = {}
    for mod in driver_modules:
        v = _read(_hw("/sys/module/%s/version" % mod))
        if v:
            drivers[mod] = v
    ascend = _read("/usr/local/Ascend/driver/version.info", "")
    for line in ascend.splitlines():
        if line.lower().startswith("version="):
            drivers["ascend"] = line.split("=", 1)[1].strip()
    return {
        "python": platform.python_version(),
        "torch": dists.get("torch"),
        "plugins": plugins,
        "drivers": drivers,
    }


def collect(args):
    """Gather every raw fact; ``args`` is the decoded JSON argument."""
    start = time.monotonic()
    timeout = float(args.get("timeout", 20))
    # Tool threads run while this thread reads files: the slow part overlaps.
    tools_box = {}
    tool_thread = threading.Thread(
        target=lambda: tools_box.update(collect_tools(args.get("tools") or {}, timeout)), daemon=True
    )
    tool_thread.start()
    raw = {
        "collector": 1,
        "hostname": socket.gethostname(),
        "pci": collect_pci(),
        "dev": collect_dev(),
        "cpu": collect_cpu(),
        "memory_gb": collect_memory_gb(),
        "nics": collect_nics(),
        "software": collect_software(args.get("plugin_dists") or (), args.get("driver_modules") or ()),
    }
    tool_thread.join(timeout + 10)
    raw["tools"] = dict(tools_box)
    raw["elapsed_s"] = round(time.monotonic() - start, 3)
    return raw


def main(argv):
    signal.signal(signal.SIGTERM, on_term)
    try:
        args = json.loads(argv[1]) if len(argv) > 1 else {}
    except ValueError as e:
        sys.stderr.write("hetctl collector: bad argument JSON: %s\n" % e)
        return 2
    json.dump(collect(args), sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
