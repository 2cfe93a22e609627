"""Progress read from a rank's own log lines, for scripts that never call ``hetctl.runtime.heartbeat``.

A Megatron-LM, FlagScale or DeepSpeed job, or a plain torchrun script, prints a
line per step. The agent matches each output line of a rank against a pattern
with named groups (``step`` required; ``loss``, ``step_ms``, ``step_s``
optional) and turns a match into a heartbeat, so hang detection, the live view
and the straggler check work on jobs that hetctl did not write. A rank that also
writes the heartbeat file (the precise path) is followed through the file.

Stdlib only (it runs inside the agent on the node).
"""

import re
import time

# The frameworks' own step lines; a preset may have several forms, tried in order.
PRESETS = {
    # Megatron-LM / FlagScale training_log() (Megatron-DeepSpeed writes lm_loss):
    #  " iteration      201/  250000 | consumed samples: 205824 | elapsed time per iteration (ms): 139113.4 |
    #    learning rate: 1.507E-05 | global batch size: 1024 | lm loss: 2.373574E+00 | ..."
    "megatron": (r"iteration\s+(?P<step>\d+)\s*/\s*\d+\s*\|.*?elapsed time per iteration \(ms\):\s*(?P<step_ms>[\d.]+)"
                 r"(?:.*?lm[ _]loss:\s*(?P<loss>[-+\d.eE]+))?",),
    # DeepSpeed: PipelineEngine "steps: 10 loss: 2.3456 iter time (s): 0.123 samples/sec: 259.1", and the
    # engine's "[Rank 0] step=40, skipped=2, lr=[5e-05], mom=[[0.9, 0.999]]" (no loss)
    "deepspeed": (r"steps:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>[-+\d.eE]+)\s+iter time \(s\):\s*(?P<step_s>[\d.]+)",
                  r"\[Rank \d+\] step=(?P<step>\d+), skipped="),
}


class LineProgress:
    """Turns matching output lines of one rank into heartbeat records."""

    def __init__(self, pattern: str) -> None:
        self.patterns = [re.compile(p) for p in PRESETS.get(pattern, (pattern,))]
        if any("step" not in p.groupindex for p in self.patterns):
            raise ValueError("a progress pattern needs a named group (?P<step>…)")

    def feed(self, line: str):
        """The heartbeat a line says (``{"step", "time", …}``), or None when it says nothing."""
        m = next((m for m in (p.search(line) for p in self.patterns) if m is not None), None)
        if m is None:
            return None
        try:
            hb = {"step": int(m.group("step")), "time": time.time(), "source": "log"}
        except (TypeError, ValueError):
            return None
        groups = m.groupdict()
        for key in ("loss", "step_ms", "step_s"):
            value = groups.get(key)
            if value is not None:
                try:
                    hb[key] = float(value)
                except ValueError:
                    pass
        if "step_s" in hb:
            hb["step_ms"] = hb.pop("step_s") * 1000.0
        return hb
