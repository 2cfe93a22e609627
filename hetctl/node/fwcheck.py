"""Whether a node can run a framework's rendered command: runs there as ``python -c`` (stdlib only).

Argument: one JSON object ``{"workdir": W, "files": [[VAR, DEFAULT, REL], …],
"modules": [M, …]}``. Each file is ``${VAR:-DEFAULT}/REL`` as the rank's script
would expand it (VAR from this process's environment, the inventory's ``env:``;
relative paths from the workdir, where ranks start); an empty REL names the
value itself (``HETCTL_SCRIPT``). Prints one JSON line: ``{"files": [[path,
exists], …], "modules": {M: found}}``. Modules are found, not imported (cheap).
"""

import importlib.util
import json
import os
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    wd = os.path.expanduser(spec.get("workdir") or ".")
    files = []
    for var, default, rel in spec.get("files", []):
        base = os.environ.get(var) or default if var else default
        path = os.path.join(base, rel) if rel else base
        full = path if os.path.isabs(path) else os.path.join(wd, path)
        files.append([path, os.path.isfile(full)])
    modules = {}
    for m in spec.get("modules", []):
        try:
            modules[m] = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            modules[m] = False
    print(json.dumps({"files": files, "modules": modules}))


if __name__ == "__main__":
    main()
