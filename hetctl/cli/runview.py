"""What ``launch``, ``demo`` and ``resume`` print: the dry run (each node's agent command, each rank's argv
and environment, nothing started) and the run's summary at the end, with the exit code it means."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from hetctl.cli.base import err, out, print_json, text
from hetctl.textsafe import json_dumps

if TYPE_CHECKING:
    from hetctl.files.inventory import Inventory
    from hetctl.launch.materialize import LaunchSpec


def warn(line: str) -> None:
    """A warning on stderr, after what stdout already holds."""
    out.file.flush()
    err.print(text(("warning:", "yellow"), " ", line), highlight=False, soft_wrap=True)


def loss_span(first: float | None, final: float | None) -> str:
    """``5.5000 → 1.2000``; a missing end is ``-``, and a NaN or infinite one says the run diverged."""
    import math

    def one(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}" if math.isfinite(x) else f"{x} (diverged)"

    return "-" if first is None and final is None else f"{one(first)} → {one(final)}"


def finish_launch(result, json_out: bool, warning: str | None = None, extra: dict | None = None) -> None:
    """Summary on stdout, then ``warning`` (a plan rendered anyway); exit 0 only on success (3: could not start,
    5: failed, 130: stopped). ``extra``: the demo's export and sample (a ``demo`` key in the JSON)."""
    from hetctl.errors import RunFailed

    s = result.summary
    if json_out:
        if extra is None:
            print_json(s.model_dump_json(indent=2))
        else:
            print_json(json_dumps({**s.model_dump(mode="json"), "demo": extra}, indent=2))
    else:
        loss = loss_span(s.first_loss, s.final_loss)
        tps = "-" if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}"
        colour = {"succeeded": "green", "failed": "red", "stopped": "yellow"}.get(s.state, "")
        out.print(text((s.state, f"bold {colour}"), f"  run {s.run_id}  steps {s.steps}  loss {loss}  tokens/s {tps}  "
                       f"attempts {s.attempts}  restarts {s.restarts}"), highlight=False, soft_wrap=True)
        out.print(text(f"run folder: {s.run_dir}"), highlight=False, soft_wrap=True)
        if s.step_ratio is not None:
            out.print(text(f"step time: measured {s.measured_step_s:.4g} s, planned {s.predicted_step_s:.4g} s "
                           f"(measured ÷ planned {s.step_ratio:.3g}); `hetctl plan --calibrate {s.run_dir}` "
                           "re-plans with the measured speeds"), highlight=False, soft_wrap=True)
            if extra and extra.get("step_note"):
                out.print(text((extra["step_note"], "dim")), highlight=False, soft_wrap=True)
        for r in s.recoveries:
            out.print(text(f"attempt {r.attempt}: from {'its peers' if r.recovery_path == 'peer' else 'the checkpoint'}"
                           f" at step {r.resume_step or 0}, {r.steps_lost} completed steps lost"), highlight=False)
        if "diverged" in loss:
            err.print(text(("warning:", "yellow"), " the loss is not a number at the end: the model diverged; lower the "
                           "learning rate or resume from an earlier checkpoint"), highlight=False, soft_wrap=True)
        if s.reason and s.state != "succeeded":
            out.print(text(f"reason: {s.reason}"), highlight=False, soft_wrap=True)
        if any(r.restart_s is not None for r in s.recoveries):
            from hetctl.elastic.recovery import describe

            for r in s.recoveries:  # seconds from the failure: where each restart's time went
                if r.restart_s is not None:
                    out.print(text(f"recovery: {describe(r)}"), highlight=False, soft_wrap=True)
        if extra and extra.get("export"):
            if extra.get("sample") is None:
                out.print(text(f"exported to {extra['export']}; `pip install transformers` to see it generate text"),
                          highlight=False, soft_wrap=True)
            else:
                out.print(text(("transformers generated from the export:", "bold")), highlight=False)
                out.print(text(extra["sample"]), highlight=False, soft_wrap=True)  # the console drops control bytes
    if warning:
        warn(warning)
    if s.state != "succeeded":
        err.print(text(("continue with:", "dim"), f" hetctl resume {s.run_dir}"), highlight=False, soft_wrap=True)
        raise typer.Exit(130 if s.state == "stopped" else RunFailed.exit_code)


