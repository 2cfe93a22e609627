"""The reference trainer's command line (``python -m hetctl.train --help``).

Defaults come from the rank's environment where the launcher sets them
(``HETCTL_STEPS``, ``HETCTL_CKPT_EVERY``, ``HETCTL_SAVE_MODE``, ``HETCTL_JIT_CHECKPOINT``,
``OMP_NUM_THREADS``), as do the test-only knobs (``HETCTL_TEST_*``); the optimizer's
options are :mod:`hetctl.train.optim`'s. A bad value is argparse's one-line error and exit 2.
``docs/training.md`` describes the options.
"""

from __future__ import annotations

import argparse
import os

from hetctl.train import gradmode, optim
from hetctl.train.units import parse_test_delay

DESCRIPTION = "``python -m hetctl.train``: one rank of the reference pipeline trainer."


def _omp_threads(env: os._Environ | dict) -> int:
    """The node's ``OMP_NUM_THREADS`` where it is one positive number (an inventory may set it per node); else 1,
    as torchrun's default, so that ranks sharing a machine do not oversubscribe it."""
    value = str(env.get("OMP_NUM_THREADS") or "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else 1


def parse_args(argv: list[str] | None, env: os._Environ | dict) -> argparse.Namespace:
    """Options of the trainer; ``HETCTL_STEPS``/``HETCTL_CKPT_EVERY`` give the defaults."""
    ap = argparse.ArgumentParser(prog="python -m hetctl.train", description=DESCRIPTION)
    ap.add_argument("--steps", type=int, default=int(env.get("HETCTL_STEPS") or 0) or None,
                    help="total optimizer steps of the run (default $HETCTL_STEPS)")
    ap.add_argument("--checkpoint-every", type=int, default=int(env.get("HETCTL_CKPT_EVERY") or 0),
                    help="write a checkpoint every K steps; 0 writes none (default $HETCTL_CKPT_EVERY)")
    ap.add_argument("--save-mode", choices=("async", "blocking"), default=env.get("HETCTL_SAVE_MODE") or "async",
                    help="async: training waits only for a host-memory copy, a background thread writes it; "
                    "blocking: training waits for the whole write (default $HETCTL_SAVE_MODE or async)")
    ap.add_argument("--jit-checkpoint", choices=("on", "off"), default=env.get("HETCTL_JIT_CHECKPOINT") or "on",
                    help="on: with data parallelism, the survivors of a failed rank write their stage's state at "
                    "the failed step for the next attempt to resume from (default $HETCTL_JIT_CHECKPOINT or on)")
    ap.add_argument("--seed", type=int, default=1234, help="seed of weights and data (default 1234)")
    ap.add_argument("--init-from", metavar="HF_FOLDER", default=None,
                    help="start from a Hugging Face checkpoint folder (config.json and safetensors): each stage "
                    "reads only its own layers; ignored when resuming from a hetctl checkpoint")
    ap.add_argument("--threads", type=int, default=_omp_threads(env),
                    help="torch CPU threads per rank (default $OMP_NUM_THREADS where it is one number, else 1)")
    ap.add_argument("--dp-reduce", choices=("auto", "flat"), default="auto",
                    help="auto: hierarchical across vendors where it applies (hetctl.train.dpreduce); flat: one "
                    "all-reduce over every replica (default auto)")
    ap.add_argument("--grad-compress", default=None, metavar="{none,bf16,int8,powersgd:R}",
                    help="compress the data-parallel reduce where it crosses vendors (over gloo): bf16, int8 or "
                    "rank-R PowerSGD, the last two with error feedback; within a vendor it is never compressed "
                    "(default: the plan's grad_compress, `hetctl plan --grad-compress`, else none)")
    ap.add_argument("--p2p-compress", choices=("none", "bf16"), default=None,
                    help="bf16: a pipeline's activations and their gradients cross a stage boundary between two "
                    "vendors (over gloo) in bfloat16, half the bytes; within a vendor they stay fp32 (between two "
                    "bf16 stages, bf16) (default: the plan's p2p_compress, `hetctl plan --p2p-compress`, else none)")
    ap.add_argument("--comm-timeout", type=float, default=300.0,
                    help="seconds a collective or receive may wait before the rank fails (default 300)")
    optim.add_args(ap)
    ap.add_argument("--data", nargs="+", metavar="PREFIX", default=None,
                    help="train on a Megatron indexed dataset (PREFIX.bin/.idx), or a blend 'W1 P1 W2 P2 …'; "
                    "without it, synthetic data")
    ap.add_argument("--eval-data", nargs="+", metavar="PREFIX", default=None,
                    help="validation data, same syntax (default: the last 1%% of --data's documents, held out)")
    ap.add_argument("--eval-every", type=int, default=0, help="validation loss every N steps; 0: never (default 0)")
    ap.add_argument("--eval-iters", type=int, default=2,
                    help="global batches of fixed validation windows per evaluation (default 2)")
    ap.add_argument("--log-samples", action="store_true", default=env.get("HETCTL_LOG_SAMPLES") == "1",
                    help="first-stage ranks print the ids of the samples of each step (default $HETCTL_LOG_SAMPLES=1)")
    args = ap.parse_args(argv)
    try:
        args.grad_compress = None if args.grad_compress is None else gradmode.parse_mode(args.grad_compress)
    except ValueError as e:
        ap.error(f"--grad-compress {e}; pass none, bf16, int8 or powersgd:R (R a rank such as 4)")
    try:
        args.test_save_delay = parse_test_delay(env.get("HETCTL_TEST_SAVE_DELAY"))
    except ValueError:
        ap.error("HETCTL_TEST_SAVE_DELAY (test-only) must be <step>:<seconds>")
    try:
        args.test_jit_delay = float(env.get("HETCTL_TEST_JIT_DELAY") or 0)
    except ValueError:
        ap.error("HETCTL_TEST_JIT_DELAY (test-only) must be a number of seconds")
    try:
        args.test_nan = optim.parse_test_nan(env.get("HETCTL_TEST_NAN_GRAD"))
    except ValueError:
        ap.error("HETCTL_TEST_NAN_GRAD (test-only) must be <step>[:<count>]")
    if not args.steps or args.steps < 1:
        ap.error("--steps (or HETCTL_STEPS) must be a positive number of steps")
    args.optim = optim.config(args, ap)
    if args.checkpoint_every < 0:
        ap.error("--checkpoint-every must be >= 0")
    if args.eval_every < 0 or args.eval_iters < 1:
        ap.error("--eval-every must be >= 0 and --eval-iters >= 1")
    if (args.eval_every or args.eval_data) and not args.data:
        ap.error("--eval-every and --eval-data need --data (validation runs on a token corpus)")
    return args
