#!/usr/bin/env bash
# The checks CI cannot run, on one machine with an NVIDIA GPU and torch (README, "On a real GPU"):
#   the engine's speed against a plain tuned torch loop (bench/engine_speed.py, a 1 B model and
#   an 8 B-class slice), nvidia-smi's layouts as the collector reads them (kept as captures), probe, probe --bench --model,
#   plan, a launch of the reference trainer, plan --calibrate on that run and a second launch,
#   and megatron-core's own torch_dist save (the test skipped without CUDA).
#
#   bash scripts/device_check.sh            # from the repository root
#   PART=cpu bash scripts/device_check.sh   # the measured mixed-speed bench on pinned cores instead (issue 31):
#                                           # bench/hetero_cpu.py --cpus-per-node 8,4,2 (14 of the 16 cores)
#
# Each part fits one 10-minute device command; PART=all runs both (gpu, then cpu).
# Environment: OUT (default: a new folder) receives log.txt, captures.tgz and results.tgz;
# MODEL (default scripts/model-1b.yaml), GB (global batch, 32), STEPS (30);
# WHEELS=folder installs those wheels first, for a machine without a package index
# (this workplace's GPU machine lacks pydantic, python-hostlist and megatron-core).
set -u
R=$PWD
[ -f "$R/hetctl/__init__.py" ] || { echo "run from the repository root" >&2; exit 2; }
W=$(mktemp -d /tmp/hetctl-device-check.XXXXXX); mkdir -p "$W/cap" "$W/res"
O=${OUT:-$W/out}; mkdir -p "$O"
MODEL=${MODEL:-$R/scripts/model-1b.yaml}; GB=${GB:-32}; STEPS=${STEPS:-30}
log() { echo "== $(date +%T) $*"; }
exec > >(tee "$O/log.txt") 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$R${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$WHEELS"/*.whl || exit 9
fi

log machine; uname -r; nproc
python3 -c "import torch,sys;print(sys.version.split()[0],torch.__version__,torch.cuda.is_available(),torch.version.cuda)"

PART=${PART:-gpu}
if [ "$PART" = cpu ] || [ "$PART" = all ]; then
  log "mixed-speed cluster on cores of its own: node-a 8, node-b 4, node-c 2 CPUs (issue 31, part 4)"
  ( cd "$R" && timeout 540 python3 bench/hetero_cpu.py --cpus-per-node 8,4,2 --pairs 2 --steps 6 --rounds 2 2>&1 \
      | tail -40 )
  [ "$PART" = cpu ] && { log "done: $O"; exit 0; }
fi

log "engine speed: the engine at PP=1 against a plain tuned torch loop, same model and batch (issue 30)"
( cd "$R" && timeout 240 python3 bench/engine_speed.py --device cuda --model scripts/model-1b.yaml \
    --micro-batch "${MB:-8}" --micro-batches 2 --steps 10 --pairs 1 --compile 2>&1 | tail -12 )
( cd "$R" && timeout 240 python3 bench/engine_speed.py --device cuda --model scripts/model-8b-slice.yaml \
    --micro-batch 2 --micro-batches 2 --steps 6 --pairs 1 --compile 2>&1 | tail -12 )

log captures
F=$(python3 -c "from hetctl.probe.tools import TOOL_COMMANDS as T;print(T['nvidia-smi-csv'][1])")
( cd "$W/cap" && nvidia-smi >plain.txt 2>&1; nvidia-smi -L >L.txt 2>&1
  nvidia-smi "$F" --format=csv,noheader,nounits >csv.txt 2>&1; nvidia-smi "$F" --format=csv >csv_header.txt 2>&1
  nvidia-smi -q -x >q_x.xml 2>&1; nvidia-smi -q >q.txt 2>&1; nvidia-smi topo -m >topo.txt 2>&1
  nvidia-smi --version >version.txt 2>&1; head -5 plain.txt csv.txt L.txt )

cat > "$W/inventory.yaml" <<EOI
nodes:
  - name: gpu
    host: localhost
    transport: local
    workdir: $W/work
EOI
cd "$W"
log probe; timeout 120 python3 -m hetctl probe -i inventory.yaml -o res/cluster.yaml --json > res/probe.json; echo rc=$?
python3 - <<'EOP'
import json
for n in json.load(open("res/probe.json"))["nodes"]:
    print(n["name"], n["reachable"], n["error"])
    for c in n["chips"]:
        print(" ", c["vendor"], c["model"], c["memory_gb"], c["tflops"], c.get("pci_bus_id"))
EOP
log probe --bench --model
timeout 240 python3 -m hetctl probe -i inventory.yaml --bench --model "$MODEL" -o res/cluster-bench.yaml > res/probe-bench.txt 2>&1
echo rc=$?; tail -25 res/probe-bench.txt; grep -A3 measured_tflops res/cluster-bench.yaml | head -12
log plan
timeout 120 python3 -m hetctl plan res/cluster-bench.yaml -m "$MODEL" --global-batch "$GB" -o plan > res/plan.txt 2>&1
echo rc=$?; tail -14 res/plan.txt
log launch
timeout 300 python3 -m hetctl launch plan --steps "$STEPS" --checkpoint-every 0 --run-dir runs --json \
  > res/launch1.json 2> res/launch1.err
echo rc=$?; cat res/launch1.json; tail -4 res/launch1.err
RUN=$(ls -d runs/* | head -1)
log calibrate
timeout 120 python3 -m hetctl plan --calibrate "$RUN" --global-batch "$GB" -o plan2 > res/plan2.txt 2>&1
echo rc=$?; tail -14 res/plan2.txt
log launch calibrated, one checkpoint at the end
timeout 300 python3 -m hetctl launch plan2 --steps "$STEPS" --checkpoint-every "$STEPS" --run-dir runs --json \
  > res/launch2.json 2> res/launch2.err
echo rc=$?; cat res/launch2.json; tail -4 res/launch2.err
cp -r plan plan2 res/
for r in runs/*; do find "$r" -maxdepth 3 -type f ! -path '*ckpt*' -size -5M -exec cp --parents {} res/ \; ; done
nvidia-smi --query-gpu=name,memory.used,temperature.gpu,clocks.sm --format=csv 2>/dev/null

log megatron-core save test
( cd "$R" && timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_framework_launch.py -k saved_by_megatron 2>&1 | tail -5 )
du -sh "$W"/* 2>/dev/null
tar czf "$O/captures.tgz" cap; tar czf "$O/results.tgz" res
rm -rf "$W/runs" "$W/work"  # the checkpoints (GBs)
log "done: $O"
