#!/usr/bin/env bash
# What a device-machine call runs (see bench/gpu/DEVICE.md). Usage: bench/gpu/gpu_run.sh STEP...
#   probe  nvidia-smi, CuPy version, mapped host memory and bf16 availability
#   ops    tests/engine/test_gpu_ops.py
#   kernels  bench/gpu/bench_gpu_kernels.py (the flash attention kernel vs torch SDPA)
#   gemv  bench/gpu/bench_gpu_gemv.py (a decode step's products in a graph: strata_gemv, cuBLAS, a copy)
#   ops-k  tests/engine/test_gpu_ops.py -k "$OPS_K";  model-k  tests/engine/test_gpu_model.py -k "$MODEL_K"
#   attn  bench/gpu/bench_gpu_decode_attn.py (a decode step's attention per layer; ATTN_ARGS); attn-base: the same
#         with the strata_engine copied to .gpu-carry/base (carried), the checkout to compare against
#   profile  bench/gpu/profile_gpu.py (host time of prefill and decode per function; PROFILE_MODEL, PROFILE_PROMPT)
#   op-cost  bench/gpu/profile_gpu.py --op-cost (each op's cost inside the decode graph) for each model present
#   profile-session  bench/gpu/profile_gpu_session.py (in-process SAVE/RESTORE, per adapter call and library step)
#   trace-restore  bench/gpu/trace_engine_restore.py (a timeline of each RESTORE in fresh engines; variants
#           TRACE_VARIANTS, default "none vram-staging"; e.g. "threads=8 block=8")
#   probe-io  bench/gpu/probe_gpu_io.py (reads by 1-8 threads, XXH3, host->device copies, write+fsync)
#   tests  every tests/engine/test_gpu*.py
#   families  the GPU cases of tests/engine/test_families.py (tiny random models of each family vs transformers)
#   bench  bench/gpu/bench_gpu.py (engine vs transformers), then bench/gpu/bench_gpu_session.py
#   slots  the batched decode tests (test_gpu_model.py -k batched)
#   bench-slots  bench/gpu/bench_gpu_slots.py (step time per B op by op vs graphs; aggregate tok/s at B = 1..8)
#   parallel  bench/server/bench_parallel.py through strata-server --backend cupy (needs the server's wheels in .whl)
#   row-cost  bench/engine/probe_row_overhead.py: the engine loop's step at 1 and 8 slots, forward pass real and replaced
#   peer-build  starts building llama.cpp's llama-bench for sm_90 in the background (.gpu-carry/lcpp-src.tar.xz:
#         the llama.cpp tree of llama-cpp-python's sdist; bench/gpu/DEVICE.md says which); peer-bench waits for it, then
#         runs llama-bench (-fa 1, tg128 at 0 / 512 / 4,096 held) on each model present: $OUT/peer_<model>.json
# Model files travel in pieces under .gpu-carry/ (git-ignored) and are reassembled here, checked
# against .gpu-carry/meta/*.sha256. Output goes to $OUT/<step>.log (and the tail to stdout).
set -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
# The wheels travel once per warm machine (a later call may carry a model piece in their place).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
elif [ ! -d /tmp/site ]; then echo "no wheels carried and none installed"; exit 1; fi
export PYTHONPATH=/tmp/site:$PWD/packages/strata-sessionfile/src:$PWD/packages/strata-engine/src
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export STRATA_REFERENCE_DIR=$PWD/tests/reference
# A carried folder is replaced by the next call's carry: stash each piece outside the tree first.
mkdir -p /tmp/pieces && cp -n .gpu-carry/*.part* /tmp/pieces/ 2>/dev/null
MODELS=()
for m in smollm2 gemma3; do
  ls /tmp/pieces/$m.part* >/dev/null 2>&1 && [ -f .gpu-carry/meta/$m.sha256 ] || continue
  if [ ! -f /tmp/$m.gguf ]; then cat /tmp/pieces/$m.part* > /tmp/$m.gguf; fi
  if [ "$(sha256sum < /tmp/$m.gguf | cut -d' ' -f1)" = "$(cat .gpu-carry/meta/$m.sha256)" ]; then
    export STRATA_${m^^}_PATH=/tmp/$m.gguf; MODELS+=(--model $m=/tmp/$m.gguf); echo "model $m ok"
  else
    echo "model $m: checksum mismatch (pieces missing?)"; rm -f /tmp/$m.gguf
  fi
done
rc=0
for step in "$@"; do
  case $step in
    probe) { nvidia-smi; python3 - <<'PY'
import cupy as cp, numpy as np, time
print("cupy", cp.__version__, "device", cp.cuda.runtime.getDeviceProperties(0)["name"])
from strata_engine.ops.cupy_ops import _device_dtypes
print("compute dtypes", list(_device_dtypes(cp)))
from strata_engine.kv.device import MappedHostBuffer
b = MappedHostBuffer(1 << 30); b.host[:] = 7
int(b.device[:1024].sum()); cp.cuda.Device().synchronize(); t = time.perf_counter(); s = int(b.device.sum()); cp.cuda.Device().synchronize()
print("mapped read 1 GiB by a kernel:", s == 7 << 30, f"{(1 << 30) / (time.perf_counter() - t) / 1e9:.1f} GB/s")
d = cp.ones(1 << 30, dtype=cp.uint8); cp.cuda.Device().synchronize(); t = time.perf_counter(); int(d.sum()); cp.cuda.Device().synchronize()
print(f"device read 1 GiB: {(1 << 30) / (time.perf_counter() - t) / 1e9:.1f} GB/s")
PY
      } 2>&1 | tee "$OUT/probe.log" || rc=1 ;;
    ops) python3 -m pytest -p no:cacheprovider -q -rA tests/engine/test_gpu_ops.py 2>&1 | tee "$OUT/ops.log" || rc=1 ;;
    kernels) python3 bench/gpu/bench_gpu_kernels.py 2>&1 | tee "$OUT/kernels.log" || rc=1 ;;
    gemv) python3 bench/gpu/bench_gpu_gemv.py 2>&1 | tee "$OUT/gemv.log" || rc=1 ;;
    ops-k) python3 -m pytest -p no:cacheprovider -q -rA tests/engine/test_gpu_ops.py -k "$OPS_K" 2>&1 | tee "$OUT/ops-k.log" || rc=1 ;;
    attn) python3 bench/gpu/bench_gpu_decode_attn.py ${ATTN_ARGS:-} 2>&1 | tee "$OUT/attn.log" || rc=1 ;;
    attn-base)  # the same with the strata_engine of .gpu-carry/base (a checkout to compare against)
      PYTHONPATH=/tmp/site:$PWD/.gpu-carry/base/packages/strata-engine/src python3 bench/gpu/bench_gpu_decode_attn.py --min-tiles 4 ${ATTN_BASE_ARGS:-} 2>&1 | tee "$OUT/attn-base.log" || rc=1 ;;
    profile)  # host time of prefill and decode, per function (the first model present)
      m=${PROFILE_MODEL:-${STRATA_GEMMA3_PATH:-$STRATA_SMOLLM2_PATH}}; p=${PROFILE_PROMPT:-512}
      python3 bench/gpu/profile_gpu.py --model "$m" --prompt "$p" --dtype "${PROFILE_DTYPE:-bf16}" 2>&1 | tee "$OUT/profile-$p.log" | grep -E "ms/token|tottime|^ +[0-9]|^  [a-z(]|----" | head -60 || rc=1 ;;
    op-cost)
      [ -n "$STRATA_SMOLLM2_PATH" ] && { python3 bench/gpu/profile_gpu.py --model $STRATA_SMOLLM2_PATH --dtype f16 --op-cost 2>&1 | tee "$OUT/op-cost-smollm2.log" || rc=1; }
      [ -n "$STRATA_GEMMA3_PATH" ] && { python3 bench/gpu/profile_gpu.py --model $STRATA_GEMMA3_PATH --dtype bf16 --op-cost 2>&1 | tee "$OUT/op-cost-gemma3.log" || rc=1; } ;;
    profile-session)  # in-process SAVE/RESTORE per adapter call and library step: smollm2 random K/V, gemma3 prefilled 32K
      [ -n "$STRATA_SMOLLM2_PATH" ] && { python3 bench/gpu/profile_gpu_session.py --model $STRATA_SMOLLM2_PATH --tokens 7915 2>&1 | tee "$OUT/profile_session_smollm2.log" | grep -v "^ " || rc=1; }
      [ -n "$STRATA_GEMMA3_PATH" ] && { python3 bench/gpu/profile_gpu_session.py --model $STRATA_GEMMA3_PATH --tokens 32715 --prefill 2>&1 | tee "$OUT/profile_session_gemma3.log" | grep -v "^ " || rc=1; } ;;
    trace-restore)  # fresh engines, 3 RESTOREs each: smollm2 7,915 tokens (variants), gemma3 32,715 (device, host+ring)
      T=bench/gpu/trace_engine_restore.py
      { [ -n "$STRATA_SMOLLM2_PATH" ] && for v in ${TRACE_VARIANTS:-none vram-staging}; do
          python3 $T --model $STRATA_SMOLLM2_PATH --tokens 7915 --engines 2 --variant "$v" || rc=1; done
        [ -n "$STRATA_GEMMA3_PATH" ] && for v in ${TRACE_VARIANTS:-none vram-staging}; do
          python3 $T --model $STRATA_GEMMA3_PATH --tokens 32715 --engines 2 --variant "$v" || rc=1; done
        [ -n "$STRATA_GEMMA3_PATH" ] && { python3 $T --model $STRATA_GEMMA3_PATH --tokens 32715 --engines 1 --restores 2 \
          --args "--kv-resident 1024" || rc=1; }
      } 2>&1 | tee "$OUT/trace_restore.log" | grep -vE "^       " ;;
    probe-io) python3 bench/gpu/probe_gpu_io.py --folder /tmp 2>&1 | tee "$OUT/probe_io.log" || rc=1 ;;
    tests) python3 -m pytest -p no:cacheprovider -q -rA --durations=15 tests/engine/test_gpu_ops.py tests/engine/test_gpu_model.py tests/engine/test_gpu_session.py 2>&1 | tee "$OUT/tests.log" || rc=1 ;;
    families) python3 -m pytest -p no:cacheprovider -q -rA -m gpu tests/engine/test_families.py 2>&1 | tee "$OUT/families.log" || rc=1 ;;
    model-k) python3 -m pytest -p no:cacheprovider -q -rA tests/engine/test_gpu_model.py -k "$MODEL_K" 2>&1 | tee "$OUT/model-k.log" || rc=1 ;;
    model) python3 -m pytest -p no:cacheprovider -q -rA --durations=15 tests/engine/test_gpu_model.py 2>&1 | tee "$OUT/model.log" || rc=1 ;;
    session) python3 -m pytest -p no:cacheprovider -q -rA --durations=15 tests/engine/test_gpu_session.py 2>&1 | tee "$OUT/session.log" || rc=1 ;;
    bench)  # f16 for smollm2; gemma3 in bf16 (its residual stream overflows f16); llama-bench's figures if peer-bench ran
      [ -n "$STRATA_SMOLLM2_PATH" ] && { python3 bench/gpu/bench_gpu.py --model smollm2=$STRATA_SMOLLM2_PATH --dtype f16 --lengths 512,4096 \
        $([ -f /tmp/peer_smollm2.json ] && echo --peer smollm2=/tmp/peer_smollm2.json) ${BENCH_ARGS:-} --json "$OUT/bench_gpu_smollm2.json" 2>&1 | tee "$OUT/bench_gpu_smollm2.log" || rc=1; }
      [ -n "$STRATA_GEMMA3_PATH" ] && { python3 bench/gpu/bench_gpu.py --model gemma3=$STRATA_GEMMA3_PATH --dtype bf16 --lengths 512,4096 --long 32768 \
        $([ -f /tmp/peer_gemma3.json ] && echo --peer gemma3=/tmp/peer_gemma3.json) ${BENCH_ARGS:-} --json "$OUT/bench_gpu_gemma3.json" 2>&1 | tee "$OUT/bench_gpu_gemma3.log" || rc=1; } ;;
    slots) python3 -m pytest -p no:cacheprovider -q -rA tests/engine/test_gpu_model.py -k batched 2>&1 | tee "$OUT/slots.log" || rc=1 ;;
    bench-slots) python3 bench/gpu/bench_gpu_slots.py "${MODELS[@]}" ${SLOTS_ARGS:-} --json "$OUT/bench_gpu_slots.json" 2>&1 | tee "$OUT/bench_gpu_slots.log" || rc=1 ;;
    bench-session) python3 bench/gpu/bench_gpu_session.py "${MODELS[@]}" --json "$OUT/bench_gpu_session.json" 2>&1 | tee "$OUT/bench_gpu_session.log" || rc=1 ;;
    bench-session-quick) python3 bench/gpu/bench_gpu_session.py "${MODELS[@]}" --placements device-pool --synthetic-tokens 0 2>&1 | tee "$OUT/bench_gpu_session_quick.log" || rc=1 ;;
    parallel)  # bench/server/bench_parallel.py: concurrent HTTP clients on strata-server --backend cupy -np 8, each model present
      for m in smollm2 gemma3; do v=STRATA_${m^^}_PATH; [ -n "${!v}" ] || continue
        PYTHONPATH=$PYTHONPATH:$PWD/packages/strata-server/src python3 bench/server/bench_parallel.py --rounds ${PARALLEL_ROUNDS:-3} \
          --server-args "--backend cupy -m ${!v}" 2>&1 | tee "$OUT/bench_parallel_$m.log" || rc=1; done ;;
    row-cost)
      for m in smollm2 gemma3; do v=STRATA_${m^^}_PATH; [ -n "${!v}" ] || continue
        for run in "8 replaced" "1 --real" "8 --real"; do set -- $run; echo "$m slots $1 $2"
          python3 bench/engine/probe_row_overhead.py --model ${!v} --backend cupy --slots $1 --prompt 512 --tokens 384 \
            ${2/replaced/} 2>&1 | tail -1
        done; done 2>&1 | tee "$OUT/row-cost.log" || rc=1 ;;
    peer-build)  # in the background (setsid), so that the model pieces can travel while it compiles
      mkdir -p /tmp/lcpp && tar xJf .gpu-carry/lcpp-src.tar.xz -C /tmp/lcpp || { rc=1; continue; }
      setsid bash -c 'cd /tmp/lcpp/llama.cpp && cmake -S . -B build -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        && ninja -C build llama-bench; echo "exit $?" > /tmp/lcpp/done' > /tmp/lcpp/build.log 2>&1 < /dev/null &
      echo "llama.cpp build started" ;;
    peer-bench)
      while [ ! -f /tmp/lcpp/done ]; do sleep 5; done; tail -3 /tmp/lcpp/build.log | tee "$OUT/peer_build.log"
      for m in smollm2 gemma3; do v=STRATA_${m^^}_PATH; [ -n "${!v}" ] || continue
        /tmp/lcpp/llama.cpp/build/bin/llama-bench -m "${!v}" -ngl 99 -fa 1 -p 512 -n 128 -d 0,512,4096 -r 5 -o json \
          > /tmp/peer_$m.json 2> "$OUT/peer_$m.err" || { rc=1; tail -5 "$OUT/peer_$m.err"; }
        cp /tmp/peer_$m.json "$OUT/"
        python3 -c "import json,sys; [print('$m', r['n_prompt'], r['n_gen'], r['n_depth'], round(r['avg_ts'], 1)) for r in json.load(open(sys.argv[1]))]" /tmp/peer_$m.json
      done ;;
    *) echo "unknown step $step"; rc=2 ;;
  esac
done
exit $rc
