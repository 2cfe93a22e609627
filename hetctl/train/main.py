"""``python -m hetctl.train``: one rank of the reference pipeline trainer.

The launcher (agent, or ``tests/helpers/rankrunner.py``) sets the rank contract
(:data:`hetctl.node.runtime.TRAIN_ENV`); the run length and checkpoint interval come
as options, defaulting to ``HETCTL_STEPS`` and ``HETCTL_CKPT_EVERY``. The last
stage prints ``step=… loss=… step_ms=…`` per step; every rank writes its
heartbeat each step, and a final one with ``done: true``. Faults are injected
from outside with real signals. SIGTERM ends the rank at once (default handler),
except with data parallelism and ``--jit-checkpoint on`` (the default): the rank
then first writes its stage's state at the last step it can vouch for
(:mod:`hetctl.train.jit`), as it does when a collective fails on a peer's death,
and exits with status 143.

The optimizer (AdamW, its schedule, global-norm clipping, skipped non-finite
steps) is :mod:`hetctl.train.optim`; ``docs/training.md`` describes its options.

Exit codes: 0 done; 2 a configuration mistake (one line on stderr naming the
variable, plan key or checkpoint file); 6 training diverged (``--max-skipped-steps``
non-finite steps in a row: :class:`hetctl.train.optim.Diverged`).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import io
import json
import os
import pickle
import sys
import time

from hetctl.errors import CheckpointUnloadable, HetctlError
from hetctl.node.runtime import RankContext, load_plan
from hetctl.train import gradmode, optim
from hetctl.train.options import parse_args
from hetctl.vendors import VENDOR_TABLE

# The torch plugin that registers each device type (the vendor table's), imported only on that vendor's nodes.
DEVICE_PLUGINS = {v.device_type: v.torch_module for v in VENDOR_TABLE.values() if v.torch_module}


def _device(topo, torch):
    if topo.device_type == "cpu":
        return torch.device("cpu")
    plugin = DEVICE_PLUGINS.get(topo.device_type)
    if plugin:
        try:
            importlib.import_module(plugin)
        except ImportError:
            raise HetctlError(f"HETCTL_DEVICE_TYPE={topo.device_type} needs the torch plugin {plugin}, "
                              "which is not importable on this node", "install the vendor's torch plugin") from None
    # Normally the launcher narrows the vendor's visible-devices variable to this rank's chip (one
    # device, index 0); when every chip is visible, the plan's chip number is the index.
    mod = torch.get_device_module(topo.device_type)
    count = mod.device_count()
    if count < 1:
        raise HetctlError(f"HETCTL_DEVICE_TYPE={topo.device_type} but torch sees no such device on this node",
                          "check the driver and the visible-devices variable")
    index = 0 if count == 1 else (topo.chip if topo.chip is not None and topo.chip < count else 0)
    mod.set_device(index)
    return torch.device(topo.device_type, index)


def _default_backend(topo) -> str:
    """gloo for CPU tensors plus the vendor library for device tensors, when any link or group uses one."""
    vendor = {b for b in (topo.backend, topo.backend_prev, topo.backend_next) if b and b != "gloo"}
    if topo.device_type == "cpu" or not vendor:
        return "gloo"
    return f"cpu:gloo,{topo.device_type}:{sorted(vendor)[0]}"


def _tensor_group(topo, timeout, dist, saving: bool):
    """This rank's :class:`hetctl.train.tensor.TensorGroup` (None without TP); every rank creates every group.

    The group runs on the stage's comm library (gloo moves device tensors through host memory); saves
    gather shards on a gloo group of their own, so a save never interleaves with training's all-reduces.
    """
    if topo.tp == 1:
        return None
    from hetctl.train.tensor import TensorGroup

    lib = topo.backend
    mine = cpu = None
    for ranks in topo.tp_groups:
        g = dist.new_group(list(ranks), timeout=timeout, backend="gloo" if lib == "gloo" else None)
        c = dist.new_group(list(ranks), timeout=timeout, backend="gloo") if saving else None
        if topo.rank in ranks:
            mine, cpu = g, c
    return TensorGroup(rank=topo.tp_rank, ranks=topo.tp_ranks, group=mine, lib=lib, cpu_group=cpu)


def _state(step: int, args: argparse.Namespace, topo, spec: dict, sources: list | None = None,
           scaler: optim.LossScaler | None = None) -> dict:
    """The ``state.json`` record of a checkpoint of ``step`` (normal or just-in-time); ``sources``: the corpus's;
    ``scaler``: the loss scale with fp16 stages."""
    extra = {"loss_scale": scaler.record()} if scaler is not None else {}
    return {
        "step": step,
        "seed": args.seed,
        "data": {"next_step": step + 1, "global_batch": topo.global_batch, "samples_seen": step * topo.global_batch,
                 "sources": sources},
        "rng": {"kind": "counter", "seed": args.seed, "counter": step},
        "optimizer": args.optim.record(),
        "grad_compress": str(args.grad_compress),
        "model": spec,
        **extra,
    }


def run(args: argparse.Namespace, ctx: RankContext) -> int:
    """Set up this rank, train from the resume step to ``args.steps``, checkpoint, report."""
    plan = load_plan(ctx.plan)
    from hetctl.node.manifest import model_digest
    from hetctl.train.topology import topology

    topo = topology(plan, ctx)
    spec = plan["model"]
    if args.p2p_compress is None:  # the mode the plan was priced with (plan --p2p-compress)
        args.p2p_compress = str(plan.get("p2p_compress") or "none")
        if args.p2p_compress not in gradmode.P2P_MODES:
            raise HetctlError(f"{ctx.plan}: p2p_compress {args.p2p_compress!r} is not one of "
                              f"{', '.join(gradmode.P2P_MODES)}", "re-plan with `hetctl plan --p2p-compress …`")
    if args.grad_compress is None:  # the mode the plan was priced with (plan --grad-compress)
        try:
            args.grad_compress = gradmode.parse_mode(str(plan.get("grad_compress") or "none"))
        except ValueError as e:
            raise HetctlError(f"{ctx.plan}: grad_compress {e}", "re-plan with `hetctl plan --grad-compress …`") from None
    if args.checkpoint_every and ctx.ckpt_dir is None:
        raise HetctlError("--checkpoint-every is set but HETCTL_CKPT_DIR is not", "set it, or pass --checkpoint-every 0")
    if ctx.resume_step and ctx.ckpt_dir is None:
        raise HetctlError(f"HETCTL_RESUME_STEP={ctx.resume_step} but HETCTL_CKPT_DIR is not set")
    tied = bool(spec.get("tie_embeddings"))
    blobs = resumed = squeezed = None
    if ctx.resume_step:
        # Read and verify this stage's files before importing torch and joining the group, so a
        # missing, foreign or corrupted checkpoint is one clear error instead of a peer's hang.
        from hetctl.node.manifest import read_verified, step_dir
        from hetctl.train.units import STATE, check_state, unit_files

        blobs = read_verified(ctx.ckpt_dir, ctx.resume_step, unit_files(topo.spans, topo.is_first, topo.is_last, tied),
                              model_digest(spec))
        try:
            resumed = json.loads(blobs[STATE])
        except ValueError as e:
            raise CheckpointUnloadable(ctx.resume_step, e) from None
        check_state(resumed, args.seed, topo.global_batch, args.optim, step_dir(ctx.ckpt_dir, ctx.resume_step))
        if args.grad_compress.feedback and topo.dp > 1:
            squeezed, why = gradmode.saved_state(ctx.ckpt_dir, ctx.resume_step, ctx.rank, model_digest(spec))
            if why:
                print(f"grad-compress: {why}", file=sys.stderr)

    corpus = eval_set = sources = None
    if args.data:  # opened and checked before torch and the process group, like the checkpoint above
        from hetctl.corpus.samples import describe, source_record, training_data

        corpus, eval_set = training_data(args.data, args.eval_data, seq_len=int(spec["seq_len"]),
                                         vocab_size=int(spec["vocab_size"]), seed=args.seed,
                                         global_batch=topo.global_batch)
        if args.eval_every and eval_set is None:
            raise HetctlError(f"--eval-every {args.eval_every}: {' '.join(args.data)} has too few documents to hold "
                              "any out for validation", "pass --eval-data PREFIX")
        sources = source_record(corpus)
        if ctx.rank == 0:
            print(f"data: {describe(corpus)}", flush=True)
    if resumed is not None and (resumed.get("data") or {}).get("sources") != sources:
        print(f"warning: checkpoint step-{ctx.resume_step} was trained on {(resumed.get('data') or {}).get('sources')}"
              f", continuing on {sources}; the samples differ from an undisturbed run", file=sys.stderr)

    init_from = None if ctx.resume_step else args.init_from  # a resume continues its own weights
    if init_from:
        # Checked before torch and the group, like a resume's files: a mismatch is one line, not a peer's hang.
        from hetctl.train.hfweights import check
        from hetctl.train.units import stage_reads

        check(init_from, spec, stage_reads(topo.spans, topo.is_first, topo.is_last, tied))

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    import torch
    import torch.distributed as dist

    from hetctl.train import ckpt, data, pipeline
    from hetctl.train.saver import Saver
    from hetctl.train.model import StageModule, build_units

    from hetctl.train.adamw import deterministic

    torch.set_num_threads(args.threads)
    deterministic()
    device = _device(topo, torch)
    timeout = datetime.timedelta(seconds=args.comm_timeout)
    store = dist.TCPStore(ctx.master_addr, ctx.master_port, ctx.world_size, is_master=ctx.rank == 0, timeout=timeout)
    backend = _default_backend(topo)
    dist.init_process_group(backend=backend, store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=timeout)
    jit = None
    try:
        # Collectives on Python objects (checkpoint hashes) need a CPU group.
        ctrl = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        groups: dict[str, tuple] = {}  # unit → (its data-parallel group, comm library), for this rank's units
        if topo.dp > 1:
            # Every rank creates every group, in unit order (one per distinct set of holders: one per stage
            # position when every replica has one shape); the backend only matters to the members.
            made: dict[tuple[int, ...], object] = {}
            for name, members, lib in topo.unit_groups:
                if members not in made:
                    made[members] = dist.new_group(list(members), timeout=timeout,
                                                   backend="gloo" if lib == "gloo" else None)
                if topo.rank in members:
                    groups[name] = (made[members], lib)
        reducer = compressor = None
        if topo.dp > 1:  # after the flat groups: every rank creates the hierarchical ones in one order too
            from hetctl.train.dpreduce import Reducer
            from hetctl.train.gradcomp import Compressor

            compressor = Compressor(args.grad_compress)
            if squeezed is not None:
                why = compressor.load_state_dict(torch.load(io.BytesIO(squeezed), weights_only=True))
                if why:
                    print(f"grad-compress: checkpoint step-{ctx.resume_step}: {why}; error feedback starts from zero",
                          file=sys.stderr)
            reducer = Reducer(topo, plan, functools.partial(dist.new_group, timeout=timeout), groups,
                              hierarchical=args.dp_reduce == "auto", compressor=compressor)
            print(reducer.describe(), flush=True)
        # The saves gather on a group of their own, so a background save never interleaves with training's.
        save_group = dist.new_group(backend="gloo", timeout=timeout) if args.checkpoint_every else None
        tg = _tensor_group(topo, timeout, dist, args.checkpoint_every > 0)
        # Just-in-time checkpoints need a peer per stage, and every rank's agreement (an all-reduce of the flag).
        # Not under TP: a survivor holds only its shard, and the controller assembles whole units.
        commit_group = dist.new_group(backend="gloo", timeout=timeout) if topo.dp > 1 else None
        jit_on = (args.jit_checkpoint == "on" and commit_group is not None and ctx.ckpt_dir is not None
                  and topo.tp == 1)
        if args.jit_checkpoint == "on" and commit_group is not None and topo.tp > 1 and topo.rank == 0:
            print(f"jit checkpoint: off under tensor parallelism (tp={topo.tp}: a survivor holds only its shard); "
                  "a restart resumes from the last checkpoint", flush=True)
        # The global gradient norm sums every rank's share (hetctl.train.optim), on a gloo group of its own.
        norm_group = dist.new_group(backend="gloo", timeout=timeout) if ctx.world_size > 1 else None
        if commit_group is not None:
            flag = torch.tensor([int(jit_on)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=commit_group)
            jit_on = bool(flag.item())

        units = build_units(spec, topo.spans, topo.is_first, topo.is_last, args.seed, tg)
        if init_from:
            from hetctl.train.hfio import load_into

            n = load_into(init_from, spec, units, tp=(topo.tp_rank, topo.tp))
            print(f"init-from {init_from}: {n} tensors for {', '.join(units)}", flush=True)
        units.to(device)
        from hetctl.train.tied import TiedTable, tied_copy

        copy = tied_copy(units)  # a last stage's copy of a tied table: not a unit's, so moved and optimized here
        if copy is not None:
            copy.data = copy.data.to(device)
        # Every rank (of any replica's depth) takes part in making the two-rank groups of a tied table.
        table = TiedTable(topo.rank, topo.unit_groups, units, functools.partial(dist.new_group, timeout=timeout)) \
            if tied else None
        module = StageModule(units)
        extra = [copy] if copy is not None else []  # the tied copy: stepped and clipped, not counted twice
        optimizer = optim.build(units, args.optim, extra=extra)
        scaler = None
        if any(st.get("precision") == "fp16" for st in plan["stages"]):  # one scale for the whole pipeline
            if resumed is None:
                scaler = optim.LossScaler.fresh(args.optim)
            else:
                scaler, note = optim.LossScaler.resumed(resumed.get("loss_scale"), args.optim)
                if note and ctx.rank == 0:
                    print(f"loss scale: {note}", flush=True)
        stepper = optim.Stepper(args.optim, optimizer, units, topo, group=norm_group, poison=args.test_nan,
                                extra=extra, scaler=scaler)
        digest = model_digest(spec)
        start = ctx.resume_step or 0
        if start:
            try:  # the files passed their sha256 check; what fails here is the checkpoint, not this node
                ckpt.load(blobs, units, optimizer, tp=(topo.tp_rank, topo.tp))
                if copy is not None:
                    ckpt.load_copy(blobs, copy, optimizer)
            except (RuntimeError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as e:
                # Out at once, before destroy_process_group: a peer's broken pipe must not reach the controller
                # first, or the peer's node would be blamed for this checkpoint (issue 33, kind 7).
                err = CheckpointUnloadable(start, e)
                print(f"hetctl.train: error: {err.message} (hint: {err.hint})", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(err.exit_code)
            del blobs

        saver = Saver(ctx.ckpt_dir, args.save_mode, rank=ctx.rank, replica=topo.replica, num_layers=topo.num_layers,
                      digest=digest, group=save_group, log=lambda line: print(line, flush=True),
                      test_delay=args.test_save_delay, tp=tg) if args.checkpoint_every else None
        if jit_on:
            from hetctl.train.jit import JitCheckpoint

            jit = JitCheckpoint(ctx.ckpt_dir, attempt=ctx.attempt, rank=ctx.rank, start=start, units=units,
                                optimizer=optimizer, digest=digest,
                                state_of=functools.partial(_state, args=args, topo=topo, spec=spec, sources=sources,
                                                           scaler=scaler),
                                meta={"run_id": ctx.run_id, "stage": topo.stage, "replica": topo.replica,
                                      "pp": topo.pp, "dp": topo.dp, "global_batch": topo.global_batch},
                                log=lambda line: print(line, flush=True), test_delay_s=args.test_jit_delay)
            jit.arm()
        comm = pipeline.Comm(topo, device, groups, p2p_compress=args.p2p_compress)
        amp = functools.partial(pipeline.autocast, device, topo.precision)
        seq, vocab = int(spec["seq_len"]), int(spec["vocab_size"])
        role = {"stage": topo.stage, "replica": topo.replica}
        talk = topo.is_last and topo.tp_rank == 0  # every TP rank of the last stage has the loss; one prints it
        first_loss = loss_value = None
        evaluated: dict = {}  # the last validation, repeated in every later heartbeat of the last stage
        step_times: list[float] = []
        ctx.heartbeat(start, phase="ready", **role)
        for step in range(start + 1, args.steps + 1):
            t0 = time.perf_counter()

            @functools.lru_cache(maxsize=None)
            def batch(m: int, step: int = step) -> tuple:
                # Rows of the global batch by micro-batch number over every replica (replicas may differ).
                x, y = data.micro_batch(args.seed, step, 0, topo.first_micro + m, topo.micro_batch,
                                        topo.micro_batches, seq, vocab, corpus=corpus)
                return x.to(device), y.to(device)

            comm.take_wait()
            optimizer.zero_grad(set_to_none=False)
            loss = pipeline.train_step(module, topo, comm, batch, int(spec["hidden_size"]), seq, amp,
                                       stepper.loss_scale())
            stepper.unscale()  # fp16 stages: true gradients from here on (reduce, compression, norm)
            if table is not None:
                table.sum_grads()
            if reducer is not None:
                reducer.reduce(units, comm)
                if table is not None:
                    table.broadcast()
            # Clipped, or skipped on every rank when not finite; under jit, applied once every rank has summed.
            done = stepper.step(step, loss, optimizer.step if jit is None else functools.partial(
                jit.commit, step, functools.partial(dist.barrier, group=commit_group)),
                on_skip=jit.skip if jit is not None else None)
            if saver is not None and step == start + 1:
                saver.prepare(units, optimizer)  # host buffers for the snapshots, made in the background
            if loss is not None:
                step_loss = float(comm.all_reduce_loss(loss).item())
                if done.applied:  # the run's loss is the last applied step's; a skipped one is reported as such
                    loss_value = step_loss
                    first_loss = loss_value if first_loss is None else first_loss
            ms = (time.perf_counter() - t0) * 1000.0
            timing = {"step_ms": round(ms, 3), "compute_ms": round(ms - comm.take_wait() * 1000.0, 3)}
            if compressor is not None and compressor.raw:  # this attempt's cross-vendor gradient bytes, so far
                timing.update(xv_bytes=compressor.sent, xv_raw_bytes=compressor.raw)
            if comm.xv_p2p_bytes:  # this attempt's pipeline bytes sent across vendors, so far (--p2p-compress)
                timing.update(xv_p2p_bytes=comm.xv_p2p_bytes)
            step_times.append(ms)
            if args.eval_every and step % args.eval_every == 0:
                value = data.eval_loss(module, topo, comm, eval_set, args.eval_iters, int(spec["hidden_size"]), seq, amp)
                evaluated = {"eval_loss": value, "eval_step": step} if value is not None else evaluated
                if talk:
                    print(f"eval step={step} eval_loss={value:.9g}", flush=True)
            last_metrics = {"loss": loss_value if done.applied else None, **evaluated} if topo.is_last else {}
            last_metrics.update(done.metrics())
            skip = "" if done.applied else (f" skipped={done.nonfinite} loss_scale={done.loss_scale:g}"
                                            if done.nonfinite == "fp16-overflow" else
                                            f" skipped=non-finite-{done.nonfinite} in_a_row={done.skipped_in_row}")
            if talk:
                print(f"step={step} loss={step_loss:.9g} grad_norm={done.grad_norm:.6g} lr={done.lr:.6g} "
                      f"step_ms={ms:.1f}" + skip, flush=True)
            elif skip and topo.rank == 0:
                print(f"step={step}{skip}", flush=True)
            if args.log_samples and corpus is not None and topo.is_first and topo.tp_rank == 0:
                print(data.sample_log(corpus, step, topo), flush=True)
            ctx.heartbeat(step, **last_metrics, **timing, **role)
            if saver is not None:
                saver.check()  # a background save that failed ends the rank here, with its own error
            if saver is not None and step % args.checkpoint_every == 0:
                ctx.heartbeat(step, phase="checkpoint", **last_metrics, **timing, **role)  # slow disks are not hangs
                state = _state(step, args, topo, spec, sources, scaler)
                meta = {"seed": args.seed, "run_id": ctx.run_id, "attempt": ctx.attempt,
                        "pp": topo.pp, "dp": topo.dp, "global_batch": topo.global_batch}
                waiting = functools.partial(ctx.heartbeat, step, phase="checkpoint_wait", **last_metrics, **timing,
                                            **role)
                own = {gradmode.state_file(ctx.rank): compressor.state_dict()} \
                    if compressor is not None and args.grad_compress.feedback else None
                saver.save(step, units, optimizer, state=state, meta=meta, on_wait=waiting, own=own)

        steady = step_times[1:] or step_times
        final = {"done": True, "steps": args.steps, "skipped": stepper.skipped_total, **role}
        if scaler is not None:
            final.update(loss_scale=scaler.scale)
        if compressor is not None and compressor.raw:
            final.update(xv_bytes=compressor.sent, xv_raw_bytes=compressor.raw)
        if comm.xv_p2p_bytes:
            final.update(xv_p2p_bytes=comm.xv_p2p_bytes)
        if saver is not None:  # the last save must be on disk, manifest and all, before the rank reports done
            final.update(saver.close(on_wait=functools.partial(ctx.heartbeat, args.steps, phase="checkpoint_wait",
                                                               **role)))
        if steady:
            mean_ms = sum(steady) / len(steady)
            final.update(step_ms=round(mean_ms, 3), tokens_per_s=round(topo.global_batch * seq / (mean_ms / 1000), 1))
        if topo.is_last and loss_value is not None:
            final.update(loss=loss_value, first_loss=first_loss, **evaluated)
            if topo.replica == 0 and topo.tp_rank == 0:
                print(f"done steps={args.steps} final_loss={loss_value:.9g} first_loss={first_loss:.9g} "
                      f"tokens_per_s={final.get('tokens_per_s')}", flush=True)
        elif talk and topo.replica == 0:
            print(f"done steps={args.steps}: nothing to train after resume step {start}", flush=True)
        ctx.heartbeat(args.steps, phase="finishing", **role)
        dist.barrier(group=ctrl)
        ctx.heartbeat(args.steps, **final)
    except Exception as e:
        if jit is not None:  # a peer's failure, seen here first: leave this stage's state for the next attempt
            jit.dump(f"{type(e).__name__} in training")
        raise
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: a configuration mistake is one line on stderr and exit code 2, never a traceback."""
    try:
        args = parse_args(argv, os.environ)
        ctx = RankContext.from_env()
        return run(args, ctx)
    except HetctlError as e:
        print(f"hetctl.train: error: {e.message}" + (f" (hint: {e.hint})" if e.hint else ""), file=sys.stderr)
        return e.exit_code
