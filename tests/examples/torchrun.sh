#!/usr/bin/env bash
# gradsync under the real torchrun and against PyTorch's own TCPStore (torch from the cached
# venv of scripts/torch_env.sh; skipped, saying why, when it is not installed):
#   torchrun.sh BUILD_DIR SOURCE_DIR
#  1. torch's TCPStore servers (libuv and classic) host the rendezvous of three processes;
#  2. torchrun --nproc-per-node 3 (the agent's store), and two torchrun agents as two nodes
#     meeting through c10d rendezvous;
#  3. the three trainers under torchrun; --backend mpi refused, torchrun's summary quoting us;
#  4. a rank SIGKILLed mid-epoch under --max-restarts 2: the group restarts from the latest
#     checkpoint and ends with the bytes an uninterrupted run ends with.
set -uo pipefail
build=$1
source=$2
venv=${GRADSYNC_TORCH_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gradsync/torch-venv}
if [[ ! -f $venv/.ready ]]; then
  echo "SKIP: no PyTorch venv at $venv (scripts/torch_env.sh installs one; scripts/test.sh runs it)"
  exit 77
fi
python=$venv/bin/python
torchrun=("$python" -m torch.distributed.run)
examples=$build/examples
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export GRADSYNC_TIMEOUT_MS=30000 OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
failed=0
check() {  # check NAME COMMAND...: runs it, shows its output, counts a failure
  local name=$1
  shift
  echo "== $name"
  if ! "$@" >"$scratch/out" 2>&1; then
    grep -v "^W[0-9]\{4\} \|UserWarning\|_conversion_method" "$scratch/out" | tail -30
    echo "FAIL: $name"
    failed=1
    return 1
  fi
  grep -v "^W[0-9]\{4\} \|UserWarning\|_conversion_method" "$scratch/out" | tail -6
}
free_port() { "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# 1. A TCPStore that torch serves; three gradsync processes are its clients.
three_clients_of() {  # three_clients_of USE_LIBUV
  local port
  port=$(free_port)
  "$python" -c "
import datetime, sys, time
from torch.distributed import TCPStore
s = TCPStore('127.0.0.1', $port, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False,
             use_libuv=$1)
print('server libuv', s.libuvBackend, flush=True)
time.sleep(60)" &
  local server=$!
  local pids=() status=0
  for rank in 0 1 2; do
    RANK=$rank WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port GRADSYNC_TORCH_STORE=1 TORCHELASTIC_RUN_ID=t$1 \
      "$build/tests/connect_world" gloo &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  kill $server 2>/dev/null
  return $status
}
check "torch's libuv TCPStore serves the rendezvous" three_clients_of True
check "torch's classic TCPStore serves the rendezvous" three_clients_of False

# 2. torchrun itself: one node of three, then two agents as two nodes.
check "torchrun --nproc-per-node 3" "${torchrun[@]}" --nproc-per-node 3 --no-python "$build/tests/connect_world" gloo
two_nodes() {
  local port status=0 pids=()
  port=$(free_port)
  for node in 0 1; do
    "${torchrun[@]}" --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:$port \
      --rdzv-id two-nodes --no-python "$build/tests/connect_world" gloo > "$scratch/node$node" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  cat "$scratch/node0" "$scratch/node1"
  [[ $status == 0 && $(grep -c "of 4 (gloo): ok" "$scratch/node0" "$scratch/node1" | awk -F: '{s+=$2} END {print s}') == 4 ]]
}
check "two torchrun agents, c10d rendezvous (2 nodes x 2)" two_nodes

# 3. The trainers.
check "digits_ddp under torchrun" "${torchrun[@]}" --nproc-per-node 2 --no-python "$examples/digits_ddp" --epochs 2 \
  --check-replicas
check "horovod_style under torchrun" "${torchrun[@]}" --nproc-per-node 2 --no-python "$examples/horovod_style" \
  --max-steps 12 --check-replicas
check "bring_your_own_engine under torchrun" "${torchrun[@]}" --nproc-per-node 2 --no-python \
  "$examples/bring_your_own_engine" --epochs 20
mpi_refused() {
  ! "${torchrun[@]}" --nproc-per-node 2 --no-python "$examples/digits_ddp" --epochs 1 --backend mpi > "$scratch/mpi" 2>&1
  cat "$scratch/mpi"
  # torchrun's summary carries our error file's text, not "<N/A>".
  grep -q "traceback : digits_ddp: backend mpi: this process is rank" "$scratch/mpi"
}
check "--backend mpi under torchrun is refused, in torchrun's summary" mpi_refused

# 4. Restarts.
restart_is_exact() {
  local common=(--nproc-per-node 2 --no-python "$examples/digits_ddp" --epochs 3 --checkpoint-every 7)
  "${torchrun[@]}" "${common[@]}" --checkpoint-dir "$scratch/a" --save "$scratch/a.safetensors" > "$scratch/plain" 2>&1 ||
    { cat "$scratch/plain"; return 1; }
  "${torchrun[@]}" --max-restarts 2 "${common[@]}" --checkpoint-dir "$scratch/b" --kill-rank 1:30 \
    --save "$scratch/b.safetensors" > "$scratch/killed" 2>&1 || { cat "$scratch/killed"; return 1; }
  grep -v "^W[0-9]\{4\} \|UserWarning\|_conversion_method" "$scratch/killed"
  grep -q "kills itself after step 30" "$scratch/killed" && grep -q "resuming from .*step_28.safetensors" "$scratch/killed" &&
    cmp "$scratch/a.safetensors" "$scratch/b.safetensors" && echo "the restarted run's final checkpoint is byte-identical"
}
check "a rank SIGKILLed mid-epoch, torchrun --max-restarts 2: the same bytes" restart_is_exact
gpt_restart_is_exact() {  # the GPT trainer resumes by the same code (examples/common/checkpoints.h)
  local fixtures=$source/tests/fixtures
  local common=(--nproc-per-node 2 --no-python "$examples/gpt_ddp" --data "$fixtures/gpt_train.bin" --vocab-size 17
                --layers 2 --heads 2 --embd 16 --block 8 --init "$fixtures/gpt_init.safetensors" --steps 20 --batch 2
                --zero 1 --checkpoint-every 5)
  "${torchrun[@]}" "${common[@]}" --checkpoint-dir "$scratch/gpt_a" --save "$scratch/gpt_a.safetensors" \
    > "$scratch/gpt_plain" 2>&1 || { cat "$scratch/gpt_plain"; return 1; }
  "${torchrun[@]}" --max-restarts 2 "${common[@]}" --checkpoint-dir "$scratch/gpt_b" --kill-rank 1:13 \
    --save "$scratch/gpt_b.safetensors" > "$scratch/gpt_killed" 2>&1 || { cat "$scratch/gpt_killed"; return 1; }
  grep -v "^W[0-9]\{4\} \|UserWarning\|_conversion_method" "$scratch/gpt_killed" | grep -v "^step " | tail -8
  grep -q "kills itself after step 13" "$scratch/gpt_killed" &&
    grep -q "resuming from .*step_10.safetensors" "$scratch/gpt_killed" &&
    cmp "$scratch/gpt_a.safetensors" "$scratch/gpt_b.safetensors" && echo "the restarted GPT run's checkpoint is byte-identical"
}
check "gpt_ddp (ZeRO 1) SIGKILLed at step 13, torchrun --max-restarts 2: the same bytes" gpt_restart_is_exact
no_restarts_left() {  # without restarts torchrun gives up, and its summary quotes the survivor's error
  # The agent SIGTERMs the other workers as soon as it sees one fail; polling every 5 s (not
  # 0.1 s) it sees both ended: rank 1 killed, rank 0 failed by itself (within milliseconds of its
  # peer's death) with its error file written. At 0.1 s the agent may stop rank 0 first.
  ! "${torchrun[@]}" --monitor-interval 5 --nproc-per-node 2 --no-python "$examples/digits_ddp" --epochs 3 \
    --kill-rank 1:30 \
    > "$scratch/summary" 2>&1
  grep -v "^W[0-9]\{4\} \|UserWarning\|_conversion_method" "$scratch/summary" | tail -22
  grep -q "Signal 9 (SIGKILL)" "$scratch/summary" &&
    grep -q "traceback : digits_ddp: rank 0: .* the peer is rank 1" "$scratch/summary"
}
check "the same kill without restarts: torchrun's summary names SIGKILL and quotes rank 0's error" no_restarts_left
exit $failed
