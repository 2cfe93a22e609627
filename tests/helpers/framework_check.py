"""Stand-in for ``python`` under a rendered Megatron/FlagScale script: the framework's own code checks the rank.

Run as ``framework_check.py <out dir> <script.py> <args…>`` (the node script's
``"$HETCTL_PYTHON" "$MEGATRON_DIR/pretrain_gpt.py" …`` with HETCTL_PYTHON a
wrapper that adds the out dir). It does what the real script does first, with
the framework's own code and nothing of hetctl's: puts the script's folder on
``sys.path`` as Python does, parses the arguments with Megatron's
``parse_args`` and checks them with ``validate_args``; for FlagScale's hetero
mode first ``FSTrainArguments.pre_validate_args`` (which initialises
torch.distributed, here over gloo, and maps physical to logical ranks with
FlagScale's ``RankMapper``) and ``post_validate_args`` after. Then it asks the
framework where the rank sits: Megatron's ``RankGenerator`` (the
``tp-cp-ep-dp-pp`` order ``initialize_model_parallel`` uses) and
``PipelineParallelLayerLayout`` for the layers, or FlagScale's
``ParallelContext`` (its process meshes and groups, built over gloo) and
``get_transformer_layer_offset`` for the first layer the rank numbers. The
training loop needs CUDA and is not run; without CUDA the one question
``validate_args`` asks the GPU (its architecture, with TP > 1) is answered
as for an A100 (``CHECK_CUDA_ARCH``). One JSON file per rank.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    out_dir, script = sys.argv[1], sys.argv[2]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    sys.argv = [script] + sys.argv[3:]
    import torch
    from megatron.training import arguments
    from megatron.training.arguments import parse_args, validate_args

    if not torch.cuda.is_available():
        # With TP > 1, validate_args asks the GPU's architecture: answer for the chip this machine lacks.
        arguments.get_device_arch_version = lambda: int(os.environ.get("CHECK_CUDA_ARCH", "8"))
    args = parse_args()
    hetero = args.hetero_process_meshes is not None
    if hetero:
        from flagscale.train import FSTrainArguments

        fs_args = FSTrainArguments(args)
        fs_args.pre_validate_args()
    validate_args(args, {})
    rec = {"argv_rank": args.rank, "world_size": args.world_size, "train_iters": args.train_iters, "lr": args.lr,
           "save": args.save, "load": args.load, "save_interval": args.save_interval, "ckpt_format": args.ckpt_format,
           "ckpt_step": args.ckpt_step, "optim_fully_reshardable": args.dist_ckpt_optim_fully_reshardable}
    if hetero:
        fs_args.post_validate_args()
        from flagscale.train.hetero.parallel_context import ParallelContext
        from megatron.training.global_vars import set_global_variables

        set_global_variables(args)  # as initialize_megatron does before building the parallel state

        ctx = ParallelContext(args)
        stage = ctx.get_pipeline_model_parallel_rank()
        split = args.hetero_pipeline_layer_split
        # FlagScale's own layer numbering for this rank: its offset from the rank's transformer config.
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
        from megatron.training.arguments import core_transformer_config_from_args

        offset = get_transformer_layer_offset(core_transformer_config_from_args(args), pp_rank=stage)
        rec.update(logical_rank=fs_args.rank_mapper.to_logical_ranks([args.rank])[0], stage=stage,
                   replica=ctx.get_data_parallel_rank(), tp_rank=ctx.get_tensor_model_parallel_rank(),
                   tp=args.tensor_model_parallel_size, dp=args.data_parallel_size,
                   layers=[offset, offset + split[stage]], device_type=args.hetero_current_device_type,
                   meshes=args.hetero_process_meshes)
    else:
        from megatron.core.parallel_state import RankGenerator
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        tp, pp, dp, cp = (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                          args.data_parallel_size, args.context_parallel_size)
        gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")

        def index_in(mode: str) -> int:
            return next(g.index(args.rank) for g in gen.get_ranks(mode) if args.rank in g)

        layout = PipelineParallelLayerLayout(args.pipeline_model_parallel_layout, pp)
        layout.validate_layer_layout(num_layers=args.num_layers, mtp_num_layers=0)
        stage = index_in("pp")
        ids = layout.get_layer_id_list(pp_rank=stage)
        rec.update(stage=stage, replica=index_in("dp"), tp_rank=index_in("tp"), tp=tp, dp=dp, pp=pp,
                   layers=[ids[0], ids[-1] + 1] if ids else [0, 0],  # the first chunk's, under interleaving
                   vpp=args.virtual_pipeline_model_parallel_size or 1)
    with open(os.path.join(out_dir, f"rank-{args.rank}.json"), "w") as f:
        json.dump(rec, f)
    if hetero:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
