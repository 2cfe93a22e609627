"""Whether a node's own Megatron-LM accepts a rank's arguments: its ``parse_args``, nothing more (stdlib only).

Runs as ``"$HETCTL_PYTHON" -c <this file> SCRIPT ARG…`` from a rank's rendered
script in its check mode (``hetctl/templates/_base.sh.j2``): the rank's own
python, environment, working folder and argv, with this program in front of
the training script. As ``python SCRIPT`` would, it puts the script's folder
first on ``sys.path``, so the Megatron-LM imported is the one the rank would
import (``$MEGATRON_DIR``, or FlagScale's ``third_party/Megatron-LM``). Then
``megatron.training.arguments.parse_args`` (``megatron.arguments`` before
Megatron-LM core 0.6), given the same ``extra_args_provider`` the script's
``__main__`` passes to ``pretrain`` (evaluated after running the script's
imports, not its ``__main__``). No ``validate_args``, no torch.distributed, no
CUDA; argparse's ``error`` raises instead of printing the usage and exiting.

Prints one JSON line last on stdout (whatever Megatron prints goes to stderr)::

    {"script": S, "megatron": DIR, "argv": [...], "ok": true}
    … "rejected": "unrecognized arguments: --foo 1"   (argparse's own message)
    … "import": "ModuleNotFoundError: No module named 'torch'"
    … "failed": "AssertionError: …"                  (parse_args raised something else)
"""

import argparse
import ast
import importlib
import json
import os
import runpy
import sys


class Rejected(Exception):
    """argparse refused the command line (its message)."""


def refuse(self, message):  # stands in for ArgumentParser.error: no usage dump, no exit
    raise Rejected(message)


def describe(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return (type(e).__name__ + (": " + text if text else ""))[:400]


def extra_args_provider(script: str):
    """What the script's ``__main__`` passes as ``extra_args_provider`` (None when it passes nothing).

    Its expression (``add_modelopt_args if has_nvidia_modelopt else None`` in Megatron-LM since core
    0.14) is evaluated in the script's own globals, after running its module code (its imports) under
    another name than ``__main__``.
    """
    with open(script, encoding="utf-8") as f:
        tree = ast.parse(f.read(), script)
    found = None
    for block in tree.body:  # `if __name__ == "__main__":`
        if isinstance(block, ast.If) and "__main__" in ast.dump(block.test):
            for node in ast.walk(block):
                if isinstance(node, ast.Call) and found is None:
                    found = next((k.value for k in node.keywords if k.arg == "extra_args_provider"), None)
    if found is None:
        return None
    names = runpy.run_path(script, run_name="__hetctl_argcheck__")
    return eval(compile(ast.Expression(found), script, "eval"), names)  # the script's own expression


def check(script: str, args: list) -> dict:
    out = {"script": script, "argv": args}
    here = os.path.dirname(os.path.realpath(script))  # first on sys.path, as `python SCRIPT` puts it
    if sys.path and sys.path[0] == "":  # where `python -c` put the working folder instead
        sys.path[0] = here
    else:
        sys.path.insert(0, here)
    sys.argv = [script] + args
    try:
        try:
            arguments = importlib.import_module("megatron.training.arguments")
        except ModuleNotFoundError as e:
            if e.name not in ("megatron", "megatron.training"):
                raise
            try:
                arguments = importlib.import_module("megatron.arguments")  # Megatron-LM before core 0.6
            except ModuleNotFoundError:
                raise e from None
        root = os.path.abspath(arguments.__file__)
        for _ in range(arguments.__name__.count(".") + 1):  # …/megatron/training/arguments.py → the checkout
            root = os.path.dirname(root)
        out["megatron"] = root
        extra = extra_args_provider(script)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - no torch, a broken install, failing imports
        out["import"] = describe(e)
        return out
    argparse.ArgumentParser.error = refuse
    try:
        arguments.parse_args(extra_args_provider=extra)
        out["ok"] = True
    except Rejected as e:
        out["rejected"] = str(e)
    except SystemExit as e:  # --help, --version: the rank would exit here too
        out["failed"] = f"parse_args exited ({e.code})"
    except Exception as e:  # noqa: BLE001 - whatever parse_args raises, the rank would meet it too
        out["failed"] = describe(e)
    return out


def main() -> None:
    stdout, sys.stdout = sys.stdout, sys.stderr  # Megatron's own prints; the answer is the last stdout line
    try:
        out = check(sys.argv[1], sys.argv[2:])
    finally:
        sys.stdout = stdout
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
