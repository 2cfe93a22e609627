"""Stand-in for the user's DeepSpeed script under a rendered node script: DeepSpeed's own code checks the rank.

Run as ``$HETCTL_SCRIPT`` (``deepspeed_check.py --local_rank=N --deepspeed
--deepspeed_config FILE``, then ``--out DIR``). With DeepSpeed's code only:
``deepspeed.init_distributed`` over gloo from the rank contract's
environment, the pipe-data-model topology and ``PipelineParallelGrid`` for
the stage and replica of this rank, ``DeepSpeedConfig`` validating the
rendered config against that grid, and a ``PipelineModule`` of one small
``DecoderLayer`` per model layer partitioned with
``partition_method="type:DecoderLayer"`` for the layers this rank builds.
No training step (the CPU build has no fused optimizers); one JSON file per rank.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


class DecoderLayer(torch.nn.Module):
    """A stand-in decoder layer: DeepSpeed partitions by type name, not by what the layer computes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int)
    parser.add_argument("--deepspeed", action="store_true")
    parser.add_argument("--deepspeed_config")
    parser.add_argument("--out")
    parser.add_argument("--tp", type=int)
    parser.add_argument("--pp", type=int)
    parser.add_argument("--num-layers", type=int)
    a = parser.parse_args()

    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology, PipelineParallelGrid

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    world = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    topo = PipeModelDataParallelTopology(num_pp=a.pp, num_mp=a.tp, num_dp=world // (a.pp * a.tp))
    grid = PipelineParallelGrid(topology=topo)
    config = DeepSpeedConfig(a.deepspeed_config, mpu=grid)
    module = PipelineModule(layers=[LayerSpec(DecoderLayer) for _ in range(a.num_layers)], topology=topo,
                            partition_method="type:DecoderLayer")
    coord = topo.get_coord(rank)
    rec = {"rank": rank, "world": world, "stage": grid.get_stage_id(), "replica": grid.get_data_parallel_id(),
           "tp_rank": coord.model, "layers": [int(module._local_start), int(module._local_stop)],
           "train_batch_size": config.train_batch_size, "micro_batch": config.train_micro_batch_size_per_gpu,
           "grad_acc": config.gradient_accumulation_steps, "local_rank": a.local_rank,
           "env_local_rank": int(os.environ["LOCAL_RANK"])}
    with open(os.path.join(a.out, f"rank-{rank}.json"), "w") as f:
        json.dump(rec, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