def print_dry_run(spec: LaunchSpec, inv: Inventory | None = None, ssh: dict[str, Any] | None = None,
                  note: str | None = None) -> None:
    """Per node: the agent command, then each rank's argv and environment (inventory env values masked but
    ``public_env``'s); ``note``: the node checks a launch would run first."""
    import shlex

    from hetctl.launch.materialize import mask_env

    from hetctl.remote.relay import relays_of

    steps: dict[str, dict] | None = None  # the Slurm nodes' agent steps, made at the first
    relays = relays_of(inv, spec) if inv is not None else {}  # node → the relay its agent goes through
    out.print(text(("dry run", "bold"), f": attempt {spec.attempt}, {sum(len(n.ranks) for n in spec.nodes)} ranks on "
              f"{len(spec.nodes)} nodes; rendezvous {spec.master_addr}:{spec.master_port}; "
              f"checkpoints {spec.ckpt_dir}; nothing started"), highlight=False, soft_wrap=True)
    if note:
        out.print(text(note), highlight=False, soft_wrap=True)
    for n in spec.nodes:
        out.print(text("\n", (n.node, "bold"), f" ({n.transport} {n.host}, workdir {n.workdir})"), highlight=False)
        eff = (ssh or {}).get(n.node)
        if isinstance(eff, str):
            out.print(text(("  ssh: ", "red"), eff), highlight=False, soft_wrap=True)
        elif eff is not None:  # what `ssh -G` says: the connection as it will be made
            via = f" via {' → '.join(eff.jump_path or (eff.proxy_jump,))}" if eff.proxy_jump else ""
            via += f" via ProxyCommand {eff.proxy_command}" if eff.proxy_command else ""
            out.print(text(f"  ssh: {eff.user}@{eff.hostname}:{eff.port}{via}; keys "
                           f"{', '.join(eff.identity_files) or 'agent only'}; known_hosts "
                           f"{', '.join(eff.known_hosts)}; StrictHostKeyChecking {eff.strict_host_key_checking}"),
                      highlight=False, soft_wrap=True)
        if relay := relays.get(n.node):
            out.print(text(f"  relay: {'itself' if relay == n.node else relay + ' (its agent over ssh from there)'}"),
                      highlight=False)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in mask_env(n.env, inv.public_env if inv is not None else ()).items())
        out.print(text(f"  agent: {env + ' ' if env else ''}{shlex.join(n.agent_argv)}"), highlight=False,
                  soft_wrap=True)
        if n.transport == "slurm" and inv is not None:  # the step the agent runs in
            from hetctl.remote.slurmstep import dry_run_steps, srun_text

            steps = steps if steps is not None else dry_run_steps(inv, spec)
            out.print(text(f"  srun: {srun_text(steps[n.node])}"), highlight=False, soft_wrap=True)
        for r in n.ranks:
            out.print(text(f"  rank {r.rank} (replica {r.replica}, stage {r.stage}, "
                           f"layers {r.layers[0]}:{r.layers[1]}):"), highlight=False)
            for k in sorted(r.env):
                out.print(text(f"    {k}={shlex.quote(r.env[k])}"), highlight=False, soft_wrap=True)
            argv = r.argv
            if argv[:2] == ("bash", "-c"):  # a rendered framework rank: name its script rather than print it
                from hetctl.plan.render import script_name

                argv = ("bash", "-c", f"<plan/nodes/{script_name(n.node)} for rank {r.rank} alone, then exec>",
                        *argv[3:])
            out.print(text(f"    {shlex.join(argv)}"), highlight=False, soft_wrap=True)
